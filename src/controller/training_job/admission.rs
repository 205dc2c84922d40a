//! The Kueue step of the TrainingJob controller: for a job labelled
//! `kueue.x-k8s.io/queue-name`, makes its Workload (once its data is there), keeps it true to
//! the job (its queue, `runPolicy.suspend`, a re-made Workload when the pods' shape changed
//! before they run) and says where the job stands (see [`queue`]); after the plan is carried
//! out, tells Kueue what it waits for: PodsReady, an evicted job's quota given back once its
//! pods are gone, Finished when the job ends. Workloads and ResourceFlavors are read from
//! the operator's caches.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};

use super::apply::{ApplyError, kube_error};
use super::build::BuildInputs;
use super::names;
use super::queue::{self, Priority};
use super::snapshot::Snapshot;
use super::spec::ValidatedTrainingJob;
use super::state::DataState;
use super::state::QueueState;
use crate::api::{TrainingJob, TrainingJobPhase};
use crate::controller::{Context, FIELD_MANAGER, is_conflict, is_not_found};
use crate::kueue::{PRIORITY_CLASS_LABEL, ResourceFlavor, Workload, conditions as wl};

/// How soon a job waiting for its priority class, or for an earlier job's Workload to go,
/// looks again (neither is watched).
const PRIORITY_CLASS_RETRY: Duration = Duration::from_secs(30);

fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
    }
}

/// What the Kueue step found, and what it could not do.
pub struct KueueLook {
    /// Where the job stands, from the cached Workload.
    pub state: QueueState,
    /// The job's Workload as cached.
    pub workload: Option<Arc<Workload>>,
    /// Look again after this long even if nothing changes.
    pub requeue: Option<Duration>,
    /// A write that failed: reported after the plan, which still runs from the cache (a
    /// suspended or evicted job's pods go even while Kueue's webhook does not answer).
    pub error: Option<ApplyError>,
}

/// What the Kueue step reads: the job's queue, and its Workload from the cache.
pub struct KueueSeen {
    /// The queue the job's label names, if any.
    pub queue: Option<String>,
    /// Whether the operator runs with its Kueue integration.
    pub integration: bool,
    /// The Workload of the job's name, as cached (maybe an earlier job's).
    pub workload: Option<Arc<Workload>>,
}

/// What the Kueue step decides to write (at most one write a reconcile).
#[derive(Clone, Debug, PartialEq)]
pub enum WorkloadWrite {
    /// Delete the Workload: the job left its queue, or its pods' shape changed before they
    /// ran (a new one is made on the next look).
    Delete,
    /// Make the job's Workload in this queue (its priority class read first).
    Make {
        /// The queue.
        queue: String,
    },
    /// Merge-patch the Workload: `runPolicy.suspend` on `spec.active`, the queue while it
    /// waits.
    Patch(serde_json::Value),
}

/// What the Kueue step decided: the write, or the state it settles on without one.
#[derive(Clone, Debug, PartialEq)]
pub enum KueueDecision {
    /// Not queued; `write` is a Workload left behind to delete.
    NotQueued { write: Option<WorkloadWrite> },
    /// Queued while this operator runs without the integration.
    IntegrationOff { queue: String },
    /// The Workload of this name is an earlier job's: wait for it to go.
    EarlierJobs { workload: String },
    /// Queued: the write (if any), then the state from the cached Workload.
    Queued {
        queue: String,
        write: Option<WorkloadWrite>,
    },
}

/// Where the job stands with Kueue, after making or mending its Workload when needed:
/// read → decide → write.
pub async fn reconcile(
    ctx: &Context,
    job: &TrainingJob,
    validated: &ValidatedTrainingJob,
    seen: &Snapshot,
) -> KueueLook {
    let found = read(ctx, job, validated);
    let inputs = BuildInputs {
        attempt: seen.old.restarts,
        data_claim: seen.data_claim(),
        ..BuildInputs::default()
    };
    let finished = matches!(
        seen.old.phase,
        TrainingJobPhase::Succeeded | TrainingJobPhase::Failed
    );
    let facts = Facts {
        finished,
        data_waiting: matches!(seen.data, DataState::Waiting { .. }),
        gang_exists: !seen.pods.is_empty(),
    };
    let decision = decide(&found, validated, &inputs, facts);
    write(ctx, job, validated, &inputs, found.workload, decision).await
}

