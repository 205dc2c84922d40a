//! The DataStage controller: validate → build → apply → status.
//!
//! A valid DataStage gets a PersistentVolume and claim (or uses the user's claim), a
//! ServiceAccount with a Role that may only patch this DataStage's status, and a Job that
//! runs `ringmaster stage` once the claim is bound. The status follows the claim and the
//! Job; the stager itself writes `status.progress` while it copies.

pub mod apply;
pub mod build;
pub mod destinations;
pub mod start;
pub mod status;
pub mod validate;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::Resource;
use kube::core::error_boundary::DeserializeGuard;
use kube::runtime::controller::Action;

use super::{Context, Error, conditions, is_warning, now, object_key};
use crate::api::{DataStage, DataStagePhase, condition_reasons};
use crate::validation::FieldErrors;
use status::{ClaimState, CopyState, NotOurs};

/// The controller's name in metrics and logs.
pub const CONTROLLER: &str = "datastage";

/// How often a DataStage waiting for a claim it does not own, or for a name another object
/// holds, is looked at again (changes of claims we own wake it at once).
const BINDING_RECHECK: Duration = Duration::from_secs(10);

/// When a DataStage held back by `held` is looked at again. The deletion of an earlier
/// DataStage's claim or Job wakes it (they are watched, and the earlier DataStage had its
/// name): a slow look then, since a claim stays while any pod mounts it, maybe for days. Its
/// stager's ServiceAccount, Role, RoleBinding and pods are not watched, and go within seconds.
fn recheck_after(held: &NotOurs) -> Duration {
    match (held.earlier_stage, held.kind) {
        (true, "PersistentVolumeClaim" | "Job") => Duration::from_secs(60),
        (true, _) => Duration::from_secs(2),
        (false, _) => BINDING_RECHECK,
    }
}

/// Reconciles one DataStage.
pub async fn reconcile(
    object: Arc<DeserializeGuard<DataStage>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started(CONTROLLER);
    let key = object_key(object.as_ref());
    let stage_error = |source| Error::StageApply {
        name: key.clone(),
        source,
    };
    if object.meta().deletion_timestamp.is_some() {
        // Its series go now, not at the next listing of the cache.
        let meta = object.meta();
        let namespace = meta.namespace.as_deref().unwrap_or_default();
        ctx.metrics
            .forget_data_stage(namespace, meta.name.as_deref().unwrap_or_default());
    }
    if let Ok(raw) = &object.0
        && raw.meta().deletion_timestamp.is_some()
    {
        apply::finalize(&ctx.client, raw)
            .await
            .map_err(stage_error)?;
        return Ok(Action::await_change());
    }
    if let Err(invalid) = &object.0
        && invalid.metadata.deletion_timestamp.is_some()
    {
        // Its volume goes all the same: the finalizer must not hold what cannot be read.
        apply::finalize_unreadable(&ctx.client, &invalid.metadata)
            .await
            .map_err(stage_error)?;
        return Ok(Action::await_change());
    }
    let old = object
        .0
        .as_ref()
        .ok()
        .and_then(|stage| stage.status.clone())
        .unwrap_or_default();
    let generation = object.meta().generation;
    let admitted = validated(&object).and_then(|(raw, mut stage)| {
        // The destination as the admin's allow list admits it (with the admin's mount
        // options), or the rule it breaks, reported as an invalid spec: no volume is made.
        stage.destination = ctx
            .config
            .data_stage_destinations
            .admit(raw, &stage.destination)?;
        Ok((raw, stage))
    });
    let (raw, stage) = match admitted {
        Ok(pair) => pair,
        Err(errors) => {
            tracing::info!(stage = %key, %errors, "invalid DataStage spec");
            let new = status::invalid(&old, generation, &errors, &now());
            write(&ctx, &object, &old, &new).await?;
            ctx.succeeded(&key);
            return Ok(Action::await_change());
        }
    };

    let inputs = build::BuildInputs {
        stager_image: ctx.config.stager_image.clone(),
    };
    let (claim, copy) = match carry_out(&ctx, raw, &stage, &inputs, &old).await {
        Ok(observed) => observed,
        Err(source) => {
            if let Some(message) = source.rejection() {
                // Visible on the DataStage, retried with backoff.
                let new = status::child_rejected(&old, generation, &message, &now());
                write(&ctx, &object, &old, &new).await?;
                if conditions::rejected_child(&old.conditions) != Some(message.as_str()) {
                    ctx.warn(object.as_ref(), condition_reasons::CHILD_REJECTED, &message)
                        .await;
                }
            }
            return Err(stage_error(source));
        }
    };
    let claim_name = build::Names::of(&stage).claim;
    let new = status::observed(&old, generation, &claim_name, &claim, &copy, &now());
    let first_look = old.observed_generation != generation;
    write(&ctx, &object, &old, &new).await?;
    // Allowed-but-risky settings are said once per change of the spec.
    if first_look {
        for warning in &stage.warnings {
            ctx.warn(object.as_ref(), "InsecureAuth", warning).await;
        }
    }
    ctx.succeeded(&key);
    Ok(match (&claim, &copy) {
        (ClaimState::NotOurs(held), _) | (_, CopyState::NotOurs(held)) => {
            Action::requeue(recheck_after(held))
        }
        // Bound and no Job: the copy Job's create found one that went away again.
        (ClaimState::Bound, CopyState::NotStarted) => Action::requeue(Duration::from_secs(2)),
        // A pod waiting to start sends nothing when its start timeout passes.
        (
            ClaimState::Bound,
            CopyState::Running {
                recheck: Some(left),
                ..
            },
        ) => Action::requeue(*left + Duration::from_secs(1)),
        (ClaimState::Bound, _) => Action::await_change(),
        _ => Action::requeue(BINDING_RECHECK),
    })
}

