//! Gang scheduling through the Kubernetes scheduler-plugins' Coscheduling plugin
//! (`sigs.k8s.io/scheduler-plugins`, the scheduler MPI Operator and Kubeflow Trainer also
//! use): the `PodGroup` (`scheduling.x-k8s.io/v1alpha1`) Ringmaster makes for each
//! TrainingJob when the operator runs with `--gang-scheduler`, and the label that puts a pod
//! in it. The scheduler holds a group's pods at its Permit stage until it can place
//! `minMember` of them at once, and gives back what it held when it cannot within the
//! group's timeout, so two jobs sharing nodes never each hold part of a gang and wait on
//! each other. Only the fields Ringmaster writes are typed; the CRD is the scheduler-plugins'
//! own (installed with that scheduler), so no schema is generated from these types.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::CustomResource;
use serde::{Deserialize, Serialize};

/// The label naming a pod's PodGroup (in the pod's namespace).
pub const POD_GROUP_LABEL: &str = "scheduling.x-k8s.io/pod-group";

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
