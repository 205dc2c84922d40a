//! The TrainingJob controller: validate → (dereference the DataStage) → plan → build/apply →
//! status. Pods are read from a shared cache, so a reconcile costs no reads of the API.

pub mod admission;
pub mod apply;
pub mod build;
pub mod condition_names;
pub mod names;
pub mod observe;
pub mod plan;
pub mod pool;
pub mod queue;
pub mod recent;
pub mod spec;
pub mod state;
pub mod status;
pub mod validate;

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::api::DeleteParams;
use kube::core::error_boundary::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource, ResourceExt};

use super::{Context, Error, StatusWrite, conditions, is_warning, now, object_key};
use crate::api::{
    DataStage, DataStagePhase, TrainingJob, TrainingJobPhase, TrainingJobStatus, condition_reasons,
};
use crate::validation::FieldErrors;
use build::BuildInputs;
use observe::Observed;
use plan::PlanInputs;
use state::{DataState, NameHolder};

/// The controller's name in metrics and logs.
pub const CONTROLLER: &str = "trainingjob";

/// Reconciles one TrainingJob.
pub async fn reconcile(
    object: Arc<DeserializeGuard<TrainingJob>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    if !ctx.caches_synced() {
        // Planned from caches without the job's pods, it would make pods that exist.
        return Ok(Action::requeue(std::time::Duration::from_millis(500)));
    }
    let _timer = ctx.metrics.reconcile_started(CONTROLLER);
    let key = object_key(object.as_ref());
    let action = match &object.0 {
        Err(invalid) => {
            let errors = FieldErrors::one(
                "",
                format!(
                    "the object does not match the TrainingJob schema: {}",
                    invalid.error
                ),
            );
            report_invalid(&ctx, &object, &errors).await?
        }
        Ok(job) if job.meta().deletion_timestamp.is_some() => {
            let finalized = pool::finalize(&ctx.client, ctx.config.arm.as_ref(), job)
                .await
                .map_err(|source| Error::Pool {
                    name: key.clone(),
                    source,
                })?;
            match finalized {
                pool::Finalized::Done => Action::await_change(),
                pool::Finalized::Waiting => Action::requeue(std::time::Duration::from_secs(10)),
                pool::Finalized::Stuck(problem) => {
                    // Why the job does not go away, on it (the recorder counts repeats).
                    ctx.warn(job, condition_reasons::NODE_POOL_DELETE_FAILED, &problem)
                        .await;
                    Action::requeue(std::time::Duration::from_secs(10))
                }
                pool::Finalized::LeftBehind(problem) => {
                    ctx.warn(job, condition_reasons::NODE_POOL_LEFT_BEHIND, &problem)
                        .await;
                    Action::await_change()
                }
            }
        }
        Ok(job) => match validate::validate(job) {
            Err(errors) => report_invalid(&ctx, &object, &errors).await?,
            Ok(validated) => run(&ctx, &object, job, &validated).await?,
        },
    };
    ctx.succeeded(&key);
    Ok(action)
}

async fn report_invalid(
    ctx: &Context,
    object: &DeserializeGuard<TrainingJob>,
    errors: &FieldErrors,
) -> Result<Action, Error> {
    tracing::info!(job = %object_key(object), %errors, "invalid TrainingJob spec");
    let old = object
        .0
        .as_ref()
        .ok()
        .and_then(|j| j.status.clone())
        .unwrap_or_default();
    let new = status::invalid(&old, object.meta().generation, errors, &now());
    if new != old {
        let value = serde_json::to_value(&new).expect("status serializes");
        ctx.write_status(
            object,
            &old.conditions,
            &new.conditions,
            value,
            StatusWrite::Replace,
            is_warning,
        )
        .await?;
    }
    Ok(Action::await_change())
}

/// The referenced DataStage's state, from the cache (no read of the API server).
fn data_state(ctx: &Context, job: &spec::ValidatedTrainingJob) -> DataState {
    let Some(reference) = &job.data else {
        return DataState::NotNeeded;
    };
    let key = ObjectRef::<DataStage>::new(&reference.name).within(&job.namespace);
    match ctx.data_stages.get(&key).and_then(|s| s.status.clone()) {
        Some(status) if status.phase == DataStagePhase::Ready && status.claim_name.is_some() => {
            DataState::Ready {
                claim: status.claim_name.unwrap_or_default(),
            }
        }
        Some(status) if status.phase == DataStagePhase::Failed => DataState::Waiting {
            message: format!(
                "DataStage {} failed ({}): fix it and make it again; the job starts once it is Ready",
                reference.name,
                conditions::find(&status.conditions, crate::api::condition_types::READY)
                    .map(|c| c.message.as_str())
                    .unwrap_or("no reason given")
            ),
            failed: true,
        },
        Some(status) => DataState::Waiting {
            message: format!("DataStage {} is {:?}", reference.name, status.phase),
            failed: false,
        },
        None => DataState::Waiting {
            message: format!(
                "DataStage {} does not exist yet (or has no status)",
                reference.name
            ),
            failed: false,
        },
    }
}

