//! The worker and launcher pods of a gang, with the user's overrides and a Kueue admission's
//! placement merged in.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EnvVar, EnvVarSource, ExecAction, ObjectFieldSelector, Pod, PodSpec,
    Probe, ResourceRequirements, Toleration, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::pod_group::join_gang;
use super::security::{PodSecurity, added_container_security, pod_security};
use super::volumes::{PodRole, reserved_volumes};
use super::{
    BuildInputs, KNOWN_HOSTS, LAUNCHER_IP_ENV, env_var, hostfile, launcher_command, metadata,
    per_pod_env_names, rank_env, ssh_options, ssh_program, strings,
};
use crate::api::PodOverrides;
use crate::controller::training_job::names::{
    self, ChildNaming, LAUNCHER_ROLE, RENDEZVOUS_PORT, SSH_MOUNT, SSH_SECRET_MOUNT, WORKER_ROLE,
};
use crate::controller::training_job::spec::ValidatedTrainingJob;
use crate::controller::training_job::state::PodPlacement;

/// Worker pod `index` of gang `inputs.attempt`: sshd on the job's port, ready when it is
/// reachable over ssh under its DNS name, with GPUs, RDMA, shared memory and data mounted.
pub fn worker_pod(job: &ValidatedTrainingJob, index: u32, inputs: &BuildInputs) -> Pod {
    let name = names::worker_pod(&job.name, index);
    let mut labels = names::pod_labels(job, inputs.naming, WORKER_ROLE, inputs.attempt);
    labels.insert(names::WORKER_INDEX_LABEL.into(), index.to_string());
    let (volumes, mounts) = reserved_volumes(
        job,
        PodRole::Worker,
        inputs.naming,
        inputs.data_claim.as_deref(),
    )
    .into_iter()
    .unzip();
    let (node_selector, tolerations) = worker_placement(job);
    let security = pod_security(job, PodRole::Worker, &job.worker);
    let mut container = worker_container(job, index, inputs.naming, mounts);
    container.security_context = Some(security.container);
    let spec = PodSpec {
        hostname: Some(name.clone()),
        subdomain: Some(names::worker_service(job, inputs.naming)),
        security_context: Some(security.pod),
        node_selector: Some(node_selector),
        tolerations: Some(tolerations),
        volumes: Some(volumes),
        containers: vec![container],
        ..training_pod_spec()
    };
    finish(
        PodRole::Worker,
        metadata(job, name, labels),
        spec,
        job,
        inputs,
    )
}

/// The pod of `role` with what others add to it, each over the ones before: the user's
/// overrides, a Kueue admission's placement, the gang scheduler's group.
fn finish(
    role: PodRole,
    metadata: ObjectMeta,
    spec: PodSpec,
    job: &ValidatedTrainingJob,
    inputs: &BuildInputs,
) -> Pod {
    let (overrides, placement) = match role {
        PodRole::Worker => (&job.worker, &inputs.placement.workers),
        PodRole::Launcher => (&job.launcher, &inputs.placement.launcher),
    };
    let mut pod = Pod {
        metadata,
        spec: Some(spec),
        status: None,
    };
    merge_overrides(&mut pod, overrides);
    place(&mut pod, placement);
    join_gang(&mut pod, job, inputs);
    pod
}

/// What the pods of a training job share: they run once, never call the API server (no
/// token to steal, and smaller pods), and get no variable per Service of the namespace (a
/// namespace with a thousand jobs has a thousand Services).
fn training_pod_spec() -> PodSpec {
    PodSpec {
        restart_policy: Some("Never".into()),
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        ..PodSpec::default()
    }
}

/// Worker `index`'s container: sshd, with the job's GPUs and RDMA devices and the ranks'
/// environment, ready once the worker's own DNS name answers over ssh.
fn worker_container(
    job: &ValidatedTrainingJob,
    index: u32,
    naming: ChildNaming,
    mounts: Vec<VolumeMount>,
) -> Container {
    let port = job.mpi.ssh_port;
    let host = names::worker_host(job, naming, index);
    let limits = worker_devices(job);
    let per_pod_env = per_pod_env_names(job);
    Container {
        // The controller reads this container's state by its name (observe.rs).
        name: WORKER_ROLE.into(),
        image: Some(job.image.clone()),
        command: Some(worker_with_private_ssh_keys(
            sshd_command(port, !per_pod_env.is_empty()),
            &per_pod_env,
        )),
        ports: Some(reserved_ports(job, PodRole::Worker)),
        readiness_probe: Some(Probe {
            exec: Some(ExecAction {
                command: Some(strings([
                    "sh",
                    "-c",
                    &format!("ssh {} {host} true", ssh_options(job)),
                ])),
            }),
            period_seconds: Some(5),
            timeout_seconds: Some(4),
            ..Probe::default()
        }),
        // sshd's own words (a port it cannot bind, a key it refuses) reach the job's status
        // when the worker exits.
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        resources: Some(ResourceRequirements {
            limits: Some(limits),
            ..ResourceRequirements::default()
        }),
        env: Some(rank_env(job, naming)),
        volume_mounts: Some(mounts),
        ..Container::default()
    }
}

