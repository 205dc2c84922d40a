//! Prometheus metrics of the operator, served on `/metrics`.

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramTimer, HistogramVec, IntCounter,
    IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::api::TrainingJobPhase;

/// Every phase, so the gauge shows zeros rather than missing series.
const PHASES: [TrainingJobPhase; 10] = [
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
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    reconciles: IntCounterVec,
    failures: IntCounterVec,
    duration: HistogramVec,
    jobs_by_phase: IntGaugeVec,
    time_to_running: Histogram,
    restarts: IntCounter,
    kube_requests: IntCounterVec,
    progress: JobProgressGauges,
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
        let gauge = |name: &str, help: &str| {
            GaugeVec::new(Opts::new(name, help), &["namespace", "name"]).expect("valid metric")
        };
        Self {
            steps: gauge(
                "ringmaster_trainingjob_progress_steps",
                "Steps a running TrainingJob reported done",
            ),
            total_steps: gauge(
                "ringmaster_trainingjob_progress_total_steps",
                "Steps a running TrainingJob trains in all, as it reported",
            ),
            loss: gauge(
                "ringmaster_trainingjob_progress_loss",
                "The loss a running TrainingJob reported last",
            ),
            images_per_second: gauge(
                "ringmaster_trainingjob_progress_images_per_second",
                "Images per second over all ranks of a running TrainingJob (recent rate)",
            ),
            seconds_remaining: gauge(
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
            Opts::new("ringmaster_trainingjobs", "TrainingJobs by phase"),
            &["phase"],
        )
        .expect("valid metric");
        let time_to_running = Histogram::with_opts(
            HistogramOpts::new(
                "ringmaster_trainingjob_time_to_running_seconds",
                "Time from a TrainingJob's creation until its launcher first runs",
            )
            .buckets(vec![
                1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
            ]),
        )
        .expect("valid metric");
        let restarts = IntCounter::new(
            "ringmaster_trainingjob_restarts_total",
            "Gang restarts of TrainingJobs after a retryable failure",
        )
        .expect("valid metric");
        let kube_requests = IntCounterVec::new(
            Opts::new(
                "ringmaster_kube_requests_total",
                "Requests sent to the Kubernetes API server, by HTTP method",
            ),
            &["method"],
        )
        .expect("valid metric");
        let progress = JobProgressGauges::new();
        for gauge in progress.all() {
            registry
                .register(Box::new(gauge.clone()))
                .expect("metric registered once");
        }
        for collector in [
            Box::new(kube_requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(reconciles.clone()),
            Box::new(failures.clone()),
            Box::new(duration.clone()),
            Box::new(jobs_by_phase.clone()),
            Box::new(time_to_running.clone()),
            Box::new(restarts.clone()),
        ] {
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

    /// Counts a request to the API server.
    pub fn kube_request(&self, method: &str) {
        self.kube_requests.with_label_values(&[method]).inc();
    }

    /// Sets the jobs-by-phase gauge from every job's phase.
    pub fn set_training_jobs_by_phase(&self, phases: &[TrainingJobPhase]) {
        for phase in PHASES {
            let count = phases.iter().filter(|p| **p == phase).count();
            self.jobs_by_phase
                .with_label_values(&[&format!("{phase:?}")])
                .set(i64::try_from(count).unwrap_or(i64::MAX));
        }
    }

    /// Records how long a job took from creation to Running.
    pub fn training_job_running_after(&self, seconds: f64) {
        self.time_to_running.observe(seconds);
    }

    /// Counts a gang restart.
    pub fn training_job_restarted(&self) {
        self.restarts.inc();
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
}
