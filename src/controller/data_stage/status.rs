//! Status step of the DataStage controller. Pure: what was observed and the clock are
//! passed in.
//!
//! Phases: Pending (nothing made yet, the spec is invalid, or a child's name is held by an
//! object the DataStage does not control: [`NotOurs`]), Binding (the claim is not
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
    /// The copy Job's pod did not start within `spec.startTimeoutSeconds`; the Job was
    /// stopped.
    pub const START_TIMEOUT: &str = "StartTimeout";
    /// The copy Job ran past `spec.activeDeadlineSeconds`.
    pub const DEADLINE_EXCEEDED: &str = "DeadlineExceeded";
    /// An object that is not this DataStage's has one of its children's names.
    pub const NAME_IN_USE: &str = "NameInUse";
    /// A child's name is still held by the child of an earlier DataStage of this name, which
    /// the garbage collector is deleting.
    pub const EARLIER_STAGE_DELETING: &str = "EarlierStageDeleting";
}

/// An object that has one of the DataStage's child names but that the DataStage did not make
/// (it is not its controller). It is never used, changed or adopted: adopting it would have
/// the garbage collector delete it with the DataStage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotOurs {
    /// Its kind: "PersistentVolumeClaim", "Job", ...
    pub kind: &'static str,
    /// Its name.
    pub name: String,
    /// Its controller: "DataStage imagenet", or "none".
    pub owner: String,
    /// It is the child of an earlier DataStage of this name: it goes away by itself.
    pub earlier_stage: bool,
}

impl NotOurs {
    /// The condition reason.
    pub fn reason(&self) -> &'static str {
        if self.earlier_stage {
            reasons::EARLIER_STAGE_DELETING
        } else {
            reasons::NAME_IN_USE
        }
    }

    /// What the DataStage says about it.
    pub fn message(&self) -> String {
        let (kind, name) = (self.kind, &self.name);
        if self.earlier_stage && kind == "Pod" {
            format!(
                "Pod {name} of an earlier copy Job ({}) has not stopped yet; this copy starts \
                 once it has: two stagers must not write one folder",
                self.owner
            )
        } else if self.earlier_stage {
            let claims_wait = if kind == "PersistentVolumeClaim" {
                " (a claim is deleted once no pod mounts it)"
            } else {
                ""
            };
            format!(
                "{kind} {name} belongs to an earlier DataStage of this name that is being \
                 deleted; this one goes on once it is gone{claims_wait}"
            )
        } else {
            format!(
                "{kind} {name} exists and is not this DataStage's (its controller: {}), so it \
                 is left as it is: delete or rename it, or give the DataStage another name \
                 (child names are cut to fit, so two long names can clash)",
                self.owner
            )
        }
    }
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
    /// A claim of that name exists that is not this DataStage's.
    NotOurs(NotOurs),
}

/// The copy Job as observed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CopyState {
    /// Not created (the claim is not bound yet).
    NotStarted,
    /// Running since `start`; its pod is waiting to start, and the start timeout is due in
    /// `recheck` (nothing else wakes the DataStage then).
    Running {
        start: Option<Time>,
        recheck: Option<std::time::Duration>,
    },
    /// Succeeded.
    Succeeded {
        start: Option<Time>,
        completion: Option<Time>,
    },
    /// Failed for good: `reason` ([`reasons::COPY_FAILED`], [`reasons::START_TIMEOUT`],
    /// [`reasons::DEADLINE_EXCEEDED`]), and `message` says why (the stager's own words when
    /// it gave any).
    Failed {
        reason: &'static str,
        message: String,
    },
    /// The Job, or the stager's ServiceAccount, Role or RoleBinding, has a name that an
    /// object not this DataStage's holds: not started.
    NotOurs(NotOurs),
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
        ClaimState::NotOurs(not_ours) => DesiredCondition::new(
            types::VOLUME_BOUND,
            false,
            not_ours.reason(),
            not_ours.message(),
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
        CopyState::Failed { reason, message } => {
            let message = match *reason {
                reasons::COPY_FAILED => format!("the copy failed: {message}"),
                _ => message.clone(),
            };
            (
                DataStagePhase::Failed,
                DesiredCondition::new(types::COPIED, false, reason, message.clone()),
                (false, *reason, message),
                false,
                true,
            )
        }
        CopyState::Running { start, .. } => {
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
        // The claim first: the copy needs it.
        CopyState::NotStarted | CopyState::NotOurs(_)
            if let ClaimState::NotOurs(not_ours) = claim =>
        {
            let mut said = not_started_by(not_ours);
            // Copied waits for the claim: VolumeBound says why (one Warning, not two).
            said.1 = DesiredCondition::new(
                types::COPIED,
                false,
                reasons::BINDING,
                format!("waiting for claim {claim_name}"),
            );
            said
        }
        CopyState::NotOurs(not_ours) => not_started_by(not_ours),
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

/// Phase, Copied, Ready, Reconciling and Stalled of a DataStage held back by an object of
/// one of its child names: stalled, unless that object goes away by itself.
fn not_started_by(
    not_ours: &NotOurs,
) -> (
    DataStagePhase,
    DesiredCondition,
    (bool, &'static str, String),
    bool,
    bool,
) {
    let (reason, message) = (not_ours.reason(), not_ours.message());
    (
        DataStagePhase::Pending,
        DesiredCondition::new(types::COPIED, false, reason, message.clone()),
        (false, reason, message),
        not_ours.earlier_stage,
        !not_ours.earlier_stage,
    )
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
