//! Build step of the TrainingJob controller: the desired children of a validated job.
//! Pure: no client, no clock; the SSH key's seed comes in from outside.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Pod, Secret, Service};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use serde_json::{Value, json};

use super::names::{
    self, ChildNaming, LAUNCHER_ROLE, RENDEZVOUS_PORT, SSH_MOUNT, SSH_SECRET_MOUNT, WORKER_ROLE,
};
use super::spec::{Program, TrainerSettings, ValidatedTrainingJob};
use super::state::{Placement, PodPlacement};
use crate::api::{MpiImplementation, OutputSpec, PodOverrides};
use crate::gang::{GangApi, GangScheduler, POD_GROUP_LABEL, PodGroup, PodGroupSpec, volcano};

/// Group the pods' volumes are given to, so a non-root user (the trainer image's uid/gid
/// 1000) can read the SSH key, which is mounted owned by root (0600 becomes 0640 with the
/// group); every container copies it into a file of its own before use.
pub const POD_FS_GROUP: i64 = 1000;
/// The key of the ssh program in the launcher's ConfigMap, and its file name under
/// [`names::HOSTFILE_MOUNT`].
pub const SSH_PROGRAM: &str = "ssh";
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

/// A per-job SSH key pair in OpenSSH formats.
#[derive(Clone, PartialEq, Eq)]
pub struct SshKeys {
    /// The private key, `-----BEGIN OPENSSH PRIVATE KEY-----`.
    pub private_key: String,
    /// The public key line, `ssh-ed25519 AAAA... comment`.
    pub public_key: String,
}

impl std::fmt::Debug for SshKeys {
    // Never print the private key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SshKeys")
            .field("public_key", &self.public_key)
            .finish_non_exhaustive()
    }
}

impl SshKeys {
    /// An Ed25519 key pair from a 32-byte seed (the caller draws it from the OS).
    pub fn from_seed(seed: &[u8; 32], comment: &str) -> Self {
        let keypair = ssh_key::private::Ed25519Keypair::from_seed(seed);
        let mut private = ssh_key::PrivateKey::from(keypair);
        private.set_comment(comment);
        let private_key = private
            .to_openssh(ssh_key::LineEnding::LF)
            .expect("an Ed25519 key encodes")
            .to_string();
        let public_key = private
            .public_key()
            .to_openssh()
            .expect("an Ed25519 key encodes");
        Self {
            private_key,
            public_key,
        }
    }
}

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

fn owner(job: &ValidatedTrainingJob) -> Value {
    serde_json::to_value(owner_reference(job)).expect("owner reference serializes")
}

fn metadata(job: &ValidatedTrainingJob, name: &str, labels: BTreeMap<String, String>) -> Value {
    json!({
        "name": name,
        "namespace": job.namespace,
        "labels": labels,
        "ownerReferences": [owner(job)],
    })
}

fn typed<T: serde::de::DeserializeOwned>(value: Value) -> T {
    serde_json::from_value(value).expect("built objects match their Kubernetes types")
}

/// The SSH Secret: `kubernetes.io/ssh-auth` with the private key, plus the public key and
/// `authorized_keys` so workers accept the launcher.
pub fn ssh_secret(job: &ValidatedTrainingJob, naming: ChildNaming, keys: &SshKeys) -> Secret {
    let mut labels = names::job_labels(&job.name);
    labels.insert(names::ROLE_LABEL.into(), "ssh".into());
    typed(json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(job, &names::ssh_secret(job, naming), labels),
        "type": "kubernetes.io/ssh-auth",
        "stringData": {
            "ssh-privatekey": keys.private_key,
            "ssh-publickey": keys.public_key,
            "authorized_keys": keys.public_key,
        },
    }))
}

/// The hostfile in the chosen MPI's format, one line per worker.
pub fn hostfile(job: &ValidatedTrainingJob, naming: ChildNaming) -> String {
    (0..job.workers)
        .map(|i| {
            let host = names::worker_host(job, naming, i);
            match job.mpi.implementation {
                MpiImplementation::OpenMPI => format!("{host} slots={}\n", job.slots_per_worker),
                MpiImplementation::IntelMPI | MpiImplementation::MPICH => {
                    format!("{host}:{}\n", job.slots_per_worker)
                }
            }
        })
        .collect()
}

