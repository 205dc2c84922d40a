//! Gang scheduling: the `PodGroup` Ringmaster makes for each TrainingJob when the operator
//! runs with `--gang-scheduler`, and what puts a pod in it, for either of two schedulers:
//!
//! * the Kubernetes scheduler-plugins' Coscheduling plugin (`sigs.k8s.io/scheduler-plugins`,
//!   the scheduler MPI Operator and Kubeflow Trainer also use): `scheduling.x-k8s.io/v1alpha1`
//!   PodGroups, pods labelled with their group. It holds a group's pods at its Permit stage
//!   until it can place `minMember` of them at once, and gives back what it held when it
//!   cannot within the group's timeout;
//! * Volcano (`volcano.sh`): `scheduling.volcano.sh/v1beta1` PodGroups in a Volcano queue,
//!   pods annotated with their group. It admits a group to its queue when the queue and the
//!   cluster have room for its `minResources`, then binds `minMember` pods in one session or
//!   none.
//!
//! Either way two jobs sharing nodes never each hold part of a gang and wait on each other.
//! Only the fields Ringmaster writes are typed; the CRDs are the schedulers' own (installed
//! with them), so no schema is generated from these types.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::CustomResource;
use serde::{Deserialize, Serialize};

/// The label naming a pod's scheduler-plugins PodGroup (in the pod's namespace).
pub const POD_GROUP_LABEL: &str = "scheduling.x-k8s.io/pod-group";

/// Whose PodGroups the gang scheduler reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GangApi {
    /// scheduler-plugins' Coscheduling (`scheduling.x-k8s.io/v1alpha1`).
    #[default]
    SchedulerPlugins,
    /// Volcano (`scheduling.volcano.sh/v1beta1`).
    Volcano,
}

impl GangApi {
    /// The API group of its PodGroups.
    pub fn group(self) -> &'static str {
        match self {
            GangApi::SchedulerPlugins => "scheduling.x-k8s.io",
            GangApi::Volcano => "scheduling.volcano.sh",
        }
    }
}

/// The scheduler that places a TrainingJob's pods as a gang.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GangScheduler {
    /// Its name: the pods' `schedulerName`.
    pub name: String,
    /// Whose PodGroups it reads.
    pub api: GangApi,
}

impl GangScheduler {
    /// The scheduler named `name`; `api` unset is Volcano's for a scheduler named `volcano`
    /// (the name Volcano installs its scheduler under) and scheduler-plugins' otherwise.
    pub fn new(name: impl Into<String>, api: Option<GangApi>) -> Self {
        let name = name.into();
        let api = api.unwrap_or(if name == volcano::SCHEDULER_NAME {
            GangApi::Volcano
        } else {
            GangApi::SchedulerPlugins
        });
        Self { name, api }
    }
}

/// How many of a group's pods must be placed together, and what they need.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "scheduling.x-k8s.io",
    version = "v1alpha1",
    kind = "PodGroup",
    namespaced,
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct PodGroupSpec {
    /// Pods that must be placed at once before any of them is bound.
    pub min_member: i32,
    /// What those `minMember` pods request together: the scheduler turns a group away early
    /// when the cluster has less, instead of holding part of it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub min_resources: BTreeMap<String, Quantity>,
    /// Seconds the scheduler holds placed pods while waiting for the rest of the group (the
    /// plugin's `permitWaitingTimeSeconds` when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule_timeout_seconds: Option<i32>,
}

/// Volcano's PodGroup.
pub mod volcano {
    use std::collections::BTreeMap;

    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use kube::CustomResource;
    use serde::{Deserialize, Serialize};

    /// The name Volcano's chart gives its scheduler.
    pub const SCHEDULER_NAME: &str = "volcano";
    /// The annotation naming a pod's PodGroup (in the pod's namespace).
    pub const GROUP_NAME_ANNOTATION: &str = "scheduling.k8s.io/group-name";

    /// How many of a group's pods must be placed together, what they need, and in which
    /// Volcano queue.
    #[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
    #[kube(
        group = "scheduling.volcano.sh",
        version = "v1beta1",
        kind = "PodGroup",
        namespaced,
        schema = "disabled"
    )]
    #[serde(rename_all = "camelCase")]
    pub struct PodGroupSpec {
        /// Pods that must be placed in one scheduling session before any is bound.
        pub min_member: i32,
        /// What those `minMember` pods request together: the group waits in its queue
        /// (phase Pending) until the queue and the cluster have that much.
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        pub min_resources: BTreeMap<String, Quantity>,
        /// The Volcano queue (Volcano's default queue, `default`, when unset).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub queue: Option<String>,
        /// The group's priority, among the jobs of its queue.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub priority_class_name: Option<String>,
    }
}
