//! Prometheus metrics of the operator, served on `/metrics`.

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};

use prometheus::core::Collector;
use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramTimer, HistogramVec, IntCounterVec, IntGaugeVec,
    Opts, Registry, TextEncoder,
};

use crate::api::{DataStagePhase, TrainingJobPhase};

/// The commit the binary was built from, as the Makefile and Dockerfile pass it.
const GIT_COMMIT: Option<&str> = option_env!("RINGMASTER_GIT_COMMIT");

/// Every DataStage phase, so a namespace's gauge shows zeros rather than missing series.
const DATA_STAGE_PHASES: [DataStagePhase; 5] = [
    DataStagePhase::Pending,
    DataStagePhase::Binding,
    DataStagePhase::Copying,
    DataStagePhase::Ready,
    DataStagePhase::Failed,
];

/// Every TrainingJob phase, so a namespace's gauge shows zeros rather than missing series.
const TRAINING_JOB_PHASES: [TrainingJobPhase; 10] = [
    TrainingJobPhase::Pending,
    TrainingJobPhase::WaitingForData,
    TrainingJobPhase::Queued,
    TrainingJobPhase::ProvisioningNodes,
    TrainingJobPhase::Starting,
    TrainingJobPhase::Running,
    TrainingJobPhase::Restarting,
    TrainingJobPhase::Suspended,
    TrainingJobPhase::Succeeded,
    TrainingJobPhase::Failed,
];

/// The operator's metrics, in a registry of their own.
///
/// Object counts and job timings carry the namespace (bounded by the namespaces in use);
/// the reconcile counters stay per controller: a label per object would make a series per
/// TrainingJob and DataStage ever reconciled, unbounded in a long-lived operator. Series
/// per object exist only for what is live (running jobs, existing DataStages) and are
/// removed when it goes.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    reconciles: IntCounterVec,
    failures: IntCounterVec,
    duration: HistogramVec,
    jobs_by_phase: IntGaugeVec,
    time_to_running: HistogramVec,
    restarts: IntCounterVec,
    kube_requests: IntCounterVec,
    progress: JobProgressGauges,
    stages_by_phase: IntGaugeVec,
    stage_progress: DataStageGauges,
    /// The label values of series that are set from a full listing, so that those the
    /// next listing lacks are removed.
    listed: Arc<Mutex<Listed>>,
}

/// Label values last set from a listing of the caches.
#[derive(Default)]
struct Listed {
    job_namespaces: BTreeSet<String>,
    stage_namespaces: BTreeSet<String>,
    stages: BTreeSet<(String, String)>,
}

/// What one DataStage shows in the metrics: its phase and the stager's progress.
#[derive(Clone, Debug, PartialEq)]
pub struct DataStageSample {
    /// The DataStage's namespace.
    pub namespace: String,
    /// The DataStage's name.
    pub name: String,
    /// Its phase.
    pub phase: DataStagePhase,
    /// What its stager reported, if it reported yet.
    pub progress: Option<crate::api::data_stage::Progress>,
}

/// A DataStage's copy, a series per DataStage (labels `namespace`, `name`): bounded by the
/// DataStages that exist, each removed when its DataStage is deleted.
#[derive(Clone)]
struct DataStageGauges {
    copied_bytes: GaugeVec,
    size_bytes: GaugeVec,
    copied_files: GaugeVec,
    files: GaugeVec,
    rate: GaugeVec,
}

impl DataStageGauges {
    fn new() -> Self {
        Self {
            copied_bytes: object_gauge(
                "ringmaster_datastage_copied_bytes",
                "Bytes a DataStage's stager copied or found there and verified",
            ),
            size_bytes: object_gauge(
                "ringmaster_datastage_size_bytes",
                "Bytes under a DataStage's source prefix",
            ),
            copied_files: object_gauge(
                "ringmaster_datastage_copied_files",
                "Blobs a DataStage's stager copied or found there and verified",
            ),
            files: object_gauge(
                "ringmaster_datastage_files",
                "Blobs under a DataStage's source prefix",
            ),
            rate: object_gauge(
                "ringmaster_datastage_copy_rate_bytes_per_second",
                "A copying DataStage's current rate in bytes per second",
            ),
        }
    }

    fn all(&self) -> [&GaugeVec; 5] {
        [
            &self.copied_bytes,
            &self.size_bytes,
            &self.copied_files,
            &self.files,
            &self.rate,
        ]
    }