/// `ssh` with the job's settings, as a program: Hydra (MPICH, Intel MPI) takes the path of
/// the program it launches with, not a command line.
pub fn ssh_program(job: &ValidatedTrainingJob) -> String {
    format!(
        "#!/bin/sh\n# ssh as the MPI launcher uses it: the job's port and key, no host-key prompts.\nexec ssh {} \"$@\"\n",
        ssh_options(job)
    )
}

/// The launcher's files under [`names::HOSTFILE_MOUNT`] (the hostfile, and the ssh program
/// Hydra runs): annotations of the launcher pod, projected into files by a downward-API
/// volume. They depend on the spec alone, so they travel with the pod the launcher runs in:
/// no ConfigMap to write and keep per job.
fn launcher_files(
    job: &ValidatedTrainingJob,
    naming: ChildNaming,
) -> (BTreeMap<String, String>, Value) {
    let files = [
        (
            names::HOSTFILE_ANNOTATION,
            "hostfile",
            hostfile(job, naming),
        ),
        (names::SSH_PROGRAM_ANNOTATION, SSH_PROGRAM, ssh_program(job)),
    ];
    let annotations = files
        .iter()
        .map(|(key, _, text)| (key.to_string(), text.clone()))
        .collect();
    let items: Vec<Value> = files
        .iter()
        .map(|(key, path, _)| {
            json!({"path": path, "fieldRef": {"fieldPath": format!("metadata.annotations['{key}']")}})
        })
        .collect();
    let volume = json!({"name": "hostfile", "downwardAPI": {"defaultMode": 0o755, "items": items}});
    (annotations, volume)
}

/// The headless Service that gives each worker a DNS name. Not-ready addresses are published
/// so a worker's name resolves while its readiness probe (ssh to that name) is checked. It
/// selects this job's workers only, not those of an earlier job of the same name.
pub fn worker_service(job: &ValidatedTrainingJob, naming: ChildNaming) -> Service {
    let mut labels = names::job_labels(&job.name);
    labels.insert(names::ROLE_LABEL.into(), "workers".into());
    let mut selector = names::job_labels(&job.name);
    selector.insert(names::ROLE_LABEL.into(), WORKER_ROLE.into());
    if naming == ChildNaming::UidTagged {
        // Older workers lack the label; their gang keeps its untagged Service.
        selector.insert(names::JOB_UID_LABEL.into(), job.uid.clone());
    }
    typed(json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(job, &names::worker_service(job, naming), labels),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": true,
            "selector": selector,
            "ports": [
                {"name": "ssh", "port": job.mpi.ssh_port, "targetPort": job.mpi.ssh_port},
                {"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT},
            ],
        },
    }))
}

/// What a gang's workers need together, for its PodGroup: their GPUs and RDMA devices (whole
/// counts Ringmaster sets itself), the scarce part, and what a gang scheduler can check the
/// cluster for before holding any node.
fn gang_min_resources(job: &ValidatedTrainingJob) -> BTreeMap<String, Quantity> {
    let mut min_resources = BTreeMap::new();
    if job.gpus_per_worker > 0 {
        min_resources.insert(
            crate::api::GPU_RESOURCE.to_string(),
            Quantity((u64::from(job.gpus_per_worker) * u64::from(job.workers)).to_string()),
        );
    }
    if let Some(ib) = &job.infiniband {
        min_resources.insert(
            ib.rdma_resource.clone(),
            Quantity((u64::from(ib.rdma_resource_count) * u64::from(job.workers)).to_string()),
        );
    }
    min_resources
}

/// The workers, the gang's members. The launcher is in the group but not counted: it is made
/// only once every worker is ready, so counting it would hold the workers back for a pod
/// that cannot exist yet; it joins a group already placed and is scheduled at once.
fn gang_min_member(job: &ValidatedTrainingJob) -> i32 {
    // The schema bounds workers far below i32::MAX.
    i32::try_from(job.workers).unwrap_or(i32::MAX)
}

/// The metadata of a job's PodGroup, either scheduler's.
fn pod_group_metadata(job: &ValidatedTrainingJob) -> Value {
    let mut labels = names::job_labels(&job.name);
    labels.insert(names::ROLE_LABEL.into(), "gang".into());
    metadata(job, &names::pod_group(&job.name, &job.uid), labels)
}

