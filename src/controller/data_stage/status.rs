//! Status step of the DataStage controller. Pure: the clock is passed in.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::api::{DataStagePhase, DataStageStatus};
use crate::controller::{conditions, validation_conditions};
use crate::validation::FieldErrors;

/// What a valid DataStage says while this operator version does not copy data yet.
pub const NOT_STARTED: &str = "the spec is valid; this version of Ringmaster validates DataStages but does not create the volume or the copy Job yet";

/// The status after the validate step, keeping what `old` says of everything else.
pub fn after_validation(
    old: &DataStageStatus,
    generation: Option<i64>,
    outcome: Result<(), &FieldErrors>,
    now: &Time,
) -> DataStageStatus {
    let mut status = old.clone();
    status.phase = DataStagePhase::Pending;
    status.observed_generation = generation;
    for desired in validation_conditions(outcome, NOT_STARTED) {
        conditions::set(&mut status.conditions, desired, generation, now);
    }
    status
}