/// The ports Ringmaster lists on the main container of `role`'s pod: a worker's sshd (`ssh`,
/// `mpi.sshPort`) and the trainers' rendezvous (`rendezvous`, [`RENDEZVOUS_PORT`]); none
/// on the launcher. The user's `ports` must differ from them in name and number.
pub fn reserved_ports(job: &ValidatedTrainingJob, role: PodRole) -> Vec<ContainerPort> {
    let container_port = |name: &str, port: i32| ContainerPort {
        name: Some(name.into()),
        container_port: port,
        ..ContainerPort::default()
    };
    match role {
        PodRole::Worker => vec![
            container_port("ssh", job.mpi.ssh_port),
            container_port("rendezvous", RENDEZVOUS_PORT.into()),
        ],
        PodRole::Launcher => Vec::new(),
    }
}

/// A worker's device limits: its GPUs and RDMA devices (whose capability, IPC_LOCK, is in
/// its security context: [`pod_security`]).
fn worker_devices(job: &ValidatedTrainingJob) -> BTreeMap<String, Quantity> {
    let mut limits = BTreeMap::new();
    if job.gpus_per_worker > 0 {
        limits.insert(
            crate::api::GPU_RESOURCE.into(),
            Quantity(job.gpus_per_worker.to_string()),
        );
    }
    if let Some(ib) = &job.infiniband {
        limits.insert(
            ib.rdma_resource.clone(),
            Quantity(ib.rdma_resource_count.to_string()),
        );
    }
    limits
}

/// A worker's node selector and tolerations: the node pool's labels, and its own AKS pool's.
fn worker_placement(job: &ValidatedTrainingJob) -> (BTreeMap<String, String>, Vec<Toleration>) {
    let mut node_selector = BTreeMap::new();
    let mut tolerations = Vec::new();
    if let Some(pool) = &job.node_pool {
        node_selector.extend(pool.node_selector.clone());
        if let Some((selector, toleration)) = own_pool_placement(job) {
            node_selector.extend(selector);
            tolerations.push(toleration);
        }
    }
    (node_selector, tolerations)
}

/// sshd in the foreground, logging to stderr, with the job's key as its host key (which
/// every ssh of the job pins: [`known_hosts_script`]) and the job's public key as the only
/// one it accepts. `StrictModes=no`: the folders above the key
/// copies are volume mounts the user does not own (sshd would refuse them otherwise); the
/// copies themselves are the user's own, mode 0600. `UsePAM=no` lets it run as any user.
/// `user_environment`: the `environment=` options of `authorized_keys` are honoured
/// ([`worker_with_private_ssh_keys`]). sshd is found in the image ([`FIND_SSHD_SCRIPT`]).
fn sshd_command(port: i32, user_environment: bool) -> Vec<String> {
    let mut command = strings([
        "sh",
        "-c",
        FIND_SSHD_SCRIPT,
        "ringmaster-sshd",
        "-D",
        "-e",
        "-p",
        &port.to_string(),
        "-h",
        &format!("{SSH_MOUNT}/ssh-privatekey"),
        "-o",
        &format!("AuthorizedKeysFile={SSH_MOUNT}/authorized_keys"),
        "-o",
        "StrictModes=no",
        "-o",
        "PidFile=/tmp/sshd.pid",
        "-o",
        "UsePAM=no",
    ]);
    if user_environment {
        command.extend(strings(["-o", "PermitUserEnvironment=yes"]));
    }
    command
}

