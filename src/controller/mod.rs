//! The controllers: one kube-runtime `Controller` per kind, sharing a [`Context`].
//!
//! Each kind's module follows the same steps — validate → build → apply → status — one
//! submodule each. Objects are watched through `DeserializeGuard`, so one object that does
//! not deserialize is reported on its own status instead of stalling the watch.

pub mod conditions;
pub mod data_stage;
mod drain;
pub mod progress;
pub mod training_job;

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::core::error_boundary::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::store::Writer;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{Controller, WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use crate::api::{DataStage, TrainingJob, TrainingJobPhase, condition_reasons, condition_types};
use crate::kueue::{ResourceFlavor, Workload};
use crate::metrics::Metrics;
use crate::validation::FieldErrors;
use conditions::DesiredCondition;
use drain::drained;

/// How a status is written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StatusWrite {
    /// One JSON Patch replacing the whole status (what is not in it is removed), when the
    /// stored status is what the [`Fence`] expects. For a status the operator alone writes:
    /// it costs the API server about half of what an apply does (TrainingJobs, measured at
    /// 1,000 jobs).
    Replace(Fence),
    /// A server-side apply of the fields given, leaving the fields other managers own (a
    /// DataStage's `progress`, written by its stager).
    Apply,
}

/// What a status write expects of the stored status, so that a writer whose view is stale
/// (a replica that lost its leadership with a write still in flight) cannot overwrite a
/// newer one: the write is a JSON Patch whose first operation tests it, and the API server
/// refuses the whole patch when the test fails.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fence {
    /// The object has no status yet.
    NoStatus,
    /// Its status was last written by this writer (`None`: by none that said so, an older
    /// operator's).
    WrittenBy(Option<String>),
}

impl Fence {
    /// The JSON Patch that replaces the status with `status` when the fence holds.
    pub fn patch(&self, status: serde_json::Value) -> json_patch::Patch {
        let replace = serde_json::json!({"op": "add", "path": "/status", "value": status});
        serde_json::from_value(serde_json::json!([self.test(), replace])).expect("a JSON Patch")
    }

    /// The JSON Patch test operation.
    fn test(&self) -> serde_json::Value {
        match self {
            Fence::NoStatus => serde_json::json!({"op": "test", "path": "/status", "value": null}),
            Fence::WrittenBy(writer) => {
                serde_json::json!({"op": "test", "path": "/status/writtenBy", "value": writer})
            }
        }
    }
}

/// The field manager of every server-side apply, and the Events' reporting controller.
pub const FIELD_MANAGER: &str = "ringmaster";

/// Errors of a reconciliation, wrapping each step's error with the object it concerns.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The status was written by another writer since this one read it (the [`Fence`]
    /// failed): nothing was written; the object is read again.
    #[error(
        "the status of {kind} {namespace}/{name} was written by another operator replica since this one read it (expected writtenBy {expected}): not overwritten; reading it again"
    )]
    StatusFenced {
        kind: &'static str,
        namespace: String,
        name: String,
        expected: String,
    },
    /// Writing the status subresource failed.
    #[error("writing the status of {kind} {namespace}/{name}: {source}")]
    WriteStatus {
        kind: &'static str,
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    /// Carrying out a TrainingJob's plan failed.
    #[error("TrainingJob {name}: {source}")]
    Apply {
        name: String,
        #[source]
        source: training_job::apply::ApplyError,
    },
    /// Making a DataStage's volume, claim, RBAC or Job failed.
    #[error("DataStage {name}: {source}")]
    StageApply {
        name: String,
        #[source]
        source: data_stage::apply::ApplyError,
    },
    /// A TrainingJob's agent pool could not be looked after.
    #[error("TrainingJob {name}: {source}")]
    Pool {
        name: String,
        #[source]
        source: training_job::pool::PoolError,
    },
    /// Deleting an object failed.
    #[error("deleting {kind} {name}: {source}")]
    Delete {
        kind: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
}

impl Error {
    /// A short, fixed label for metrics and logs.
    pub fn category(&self) -> &'static str {
        match self {
            Error::WriteStatus { .. } => "write_status",
            Error::StatusFenced { .. } => "status_fenced",
            Error::Apply { .. } | Error::StageApply { .. } => "apply",
            Error::Pool { .. } => "node_pool",
            Error::Delete { .. } => "delete",
        }
    }

    /// The controller the error comes from.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::WriteStatus { kind, .. } | Error::StatusFenced { kind, .. } => kind,
            Error::StageApply { .. } => data_stage::CONTROLLER,
            Error::Apply { .. } | Error::Delete { .. } | Error::Pool { .. } => {
                training_job::CONTROLLER
            }
        }
    }
}

