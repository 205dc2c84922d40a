//! Apply and observe steps of the DataStage controller: the children are applied
//! server-side (the Job is created once: its template is immutable), then the claim and the
//! Job are read back. The PersistentVolume is cluster-scoped and cannot be owned by the
//! DataStage, so a finalizer deletes it (never the data: reclaim policy Retain).
//!
//! A namespaced child's name can be held by an object the DataStage did not make: an earlier
//! DataStage's of the same name that the garbage collector has yet to delete, or anybody's.
//! Each is read before it is applied, and such an object is neither used nor changed
//! ([`NotOurs`]): applying over it would adopt it (the garbage collector would then delete it
//! with the DataStage), and an earlier DataStage's finished Job would pass for this one's copy.

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{
    Event, PersistentVolume, PersistentVolumeClaim, Pod, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, Resource, ResourceExt};

use super::build::{self, BuildInputs, Names};
use super::start::{self, CopyPod, StartCheck};
use super::status::{ClaimState, CopyState, NotOurs, reasons};
use super::validate::ValidatedDataStage;
use crate::api::DataStage;
use crate::controller::{is_conflict, is_not_found, server_side_apply, set_finalizer};
use crate::stage::Outcome;

/// The finalizer that deletes a DataStage's PersistentVolume object.
pub const FINALIZER: &str = "ringmaster.dev/volume";

/// The annotation on a copy Job the controller stopped (suspended) because its pod did not
/// start in time: why, as the DataStage says it. The Job stays, so the DataStage stays
/// Failed; deleting the Job starts a new copy.
pub const STOPPED_ANNOTATION: &str = "ringmaster.dev/stopped";

/// Errors applying or reading a DataStage's children.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The API server refused a call.
    #[error("{action} {kind} {name}: {source}")]
    Kube {
        action: &'static str,
        kind: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
    /// A child's name was taken and freed again, over and over, while it was being made.
    #[error("{kind} {name} was made and deleted again by someone else while the DataStage made it")]
    Contended { kind: &'static str, name: String },
}

impl ApplyError {
    /// "creating Job x: <the API server's message>" when the API server refused a child
    /// (see [`crate::controller::rejection`]); `None` for errors that pass by themselves.
    pub fn rejection(&self) -> Option<String> {
        match self {
            ApplyError::Kube {
                action,
                kind,
                name,
                source,
            } => crate::controller::rejection(source)
                .map(|message| format!("{action} {kind} {name}: {message}")),
            ApplyError::Contended { .. } => None,
        }
    }
}

fn kube_error(
    action: &'static str,
    kind: &'static str,
    name: &str,
) -> impl FnOnce(kube::Error) -> ApplyError {
    let name = name.to_string();
    move |source| ApplyError::Kube {
        action,
        kind,
        name,
        source,
    }
}

/// Makes sure the finalizer is on the DataStage (only when it has a volume of ours).
pub async fn ensure_finalizer(
    client: &Client,
    object: &DataStage,
    stage: &ValidatedDataStage,
) -> Result<(), ApplyError> {
    if build::volume(stage).is_none() {
        return Ok(());
    }
    set_finalizer(client, object, FINALIZER, true)
        .await
        .map_err(kube_error("add the finalizer to", "DataStage", &stage.name))
}

/// On deletion: deletes the volume object (the data stays), then drops the finalizer.
pub async fn finalize(client: &Client, stage: &DataStage) -> Result<(), ApplyError> {
    let name = stage.name_any();
    if let Some(volume) = volume_of(stage) {
        let volumes: Api<PersistentVolume> = Api::all(client.clone());
        match volumes.delete(&volume, &Default::default()).await {
            Ok(_) => {}
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(kube_error("delete", "PersistentVolume", &volume)(e)),
        }
    }
    set_finalizer(client, stage, FINALIZER, false)
        .await
        .map_err(kube_error("remove the finalizer from", "DataStage", &name))
}

/// [`finalize`] for a DataStage whose stored form no longer parses: its volume, named by its
/// UID, is deleted if there is one (a stage of an existing claim has none), then the
/// finalizer is removed from its metadata.
pub async fn finalize_unreadable(
    client: &Client,
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> Result<(), ApplyError> {
    let name = meta.name.clone().unwrap_or_default();
    if !meta.finalizers.iter().flatten().any(|f| f == FINALIZER) {
        return Ok(());
    }
    let volume = build::volume_name(meta.uid.as_deref().unwrap_or_default());
    let volumes: Api<PersistentVolume> = Api::all(client.clone());
    match volumes.delete(&volume, &Default::default()).await {
        Ok(_) => {}
        Err(e) if is_not_found(&e) => {}
        Err(e) => return Err(kube_error("delete", "PersistentVolume", &volume)(e)),
    }
    crate::controller::remove_finalizer_from_metadata::<DataStage>(client, meta, FINALIZER)
        .await
        .map_err(kube_error("remove the finalizer from", "DataStage", &name))
}

/// `NotOurs` when `meta` is not of an object this DataStage controls.
pub fn not_ours(
    kind: &'static str,
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    stage: &ValidatedDataStage,
) -> Option<NotOurs> {
    let controller = meta
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true));
    if controller.is_some_and(|o| o.uid == stage.uid) {
        return None;
    }
    Some(NotOurs {
        kind,
        name: meta.name.clone().unwrap_or_default(),
        owner: controller.map_or("none".into(), |o| format!("{} {}", o.kind, o.name)),
        earlier_stage: controller.is_some_and(|o| {
            o.kind == "DataStage" && o.name == stage.name && crate::api::in_group(&o.api_version)
        }),
    })
}