/// Where a worker looks for sshd: `RINGMASTER_SSHD` when the worker's environment sets it
/// (and only there), else `/usr/sbin`, `/usr/local/sbin`, `/sbin` and the `PATH`, in that
/// order; run by its absolute path, which sshd needs to re-execute itself. No sshd: the
/// worker stops with words that say so, which the job shows. Backquotes, not `$(`: the
/// kubelet would take that for a variable to substitute.
pub const FIND_SSHD_SCRIPT: &str = concat!(
    r#"if [ -n "${RINGMASTER_SSHD:-}" ]; then sshd=$RINGMASTER_SSHD; "#,
    r#"else for sshd in /usr/sbin/sshd /usr/local/sbin/sshd /sbin/sshd `command -v sshd` ''; do [ -x "$sshd" ] && break; done; fi; "#,
    r#"if [ -z "$sshd" ] || [ ! -x "$sshd" ]; then "#,
    r#"echo "ringmaster: no sshd ${RINGMASTER_SSHD:+at $RINGMASTER_SSHD (RINGMASTER_SSHD) }in this image (looked in /usr/sbin, /usr/local/sbin, /sbin and the PATH unless RINGMASTER_SSHD is set): the launcher starts the ranks over ssh, so a worker's image needs OpenSSH's server (Debian's and Ubuntu's openssh-server)" >&2; exit 127; fi; "#,
    r#"exec "$sshd" "$@""#,
);

/// `command` run after the container's own user has copied the SSH key and
/// `authorized_keys` into [`SSH_MOUNT`], readable by that user alone, and written the
/// job's [`KNOWN_HOSTS`] there ([`known_hosts_script`]). Whoever the image runs as (root, or
/// a user that reads the Secret through `fsGroup`), the copies are its own with mode 0600,
/// which ssh, sshd and the readiness probe accept.
fn with_private_ssh_keys(command: Vec<String>) -> Vec<String> {
    let prepare = format!(
        "umask 077 && cp {SSH_SECRET_MOUNT}/ssh-privatekey {SSH_SECRET_MOUNT}/authorized_keys {SSH_MOUNT}/ && {} && exec \"$@\"",
        known_hosts_script()
    );
    shell_then(prepare, command)
}

/// Writes [`KNOWN_HOSTS`] into [`SSH_MOUNT`]: `* ` and the job's public key, the host key
/// of every worker's sshd ([`sshd_command`]), for any host name and port. Made from the
/// Secret's public key, which every job's Secret has, those of older operators too.
pub(super) fn known_hosts_script() -> String {
    format!(
        "{{ printf '* ' && cat {SSH_SECRET_MOUNT}/ssh-publickey && echo; }} > {SSH_MOUNT}/{KNOWN_HOSTS}"
    )
}

/// A worker's [`with_private_ssh_keys`]: when the worker environment has entries each worker
/// resolves for itself ([`per_pod_env_names`]), its `authorized_keys` copy starts with an
/// `environment="NAME=value"` option per entry, holding this container's value (`"` escaped,
/// line breaks dropped; a value ending in `\` stops the container with a message, as sshd
/// would read it as an escaped quote; an unset one is left out), so that sshd, run with
/// `PermitUserEnvironment`, sets them in every session the job's key opens: the ranks'. Any
/// OpenSSH reads these options. [`KNOWN_HOSTS`] is written as by [`with_private_ssh_keys`]. Values come from `printenv`, not the shell's variables (the
/// script's own are `_rm_*`), and command substitution is written with backquotes: the
/// kubelet would take `$(` for a variable to substitute.
fn worker_with_private_ssh_keys(command: Vec<String>, per_pod_env: &[String]) -> Vec<String> {
    if per_pod_env.is_empty() {
        return with_private_ssh_keys(command);
    }
    let prepare = r#"umask 077 && cp SECRET/ssh-privatekey OWN/ && { _rm_sep=; for _rm_n in NAMES; do _rm_v=`printenv "$_rm_n"` || continue; _rm_v=`printf '%s' "$_rm_v" | tr -d '\n'`; case "$_rm_v" in *'\') echo "ringmaster: the value of $_rm_n ends with a backslash, which sshd cannot take" >&2; exit 1;; esac; printf '%senvironment="%s=' "$_rm_sep" "$_rm_n"; printf '%s' "$_rm_v" | sed 's/"/\\"/g'; printf '"'; _rm_sep=,; done; printf ' '; cat SECRET/authorized_keys; } > OWN/authorized_keys && PIN_HOST_KEY && exec "$@""#
        .replace("SECRET", SSH_SECRET_MOUNT)
        .replace("OWN", SSH_MOUNT)
        .replace("PIN_HOST_KEY", &known_hosts_script())
        // Last: the names are the user's, and no placeholder in them is one.
        .replace("NAMES", &per_pod_env.join(" "));
    shell_then(prepare, command)
}

/// `sh -c prepare` that then runs `command` (the script ends with `exec "$@"`).
fn shell_then(prepare: String, command: Vec<String>) -> Vec<String> {
    let mut wrapped = vec!["sh".into(), "-c".into(), prepare, "sh".into()];
    wrapped.extend(command);
    wrapped
}