/// The scheduler-plugins PodGroup of a gang-scheduled job: the scheduler places all its
/// workers ([`gang_min_member`]) at once or none of them.
pub fn pod_group(job: &ValidatedTrainingJob) -> PodGroup {
    typed(json!({
        "apiVersion": "scheduling.x-k8s.io/v1alpha1",
        "kind": "PodGroup",
        "metadata": pod_group_metadata(job),
        "spec": PodGroupSpec {
            min_member: gang_min_member(job),
            min_resources: gang_min_resources(job),
            schedule_timeout_seconds: job
                .run_policy
                .scheduling_policy
                .as_ref()
                .and_then(|p| p.schedule_timeout_seconds),
        },
    }))
}

/// The Volcano PodGroup of a gang-scheduled job: in the job's queue, with the workers'
/// priority class, so Volcano orders it among its queue's jobs as the workers' priority says.
pub fn volcano_pod_group(job: &ValidatedTrainingJob) -> volcano::PodGroup {
    typed(json!({
        "apiVersion": "scheduling.volcano.sh/v1beta1",
        "kind": "PodGroup",
        "metadata": pod_group_metadata(job),
        "spec": volcano::PodGroupSpec {
            min_member: gang_min_member(job),
            min_resources: gang_min_resources(job),
            queue: job
                .run_policy
                .scheduling_policy
                .as_ref()
                .and_then(|p| p.queue.clone()),
            priority_class_name: job.worker.priority_class_name.clone(),
        },
    }))
}

/// Hands a pod to the gang scheduler, in the job's PodGroup: a label for scheduler-plugins,
/// an annotation for Volcano. Last: it wins over the user's own and over what a Kueue
/// admission adds.
fn join_gang(pod: &mut Value, job: &ValidatedTrainingJob, inputs: &BuildInputs) {
    if let Some(scheduler) = &inputs.gang_scheduler {
        pod["spec"]["schedulerName"] = json!(scheduler.name);
        let group = json!(names::pod_group(&job.name, &job.uid));
        match scheduler.api {
            GangApi::SchedulerPlugins => pod["metadata"]["labels"][POD_GROUP_LABEL] = group,
            GangApi::Volcano => {
                pod["metadata"]["annotations"][volcano::GROUP_NAME_ANNOTATION] = group;
            }
        }
    }
}

/// The options every ssh from the launcher (and the readiness probe) uses.
fn ssh_options(job: &ValidatedTrainingJob) -> String {
    format!(
        "-p {} -i {SSH_MOUNT}/ssh-privatekey -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o BatchMode=yes",
        job.mpi.ssh_port
    )
}

fn data_volume(job: &ValidatedTrainingJob, inputs: &BuildInputs) -> Option<(Value, Value)> {
    let data = job.data.as_ref()?;
    let claim = inputs.data_claim.as_ref()?;
    Some((
        json!({"name": "data", "persistentVolumeClaim": {"claimName": claim, "readOnly": true}}),
        json!({"name": "data", "mountPath": data.mount_path, "readOnly": true}),
    ))
}

fn output_volume(output: &OutputSpec) -> (Value, Value) {
    let volume = match (&output.persistent_volume_claim, &output.azure_file) {
        (Some(claim), _) => {
            json!({"name": "output", "persistentVolumeClaim": {"claimName": claim.claim_name}})
        }
        (None, Some(files)) => json!({
            "name": "output",
            "csi": {
                "driver": "file.csi.azure.com",
                "volumeAttributes": {"shareName": files.share_name, "secretName": files.secret_name},
            },
        }),
        // The schema requires exactly one; an empty dir keeps the pod valid if it ever isn't.
        (None, None) => json!({"name": "output", "emptyDir": {}}),
    };
    (
        volume,
        json!({"name": "output", "mountPath": output.mount_path}),
    )
}

/// The SSH Secret (read only) and the memory folder the container's user copies it into.
fn ssh_volumes(job: &ValidatedTrainingJob, naming: ChildNaming) -> [(Value, Value); 2] {
    [
        (
            json!({"name": "ssh-secret", "secret": {"secretName": names::ssh_secret(job, naming), "defaultMode": 0o600}}),
            json!({"name": "ssh-secret", "mountPath": SSH_SECRET_MOUNT, "readOnly": true}),
        ),
        (
            json!({"name": "ssh", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}),
            json!({"name": "ssh", "mountPath": SSH_MOUNT}),
        ),
    ]
}