    /// Sets a DataStage's series: the counts once its stager reported, the rate only
    /// while it copies (a finished copy has no rate, and its last one would mislead).
    fn set(&self, stage: &DataStageSample) {
        let labels = [stage.namespace.as_str(), stage.name.as_str()];
        let Some(progress) = &stage.progress else {
            self.forget(&labels);
            return;
        };
        let counts = [
            (&self.copied_bytes, progress.bytes_done),
            (&self.size_bytes, progress.bytes_total),
            (&self.copied_files, progress.files_done),
            (&self.files, progress.files_total),
        ];
        for (gauge, value) in counts {
            gauge.with_label_values(&labels).set(value as f64);
        }
        if stage.phase == DataStagePhase::Copying {
            let rate = progress.bytes_per_second as f64;
            self.rate.with_label_values(&labels).set(rate);
        } else {
            let _ = self.rate.remove_label_values(&labels);
        }
    }

    fn forget(&self, labels: &[&str; 2]) {
        for gauge in self.all() {
            let _ = gauge.remove_label_values(labels);
        }
    }
}

/// What running jobs report, a series per job (labels `namespace`, `name`): bounded by the
/// jobs running, each removed when its job stops running.
#[derive(Clone)]
struct JobProgressGauges {
    steps: GaugeVec,
    total_steps: GaugeVec,
    loss: GaugeVec,
    images_per_second: GaugeVec,
    seconds_remaining: GaugeVec,
}

impl JobProgressGauges {
    fn new() -> Self {
        Self {
            steps: object_gauge(
                "ringmaster_trainingjob_progress_steps",
                "Steps a running TrainingJob reported done",
            ),
            total_steps: object_gauge(
                "ringmaster_trainingjob_progress_total_steps",
                "Steps a running TrainingJob trains in all, as it reported",
            ),
            loss: object_gauge(
                "ringmaster_trainingjob_progress_loss",
                "The loss a running TrainingJob reported last",
            ),
            images_per_second: object_gauge(
                "ringmaster_trainingjob_progress_images_per_second",
                "Images per second over all ranks of a running TrainingJob (recent rate)",
            ),
            seconds_remaining: object_gauge(
                "ringmaster_trainingjob_progress_seconds_remaining",
                "Estimated seconds until a running TrainingJob's last step",
            ),
        }
    }

    fn all(&self) -> [&GaugeVec; 5] {
        [
            &self.steps,
            &self.total_steps,
            &self.loss,
            &self.images_per_second,
            &self.seconds_remaining,
        ]
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let registry = Registry::new();
        let reconciles = IntCounterVec::new(
            Opts::new(
                "ringmaster_reconcile_total",
                "Reconciliations run, by controller",
            ),
            &["controller"],
        )
        .expect("valid metric");
        let failures = IntCounterVec::new(
            Opts::new(
                "ringmaster_reconcile_errors_total",
                "Reconciliations that failed, by controller and error category",
            ),
            &["controller", "category"],
        )
        .expect("valid metric");
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "ringmaster_reconcile_duration_seconds",
                "Time one reconciliation took",
            )
            .buckets(vec![
                0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
            &["controller"],
        )
        .expect("valid metric");
        let jobs_by_phase = IntGaugeVec::new(
            Opts::new(
                "ringmaster_trainingjobs",
                "TrainingJobs by namespace and phase",
            ),
            &["namespace", "phase"],
        )
        .expect("valid metric");
        let time_to_running = HistogramVec::new(
            HistogramOpts::new(
                "ringmaster_trainingjob_time_to_running_seconds",
                "Time from a TrainingJob's creation until its launcher first runs",
            )
            .buckets(vec![
                1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
            ]),
            &["namespace"],
        )
        .expect("valid metric");
        let restarts = IntCounterVec::new(
            Opts::new(
                "ringmaster_trainingjob_restarts_total",
                "Gang restarts of TrainingJobs after a retryable failure, by namespace",
            ),
            &["namespace"],
        )
        .expect("valid metric");
        let kube_requests = IntCounterVec::new(
            Opts::new(
                "ringmaster_kube_requests_total",
                "Requests sent to the Kubernetes API server, by HTTP method and response \
                 status code (error: no response)",
            ),
            &["method", "code"],
        )
        .expect("valid metric");
        let stages_by_phase = IntGaugeVec::new(
            Opts::new("ringmaster_datastages", "DataStages by namespace and phase"),
            &["namespace", "phase"],
        )
        .expect("valid metric");
        let progress = JobProgressGauges::new();
        let stage_progress = DataStageGauges::new();
        let gauges = progress.all().into_iter().chain(stage_progress.all());
        let mut collectors = gauges
            .map(|g| Box::new(g.clone()) as Box<dyn Collector>)
            .collect::<Vec<_>>();
        collectors.extend([
            Box::new(kube_requests.clone()) as Box<dyn Collector>,
            Box::new(reconciles.clone()),
            Box::new(failures.clone()),
            Box::new(duration.clone()),
            Box::new(jobs_by_phase.clone()),
            Box::new(time_to_running.clone()),
            Box::new(restarts.clone()),
            Box::new(stages_by_phase.clone()),
            Box::new(build_info()),
        ]);
        collectors.extend(process_collector());
        for collector in collectors {
            registry
                .register(collector)
                .expect("metric registered once");
        }
        Self {
            registry,
            reconciles,
            failures,
            duration,
            jobs_by_phase,
            time_to_running,
            restarts,
            kube_requests,
            progress,
            stages_by_phase,
            stage_progress,
            listed: Arc::default(),
        }
    }

