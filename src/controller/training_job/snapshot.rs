//! The observe step of the TrainingJob controller: what a reconcile reads before it plans,
//! all from the operator's caches and its memory of recent writes (no request to the API
//! server): the status to plan from, the DataStage, the job's pods sorted into its gang, the
//! workers' DNS records its EndpointSlice holds, the pods of others that hold names the job
//! would use, and the writes the caches do not show yet.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};

use super::names;
use super::observe::Observed;
use super::plan::PlanInputs;
use super::recent::RecentJob;
use super::spec::ValidatedTrainingJob;
use super::state::{DataState, NameHolder, PoolState, QueueState};
use super::worker_dns::Published;
use crate::api::{DataStage, DataStagePhase, TrainingJob, TrainingJobStatus};
use crate::controller::{Context, conditions, now};

/// What one reconcile of a job saw.
pub struct Snapshot {
    /// The status to plan from: the one written moments ago when the cache does not show
    /// it yet.
    pub old: TrainingJobStatus,
    /// The job's generation.
    pub generation: Option<i64>,
    /// The referenced DataStage.
    pub data: DataState,
    /// The job's own pods, from the cache.
    pub pods: Vec<Arc<Pod>>,
    /// Those pods, sorted into the gang of the status's attempt.
    pub observed: Observed,
    /// Pods of others (same job name) that hold names the job would use.
    pub names_in_use: BTreeMap<String, NameHolder>,
    /// What this operator wrote for the job moments ago that the caches do not show yet.
    pub recent: RecentJob,
    /// The clock, read once.
    pub now: Time,
}

impl Snapshot {
    /// Reads the caches for `job`.
    pub fn take(ctx: &Context, job: &TrainingJob, validated: &ValidatedTrainingJob) -> Self {
        let uid = job.uid().unwrap_or_default();
        let clock = std::time::Instant::now();
        let old = ctx
            .recent
            .latest_status(&uid, &job.status.clone().unwrap_or_default(), clock);
        let now = now();
        let (pods, names_in_use) = pods_of(ctx, job, &now);
        let pod_refs: Vec<&Pod> = pods.iter().map(AsRef::as_ref).collect();
        let mut observed = Observed::sort(&pod_refs, validated.workers, old.restarts);
        let cached = published_of(ctx, validated, observed.naming);
        observed.published = ctx.recent.latest_published(&uid, cached, clock);
        let recent = ctx.recent.recall(&uid, &pod_refs, clock);
        Self {
            generation: job.meta().generation,
            data: data_state(ctx, validated),
            old,
            pods,
            observed,
            names_in_use,
            recent,
            now,
        }
    }

    /// The claim of the job's DataStage, once it is Ready.
    pub fn data_claim(&self) -> Option<String> {
        match &self.data {
            DataState::Ready { claim } => Some(claim.clone()),
            _ => None,
        }
    }

    /// The plan's inputs: this snapshot, with where the job stands with Kueue and its pool,
    /// and the names held (this snapshot's, or more when a create's 409 told of others).
    pub fn plan_inputs<'a>(
        &'a self,
        job: &'a ValidatedTrainingJob,
        (queue, pool): (&'a QueueState, &'a PoolState),
        names_in_use: &'a BTreeMap<String, NameHolder>,
        restart_backoff: Duration,
    ) -> PlanInputs<'a> {
        PlanInputs {
            job,
            generation: self.generation,
            status: &self.old,
            observed: &self.observed,
            data: &self.data,
            pool,
            queue,
            now: &self.now,
            restart_backoff,
            names_in_use,
            recent: &self.recent,
        }
    }
}

/// The workers' DNS records in the cached EndpointSlice of the job's Service (named for the
/// gang's `naming`), when the job controls it.
fn published_of(
    ctx: &Context,
    job: &ValidatedTrainingJob,
    naming: names::ChildNaming,
) -> Option<Published> {
    let name = names::worker_service(job, naming);
    let key = ObjectRef::<EndpointSlice>::new(&name).within(&job.namespace);
    ctx.endpoint_slices
        .get(&key)
        .and_then(|slice| Published::of(&slice, &job.uid))
}

/// The referenced DataStage's state, from the cache.
fn data_state(ctx: &Context, job: &ValidatedTrainingJob) -> DataState {
    let Some(reference) = &job.data else {
        return DataState::NotNeeded;
    };
    let key = ObjectRef::<DataStage>::new(&reference.name).within(&job.namespace);
    match ctx.data_stages.get(&key).and_then(|s| s.status.clone()) {
        Some(status) if status.phase == DataStagePhase::Ready && status.claim_name.is_some() => {
            DataState::Ready {
                claim: status.claim_name.unwrap_or_default(),
            }
        }
        Some(status) if status.phase == DataStagePhase::Failed => DataState::Waiting {
            message: format!(
                "DataStage {} failed ({}): fix it and make it again; the job starts once it is Ready",
                reference.name,
                conditions::find(&status.conditions, crate::api::condition_types::READY)
                    .map(|c| c.message.as_str())
                    .unwrap_or("no reason given")
            ),
            failed: true,
        },
        Some(status) => DataState::Waiting {
            message: format!("DataStage {} is {:?}", reference.name, status.phase),
            failed: false,
        },
        None => DataState::Waiting {
            message: format!(
                "DataStage {} does not exist yet (or has no status)",
                reference.name
            ),
            failed: false,
        },
    }
}

/// The pods from the shared cache that carry the job's name label (same namespace), found
/// through the pod index: those owned by this UID, and who holds the names of the others (an
/// earlier job of the same name whose pods are still terminating, or pods left without a
/// controller).
fn pods_of(
    ctx: &Context,
    job: &TrainingJob,
    now: &Time,
) -> (Vec<Arc<Pod>>, BTreeMap<String, NameHolder>) {
    let namespace = job.namespace().unwrap_or_default();
    let name = job.name_any();
    let uid = job.uid();
    let (ours, others): (Vec<Arc<Pod>>, Vec<Arc<Pod>>) = ctx
        .pod_index
        .names(&namespace, &name)
        .iter()
        .filter_map(|pod| ctx.pods.get(&ObjectRef::new(pod).within(&namespace)))
        // The cache may be a moment ahead of the index, or behind it.
        .filter(|pod| pod.labels().get(names::JOB_NAME_LABEL) == Some(&name))
        .partition(|pod| {
            pod.owner_references()
                .iter()
                .any(|o| o.controller == Some(true) && Some(&o.uid) == uid.as_ref())
        });
    let holders = others
        .iter()
        .map(|pod| (pod.name_any(), NameHolder::of(pod, &name, now)))
        .collect();
    (ours, holders)
}
