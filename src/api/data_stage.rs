//! `DataStage`: copy a dataset from Azure Blob Storage onto an NFS share and expose it as a
//! PersistentVolume + claim.

// The repeated `printcolumn(...)` arguments of the kube derive look like duplicated attributes to clippy.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{LocalObjectReference, ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{Conditions, SecretKeyRef};
use super::kubernetes_rules;

/// Stages a dataset: copies the blobs under a prefix of an Azure Blob Storage container onto
/// an NFS share (or an existing claim) and exposes it as a PersistentVolumeClaim that
/// TrainingJobs mount read-only. The data on the share outlives the DataStage.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "ringmaster.dev",
    version = "v1alpha1",
    kind = "DataStage",
    namespaced,
    cel,
    shortname = "dstage",
    category = "ringmaster",
    status = "DataStageStatus",
    doc = "Copies a dataset from Azure Blob Storage onto an NFS share and exposes it as a PersistentVolumeClaim.",
    printcolumn(
        name = "Phase",
        type_ = "string",
        json_path = ".status.phase",
        description = "Where the staging is"
    ),
    printcolumn(
        name = "Progress",
        type_ = "string",
        json_path = ".status.progress.percent",
        description = "Bytes copied, in percent of the total"
    ),
    printcolumn(
        name = "Files",
        type_ = "integer",
        json_path = ".status.progress.filesDone",
        description = "Files copied or verified"
    ),
    printcolumn(
        name = "Rate",
        type_ = "string",
        json_path = ".status.progress.rate",
        description = "Current copy rate",
        priority = 1
    ),
    printcolumn(
        name = "Claim",
        type_ = "string",
        json_path = ".status.claimName",
        description = "The claim TrainingJobs mount",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.source == oldSelf.source")
        .message("spec.source is immutable once set: create a new DataStage for other data")
        .field_path(".source"),
    validation = Rule::new("self.destination == oldSelf.destination")
        .message("spec.destination is immutable once set: create a new DataStage to stage elsewhere")
        .field_path(".destination"),
    validation = Rule::new("has(self.destination.existingClaim) || has(self.capacity)")
        .message("spec.capacity is required unless destination.existingClaim is used: it sizes the PersistentVolume")
        .field_path(".capacity"),
)]
pub struct DataStageSpec {
    /// Where the data comes from.
    pub source: Source,
    /// Where the data is copied to.
    pub destination: Destination,
    /// Size of the PersistentVolume and claim Ringmaster creates, e.g. 2Ti. Not used with
    /// destination.existingClaim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<Quantity>,
    /// Blobs downloaded at once. Default: 16.
    #[serde(default = "default_parallelism")]
    #[schemars(range(min = 1, max = 512))]
    pub parallelism: i32,
    /// How a file already on the share is checked before it is skipped: `Size` (its size
    /// and the blob's ETag match what the stager's manifest recorded when it copied it), or
    /// `MD5` (that, and the file's MD5 matches the one recorded while downloading it: a file
    /// changed on the share since is fetched again). Default: MD5.
    #[serde(default)]
    pub verify: Verification,
    /// Retries of the copy Job's pod before the DataStage is Failed. Default: 3.
    #[serde(default = "default_backoff_limit")]
    #[schemars(range(min = 0, max = 100))]
    pub backoff_limit: i32,
    /// Make the destination a mirror of the prefix: after each complete copy, the files
    /// the stager copied earlier whose blobs are gone from the source are deleted (the
    /// count is in the stager's summary). Files it did not copy (not in its manifest,
    /// `.ringmaster-stage/manifest.jsonl`) are never touched. Default: false (files of
    /// deleted blobs stay on the share).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mirror: bool,
    /// Seconds the copy Job may run in all (its `activeDeadlineSeconds`, retries included)
    /// before it is stopped and the DataStage is Failed with reason DeadlineExceeded. Files
    /// copied by then stay and are skipped when the copy runs again. Read when the copy Job
    /// is made. Default: 172800 (two days: 20 TiB at a modest 120 MiB/s, so only a copy
    /// that hangs reaches it).
    #[serde(default = "default_active_deadline_seconds")]
    #[schemars(range(min = 60, max = 2592000))]
    pub active_deadline_seconds: i64,
    /// Seconds the copy Job's pod may take to start (counted from when it was made) before
    /// the DataStage is Failed with what holds it: its volume cannot be mounted
    /// (FailedMount, FailedAttachVolume), its image cannot be pulled, its container cannot
    /// be created, or no node can take it. Separate from, and much shorter than,
    /// activeDeadlineSeconds: a pod that cannot start does not start by waiting two days.
    /// Default: 600 (the stager's image is small, a volume that can be mounted is mounted
    /// in seconds, and the kubelet retries a failed mount every two minutes or so: ten
    /// minutes covers a new node's image pull and a few mount retries).
    #[serde(default = "default_start_timeout_seconds")]
    #[schemars(range(min = 30, max = 86400))]
    pub start_timeout_seconds: i64,
    /// Node labels the copy Job's pod must match: keep it on a system pool, or on the node
    /// that holds a node-local destination.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 32, "additionalProperties" = {"type": "string", "maxLength": 63, "pattern": kubernetes_rules::LABEL_VALUE_PATTERN}))]
    #[x_kube(validation = kubernetes_rules::label_keys("nodeSelector"))]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations of the copy Job's pod, for nodes with taints (a dedicated or tainted pool).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    #[x_kube(
        validation = kubernetes_rules::tolerations()[0].clone(),
        validation = kubernetes_rules::tolerations()[1].clone(),
        validation = kubernetes_rules::tolerations()[2].clone(),
        validation = kubernetes_rules::tolerations()[3].clone(),
    )]
    pub tolerations: Vec<Toleration>,
    /// Resource requests and limits of the copy Job's container, in place of Ringmaster's
    /// (requests: 500m CPU and 256Mi memory; limit: 1Gi memory), resource by resource: a
    /// request or limit you leave out keeps Ringmaster's. Raise the memory with a high
    /// `parallelism` (each download holds a buffer), or the CPU with `verify: MD5`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Secrets in the DataStage's namespace with the registry credentials that pull the
    /// stager's image (the operator's own image, from its registry).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub image_pull_secrets: Vec<LocalObjectReference>,
}