/// `command` run after the container's own user has copied the SSH key and
/// `authorized_keys` into [`SSH_MOUNT`], readable by that user alone. Whoever the image runs
/// as (root, or a user that reads the Secret through `fsGroup`), the copies are its own with
/// mode 0600, which ssh, sshd and the readiness probe accept.
fn with_private_ssh_keys(command: Vec<String>) -> Vec<String> {
    let prepare = format!(
        "umask 077 && cp {SSH_SECRET_MOUNT}/ssh-privatekey {SSH_SECRET_MOUNT}/authorized_keys {SSH_MOUNT}/ && exec \"$@\""
    );
    let mut wrapped: Vec<String> = vec!["sh".into(), "-c".into(), prepare, "sh".into()];
    wrapped.extend(command);
    wrapped
}

/// A worker's [`with_private_ssh_keys`]: when the worker environment has entries each worker
/// resolves for itself ([`per_pod_env_names`]), its `authorized_keys` copy starts with an
/// `environment="NAME=value"` option per entry, holding this container's value (`"` escaped,
/// line breaks dropped; a value ending in `\` stops the container with a message, as sshd
/// would read it as an escaped quote; an unset one is left out), so that sshd, run with
/// `PermitUserEnvironment`, sets them in every session the job's key opens: the ranks'. Any
/// OpenSSH reads these options. Values come from `printenv`, not the shell's variables (the
/// script's own are `_rm_*`), and command substitution is written with backquotes: the
/// kubelet would take `$(` for a variable to substitute.
fn worker_with_private_ssh_keys(command: Vec<String>, per_pod_env: &[String]) -> Vec<String> {
    if per_pod_env.is_empty() {
        return with_private_ssh_keys(command);
    }
    let prepare = r#"umask 077 && cp SECRET/ssh-privatekey OWN/ && { _rm_sep=; for _rm_n in NAMES; do _rm_v=`printenv "$_rm_n"` || continue; _rm_v=`printf '%s' "$_rm_v" | tr -d '\n'`; case "$_rm_v" in *'\') echo "ringmaster: the value of $_rm_n ends with a backslash, which sshd cannot take" >&2; exit 1;; esac; printf '%senvironment="%s=' "$_rm_sep" "$_rm_n"; printf '%s' "$_rm_v" | sed 's/"/\\"/g'; printf '"'; _rm_sep=,; done; printf ' '; cat SECRET/authorized_keys; } > OWN/authorized_keys && exec "$@""#
        .replace("SECRET", SSH_SECRET_MOUNT)
        .replace("OWN", SSH_MOUNT)
        .replace("NAMES", &per_pod_env.join(" "));
    let mut wrapped: Vec<String> = vec!["sh".into(), "-c".into(), prepare, "sh".into()];
    wrapped.extend(command);
    wrapped
}

/// Applies the user's additions to a pod value (labels, annotations, env, volumes, ...).
fn merge_overrides(pod: &mut Value, overrides: &PodOverrides) {
    let meta = &mut pod["metadata"];
    for (key, map) in [
        ("labels", &overrides.labels),
        ("annotations", &overrides.annotations),
    ] {
        for (k, v) in map {
            // Ringmaster's own labels win; the schema refuses ringmaster.dev/ keys anyway.
            if meta[key].get(k).is_none() {
                meta[key][k] = json!(v);
            }
        }
    }
    let spec = &mut pod["spec"];
    for (k, v) in &overrides.node_selector {
        spec["nodeSelector"][k] = json!(v);
    }
    extend(
        &mut spec["tolerations"],
        overrides.tolerations.iter().map(as_value),
    );
    extend(&mut spec["volumes"], overrides.volumes.iter().map(as_value));
    if let Some(class) = &overrides.priority_class_name {
        spec["priorityClassName"] = json!(class);
    }
    let container = &mut spec["containers"][0];
    extend(&mut container["env"], overrides.env.iter().map(as_value));
    extend(
        &mut container["volumeMounts"],
        overrides.volume_mounts.iter().map(as_value),
    );
    if let Some(resources) = &overrides.resources {
        // GPU and RDMA limits set by Ringmaster stay.
        let ours = container["resources"]["limits"].clone();
        container["resources"] = as_value(resources);
        if let Some(ours) = ours.as_object() {
            for (k, v) in ours {
                container["resources"]["limits"][k] = v.clone();
            }
        }
    }
}

