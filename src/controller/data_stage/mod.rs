//! The DataStage controller: validate → build → apply → status.
//!
//! This version carries the validate and status steps; the volume, claim and copy Job are
//! not in it yet, and the status says so.

pub mod status;
pub mod validate;

use std::sync::Arc;

use kube::Resource;
use kube::core::error_boundary::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};

use super::{Context, Error, is_warning, now, object_key};
use crate::api::DataStage;
use crate::validation::FieldErrors;

/// The controller's name in metrics and logs.
pub const CONTROLLER: &str = "datastage";

/// Reconciles one DataStage.
pub async fn reconcile(
    object: Arc<DeserializeGuard<DataStage>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started(CONTROLLER);
    let validated = match &object.0 {
        Ok(stage) => validate::validate(stage),
        Err(invalid) => Err(FieldErrors::one(
            "",
            format!(
                "the object does not match the DataStage schema: {}",
                invalid.error
            ),
        )),
    };
    if let Err(errors) = &validated {
        tracing::info!(stage = %object_key(object.as_ref()), %errors, "invalid DataStage spec");
    }
    let old = object
        .0
        .as_ref()
        .ok()
        .and_then(|stage| stage.status.clone())
        .unwrap_or_default();
    let new = status::after_validation(
        &old,
        object.meta().generation,
        validated.as_ref().map(|_| ()),
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
        // Allowed-but-risky settings are said once per change of the spec, with the status.
        if let Ok(stage) = &validated {
            for warning in &stage.warnings {
                let event = Event {
                    type_: EventType::Warning,
                    reason: "InsecureAuth".into(),
                    note: Some(warning.clone()),
                    action: "Validate".into(),
                    secondary: None,
                };
                if let Err(error) = ctx.recorder.publish(&event, &object.object_ref(&())).await {
                    tracing::warn!(%error, "could not publish Event");
                }
            }
        }
    }
    ctx.succeeded(&object_key(object.as_ref()));
    Ok(Action::await_change())
}