/// The node selector and toleration that put a pod on the job's own AKS pool.
fn own_pool_placement(
    job: &ValidatedTrainingJob,
) -> Option<(BTreeMap<String, String>, Toleration)> {
    let pool_name = job.node_pool.as_ref()?.pool_name.as_ref()?;
    let selector = BTreeMap::from([(
        crate::controller::training_job::names::AGENT_POOL_LABEL.to_string(),
        pool_name.clone(),
    )]);
    let toleration = Toleration {
        key: Some(crate::controller::training_job::names::POOL_KEY.into()),
        operator: Some("Equal".into()),
        value: Some(pool_name.clone()),
        effect: Some("NoSchedule".into()),
        toleration_seconds: None,
    };
    Some((selector, toleration))
}

/// The launcher pod of gang `inputs.attempt`: runs the MPI launcher over the hostfile.
pub fn launcher_pod(job: &ValidatedTrainingJob, inputs: &BuildInputs) -> Pod {
    let security = pod_security(job, PodRole::Launcher, &job.launcher);
    let (mut volumes, mut mounts): (Vec<_>, Vec<_>) =
        reserved_volumes(job, PodRole::Launcher, inputs.naming, None)
            .into_iter()
            .unzip();
    let mut env = launcher_env(job, inputs, &security);
    if let Some((report_env, volume, mount)) = super::progress::launcher_reporting(job, inputs) {
        env.extend(report_env);
        volumes.push(volume);
        mounts.push(mount);
    }
    // A job with its own pool runs its launcher there too: it needs no other capacity.
    let (node_selector, tolerations) = own_pool_placement(job)
        .map(|(selector, toleration)| (selector, vec![toleration]))
        .unwrap_or_default();
    let labels = names::pod_labels(job, inputs.naming, LAUNCHER_ROLE, inputs.attempt);
    let spec = PodSpec {
        node_selector: Some(node_selector),
        tolerations: Some(tolerations),
        volumes: Some(volumes),
        containers: vec![Container {
            name: LAUNCHER_ROLE.into(),
            image: Some(job.image.clone()),
            command: Some(with_private_ssh_keys(launcher_command(job))),
            env: Some(env),
            volume_mounts: Some(mounts),
            termination_message_policy: Some("FallbackToLogsOnError".into()),
            security_context: Some(security.container),
            ..Container::default()
        }],
        security_context: Some(security.pod),
        // The launcher is made once every worker is ready, so it enters the scheduler's
        // queue behind every pod made meanwhile: when many jobs start at once, each one's
        // ready workers (and their GPUs) idle until the whole backlog is placed. A class
        // above the workers' puts it first; the chart's does not preempt. Gang schedulers
        // order their own groups, and the launcher joins one already placed.
        priority_class_name: inputs
            .launcher_priority_class
            .clone()
            .filter(|_| inputs.gang_scheduler.is_none()),
        ..training_pod_spec()
    };
    let meta = ObjectMeta {
        annotations: Some(BTreeMap::from([
            (
                names::HOSTFILE_ANNOTATION.into(),
                hostfile(job, inputs.naming),
            ),
            (names::SSH_PROGRAM_ANNOTATION.into(), ssh_program(job)),
        ])),
        ..metadata(job, names::launcher_pod(&job.name, inputs.attempt), labels)
    };
    finish(PodRole::Launcher, meta, spec, job, inputs)
}

/// The launcher's environment: what every rank needs, then the user's worker environment
/// (which reaches the ranks through the launcher too), then the launcher's own: its pod IP,
/// and Open MPI's consent to run as root when the launcher may (`security`: Open MPI's
/// `mpirun` refuses root without it).
fn launcher_env(
    job: &ValidatedTrainingJob,
    inputs: &BuildInputs,
    security: &PodSecurity,
) -> Vec<EnvVar> {
    let mut env = rank_env(job, inputs.naming);
    // But for the entries each worker resolves for itself (resolved here, they could name a
    // container or a file the launcher does not have).
    let per_pod = per_pod_env_names(job);
    env.extend(
        job.worker
            .env
            .iter()
            .filter(|e| !per_pod.contains(&e.name))
            .cloned(),
    );
    let as_root = security.may_run_as_root();
    if as_root {
        env.push(env_var("OMPI_ALLOW_RUN_AS_ROOT", "1"));
    }
    env.push(EnvVar {
        name: LAUNCHER_IP_ENV.into(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                api_version: None,
                field_path: "status.podIP".into(),
            }),
            ..EnvVarSource::default()
        }),
    });
    if as_root {
        env.push(env_var("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"));
    }
    env
}