/// The job's queue and its Workload, from the job's label and the cache.
pub fn read(ctx: &Context, job: &TrainingJob, validated: &ValidatedTrainingJob) -> KueueSeen {
    let name = names::workload(&validated.name, &validated.uid);
    KueueSeen {
        queue: queue::queue_name(job).map(str::to_string),
        integration: ctx.config.kueue,
        workload: ctx
            .workloads
            .get(&ObjectRef::new(&name).within(&validated.namespace)),
    }
}

/// What else the Kueue step decides on.
#[derive(Clone, Copy, Debug, Default)]
pub struct Facts {
    /// The job has finished.
    pub finished: bool,
    /// It waits for its DataStage (no Workload, so it holds no quota).
    pub data_waiting: bool,
    /// Pods of its gang exist (a Workload whose shape changed is not made again then).
    pub gang_exists: bool,
}

/// The Kueue step's choice. Pure.
pub fn decide(
    found: &KueueSeen,
    validated: &ValidatedTrainingJob,
    inputs: &BuildInputs,
    facts: Facts,
) -> KueueDecision {
    let workload = found.workload.as_deref();
    let Some(queue_name) = found.queue.clone() else {
        // The label was taken off: the job leaves Kueue, and so does its quota.
        let left_behind = workload.is_some_and(|w| !w.is(wl::FINISHED));
        return KueueDecision::NotQueued {
            write: left_behind.then_some(WorkloadWrite::Delete),
        };
    };
    if !found.integration {
        return KueueDecision::IntegrationOff { queue: queue_name };
    }
    if let Some(other) =
        workload.filter(|w| !w.owner_references().iter().any(|o| o.uid == validated.uid))
    {
        return KueueDecision::EarlierJobs {
            workload: other.name_any(),
        };
    }
    let write = match workload {
        // Made once the data is there: a job waiting for its data holds no quota.
        None if !facts.finished && !facts.data_waiting => Some(WorkloadWrite::Make {
            queue: queue_name.clone(),
        }),
        Some(workload) if !facts.finished => {
            mend(validated, &queue_name, inputs, workload, facts.gang_exists)
        }
        _ => None,
    };
    KueueDecision::Queued {
        queue: queue_name,
        write,
    }
}

/// Keeps a Workload true to its job: a new Workload when the pods' shape changed before any
/// of them ran, else `runPolicy.suspend` on `spec.active` and the queue while it waits.
fn mend(
    validated: &ValidatedTrainingJob,
    queue_name: &str,
    inputs: &BuildInputs,
    workload: &Workload,
    gang_exists: bool,
) -> Option<WorkloadWrite> {
    if !gang_exists {
        // The priority is not compared: a class's value may change on its own.
        let desired = queue::workload(validated, queue_name, inputs, None);
        if queue::outdated(workload, &desired) {
            tracing::info!(job = %validated.name, workload = %workload.name_any(), "the pods' shape changed: the Workload is made again");
            return Some(WorkloadWrite::Delete);
        }
    }
    let mut patch = queue::activation_patch(workload, validated.run_policy.suspend);
    if workload.spec.queue_name.as_deref() != Some(queue_name) && !workload.has_quota_reservation()
    {
        let patch = patch.get_or_insert_with(|| serde_json::json!({}));
        patch["spec"]["queueName"] = queue_name.into();
        patch["metadata"]["labels"][crate::kueue::QUEUE_NAME_LABEL] = queue_name.into();
    }
    patch.map(WorkloadWrite::Patch)
}