/// The pods from the shared cache that carry the job's name label (same namespace), in one
/// pass: those owned by this UID, and who holds the names of the others (an earlier job of
/// the same name whose pods are still terminating, or pods left without a controller).
fn pods_of(ctx: &Context, job: &TrainingJob) -> (Vec<Arc<Pod>>, BTreeMap<String, NameHolder>) {
    let namespace = job.namespace();
    let name = job.name_any();
    let uid = job.uid();
    let now = now();
    let (ours, others): (Vec<Arc<Pod>>, Vec<Arc<Pod>>) = ctx
        .pods
        .state()
        .into_iter()
        .filter(|pod| {
            pod.metadata.namespace == namespace
                && pod.labels().get(names::JOB_NAME_LABEL) == Some(&name)
        })
        .partition(|pod| {
            pod.owner_references()
                .iter()
                .any(|o| o.controller == Some(true) && Some(&o.uid) == uid.as_ref())
        });
    let holders = others
        .iter()
        .map(|pod| (pod.name_any(), NameHolder::of(pod, &name, &now)))
        .collect();
    (ours, holders)
}

async fn run(
    ctx: &Context,
    object: &DeserializeGuard<TrainingJob>,
    job: &TrainingJob,
    validated: &spec::ValidatedTrainingJob,
) -> Result<Action, Error> {
    let uid = job.uid().unwrap_or_default();
    let clock = std::time::Instant::now();
    // The status written moments ago, when the cache does not show it yet.
    let old = ctx
        .recent
        .latest_status(&uid, &job.status.clone().unwrap_or_default(), clock);
    let generation = job.meta().generation;
    let key = object_key(object);
    let now = now();
    let data = data_state(ctx, validated);
    let data_claim = match &data {
        DataState::Ready { claim } => Some(claim.clone()),
        _ => None,
    };
    let finished = matches!(
        old.phase,
        TrainingJobPhase::Succeeded | TrainingJobPhase::Failed
    );
    let (pods, names_in_use) = pods_of(ctx, job);
    let looked = admission::look(
        ctx,
        job,
        validated,
        &data,
        &BuildInputs {
            attempt: old.restarts,
            data_claim: data_claim.clone(),
            ..BuildInputs::default()
        },
        finished,
        !pods.is_empty(),
    )
    .await;
    let (queue, workload) = (looked.state, looked.workload);
    let pod_refs: Vec<&Pod> = pods.iter().map(AsRef::as_ref).collect();
    let observed = Observed::sort(&pod_refs, validated.workers, old.restarts);
    let pool = pool::look(
        &ctx.client,
        ctx.config.arm.as_ref(),
        job,
        validated,
        observed.gang_exists(),
    )
    .await
    .map_err(|source| Error::Pool {
        name: format!("{}/{}", validated.namespace, validated.name),
        source,
    })?;
    let mut plan = plan::plan(&PlanInputs {
        job: validated,
        generation,
        status: &old,
        observed: &observed,
        data: &data,
        pool: &pool.state,
        queue: &queue,
        now: &now,
        restart_backoff: ctx.config.restart_backoff,
    });
    plan::hold_back_names_in_use(
        &mut plan,
        &validated.name,
        &names_in_use,
        old.start_time.as_ref(),
    );
    // Pods made moments ago that the cache does not show yet are not made again.
    let unseen = ctx
        .recent
        .pods_not_yet_seen(&uid, plan.restarts, &pod_refs, clock);
    let worker_held_back = |i: &u32| unseen.contains(&names::worker_pod(&validated.name, *i));
    let launcher_held_back =
        plan.create_launcher && unseen.contains(&names::launcher_pod(&validated.name));
    if launcher_held_back || plan.create_workers.iter().any(worker_held_back) {
        // Looked at again when the memory fades, should the cache never show them.
        plan.requeue(recent::FRESH_FOR);
    }
    plan.create_workers.retain(|i| !worker_held_back(i));
    if launcher_held_back {
        plan.create_launcher = false;
    }
    let mut new = status::from_plan(&old, generation, &plan, &observed, &now);
    if pool.status.is_some() {
        new.node_pool = pool.status.clone();
    }
    let inputs = BuildInputs {
        attempt: plan.restarts,
        data_claim,
        placement: match &queue {
            state::QueueState::Admitted { placement, .. } => placement.clone(),
            _ => state::Placement::default(),
        },
        gang_scheduler: ctx.config.gang_scheduler.clone(),
        naming: names::ChildNaming::of_gang(pod_refs.iter().copied(), plan.restarts),
        launcher_priority_class: ctx.config.launcher_priority_class.clone(),
    };
    // A restart is recorded before its pods are deleted, so a crash in between cannot lose
    // it; everything else is carried out before the status that reports it.
    let restarting = plan.restarts != old.restarts;
    if restarting {
        write_status(ctx, object, &old, &new, &plan.message, plan.about.as_ref()).await?;
        ctx.status_written(&key);
        ctx.metrics.training_job_restarted();
    }
    // The Secret and Service go out with a gang's workers (the launcher comes later, into a
    // gang that has them) and with a new spec, once.
    // Also after a refused write of the Secret, Service or PodGroup: they may not have
    // followed this spec.
    let spec_changed = (old.observed_generation.is_some() && old.observed_generation != generation)
        || conditions::rejected_child(&old.conditions).is_some_and(apply::refused_children);
    let children =
        if ctx
            .recent
            .children_fresh(&uid, generation, plan.restarts, inputs.naming, clock)
        {
            apply::Children::Keep
        } else if spec_changed {
            apply::Children::Update
        } else if !plan.create_workers.is_empty() {
            apply::Children::Ensure
        } else {
            apply::Children::Keep
        };
    let mut written = apply::Written::default();
    let applied = apply::execute(
        &ctx.client,
        validated,
        &plan,
        &inputs,
        children,
        &mut written,
    )
    .await;
    // Remembered also when something failed after: a retry does not write it again.
    if written.children {
        ctx.recent
            .children_applied(&uid, generation, plan.restarts, inputs.naming, clock);
    }
    let made_pods = !written.pods.is_empty();
    let launcher_made = written.pods.contains(&names::launcher_pod(&validated.name));
    let workers_made = written.pods.len() - usize::from(launcher_made);
    ctx.recent
        .pods_made(&uid, plan.restarts, written.pods, clock);
    if !written.held.is_empty() {
        // Names only the create's 409 showed taken (by pods the cache does not hold): said
        // as those the cache shows are.
        plan::hold_back_names_in_use(
            &mut plan,
            &validated.name,
            &written.held,
            old.start_time.as_ref(),
        );
        new = status::from_plan(&old, generation, &plan, &observed, &now);
        if pool.status.is_some() {
            new.node_pool = pool.status.clone();
        }
    }
    status::count_made(&mut new, workers_made, launcher_made);
    if let Err(source) = applied {
        if plan.create_launcher && !launcher_made {
            // The job did not start: its deadline does not run yet.
            new.start_time = old.start_time.clone();
        }
        let written = if restarting { &new } else { &old };
        return Err(rejected(
            ctx,
            object,
            (written, &new),
            &plan.message,
            validated,
            source,
        )
        .await);
    }
    // Progress alone (worker counts, messages) is held back a little and goes out with the
    // next write: one write per pod event would cost the API server most of a job's requests.
    let progress_wait = if !restarting && status::is_progress_only(&old, &new) {
        ctx.progress_wait(&key)
    } else {
        None
    };
    if !restarting && progress_wait.is_none() {
        write_status(ctx, object, &old, &new, &plan.message, plan.about.as_ref()).await?;
        ctx.status_written(&key);
    }
    // Kueue is told what it waits for: PodsReady, the quota of an evicted job whose pods are
    // all gone (also those terminating, or made moments ago and not in the cache yet), and
    // the end of a finished job. A Kueue write that failed before the plan is reported now.
    let pods_exist = !pods.is_empty() || !unseen.is_empty() || made_pods;
    if let Some(source) = looked.error {
        return Err(rejected(ctx, object, (&new, &new), &plan.message, validated, source).await);
    }
    if let Err(source) = admission::settle(
        ctx,
        validated,
        workload.as_deref(),
        plan.phase,
        &plan.message,
        pods_exist,
        &now,
    )
    .await
    {
        return Err(rejected(ctx, object, (&new, &new), &plan.message, validated, source).await);
    }
    // Time to Running, for first runs only (not restarts or resumes).
    if new.phase == TrainingJobPhase::Running
        && old.phase == TrainingJobPhase::Starting
        && new.restarts == 0
        && let Some(created) = job.meta().creation_timestamp.as_ref()
    {
        ctx.metrics
            .training_job_running_after(now.0.duration_since(created.0).as_secs_f64());
    }
    if plan.delete_job {
        let api: Api<TrainingJob> = Api::namespaced(ctx.client.clone(), &validated.namespace);
        match api
            .delete(&validated.name, &DeleteParams::background())
            .await
        {
            Ok(_) => {
                tracing::info!(job = %validated.name, "deleted after runPolicy.ttlSecondsAfterFinished")
            }
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(source) => {
                return Err(Error::Delete {
                    kind: "TrainingJob",
                    name: format!("{}/{}", validated.namespace, validated.name),
                    source,
                });
            }
        }
        return Ok(Action::await_change());
    }
    Ok(
        match [
            plan.requeue_after,
            pool.requeue,
            progress_wait,
            looked.requeue,
        ]
        .into_iter()
        .flatten()
        .min()
        {
            Some(after) => Action::requeue(after),
            None => Action::await_change(),
        },
    )
}

