//! Types shared by both resources.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A key of a Secret in the resource's own namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// Name of the Secret, in the same namespace as the resource.
    #[schemars(length(min = 1, max = 253), regex(pattern = super::kubernetes_rules::DNS_SUBDOMAIN_PATTERN))]
    pub name: String,
    /// Key inside the Secret whose value is used.
    #[schemars(length(min = 1, max = 253), regex(pattern = super::kubernetes_rules::CONFIG_KEY_PATTERN))]
    pub key: String,
}

/// The conditions list every status carries: kstatus-compatible (`type`, `status`,
/// `reason`, `message`, `lastTransitionTime`, `observedGeneration`).
pub type Conditions = Vec<Condition>;

/// Condition types shared by both kinds.
pub mod condition_types {
    /// `True` when the resource has done its work (a DataStage's data is ready, a
    /// TrainingJob is running or has succeeded); `kubectl wait --for=condition=Ready` uses it.
    pub const READY: &str = "Ready";
    /// `False` when the spec breaks a rule the schema could not check; the message names the field.
    pub const SPEC_VALID: &str = "SpecValid";
    /// `True` while the operator is working towards the desired state (kstatus "Reconciling").
    pub const RECONCILING: &str = "Reconciling";
    /// `True` when the resource cannot make progress without a change (kstatus "Stalled").
    pub const STALLED: &str = "Stalled";
}

/// Condition reasons shared by both kinds.
pub mod condition_reasons {
    /// The spec passed validation.
    pub const VALID: &str = "Valid";
    /// The spec breaks a rule; the message names the field.
    pub const INVALID_SPEC: &str = "InvalidSpec";
    /// The API server refused a child the operator made from a valid spec (a missing
    /// PriorityClass, a quota, an admission webhook); the message is the API server's, with
    /// the child's kind and name. The operator keeps retrying with backoff.
    pub const CHILD_REJECTED: &str = "ChildRejected";
    /// (Event) Azure refused to delete a deleted job's agent pool, or could not be asked;
    /// the job stays until the pool is gone, and the deletion is retried.
    pub const NODE_POOL_DELETE_FAILED: &str = "NodePoolDeleteFailed";
    /// (Event) A deleted job's agent pool was not deleted: the operator has no AKS settings.
    pub const NODE_POOL_LEFT_BEHIND: &str = "NodePoolLeftBehind";
    /// (Event) An operation URL for a job's agent pool (in its `status.nodePool.operation`,
    /// or in Azure's answer) is not on the operator's ARM endpoint: it was not requested
    /// (the ARM token goes only there) and is dropped from the status.
    pub const NODE_POOL_OPERATION_IGNORED: &str = "NodePoolOperationIgnored";
}
