//! Names and labels of a TrainingJob's children, in one place so build, apply and observe
//! agree on them.

use std::collections::BTreeMap;

use super::spec::ValidatedTrainingJob;
use crate::controller::uid_tag;

/// Label with the owning job's name, on every child.
pub const JOB_NAME_LABEL: &str = "ringmaster.dev/job-name";
/// Label with the owning job's UID, on the pods of a gang whose Secret and Service names carry
/// it: which job made a pod, also while the pods of an earlier job of the same name are still
/// being deleted. The pods of a gang an older operator started have none
/// ([`ChildNaming::Untagged`]), and its pods made again keep it that way.
pub const JOB_UID_LABEL: &str = "ringmaster.dev/job-uid";
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

/// The label that ties an EndpointSlice to its Service (DNS servers read the slices by it).
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The label that names who manages an EndpointSlice: the cluster's EndpointSlice
/// controllers leave alone the slices of another manager.
pub const SLICE_MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
/// The value of [`SLICE_MANAGED_BY_LABEL`] on the slices this operator writes (the workers'
/// DNS records: see `worker_dns`).
pub const SLICE_MANAGER: &str = "ringmaster.dev";

/// Port of the trainer's rendezvous on rank 0.
pub const RENDEZVOUS_PORT: u16 = 29500;
/// Where every pod keeps its private copies of the SSH key and `authorized_keys`, and the
/// `known_hosts` that pins the job's host key (a memory emptyDir), made from
/// [`SSH_SECRET_MOUNT`] by the container's own user before anything uses them: ssh and sshd
/// refuse a key that its owner's group can read, and a Secret volume's files are
/// group-readable (`fsGroup` turns mode 0600 into 0640) and owned by root.
pub const SSH_MOUNT: &str = "/etc/ringmaster/ssh";
/// Where the SSH Secret is mounted in every pod (read only; its SSH keys copied into
/// [`SSH_MOUNT`]; the ranks read its rendezvous key here).
pub const SSH_SECRET_MOUNT: &str = "/etc/ringmaster/ssh-secret";
/// Where the hostfile ConfigMap is mounted in the launcher.
pub const HOSTFILE_MOUNT: &str = "/etc/ringmaster/mpi";
/// The launcher pod's annotation holding its hostfile (projected to HOSTFILE_MOUNT/hostfile).
pub const HOSTFILE_ANNOTATION: &str = "ringmaster.dev/hostfile";
/// The launcher pod's annotation holding the ssh program Hydra runs (HOSTFILE_MOUNT/ssh).
pub const SSH_PROGRAM_ANNOTATION: &str = "ringmaster.dev/ssh-program";
/// The trainer's binary in the image.
pub const TRAINER_BINARY: &str = "ringmaster-trainer";

/// How a gang's pods name the job's SSH Secret and headless Service.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ChildNaming {
    /// `<job>-ssh-<uid5>` and `<job>-workers-<uid5>` ([`uid_tag`]). A job deleted and made
    /// again at once (`kubectl replace --force`, Flux's `force`) must not find the first
    /// job's Secret and Service still there: it would keep them (the Secret is only ever
    /// created), and the garbage collector would then delete them from under its pods.
    #[default]
    UidTagged,
    /// `<job>-ssh` and `<job>-workers`: the names of a gang whose pods an older operator made
    /// (they have no [`JOB_UID_LABEL`]). Its launcher, made after an upgrade, must reach
    /// those workers with their key and under their DNS names.
    Untagged,
}

impl ChildNaming {
    /// The naming of gang `attempt` from the job's pods: untagged when one of that attempt's
    /// pods has no [`JOB_UID_LABEL`], so an upgrade in the middle of a start does not split
    /// the gang; a new gang (no pod yet) is tagged.
    pub fn of_gang<'a>(
        pods: impl IntoIterator<Item = &'a k8s_openapi::api::core::v1::Pod>,
        attempt: i32,
    ) -> Self {
        let attempt = attempt.to_string();
        let untagged = pods.into_iter().any(|pod| {
            let labels = pod.metadata.labels.as_ref();
            labels.and_then(|l| l.get(ATTEMPT_LABEL)) == Some(&attempt)
                && labels.is_none_or(|l| !l.contains_key(JOB_UID_LABEL))
        });
        if untagged {
            Self::Untagged
        } else {
            Self::UidTagged
        }
    }

    fn suffix(self, job: &ValidatedTrainingJob) -> String {
        match self {
            Self::UidTagged => format!("-{}", uid_tag(&job.uid)),
            Self::Untagged => String::new(),
        }
    }
}

/// The per-job SSH key Secret.
pub fn ssh_secret(job: &ValidatedTrainingJob, naming: ChildNaming) -> String {
    format!("{}-ssh{}", job.name, naming.suffix(job))
}

/// The headless Service that gives workers DNS names (at most 62 characters: a DNS label).
pub fn worker_service(job: &ValidatedTrainingJob, naming: ChildNaming) -> String {
    format!("{}-workers{}", job.name, naming.suffix(job))
}

/// The NetworkPolicy that keeps the gang's pods to themselves.
pub fn network_policy(job: &ValidatedTrainingJob, naming: ChildNaming) -> String {
    format!("{}-gang{}", job.name, naming.suffix(job))
}

/// Worker pod `index`.
pub fn worker_pod(job: &str, index: u32) -> String {
    format!("{job}-worker-{index}")
}

/// The launcher pod of gang `attempt`: `<job>-launcher` for the first, `<job>-launcher-<n>`
/// after the n-th restart. A name of its own per attempt lets the last failed launcher stay
/// (with its log) while the next attempt runs.
pub fn launcher_pod(job: &str, attempt: i32) -> String {
    match attempt {
        0 => format!("{job}-launcher"),
        n => format!("{job}-launcher-{n}"),
    }
}