/// The error of a write the job needed; when the API server refused it (a missing
/// PriorityClass, an exhausted ResourceQuota, Kueue's webhook refusing the Workload), the
/// refusal is put on the job's status (`written` is what it says now) and a Warning Event,
/// and the write is retried with backoff: it can be fixed meanwhile.
async fn rejected(
    ctx: &Context,
    object: &DeserializeGuard<TrainingJob>,
    (written, planned): (&TrainingJobStatus, &TrainingJobStatus),
    phase_message: &str,
    validated: &spec::ValidatedTrainingJob,
    source: apply::ApplyError,
) -> Error {
    if let Some(message) = source.rejection() {
        let generation = object.meta().generation;
        let stalled = status::child_rejected(planned, generation, &message, &now());
        if let Err(error) = write_status(ctx, object, written, &stalled, phase_message, None).await
        {
            return error;
        }
        if conditions::rejected_child(&written.conditions) != Some(message.as_str()) {
            ctx.warn(object, condition_reasons::CHILD_REJECTED, &message)
                .await;
        }
    }
    Error::Apply {
        name: format!("{}/{}", validated.namespace, validated.name),
        source,
    }
}

/// Writes the status when it changed, with an Event when the phase changed (and only then:
/// the conditions move with the phase, and an invalid spec is reported by
/// [`report_invalid`]).
async fn write_status(
    ctx: &Context,
    object: &DeserializeGuard<TrainingJob>,
    old: &TrainingJobStatus,
    new: &TrainingJobStatus,
    message: &str,
    about: Option<&observe::PodRef>,
) -> Result<(), Error> {
    if new == old {
        return Ok(());
    }
    let value = serde_json::to_value(new).expect("status serializes");
    ctx.write_status(object, &[], &[], value, StatusWrite::Replace, is_warning)
        .await?;
    ctx.recent.status_written(
        &object.uid().unwrap_or_default(),
        new,
        std::time::Instant::now(),
    );
    let related = about.map(|pod| pod_reference(object, pod));
    publish_phase_event(ctx, object, old.phase, new.phase, message, related.clone()).await;
    publish_blocked_event(ctx, object, old, new, related).await;
    Ok(())
}

