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
    let same_gang = plan.restarts == old.restarts;
    let workers = observed.workers.iter().flatten().filter(|_| same_gang);
    status.workers = WorkerCounts {
        active: workers
            .clone()
            .filter(|w| !w.deleting && !w.is_finished())
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