fn default_parallelism() -> i32 {
    16
}

fn default_backoff_limit() -> i32 {
    3
}

fn default_active_deadline_seconds() -> i64 {
    172_800
}

fn default_start_timeout_seconds() -> i64 {
    600
}

/// The data's origin.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Source {
    /// A prefix of an Azure Blob Storage container.
    pub azure_blob: AzureBlobSource,
}

/// A prefix of an Azure Blob Storage container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.endpoint) || !self.endpoint.startsWith('http://') || (has(self.allowInsecureEndpoint) && self.allowInsecureEndpoint)")
    .message("endpoint is plain http: the credentials would cross the network in the clear; use https, or set allowInsecureEndpoint: true for an emulator on a trusted network")
    .field_path(".endpoint"))]
pub struct AzureBlobSource {
    /// Storage account name (3-24 lowercase letters and digits).
    #[schemars(regex(pattern = r"^[a-z0-9]{3,24}$"))]
    pub account: String,
    /// Container name.
    #[schemars(
        length(min = 3, max = 63),
        regex(pattern = r"^(\$root|[a-z0-9](-?[a-z0-9])*)$")
    )]
    pub container: String,
    /// Only blobs whose names start with this are copied; their names below it become paths
    /// under the destination. Default: the whole container.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 1024))]
    pub prefix: String,
    /// Blob service endpoint, for sovereign clouds or the Azurite emulator, e.g.
    /// https://myaccount.blob.core.chinacloudapi.cn or http://127.0.0.1:10000/devstoreaccount1
    /// (plain http needs allowInsecureEndpoint). Default:
    /// https://ACCOUNT.blob.core.windows.net.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 2048), regex(pattern = r"^https?://[^\s]+$"))]
    #[x_kube(validation = Rule::new("!self.contains('?') && !self.contains('#')")
        .message("endpoint is the blob service's URL alone: a SAS token (a query such as ?sv=...&sig=...) goes in a Secret named by auth.sasTokenSecretRef"))]
    pub endpoint: Option<String>,
    /// Allow a plain http endpoint: the credentials then cross the network in the clear. For
    /// an emulator on a trusted network (Azurite) only. Default: false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_insecure_endpoint: bool,
    /// How the stager signs in: exactly one of sasTokenSecretRef, workloadIdentity and
    /// accountKeySecretRef.
    pub auth: BlobAuth,
}

/// Credentials for Blob Storage: exactly one method.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(
    "[has(self.sasTokenSecretRef), has(self.workloadIdentity), has(self.accountKeySecretRef)].filter(x, x).size() == 1"
).message("auth needs exactly one of sasTokenSecretRef, workloadIdentity and accountKeySecretRef"))]
pub struct BlobAuth {
    /// A Secret key holding a SAS token with read and list permission on the container
    /// (preferred: scoped and expiring).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sas_token_secret_ref: Option<SecretKeyRef>,
    /// Azure AD workload identity: the stager pod runs as a ServiceAccount federated with a
    /// managed identity that has Storage Blob Data Reader on the container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload_identity: Option<WorkloadIdentity>,
    /// A Secret key holding the storage account key. Allowed but warned about: the key grants
    /// full access to the whole account.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub account_key_secret_ref: Option<SecretKeyRef>,
}

