//! Build step of the TrainingJob controller: the desired children of a validated job, as
//! typed Kubernetes objects. Pure: no client, no clock; the SSH key's seed comes in from
//! outside.
//!
//! One file per kind of child: `pods` (workers and launcher, with the volumes Ringmaster
//! reserves in them from `volumes`: [`reserved_volumes`]), `service` and its
//! `endpoint_slice`, `secret`,
//! `network_policy` and `pod_group`, and the pods' security contexts in `security`. All that
//! differs between MPI implementations is in `mpi`.

mod endpoint_slice;
mod mpi;
mod network_policy;
mod pod_group;
mod pods;
mod progress;
mod secret;
mod security;
mod service;
mod volumes;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::EnvVar;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use ringmaster_contract::trainer as trainer_contract;

pub use self::endpoint_slice::worker_endpoints;
pub use self::mpi::{hostfile, launcher_command};
pub use self::network_policy::network_policy;
pub use self::pod_group::{pod_group, volcano_pod_group};
pub use self::pods::{launcher_pod, reserved_ports, worker_pod};
pub use self::secret::{RendezvousKey, SshKeys, ssh_secret};
pub use self::security::{POD_FS_GROUP, PodSecurity, RDMA_CAPABILITY, pod_security};
pub use self::service::worker_service;
pub use self::volumes::{PodRole, reserved_volumes};
use super::names::{self, ChildNaming, RENDEZVOUS_PORT, SSH_MOUNT, SSH_SECRET_MOUNT};
use super::spec::{Program, TrainerSettings, ValidatedTrainingJob};
use super::state::Placement;
use crate::gang::GangScheduler;

/// The hostfile's name under [`names::HOSTFILE_MOUNT`].
pub const HOSTFILE: &str = "hostfile";
/// The ssh program's name under [`names::HOSTFILE_MOUNT`] (Hydra runs it to reach workers).
pub const SSH_PROGRAM: &str = "ssh";
/// The file under [`SSH_MOUNT`] that pins the job's host key for every ssh: the workers'
/// sshd serves the job's key as its host key ([`SshKeys`]), so the line is `* <public key>`.
pub const KNOWN_HOSTS: &str = "known_hosts";
/// The launcher's variable with its own pod IP (downward API).
pub const LAUNCHER_IP_ENV: &str = "RINGMASTER_LAUNCHER_IP";

/// NCCL and UCX settings for InfiniBand on Azure ND-series VMs; `infiniband.env` overrides them.
pub const DEFAULT_IB_ENV: &[(&str, &str)] = &[
    ("NCCL_IB_DISABLE", "0"),
    ("NCCL_IB_PCI_RELAXED_ORDERING", "1"),
    ("NCCL_SOCKET_IFNAME", "eth0"),
    ("NCCL_DEBUG", "WARN"),
    ("UCX_TLS", "rc"),
    ("UCX_NET_DEVICES", "mlx5_ib0:1"),
];

/// What the build needs beyond the spec: the gang attempt, the resolved DataStage claim and
/// what a Kueue admission adds to the pods.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BuildInputs {
    /// The gang attempt (the job's restart count).
    pub attempt: i32,
    /// The claim of the referenced DataStage, once it is Ready.
    pub data_claim: Option<String>,
    /// The admitted flavors' node selectors and tolerations (empty unless queued in Kueue).
    pub placement: Placement,
    /// The gang scheduler (`--gang-scheduler`): the pods are scheduled by it, in the job's
    /// [`pod_group`] (or [`volcano_pod_group`]). `None`: the cluster's default scheduler, one
    /// pod at a time.
    pub gang_scheduler: Option<GangScheduler>,
    /// How the gang's pods name the Secret and Service (from its pods: [`ChildNaming::of_gang`]).
    pub naming: ChildNaming,
    /// The PriorityClass of launchers that set none (`--launcher-priority-class`): see
    /// [`launcher_pod`].
    pub launcher_priority_class: Option<String>,
    /// Give the job its [`network_policy`] (`--job-network-policies`, on by default).
    pub network_policy: bool,
    /// Where the launcher reports progress (`--progress-url`); none: it does not.
    pub progress: Option<crate::report::ProgressEndpoint>,
}

/// The job as the controlling owner of its children (pods, Secret, Service, Workload,
/// PodGroup).
pub fn owner_reference(job: &ValidatedTrainingJob) -> OwnerReference {
    OwnerReference {
        api_version: format!("{}/{}", crate::api::GROUP, crate::api::VERSION),
        kind: "TrainingJob".into(),
        name: job.name.clone(),
        uid: job.uid.clone(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

/// The metadata of a child named `name`: in the job's namespace, with `labels`, owned by the
/// job.
fn metadata(
    job: &ValidatedTrainingJob,
    name: String,
    labels: BTreeMap<String, String>,
) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: Some(job.namespace.clone()),
        labels: Some(labels),
        owner_references: Some(vec![owner_reference(job)]),
        ..ObjectMeta::default()
    }
}

/// The options every ssh from the launcher (and the readiness probe, and Open MPI's daemons
/// on the workers) uses: the job's port and key, and the job's key as the only host key it
/// accepts ([`KNOWN_HOSTS`], which each container writes before it starts: see
/// [`pods::known_hosts_script`]). A host that shows another key is refused, never asked
/// about.
fn ssh_options(job: &ValidatedTrainingJob) -> String {
    format!(
        "-p {} -i {SSH_MOUNT}/ssh-privatekey -o StrictHostKeyChecking=yes -o UserKnownHostsFile={SSH_MOUNT}/{KNOWN_HOSTS} -o GlobalKnownHostsFile=/dev/null -o LogLevel=ERROR -o BatchMode=yes",
        job.mpi.ssh_port
    )
}

/// `ssh` with the job's settings, as a program: Hydra (MPICH, Intel MPI) takes the path of
/// the program it launches with, not a command line.
pub fn ssh_program(job: &ValidatedTrainingJob) -> String {
    format!(
        "#!/bin/sh\n# ssh as the MPI launcher uses it: the job's port and key, the job's host key pinned.\nexec ssh {} \"$@\"\n",
        ssh_options(job)
    )
}

/// A variable with a plain value.
fn env_var(name: impl Into<String>, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        value_from: None,
    }
}

