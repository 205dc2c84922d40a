//! Status step of the TrainingJob controller: the status to write, computed from what was
//! observed. Pure: the clock is passed in.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::api::{TrainingJobPhase, TrainingJobStatus};
use crate::controller::{conditions, validation_conditions};
use crate::validation::FieldErrors;

/// What a valid job says while this operator version does not start workers yet.
pub const NOT_STARTED: &str = "the spec is valid; this version of Ringmaster validates TrainingJobs but does not create workers or a launcher yet";

/// The status after the validate step, keeping what `old` says of everything else.
pub fn after_validation(
    old: &TrainingJobStatus,
    generation: Option<i64>,
    outcome: Result<(), &FieldErrors>,
    now: &Time,
) -> TrainingJobStatus {
    let mut status = old.clone();
    status.phase = TrainingJobPhase::Pending;
    status.observed_generation = generation;
    for desired in validation_conditions(outcome, NOT_STARTED) {
        conditions::set(&mut status.conditions, desired, generation, now);
    }
    status
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::condition_types::{READY, SPEC_VALID};
    use k8s_openapi::jiff::Timestamp;

    #[test]
    fn invalid_then_fixed() {
        let t0 = Time(Timestamp::from_second(100).unwrap());
        let t1 = Time(Timestamp::from_second(200).unwrap());
        let errors = FieldErrors::one("spec.workers", "must be at least 1");
        let invalid = after_validation(&TrainingJobStatus::default(), Some(1), Err(&errors), &t0);
        let spec_valid = invalid
            .conditions
            .iter()
            .find(|c| c.type_ == SPEC_VALID)
            .unwrap();
        assert_eq!(spec_valid.status, "False");
        assert!(
            spec_valid.message.contains("spec.workers"),
            "{}",
            spec_valid.message
        );
        assert_eq!(invalid.observed_generation, Some(1));

        let fixed = after_validation(&invalid, Some(2), Ok(()), &t1);
        let spec_valid = fixed
            .conditions
            .iter()
            .find(|c| c.type_ == SPEC_VALID)
            .unwrap();
        assert_eq!(
            (spec_valid.status.as_str(), &spec_valid.last_transition_time),
            ("True", &t1)
        );
        let ready = fixed.conditions.iter().find(|c| c.type_ == READY).unwrap();
        // Ready stayed False, so its transition time stays.
        assert_eq!(
            (ready.status.as_str(), &ready.last_transition_time),
            ("False", &t0)
        );
        assert_eq!(after_validation(&fixed, Some(2), Ok(()), &t1), fixed);
    }
}