/// Settings of the controllers.
#[derive(Clone, Debug)]
pub struct OperatorConfig {
    /// Wait before a failed gang is started again; doubles with each restart (at most 5 min).
    pub restart_backoff: Duration,
    /// The image a DataStage's copy Job runs `ringmaster stage` in (the operator's own).
    pub stager_image: String,
    /// Azure Resource Manager, for TrainingJobs that bring their own AKS agent pool; `None`
    /// when the operator has no AKS settings.
    pub arm: Option<crate::aks::ArmClient>,
    /// Reconciles of one kind at once (each makes up to a gang's pods concurrently).
    pub max_concurrent_reconciles: u16,
    /// Queue TrainingJobs labelled `kueue.x-k8s.io/queue-name` in Kueue (its CRDs must be
    /// installed): Workloads and ResourceFlavors are watched.
    pub kueue: bool,
    /// Schedule every TrainingJob's pods with this scheduler (scheduler-plugins with its
    /// Coscheduling plugin, or Volcano), each job's in a PodGroup: all workers are placed at
    /// once or none is. `None`: the cluster's default scheduler.
    pub gang_scheduler: Option<crate::gang::GangScheduler>,
    /// The PriorityClass of launchers whose job sets none, so that a job whose workers are
    /// ready does not wait for the scheduler to place every other pod first. `None`: none.
    pub launcher_priority_class: Option<String>,
    /// Where DataStages may write: the NFS exports and Azure Files shares the cluster admin
    /// allows, per namespace. Empty: only `existingClaim`.
    pub data_stage_destinations: data_stage::destinations::AllowedDestinations,
    /// Give each TrainingJob a NetworkPolicy that admits to its pods only its own pods.
    pub job_network_policies: bool,
    /// What the leader does with agent pools whose TrainingJob is gone (with `arm` only).
    pub orphan_pool_sweep: training_job::sweep::SweepMode,
    /// How often the leader sweeps (and once at start).
    pub orphan_pool_sweep_every: Duration,
    /// Where launchers report progress (none: they do not, and the status shows no progress
    /// until a job ends).
    pub progress: Option<crate::report::ProgressEndpoint>,
}

/// The operator image of this version, which also runs the stager.
pub const DEFAULT_STAGER_IMAGE: &str = concat!(
    "ghcr.io/ringmaster-dev/ringmaster:",
    env!("CARGO_PKG_VERSION")
);

impl Default for OperatorConfig {
    fn default() -> Self {
        Self {
            restart_backoff: Duration::from_secs(10),
            stager_image: DEFAULT_STAGER_IMAGE.to_string(),
            arm: None,
            max_concurrent_reconciles: 16,
            kueue: false,
            gang_scheduler: None,
            launcher_priority_class: None,
            data_stage_destinations: Default::default(),
            job_network_policies: true,
            orphan_pool_sweep: Default::default(),
            orphan_pool_sweep_every: Duration::from_secs(600),
            progress: None,
        }
    }
}

/// What every reconciliation shares.
pub struct Context {
    /// The API client.
    pub client: Client,
    /// The operator's metrics.
    pub metrics: Metrics,
    /// Publishes Events as `ringmaster`.
    pub recorder: Recorder,
    /// Settings.
    pub config: OperatorConfig,
    /// Every pod Ringmaster made (label ringmaster.dev/job-name), cached by a shared reflector.
    pub pods: Store<Pod>,
    /// The writer of `pods`, taken by [`run`].
    pods_writer: Mutex<Option<Writer<Pod>>>,
    /// Which of `pods` belong to which job, kept from the same watch.
    pub pod_index: training_job::pod_index::PodIndex,
    /// The EndpointSlices of the jobs' Services, which this operator writes (label
    /// endpointslice.kubernetes.io/managed-by=ringmaster.dev): the workers' DNS records.
    pub endpoint_slices: Store<EndpointSlice>,
    /// The writer of `endpoint_slices`, taken by [`run`].
    endpoint_slices_writer: Mutex<Option<Writer<EndpointSlice>>>,
    /// Every DataStage in scope, cached: a TrainingJob reads its DataStage from here, not
    /// from the API server on each reconcile.
    pub data_stages: Store<DataStage>,
    /// The writer of `data_stages`, taken by [`run`].
    data_stages_writer: Mutex<Option<Writer<DataStage>>>,
    /// The Kueue Workloads of queued TrainingJobs (label ringmaster.dev/job-name), cached;
    /// empty without the Kueue integration.
    pub workloads: Store<Workload>,
    /// The writer of `workloads`, taken by [`run`].
    workloads_writer: Mutex<Option<Writer<Workload>>>,
    /// Kueue's ResourceFlavors (their node labels and tolerations place admitted pods).
    pub flavors: Store<ResourceFlavor>,
    /// The writer of `flavors`, taken by [`run`].
    flavors_writer: Mutex<Option<Writer<ResourceFlavor>>>,
    /// Consecutive failures per object, for exponential backoff.
    failures: Mutex<HashMap<String, u32>>,
    /// Status progress held back per object.
    progress: progress::ProgressGate,
    /// What running jobs' launchers reported, and the reconciles their reports ask for.
    pub reports: crate::report::Reports,
    /// Whether the pod and DataStage caches have their first full list: a TrainingJob is
    /// not planned from caches that do not know its pods yet.
    caches_synced: AtomicBool,
    /// What was written for each TrainingJob moments ago, until the caches show it.
    pub(crate) recent: training_job::recent::RecentWrites,
    /// This process, as the statuses it writes name it (`status.writtenBy`): the instance
    /// and a number drawn at start, so a restarted replica is another writer.
    writer: String,
}

