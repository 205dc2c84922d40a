//! Build step of the DataStage controller: the PersistentVolume, its claim, the stager's
//! ServiceAccount + Role + RoleBinding, and the copy Job. Pure functions of the validated
//! spec and the operator's settings.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, Capabilities, Container, EnvVar, EnvVarSource, NFSVolumeSource,
    ObjectReference, PersistentVolume, PersistentVolumeClaim, PersistentVolumeClaimSpec,
    PersistentVolumeClaimVolumeSource, PersistentVolumeSpec, PodSecurityContext, PodSpec,
    PodTemplateSpec, ResourceRequirements, SeccompProfile, SecretKeySelector, SecurityContext,
    ServiceAccount, Volume, VolumeMount, VolumeResourceRequirements,
};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

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

fn owner(stage: &ValidatedDataStage) -> OwnerReference {
    OwnerReference {
        api_version: format!("{}/{}", crate::api::GROUP, crate::api::VERSION),
        kind: "DataStage".into(),
        name: stage.name.clone(),
        uid: stage.uid.clone(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

fn metadata(stage: &ValidatedDataStage, name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: Some(stage.namespace.clone()),
        labels: Some(labels(stage)),
        owner_references: Some(vec![owner(stage)]),
        ..ObjectMeta::default()
    }
}

/// `items` as owned strings, for an optional list field.
fn strings<const N: usize>(items: [&str; N]) -> Option<Vec<String>> {
    Some(items.map(String::from).to_vec())
}

/// Quantities by resource name.
fn quantities<const N: usize>(items: [(&str, &str); N]) -> Option<BTreeMap<String, Quantity>> {
    Some(
        items
            .into_iter()
            .map(|(name, q)| (name.to_string(), Quantity(q.to_string())))
            .collect(),
    )
}

/// The PersistentVolume for an NFS or Azure Files destination (none for an existing
/// claim). Reclaim policy Retain: deleting the DataStage, the claim or this volume never
/// deletes data on the share. Cluster-scoped, so it cannot be owned by the namespaced
/// DataStage: the controller deletes it through a finalizer.
pub fn volume(stage: &ValidatedDataStage) -> Option<PersistentVolume> {
    let names = Names::of(stage);
    let capacity = stage
        .capacity
        .clone()
        .unwrap_or_else(|| Quantity(FALLBACK_CAPACITY.to_string()));
    let spec = PersistentVolumeSpec {
        capacity: Some(BTreeMap::from([("storage".to_string(), capacity)])),
        access_modes: strings(["ReadWriteMany"]),
        persistent_volume_reclaim_policy: Some("Retain".into()),
        storage_class_name: Some(String::new()),
        // Pre-bound to our claim so no other claim can take it.
        claim_ref: Some(ObjectReference {
            namespace: Some(stage.namespace.clone()),
            name: Some(names.claim),
            ..ObjectReference::default()
        }),
        ..volume_source(stage)?
    };
    Some(PersistentVolume {
        metadata: ObjectMeta {
            name: Some(names.volume),
            labels: Some(labels(stage)),
            ..ObjectMeta::default()
        },
        spec: Some(spec),
        status: None,
    })
}

/// Where [`volume`] is, with its mount options: the NFS export or the Azure Files share (none
/// for an existing claim).
fn volume_source(stage: &ValidatedDataStage) -> Option<PersistentVolumeSpec> {
    match &stage.destination {
        StagingTarget::ExistingClaim { .. } => None,
        StagingTarget::Nfs {
            server,
            path,
            mount_options,
        } => Some(PersistentVolumeSpec {
            nfs: Some(NFSVolumeSource {
                server: server.clone(),
                path: path.clone(),
                read_only: None,
            }),
            mount_options: Some(mount_options.clone()),
            ..PersistentVolumeSpec::default()
        }),
        StagingTarget::AzureFileNfs {
            storage_account,
            share_name,
            resource_group,
            mount_options,
        } => {
            let mut attributes = BTreeMap::from([
                ("storageAccount".to_string(), storage_account.clone()),
                ("shareName".to_string(), share_name.clone()),
                ("protocol".to_string(), "nfs".to_string()),
            ]);
            if let Some(rg) = resource_group {
                attributes.insert("resourceGroup".into(), rg.clone());
            }
            Some(PersistentVolumeSpec {
                csi: Some(CSIPersistentVolumeSource {
                    driver: "file.csi.azure.com".into(),
                    // Unique per volume: `{resource group}#{account}#{share}#{uid}`.
                    volume_handle: format!(
                        "{}#{storage_account}#{share_name}#{}",
                        resource_group.as_deref().unwrap_or(""),
                        stage.uid
                    ),
                    volume_attributes: Some(attributes),
                    ..CSIPersistentVolumeSource::default()
                }),
                mount_options: Some(mount_options.clone()),
                ..PersistentVolumeSpec::default()
            })
        }
    }
}

/// The claim bound to [`volume`] (none for an existing claim).
pub fn claim(stage: &ValidatedDataStage) -> Option<PersistentVolumeClaim> {
    let volume = volume(stage)?;
    let names = Names::of(stage);
    let capacity = volume.spec?.capacity?.remove("storage")?;
    Some(PersistentVolumeClaim {
        metadata: metadata(stage, &names.claim),
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: strings(["ReadWriteMany"]),
            storage_class_name: Some(String::new()),
            volume_name: Some(names.volume),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([("storage".to_string(), capacity)])),
                limits: None,
            }),
            ..PersistentVolumeClaimSpec::default()
        }),
        status: None,
    })
}

