//! The operators bench-operator measures, side by side: how each is started, what job it is
//! given (the same gang shape for both: WORKERS sshd workers and one launcher running the
//! trainer under mpirun, launcher created once the workers are ready), and when a job counts
//! as Running. Beside them, the floor: the same pods with no operator at all.

use std::path::PathBuf;
use std::process::Stdio;

use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use serde_json::{Value, json};

/// The image every measured pod names; KWOK runs nothing, so it is never pulled.
pub const IMAGE: &str = "ringmaster-trainer:bench";

/// Which operator, and for MPI Operator which limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Operator {
    /// Ringmaster, as built (`ringmaster run`).
    Ringmaster,
    /// Kubeflow MPI Operator v2 with its own defaults (client 5 QPS / burst 10, 2 workers,
    /// work queue 10/s burst 100).
    MpiOperatorDefaults,
    /// Kubeflow MPI Operator v2 with every limit raised out of the way.
    MpiOperatorRaised,
    /// No operator: each job is a ReplicaSet of WORKERS + 1 pods, which the controller
    /// manager's ReplicaSet controller makes. What the cluster itself spends on the same
    /// pods (scheduling, binding, the kubelets' status, events): the floor under any
    /// operator's time and API-server CPU on this machine.
    ReplicaSetFloor,
}

/// MPI Operator's limits, raised: client QPS and burst, reconcile workers, work-queue rate
/// and burst, each far past what this cluster can serve.
pub const MPI_OPERATOR_RAISED: [&str; 10] = [
    "--kube-api-qps",
    "100000",
    "--kube-api-burst",
    "100000",
    "--threadiness",
    "64",
    "--controller-queue-rate-limit",
    "100000",
    "--controller-queue-burst",
    "100000",
];

/// One operator to measure.
#[derive(Clone, Debug)]
pub struct Contender {
    /// Its name in the tables, its ServiceAccount and its namespace's suffix.
    pub label: String,
    pub operator: Operator,
    pub binary: PathBuf,
    /// Ringmaster's `--launcher-priority-class`, as the Helm chart runs it.
    pub launcher_priority_class: Option<String>,
}

/// The floor's label in the tables.
pub const FLOOR_LABEL: &str = "floor-replicasets";

/// The PriorityClass bench-operator makes for Ringmaster's launchers, as the Helm chart's.
pub const LAUNCHER_PRIORITY_CLASS: &str = "bench-ringmaster-launcher";