impl Context {
    /// A context for `client`, reporting Events as `instance` (the pod name, when known).
    pub fn new(
        client: Client,
        metrics: Metrics,
        instance: Option<String>,
        config: OperatorConfig,
    ) -> Self {
        let writer = format!(
            "{}/{:08x}",
            instance.as_deref().unwrap_or(FIELD_MANAGER),
            draw_u32()
        );
        let reporter = Reporter {
            controller: FIELD_MANAGER.into(),
            instance,
        };
        let (pods, pods_writer) = reflector::store();
        let (endpoint_slices, endpoint_slices_writer) = reflector::store();
        let (data_stages, data_stages_writer) = reflector::store();
        let (workloads, workloads_writer) = reflector::store();
        let (flavors, flavors_writer) = reflector::store();
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            metrics,
            config,
            pods,
            pods_writer: Mutex::new(Some(pods_writer)),
            pod_index: Default::default(),
            endpoint_slices,
            endpoint_slices_writer: Mutex::new(Some(endpoint_slices_writer)),
            data_stages,
            data_stages_writer: Mutex::new(Some(data_stages_writer)),
            workloads,
            workloads_writer: Mutex::new(Some(workloads_writer)),
            flavors,
            flavors_writer: Mutex::new(Some(flavors_writer)),
            failures: Mutex::new(HashMap::new()),
            progress: progress::ProgressGate::default(),
            reports: crate::report::Reports::default(),
            caches_synced: AtomicBool::new(false),
            recent: training_job::recent::RecentWrites::default(),
            writer,
        }
    }

    /// This process as a status writer (`status.writtenBy`).
    pub fn writer(&self) -> &str {
        &self.writer
    }

    /// Whether the pod and DataStage caches have their first full list.
    pub(crate) fn caches_synced(&self) -> bool {
        self.caches_synced.load(Ordering::Acquire)
    }

    /// For a status change of `key` that is only progress: `None` when it may be written
    /// now, else how long it is held back (see [`progress::ProgressGate`]).
    pub(crate) fn progress_wait(&self, key: &str) -> Option<Duration> {
        self.progress.wait(key, Instant::now())
    }

    /// The status of `key` was written: no progress of it is held back.
    pub(crate) fn status_written(&self, key: &str) {
        self.progress.written(key);
    }

    /// Forgets the failures of an object that reconciled cleanly.
    fn succeeded(&self, key: &str) {
        self.failures
            .lock()
            .expect("backoff map poisoned")
            .remove(key);
    }

    /// Counts a failure and returns how long to wait before the next try: 1 s doubling up
    /// to 5 minutes.
    fn failed(&self, key: &str) -> Duration {
        let mut failures = self.failures.lock().expect("backoff map poisoned");
        let count = failures.entry(key.to_string()).or_insert(0);
        *count = count.saturating_add(1);
        Duration::from_secs(1u64 << (*count - 1).min(8)).min(Duration::from_secs(300))
    }

    /// Writes `status` as `how` says, and publishes an Event for each condition that
    /// changed. Event failures are logged, not
    /// returned: an Event is a courtesy, the status is the record.
    async fn write_status<K>(
        &self,
        object: &DeserializeGuard<K>,
        old_conditions: &[Condition],
        new_conditions: &[Condition],
        status: serde_json::Value,
        how: StatusWrite,
        warning: impl Fn(&Condition) -> bool,
    ) -> Result<(), Error>
    where
        K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + DeserializeOwned
            + Debug,
    {
        let namespace = object.namespace().unwrap_or_default();
        let name = object.name_any();
        let api: Api<DeserializeGuard<K>> = Api::namespaced(self.client.clone(), &namespace);
        let written = match &how {
            StatusWrite::Replace(fence) => {
                let patch = fence.patch(status);
                let params = PatchParams {
                    field_manager: Some(FIELD_MANAGER.into()),
                    ..PatchParams::default()
                };
                api.patch_status(&name, &params, &Patch::<()>::Json(patch))
                    .await
            }
            StatusWrite::Apply => {
                let patch = serde_json::json!({
                    "apiVersion": K::api_version(&()),
                    "kind": K::kind(&()),
                    "status": status,
                });
                api.patch_status(
                    &name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&patch),
                )
                .await
            }
        };
        written.map_err(|source| match (&how, is_failed_fence(&source)) {
            (StatusWrite::Replace(fence), true) => Error::StatusFenced {
                kind: kind_label::<K>(),
                namespace: namespace.clone(),
                name: name.clone(),
                expected: match fence {
                    Fence::NoStatus => "no status".into(),
                    Fence::WrittenBy(w) => w.clone().unwrap_or_else(|| "none".into()),
                },
            },
            _ => Error::WriteStatus {
                kind: kind_label::<K>(),
                namespace: namespace.clone(),
                name: name.clone(),
                source,
            },
        })?;
        let reference = object.object_ref(&());
        for event in conditions::transition_events(old_conditions, new_conditions, warning) {
            if let Err(error) = self.recorder.publish(&event, &reference).await {
                tracing::warn!(%namespace, %name, reason = %event.reason, %error, "could not publish Event");
            }
        }
        Ok(())
    }
}

