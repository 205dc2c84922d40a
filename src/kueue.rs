//! Kueue's API (`kueue.x-k8s.io/v1beta2`, Kueue v0.19), as far as Ringmaster reads and writes
//! it as the controller of an external framework: the `Workload` it makes for each queued
//! TrainingJob, and the `ResourceFlavor`s whose node labels and tolerations an admission
//! brings. Only the fields Ringmaster uses are typed; the CRDs are Kueue's own (installed
//! with Kueue), so no schema is generated from these types.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{PodTemplateSpec, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use serde::{Deserialize, Serialize};

/// The label that puts a job into a Kueue LocalQueue of its namespace.
pub const QUEUE_NAME_LABEL: &str = "kueue.x-k8s.io/queue-name";
/// The label that names a job's WorkloadPriorityClass.
pub const PRIORITY_CLASS_LABEL: &str = "kueue.x-k8s.io/priority-class";
/// The name under which Kueue is told to leave TrainingJobs to Ringmaster
/// (`integrations.externalFrameworks`, "Kind.version.group").
pub const EXTERNAL_FRAMEWORK: &str = "TrainingJob.v1alpha1.ringmaster.dev";

/// Workload condition types and reasons Ringmaster reads or writes.
pub mod conditions {
    /// Kueue reserved quota in a ClusterQueue.
    pub const QUOTA_RESERVED: &str = "QuotaReserved";
    /// Quota reserved and every admission check passed: the job may start.
    pub const ADMITTED: &str = "Admitted";
    /// Kueue takes the admission back (preemption, deactivation, a stopped queue, ...).
    pub const EVICTED: &str = "Evicted";
    /// The workload was put back in its queue after an eviction.
    pub const REQUEUED: &str = "Requeued";
    /// The job ended; its quota is free. Set by the job's controller.
    pub const FINISHED: &str = "Finished";
    /// Reason of Evicted when a higher-priority workload took the quota.
    pub const PREEMPTED: &str = "Preempted";
    /// Reason of QuotaReserved=False once an evicted job's pods are gone.
    pub const PENDING: &str = "Pending";
    /// Reason of Finished for a job that succeeded.
    pub const SUCCEEDED: &str = "Succeeded";
    /// Reason of Finished for a job that failed.
    pub const FAILED: &str = "Failed";
    /// Every pod of the admitted workload is ready (set by the job's controller).
    pub const PODS_READY: &str = "PodsReady";
    /// PodsReady=False: the pods are starting.
    pub const WAIT_FOR_START: &str = "WaitForStart";
    /// PodsReady=False: a pod failed after all were ready once.
    pub const WAIT_FOR_RECOVERY: &str = "WaitForRecovery";
    /// PodsReady=True the first time.
    pub const STARTED: &str = "Started";
    /// PodsReady=True again after a recovery.
    pub const RECOVERED: &str = "Recovered";
}

/// What a Workload asks for: its pod sets, queue, priority and whether it may be admitted.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "kueue.x-k8s.io",
    version = "v1beta2",
    kind = "Workload",
    namespaced,
    status = "WorkloadStatus",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadSpec {
    /// The pods, in sets of the same shape.
    pub pod_sets: Vec<PodSet>,
    /// The LocalQueue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_name: Option<String>,
    /// False keeps (or takes) the workload out of admission.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active: Option<bool>,
    /// Where the priority comes from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_ref: Option<PriorityClassRef>,
    /// The priority; required with `priorityClassRef`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
}

/// Pods of one shape.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PodSet {
    /// The set's name (a DNS label).
    pub name: String,
    /// How many pods.
    pub count: i32,
    /// What each pod is: Kueue reads its requests, node selector and tolerations.
    pub template: PodTemplateSpec,
}

/// A reference to a priority class.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PriorityClassRef {
    /// `kueue.x-k8s.io` or `scheduling.k8s.io`.
    pub group: String,
    /// `WorkloadPriorityClass` or `PriorityClass`.
    pub kind: String,
    /// The class's name.
    pub name: String,
}