/// Puts a pod where its Kueue admission says: the flavors' node labels win over the spec's
/// (the quota was given for those nodes), their tolerations are added, and so are the
/// admission checks' labels and annotations.
fn place(pod: &mut Value, placement: &PodPlacement) {
    for (key, map) in [
        ("labels", &placement.labels),
        ("annotations", &placement.annotations),
    ] {
        for (k, v) in map {
            pod["metadata"][key][k] = json!(v);
        }
    }
    let spec = &mut pod["spec"];
    for (k, v) in &placement.node_selector {
        spec["nodeSelector"][k] = json!(v);
    }
    extend(
        &mut spec["tolerations"],
        placement.tolerations.iter().map(as_value),
    );
}

fn as_value<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).expect("Kubernetes types serialize")
}

fn extend(list: &mut Value, items: impl Iterator<Item = Value>) {
    let items: Vec<Value> = items.collect();
    if items.is_empty() {
        return;
    }
    if !list.is_array() {
        *list = json!([]);
    }
    list.as_array_mut().expect("array").extend(items);
}

/// Worker pod `index` of gang `inputs.attempt`: sshd on the job's port, ready when it is
/// reachable over ssh under its DNS name, with GPUs, RDMA, shared memory and data mounted.
pub fn worker_pod(job: &ValidatedTrainingJob, index: u32, inputs: &BuildInputs) -> Pod {
    let name = names::worker_pod(&job.name, index);
    let mut labels = names::pod_labels(job, inputs.naming, WORKER_ROLE, inputs.attempt);
    labels.insert(names::WORKER_INDEX_LABEL.into(), index.to_string());
    let port = job.mpi.ssh_port;
    let (mut volumes, mut mounts): (Vec<Value>, Vec<Value>) =
        ssh_volumes(job, inputs.naming).into_iter().unzip();
    let mut limits = serde_json::Map::new();
    let mut capabilities = Vec::new();
    if job.gpus_per_worker > 0 {
        limits.insert(
            crate::api::GPU_RESOURCE.into(),
            json!(job.gpus_per_worker.to_string()),
        );
    }
    if let Some(ib) = &job.infiniband {
        limits.insert(
            ib.rdma_resource.clone(),
            json!(ib.rdma_resource_count.to_string()),
        );
        capabilities.push("IPC_LOCK");
        volumes.push(
            json!({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": ib.shm_size}}),
        );
        mounts.push(json!({"name": "dshm", "mountPath": "/dev/shm"}));
    }
    if let Some((volume, mount)) = data_volume(job, inputs) {
        volumes.push(volume);
        mounts.push(mount);
    }
    if let Some(output) = &job.output {
        let (volume, mount) = output_volume(output);
        volumes.push(volume);
        mounts.push(mount);
    }
    let host = names::worker_host(job, inputs.naming, index);
    let probe = format!("ssh {} {host} true", ssh_options(job));
    let per_pod_env = per_pod_env_names(job);
    let mut node_selector = serde_json::Map::new();
    let mut tolerations = Vec::new();
    if let Some(pool) = &job.node_pool {
        for (k, v) in &pool.node_selector {
            node_selector.insert(k.clone(), json!(v));
        }
        if let Some((selector, toleration)) = own_pool_placement(job) {
            node_selector.extend(selector);
            tolerations.push(toleration);
        }
    }
    let mut pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata(job, &name, labels),
        "spec": {
            "hostname": name,
            "subdomain": names::worker_service(job, inputs.naming),
            "restartPolicy": "Never",
            // Training pods never call the API server: no token to steal, and smaller pods.
            "automountServiceAccountToken": false,
            // Not one variable per Service of the namespace in every container: a namespace
            // with a thousand jobs has a thousand Services.
            "enableServiceLinks": false,
            "securityContext": worker_pod_security(port),
            "nodeSelector": node_selector,
            "tolerations": tolerations,
            "volumes": volumes,
            "containers": [{
                // The controller reads this container's state by its name (observe.rs).
                "name": WORKER_ROLE,
                "image": job.image,
                "command": worker_with_private_ssh_keys(
                    sshd_command(port, !per_pod_env.is_empty()),
                    &per_pod_env,
                ),
                "ports": [
                    {"name": "ssh", "containerPort": port},
                    {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT},
                ],
                "readinessProbe": {
                    "exec": {"command": ["sh", "-c", probe]},
                    "periodSeconds": 5,
                    "timeoutSeconds": 4,
                },
                // sshd's own words (a port it cannot bind, a key it refuses) reach the
                // job's status when the worker exits.
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "resources": {"limits": limits},
                "securityContext": {"capabilities": {"add": capabilities}},
                "env": rank_env(job, inputs.naming),
                "volumeMounts": mounts,
            }],
        },
    });
    merge_overrides(&mut pod, &job.worker);
    place(&mut pod, &inputs.placement.workers);
    join_gang(&mut pod, job, inputs);
    typed(pod)
}