impl Context {
    /// Publishes a Warning Event about `object` (the note cut to the 1,000 characters Events
    /// keep); a failure to publish is logged, not returned.
    pub(crate) async fn warn<K: Resource<DynamicType = ()>>(
        &self,
        object: &K,
        reason: &str,
        message: &str,
    ) {
        self.warn_about(object, reason, message, None).await;
    }

    /// [`Context::warn`] about `related` too (a pod the words name): Events of one reason
    /// about different objects stay apart, each with its own note, where the recorder
    /// would count the second as a repeat of the first and keep the first's note.
    pub(crate) async fn warn_about<K: Resource<DynamicType = ()>>(
        &self,
        object: &K,
        reason: &str,
        message: &str,
        related: Option<k8s_openapi::api::core::v1::ObjectReference>,
    ) {
        let event = kube::runtime::events::Event {
            type_: kube::runtime::events::EventType::Warning,
            reason: reason.into(),
            note: Some(message.chars().take(1000).collect()),
            action: "Reconcile".into(),
            secondary: related,
        };
        if let Err(error) = self.recorder.publish(&event, &object.object_ref(&())).await {
            tracing::warn!(%reason, %error, "could not publish Event");
        }
    }
}

fn kind_label<K: Resource<DynamicType = ()>>() -> &'static str {
    match K::kind(&()).as_ref() {
        "TrainingJob" => training_job::CONTROLLER,
        "DataStage" => data_stage::CONTROLLER,
        _ => "unknown",
    }
}

/// 5 hex digits of an object's UID: names of children made with it differ between an object
/// and one made again under the same name while the first one's children are still being
/// deleted.
pub(crate) fn uid_tag(uid: &str) -> String {
    uid.chars()
        .filter(char::is_ascii_hexdigit)
        .map(|c| c.to_ascii_lowercase())
        .take(5)
        .collect()
}

/// Whether the API server answered 404.
pub(crate) fn is_not_found(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 404)
}

/// Whether the API server refused a fenced status write because its test operation failed.
/// Kubernetes answers a JSON Patch it cannot apply with a bare 422 ("the server rejected our
/// request due to an error in our request", reason Invalid, no causes), unlike a status its
/// schema refuses (422 naming the fields); the fence's patch is well formed, so such an
/// answer is its test failing. (Servers that pass the JSON Patch library's words on say
/// "testing value … failed".)
pub fn is_failed_fence(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status)
        if status.code == 422
            && (status.message.starts_with("the server rejected our request")
                || status.message.contains("testing value")))
}

/// A random number (a writer's start nonce).
fn draw_u32() -> u32 {
    let mut bytes = [0u8; 4];
    getrandom::fill(&mut bytes).expect("the OS's random source");
    u32::from_le_bytes(bytes)
}

/// Whether the API server answered 409 (exists, or a conflicting write).
pub(crate) fn is_conflict(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 409)
}

/// Server-side apply of `object` as `ringmaster`, taking over fields from other managers.
pub(crate) async fn server_side_apply<K>(api: &Api<K>, object: &K) -> Result<K, kube::Error>
where
    K: Resource + serde::Serialize + Clone + DeserializeOwned + Debug,
{
    api.patch(
        &object.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(object),
    )
    .await
}

/// Puts `finalizer` on `object` (`present`) or takes it off, with a merge patch that carries
/// the object's resourceVersion: it fails, and the reconcile is retried, when the object
/// changed meanwhile, so other controllers' finalizers are never lost. Nothing is sent when
/// the finalizer is already as wanted; an object already gone is fine.
/// Removes `finalizer` from an object known by its metadata alone (one whose stored form
/// no longer parses): a merge patch on the metadata, conditional on `meta`'s
/// resourceVersion, whose answer is read as metadata only.
pub(crate) async fn remove_finalizer_from_metadata<K>(
    client: &Client,
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    finalizer: &str,
) -> Result<(), kube::Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + Debug,
{
    let current = meta.finalizers.clone().unwrap_or_default();
    if !current.iter().any(|f| f == finalizer) {
        return Ok(());
    }
    let wanted: Vec<&String> = current.iter().filter(|f| *f != finalizer).collect();
    let api: Api<K> = Api::namespaced(
        client.clone(),
        meta.namespace.as_deref().unwrap_or_default(),
    );
    let patch = serde_json::json!({
        "metadata": {"finalizers": wanted, "resourceVersion": meta.resource_version}
    });
    let name = meta.name.as_deref().unwrap_or_default();
    match api
        .patch_metadata(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => Ok(()),
        Err(e) if is_not_found(&e) => Ok(()),
        Err(e) => Err(e),
    }
}