/// Who holds a child's name.
enum Holder {
    /// Nobody: the child is created (a create, so one made meanwhile is never taken over).
    Free,
    /// The DataStage's own child: applied server-side again.
    Ours,
    /// An object the DataStage does not control: left alone.
    NotOurs(NotOurs),
}

/// Reads who holds `name`.
async fn holder<K>(
    api: &Api<K>,
    kind: &'static str,
    name: &str,
    stage: &ValidatedDataStage,
) -> Result<Holder, ApplyError>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let existing = api
        .get_opt(name)
        .await
        .map_err(kube_error("read", kind, name))?;
    Ok(match existing {
        None => Holder::Free,
        Some(object) => match not_ours(kind, object.meta(), stage) {
            None => Holder::Ours,
            Some(held) => Holder::NotOurs(held),
        },
    })
}

/// Writes `object` where `held` (from [`holder`]) says: created when its name is free,
/// server-side applied when the object there is the DataStage's own, and not at all when it
/// is not (that one is returned). The object as written otherwise.
async fn write_child<K>(
    api: &Api<K>,
    kind: &'static str,
    object: &K,
    stage: &ValidatedDataStage,
    mut held: Holder,
) -> Result<Result<K, NotOurs>, ApplyError>
where
    K: Resource + serde::Serialize + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let name = object.name_any();
    // A name taken between the read and the create is read again; made and deleted by
    // someone else over and over, it is retried with the reconcile's backoff.
    for _ in 0..3 {
        match held {
            Holder::NotOurs(not_ours) => return Ok(Err(not_ours)),
            Holder::Ours => {
                return server_side_apply(api, object)
                    .await
                    .map(Ok)
                    .map_err(kube_error("apply", kind, &name));
            }
            Holder::Free => match api.create(&PostParams::default(), object).await {
                Ok(made) => return Ok(Ok(made)),
                Err(e) if is_conflict(&e) => held = holder(api, kind, &name, stage).await?,
                Err(e) => return Err(kube_error("create", kind, &name)(e)),
            },
        }
    }
    Err(ApplyError::Contended { kind, name })
}

