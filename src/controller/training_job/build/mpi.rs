//! Everything that differs between the MPI implementations a job may name: the hostfile's
//! lines and the launcher's command (its program, how it is given the hostfile and the
//! process count, how it reaches the workers over ssh, how it forwards the environment to
//! the ranks). Another implementation is a variant of [`MpiImplementation`] and an arm in
//! each `match` of this file: [`hostfile_line`] and [`mpi_launcher`].

use super::{
    HOSTFILE, LAUNCHER_IP_ENV, SSH_PROGRAM, image_env, spec_env_names, ssh_options, strings,
    trainer_args,
};
use crate::api::MpiImplementation;
use crate::controller::training_job::names::{self, ChildNaming};
use crate::controller::training_job::spec::{Program, ValidatedTrainingJob};

/// The per-rank variables PyTorch's `init_process_group("env://")`, Horovod and most
/// frameworks read, from what each MPI gives its ranks (Open MPI's `OMPI_COMM_WORLD_*`,
/// Hydra's `PMI_*` and `MPI_LOCAL*`, PMIx's `PMIX_RANK`); a value the user set stays. The
/// shared ones (`MASTER_ADDR`, `MASTER_PORT`) travel with the job's environment. Only
/// `/bin/sh` is needed in the image.
pub const FRAMEWORK_ENV_SCRIPT: &str = concat!(
    r#"export RANK="${RANK:-${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${PMIX_RANK:-0}}}}" "#,
    r#"WORLD_SIZE="${WORLD_SIZE:-${OMPI_COMM_WORLD_SIZE:-${PMI_SIZE:-1}}}" "#,
    r#"LOCAL_RANK="${LOCAL_RANK:-${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-0}}}" "#,
    r#"LOCAL_WORLD_SIZE="${LOCAL_WORLD_SIZE:-${OMPI_COMM_WORLD_LOCAL_SIZE:-${MPI_LOCALNRANKS:-1}}}"; "#,
    r#"exec "$@""#,
);

/// `ringmaster-trainer launch` and its arguments, before the MPI launcher's command: it
/// reports the ranks' progress lines and writes the summary line or the failure (the
/// contract's failure line, else a Python exception's line) to the termination message.
const TRAINER_LAUNCH: [&str; 5] = [
    names::TRAINER_BINARY,
    "launch",
    "--termination-message",
    "/dev/termination-log",
    "--",
];

/// The launcher of a user's program: [`TRAINER_LAUNCH`] over the MPI launcher when the image
/// has the trainer, else the MPI launcher alone, said once on stderr. Decided in the pod,
/// where the image is.
fn launch_if_present_script() -> String {
    let trainer = names::TRAINER_BINARY;
    let launch = TRAINER_LAUNCH.join(" ");
    format!(
        r#"if command -v {trainer} >/dev/null 2>&1; then exec {launch} "$@"; fi; echo "ringmaster: this image has no {trainer} on its PATH: the job shows no progress, result or exception line, only the log's tail (see the image contract in the README)" >&2; exec "$@""#
    )
}

/// The name the launcher's wrapper script runs under (its `$0`).
pub const LAUNCHER_SCRIPT_NAME: &str = "ringmaster-launcher";

/// The user's program, run by each rank through [`FRAMEWORK_ENV_SCRIPT`].
fn with_framework_env(user: &[String]) -> Vec<String> {
    let mut command = strings(["sh", "-c", FRAMEWORK_ENV_SCRIPT, "ringmaster-rank"]);
    command.extend(user.iter().cloned());
    command
}

/// A worker's hostfile line: its DNS name and how many ranks it runs.
fn hostfile_line(mpi: MpiImplementation, host: &str, slots: u32) -> String {
    match mpi {
        MpiImplementation::OpenMPI => format!("{host} slots={slots}\n"),
        MpiImplementation::IntelMPI | MpiImplementation::MPICH => format!("{host}:{slots}\n"),
    }
}

/// What the launcher's command is made of, whichever the MPI: each implementation's
/// [`mpi_launcher`] arm puts it in its own flags.
struct Launch {
    /// The hostfile's path.
    hostfile: String,
    /// How many ranks, over all workers.
    processes: String,
    /// ssh's options (port, key, no host-key prompts), for a launcher that takes them.
    ssh_options: String,
    /// The path of [`super::ssh_program`], for a launcher that takes a program.
    ssh_program: String,
    /// The launcher's own address, for a launcher whose workers call back to it: its pod IP,
    /// which the kubelet substitutes for `$(VAR)` in the command.
    launcher_address: String,
    /// Variables of the launcher container's spec that every rank needs.
    spec_env: Vec<String>,
    /// Variables of the image that every rank needs.
    image_env: Vec<String>,
}