pub(crate) async fn set_finalizer<K>(
    client: &Client,
    object: &K,
    finalizer: &str,
    present: bool,
) -> Result<(), kube::Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + Debug,
{
    let current = object.finalizers();
    if current.iter().any(|f| f == finalizer) == present {
        return Ok(());
    }
    let mut wanted: Vec<&str> = current
        .iter()
        .map(String::as_str)
        .filter(|f| *f != finalizer)
        .collect();
    if present {
        wanted.push(finalizer);
    }
    let api: Api<K> = Api::namespaced(client.clone(), &object.namespace().unwrap_or_default());
    let patch = serde_json::json!({
        "metadata": {"finalizers": wanted, "resourceVersion": object.resource_version()}
    });
    match api
        .patch(
            &object.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(e) if is_not_found(&e) => Ok(()),
        Err(e) => Err(e),
    }
}

/// The current time as a Kubernetes timestamp (the one clock read of a reconciliation).
fn now() -> Time {
    Time(Timestamp::now())
}

/// The conditions of an object whose spec is invalid: not valid, not ready, stalled until
/// the spec changes, each saying why.
pub(crate) fn invalid_spec_conditions(errors: &FieldErrors) -> Vec<DesiredCondition> {
    use condition_reasons::INVALID_SPEC;
    use condition_types::{READY, RECONCILING, SPEC_VALID, STALLED};
    let message = format!("invalid spec: {errors}");
    vec![
        DesiredCondition::new(SPEC_VALID, false, INVALID_SPEC, message.clone()),
        DesiredCondition::new(READY, false, INVALID_SPEC, message.clone()),
        DesiredCondition::new(RECONCILING, false, INVALID_SPEC, message.clone()),
        DesiredCondition::new(STALLED, true, INVALID_SPEC, message),
    ]
}

/// The API server's refusal of a child, when `error` is one: a 4xx or 5xx answer other than
/// a conflict (409) or throttling (429), which pass by themselves. The text is the API
/// server's message; it never holds the child's data.
pub(crate) fn rejection(error: &kube::Error) -> Option<&str> {
    match error {
        kube::Error::Api(status)
            if (400..600).contains(&status.code) && !matches!(status.code, 409 | 429) =>
        {
            Some(status.message.as_str())
        }
        _ => None,
    }
}

/// A Warning Event for an invalid spec; Normal for everything else at this stage.
pub(crate) fn is_warning(condition: &Condition) -> bool {
    condition.type_ == condition_types::SPEC_VALID && condition.status == "False"
}

fn object_key<K: Resource>(object: &K) -> String {
    format!(
        "{}/{}/{}",
        object.meta().namespace.as_deref().unwrap_or_default(),
        object.meta().name.as_deref().unwrap_or_default(),
        object.meta().uid.as_deref().unwrap_or_default()
    )
}

/// Every minute, forgets the reports of jobs whose launchers fell silent for 10 minutes
/// (a job deleted while another replica led, a launcher gone without a word) and their
/// progress series.
fn spawn_report_sweep(ctx: &Arc<Context>, shutdown: CancellationToken) {
    let ctx = ctx.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(60));
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = every.tick() => {}
            }
            let now = k8s_openapi::jiff::Timestamp::now();
            for key in ctx.reports.board.stale(now, Duration::from_secs(600)) {
                if let Some((namespace, name)) = key.split_once('/') {
                    training_job::forget_reports(&ctx, namespace, name);
                }
            }
        }
    });
}

