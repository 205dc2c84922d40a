//! Validate step of the DataStage controller: the raw object in, a [`ValidatedDataStage`]
//! out — schema and CEL rules checked, defaults merged, the endpoint resolved. No client.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::ResourceExt;

use crate::api::{DataStage, SecretKeyRef, Verification};
use crate::validation::{self, FieldErrors};

/// A DataStage whose spec passed every rule, with defaults filled in.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidatedDataStage {
    /// The DataStage's name.
    pub name: String,
    /// Its namespace.
    pub namespace: String,
    /// Its UID.
    pub uid: String,
    /// Storage account.
    pub account: String,
    /// Container.
    pub container: String,
    /// Blob name prefix (may be empty).
    pub prefix: String,
    /// Blob service endpoint, resolved.
    pub endpoint: String,
    /// How the stager signs in.
    pub credentials: BlobCredentials,
    /// Where the data goes.
    pub destination: StagingTarget,
    /// Folder inside the volume.
    pub sub_path: Option<String>,
    /// Size of the volume Ringmaster creates.
    pub capacity: Option<Quantity>,
    /// Parallel downloads.
    pub parallelism: u32,
    /// How files already there are checked.
    pub verify: Verification,
    /// Retries of the copy Job.
    pub backoff_limit: u32,
    /// Delete files of blobs gone from the source.
    pub mirror: bool,
    /// The copy Job's `activeDeadlineSeconds`.
    pub active_deadline_seconds: i64,
    /// Seconds the copy Job's pod may take to start.
    pub start_timeout_seconds: i64,
    /// Node labels the copy Job's pod must match.
    pub node_selector: std::collections::BTreeMap<String, String>,
    /// Tolerations of the copy Job's pod.
    pub tolerations: Vec<k8s_openapi::api::core::v1::Toleration>,
    /// The user's requests and limits of the copy Job's container, over Ringmaster's.
    pub resources: Option<k8s_openapi::api::core::v1::ResourceRequirements>,
    /// Registry credentials of the copy Job's pod.
    pub image_pull_secrets: Vec<k8s_openapi::api::core::v1::LocalObjectReference>,
    /// Things that are allowed but worth a Warning Event.
    pub warnings: Vec<String>,
}

/// How the stager authenticates to Blob Storage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlobCredentials {
    /// A SAS token from a Secret.
    SasToken(SecretKeyRef),
    /// Azure AD workload identity through a ServiceAccount.
    WorkloadIdentity {
        /// The federated ServiceAccount.
        service_account_name: String,
    },
    /// The account key from a Secret.
    AccountKey(SecretKeyRef),
}

/// Where the data is written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StagingTarget {
    /// An NFS export, as a PersistentVolume Ringmaster creates.
    Nfs {
        /// Server host.
        server: String,
        /// Export path.
        path: String,
        /// PV mount options.
        mount_options: Vec<String>,
    },
    /// An Azure Files NFS share through the CSI driver.
    AzureFileNfs {
        /// Storage account.
        storage_account: String,
        /// Share.
        share_name: String,
        /// Resource group, when not the node resource group.
        resource_group: Option<String>,
        /// PV mount options.
        mount_options: Vec<String>,
    },
    /// A claim the user made.
    ExistingClaim {
        /// Its name.
        claim_name: String,
    },
}

/// Warning given when a DataStage signs in with the account key.
pub const ACCOUNT_KEY_WARNING: &str = "auth uses the storage account key, which grants full access to the whole account: prefer sasTokenSecretRef (read and list on the container, with an expiry) or workloadIdentity";

/// Checks `stage` against every rule and fills in defaults.
pub fn validate(stage: &DataStage) -> Result<ValidatedDataStage, FieldErrors> {
    validation::check_object(stage)?;
    with_defaults(stage)
}

/// Checks a raw object as a user wrote it (and, for an update, against the `old` one), then
/// validates it like [`validate`]. Used by the fixture tests and by tools that lint YAML.
pub fn validate_value(
    value: &serde_json::Value,
    old: Option<&serde_json::Value>,
) -> Result<ValidatedDataStage, FieldErrors> {
    let stage: DataStage = validation::parse_object(value, old)?;
    with_defaults(&stage)
}

/// The defaults and derived values of an object that passed the schema.
fn with_defaults(stage: &DataStage) -> Result<ValidatedDataStage, FieldErrors> {
    let spec = &stage.spec;
    let blob = &spec.source.azure_blob;
    let mut warnings = Vec::new();
    // The schema's CEL rule guarantees exactly one method and one destination.
    let credentials = if let Some(sas) = &blob.auth.sas_token_secret_ref {
        BlobCredentials::SasToken(sas.clone())
    } else if let Some(wi) = &blob.auth.workload_identity {
        BlobCredentials::WorkloadIdentity {
            service_account_name: wi.service_account_name.clone(),
        }
    } else if let Some(key) = &blob.auth.account_key_secret_ref {
        warnings.push(ACCOUNT_KEY_WARNING.to_string());
        BlobCredentials::AccountKey(key.clone())
    } else {
        return Err(FieldErrors::one(
            "spec.source.azureBlob.auth",
            "no authentication method set",
        ));
    };
    let dest = &spec.destination;
    let destination = if let Some(nfs) = &dest.nfs {
        StagingTarget::Nfs {
            server: nfs.server.clone(),
            path: nfs.path.clone(),
            // The admin's, once the allow list admits the export (`destinations`).
            mount_options: Vec::new(),
        }
    } else if let Some(files) = &dest.azure_file_nfs {
        StagingTarget::AzureFileNfs {
            storage_account: files.storage_account.clone(),
            share_name: files.share_name.clone(),
            resource_group: files.resource_group.clone(),
            mount_options: Vec::new(),
        }
    } else if let Some(claim) = &dest.existing_claim {
        StagingTarget::ExistingClaim {
            claim_name: claim.claim_name.clone(),
        }
    } else {
        return Err(FieldErrors::one("spec.destination", "no destination set"));
    };
    let as_u32 = |v: i32| u32::try_from(v).unwrap_or(0);
    Ok(ValidatedDataStage {
        name: stage.name_any(),
        namespace: stage.namespace().unwrap_or_default(),
        uid: stage.uid().unwrap_or_default(),
        account: blob.account.clone(),
        container: blob.container.clone(),
        prefix: blob.prefix.clone(),
        endpoint: blob
            .endpoint
            .clone()
            .unwrap_or_else(|| format!("https://{}.blob.core.windows.net", blob.account)),
        credentials,
        destination,
        sub_path: dest.sub_path.clone(),
        capacity: spec.capacity.clone(),
        parallelism: as_u32(spec.parallelism),
        verify: spec.verify,
        backoff_limit: as_u32(spec.backoff_limit),
        mirror: spec.mirror,
        active_deadline_seconds: spec.active_deadline_seconds,
        start_timeout_seconds: spec.start_timeout_seconds,
        node_selector: spec.node_selector.clone(),
        tolerations: spec.tolerations.clone(),
        resources: spec.resources.clone(),
        image_pull_secrets: spec.image_pull_secrets.clone(),
        warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schema_rules_compile() {
        assert_eq!(
            crate::validation::checker::<DataStage>().compile_errors(),
            Vec::<String>::new()
        );
    }
}
