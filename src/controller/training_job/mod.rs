//! The TrainingJob controller: validate → (dereference the DataStage) → plan → build/apply →
//! status. Pods are read from a shared cache, so a reconcile costs no reads of the API.

pub mod admission;
pub mod apply;
pub mod build;
pub mod condition_names;
pub mod live;
pub mod names;
pub mod observe;
pub mod plan;
pub mod pod_index;
pub mod pool;
pub mod queue;
pub mod recent;
pub mod snapshot;
pub mod spec;
pub mod state;
pub mod status;
pub mod sweep;
pub mod validate;
pub mod worker_dns;

use std::sync::Arc;

use kube::api::DeleteParams;
use kube::core::error_boundary::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::{Api, Resource, ResourceExt};

use super::{Context, Error, Fence, StatusWrite, conditions, is_warning, now, object_key};
use crate::api::{TrainingJob, TrainingJobPhase, TrainingJobStatus, condition_reasons};
use crate::validation::FieldErrors;
use build::BuildInputs;
use snapshot::Snapshot;

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
    let pool_error = |source| Error::Pool {
        name: key.clone(),
        source,
    };
    let action = match &object.0 {
        // Its pool goes all the same: the finalizer must not hold a job that cannot be read.
        Err(invalid) if invalid.metadata.deletion_timestamp.is_some() => {
            let finalized =
                pool::finalize_unreadable(&ctx.client, ctx.config.arm.as_ref(), &invalid.metadata)
                    .await
                    .map_err(pool_error)?;
            after_finalize(&ctx, object.as_ref(), finalized).await
        }
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
            forget_reports(&ctx, &job.namespace().unwrap_or_default(), &job.name_any());
            let finalized = pool::finalize(&ctx.client, ctx.config.arm.as_ref(), job)
                .await
                .map_err(pool_error)?;
            after_finalize(&ctx, job, finalized).await
        }
        Ok(job) => match validate::validate(job) {
            Err(errors) => report_invalid(&ctx, &object, &errors).await?,
            Ok(validated) => run(&ctx, &object, job, &validated).await?,
        },
    };
    ctx.succeeded(&key);
    Ok(action)
}

/// What follows a deleted job's finalizer step: done, a look again while its pool is
/// deleted, or a Warning on the job when the pool cannot be deleted or is left behind.
async fn after_finalize<K: kube::Resource<DynamicType = ()>>(
    ctx: &Context,
    job: &K,
    finalized: pool::Finalized,
) -> Action {
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
    let mut new = status::invalid(&old, object.meta().generation, errors, &now());
    if new != old {
        let fence = fence(ctx, object);
        new.written_by = Some(ctx.writer().to_string());
        let value = serde_json::to_value(&new).expect("status serializes");
        ctx.write_status(
            object,
            &old.conditions,
            &new.conditions,
            value,
            StatusWrite::Replace(fence),
            is_warning,
        )
        .await?;
        ctx.recent.status_written(
            &object.uid().unwrap_or_default(),
            &new,
            std::time::Instant::now(),
        );
    }
    Ok(Action::await_change())
}