/// Environment every rank needs. Ranks are started by sshd, which passes no container
/// environment on, so the launcher holds these and mpirun forwards them.
fn rank_env(job: &ValidatedTrainingJob, naming: ChildNaming) -> Vec<EnvVar> {
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    env.insert("RINGMASTER_JOB".into(), job.name.clone());
    // The trainer resumes only from checkpoints written under this run's id: a job made
    // anew under the same name starts from the beginning.
    env.insert(trainer_contract::RUN_ID_ENV.into(), job.uid.clone());
    env.insert(
        trainer_contract::RENDEZVOUS_ENV.into(),
        format!("{}:{RENDEZVOUS_PORT}", names::worker_host(job, naming, 0)),
    );
    // Read from the mounted Secret: the key itself is in no pod's spec. A Secret an older
    // operator made has no such file, and the trainer then goes without a key.
    env.insert(
        trainer_contract::RENDEZVOUS_KEY_FILE_ENV.into(),
        format!("{SSH_SECRET_MOUNT}/{}", trainer_contract::RENDEZVOUS_KEY),
    );
    if matches!(job.program, Program::Command(_)) {
        // The user's framework finds rank 0 where our trainer's rendezvous would be (the
        // job's NetworkPolicy admits the job's own pods to any port).
        env.insert("MASTER_ADDR".into(), names::worker_host(job, naming, 0));
        env.insert("MASTER_PORT".into(), RENDEZVOUS_PORT.to_string());
    }
    if let Some(ib) = &job.infiniband {
        for (k, v) in DEFAULT_IB_ENV {
            env.insert((*k).into(), (*v).into());
        }
        env.extend(ib.env.clone());
    }
    env.into_iter()
        .map(|(name, value)| env_var(name, value))
        .collect()
}

/// The names of the worker environment's entries that each worker resolves for itself: every
/// `valueFrom` but a Secret's or ConfigMap's key (`fieldRef`: the pod's name, IP or node;
/// `resourceFieldRef`: its container's limits; `fileKeyRef`: a file in the pod), and plain
/// values that refer to other variables (`$(NAME)`). The launcher's values would be wrong on
/// every rank, so these reach the ranks through each worker's sshd (see the worker's
/// command in [`worker_pod`]), not mpirun. Names that are not shell identifiers cannot be
/// read by the worker's shell and stay with the launcher.
pub fn per_pod_env_names(job: &ValidatedTrainingJob) -> Vec<String> {
    let identifier = |name: &str| {
        name.chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    job.worker
        .env
        .iter()
        .filter(|e| match &e.value_from {
            Some(from) => from.secret_key_ref.is_none() && from.config_map_key_ref.is_none(),
            None => e.value.as_deref().is_some_and(|v| v.contains("$(")),
        })
        .map(|e| e.name.clone())
        .filter(|name| identifier(name))
        .fold(Vec::new(), |mut names, name| {
            if !names.contains(&name) {
                names.push(name);
            }
            names
        })
}

/// The variables of the launcher container's spec that every rank needs: Ringmaster's own and
/// the user's worker environment.
fn spec_env_names(job: &ValidatedTrainingJob) -> Vec<String> {
    // Only the variables' names: any naming gives the same.
    let mut names: Vec<String> = rank_env(job, ChildNaming::default())
        .into_iter()
        .map(|e| e.name)
        .collect();
    names.extend(job.worker.env.iter().map(|e| e.name.clone()));
    // Each worker sets these for its own ranks, Ringmaster's own names among them when the
    // worker environment sets them per pod.
    let per_pod = per_pod_env_names(job);
    names.retain(|name| !per_pod.contains(name));
    names
}

/// Variables the image sets that the ranks need too.
const IMAGE_ENV: [&str; 2] = ["PATH", "LD_LIBRARY_PATH"];

/// [`IMAGE_ENV`] but for a name the worker environment sets per pod.
fn image_env(job: &ValidatedTrainingJob) -> Vec<String> {
    let per_pod = per_pod_env_names(job);
    IMAGE_ENV
        .iter()
        .map(|name| name.to_string())
        .filter(|name| !per_pod.contains(name))
        .collect()
}

/// `ringmaster-trainer train ...` with the job's settings (the typed invocation validate
/// made and checked, then the user's extra flags).
pub fn trainer_args(t: &TrainerSettings) -> Vec<String> {
    let mut args: Vec<String> = vec![names::TRAINER_BINARY.into(), "train".into()];
    args.extend(t.flags());
    args
}

/// `args` as owned strings.
fn strings<const N: usize>(args: [&str; N]) -> Vec<String> {
    args.map(String::from).to_vec()
}