/// Creates `object` when its name is free; the DataStage's own object of that name is used
/// as it is, never changed (what Ringmaster builds for these depends on the DataStage's name
/// and source alone, which do not change), so the operator needs no right to patch or update
/// ServiceAccounts, Roles and RoleBindings, which it would hold in every namespace. Returns
/// the object there when it is not the DataStage's.
async fn create_unless_held<K>(
    api: &Api<K>,
    kind: &'static str,
    object: &K,
    stage: &ValidatedDataStage,
) -> Result<Option<NotOurs>, ApplyError>
where
    K: Resource + serde::Serialize + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let name = object.name_any();
    // A name taken between the read and the create is read again (as in [`write_child`]).
    for _ in 0..3 {
        match holder(api, kind, &name, stage).await? {
            Holder::Ours => return Ok(None),
            Holder::NotOurs(not_ours) => return Ok(Some(not_ours)),
            Holder::Free => match api.create(&PostParams::default(), object).await {
                Ok(_) => return Ok(None),
                Err(e) if is_conflict(&e) => continue,
                Err(e) => return Err(kube_error("create", kind, &name)(e)),
            },
        }
    }
    Err(ApplyError::Contended { kind, name })
}

/// Writes the claim, unless a claim of its name is not this DataStage's, then the volume
/// pre-bound to that claim by its UID (by name alone, it could bind a claim someone made
/// under that name meanwhile); what the claim says.
pub async fn storage(
    client: &Client,
    stage: &ValidatedDataStage,
) -> Result<ClaimState, ApplyError> {
    let ns = &stage.namespace;
    let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    let name = Names::of(stage).claim;
    let claim = match build::claim(stage) {
        Some(claim) => {
            let held = holder(&api, "PersistentVolumeClaim", &name, stage).await?;
            let written =
                match write_child(&api, "PersistentVolumeClaim", &claim, stage, held).await? {
                    Ok(written) => written,
                    Err(not_ours) => return Ok(ClaimState::NotOurs(not_ours)),
                };
            if let Some(mut volume) = build::volume(stage) {
                // Named for the DataStage's UID: no one else's. A claim waits for the volume
                // it names, so the order costs nothing.
                if let Some(claim_ref) = volume.spec.as_mut().and_then(|s| s.claim_ref.as_mut()) {
                    claim_ref.uid = written.metadata.uid.clone();
                }
                server_side_apply(&Api::<PersistentVolume>::all(client.clone()), &volume)
                    .await
                    .map_err(kube_error("apply", "PersistentVolume", &volume.name_any()))?;
            }
            Some(written)
        }
        // The user's own claim (existingClaim): only read.
        None => {
            api.get_opt(&name)
                .await
                .map_err(kube_error("read", "PersistentVolumeClaim", &name))?
        }
    };
    Ok(match claim {
        None => ClaimState::Missing,
        Some(claim) => match claim.status.and_then(|s| s.phase).as_deref() {
            Some("Bound") => ClaimState::Bound,
            phase => ClaimState::Unbound(phase.unwrap_or("Pending").to_string()),
        },
    })
}

/// Creates the stager's ServiceAccount (unless it runs as the user's), Role and RoleBinding
/// where they are missing, just before its Job is made: the first of them whose name an
/// object not this DataStage's holds, if any ([`create_unless_held`]).
async fn stager_rbac(
    client: &Client,
    stage: &ValidatedDataStage,
) -> Result<Option<NotOurs>, ApplyError> {
    let ns = &stage.namespace;
    if let Some(account) = build::service_account(stage) {
        let api: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
        if let Some(held) = create_unless_held(&api, "ServiceAccount", &account, stage).await? {
            return Ok(Some(held));
        }
    }
    let api: Api<Role> = Api::namespaced(client.clone(), ns);
    if let Some(held) = create_unless_held(&api, "Role", &build::role(stage), stage).await? {
        return Ok(Some(held));
    }
    let api: Api<RoleBinding> = Api::namespaced(client.clone(), ns);
    create_unless_held(&api, "RoleBinding", &build::role_binding(stage), stage).await
}