/// One reconcile of a valid, live job: observe → (the Kueue and node-pool sub-reconcilers)
/// → plan → apply → status → settle.
async fn run(
    ctx: &Context,
    object: &DeserializeGuard<TrainingJob>,
    job: &TrainingJob,
    validated: &spec::ValidatedTrainingJob,
) -> Result<Action, Error> {
    let seen = Snapshot::take(ctx, job, validated);
    // Kueue first (the plan reads where the job stands), then the job's own node pool.
    let kueue = admission::reconcile(ctx, job, validated, &seen).await;
    let pool = pool::reconcile(ctx, job, validated, seen.observed.gang_exists())
        .await
        .map_err(|source| Error::Pool {
            name: format!("{}/{}", validated.namespace, validated.name),
            source,
        })?;
    let found = (&kueue.state, &pool.state);
    let backoff = ctx.config.restart_backoff;
    let plan = plan::plan(&seen.plan_inputs(validated, found, &seen.names_in_use, backoff));
    let restarting = plan.restarts != seen.old.restarts;
    if restarting {
        record_restart(ctx, object, &seen, &plan, &pool).await?;
    }
    let (applied, written) = carry_out(ctx, validated, &seen, &plan, &kueue.state).await;
    // Names only a create's 409 showed taken (pods the cache does not hold): planned again
    // with them, so the status says them as it says those the cache shows.
    let plan = if written.held.is_empty() {
        plan
    } else {
        let held = seen
            .names_in_use
            .clone()
            .into_iter()
            .chain(written.held.clone())
            .collect();
        plan::plan(&seen.plan_inputs(validated, found, &held, backoff))
    };
    let new = status_after_apply(
        &seen,
        &validated.name,
        &plan,
        &pool,
        &written,
        applied.is_err(),
    );
    if let Err(source) = applied {
        let before = if restarting { &new } else { &seen.old };
        let message = &plan.message;
        return Err(rejected(ctx, object, (before, &new), message, validated, source).await);
    }
    let new = with_live_reports(ctx, validated, &seen, new);
    let progress_wait = report(ctx, object, &seen.old, &new, &plan, restarting).await?;
    if progress_wait.is_none() {
        let key = crate::report::job_key(&validated.namespace, &validated.name);
        ctx.reports.board.settled(&key);
    }
    let kueue_requeue = kueue.requeue;
    let pods_exist = !seen.pods.is_empty() || plan.unseen_pods || !written.pods.is_empty();
    settle(ctx, object, validated, (&plan, &new), kueue, pods_exist).await?;
    record_time_to_running(ctx, job, &seen.old, &new);
    if plan.delete_job {
        return delete_finished(ctx, validated).await;
    }
    let waits = [
        plan.requeue_after,
        pool.requeue,
        progress_wait,
        kueue_requeue,
    ];
    let next = waits.into_iter().flatten().min();
    Ok(next.map_or_else(Action::await_change, Action::requeue))
}

/// The status with what the job's launcher reported ([`live`]); a job that no longer runs
/// is taken off the report board and its progress metrics.
fn with_live_reports(
    ctx: &Context,
    validated: &spec::ValidatedTrainingJob,
    seen: &Snapshot,
    new: TrainingJobStatus,
) -> TrainingJobStatus {
    let key = crate::report::job_key(&validated.namespace, &validated.name);
    let entry = ctx.reports.board.read(&key);
    let infiniband = validated.infiniband.is_some();
    let new = live::with_reports(
        new,
        &seen.old,
        entry.as_ref(),
        infiniband,
        seen.generation,
        &seen.now,
    );
    if new.phase != crate::api::TrainingJobPhase::Running {
        forget_reports(ctx, &validated.namespace, &validated.name);
    }
    new
}

/// Takes a job off the report board and its progress series off the metrics.
pub fn forget_reports(ctx: &Context, namespace: &str, name: &str) {
    ctx.reports
        .board
        .forget(&crate::report::job_key(namespace, name));
    ctx.metrics.forget_job_progress(namespace, name);
}

/// A restart is written before its pods are deleted, so a crash in between cannot lose it.
async fn record_restart(
    ctx: &Context,
    object: &DeserializeGuard<TrainingJob>,
    seen: &Snapshot,
    plan: &plan::Plan,
    pool: &pool::PoolLook,
) -> Result<(), Error> {
    let new = status_after(seen, plan, pool);
    let about = plan.about.as_ref();
    write_status(ctx, object, &seen.old, &new, &plan.message, about).await?;
    ctx.status_written(&object_key(object));
    ctx.metrics
        .training_job_restarted(object.meta().namespace.as_deref().unwrap_or_default());
    Ok(())
}