impl Contender {
    /// The kind of job the operator runs.
    pub fn job_resource(&self) -> ApiResource {
        match self.operator {
            Operator::Ringmaster => ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk("ringmaster.dev", "v1alpha1", "TrainingJob"),
                "trainingjobs",
            ),
            Operator::MpiOperatorDefaults | Operator::MpiOperatorRaised => {
                ApiResource::from_gvk_with_plural(
                    &GroupVersionKind::gvk("kubeflow.org", "v2beta1", "MPIJob"),
                    "mpijobs",
                )
            }
            Operator::ReplicaSetFloor => ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk("apps", "v1", "ReplicaSet"),
                "replicasets",
            ),
        }
    }

    /// Whether an operator process runs for this contender (not for the floor).
    pub fn has_operator(&self) -> bool {
        self.operator != Operator::ReplicaSetFloor
    }

    /// Job `name` of `workers` workers, as this operator takes it.
    pub fn job(&self, name: &str, workers: u32) -> Value {
        match self.operator {
            Operator::Ringmaster => json!({
                "apiVersion": "ringmaster.dev/v1alpha1", "kind": "TrainingJob",
                "metadata": {"name": name},
                "spec": {"workers": workers, "image": IMAGE,
                         "trainer": {"model": "resnet18", "steps": 10}},
            }),
            Operator::MpiOperatorDefaults | Operator::MpiOperatorRaised => json!({
                "apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob",
                "metadata": {"name": name},
                "spec": {
                    "slotsPerWorker": 1,
                    "launcherCreationPolicy": "WaitForWorkersReady",
                    "runPolicy": {"cleanPodPolicy": "Running"},
                    "mpiReplicaSpecs": {
                        "Launcher": {"replicas": 1, "template": {"spec": {"containers": [{
                            "name": "launcher", "image": IMAGE,
                            "command": ["mpirun", "-np", workers.to_string(),
                                        "ringmaster-trainer", "train", "--model", "resnet18", "--steps", "10"],
                        }]}}},
                        "Worker": {"replicas": workers, "template": {"spec": {"containers": [{
                            "name": "worker", "image": IMAGE,
                            "command": ["/usr/sbin/sshd", "-De"],
                            "ports": [{"name": "ssh", "containerPort": 22}],
                            "readinessProbe": {"tcpSocket": {"port": 22}},
                        }]}}},
                    },
                },
            }),
            // MPI Operator's worker pod, once per worker and once for the launcher.
            Operator::ReplicaSetFloor => json!({
                "apiVersion": "apps/v1", "kind": "ReplicaSet",
                "metadata": {"name": name},
                "spec": {
                    "replicas": workers + 1,
                    "selector": {"matchLabels": {"bench-job": name}},
                    "template": {
                        "metadata": {"labels": {"bench-job": name}},
                        "spec": {"containers": [{
                            "name": "worker", "image": IMAGE,
                            "command": ["/usr/sbin/sshd", "-De"],
                            "ports": [{"name": "ssh", "containerPort": 22}],
                            "readinessProbe": {"tcpSocket": {"port": 22}},
                        }]},
                    },
                },
            }),
        }
    }

    /// Whether the job is Running: Ringmaster's phase, MPI Operator's Running condition.
    pub fn is_running(&self, job: &DynamicObject) -> bool {
        let status = &job.data["status"];
        match self.operator {
            Operator::Ringmaster => status["phase"] == "Running",
            Operator::MpiOperatorDefaults | Operator::MpiOperatorRaised => {
                status["conditions"].as_array().is_some_and(|cs| {
                    cs.iter()
                        .any(|c| c["type"] == "Running" && c["status"] == "True")
                })
            }
            // Every pod ready, as Ringmaster's Running needs every worker ready and the
            // launcher running.
            Operator::ReplicaSetFloor => job.data["spec"]["replicas"]
                .as_u64()
                .is_some_and(|wanted| status["readyReplicas"].as_u64() >= Some(wanted)),
        }
    }

    /// The command that starts the operator on `namespace` as the identity in `kubeconfig`
    /// (none for the floor). Ringmaster serves its metrics and readiness on `metrics_port`;
    /// MPI Operator takes its leader-election lock in `namespace` (fresh for each run, so no
    /// earlier run's lock is waited out).
    pub fn command(
        &self,
        kubeconfig: &std::path::Path,
        namespace: &str,
        metrics_port: u16,
        progress_port: Option<u16>,
        log: std::fs::File,
    ) -> Option<tokio::process::Command> {
        let mut command = tokio::process::Command::new(&self.binary);
        match self.operator {
            Operator::Ringmaster => {
                command
                    .args(["run", "--namespace", namespace, "--metrics-bind-address"])
                    .arg(format!("127.0.0.1:{metrics_port}"))
                    .env("RUST_LOG", "warn");
                if let Some(port) = progress_port {
                    // Its certificate's Secret in the run's namespace, deleted with it.
                    command
                        .arg(format!("--progress-bind-address=127.0.0.1:{port}"))
                        .arg(format!("--progress-url=https://127.0.0.1:{port}"))
                        .args(["--leader-election-namespace", namespace]);
                }
                if let Some(class) = &self.launcher_priority_class {
                    command.args(["--launcher-priority-class", class]);
                }
            }
            Operator::MpiOperatorDefaults | Operator::MpiOperatorRaised => {
                command.args(["--namespace", namespace, "--lock-namespace", namespace]);
                if self.operator == Operator::MpiOperatorRaised {
                    command.args(MPI_OPERATOR_RAISED);
                }
            }
            Operator::ReplicaSetFloor => return None,
        }
        command
            .env("KUBECONFIG", kubeconfig)
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true);
        Some(command)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contender(operator: Operator) -> Contender {
        Contender {
            label: "x".into(),
            operator,
            binary: "/bin/true".into(),
            launcher_priority_class: None,
        }
    }

    fn object(contender: &Contender, status: Value) -> DynamicObject {
        let mut job = contender.job("j", 8);
        job["status"] = status;
        serde_json::from_value(job).unwrap()
    }

    #[test]
    fn both_operators_get_the_same_gang_shape() {
        let ours = contender(Operator::Ringmaster).job("j", 8);
        let theirs = contender(Operator::MpiOperatorRaised).job("j", 8);
        assert_eq!(ours["spec"]["workers"], 8);
        let replicas = &theirs["spec"]["mpiReplicaSpecs"];
        assert_eq!(replicas["Worker"]["replicas"], 8);
        assert_eq!(replicas["Launcher"]["replicas"], 1);
        assert_eq!(
            theirs["spec"]["launcherCreationPolicy"],
            "WaitForWorkersReady"
        );
        assert_eq!(contender(Operator::MpiOperatorDefaults).job("j", 8), theirs);
    }

    #[test]
    fn running_is_each_operators_own_word_for_it() {
        let ours = contender(Operator::Ringmaster);
        assert!(ours.is_running(&object(&ours, json!({"phase": "Running"}))));
        assert!(!ours.is_running(&object(&ours, json!({"phase": "Starting"}))));
        let theirs = contender(Operator::MpiOperatorRaised);
        let running = json!({"conditions": [
            {"type": "Created", "status": "True"}, {"type": "Running", "status": "True"}]});
        assert!(theirs.is_running(&object(&theirs, running)));
        let not_yet = json!({"conditions": [{"type": "Running", "status": "False"}]});
        assert!(!theirs.is_running(&object(&theirs, not_yet)));
        assert!(!theirs.is_running(&object(&theirs, json!({}))));
    }

    #[test]
    fn the_floor_is_a_replica_set_of_every_pod_of_the_gang_running_without_an_operator() {
        let floor = contender(Operator::ReplicaSetFloor);
        let job = floor.job("j", 8);
        assert_eq!(job["spec"]["replicas"], 9);
        assert_eq!(
            job["spec"]["selector"]["matchLabels"],
            job["spec"]["template"]["metadata"]["labels"]
        );
        assert!(floor.is_running(&object(&floor, json!({"readyReplicas": 9}))));
        assert!(!floor.is_running(&object(&floor, json!({"readyReplicas": 8}))));
        assert!(!floor.is_running(&object(&floor, json!({"replicas": 9}))));
        let log = tempfile_for_log();
        assert!(
            floor
                .command(std::path::Path::new("/k"), "ns", 1, None, log)
                .is_none()
        );
        assert!(!floor.has_operator());
    }

    #[test]
    fn only_the_raised_mpi_operator_gets_raised_limits() {
        let args = |operator| {
            let command = contender(operator).command(
                std::path::Path::new("/k"),
                "ns",
                1,
                Some(2),
                tempfile_for_log(),
            );
            command
                .unwrap()
                .as_std()
                .get_args()
                .map(|a| a.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
        };
        assert!(args(Operator::MpiOperatorRaised).contains(&"--threadiness".to_string()));
        assert!(!args(Operator::MpiOperatorDefaults).contains(&"--threadiness".to_string()));
        let ringmaster = args(Operator::Ringmaster);
        assert_eq!(ringmaster[..3], ["run", "--namespace", "ns"]);
        // Reports go to its endpoint, its certificate in the run's namespace.
        assert!(ringmaster.contains(&"--progress-url=https://127.0.0.1:2".to_string()));
        assert!(
            !args(Operator::MpiOperatorRaised)
                .iter()
                .any(|a| a.starts_with("--progress"))
        );
    }

    fn tempfile_for_log() -> std::fs::File {
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .unwrap()
    }
}