/// The worker pod's security context. sshd runs as the image's user, often not root: a
/// port below 1024 is then opened to every user of the pod's own network namespace
/// through `net.ipv4.ip_unprivileged_port_start`, a sysctl the kubelet allows by default
/// (since Kubernetes 1.22) and the baseline Pod Security Standard permits. It touches no
/// other pod or the node.
fn worker_pod_security(ssh_port: i32) -> Value {
    let mut security = json!({"fsGroup": POD_FS_GROUP});
    if ssh_port < PRIVILEGED_PORTS_END {
        security["sysctls"] = json!([{
            "name": "net.ipv4.ip_unprivileged_port_start",
            "value": ssh_port.to_string(),
        }]);
    }
    security
}

/// Ports below this one need root (or CAP_NET_BIND_SERVICE) to listen on, unless the
/// network namespace's `ip_unprivileged_port_start` says otherwise.
const PRIVILEGED_PORTS_END: i32 = 1024;

/// sshd in the foreground, logging to stderr, with the job's key as its host key and the
/// job's public key as the only one it accepts. `StrictModes=no`: the folders above the key
/// copies are volume mounts the user does not own (sshd would refuse them otherwise); the
/// copies themselves are the user's own, mode 0600. `UsePAM=no` lets it run as any user.
/// `user_environment`: the `environment=` options of `authorized_keys` are honoured
/// ([`worker_with_private_ssh_keys`]).
fn sshd_command(port: i32, user_environment: bool) -> Vec<String> {
    let mut command: Vec<String> = [
        "/usr/sbin/sshd",
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
    ]
    .map(String::from)
    .to_vec();
    if user_environment {
        command.extend(["-o", "PermitUserEnvironment=yes"].map(String::from));
    }
    command
}

/// Environment every rank needs. Ranks are started by sshd, which passes no container
/// environment on, so the launcher holds these and mpirun forwards them.
fn rank_env(job: &ValidatedTrainingJob, naming: ChildNaming) -> Vec<Value> {
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    env.insert("RINGMASTER_JOB".into(), job.name.clone());
    // The trainer resumes only from checkpoints written under this run's id: a job made
    // anew under the same name starts from the beginning.
    env.insert(
        ringmaster_contract::trainer::RUN_ID_ENV.into(),
        job.uid.clone(),
    );
    env.insert(
        "RINGMASTER_RENDEZVOUS".into(),
        format!("{}:{RENDEZVOUS_PORT}", names::worker_host(job, naming, 0)),
    );
    if let Some(ib) = &job.infiniband {
        for (k, v) in DEFAULT_IB_ENV {
            env.insert((*k).into(), (*v).into());
        }
        env.extend(ib.env.clone());
    }
    env.into_iter()
        .map(|(name, value)| json!({"name": name, "value": value}))
        .collect()
}

/// The node selector and toleration that put a pod on the job's own AKS pool.
fn own_pool_placement(
    job: &ValidatedTrainingJob,
) -> Option<(serde_json::Map<String, Value>, Value)> {
    let pool_name = job.node_pool.as_ref()?.pool_name.as_ref()?;
    let mut selector = serde_json::Map::new();
    selector.insert(super::names::AGENT_POOL_LABEL.into(), json!(pool_name));
    let toleration = json!({"key": super::names::POOL_KEY, "operator": "Equal", "value": pool_name, "effect": "NoSchedule"});
    Some((selector, toleration))
}