/// Workload identity settings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadIdentity {
    /// ServiceAccount the stager pod runs as; it carries the
    /// `azure.workload.identity/client-id` annotation.
    #[schemars(length(min = 1, max = 253), regex(pattern = super::kubernetes_rules::DNS_SUBDOMAIN_PATTERN))]
    pub service_account_name: String,
}

/// Where the data goes: exactly one of `nfs`, `azureFileNfs` and `existingClaim`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(
    "[has(self.nfs), has(self.azureFileNfs), has(self.existingClaim)].filter(x, x).size() == 1"
).message("destination needs exactly one of nfs, azureFileNfs and existingClaim"))]
pub struct Destination {
    /// An NFS server and export (an Azure VM file server, Azure NetApp Files, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nfs: Option<NfsDestination>,
    /// An Azure Files NFS share, mounted through the `file.csi.azure.com` driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub azure_file_nfs: Option<AzureFileNfsDestination>,
    /// A claim that exists in the same namespace; Ringmaster creates no volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub existing_claim: Option<ExistingClaim>,
    /// Folder inside the volume the data is written to. Default: the volume's root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024), regex(pattern = r"^[^/](.*[^/])?$"))]
    #[x_kube(validation = Rule::new("!self.split('/').exists(p, p == '..')")
        .message("destination.subPath must stay inside the volume: no '..'"))]
    pub sub_path: Option<String>,
}

/// An NFS export.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NfsDestination {
    /// Host name or IP address of the NFS server.
    #[schemars(length(min = 1, max = 253))]
    pub server: String,
    /// Exported path on the server: the cluster admin allows each namespace only its own
    /// folder of an export (`<export's path>/<namespace>`, see the operator setting
    /// `dataStage.destinations`).
    #[schemars(length(max = 1024), regex(pattern = r"^/.*$"))]
    pub path: String,
    /// Mount options are the cluster admin's (operator setting `dataStage.destinations`):
    /// leave this out. Kept for DataStages written before; one that differs from the
    /// admin's is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub mount_options: Option<Vec<String>>,
}

/// An Azure Files NFS share.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AzureFileNfsDestination {
    /// Storage account (FileStorage, premium) that holds the share.
    #[schemars(regex(pattern = r"^[a-z0-9]{3,24}$"))]
    pub storage_account: String,
    /// Name of the NFS file share.
    #[schemars(length(min = 3, max = 63), regex(pattern = r"^[a-z0-9](-?[a-z0-9])*$"))]
    pub share_name: String,
    /// Resource group of the storage account. Default: the cluster's node resource group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 90))]
    pub resource_group: Option<String>,
    /// Mount options are the cluster admin's (operator setting `dataStage.destinations`):
    /// leave this out. Kept for DataStages written before; one that differs from the
    /// admin's is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub mount_options: Option<Vec<String>>,
}

/// A claim that exists.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExistingClaim {
    /// Name of the claim in the DataStage's namespace; it must allow ReadWriteMany or
    /// ReadWriteOnce writes by the copy Job and ReadOnlyMany reads by the trainers.
    #[schemars(length(min = 1, max = 253), regex(pattern = super::kubernetes_rules::DNS_SUBDOMAIN_PATTERN))]
    pub claim_name: String,
}

/// How files already on the share are checked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Verification {
    /// Same size and ETag as recorded in the stager's manifest when it copied the file.
    Size,
    /// As `Size`, and the file's MD5 is the one recorded while downloading it.
    #[default]
    MD5,
}

/// Where a DataStage is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum DataStagePhase {
    /// Accepted, nothing created yet (or the spec is invalid: see the conditions).
    #[default]
    Pending,
    /// Waiting for the claim to bind to its volume.
    Binding,
    /// The copy Job is running.
    Copying,
    /// Every blob is on the share and verified; the claim is ready to mount.
    Ready,
    /// The copy failed for good; the Ready condition says why.
    Failed,
}

/// Observed state of a DataStage.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DataStageStatus {
    /// Where the staging is.
    #[serde(default)]
    pub phase: DataStagePhase,
    /// The generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Ready, SpecValid, Reconciling and Stalled.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Conditions,
    /// The claim TrainingJobs mount.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_name: Option<String>,
    /// Copy progress, updated while the Job runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    /// When copying started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    /// When the data became Ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
}

/// Copy progress.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Progress {
    /// Blobs under the prefix.
    #[serde(default)]
    pub files_total: i64,
    /// Blobs copied or found already there and verified.
    #[serde(default)]
    pub files_done: i64,
    /// Bytes under the prefix.
    #[serde(default)]
    pub bytes_total: i64,
    /// Bytes copied or verified.
    #[serde(default)]
    pub bytes_done: i64,
    /// Current rate in bytes per second.
    #[serde(default)]
    pub bytes_per_second: i64,
    /// bytesDone in percent of bytesTotal, e.g. "42%".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub percent: Option<String>,
    /// bytesPerSecond for people, e.g. "512 MiB/s".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<String>,
}
