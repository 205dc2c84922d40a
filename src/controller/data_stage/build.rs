//! Build step of the DataStage controller: the PersistentVolume, its claim, the stager's
//! ServiceAccount + Role + RoleBinding, and the copy Job. Pure functions of the validated
//! spec and the operator's settings.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use serde_json::{Value, json};

use super::validate::{BlobCredentials, StagingTarget, ValidatedDataStage};
use crate::api::Verification;
use crate::stage::{AuthMethod, StageSettings, VerifyMode};

/// Label on every object made for a DataStage: `<namespace>.<name>` (PVs are cluster-wide);
/// past a label value's 63 characters, its first 57 and 5 hex digits of the DataStage's UID.
pub const STAGE_LABEL: &str = "ringmaster.dev/datastage";
/// Where the claim is mounted in the stager.
pub const DATA_MOUNT: &str = "/data";
/// Default capacity written on a PV when the spec gives none (only with an existing claim,
/// which makes no PV), kept for completeness.
const FALLBACK_CAPACITY: &str = "1Gi";

/// Names of a DataStage's children.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Names {
    /// The PersistentVolume (cluster-scoped: made unique by the DataStage's UID).
    pub volume: String,
    /// The claim TrainingJobs mount.
    pub claim: String,
    /// The copy Job.
    pub job: String,
    /// ServiceAccount, Role and RoleBinding of the stager.
    pub stager: String,
}

impl Names {
    /// The names for `stage`.
    pub fn of(stage: &ValidatedDataStage) -> Self {
        let claim = match &stage.destination {
            StagingTarget::ExistingClaim { claim_name } => claim_name.clone(),
            _ => format!("{}-data", short(&stage.name, 58)),
        };
        Self {
            volume: volume_name(&stage.uid),
            claim,
            job: format!("{}-stage", short(&stage.name, 57)),
            stager: format!("{}-stager", short(&stage.name, 56)),
        }
    }
}

/// The PersistentVolume's name for the DataStage with `uid` (cluster-wide unique).
pub fn volume_name(uid: &str) -> String {
    format!("ringmaster-{uid}")
}

/// `name` cut to `max` characters, without a trailing '.' (a DNS label cannot end with one,
/// nor begin with the '-' that follows). Names are ASCII.
fn short(name: &str, max: usize) -> &str {
    name[..name.len().min(max)].trim_end_matches('.')
}

/// What the builders need besides the spec.
#[derive(Clone, Debug)]
pub struct BuildInputs {
    /// The image that runs `ringmaster stage` (the operator's own image).
    pub stager_image: String,
}

/// The [`STAGE_LABEL`] value of `stage`.
pub fn stage_label(stage: &ValidatedDataStage) -> String {
    let whole = format!("{}.{}", stage.namespace, stage.name);
    if whole.len() <= 63 {
        return whole;
    }
    // A label value ends with a letter or digit; names are ASCII.
    let cut = whole[..57].trim_end_matches(['-', '.']);
    format!("{cut}-{}", crate::controller::uid_tag(&stage.uid))
}

fn labels(stage: &ValidatedDataStage) -> BTreeMap<String, String> {
    BTreeMap::from([
        (STAGE_LABEL.to_string(), stage_label(stage)),
        (
            "app.kubernetes.io/managed-by".to_string(),
            "ringmaster".to_string(),
        ),
    ])
}

