//! The TrainingJob controller: validate → build → apply → status.
//!
//! This version carries the validate and status steps; building and applying the MPI
//! launcher and workers is not in it yet, and the status says so.

pub mod status;
pub mod validate;

use std::sync::Arc;

use kube::Resource;
use kube::core::error_boundary::DeserializeGuard;
use kube::runtime::controller::Action;

use super::{Context, Error, is_warning, now, object_key};
use crate::api::TrainingJob;
use crate::validation::FieldErrors;

/// The controller's name in metrics and logs.
pub const CONTROLLER: &str = "trainingjob";

/// Reconciles one TrainingJob.
pub async fn reconcile(
    object: Arc<DeserializeGuard<TrainingJob>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started(CONTROLLER);
    let outcome = match &object.0 {
        Ok(job) => validate::validate(job).map(|_| ()),
        Err(invalid) => Err(FieldErrors::one(
            "",
            format!(
                "the object does not match the TrainingJob schema: {}",
                invalid.error
            ),
        )),
    };
    if let Err(errors) = &outcome {
        tracing::info!(job = %object_key(object.as_ref()), %errors, "invalid TrainingJob spec");
    }
    let old = object
        .0
        .as_ref()
        .ok()
        .and_then(|job| job.status.clone())
        .unwrap_or_default();
    let new = status::after_validation(
        &old,
        object.meta().generation,
        outcome.as_ref().map(|_| ()),
        &now(),
    );
    if new != old {
        let value = serde_json::to_value(&new).expect("status serializes");
        ctx.write_status(
            object.as_ref(),
            &old.conditions,
            &new.conditions,
            value,
            is_warning,
        )
        .await?;
    }
    ctx.succeeded(&object_key(object.as_ref()));
    Ok(Action::await_change())
}