    /// A running job's reported progress (values it did not report are left out).
    pub fn set_job_progress(
        &self,
        namespace: &str,
        name: &str,
        progress: &crate::api::TrainingProgress,
        seconds_remaining: Option<f64>,
    ) {
        let labels = [namespace, name];
        let g = &self.progress;
        g.steps.with_label_values(&labels).set(progress.step as f64);
        let optional = [
            (&g.total_steps, progress.total_steps.map(|t| t as f64)),
            (&g.loss, progress.loss),
            (
                &g.images_per_second,
                progress.images_per_second.map(|r| r as f64),
            ),
            (&g.seconds_remaining, seconds_remaining),
        ];
        for (gauge, value) in optional {
            match value {
                Some(value) => gauge.with_label_values(&labels).set(value),
                None => {
                    let _ = gauge.remove_label_values(&labels);
                }
            }
        }
    }

    /// Removes a job's progress series (it stopped running, or is gone).
    pub fn forget_job_progress(&self, namespace: &str, name: &str) {
        for gauge in self.progress.all() {
            let _ = gauge.remove_label_values(&[namespace, name]);
        }
    }

    /// Counts a request to the API server and the status `code` of its response
    /// (`error` when none came).
    pub fn kube_request(&self, method: &str, code: &str) {
        self.kube_requests.with_label_values(&[method, code]).inc();
    }

    /// Sets the jobs-by-phase gauge from every job's namespace and phase; the series of a
    /// namespace with no jobs any more are removed.
    pub fn set_training_jobs_by_phase(&self, jobs: &[(String, TrainingJobPhase)]) {
        let mut listed = self.listed.lock().expect("metrics lock");
        set_by_phase(
            &self.jobs_by_phase,
            &TRAINING_JOB_PHASES,
            jobs,
            &mut listed.job_namespaces,
        );
    }

    /// Sets the DataStage gauges from every DataStage: the by-phase counts per namespace
    /// and each one's copy; the series of DataStages (and namespaces) that are gone are
    /// removed.
    pub fn set_data_stages(&self, stages: &[DataStageSample]) {
        let phases = stages
            .iter()
            .map(|s| (s.namespace.clone(), s.phase))
            .collect::<Vec<_>>();
        let mut listed = self.listed.lock().expect("metrics lock");
        set_by_phase(
            &self.stages_by_phase,
            &DATA_STAGE_PHASES,
            &phases,
            &mut listed.stage_namespaces,
        );
        let now = stages
            .iter()
            .map(|s| (s.namespace.clone(), s.name.clone()))
            .collect::<BTreeSet<_>>();
        for (namespace, name) in listed.stages.difference(&now) {
            self.stage_progress.forget(&[namespace, name]);
        }
        for stage in stages {
            self.stage_progress.set(stage);
        }
        listed.stages = now;
    }

    /// Removes a DataStage's copy series (it is being deleted).
    pub fn forget_data_stage(&self, namespace: &str, name: &str) {
        let mut listed = self.listed.lock().expect("metrics lock");
        listed
            .stages
            .remove(&(namespace.to_owned(), name.to_owned()));
        self.stage_progress.forget(&[namespace, name]);
    }

    /// Records how long a job in `namespace` took from creation to Running.
    pub fn training_job_running_after(&self, namespace: &str, seconds: f64) {
        self.time_to_running
            .with_label_values(&[namespace])
            .observe(seconds);
    }