/// Reads the copy Job, creating it (and the stager's RBAC) first when `start` and it does
/// not exist.
pub async fn copy_state(
    client: &Client,
    stage: &ValidatedDataStage,
    inputs: &BuildInputs,
    start: bool,
) -> Result<CopyState, ApplyError> {
    let name = Names::of(stage).job;
    let jobs: Api<Job> = Api::namespaced(client.clone(), &stage.namespace);
    let mut job = jobs
        .get_opt(&name)
        .await
        .map_err(kube_error("read", "Job", &name))?;
    if job.is_none() && start {
        // An earlier copy's pods outlive their Job while they stop: two stagers must not
        // write the same folder (an existingClaim stays mounted across DataStages).
        let running = pods_of_job(client, stage, &name)
            .await?
            .into_iter()
            .find(|pod| {
                let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
                !matches!(phase, Some("Succeeded" | "Failed"))
            });
        if let Some(pod) = running {
            return Ok(CopyState::NotOurs(NotOurs {
                kind: "Pod",
                name: pod.name_any(),
                owner: format!("Job {name}"),
                earlier_stage: true,
            }));
        }
        if let Some(held) = stager_rbac(client, stage).await? {
            return Ok(CopyState::NotOurs(held));
        }
        let built = build::job(stage, inputs);
        job = match jobs.create(&PostParams::default(), &built).await {
            Ok(job) => Some(job),
            // Made by an earlier reconcile whose answer was lost: read it.
            Err(e) if is_conflict(&e) => jobs
                .get_opt(&name)
                .await
                .map_err(kube_error("read", "Job", &name))?,
            Err(e) => return Err(kube_error("create", "Job", &name)(e)),
        };
    }
    let Some(job) = job else {
        return Ok(CopyState::NotStarted);
    };
    if let Some(held) = not_ours("Job", &job.metadata, stage) {
        return Ok(CopyState::NotOurs(held));
    }
    if let Some(message) = job.annotations().get(STOPPED_ANNOTATION) {
        return Ok(CopyState::Failed {
            reason: reasons::START_TIMEOUT,
            message: message.clone(),
        });
    }
    let deadline = job.spec.as_ref().and_then(|s| s.active_deadline_seconds);
    let status = job.status.unwrap_or_default();
    let condition = |type_: &str| {
        status
            .conditions
            .iter()
            .flatten()
            .find(|c| c.type_ == type_ && c.status == "True")
            .cloned()
    };
    if condition("Complete").is_some() {
        return Ok(CopyState::Succeeded {
            start: status.start_time,
            completion: status.completion_time,
        });
    }
    if let Some(failed) = condition("Failed") {
        if failed.reason.as_deref() == Some("DeadlineExceeded") {
            let seconds = deadline.map_or("?".into(), |s| s.to_string());
            return Ok(CopyState::Failed {
                reason: reasons::DEADLINE_EXCEEDED,
                message: format!(
                    "the copy did not finish within spec.activeDeadlineSeconds ({seconds} s) \
                     and was stopped; the files copied so far stay on the share and are \
                     skipped when it runs again: delete Job {name} to run it again"
                ),
            });
        }
        let why = stager_message(client, stage, &name).await;
        let job_message = failed.message.unwrap_or_default();
        let message = match why {
            Some(why) => format!("{why} ({job_message})"),
            None => job_message,
        };
        return Ok(CopyState::Failed {
            reason: reasons::COPY_FAILED,
            message,
        });
    }
    watch_start(client, stage, &name, status.start_time).await
}

/// The running copy Job, timed while its pod waits to start ([`start::check`]); one that
/// waited past `spec.startTimeoutSeconds` is stopped and the DataStage Failed.
async fn watch_start(
    client: &Client,
    stage: &ValidatedDataStage,
    job: &str,
    start: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
) -> Result<CopyState, ApplyError> {
    let pods = pods_of_job(client, stage, job).await?;
    let pending = |pod: &&Pod| {
        pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending")
            && pod.metadata.deletion_timestamp.is_none()
    };
    let mut events = Vec::new();
    for pod in pods.iter().filter(pending) {
        events.extend(mount_failures(client, stage, &pod.name_any()).await?);
    }
    let pods: Vec<CopyPod> = pods.iter().map(|p| CopyPod::of(p, &events)).collect();
    match start::check(
        &pods,
        &crate::controller::now(),
        stage.start_timeout_seconds,
    ) {
        StartCheck::NotWaiting => Ok(CopyState::Running {
            start,
            recheck: None,
        }),
        StartCheck::Waiting(left) => Ok(CopyState::Running {
            start,
            recheck: Some(left),
        }),
        StartCheck::TimedOut(cause) => {
            let message = format!("{cause}; the Job {job} was stopped: delete it to try again");
            stop(client, stage, job, &message).await?;
            Ok(CopyState::Failed {
                reason: reasons::START_TIMEOUT,
                message,
            })
        }
    }
}