/// Retries a failed reconciliation with per-object exponential backoff.
fn error_policy<K>(object: Arc<DeserializeGuard<K>>, error: &Error, ctx: Arc<Context>) -> Action
where
    K: Resource<DynamicType = ()>,
{
    ctx.metrics.reconcile_failed(error.kind(), error.category());
    let delay = ctx.failed(&object_key(object.as_ref()));
    tracing::warn!(%error, category = error.category(), retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

/// Where the controllers watch.
#[derive(Clone, Debug, Default)]
pub struct Scope {
    /// One namespace, or every namespace when `None`.
    pub namespace: Option<String>,
}

impl Scope {
    fn api<K>(&self, client: &Client) -> Api<K>
    where
        K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
    {
        match &self.namespace {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        }
    }
}

/// Runs both controllers until `shutdown` is cancelled; sets `ready` once their caches have
/// synced.
pub async fn run(
    ctx: Arc<Context>,
    scope: Scope,
    ready: Arc<AtomicBool>,
    shutdown: CancellationToken,
) {
    let watch = watcher::Config::default().any_semantic();
    let (jobs, job_store) = job_controller(&ctx, &scope, &watch);
    let jobs = with_kueue_streams(jobs, &ctx, &scope, &watch);
    let triggers = ctx
        .reports
        .take_triggers()
        .map(|mut triggered| futures::stream::poll_fn(move |cx| triggered.poll_recv(cx)));
    let jobs = match triggers {
        // A launcher's report wakes its job (its status shows it at the next write).
        Some(triggers) => jobs.reconcile_on(triggers),
        None => jobs,
    };
    spawn_report_sweep(&ctx, shutdown.clone());
    let stages_writer = take_writer(&ctx.data_stages_writer);
    // DataStages fill the store a job's reconcile reads, and wake the jobs that read them.
    let stage_events = watcher(scope.api::<DataStage>(&ctx.client), watch.clone())
        .default_backoff()
        .reflect(stages_writer)
        .touched_objects();
    let jobs_by_stage = job_store.clone();
    let jobs = jobs
        .owns_stream(pod_events(&ctx, &scope))
        .owns_stream(endpoint_slice_events(&ctx, &scope))
        .watches_stream(stage_events, move |stage: DataStage| {
            jobs_reading(&jobs_by_stage, &stage)
        })
        // Pod events come in bursts (a gang's pods change together): one reconcile per burst.
        .with_config(
            kube::runtime::controller::Config::default()
                .debounce(Duration::from_millis(200))
                .concurrency(ctx.config.max_concurrent_reconciles),
        )
        .graceful_shutdown_on(shutdown.clone().cancelled_owned());
    let stages = data_stage_controller(&ctx, &scope, watch, &shutdown);
    spawn_readiness(&ctx, (job_store.clone(), stages.store()), ready);
    spawn_phase_gauge(&ctx, job_store, shutdown.clone());
    spawn_orphan_pool_sweep(&ctx, &shutdown);
    let jobs = jobs
        .run(training_job::reconcile, error_policy, ctx.clone())
        .for_each(|result| async move { log_result(training_job::CONTROLLER, result) });
    let stages = stages
        .run(data_stage::reconcile, error_policy, ctx.clone())
        .for_each(|result| async move { log_result(data_stage::CONTROLLER, result) });
    futures::future::join(jobs, stages).await;
    tracing::info!("controllers stopped");
}

type JobController = Controller<DeserializeGuard<TrainingJob>>;

/// The TrainingJob controller over its own watch and cache. The watch is read on a task of
/// its own (drain.rs), as the pods' is: a job's status changes with its pods.
fn job_controller(
    ctx: &Context,
    scope: &Scope,
    watch: &watcher::Config,
) -> (JobController, Store<DeserializeGuard<TrainingJob>>) {
    let (job_store, jobs_writer) = reflector::store::<DeserializeGuard<TrainingJob>>();
    let job_events = drained(
        watcher(
            scope.api::<DeserializeGuard<TrainingJob>>(&ctx.client),
            watch.clone(),
        )
        .default_backoff()
        .reflect(jobs_writer)
        .applied_objects(),
    );
    (
        Controller::for_stream(job_events, job_store.clone()),
        job_store,
    )
}

/// With Kueue: a Workload's change (admitted, evicted, readmitted) wakes the job that owns it;
/// ResourceFlavors are only read (at admission), so they are cached and wake no job.
fn with_kueue_streams(
    jobs: JobController,
    ctx: &Context,
    scope: &Scope,
    watch: &watcher::Config,
) -> JobController {
    let workloads_writer = take_writer(&ctx.workloads_writer);
    let flavors_writer = take_writer(&ctx.flavors_writer);
    if !ctx.config.kueue {
        return jobs;
    }
    let workload_events = watcher(
        scope.api::<Workload>(&ctx.client),
        watcher::Config::default()
            .labels(training_job::names::JOB_NAME_LABEL)
            .any_semantic(),
    )
    .default_backoff()
    .reflect(workloads_writer)
    .touched_objects();
    let flavor_events = watcher(
        Api::<ResourceFlavor>::all(ctx.client.clone()),
        watch.clone(),
    )
    .default_backoff()
    .reflect(flavors_writer)
    .touched_objects();
    jobs.owns_stream(workload_events)
        .watches_stream(flavor_events, |_| std::iter::empty())
}

/// The operator's pods, as events that wake their jobs.
///
/// One watch of the operator's pods fills the store reconcile reads and wakes the owning
/// jobs: every applied *and deleted* pod triggers its owner (a gang restart waits for the
/// old pods to be gone). kube-runtime's shared-store subscription is not used: it dispatches
/// no deletions, and its handle stalls (Pending without a wake-up) when an object it
/// announces has left the store before it is read, which real pods being deleted do
/// (found on the real node: the job stopped hearing of its pods).
/// Pods are stripped to what the controller reads before they are stored: thousands of
/// them are cached, and most of a pod's bytes are its spec and managed fields.
/// A pod's new words alone (a scheduler retrying it) are stored but wake nobody.
/// The watch is read on a task of its own (drain.rs), so no reconcile holds its reading back.
fn pod_events(
    ctx: &Context,
    scope: &Scope,
) -> impl futures::Stream<Item = Result<Pod, watcher::Error>> + Send + 'static {
    let pods_writer = take_writer(&ctx.pods_writer);
    let pod_watch = watcher::Config::default()
        .labels(training_job::names::JOB_NAME_LABEL)
        .any_semantic();
    let mut wake_filter = training_job::observe::PodWakeFilter::default();
    let index = ctx.pod_index.clone();
    drained(
        watcher(scope.api::<Pod>(&ctx.client), pod_watch)
            .default_backoff()
            .modify(training_job::observe::strip_for_cache)
            .reflect(pods_writer)
            .inspect_ok(move |event| index.apply(event))
            .filter(move |event| {
                std::future::ready(event.as_ref().map_or(true, |e| wake_filter.wakes(e)))
            })
            .touched_objects(),
    )
}

/// The jobs' EndpointSlices (the workers' DNS records this operator writes) fill the cache a
/// job's reconcile reads; a change wakes the owning job, so that a slice deleted or changed by
/// someone else is written again. Stored without their managed fields.
fn endpoint_slice_events(
    ctx: &Context,
    scope: &Scope,
) -> impl futures::Stream<Item = Result<EndpointSlice, watcher::Error>> + Send + 'static {
    let writer = take_writer(&ctx.endpoint_slices_writer);
    let ours = format!(
        "{}={}",
        training_job::names::SLICE_MANAGED_BY_LABEL,
        training_job::names::SLICE_MANAGER
    );
    let slice_watch = watcher::Config::default().labels(&ours).any_semantic();
    watcher(scope.api::<EndpointSlice>(&ctx.client), slice_watch)
        .default_backoff()
        .modify(|slice| {
            slice.metadata.managed_fields = None;
            slice.metadata.annotations = None;
        })
        .reflect(writer)
        .touched_objects()
}