/// Carries the decision out and says where the job stands.
async fn write(
    ctx: &Context,
    job: &TrainingJob,
    validated: &ValidatedTrainingJob,
    inputs: &BuildInputs,
    workload: Option<Arc<Workload>>,
    decision: KueueDecision,
) -> KueueLook {
    let mut look = KueueLook {
        state: QueueState::NotQueued,
        workload: None,
        requeue: None,
        error: None,
    };
    let (queue_name, write) = match decision {
        KueueDecision::NotQueued { write } => {
            if let (Some(WorkloadWrite::Delete), Some(workload)) = (write, &workload) {
                look.error = delete_workload(ctx, workload).await.err();
            }
            return look;
        }
        KueueDecision::IntegrationOff { queue } => {
            look.state = QueueState::IntegrationOff { queue };
            return look;
        }
        KueueDecision::EarlierJobs { workload } => {
            look.state = QueueState::Waiting {
                message: format!(
                    "Workload {workload} belongs to an earlier job of this name: waiting for it to go"
                ),
            };
            look.requeue = Some(PRIORITY_CLASS_RETRY);
            return look;
        }
        KueueDecision::Queued { queue, write } => (queue, write),
    };
    let written = match (write, &workload) {
        (Some(WorkloadWrite::Make { queue }), _) => {
            make_workload(ctx, job, validated, &queue, inputs).await
        }
        (Some(WorkloadWrite::Delete), Some(workload)) => {
            delete_workload(ctx, workload).await.map(|()| None)
        }
        (Some(WorkloadWrite::Patch(patch)), Some(workload)) => {
            patch_workload(ctx, workload, &patch).await.map(|()| None)
        }
        _ => Ok(None),
    };
    match written {
        Ok(Some(missing_class)) => {
            look.state = QueueState::Waiting {
                message: format!(
                    "{missing_class} does not exist: the job is not queued until it does"
                ),
            };
            look.requeue = Some(PRIORITY_CLASS_RETRY);
        }
        written => {
            look.error = written.err();
            look.state = queue::state(&queue_name, workload.as_deref(), |name| {
                ctx.flavors
                    .get(&ObjectRef::<ResourceFlavor>::new(name))
                    .map(|f| f.spec.clone())
            });
        }
    }
    look.workload = workload;
    look
}

/// Merge-patches the job's Workload.
async fn patch_workload(
    ctx: &Context,
    workload: &Workload,
    patch: &serde_json::Value,
) -> Result<(), ApplyError> {
    let api: Api<Workload> = Api::namespaced(
        ctx.client.clone(),
        &workload.namespace().unwrap_or_default(),
    );
    let name = workload.name_any();
    api.patch(&name, &patch_params(), &Patch::Merge(patch))
        .await
        .map_err(kube_error("patching", "Workload", &name))?;
    Ok(())
}

/// Makes the job's Workload; `Ok(Some(class))` names its priority class when that does not
/// exist (no Workload is made without it).
async fn make_workload(
    ctx: &Context,
    job: &TrainingJob,
    validated: &ValidatedTrainingJob,
    queue_name: &str,
    inputs: &BuildInputs,
) -> Result<Option<String>, ApplyError> {
    let priority = match priority(ctx, job, validated).await? {
        Ok(priority) => priority,
        Err(missing) => return Ok(Some(missing)),
    };
    let object = queue::workload(validated, queue_name, inputs, priority.as_ref());
    let api: Api<Workload> = Api::namespaced(ctx.client.clone(), &validated.namespace);
    match api.create(&PostParams::default(), &object).await {
        Ok(_) => Ok(None),
        // Made by an earlier reconcile that the cache does not show yet.
        Err(e) if is_conflict(&e) => Ok(None),
        Err(e) => Err(kube_error("creating", "Workload", &object.name_any())(e)),
    }
}

async fn delete_workload(ctx: &Context, workload: &Workload) -> Result<(), ApplyError> {
    let api: Api<Workload> = Api::namespaced(
        ctx.client.clone(),
        &workload.namespace().unwrap_or_default(),
    );
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: workload.uid(),
            resource_version: None,
        }),
        ..DeleteParams::background()
    };
    match api.delete(&workload.name_any(), &params).await {
        Ok(_) => Ok(()),
        Err(e) if is_not_found(&e) || is_conflict(&e) => Ok(()),
        Err(e) => Err(kube_error("deleting", "Workload", &workload.name_any())(e)),
    }
}

