//! The Kueue step of the TrainingJob controller: for a job labelled
//! `kueue.x-k8s.io/queue-name`, makes its Workload (once its data is there), carries
//! `runPolicy.suspend` onto it, and says where the job stands (see [`queue`]); after the
//! plan is carried out, gives an evicted job's quota back once its pods are gone and marks
//! the Workload Finished when the job ends. Workloads and ResourceFlavors are read from the
//! operator's caches.

use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams, PostParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};

use super::apply::ApplyError;
use super::build::BuildInputs;
use super::names;
use super::plan::DataState;
use super::queue::{self, Priority, QueueState};
use super::validate::ValidatedTrainingJob;
use crate::api::{TrainingJob, TrainingJobPhase};
use crate::controller::{Context, FIELD_MANAGER, is_conflict, is_not_found};
use crate::kueue::{PRIORITY_CLASS_LABEL, ResourceFlavor, Workload};

fn kube_error(
    action: &'static str,
    kind: &'static str,
    name: &str,
) -> impl FnOnce(kube::Error) -> ApplyError {
    let name = name.to_string();
    move |source| ApplyError::Kube {
        action,
        kind,
        name,
        source,
    }
}

/// The job's Workload from the cache.
fn cached_workload(ctx: &Context, job: &ValidatedTrainingJob) -> Option<Arc<Workload>> {
    let name = names::workload(&job.name, &job.uid);
    ctx.workloads
        .get(&ObjectRef::new(&name).within(&job.namespace))
}

/// Where the job stands with Kueue, making its Workload or carrying a changed
/// `runPolicy.suspend` onto it first when needed. Also returns the Workload as cached.
pub async fn look(
    ctx: &Context,
    job: &TrainingJob,
    validated: &ValidatedTrainingJob,
    data: &DataState,
    inputs: &BuildInputs,
    finished: bool,
) -> Result<(QueueState, Option<Arc<Workload>>), ApplyError> {
    let Some(queue) = queue::queue_name(job) else {
        return Ok((QueueState::NotQueued, None));
    };
    if !ctx.config.kueue {
        return Ok((
            QueueState::IntegrationOff {
                queue: queue.to_string(),
            },
            None,
        ));
    }
    let workload = cached_workload(ctx, validated);
    match &workload {
        // Made once the data is there: a job waiting for its data holds no quota.
        None if !finished && !matches!(data, DataState::Waiting { .. }) => {
            let priority = match job.labels().get(PRIORITY_CLASS_LABEL) {
                Some(class) => match priority(ctx, class).await? {
                    Some(priority) => Some(priority),
                    None => {
                        return Ok((
                            QueueState::Waiting {
                                message: format!(
                                    "WorkloadPriorityClass {class} (label {PRIORITY_CLASS_LABEL}) does not exist: the job is not queued until it does"
                                ),
                            },
                            None,
                        ));
                    }
                },
                None => None,
            };
            let object = queue::workload(validated, queue, inputs, priority.as_ref());
            let api: Api<Workload> = Api::namespaced(ctx.client.clone(), &validated.namespace);
            match api.create(&PostParams::default(), &object).await {
                Ok(_) => {}
                // Made by an earlier reconcile that the cache does not show yet.
                Err(e) if is_conflict(&e) => {}
                Err(e) => return Err(kube_error("creating", "Workload", &object.name_any())(e)),
            }
        }
        Some(workload) if !finished => {
            if let Some(patch) = queue::activation_patch(workload, validated.run_policy.suspend) {
                let api: Api<Workload> = Api::namespaced(ctx.client.clone(), &validated.namespace);
                api.patch(
                    &workload.name_any(),
                    &PatchParams {
                        field_manager: Some(FIELD_MANAGER.into()),
                        ..PatchParams::default()
                    },
                    &Patch::Merge(&patch),
                )
                .await
                .map_err(kube_error(
                    "patching",
                    "Workload",
                    &workload.name_any(),
                ))?;
            }
        }
        _ => {}
    }
    let state = queue::state(queue, workload.as_deref(), |name| {
        ctx.flavors
            .get(&ObjectRef::<ResourceFlavor>::new(name))
            .map(|f| f.spec.clone())
    });
    Ok((state, workload))
}

/// The value of WorkloadPriorityClass `class`; `None` when it does not exist.
async fn priority(ctx: &Context, class: &str) -> Result<Option<Priority>, ApplyError> {
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", "WorkloadPriorityClass"),
        "workloadpriorityclasses",
    );
    let api: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &resource);
    match api.get(class).await {
        Ok(object) => Ok(Some(Priority {
            class: class.to_string(),
            value: object.data["value"]
                .as_i64()
                .and_then(|v| i32::try_from(v).ok())
                .unwrap_or_default(),
        })),
        Err(e) if is_not_found(&e) => Ok(None),
        Err(e) => Err(kube_error("reading", "WorkloadPriorityClass", class)(e)),
    }
}

/// After the plan: an evicted job whose pods are all gone (`pods_exist` counts those still
/// terminating and those made moments ago that the cache does not show) gives its quota
/// back; a finished job's Workload is marked Finished.
pub async fn settle(
    ctx: &Context,
    workload: Option<&Workload>,
    phase: TrainingJobPhase,
    message: &str,
    pods_exist: bool,
    now: &Time,
) -> Result<(), ApplyError> {
    let Some(workload) = workload else {
        return Ok(());
    };
    let patch = match phase {
        TrainingJobPhase::Succeeded | TrainingJobPhase::Failed => {
            queue::finish_patch(workload, phase == TrainingJobPhase::Succeeded, message, now)
        }
        _ if !pods_exist => queue::release_patch(workload, now),
        _ => None,
    };
    let Some(patch) = patch else {
        return Ok(());
    };
    let api: Api<Workload> = Api::namespaced(
        ctx.client.clone(),
        &workload.namespace().unwrap_or_default(),
    );
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
    };
    match api
        .patch_status(&workload.name_any(), &params, &Patch::<()>::Json(patch))
        .await
    {
        Ok(_) => Ok(()),
        // The cache was behind (the patch tests the resourceVersion): the Workload's newer
        // version wakes the job again.
        Err(kube::Error::Api(s)) if s.code == 422 || s.code == 409 => {
            tracing::debug!(workload = %workload.name_any(), message = %s.message, "Workload changed meanwhile; looked at again");
            Ok(())
        }
        Err(e) => Err(kube_error(
            "updating the status of",
            "Workload",
            &workload.name_any(),
        )(e)),
    }
}
