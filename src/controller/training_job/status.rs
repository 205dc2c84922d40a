//! Status step of the TrainingJob controller: the status to write, from the plan and the
//! observed pods. Pure: the clock is passed in.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::observe::{Observed, PodLife};
use super::plan::Plan;
use crate::api::{
    TrainingJobPhase, TrainingJobStatus, WorkerCounts, condition_reasons, condition_types,
};
use crate::controller::conditions::{self, DesiredCondition};
use crate::controller::invalid_spec_conditions;
use crate::validation::FieldErrors;

/// The status of a job whose spec is invalid, keeping what `old` says of everything else.
pub fn invalid(
    old: &TrainingJobStatus,
    generation: Option<i64>,
    errors: &FieldErrors,
    now: &Time,
) -> TrainingJobStatus {
    let mut status = old.clone();
    status.phase = TrainingJobPhase::Pending;
    status.observed_generation = generation;
    for desired in invalid_spec_conditions(errors) {
        conditions::set(&mut status.conditions, desired, generation, now);
    }
    status
}

/// The status when the API server refused a child the plan asked for: `planned` with
/// Stalled=True and Ready=False, reason ChildRejected, and `message` (the child's kind, name
/// and the API server's words).
pub fn child_rejected(
    planned: &TrainingJobStatus,
    generation: Option<i64>,
    message: &str,
    now: &Time,
) -> TrainingJobStatus {
    let mut status = planned.clone();
    for desired in conditions::child_rejected(message) {
        conditions::set(&mut status.conditions, desired, generation, now);
    }
    status
}

/// The status after a plan, from what was observed before it was carried out.
pub fn from_plan(
    old: &TrainingJobStatus,
    generation: Option<i64>,
    plan: &Plan,
    observed: &Observed,
    now: &Time,
) -> TrainingJobStatus {
    let mut status = old.clone();
    status.phase = plan.phase;
    status.observed_generation = generation;
    status.restarts = plan.restarts;
    status.start_time = plan.start_time.clone();
    status.completion_time = plan.completion_time.clone();
    status.result = plan.result.clone();
    status.last_failure = plan.last_failure.clone();
    let same_gang = plan.restarts == old.restarts;
    let workers = observed.workers.iter().flatten().filter(|_| same_gang);
    status.workers = WorkerCounts {
        active: workers
            .clone()
            .filter(|w| !w.is_deleting() && !w.is_finished())
            .count() as i32,
        ready: workers.clone().filter(|w| w.is_ready()).count() as i32,
        failed: workers
            .filter(|w| matches!(w.life, PodLife::Failed(_)))
            .count() as i32,
    };
    status.launcher = observed.launcher.as_ref().filter(|_| same_gang).map(|l| {
        match &l.life {
            PodLife::Pending { .. } => "Pending",
            PodLife::Running { .. } => "Running",
            PodLife::Succeeded(_) => "Succeeded",
            PodLife::Failed(_) => "Failed",
        }
        .to_string()
    });
    conditions::set(
        &mut status.conditions,
        DesiredCondition::new(
            condition_types::SPEC_VALID,
            true,
            condition_reasons::VALID,
            "the spec passed validation",
        ),
        generation,
        now,
    );
    for desired in &plan.conditions {
        conditions::set(&mut status.conditions, desired.clone(), generation, now);
    }
    status
}

/// Counts in `status` the pods this reconcile made (`workers` worker pods, and the launcher
/// when `launcher`): they exist now, though the observed pods the status came from predate
/// them. The next look then finds the counts it would write already written: their creation
/// alone is no progress to write again (a write per job in a thousand).
pub fn count_made(status: &mut TrainingJobStatus, workers: usize, launcher: bool) {
    status.workers.active += i32::try_from(workers).unwrap_or(i32::MAX);
    if launcher && status.launcher.is_none() {
        status.launcher = Some("Pending".to_string());
    }
}

/// Whether `new` differs from `old` only in progress: the launcher's reports (training
/// progress, the fabric; a condition they move is not progress), worker counts, the launcher's state,
/// the start time (the launcher pod holds it too), condition messages and timestamps, and
/// WorkersReady going from Starting to ready. Such a change can wait a little and go out with
/// the next one; a new phase, restart, result, generation, node pool, or any other condition
/// moving (a worker that cannot be scheduled or cannot start among them) is written at once.
pub fn is_progress_only(old: &TrainingJobStatus, new: &TrainingJobStatus) -> bool {
    fn gist(status: &TrainingJobStatus) -> (TrainingJobStatus, Vec<(String, String, String)>) {
        let conditions = status
            .conditions
            .iter()
            .filter(|c| {
                c.type_ != super::condition_names::condition_types::WORKERS_READY
                    || super::condition_names::reasons::BLOCKING.contains(&c.reason.as_str())
            })
            .map(|c| (c.type_.clone(), c.status.clone(), c.reason.clone()))
            .collect();
        let rest = TrainingJobStatus {
            workers: WorkerCounts::default(),
            launcher: None,
            start_time: None,
            progress: None,
            fabric: None,
            conditions: Vec::new(),
            ..status.clone()
        };
        (rest, conditions)
    }
    new != old && gist(new) == gist(old)
}