/// The job's priority class: its WorkloadPriorityClass label, else the workers'
/// PriorityClass, else none. `Err(what)` names a class that does not exist.
async fn priority(
    ctx: &Context,
    job: &TrainingJob,
    validated: &ValidatedTrainingJob,
) -> Result<Result<Option<Priority>, String>, ApplyError> {
    if let Some(class) = job.labels().get(PRIORITY_CLASS_LABEL) {
        let resource = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", "WorkloadPriorityClass"),
            "workloadpriorityclasses",
        );
        let api: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &resource);
        return match api.get(class).await {
            Ok(object) => Ok(Ok(Some(Priority {
                class: class.clone(),
                value: object.data["value"]
                    .as_i64()
                    .and_then(|v| i32::try_from(v).ok())
                    .unwrap_or_default(),
                workload_class: true,
            }))),
            Err(e) if is_not_found(&e) => Ok(Err(format!(
                "WorkloadPriorityClass {class} (label {PRIORITY_CLASS_LABEL})"
            ))),
            Err(e) => Err(kube_error("reading", "WorkloadPriorityClass", class)(e)),
        };
    }
    let Some(class) = &validated.worker.priority_class_name else {
        return Ok(Ok(None));
    };
    let api: Api<PriorityClass> = Api::all(ctx.client.clone());
    match api.get(class).await {
        Ok(object) => Ok(Ok(Some(Priority {
            class: class.clone(),
            value: object.value.unwrap_or_default(),
            workload_class: false,
        }))),
        Err(e) if is_not_found(&e) => Ok(Err(format!(
            "PriorityClass {class} (worker.priorityClassName)"
        ))),
        Err(e) => Err(kube_error("reading", "PriorityClass", class)(e)),
    }
}

/// After the plan, what Kueue waits for: Finished when the job ended; once an evicted job's
/// pods are all gone (`pods_exist` counts those terminating and those made moments ago that
/// the cache does not show; the API server is asked once more, since an operator that just
/// restarted remembers nothing), its quota given back; else PodsReady.
pub async fn settle(
    ctx: &Context,
    validated: &ValidatedTrainingJob,
    workload: Option<&Workload>,
    phase: TrainingJobPhase,
    message: &str,
    pods_exist: bool,
    now: &Time,
) -> Result<(), ApplyError> {
    let Some(workload) = workload else {
        return Ok(());
    };
    let patch = match phase {
        TrainingJobPhase::Succeeded | TrainingJobPhase::Failed => {
            queue::finish_patch(workload, phase == TrainingJobPhase::Succeeded, message, now)
        }
        _ => match queue::release_patch(workload, now) {
            Some(_) if pods_exist || any_pod(ctx, validated).await? => None,
            Some(release) => Some(release),
            None => queue::pods_ready_patch(workload, phase == TrainingJobPhase::Running, now),
        },
    };
    let Some(patch) = patch else {
        return Ok(());
    };
    let api: Api<Workload> = Api::namespaced(
        ctx.client.clone(),
        &workload.namespace().unwrap_or_default(),
    );
    match api
        .patch_status(
            &workload.name_any(),
            &patch_params(),
            &Patch::<()>::Json(patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        // The Workload changed since the cache saw it (the patch tests its resourceVersion):
        // its newer version wakes the job again.
        Err(kube::Error::Api(s))
            if s.code == 422 && s.message.contains("/metadata/resourceVersion") =>
        {
            tracing::debug!(workload = %workload.name_any(), "Workload changed meanwhile; looked at again");
            Ok(())
        }
        Err(e) => Err(kube_error(
            "updating the status of",
            "Workload",
            &workload.name_any(),
        )(e)),
    }
}

/// Whether the API server (not the cache) knows a pod of the job.
async fn any_pod(ctx: &Context, job: &ValidatedTrainingJob) -> Result<bool, ApplyError> {
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &job.namespace);
    let pods = api
        .list_metadata(&ListParams::default().labels(&format!(
            "{}={}",
            names::JOB_NAME_LABEL,
            job.name
        )))
        .await
        .map_err(kube_error("listing", "Pod", &job.name))?;
    Ok(pods
        .items
        .iter()
        .any(|p| p.owner_references().iter().any(|o| o.uid == job.uid)))
}