/// The launcher pod of gang `inputs.attempt`: runs the MPI launcher over the hostfile.
pub fn launcher_pod(job: &ValidatedTrainingJob, inputs: &BuildInputs) -> Pod {
    let (mut volumes, mut mounts): (Vec<Value>, Vec<Value>) =
        ssh_volumes(job, inputs.naming).into_iter().unzip();
    let (annotations, files) = launcher_files(job, inputs.naming);
    volumes.push(files);
    mounts.push(json!({"name": "hostfile", "mountPath": names::HOSTFILE_MOUNT, "readOnly": true}));
    if let Some(output) = &job.output {
        let (volume, mount) = output_volume(output);
        volumes.push(volume);
        mounts.push(mount);
    }
    let mut env = rank_env(job, inputs.naming);
    // The user's worker environment reaches the ranks through the launcher too, but for the
    // entries each worker resolves for itself (resolved here, they could name a container or
    // a file the launcher does not have).
    let per_pod = per_pod_env_names(job);
    env.extend(
        job.worker
            .env
            .iter()
            .filter(|e| !per_pod.contains(&e.name))
            .map(as_value),
    );
    env.push(json!({"name": "OMPI_ALLOW_RUN_AS_ROOT", "value": "1"}));
    env.push(
        json!({"name": LAUNCHER_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}),
    );
    env.push(json!({"name": "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "value": "1"}));
    // A job with its own pool runs its launcher there too: it needs no other capacity.
    let (node_selector, tolerations) = match own_pool_placement(job) {
        Some((selector, toleration)) => (Value::Object(selector), json!([toleration])),
        None => (json!({}), json!([])),
    };
    let mut pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata(job, &names::launcher_pod(&job.name), names::pod_labels(job, inputs.naming, LAUNCHER_ROLE, inputs.attempt)),
        "spec": {
            "restartPolicy": "Never",
            // Training pods never call the API server: no token to steal, and smaller pods.
            "automountServiceAccountToken": false,
            // Not one variable per Service of the namespace in every container: a namespace
            // with a thousand jobs has a thousand Services.
            "enableServiceLinks": false,
            "nodeSelector": node_selector,
            "tolerations": tolerations,
            "securityContext": {"fsGroup": POD_FS_GROUP},
            "volumes": volumes,
            "containers": [{
                "name": LAUNCHER_ROLE,
                "image": job.image,
                "command": with_private_ssh_keys(launcher_command(job)),
                "env": env,
                "volumeMounts": mounts,
                "terminationMessagePolicy": "FallbackToLogsOnError",
            }],
        },
    });
    pod["metadata"]["annotations"] = json!(annotations);
    // The launcher is made once every worker is ready, so it enters the scheduler's queue
    // behind every pod made meanwhile: when many jobs start at once, each one's ready workers
    // (and their GPUs) idle until the whole backlog is placed. A class above the workers'
    // puts it first; the chart's does not preempt. Gang schedulers order their own groups,
    // and the launcher joins one already placed.
    if let Some(class) = &inputs.launcher_priority_class
        && inputs.gang_scheduler.is_none()
    {
        pod["spec"]["priorityClassName"] = json!(class);
    }
    merge_overrides(&mut pod, &job.launcher);
    place(&mut pod, &inputs.placement.launcher);
    join_gang(&mut pod, job, inputs);
    typed(pod)
}

/// Names of the variables mpirun forwards to every rank.
fn forwarded_env(job: &ValidatedTrainingJob) -> Vec<String> {
    let mut names = spec_env_names(job);
    names.extend(image_env(job));
    names
}

/// [`IMAGE_ENV`] but for a name the worker environment sets per pod.
fn image_env(job: &ValidatedTrainingJob) -> Vec<String> {
    let per_pod = per_pod_env_names(job);
    IMAGE_ENV
        .iter()
        .map(|name| name.to_string())
        .filter(|name| !per_pod.contains(name))
        .collect()
}

/// The names of the worker environment's entries that each worker resolves for itself: every
/// `valueFrom` but a Secret's or ConfigMap's key (`fieldRef`: the pod's name, IP or node;
/// `resourceFieldRef`: its container's limits; `fileKeyRef`: a file in the pod), and plain
/// values that refer to other variables (`$(NAME)`). The launcher's values would be wrong on
/// every rank, so these reach the ranks through each worker's sshd
/// ([`worker_with_private_ssh_keys`]), not mpirun. Names that are not shell identifiers
/// cannot be read by the worker's shell and stay with the launcher.
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
        .iter()
        .filter_map(|e| e["name"].as_str().map(str::to_string))
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

/// Hydra's (MPICH, Intel MPI) environment flags: `-genv NAME $(NAME)` for each variable of the
/// container's spec (the kubelet puts in the value), then `-genvlist` for the image's. Hydra
/// 4.0's `-genvlist` silently drops some names (RINGMASTER_RENDEZVOUS among them, seen on the
/// real node) while `-genv` sets every one.
fn hydra_env_flags(job: &ValidatedTrainingJob) -> Vec<String> {
    let mut flags = Vec::new();
    for name in spec_env_names(job) {
        flags.extend(["-genv".to_string(), name.clone(), format!("$({name})")]);
    }
    let image_env = image_env(job);
    if image_env.is_empty() {
        // Every image variable is set per pod: nothing from the launcher's environment.
        flags.push("-genvnone".to_string());
    } else {
        flags.extend(["-genvlist".to_string(), image_env.join(",")]);
    }
    flags
}

/// The launcher's command: the MPI launcher with the process count, hostfile, ssh settings
/// and forwarded environment, then the program. The trainer's own launcher wrapper turns
/// rank 0's summary into the pod's termination message.
pub fn launcher_command(job: &ValidatedTrainingJob) -> Vec<String> {
    let hostfile = format!("{}/hostfile", names::HOSTFILE_MOUNT);
    let np = job.world_size().to_string();
    let ssh = ssh_options(job);
    let ssh_program = format!("{}/{SSH_PROGRAM}", names::HOSTFILE_MOUNT);
    // Hydra's proxies call back to the launcher by the name it gives them, its host name by
    // default, which no DNS resolves (only workers are in the Service): its address instead,
    // which the kubelet substitutes for `$(VAR)` in the command.
    let launcher_ip = format!("$({LAUNCHER_IP_ENV})");
    let forwarded = forwarded_env(job);
    let mut command: Vec<String> = match job.mpi.implementation {
        MpiImplementation::OpenMPI => {
            let mut c: Vec<String> = [
                "mpirun",
                "--hostfile",
                &hostfile,
                "-np",
                &np,
                "--map-by",
                "slot",
                "--bind-to",
                "none",
            ]
            .map(String::from)
            .to_vec();
            c.extend(["--mca", "plm_rsh_args", &ssh].map(String::from));
            // Open MPI shortens hostfile names to their first label unless told not to, and
            // a worker's short name resolves nowhere (only `pod.service.namespace.svc` does).
            c.extend(["--mca", "orte_keep_fqdn_hostnames", "1"].map(String::from));
            for name in &forwarded {
                c.extend(["-x".to_string(), name.clone()]);
            }
            c
        }
        MpiImplementation::IntelMPI => {
            let mut c: Vec<String> = [
                "mpirun",
                "-f",
                &hostfile,
                "-n",
                &np,
                "-localhost",
                &launcher_ip,
                "-bootstrap",
                "ssh",
                "-bootstrap-exec",
                &ssh_program,
            ]
            .map(String::from)
            .to_vec();
            c.extend(hydra_env_flags(job));
            c
        }
        MpiImplementation::MPICH => {
            // Hydra by its own name: where Open MPI is installed too (Debian with both), plain
            // `mpiexec` is Open MPI's.
            let mut c: Vec<String> = [
                "mpiexec.hydra",
                "-f",
                &hostfile,
                "-n",
                &np,
                "-localhost",
                &launcher_ip,
                "-launcher",
                "ssh",
                "-launcher-exec",
                &ssh_program,
            ]
            .map(String::from)
            .to_vec();
            c.extend(hydra_env_flags(job));
            c
        }
    };
    command.extend(job.mpi.extra_args.iter().cloned());
    match &job.program {
        Program::Command(user) => {
            command.extend(user.iter().cloned());
            command
        }
        Program::Trainer(settings) => {
            command.extend(trainer_args(settings));
            let mut wrapped: Vec<String> = [
                names::TRAINER_BINARY,
                "launch",
                "--termination-message",
                "/dev/termination-log",
                "--",
            ]
            .map(String::from)
            .to_vec();
            wrapped.extend(command);
            wrapped
        }
    }
}

/// `ringmaster-trainer train ...` with the job's settings (the typed invocation validate
/// made and checked, then the user's extra flags).
pub fn trainer_args(t: &TrainerSettings) -> Vec<String> {
    let mut args: Vec<String> = vec![names::TRAINER_BINARY.into(), "train".into()];
    args.extend(t.flags());
    args
}