    /// Counts a gang restart of a job in `namespace`.
    pub fn training_job_restarted(&self, namespace: &str) {
        self.restarts.with_label_values(&[namespace]).inc();
    }

    /// Counts a reconciliation and times it until the returned timer is dropped.
    pub fn reconcile_started(&self, controller: &str) -> HistogramTimer {
        self.reconciles.with_label_values(&[controller]).inc();
        self.duration.with_label_values(&[controller]).start_timer()
    }

    /// Counts a failed reconciliation under its error category.
    pub fn reconcile_failed(&self, controller: &str, category: &str) {
        self.failures
            .with_label_values(&[controller, category])
            .inc();
    }

    /// The metrics in Prometheus' text format.
    pub fn render(&self) -> String {
        let mut buffer = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buffer)
            .expect("text encoding of gathered metrics cannot fail");
        String::from_utf8(buffer).expect("Prometheus text format is UTF-8")
    }
}

/// Sets `gauge` (labels `namespace`, `phase`) to the count of `objects` in each namespace
/// and each of `phases`, and removes the series of the namespaces in `listed` that have no
/// objects any more; `listed` becomes the namespaces counted.
fn set_by_phase<P: Copy + Debug + PartialEq>(
    gauge: &IntGaugeVec,
    phases: &[P],
    objects: &[(String, P)],
    listed: &mut BTreeSet<String>,
) {
    let namespaces = objects
        .iter()
        .map(|(namespace, _)| namespace.clone())
        .collect::<BTreeSet<_>>();
    for namespace in listed.difference(&namespaces) {
        for phase in phases {
            let _ = gauge.remove_label_values(&[namespace, &format!("{phase:?}")]);
        }
    }
    for namespace in &namespaces {
        for phase in phases {
            let count = objects
                .iter()
                .filter(|(n, p)| n == namespace && p == phase)
                .count();
            gauge
                .with_label_values(&[namespace, &format!("{phase:?}")])
                .set(i64::try_from(count).unwrap_or(i64::MAX));
        }
    }
    *listed = namespaces;
}

/// A gauge with a series per object (labels `namespace`, `name`).
fn object_gauge(name: &str, help: &str) -> GaugeVec {
    GaugeVec::new(Opts::new(name, help), &["namespace", "name"]).expect("valid metric")
}

/// `ringmaster_build_info`: 1, labelled with what was built.
fn build_info() -> IntGaugeVec {
    let info = IntGaugeVec::new(
        Opts::new(
            "ringmaster_build_info",
            "The operator's version and the commit it was built from (unknown: not given)",
        ),
        &["version", "commit"],
    )
    .expect("valid metric");
    info.with_label_values(&[env!("CARGO_PKG_VERSION"), GIT_COMMIT.unwrap_or("unknown")])
        .set(1);
    info
}