/// The pod an Event's words are about, as its related object, in the job's namespace.
fn pod_reference(
    job: &DeserializeGuard<TrainingJob>,
    pod: &observe::PodRef,
) -> k8s_openapi::api::core::v1::ObjectReference {
    k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: job.namespace(),
        name: Some(pod.name.clone()),
        uid: pod.uid.clone(),
        ..Default::default()
    }
}

/// A Warning Event when the job becomes blocked on something a person must fix (a pod that
/// cannot be scheduled, an image that cannot be pulled, a container that cannot start, a
/// DataStage that failed), once per kind of block: the kubelet's and the scheduler's retries
/// do not repeat it.
async fn publish_blocked_event(
    ctx: &Context,
    object: &DeserializeGuard<TrainingJob>,
    old: &TrainingJobStatus,
    new: &TrainingJobStatus,
    related: Option<k8s_openapi::api::core::v1::ObjectReference>,
) {
    use crate::api::condition_types::READY;
    let Some(now) = conditions::find(&new.conditions, READY) else {
        return;
    };
    if condition_names::reasons::BLOCKING.contains(&now.reason.as_str())
        && conditions::find(&old.conditions, READY).is_none_or(|before| before.reason != now.reason)
    {
        ctx.warn_about(object, &now.reason, &now.message, related)
            .await;
    }
}

/// One Event per phase change: Warning for Restarting and Failed.
async fn publish_phase_event(
    ctx: &Context,
    object: &DeserializeGuard<TrainingJob>,
    old: TrainingJobPhase,
    new: TrainingJobPhase,
    message: &str,
    related: Option<k8s_openapi::api::core::v1::ObjectReference>,
) {
    if old == new {
        return;
    }
    let warning = matches!(new, TrainingJobPhase::Restarting | TrainingJobPhase::Failed);
    let event = Event {
        type_: if warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: format!("{new:?}"),
        note: Some(message.chars().take(1000).collect()),
        action: "Reconcile".into(),
        // Each restart's cause is a pod of its own: its own Event, with its own note.
        secondary: related,
    };
    if let Err(error) = ctx.recorder.publish(&event, &object.object_ref(&())).await {
        tracing::warn!(%error, "could not publish Event");
    }
}