/// What Kueue says of a Workload.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadStatus {
    /// QuotaReserved, Admitted, Evicted, Requeued, Finished, ...
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// Where the quota was reserved; absent while it waits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<Admission>,
    /// The admission checks' verdicts, with what they add to the pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub admission_checks: Vec<AdmissionCheckState>,
}

/// Quota reserved in a ClusterQueue.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Admission {
    /// The ClusterQueue.
    pub cluster_queue: String,
    /// The flavors assigned to each pod set.
    #[serde(default)]
    pub pod_set_assignments: Vec<PodSetAssignment>,
}

/// The flavors one pod set got.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PodSetAssignment {
    /// The pod set.
    pub name: String,
    /// Resource name → ResourceFlavor name.
    #[serde(default)]
    pub flavors: BTreeMap<String, String>,
}

/// One admission check's state.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionCheckState {
    /// The check.
    #[serde(default)]
    pub name: String,
    /// What the check adds to each pod set's pods.
    #[serde(default)]
    pub pod_set_updates: Vec<PodSetUpdate>,
}

/// Additions to a pod set's pods from an admission check.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PodSetUpdate {
    /// The pod set.
    pub name: String,
    /// Labels the pods get.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Annotations the pods get.
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    /// Node labels the pods must select.
    #[serde(default)]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations the pods get.
    #[serde(default)]
    pub tolerations: Vec<Toleration>,
}

/// A kind of node (a node pool, in AKS terms) that quota is given in.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "kueue.x-k8s.io",
    version = "v1beta2",
    kind = "ResourceFlavor",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct ResourceFlavorSpec {
    /// Labels of the flavor's nodes: admitted pods select them.
    #[serde(default)]
    pub node_labels: BTreeMap<String, String>,
    /// Tolerations admitted pods get (for the taints of the flavor's nodes).
    #[serde(default)]
    pub tolerations: Vec<Toleration>,
}

impl Workload {
    /// The condition of `type_`, when Kueue set it.
    pub fn condition(&self, type_: &str) -> Option<&Condition> {
        self.status
            .as_ref()?
            .conditions
            .iter()
            .find(|c| c.type_ == type_)
    }

    /// Whether the condition of `type_` is True.
    pub fn is(&self, type_: &str) -> bool {
        self.condition(type_).is_some_and(|c| c.status == "True")
    }

    /// Whether quota is reserved for it (and not yet given back).
    pub fn has_quota_reservation(&self) -> bool {
        self.is(conditions::QUOTA_RESERVED)
            || self.status.as_ref().is_some_and(|s| s.admission.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workload_as_kueue_writes_it_reads_with_what_ringmaster_needs() {
        let workload: Workload = serde_saphyr::from_str(
            r#"
apiVersion: kueue.x-k8s.io/v1beta2
kind: Workload
metadata: {name: trainingjob-a-1f2e3, namespace: team}
spec:
  queueName: gpus
  active: true
  podSets:
  - name: workers
    count: 2
    template: {spec: {containers: [{name: worker, image: trainer}]}}
  preemptionGates: []
status:
  admission:
    clusterQueue: cluster-gpus
    podSetAssignments:
    - name: workers
      flavors: {nvidia.com/gpu: nd96, cpu: nd96}
      resourceUsage: {nvidia.com/gpu: "16"}
      count: 2
  conditions:
  - {type: QuotaReserved, status: "True", reason: QuotaReserved, message: ok, lastTransitionTime: "2026-11-22T10:00:00Z"}
  - {type: Admitted, status: "True", reason: Admitted, message: ok, lastTransitionTime: "2026-11-22T10:00:00Z"}
  requeueState: {count: 1}
"#,
        )
        .unwrap();
        assert!(workload.is(conditions::ADMITTED));
        assert!(!workload.is(conditions::EVICTED));
        assert!(workload.has_quota_reservation());
        let admission = workload.status.unwrap().admission.unwrap();
        assert_eq!(admission.cluster_queue, "cluster-gpus");
        assert_eq!(
            admission.pod_set_assignments[0].flavors["nvidia.com/gpu"],
            "nd96"
        );
    }
}