/// Applies the user's additions to a pod (labels, annotations, env, volumes, ...).
fn merge_overrides(pod: &mut Pod, overrides: &PodOverrides) {
    let meta = &mut pod.metadata;
    for (map, additions) in [
        (&mut meta.labels, &overrides.labels),
        (&mut meta.annotations, &overrides.annotations),
    ] {
        for (k, v) in additions {
            // Ringmaster's own labels win; the schema refuses ringmaster.dev/ keys anyway.
            map.get_or_insert_default()
                .entry(k.clone())
                .or_insert_with(|| v.clone());
        }
    }
    let spec = pod.spec.get_or_insert_default();
    extend_map(&mut spec.node_selector, &overrides.node_selector);
    extend(&mut spec.tolerations, &overrides.tolerations);
    extend(&mut spec.volumes, &overrides.volumes);
    if let Some(class) = &overrides.priority_class_name {
        spec.priority_class_name = Some(class.clone());
    }
    merge_pod_settings(spec, overrides);
    let container = &mut spec.containers[0];
    extend(&mut container.env, &overrides.env);
    extend(&mut container.volume_mounts, &overrides.volume_mounts);
    extend(&mut container.ports, &overrides.ports);
    if let Some(resources) = &overrides.resources {
        // GPU and RDMA limits set by Ringmaster stay.
        let ours = container
            .resources
            .take()
            .and_then(|r| r.limits)
            .unwrap_or_default();
        let mut resources = resources.clone();
        if !ours.is_empty() {
            resources.limits.get_or_insert_default().extend(ours);
        }
        container.resources = Some(resources);
    }
}

/// The user's pod-level settings that Ringmaster has no value of its own for (pull secrets,
/// ServiceAccount, affinity, spreading, runtime class, host IPC; the validate step refused
/// what clashes with its own) and their containers: init containers first (Ringmaster has
/// none), added ones after its own, each with Ringmaster's container defaults under its
/// own security context ([`added_container_security`]). The API token stays off unless
/// they turn it on.
fn merge_pod_settings(spec: &mut PodSpec, overrides: &PodOverrides) {
    extend(&mut spec.image_pull_secrets, &overrides.image_pull_secrets);
    extend(
        &mut spec.topology_spread_constraints,
        &overrides.topology_spread_constraints,
    );
    if let Some(account) = &overrides.service_account_name {
        spec.service_account_name = Some(account.clone());
    }
    if let Some(automount) = overrides.automount_service_account_token {
        spec.automount_service_account_token = Some(automount);
    }
    if let Some(affinity) = &overrides.affinity {
        spec.affinity = Some(affinity.clone());
    }
    if let Some(class) = &overrides.runtime_class_name {
        spec.runtime_class_name = Some(class.clone());
    }
    if let Some(host_ipc) = overrides.host_ipc {
        spec.host_ipc = Some(host_ipc);
    }
    let pod_security = spec.security_context.clone().unwrap_or_default();
    let with_defaults = |containers: &[Container]| -> Vec<Container> {
        containers
            .iter()
            .map(|c| Container {
                security_context: Some(added_container_security(
                    &pod_security,
                    c.security_context.as_ref(),
                )),
                ..c.clone()
            })
            .collect()
    };
    extend(
        &mut spec.init_containers,
        &with_defaults(&overrides.init_containers),
    );
    spec.containers.extend(with_defaults(&overrides.containers));
}

/// Puts a pod where its Kueue admission says: the flavors' node labels win over the spec's
/// (the quota was given for those nodes), their tolerations are added, and so are the
/// admission checks' labels and annotations.
fn place(pod: &mut Pod, placement: &PodPlacement) {
    extend_map(&mut pod.metadata.labels, &placement.labels);
    extend_map(&mut pod.metadata.annotations, &placement.annotations);
    let spec = pod.spec.get_or_insert_default();
    extend_map(&mut spec.node_selector, &placement.node_selector);
    extend(&mut spec.tolerations, &placement.tolerations);
}

/// Sets `additions` in `map` (theirs win), made if need be; untouched when there are none.
fn extend_map(map: &mut Option<BTreeMap<String, String>>, additions: &BTreeMap<String, String>) {
    if !additions.is_empty() {
        map.get_or_insert_default().extend(additions.clone());
    }
}

/// Appends `items` to `list`, made if need be; untouched when there are none.
fn extend<T: Clone>(list: &mut Option<Vec<T>>, items: &[T]) {
    if !items.is_empty() {
        list.get_or_insert_default().extend_from_slice(items);
    }
}