/// The mount failures the kubelet reported for pod `pod` (core Events, which the events.k8s.io
/// API serves too).
async fn mount_failures(
    client: &Client,
    stage: &ValidatedDataStage,
    pod: &str,
) -> Result<Vec<Event>, ApplyError> {
    let events: Api<Event> = Api::namespaced(client.clone(), &stage.namespace);
    let selector = format!("involvedObject.kind=Pod,involvedObject.name={pod}");
    let listed = events
        .list(&ListParams::default().fields(&selector))
        .await
        .map_err(kube_error("list", "Event", &format!("of pod {pod}")))?;
    Ok(listed
        .items
        .into_iter()
        .filter(|e| start::MOUNT_FAILURE_REASONS.contains(&e.reason.as_deref().unwrap_or_default()))
        .collect())
}

/// Stops the copy Job: suspended (the Job controller deletes its pod), with why in
/// [`STOPPED_ANNOTATION`], which keeps the DataStage Failed.
async fn stop(
    client: &Client,
    stage: &ValidatedDataStage,
    job: &str,
    message: &str,
) -> Result<(), ApplyError> {
    let jobs: Api<Job> = Api::namespaced(client.clone(), &stage.namespace);
    let patch = serde_json::json!({
        "metadata": { "annotations": { STOPPED_ANNOTATION: message } },
        "spec": { "suspend": true },
    });
    jobs.patch(job, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(drop)
        .map_err(kube_error("stop", "Job", job))
}

/// The pods the Job controller made for a Job named `job` (this one's, or an earlier one's
/// still stopping).
async fn pods_of_job(
    client: &Client,
    stage: &ValidatedDataStage,
    job: &str,
) -> Result<Vec<Pod>, ApplyError> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &stage.namespace);
    pods.list(&ListParams::default().labels(&format!("batch.kubernetes.io/job-name={job}")))
        .await
        .map(|list| list.items)
        .map_err(kube_error("list", "Pod", &format!("of Job {job}")))
}

/// The last failed stager pod's termination message (the stager's own error), if any.
/// Read once, when the Job has failed.
async fn stager_message(client: &Client, stage: &ValidatedDataStage, job: &str) -> Option<String> {
    let pods = pods_of_job(client, stage, job).await.ok()?;
    pods.iter()
        .filter_map(|pod| {
            let terminated = pod
                .status
                .as_ref()?
                .container_statuses
                .as_ref()?
                .iter()
                .find_map(|c| c.state.as_ref()?.terminated.clone())?;
            if terminated.exit_code == 0 {
                return None;
            }
            // The stager's own outcome when it wrote one, else the log's tail or the reason.
            let text = match terminated.message.as_deref().and_then(Outcome::parse) {
                Some(Outcome::Failed { error }) => error,
                _ => terminated
                    .message
                    .filter(|m| !m.trim().is_empty())
                    .or(terminated.reason)
                    .unwrap_or_else(|| format!("exit code {}", terminated.exit_code)),
            };
            Some((
                terminated.finished_at,
                format!("pod {}: {}", pod.name_any(), text.trim()),
            ))
        })
        .max_by(|a, b| a.0.cmp(&b.0))
        .map(|(_, text)| text)
}

/// The volume name of a DataStage from its object alone (for deletion, when the spec may
/// no longer validate): only NFS and Azure Files destinations have one.
pub fn volume_of(stage: &DataStage) -> Option<String> {
    let dest = &stage.spec.destination;
    (dest.existing_claim.is_none()).then(|| build::volume_name(&stage.uid().unwrap_or_default()))
}