/// The jobs in `stage`'s namespace that read it: its change wakes them.
fn jobs_reading(
    jobs: &Store<DeserializeGuard<TrainingJob>>,
    stage: &DataStage,
) -> Vec<ObjectRef<DeserializeGuard<TrainingJob>>> {
    let namespace = stage.namespace();
    let name = stage.name_any();
    jobs.state()
        .into_iter()
        .filter(|job| {
            job.meta().namespace == namespace
                && job.0.as_ref().is_ok_and(|j| {
                    j.spec
                        .data_stage_ref
                        .as_ref()
                        .is_some_and(|r| r.name == name)
                })
        })
        .map(|job| ObjectRef::from_obj(job.as_ref()))
        .collect()
}

/// With an ARM client: the sweep of agent pools whose jobs are gone.
fn spawn_orphan_pool_sweep(ctx: &Context, shutdown: &CancellationToken) {
    if let Some(arm) = ctx.config.arm.clone() {
        tokio::spawn(training_job::sweep::run(
            ctx.client.clone(),
            arm,
            ctx.config.orphan_pool_sweep,
            ctx.config.orphan_pool_sweep_every,
            shutdown.clone(),
        ));
    }
}

/// Takes a cache's writer: the controllers' watches fill the cache through it, once.
fn take_writer<K>(writer: &Mutex<Option<Writer<K>>>) -> Writer<K>
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Default,
{
    writer
        .lock()
        .expect("cache writer lock")
        .take()
        .expect("controller::run is called once per Context")
}

/// The DataStage controller: its Jobs and claims (only those made for DataStages are cached)
/// wake it.
fn data_stage_controller(
    ctx: &Arc<Context>,
    scope: &Scope,
    watch: watcher::Config,
    shutdown: &CancellationToken,
) -> Controller<DeserializeGuard<DataStage>> {
    let stage_children = watcher::Config::default()
        .labels(data_stage::build::STAGE_LABEL)
        .any_semantic();
    Controller::new(scope.api::<DeserializeGuard<DataStage>>(&ctx.client), watch)
        .owns(
            scope.api::<k8s_openapi::api::batch::v1::Job>(&ctx.client),
            stage_children.clone(),
        )
        .owns(
            scope.api::<k8s_openapi::api::core::v1::PersistentVolumeClaim>(&ctx.client),
            stage_children,
        )
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
}

/// Sets `ready` (and lets TrainingJobs be planned) once every cache has its first full list.
fn spawn_readiness(
    ctx: &Arc<Context>,
    (jobs, stages): (
        Store<DeserializeGuard<TrainingJob>>,
        Store<DeserializeGuard<DataStage>>,
    ),
    ready: Arc<AtomicBool>,
) {
    let (pods, staged) = (ctx.pods.clone(), ctx.data_stages.clone());
    let slices = ctx.endpoint_slices.clone();
    let (workloads, flavors) = (ctx.workloads.clone(), ctx.flavors.clone());
    let kueue = ctx.config.kueue;
    let synced = ctx.clone();
    tokio::spawn(async move {
        if wait_until_ready(&jobs).await
            && wait_until_ready(&stages).await
            && wait_until_ready(&pods).await
            && wait_until_ready(&staged).await
            && wait_until_ready(&slices).await
            && (!kueue || (wait_until_ready(&workloads).await && wait_until_ready(&flavors).await))
        {
            synced.caches_synced.store(true, Ordering::Release);
            ready.store(true, Ordering::Release);
            tracing::info!("caches synced; ready");
        }
    });
}

