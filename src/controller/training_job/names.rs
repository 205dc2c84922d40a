//! Names and labels of a TrainingJob's children, in one place so build, apply and observe
//! agree on them.

use std::collections::BTreeMap;

use super::validate::ValidatedTrainingJob;

/// Label with the owning job's name, on every child.
pub const JOB_NAME_LABEL: &str = "ringmaster.dev/job-name";
/// Label with the child's role: `worker` or `launcher` (pods), or the object kind's role.
pub const ROLE_LABEL: &str = "ringmaster.dev/role";
/// Label with the gang attempt a pod belongs to (the job's restart count when it was made).
pub const ATTEMPT_LABEL: &str = "ringmaster.dev/attempt";
/// Label with a worker's index.
pub const WORKER_INDEX_LABEL: &str = "ringmaster.dev/worker-index";
/// The value of [`ROLE_LABEL`] on workers.
pub const WORKER_ROLE: &str = "worker";
/// The value of [`ROLE_LABEL`] on the launcher.
pub const LAUNCHER_ROLE: &str = "launcher";

/// Port of the trainer's rendezvous on rank 0.
pub const RENDEZVOUS_PORT: u16 = 29500;
/// Where every pod keeps its private copies of the SSH key and `authorized_keys` (a memory
/// emptyDir), made from [`SSH_SECRET_MOUNT`] by the container's own user before anything uses
/// them: ssh and sshd refuse a key that its owner's group can read, and a Secret volume's
/// files are group-readable (`fsGroup` turns mode 0600 into 0640) and owned by root.
pub const SSH_MOUNT: &str = "/etc/ringmaster/ssh";
/// Where the SSH Secret is mounted in every pod (read only; copied into [`SSH_MOUNT`]).
pub const SSH_SECRET_MOUNT: &str = "/etc/ringmaster/ssh-secret";
/// Where the hostfile ConfigMap is mounted in the launcher.
pub const HOSTFILE_MOUNT: &str = "/etc/ringmaster/mpi";
/// The launcher pod's annotation holding its hostfile (projected to HOSTFILE_MOUNT/hostfile).
pub const HOSTFILE_ANNOTATION: &str = "ringmaster.dev/hostfile";
/// The launcher pod's annotation holding the ssh program Hydra runs (HOSTFILE_MOUNT/ssh).
pub const SSH_PROGRAM_ANNOTATION: &str = "ringmaster.dev/ssh-program";
/// The trainer's binary in the image.
pub const TRAINER_BINARY: &str = "ringmaster-trainer";

/// The per-job SSH key Secret.
pub fn ssh_secret(job: &str) -> String {
    format!("{job}-ssh")
}

/// The headless Service that gives workers DNS names.
pub fn worker_service(job: &str) -> String {
    format!("{job}-workers")
}

/// Worker pod `index`.
pub fn worker_pod(job: &str, index: u32) -> String {
    format!("{job}-worker-{index}")
}

/// The launcher pod.
pub fn launcher_pod(job: &str) -> String {
    format!("{job}-launcher")
}

/// The DNS name a worker is reached by: `<pod>.<service>.<namespace>.svc`.
pub fn worker_host(job: &ValidatedTrainingJob, index: u32) -> String {
    format!(
        "{}.{}.{}.svc",
        worker_pod(&job.name, index),
        worker_service(&job.name),
        job.namespace
    )
}

/// Labels every child carries.
pub fn job_labels(job: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (JOB_NAME_LABEL.to_string(), job.to_string()),
        (
            "app.kubernetes.io/managed-by".to_string(),
            "ringmaster".to_string(),
        ),
    ])
}

/// Labels of a pod of `role` in gang `attempt`.
pub fn pod_labels(job: &str, role: &str, attempt: i32) -> BTreeMap<String, String> {
    let mut labels = job_labels(job);
    labels.insert(ROLE_LABEL.into(), role.into());
    labels.insert(ATTEMPT_LABEL.into(), attempt.to_string());
    labels
}

/// 5 hex digits of a job's UID: names of children made with it differ between a job and one
/// made again under the same name while the first one's children are still being deleted.
fn uid_tag(uid: &str) -> String {
    uid.chars()
        .filter(char::is_ascii_hexdigit)
        .map(|c| c.to_ascii_lowercase())
        .take(5)
        .collect()
}

/// The Kueue Workload of a queued job: its name and its [`uid_tag`], so a job made again
/// under the same name gets a Workload of its own, and a restarted operator finds the one it
/// made.
pub fn workload(job: &str, uid: &str) -> String {
    format!("trainingjob-{job}-{}", uid_tag(uid))
}

/// The PodGroup of a gang-scheduled job (and its pods' pod-group label, at most 54
/// characters): its name and its [`uid_tag`], so the pods of a job made again under the same
/// name never join the old job's group while that one is being deleted.
pub fn pod_group(job: &str, uid: &str) -> String {
    format!("{job}-{}", uid_tag(uid))
}