/// The ServiceAccount the stager runs as, unless workload identity names the user's own.
pub fn service_account(stage: &ValidatedDataStage) -> Option<ServiceAccount> {
    if matches!(stage.credentials, BlobCredentials::WorkloadIdentity { .. }) {
        return None;
    }
    Some(ServiceAccount {
        metadata: metadata(stage, &Names::of(stage).stager),
        automount_service_account_token: Some(true),
        ..ServiceAccount::default()
    })
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
    Role {
        metadata: metadata(stage, &Names::of(stage).stager),
        rules: Some(vec![PolicyRule {
            api_groups: strings([crate::api::GROUP]),
            resources: strings(["datastages/status"]),
            resource_names: Some(vec![stage.name.clone()]),
            verbs: vec!["get".into(), "patch".into()],
            non_resource_urls: None,
        }]),
    }
}

/// Binds [`role`] to the Job's ServiceAccount.
pub fn role_binding(stage: &ValidatedDataStage) -> RoleBinding {
    let name = Names::of(stage).stager;
    RoleBinding {
        metadata: metadata(stage, &name),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name,
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: job_service_account(stage),
            namespace: Some(stage.namespace.clone()),
            api_group: None,
        }]),
    }
}

/// The copy Job: `ringmaster stage` with the claim mounted read-write at `/data` and the
/// credential from the referenced Secret in its environment (never in arguments).
pub fn job(stage: &ValidatedDataStage, inputs: &BuildInputs) -> Job {
    let names = Names::of(stage);
    let mut labels = labels(stage);
    let (auth, secret) = match &stage.credentials {
        BlobCredentials::SasToken(r) => (
            AuthMethod::SasToken,
            Some(secret_env(crate::stage::SAS_TOKEN_ENV, r)),
        ),
        BlobCredentials::AccountKey(r) => (
            AuthMethod::AccountKey,
            Some(secret_env(crate::stage::ACCOUNT_KEY_ENV, r)),
        ),
        BlobCredentials::WorkloadIdentity { .. } => {
            // AKS's webhook injects the client id, tenant and token file into labelled pods.
            labels.insert("azure.workload.identity/use".into(), "true".into());
            (AuthMethod::WorkloadIdentity, None)
        }
    };
    let mut env: Vec<EnvVar> = stage_settings(stage, auth)
        .to_env()
        .into_iter()
        .map(|(name, value)| EnvVar {
            name: name.into(),
            value: Some(value),
            value_from: None,
        })
        .collect();
    env.extend(secret);
    Job {
        metadata: metadata(stage, &names.job),
        spec: Some(JobSpec {
            // The schema bounds it far below i32::MAX.
            backoff_limit: Some(i32::try_from(stage.backoff_limit).unwrap_or(i32::MAX)),
            // A replacement pod only once the last one has stopped, not while it is still
            // terminating (say, behind a node partition): never two stagers at once from one
            // Job. (The stager's lock on the destination covers the rest.)
            pod_replacement_policy: Some("Failed".into()),
            // A copy that hangs ends (DeadlineExceeded); what it copied is kept.
            active_deadline_seconds: Some(stage.active_deadline_seconds),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(stager_pod(stage, env, &names.claim, inputs)),
            },
            ..JobSpec::default()
        }),
        status: None,
    }
}