fn owner(stage: &ValidatedDataStage) -> Value {
    serde_json::to_value(OwnerReference {
        api_version: format!("{}/{}", crate::api::GROUP, crate::api::VERSION),
        kind: "DataStage".into(),
        name: stage.name.clone(),
        uid: stage.uid.clone(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    })
    .expect("owner reference serializes")
}

fn metadata(stage: &ValidatedDataStage, name: &str) -> Value {
    json!({
        "name": name,
        "namespace": stage.namespace,
        "labels": labels(stage),
        "ownerReferences": [owner(stage)],
    })
}

fn typed<T: serde::de::DeserializeOwned>(value: Value) -> T {
    serde_json::from_value(value).expect("built objects match their Kubernetes types")
}

/// The PersistentVolume for an NFS or Azure Files destination (none for an existing
/// claim). Reclaim policy Retain: deleting the DataStage, the claim or this volume never
/// deletes data on the share. Cluster-scoped, so it cannot be owned by the namespaced
/// DataStage: the controller deletes it through a finalizer.
pub fn volume(stage: &ValidatedDataStage) -> Option<PersistentVolume> {
    let names = Names::of(stage);
    let capacity = stage
        .capacity
        .as_ref()
        .map_or(FALLBACK_CAPACITY.to_string(), |q| q.0.clone());
    let (source, mount_options) = match &stage.destination {
        StagingTarget::ExistingClaim { .. } => return None,
        StagingTarget::Nfs {
            server,
            path,
            mount_options,
        } => (
            json!({"nfs": {"server": server, "path": path}}),
            mount_options,
        ),
        StagingTarget::AzureFileNfs {
            storage_account,
            share_name,
            resource_group,
            mount_options,
        } => {
            let mut attributes = json!({
                "storageAccount": storage_account,
                "shareName": share_name,
                "protocol": "nfs",
            });
            if let Some(rg) = resource_group {
                attributes["resourceGroup"] = json!(rg);
            }
            (
                json!({"csi": {
                    "driver": "file.csi.azure.com",
                    // Unique per volume: `{resource group}#{account}#{share}#{uid}`.
                    "volumeHandle": format!(
                        "{}#{storage_account}#{share_name}#{}",
                        resource_group.as_deref().unwrap_or(""),
                        stage.uid
                    ),
                    "volumeAttributes": attributes,
                }}),
                mount_options,
            )
        }
    };
    let mut spec = json!({
        "capacity": {"storage": capacity},
        "accessModes": ["ReadWriteMany"],
        "persistentVolumeReclaimPolicy": "Retain",
        "storageClassName": "",
        "mountOptions": mount_options,
        // Pre-bound to our claim so no other claim can take it.
        "claimRef": {"namespace": stage.namespace, "name": names.claim},
    });
    spec.as_object_mut()
        .expect("object")
        .extend(source.as_object().expect("object").clone());
    Some(typed(json!({
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": names.volume, "labels": labels(stage)},
        "spec": spec,
    })))
}

/// The claim bound to [`volume`] (none for an existing claim).
pub fn claim(stage: &ValidatedDataStage) -> Option<PersistentVolumeClaim> {
    let volume = volume(stage)?;
    let names = Names::of(stage);
    let capacity = volume
        .spec
        .as_ref()?
        .capacity
        .as_ref()?
        .get("storage")?
        .0
        .clone();
    Some(typed(json!({
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": metadata(stage, &names.claim),
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "",
            "volumeName": names.volume,
            "resources": {"requests": {"storage": capacity}},
        },
    })))
}

/// The ServiceAccount the stager runs as, unless workload identity names the user's own.
pub fn service_account(stage: &ValidatedDataStage) -> Option<ServiceAccount> {
    if matches!(stage.credentials, BlobCredentials::WorkloadIdentity { .. }) {
        return None;
    }
    Some(typed(json!({
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(stage, &Names::of(stage).stager),
        "automountServiceAccountToken": true,
    })))
}

/// The ServiceAccount the Job uses.
pub fn job_service_account(stage: &ValidatedDataStage) -> String {
    match &stage.credentials {
        BlobCredentials::WorkloadIdentity {
            service_account_name,
        } => service_account_name.clone(),
        _ => Names::of(stage).stager,
    }
}

/// The stager may read its DataStage and patch its status: nothing else, this one name only.
pub fn role(stage: &ValidatedDataStage) -> Role {
    typed(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": metadata(stage, &Names::of(stage).stager),
        "rules": [{
            "apiGroups": [crate::api::GROUP],
            "resources": ["datastages/status"],
            "resourceNames": [stage.name],
            "verbs": ["get", "patch"],
        }],
    }))
}