/// Counts the TrainingJobs and DataStages by namespace and phase, and each DataStage's copy,
/// from the caches every few seconds, for the gauges (a listing also drops the series of
/// what is gone).
fn spawn_phase_gauge(
    ctx: &Arc<Context>,
    jobs: Store<DeserializeGuard<TrainingJob>>,
    shutdown: CancellationToken,
) {
    let metrics = ctx.metrics.clone();
    let stages = ctx.data_stages.clone();
    tokio::spawn(async move {
        loop {
            metrics.set_training_jobs_by_phase(&job_phases(&jobs));
            metrics.set_data_stages(&data_stage_samples(&stages));
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(Duration::from_secs(5)) => {}
            }
        }
    });
}

/// Each readable cached TrainingJob's namespace and phase.
fn job_phases(jobs: &Store<DeserializeGuard<TrainingJob>>) -> Vec<(String, TrainingJobPhase)> {
    jobs.state()
        .iter()
        .filter_map(|j| {
            let job = j.0.as_ref().ok()?;
            let phase = job.status.as_ref().map(|s| s.phase).unwrap_or_default();
            Some((job.namespace().unwrap_or_default(), phase))
        })
        .collect()
}

/// What each cached DataStage shows in the metrics; one being deleted shows nothing (its
/// reconcile took its series off already, and they must not come back).
fn data_stage_samples(stages: &Store<DataStage>) -> Vec<crate::metrics::DataStageSample> {
    stages
        .state()
        .iter()
        .filter(|stage| stage.meta().deletion_timestamp.is_none())
        .map(|stage| {
            let status = stage.status.clone().unwrap_or_default();
            crate::metrics::DataStageSample {
                namespace: stage.namespace().unwrap_or_default(),
                name: stage.name_any(),
                phase: status.phase,
                progress: status.progress,
            }
        })
        .collect()
}

/// Waits until a controller's cache has its first full list; false if it never will.
///
/// The store's readiness is a oneshot channel that wakes only its most recent poller, and
/// the controller itself polls it too; re-polling on a timer keeps this waiter from being
/// forgotten.
async fn wait_until_ready<K>(store: &kube::runtime::reflector::Store<K>) -> bool
where
    K: kube::runtime::reflector::Lookup + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    loop {
        match tokio::time::timeout(Duration::from_millis(250), store.wait_until_ready()).await {
            Ok(result) => return result.is_ok(),
            Err(_elapsed) => continue,
        }
    }
}

fn log_result<T: Debug, E: std::error::Error>(controller: &str, result: Result<T, E>) {
    match result {
        Ok(object) => tracing::debug!(controller, ?object, "reconciled"),
        Err(error) => tracing::debug!(controller, %error, "reconcile did not complete"),
    }
}

/// What the reconcile tier (`training_job::reconcile_tests`) needs of a context.
#[cfg(test)]
impl Context {
    /// Puts `pods` in the pod cache, as the watch would, and counts the caches as listed.
    pub(crate) fn cache_pods(&self, pods: impl IntoIterator<Item = Pod>) {
        let mut writer = self.pods_writer.lock().expect("writer poisoned");
        let writer = writer
            .as_mut()
            .expect("the pod cache's writer is not taken in tests");
        for pod in pods {
            let event = watcher::Event::Apply(pod);
            writer.apply_watcher_event(&event);
            self.pod_index.apply(&event);
        }
        self.caches_synced.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data_stage(name: &str, deleting: bool) -> DataStage {
        let mut stage: DataStage = serde_json::from_value(serde_json::json!({
            "apiVersion": "ringmaster.dev/v1alpha1",
            "kind": "DataStage",
            "metadata": {"name": name, "namespace": "team-a"},
            "spec": {
                "source": {"azureBlob": {
                    "account": "a", "container": "c",
                    "auth": {"sasTokenSecretRef": {"name": "s", "key": "k"}},
                }},
                "destination": {"existingClaim": {"claimName": "data"}},
            },
            "status": {"phase": "Copying", "progress": {"bytesDone": 7, "bytesTotal": 9}},
        }))
        .unwrap();
        if deleting {
            stage.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
        }
        stage
    }

    #[test]
    fn data_stages_being_deleted_are_not_shown_in_the_metrics() {
        let (store, mut writer) = reflector::store();
        for stage in [data_stage("kept", false), data_stage("going", true)] {
            writer.apply_watcher_event(&watcher::Event::Apply(stage));
        }
        let samples = data_stage_samples(&store);
        let names = samples.iter().map(|s| s.name.as_str()).collect::<Vec<_>>();
        assert_eq!(names, ["kept"]);
        assert_eq!(samples[0].namespace, "team-a");
        assert_eq!(samples[0].phase, crate::api::DataStagePhase::Copying);
        assert_eq!(samples[0].progress.as_ref().map(|p| p.bytes_done), Some(7));
    }

    fn api_error(code: u16) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure("pods \"w-0\" is forbidden: no PriorityClass", "Forbidden")
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn refusals_are_told_from_errors_that_pass_by_themselves() {
        for code in [400, 403, 404, 422, 500, 503] {
            assert_eq!(
                rejection(&api_error(code)),
                Some("pods \"w-0\" is forbidden: no PriorityClass"),
                "{code}"
            );
        }
        for code in [409, 429] {
            assert_eq!(rejection(&api_error(code)), None, "{code}");
        }
    }
}