/// The variable `name` with the value of the Secret key `r`.
fn secret_env(name: &str, r: &crate::api::SecretKeyRef) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: None,
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: r.name.clone(),
                key: r.key.clone(),
                optional: None,
            }),
            ..EnvVarSource::default()
        }),
    }
}

/// What `ringmaster stage` is told to do for `stage`, signing in with `auth`.
fn stage_settings(stage: &ValidatedDataStage, auth: AuthMethod) -> StageSettings {
    StageSettings {
        account: stage.account.clone(),
        container: stage.container.clone(),
        prefix: stage.prefix.clone(),
        endpoint: stage.endpoint.clone(),
        destination: match &stage.sub_path {
            Some(sub) => format!("{DATA_MOUNT}/{sub}"),
            None => DATA_MOUNT.to_string(),
        },
        parallelism: stage.parallelism,
        verify: match stage.verify {
            Verification::Size => VerifyMode::Size,
            Verification::MD5 => VerifyMode::Md5,
        },
        auth,
        report_to: format!("{}/{}", stage.namespace, stage.name),
        mirror: stage.mirror,
    }
}

/// The copy Job's pod: the [`stager_container`] with `env`, unprivileged, `claim` its volume,
/// where the spec places it.
fn stager_pod(
    stage: &ValidatedDataStage,
    env: Vec<EnvVar>,
    claim: &str,
    inputs: &BuildInputs,
) -> PodSpec {
    PodSpec {
        restart_policy: Some("Never".into()),
        service_account_name: Some(job_service_account(stage)),
        node_selector: Some(stage.node_selector.clone()),
        tolerations: Some(stage.tolerations.clone()),
        image_pull_secrets: (!stage.image_pull_secrets.is_empty())
            .then(|| stage.image_pull_secrets.clone()),
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(65532),
            run_as_group: Some(65532),
            fs_group: Some(65532),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                localhost_profile: None,
            }),
            ..PodSecurityContext::default()
        }),
        containers: vec![stager_container(env, stage.resources.as_ref(), inputs)],
        volumes: Some(vec![Volume {
            name: "data".into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim.into(),
                read_only: None,
            }),
            ..Volume::default()
        }]),
        ..PodSpec::default()
    }
}

/// The stager's requests and limits: Ringmaster's, each resource the user names replaced by
/// theirs (`theirs`, the spec's `resources`), so raising the memory limit keeps the CPU
/// request.
fn stager_resources(theirs: Option<&ResourceRequirements>) -> ResourceRequirements {
    let mut resources = ResourceRequirements {
        requests: quantities([("cpu", "500m"), ("memory", "256Mi")]),
        limits: quantities([("memory", "1Gi")]),
        ..ResourceRequirements::default()
    };
    let Some(theirs) = theirs else {
        return resources;
    };
    for (ours, theirs) in [
        (&mut resources.requests, &theirs.requests),
        (&mut resources.limits, &theirs.limits),
    ] {
        if let Some(theirs) = theirs {
            ours.get_or_insert_default().extend(theirs.clone());
        }
    }
    resources.claims = theirs.claims.clone();
    resources
}

/// The stager: `ringmaster stage` with `env`, the claim at [`DATA_MOUNT`], a read-only root
/// and no capabilities.
fn stager_container(
    env: Vec<EnvVar>,
    resources: Option<&ResourceRequirements>,
    inputs: &BuildInputs,
) -> Container {
    Container {
        name: "stager".into(),
        image: Some(inputs.stager_image.clone()),
        args: strings([
            "stage",
            "--progress",
            "log",
            "--termination-message",
            "/dev/termination-log",
        ]),
        env: Some(env),
        volume_mounts: Some(vec![VolumeMount {
            name: "data".into(),
            mount_path: DATA_MOUNT.into(),
            ..VolumeMount::default()
        }]),
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        resources: Some(stager_resources(resources)),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            capabilities: Some(Capabilities {
                add: None,
                drop: strings(["ALL"]),
            }),
            ..SecurityContext::default()
        }),
        ..Container::default()
    }
}