/// Binds [`role`] to the Job's ServiceAccount.
pub fn role_binding(stage: &ValidatedDataStage) -> RoleBinding {
    let name = Names::of(stage).stager;
    typed(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": metadata(stage, &name),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{
            "kind": "ServiceAccount",
            "name": job_service_account(stage),
            "namespace": stage.namespace,
        }],
    }))
}

/// The copy Job: `ringmaster stage` with the claim mounted read-write at `/data` and the
/// credential from the referenced Secret in its environment (never in arguments).
pub fn job(stage: &ValidatedDataStage, inputs: &BuildInputs) -> Job {
    let names = Names::of(stage);
    let destination = match &stage.sub_path {
        Some(sub) => format!("{DATA_MOUNT}/{sub}"),
        None => DATA_MOUNT.to_string(),
    };
    let secret_env = |name: &str, r: &crate::api::SecretKeyRef| json!({"name": name, "valueFrom": {"secretKeyRef": {"name": r.name, "key": r.key}}});
    let (auth, secret, pod_labels) = match &stage.credentials {
        BlobCredentials::SasToken(r) => (
            AuthMethod::SasToken,
            Some(secret_env(crate::stage::SAS_TOKEN_ENV, r)),
            json!({}),
        ),
        BlobCredentials::AccountKey(r) => (
            AuthMethod::AccountKey,
            Some(secret_env(crate::stage::ACCOUNT_KEY_ENV, r)),
            json!({}),
        ),
        // AKS's webhook injects the client id, tenant and token file into labelled pods.
        BlobCredentials::WorkloadIdentity { .. } => (
            AuthMethod::WorkloadIdentity,
            None,
            json!({"azure.workload.identity/use": "true"}),
        ),
    };
    let settings = StageSettings {
        account: stage.account.clone(),
        container: stage.container.clone(),
        prefix: stage.prefix.clone(),
        endpoint: stage.endpoint.clone(),
        destination,
        parallelism: stage.parallelism,
        verify: match stage.verify {
            Verification::Size => VerifyMode::Size,
            Verification::MD5 => VerifyMode::Md5,
        },
        auth,
        report_to: format!("{}/{}", stage.namespace, stage.name),
    };
    let mut env: Vec<Value> = settings
        .to_env()
        .into_iter()
        .map(|(name, value)| json!({"name": name, "value": value}))
        .collect();
    env.extend(secret);
    let mut labels = labels(stage);
    if let Some(extra) = pod_labels.as_object() {
        for (k, v) in extra {
            labels.insert(k.clone(), v.as_str().unwrap_or_default().to_string());
        }
    }
    typed(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(stage, &names.job),
        "spec": {
            "backoffLimit": stage.backoff_limit,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "serviceAccountName": job_service_account(stage),
                    "nodeSelector": stage.node_selector,
                    "tolerations": stage.tolerations,
                    "securityContext": {
                        "runAsNonRoot": true,
                        "runAsUser": 65532,
                        "runAsGroup": 65532,
                        "fsGroup": 65532,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [{
                        "name": "stager",
                        "image": inputs.stager_image,
                        "args": ["stage", "--progress", "log", "--termination-message", "/dev/termination-log"],
                        "env": env,
                        "volumeMounts": [{"name": "data", "mountPath": DATA_MOUNT}],
                        "terminationMessagePolicy": "FallbackToLogsOnError",
                        "resources": {
                            "requests": {"cpu": "500m", "memory": "256Mi"},
                            "limits": {"memory": "1Gi"},
                        },
                        "securityContext": {
                            "allowPrivilegeEscalation": false,
                            "readOnlyRootFilesystem": true,
                            "capabilities": {"drop": ["ALL"]},
                        },
                    }],
                    "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": names.claim}}],
                },
            },
        },
    }))
}
