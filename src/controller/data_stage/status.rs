//! Status step of the DataStage controller. Pure: what was observed and the clock are
//! passed in.
//!
//! Phases: Pending (nothing made yet, or the spec is invalid), Binding (the claim is not
//! bound), Copying (the Job runs), Ready (the Job succeeded), Failed (the Job gave up). The
//! `progress` block belongs to the stager, which patches it while it copies; this step
//! never writes it.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::api::{DataStagePhase, DataStageStatus, condition_reasons, condition_types};
use crate::controller::conditions::{self, DesiredCondition};
use crate::controller::invalid_spec_conditions;
use crate::validation::FieldErrors;

/// Condition types of a DataStage besides the shared ones.
pub mod types {
    /// `True` once the claim is bound to its volume.
    pub const VOLUME_BOUND: &str = "VolumeBound";
    /// `True` once every blob is on the share.
    pub const COPIED: &str = "Copied";
}

/// Reasons of a DataStage's conditions.
pub mod reasons {
    /// The claim waits for its volume.
    pub const BINDING: &str = "Binding";
    /// The claim is bound.
    pub const BOUND: &str = "Bound";
    /// The claim named in the spec does not exist.
    pub const CLAIM_NOT_FOUND: &str = "ClaimNotFound";
    /// The copy Job runs.
    pub const COPYING: &str = "Copying";
    /// The copy finished.
    pub const COPIED: &str = "Copied";
    /// The copy Job failed after its retries.
    pub const COPY_FAILED: &str = "CopyFailed";
}

/// The claim as observed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimState {
    /// No such claim.
    Missing,
    /// Not bound yet (`phase`).
    Unbound(String),
    /// Bound.
    Bound,
}

/// The copy Job as observed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CopyState {
    /// Not created (the claim is not bound yet).
    NotStarted,
    /// Running since `start`.
    Running { start: Option<Time> },
    /// Succeeded.
    Succeeded {
        start: Option<Time>,
        completion: Option<Time>,
    },
    /// Failed for good; `message` says why (the stager's own words when it gave any).
    Failed { message: String },
}

/// The status for a valid DataStage in the observed state. Keeps `old.progress`.
pub fn observed(
    old: &DataStageStatus,
    generation: Option<i64>,
    claim_name: &str,
    claim: &ClaimState,
    copy: &CopyState,
    now: &Time,
) -> DataStageStatus {
    use condition_types::{READY, RECONCILING, SPEC_VALID, STALLED};
    let mut status = old.clone();
    status.observed_generation = generation;
    status.claim_name = Some(claim_name.to_string());
    let valid = DesiredCondition::new(
        SPEC_VALID,
        true,
        condition_reasons::VALID,
        "the spec passed validation",
    );
    let bound = match claim {
        ClaimState::Bound => DesiredCondition::new(
            types::VOLUME_BOUND,
            true,
            reasons::BOUND,
            format!("claim {claim_name} is bound"),
        ),
        ClaimState::Unbound(phase) => DesiredCondition::new(
            types::VOLUME_BOUND,
            false,
            reasons::BINDING,
            format!("claim {claim_name} is {phase}"),
        ),
        ClaimState::Missing => DesiredCondition::new(
            types::VOLUME_BOUND,
            false,
            reasons::CLAIM_NOT_FOUND,
            format!("claim {claim_name} does not exist in this namespace"),
        ),
    };
    let (phase, copied, ready, reconciling, stalled) = match copy {
        CopyState::Succeeded { start, completion } => {
            status.start_time = start.clone().or(status.start_time.take());
            status.completion_time = completion.clone().or_else(|| Some(now.clone()));
            let message = format!("every blob is on the share; mount claim {claim_name}");
            (
                DataStagePhase::Ready,
                DesiredCondition::new(types::COPIED, true, reasons::COPIED, message.clone()),
                (true, reasons::COPIED, message),
                false,
                false,
            )
        }
        CopyState::Failed { message } => {
            let message = format!("the copy failed: {message}");
            (
                DataStagePhase::Failed,
                DesiredCondition::new(types::COPIED, false, reasons::COPY_FAILED, message.clone()),
                (false, reasons::COPY_FAILED, message),
                false,
                true,
            )
        }
        CopyState::Running { start } => {
            status.start_time = start.clone().or(status.start_time.take());
            let message = "the copy Job is running".to_string();
            (
                DataStagePhase::Copying,
                DesiredCondition::new(types::COPIED, false, reasons::COPYING, message.clone()),
                (false, reasons::COPYING, message),
                true,
                false,
            )
        }
        CopyState::NotStarted => {
            let message = format!("waiting for claim {claim_name} to be bound");
            let phase = if *claim == ClaimState::Missing {
                DataStagePhase::Pending
            } else {
                DataStagePhase::Binding
            };
            (
                phase,
                DesiredCondition::new(types::COPIED, false, reasons::BINDING, message.clone()),
                (false, reasons::BINDING, message),
                true,
                false,
            )
        }
    };
    status.phase = phase;
    let (ready_status, ready_reason, ready_message) = ready;
    let desired = [
        valid,
        bound,
        copied,
        DesiredCondition::new(READY, ready_status, ready_reason, ready_message.clone()),
        DesiredCondition::new(
            RECONCILING,
            reconciling,
            ready_reason,
            ready_message.clone(),
        ),
        DesiredCondition::new(STALLED, stalled, ready_reason, ready_message),
    ];
    for condition in desired {
        conditions::set(&mut status.conditions, condition, generation, now);
    }
    status
}

/// The status when the API server refused a child (the volume, the claim, the stager's
/// ServiceAccount, Role or Job): `old` for this generation, Stalled with the API server's
/// message.
pub fn child_rejected(
    old: &DataStageStatus,
    generation: Option<i64>,
    message: &str,
    now: &Time,
) -> DataStageStatus {
    let mut status = old.clone();
    status.observed_generation = generation;
    for desired in conditions::child_rejected(message) {
        conditions::set(&mut status.conditions, desired, generation, now);
    }
    status
}

/// The status of an invalid DataStage: Failed with the field named; nothing is made.
pub fn invalid(
    old: &DataStageStatus,
    generation: Option<i64>,
    errors: &FieldErrors,
    now: &Time,
) -> DataStageStatus {
    let mut status = old.clone();
    status.phase = DataStagePhase::Failed;
    status.observed_generation = generation;
    for desired in invalid_spec_conditions(errors) {
        conditions::set(&mut status.conditions, desired, generation, now);
    }
    status
}