/// The MPI launcher and its arguments, before the user's extra arguments and the program.
fn mpi_launcher(mpi: MpiImplementation, launch: &Launch) -> Vec<String> {
    match mpi {
        MpiImplementation::OpenMPI => open_mpi(launch),
        MpiImplementation::IntelMPI => hydra(launch, "mpirun", "-bootstrap"),
        // Hydra by its own name: where Open MPI is installed too (Debian with both), plain
        // `mpiexec` is Open MPI's.
        MpiImplementation::MPICH => hydra(launch, "mpiexec.hydra", "-launcher"),
    }
}

/// Open MPI's `mpirun`: ssh with the job's options, every variable forwarded with `-x`.
fn open_mpi(launch: &Launch) -> Vec<String> {
    let mut command = strings([
        "mpirun",
        "--hostfile",
        &launch.hostfile,
        "-np",
        &launch.processes,
        "--map-by",
        "slot",
        "--bind-to",
        "none",
        "--mca",
        "plm_rsh_args",
        &launch.ssh_options,
        // Open MPI shortens hostfile names to their first label unless told not to, and a
        // worker's short name resolves nowhere (only `pod.service.namespace.svc` does).
        "--mca",
        "orte_keep_fqdn_hostnames",
        "1",
    ]);
    for name in launch.spec_env.iter().chain(&launch.image_env) {
        command.extend(["-x".to_string(), name.clone()]);
    }
    command
}

/// A Hydra launcher (MPICH's, Intel MPI's): `program`, ssh through the ssh program given
/// with `{launcher}-exec`, and the environment through [`hydra_env_flags`]. Hydra's proxies
/// call back to the launcher by the name it gives them, its host name by default, which no
/// DNS resolves (only workers are in the Service): its address instead (`-localhost`).
fn hydra(launch: &Launch, program: &str, launcher: &str) -> Vec<String> {
    let mut command = strings([
        program,
        "-f",
        &launch.hostfile,
        "-n",
        &launch.processes,
        "-localhost",
        &launch.launcher_address,
        launcher,
        "ssh",
        &format!("{launcher}-exec"),
        &launch.ssh_program,
    ]);
    command.extend(hydra_env_flags(launch));
    command
}

/// Hydra's environment flags: `-genv NAME $(NAME)` for each variable of the container's spec
/// (the kubelet puts in the value), then `-genvlist` for the image's. Hydra 4.0's
/// `-genvlist` silently drops some names (RINGMASTER_RENDEZVOUS among them, seen on the
/// real node) while `-genv` sets every one.
fn hydra_env_flags(launch: &Launch) -> Vec<String> {
    let mut flags = Vec::new();
    for name in &launch.spec_env {
        flags.extend(["-genv".to_string(), name.clone(), format!("$({name})")]);
    }
    if launch.image_env.is_empty() {
        // Every image variable is set per pod: nothing from the launcher's environment.
        flags.push("-genvnone".to_string());
    } else {
        flags.extend(["-genvlist".to_string(), launch.image_env.join(",")]);
    }
    flags
}

/// The hostfile in the chosen MPI's format, one line per worker.
pub fn hostfile(job: &ValidatedTrainingJob, naming: ChildNaming) -> String {
    (0..job.workers)
        .map(|i| {
            let host = names::worker_host(job, naming, i);
            hostfile_line(job.mpi.implementation, &host, job.slots_per_worker)
        })
        .collect()
}

/// The launcher's command: the MPI launcher with the process count, hostfile, ssh settings
/// and forwarded environment, then the program. The trainer's own launcher wrapper turns
/// rank 0's summary into the pod's termination message; a user's program gets it too when
/// its image has it ([`launch_if_present_script`]).
pub fn launcher_command(job: &ValidatedTrainingJob) -> Vec<String> {
    let launch = Launch {
        hostfile: format!("{}/{HOSTFILE}", names::HOSTFILE_MOUNT),
        processes: job.world_size().to_string(),
        ssh_options: ssh_options(job),
        ssh_program: format!("{}/{SSH_PROGRAM}", names::HOSTFILE_MOUNT),
        launcher_address: format!("$({LAUNCHER_IP_ENV})"),
        spec_env: spec_env_names(job),
        image_env: image_env(job),
    };
    let mut command = mpi_launcher(job.mpi.implementation, &launch);
    command.extend(job.mpi.extra_args.iter().cloned());
    match &job.program {
        Program::Command(user) => {
            command.extend(with_framework_env(user));
            let script = launch_if_present_script();
            let mut wrapped = strings(["sh", "-c", script.as_str(), LAUNCHER_SCRIPT_NAME]);
            wrapped.extend(command);
            wrapped
        }
        Program::Trainer(settings) => {
            command.extend(trainer_args(settings));
            let mut wrapped = strings(TRAINER_LAUNCH);
            wrapped.extend(command);
            wrapped
        }
    }
}
