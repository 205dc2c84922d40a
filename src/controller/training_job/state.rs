//! What a TrainingJob's reconcile found around it, boiled down for the plan: the DataStage,
//! the node pool, Kueue, and the pods that hold names the job would use. Types only (and how
//! a pod in the way is read); no imports of the job's other steps.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// The referenced DataStage, as far as the job is concerned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataState {
    /// The job reads no DataStage.
    NotNeeded,
    /// Ready; its claim.
    Ready { claim: String },
    /// Not ready (or missing); why, for the condition. `failed`: the DataStage failed, and
    /// waits for a person (a fixed Secret and a new DataStage).
    Waiting { message: String, failed: bool },
}

/// The job's nodes, when it brings its own (an AKS agent pool).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PoolState {
    /// Existing nodes (or none named): nothing to wait for.
    NotNeeded,
    /// Being made or not yet Ready; what is happening, for the condition.
    Provisioning { message: String },
    /// Enough Ready nodes with the GPUs allocatable.
    Ready { message: String },
    /// Azure refused or failed to make it.
    Failed { message: String },
}

/// Where a job stands with Kueue.
#[derive(Clone, Debug, PartialEq)]
pub enum QueueState {
    /// Not queued (no queue-name label): the job runs as soon as it is ready.
    NotQueued,
    /// Queued, but this operator runs without its Kueue integration.
    IntegrationOff { queue: String },
    /// Waiting for admission; what Kueue says (or why there is no Workload yet).
    Waiting { message: String },
    /// Admitted: the gang may run, placed as the admission says.
    Admitted {
        placement: Placement,
        message: String,
    },
    /// Evicted (preempted, deactivated, its queue stopped, ...): the pods go; Kueue's
    /// reason and message.
    Evicted {
        reason: &'static str,
        message: String,
    },
}

/// What an admission adds to the pods: its flavors' node labels and tolerations, and the
/// admission checks' additions.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Placement {
    /// For the workers.
    pub workers: PodPlacement,
    /// For the launcher.
    pub launcher: PodPlacement,
}

/// A node selector, tolerations, labels and annotations for one pod set.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PodPlacement {
    /// Labels the pods' nodes must have.
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations the pods get.
    pub tolerations: Vec<Toleration>,
    /// Labels the pods get (from admission checks).
    pub labels: BTreeMap<String, String>,
    /// Annotations the pods get (from admission checks: a ProvisioningRequest's, say).
    pub annotations: BTreeMap<String, String>,
}

impl PodPlacement {
    /// Adds a flavor's node labels and tolerations (each toleration once).
    pub fn add(&mut self, node_selector: &BTreeMap<String, String>, tolerations: &[Toleration]) {
        self.node_selector.extend(node_selector.clone());
        for toleration in tolerations {
            if !self.tolerations.contains(toleration) {
                self.tolerations.push(toleration.clone());
            }
        }
    }
}

/// Who holds the name of a pod the job would make.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NameHolder {
    /// A pod on its way out: one being deleted, or one of an earlier job of the same name
    /// (deleted; the garbage collector takes its pods). Waited out quietly.
    Going,
    /// A pod that stays until a person acts: one without a controller (a job deleted with
    /// `--cascade=orphan` leaves its pods so), one controlled by something else, or one
    /// being deleted for well past its grace period (its node lost, or a finalizer that is
    /// never removed). `why` says which, and what to do, for the job's status.
    Staying { why: String },
}

/// How long past the end of its grace period a pod being deleted is waited for quietly. The
/// kubelet confirms a deletion within seconds of it; a pod on a lost node is never
/// confirmed until the node is deleted or the pod is force-deleted.
pub const TERMINATING_PATIENCE: Duration = Duration::from_secs(60);

impl NameHolder {
    /// Whether `pod`, not the job's (named `job`), goes by itself, seen at `now`.
    pub fn of(pod: &Pod, job: &str, now: &Time) -> Self {
        let meta = &pod.metadata;
        let controller = meta
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.controller == Some(true));
        let controller_words =
            || controller.map_or("none".into(), |o| format!("{} {}", o.kind, o.name));
        if let Some(deleted_at) = &meta.deletion_timestamp {
            if !past_terminating_patience(deleted_at, now) {
                return NameHolder::Going;
            }
            return NameHolder::Staying {
                why: format!(
                    "a pod of that name (its controller: {}) {}; once it is gone, the job goes on",
                    controller_words(),
                    still_being_deleted(
                        meta.name.as_deref().unwrap_or_default(),
                        meta.namespace.as_deref().unwrap_or_default(),
                        pod.spec.as_ref().and_then(|s| s.node_name.as_deref()),
                        deleted_at,
                    )
                ),
            };
        }
        let earlier_job = controller.is_some_and(|o| {
            o.kind == "TrainingJob" && o.name == job && crate::api::in_group(&o.api_version)
        });
        if earlier_job {
            NameHolder::Going
        } else {
            NameHolder::Staying {
                why: format!(
                    "a pod of that name exists that this job does not control (its controller: \
                     {}); delete or rename that pod, and the job goes on",
                    controller_words()
                ),
            }
        }
    }
}

/// Whether a pod being deleted, whose grace period ended at `grace_over` (its deletion
/// timestamp), is past [`TERMINATING_PATIENCE`] at `now`: no longer waited for quietly.
pub fn past_terminating_patience(grace_over: &Time, now: &Time) -> bool {
    seconds_between(grace_over, now) > TERMINATING_PATIENCE.as_secs_f64()
}

/// What to say of pod `name` still being deleted past its grace period, and what to do about
/// it: the node it ran on may be lost (the kubelet never confirms the deletion; the pod
/// garbage collector force-deletes only when the Node object goes), or a finalizer holds it.
pub fn still_being_deleted(
    name: &str,
    namespace: &str,
    node: Option<&str>,
    grace_over: &Time,
) -> String {
    let node = node.map_or_else(|| "its node".to_string(), |n| format!("its node {n}"));
    format!(
        "is still being deleted, its grace period over since {}: {node} may be lost (kubectl \
         delete pod {name} -n {namespace} --grace-period=0 --force), or a finalizer holds it \
         (whoever put it there takes it off)",
        grace_over.0
    )
}

/// Seconds from `from` to `to`.
pub fn seconds_between(from: &Time, to: &Time) -> f64 {
    to.0.duration_since(from.0).as_secs_f64()
}