/// The status after `plan` was carried out: the pods made counted (they exist now, though
/// the pods it was planned from predate them), and, when the apply `failed` before the
/// launcher was made, no start time (the job did not start: its deadline does not run yet).
fn status_after_apply(
    seen: &Snapshot,
    job: &str,
    plan: &plan::Plan,
    pool: &pool::PoolLook,
    written: &apply::Written,
    failed: bool,
) -> TrainingJobStatus {
    let mut new = status_after(seen, plan, pool);
    let launcher = names::launcher_pod(job, plan.restarts);
    let launcher_made = written.pods.contains(&launcher);
    let workers_made = written.pods.len() - usize::from(launcher_made);
    status::count_made(&mut new, workers_made, launcher_made);
    if failed && plan.create_launcher && !launcher_made {
        new.start_time = seen.old.start_time.clone();
    }
    new
}

/// The status after `plan`, from what was seen before it was carried out.
fn status_after(seen: &Snapshot, plan: &plan::Plan, pool: &pool::PoolLook) -> TrainingJobStatus {
    let mut new = status::from_plan(&seen.old, seen.generation, plan, &seen.observed, &seen.now);
    if pool.status.is_some() {
        new.node_pool = pool.status.clone();
    }
    new
}

/// Carries `plan` out and remembers what it wrote (also when something failed after), so
/// the reconciles that follow before the caches show it do not write it again.
async fn carry_out(
    ctx: &Context,
    validated: &spec::ValidatedTrainingJob,
    seen: &Snapshot,
    plan: &plan::Plan,
    queue: &state::QueueState,
) -> (Result<(), apply::ApplyError>, apply::Written) {
    let inputs = BuildInputs {
        attempt: plan.restarts,
        data_claim: seen.data_claim(),
        placement: match queue {
            state::QueueState::Admitted { placement, .. } => placement.clone(),
            _ => state::Placement::default(),
        },
        gang_scheduler: ctx.config.gang_scheduler.clone(),
        naming: plan.naming,
        launcher_priority_class: ctx.config.launcher_priority_class.clone(),
        network_policy: ctx.config.job_network_policies,
        progress: ctx.config.progress.clone(),
    };
    let mut written = apply::Written::default();
    let applied = apply::execute(&ctx.client, validated, plan, &inputs, &mut written).await;
    let (uid, clock) = (&validated.uid, std::time::Instant::now());
    if written.children {
        let recent = &ctx.recent;
        recent.children_applied(uid, seen.generation, plan.restarts, plan.naming, clock);
    }
    ctx.recent
        .pods_made(uid, plan.restarts, written.pods.clone(), clock);
    if let Some(published) = plan.publish.clone().filter(|_| written.published) {
        ctx.recent.published(uid, published, clock);
    }
    (applied, written)
}

/// Writes the status (unless the restart wrote it already), or holds back a change that is
/// only progress (worker counts, messages): one write per pod event would cost the API
/// server most of a job's requests. Returns how long it is held back.
async fn report(
    ctx: &Context,
    object: &DeserializeGuard<TrainingJob>,
    old: &TrainingJobStatus,
    new: &TrainingJobStatus,
    plan: &plan::Plan,
    restarting: bool,
) -> Result<Option<std::time::Duration>, Error> {
    if restarting {
        return Ok(None);
    }
    let key = object_key(object);
    let wait = status::is_progress_only(old, new)
        .then(|| ctx.progress_wait(&key))
        .flatten();
    if wait.is_none() {
        write_status(ctx, object, old, new, &plan.message, plan.about.as_ref()).await?;
        ctx.status_written(&key);
    }
    Ok(wait)
}