/// The process' CPU time, memory and file descriptors (`process_*`), where the prometheus
/// crate can read them (Linux).
fn process_collector() -> Option<Box<dyn Collector>> {
    #[cfg(target_os = "linux")]
    {
        Some(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counts_by_label() {
        let metrics = Metrics::new();
        drop(metrics.reconcile_started("trainingjob"));
        metrics.reconcile_failed("trainingjob", "kube");
        let text = metrics.render();
        assert!(
            text.contains(r#"ringmaster_reconcile_total{controller="trainingjob"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(
                r#"ringmaster_reconcile_errors_total{category="kube",controller="trainingjob"} 1"#
            ),
            "{text}"
        );
        assert!(text.contains(
            r#"ringmaster_reconcile_duration_seconds_count{controller="trainingjob"} 1"#
        ));
    }

    #[test]
    fn counts_jobs_per_namespace_and_drops_namespaces_without_jobs() {
        let metrics = Metrics::new();
        metrics.set_training_jobs_by_phase(&[
            ("team-a".into(), TrainingJobPhase::Running),
            ("team-a".into(), TrainingJobPhase::Running),
            ("team-b".into(), TrainingJobPhase::Queued),
        ]);
        let text = metrics.render();
        for series in [
            r#"ringmaster_trainingjobs{namespace="team-a",phase="Running"} 2"#,
            r#"ringmaster_trainingjobs{namespace="team-a",phase="Queued"} 0"#,
            r#"ringmaster_trainingjobs{namespace="team-b",phase="Queued"} 1"#,
        ] {
            assert!(text.contains(series), "{series} in {text}");
        }
        metrics.set_training_jobs_by_phase(&[("team-a".into(), TrainingJobPhase::Succeeded)]);
        let text = metrics.render();
        assert!(!text.contains(r#"namespace="team-b""#), "{text}");
        assert!(text.contains(r#"ringmaster_trainingjobs{namespace="team-a",phase="Running"} 0"#));
    }

    #[test]
    fn job_timings_carry_the_namespace() {
        let metrics = Metrics::new();
        metrics.training_job_running_after("team-a", 3.0);
        metrics.training_job_restarted("team-b");
        let text = metrics.render();
        assert!(
            text.contains(
                r#"ringmaster_trainingjob_time_to_running_seconds_count{namespace="team-a"} 1"#
            ),
            "{text}"
        );
        assert!(
            text.contains(r#"ringmaster_trainingjob_restarts_total{namespace="team-b"} 1"#),
            "{text}"
        );
    }

    fn stage(name: &str, phase: DataStagePhase, bytes_done: i64) -> DataStageSample {
        DataStageSample {
            namespace: "team-a".into(),
            name: name.into(),
            phase,
            progress: Some(crate::api::data_stage::Progress {
                files_total: 10,
                files_done: 4,
                bytes_total: 1000,
                bytes_done,
                bytes_per_second: 50,
                ..Default::default()
            }),
        }
    }

    #[test]
    fn shows_each_data_stage_and_removes_the_gone_and_the_forgotten() {
        let metrics = Metrics::new();
        metrics.set_data_stages(&[
            stage("imagenet", DataStagePhase::Copying, 400),
            stage("coco", DataStagePhase::Ready, 1000),
        ]);
        let text = metrics.render();
        for series in [
            r#"ringmaster_datastage_copied_bytes{name="imagenet",namespace="team-a"} 400"#,
            r#"ringmaster_datastage_size_bytes{name="imagenet",namespace="team-a"} 1000"#,
            r#"ringmaster_datastage_copied_files{name="imagenet",namespace="team-a"} 4"#,
            r#"ringmaster_datastage_files{name="imagenet",namespace="team-a"} 10"#,
            r#"ringmaster_datastage_copy_rate_bytes_per_second{name="imagenet",namespace="team-a"} 50"#,
            r#"ringmaster_datastage_copied_bytes{name="coco",namespace="team-a"} 1000"#,
            r#"ringmaster_datastages{namespace="team-a",phase="Copying"} 1"#,
            r#"ringmaster_datastages{namespace="team-a",phase="Ready"} 1"#,
            r#"ringmaster_datastages{namespace="team-a",phase="Failed"} 0"#,
        ] {
            assert!(text.contains(series), "{series} in {text}");
        }
        // A finished copy has no rate.
        assert!(
            !text.contains(r#"ringmaster_datastage_copy_rate_bytes_per_second{name="coco""#),
            "{text}"
        );

        // coco was deleted: its series go with the next listing.
        metrics.set_data_stages(&[stage("imagenet", DataStagePhase::Copying, 500)]);
        let text = metrics.render();
        assert!(!text.contains(r#"name="coco""#), "{text}");
        assert!(text.contains(
            r#"ringmaster_datastage_copied_bytes{name="imagenet",namespace="team-a"} 500"#
        ));

        // Deleting it forgets it at once; with no DataStages left, the namespace goes too.
        metrics.forget_data_stage("team-a", "imagenet");
        assert!(!metrics.render().contains(r#"name="imagenet""#));
        metrics.set_data_stages(&[]);
        assert!(!metrics.render().contains("ringmaster_datastages{"));
    }

    #[test]
    fn names_the_build_and_counts_requests_by_status_code() {
        let metrics = Metrics::new();
        metrics.kube_request("GET", "404");
        let text = metrics.render();
        let version = env!("CARGO_PKG_VERSION");
        let commit = GIT_COMMIT.unwrap_or("unknown");
        assert!(
            text.contains(&format!(
                r#"ringmaster_build_info{{commit="{commit}",version="{version}"}} 1"#
            )),
            "{text}"
        );
        assert!(
            text.contains(r#"ringmaster_kube_requests_total{code="404",method="GET"} 1"#),
            "{text}"
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn shows_the_process_cpu_and_memory() {
        let text = Metrics::new().render();
        for name in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
        ] {
            assert!(text.contains(&format!("\n{name} ")), "{name} in {text}");
        }
    }
}