/// The apply steps: the finalizer, volume and claim, then the stager's RBAC and the copy
/// Job once the claim is bound; what they observed of the claim and the copy.
async fn carry_out(
    ctx: &Context,
    raw: &DataStage,
    stage: &validate::ValidatedDataStage,
    inputs: &build::BuildInputs,
    old: &crate::api::DataStageStatus,
) -> Result<(ClaimState, CopyState), apply::ApplyError> {
    apply::ensure_finalizer(&ctx.client, raw, stage).await?;
    let claim = apply::storage(&ctx.client, stage).await?;
    let copy = if old.phase == DataStagePhase::Ready {
        // Done once: a Job deleted later (by hand or a TTL) does not copy again.
        CopyState::Succeeded {
            start: old.start_time.clone(),
            completion: old.completion_time.clone(),
        }
    } else {
        apply::copy_state(&ctx.client, stage, inputs, claim == ClaimState::Bound).await?
    };
    Ok((claim, copy))
}

/// The object and its validated form, or what is wrong with it (including an object that
/// does not even match the schema's types).
fn validated(
    object: &DeserializeGuard<DataStage>,
) -> Result<(&DataStage, validate::ValidatedDataStage), FieldErrors> {
    match &object.0 {
        Ok(stage) => validate::validate(stage).map(|v| (stage, v)),
        Err(invalid) => Err(FieldErrors::one(
            "",
            format!(
                "the object does not match the DataStage schema: {}",
                invalid.error
            ),
        )),
    }
}

/// Writes the status when it changed. `progress` is the stager's: never written here, so
/// this field manager never owns it and cannot overwrite a newer report.
async fn write(
    ctx: &Context,
    object: &DeserializeGuard<DataStage>,
    old: &crate::api::DataStageStatus,
    new: &crate::api::DataStageStatus,
) -> Result<(), Error> {
    if new == old {
        return Ok(());
    }
    let mut value = serde_json::to_value(new).expect("status serializes");
    if let Some(map) = value.as_object_mut() {
        map.remove("progress");
    }
    ctx.write_status(
        object,
        &old.conditions,
        &new.conditions,
        value,
        // An apply cannot test; a DataStage's status is mostly its stager's progress, and
        // its phase follows the copy Job, which a stale write does not change.
        super::StatusWrite::Apply,
        is_stage_warning,
    )
    .await
}

/// Warning Events for what stops a DataStage until a person acts: an invalid spec, a claim
/// that does not exist, a copy that failed, a child's name another object holds. The other
/// transitions are Normal.
pub fn is_stage_warning(condition: &Condition) -> bool {
    is_warning(condition)
        || (condition.status == "False"
            && matches!(
                (condition.type_.as_str(), condition.reason.as_str()),
                (
                    status::types::VOLUME_BOUND,
                    status::reasons::CLAIM_NOT_FOUND | status::reasons::NAME_IN_USE
                ) | (
                    status::types::COPIED,
                    status::reasons::COPY_FAILED
                        | status::reasons::START_TIMEOUT
                        | status::reasons::DEADLINE_EXCEEDED
                        | status::reasons::NAME_IN_USE
                )
            ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn condition(type_: &str, status: &str, reason: &str) -> Condition {
        Condition {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message: String::new(),
            last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ),
            observed_generation: None,
        }
    }

    #[test]
    fn a_missing_claim_and_a_failed_copy_are_warnings_waiting_is_not() {
        use status::{reasons, types};
        assert!(is_stage_warning(&condition(
            types::VOLUME_BOUND,
            "False",
            reasons::CLAIM_NOT_FOUND
        )));
        assert!(is_stage_warning(&condition(
            types::COPIED,
            "False",
            reasons::COPY_FAILED
        )));
        assert!(is_stage_warning(&condition(
            "SpecValid",
            "False",
            "InvalidSpec"
        )));
        assert!(!is_stage_warning(&condition(
            types::VOLUME_BOUND,
            "False",
            reasons::BINDING
        )));
        assert!(!is_stage_warning(&condition(
            types::COPIED,
            "False",
            reasons::COPYING
        )));
        // The kstatus conditions that repeat the reason stay Normal: one Warning per failure.
        assert!(!is_stage_warning(&condition(
            "Ready",
            "False",
            reasons::COPY_FAILED
        )));
    }
}