/// Tells Kueue what it waits for: PodsReady, the quota of an evicted job whose pods are all
/// gone (`pods_exist` counts those terminating, and those made moments ago and not in the
/// cache yet), and the end of a finished job. A Kueue write that failed before the plan is
/// reported now.
async fn settle(
    ctx: &Context,
    object: &DeserializeGuard<TrainingJob>,
    validated: &spec::ValidatedTrainingJob,
    (plan, new): (&plan::Plan, &TrainingJobStatus),
    kueue: admission::KueueLook,
    pods_exist: bool,
) -> Result<(), Error> {
    let outcome = match kueue.error {
        Some(error) => Err(error),
        None => {
            let workload = kueue.workload.as_deref();
            let (phase, message, now) = (plan.phase, &plan.message, &crate::controller::now());
            admission::settle(ctx, validated, workload, phase, message, pods_exist, now).await
        }
    };
    match outcome {
        Ok(()) => Ok(()),
        Err(source) => {
            let both = (new, new);
            Err(rejected(ctx, object, both, &plan.message, validated, source).await)
        }
    }
}

/// Time to Running, for first runs only (not restarts or resumes).
fn record_time_to_running(
    ctx: &Context,
    job: &TrainingJob,
    old: &TrainingJobStatus,
    new: &TrainingJobStatus,
) {
    if new.phase == TrainingJobPhase::Running
        && old.phase == TrainingJobPhase::Starting
        && new.restarts == 0
        && let Some(created) = job.meta().creation_timestamp.as_ref()
    {
        let seconds = now().0.duration_since(created.0).as_secs_f64();
        ctx.metrics
            .training_job_running_after(&job.namespace().unwrap_or_default(), seconds);
    }
}

/// Deletes a job whose `runPolicy.ttlSecondsAfterFinished` passed.
async fn delete_finished(
    ctx: &Context,
    validated: &spec::ValidatedTrainingJob,
) -> Result<Action, Error> {
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
    Ok(Action::await_change())
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
    let fence = fence(ctx, object);
    let new = &TrainingJobStatus {
        written_by: Some(ctx.writer().to_string()),
        ..new.clone()
    };
    let value = serde_json::to_value(new).expect("status serializes");
    let how = StatusWrite::Replace(fence);
    ctx.write_status(object, &[], &[], value, how, is_warning)
        .await?;
    ctx.recent.status_written(
        &object.uid().unwrap_or_default(),
        new,
        std::time::Instant::now(),
    );
    let related = about.map(|pod| pod_reference(object, pod));
    publish_phase_event(ctx, object, old.phase, new.phase, message, related.clone()).await;
    publish_blocked_event(ctx, object, old, new, related).await;
    publish_fabric_event(ctx, object, old, new).await;
    Ok(())
}

/// A Warning when the job asked for InfiniBand and NCCL chose sockets (once, as the
/// condition turns).
async fn publish_fabric_event(
    ctx: &Context,
    object: &DeserializeGuard<TrainingJob>,
    old: &TrainingJobStatus,
    new: &TrainingJobStatus,
) {
    use condition_names::condition_types::INFINIBAND_USED;
    let Some(now) = conditions::find(&new.conditions, INFINIBAND_USED) else {
        return;
    };
    let before = conditions::find(&old.conditions, INFINIBAND_USED);
    if now.status == "False" && before.is_none_or(|b| b.status != "False") {
        ctx.warn(object, &now.reason, &now.message).await;
    }
}

/// What a status write of `object` expects to find: this process's own status when it
/// wrote one moments ago that the cache does not show yet, else the cached one's writer.
fn fence(ctx: &Context, object: &DeserializeGuard<TrainingJob>) -> Fence {
    let uid = object.uid().unwrap_or_default();
    if ctx.recent.status_unseen(&uid, std::time::Instant::now()) {
        return Fence::WrittenBy(Some(ctx.writer().to_string()));
    }
    match object.0.as_ref().ok().and_then(|job| job.status.as_ref()) {
        Some(status) => Fence::WrittenBy(status.written_by.clone()),
        None => Fence::NoStatus,
    }
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

#[cfg(test)]
mod reconcile_tests;