/// The DNS name a worker is reached by: `<pod>.<service>.<namespace>.svc`.
pub fn worker_host(job: &ValidatedTrainingJob, naming: ChildNaming, index: u32) -> String {
    format!(
        "{}.{}.{}.svc",
        worker_pod(&job.name, index),
        worker_service(job, naming),
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

/// Labels of a pod of `role` in gang `attempt` named by `naming`: the job's UID only on the
/// pods of a UID-tagged gang, so a gang an older operator started stays untagged until it
/// restarts, whichever of its pods are made again meanwhile.
pub fn pod_labels(
    job: &ValidatedTrainingJob,
    naming: ChildNaming,
    role: &str,
    attempt: i32,
) -> BTreeMap<String, String> {
    let mut labels = job_labels(&job.name);
    if naming == ChildNaming::UidTagged {
        labels.insert(JOB_UID_LABEL.into(), job.uid.clone());
    }
    labels.insert(ROLE_LABEL.into(), role.into());
    labels.insert(ATTEMPT_LABEL.into(), attempt.to_string());
    labels
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

/// Label and taint key on a job's own pool nodes (its workers tolerate it).
pub const POOL_KEY: &str = "ringmaster.dev/pool";

/// AKS's label naming a node's agent pool.
pub const AGENT_POOL_LABEL: &str = "kubernetes.azure.com/agentpool";

/// Letters of the job's name at the start of a derived pool name.
const POOL_PREFIX_LEN: usize = 4;
/// Base-36 characters of the UID's hash at the end of a derived pool name.
const POOL_HASH_LEN: u32 = 8;

/// An AKS agent pool name for a job: up to 4 letters and digits of its name (starting with a
/// letter; `tj` when it has none), then 8 base-36 characters of a hash (MD5) of its UID, so
/// a restarted operator derives the same name again and two jobs almost never derive the
/// same one. AKS allows `^[a-z][a-z0-9]{0,11}$` for Linux pools.
///
/// Entropy: 36⁸ ≈ 2.8 × 10¹² names per prefix, 41.4 bits. The chance that any two of `n`
/// jobs with the same prefix derive the same name is about n² / (2 × 36⁸): 1.8 × 10⁻⁹ for
/// 100 pools (AKS's limit per cluster), 1.8 × 10⁻⁵ (1 in 56,000) for 10,000. (The 4 hex
/// digits of the UID used before gave 16 bits: 1 in 13 for 100 jobs of one prefix.) A
/// collision cannot take another job's pool: pools are only created (`If-None-Match: *`),
/// and used or deleted by the job their tags name; the job that finds its name taken fails.
pub fn derive_pool_name(job_name: &str, uid: &str) -> String {
    use md5::{Digest, Md5};
    let mut name: String = job_name
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .map(|c| c.to_ascii_lowercase())
        .skip_while(|c| c.is_ascii_digit())
        .take(POOL_PREFIX_LEN)
        .collect();
    if name.is_empty() {
        name.push_str("tj");
    }
    let digest: [u8; 16] = Md5::digest(uid.as_bytes()).into();
    // 128 bits reduced to 36⁸ values: the bias is below 2⁻⁸⁶.
    let mut hash = u128::from_be_bytes(digest) % 36u128.pow(POOL_HASH_LEN);
    let mut suffix = Vec::with_capacity(POOL_HASH_LEN as usize);
    for _ in 0..POOL_HASH_LEN {
        let digit = (hash % 36) as u32;
        suffix.push(char::from_digit(digit, 36).expect("a base-36 digit"));
        hash /= 36;
    }
    name.extend(suffix.into_iter().rev());
    name
}

/// Whether `name` is a valid AKS Linux agent pool name (`^[a-z][a-z0-9]{0,11}$`).
pub fn is_valid_pool_name(name: &str) -> bool {
    name.len() <= 12
        && name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_pool_names_are_valid_for_aks() {
        for (name, uid) in [
            ("resnet50-ib", "3f2a9c4e-0000-4000-8000-000000000000"),
            ("123-numbers-first", "ABCDEF12-3456"),
            ("---", ""),
            ("a", "0"),
            ("a-very-long-training-job-name", "deadbeef"),
        ] {
            let pool = derive_pool_name(name, uid);
            assert!(is_valid_pool_name(&pool), "{name} → {pool}");
        }
        let pool = derive_pool_name("resnet50-ib", "3f2a9c4e-0000-4000-8000-000000000000");
        assert_eq!(pool.len(), 12);
        assert!(pool.starts_with("resn"), "{pool}");
        assert_eq!(
            pool,
            derive_pool_name("resnet50-ib", "3f2a9c4e-0000-4000-8000-000000000000"),
            "the same name again (a restarted operator)"
        );
        assert!(derive_pool_name("---", "x").starts_with("tj"));
        assert!(derive_pool_name("123abc", "x").starts_with("abc"));
        assert_ne!(
            derive_pool_name("job", "aaaa1111"),
            derive_pool_name("job", "bbbb1111")
        );
        for invalid in ["", "Pool", "1pool", "pool-1", "waytoolongpool"] {
            assert!(!is_valid_pool_name(invalid), "{invalid}");
        }
    }

    #[test]
    fn derived_pool_names_of_jobs_of_one_name_do_not_collide() {
        // The UIDs differ only where the old rule (4 hex digits) did not look.
        let names: std::collections::BTreeSet<String> = (0..20_000u32)
            .map(|i| derive_pool_name("train", &format!("3f2a9c4e-0000-4000-8000-{i:012x}")))
            .collect();
        assert_eq!(names.len(), 20_000);
        assert!(names.iter().all(|n| n.starts_with("trai") && n.len() == 12));
    }
}
