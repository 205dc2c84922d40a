//! TrainingJobs on the real node (e2e/node.sh): the kubelet, containerd and runc run the pods.
//! Workers' sshd answers the ssh readiness probe, the launcher's `mpirun` (or MPICH's Hydra)
//! starts every rank over ssh with the hostfile, keys and environment the operator made, the
//! ranks all-reduce across pods, and the result comes from the launcher container's own
//! termination message. A DataStage's stager pod copies from Azurite onto the node. Nothing
//! here is played by KWOK.

mod common;

#[path = "../../tests/support/azurite.rs"]
#[allow(dead_code)] // only `start_on` is used here
mod azurite;

use std::process::Command;
use std::time::Duration;

use common::{
    Operator, TestNamespace, apply, client, ensure_crds, events_for, eventually, phase_is, pods,
    ready_since, repo_root, sas_secret, tool, wait_phase, wait_stage_phase,
};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::LogParams;
use ringmaster::api::TrainingJobPhase;
use ringmaster_contract::trainer::{MODEL_FILE, Summary, checkpoint_file, run_dir};
use serde_json::{Value, json};

/// The trainer image node.sh imports: the Dockerfile's trainer recipe on Debian, run as
/// uid 1000 like the published image.
const IMAGE: &str = "ringmaster.local/ringmaster-trainer:e2e";
/// The same files, run as root (as many MPI images are). Jobs on it say `runAsUser: 0`
/// ([`as_root`]): Ringmaster's pods are non-root otherwise.
const ROOT_IMAGE: &str = "ringmaster.local/ringmaster-trainer:e2e-root";

/// A user's PyTorch image built on the trainer's, as config/samples/pytorch-ddp/Dockerfile
/// builds one (Debian's PyTorch 1.13 with gloo, CPU; the sample's script in it): made by
/// `tools/image.sh`.
const PYTORCH_IMAGE: &str = "ringmaster.local/pytorch:e2e";
/// The image DataStage copy Jobs run: the Dockerfile's operator image (entrypoint
/// `ringmaster`, uid 65532), made from the same files.
const STAGER_IMAGE: &str = "ringmaster.local/ringmaster:e2e";
const REAL_NODE: &str = "real-node-0";
const REAL_NODE_LABEL: &str = "ringmaster.dev/real-node";
/// The host's address on the real node's pod network (node.sh): what pods reach it at.
const NODE_BRIDGE_ADDRESS: &str = "10.244.0.1";

/// One test at a time on the real node: it has two CPUs, which one gang of 4 ranks already
/// fills (the sample's requests say so); two at once only measure the overload.
static REAL_NODE_IN_USE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The CPU sample (config/samples/trainingjob-cpu-small.yaml) as `name`, on the real node:
/// its image is the local one and its pods tolerate and select the real node; its requests
/// are its own. `edit` changes the spec.
fn sample_on_real_node(name: &str, edit: impl FnOnce(&mut Value)) -> Value {
    let path = repo_root().join("config/samples/trainingjob-cpu-small.yaml");
    let mut job = common::documents(&path).remove(0);
    job["metadata"]["name"] = json!(name);
    let spec = &mut job["spec"];
    spec["image"] = json!(IMAGE);
    for role in ["worker", "launcher"] {
        spec[role]["tolerations"] =
            json!([{"key": REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}]);
        spec[role]["nodeSelector"] = json!({REAL_NODE_LABEL: "true"});
    }
    edit(spec);
    job
}

/// `spec` runs [`ROOT_IMAGE`] as root, as an image that runs as root must ask: `runAsUser: 0`
/// on the workers and the launcher.
fn as_root(spec: &mut Value) {
    spec["image"] = json!(ROOT_IMAGE);
    for role in ["worker", "launcher"] {
        spec[role]["securityContext"] = json!({"runAsUser": 0});
    }
}

/// Has the namespace's Pod Security admission enforce `level` (restricted, baseline or
/// privileged), as a cluster administrator labels a namespace.
async fn enforce_pod_security(client: &kube::Client, ns: &str, level: &str) {
    let patch = json!({"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": level,
        "pod-security.kubernetes.io/enforce-version": "latest",
    }}});
    Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .patch(
            ns,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .unwrap();
}

/// `kubectl exec` into a pod's only container; its stdout.
fn exec(ns: &str, pod: &str, command: &[&str]) -> String {
    let out = Command::new(tool("kubectl"))
        .arg("--kubeconfig")
        .arg(ringmaster_e2e::cluster::kubeconfig_path())
        .args(["exec", "-n", ns, pod, "--"])
        .args(command)
        .output()
        .expect("running kubectl exec");
    assert!(
        out.status.success(),
        "kubectl exec {pod} {command:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The uid a worker's container runs as, and the mode and owner of its private key copy.
fn user_and_key_copy(ns: &str, pod: &str) -> (String, String) {
    let uid = exec(ns, pod, &["id", "-u"]);
    let key = exec(
        ns,
        pod,
        &["stat", "-c", "%a %U", "/etc/ringmaster/ssh/ssh-privatekey"],
    );
    (uid.trim().to_string(), key.trim().to_string())
}

async fn logs(client: &kube::Client, ns: &str, pod: &str) -> String {
    Api::<Pod>::namespaced(client.clone(), ns)
        .logs(pod, &LogParams::default())
        .await
        .unwrap_or_default()
}

/// Waits for the launcher of the job's first gang to be running, and checks the order the
/// operator promises: every worker Ready (through the real ssh probe) before the launcher was
/// made. Returns the workers' names.
async fn launcher_started_after_ready_workers(
    client: &kube::Client,
    ns: &str,
    job: &str,
) -> Vec<String> {
    let launcher = format!("{job}-launcher");
    eventually(
        Duration::from_secs(120),
        &format!("{launcher} running"),
        || async {
            pods(client, ns, job).await.iter().any(|p| {
                p.metadata.name.as_deref() == Some(launcher.as_str())
                    && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            })
        },
    )
    .await;
    let all = pods(client, ns, job).await;
    let launcher_made = all
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some(launcher.as_str()))
        .and_then(|p| p.metadata.creation_timestamp.clone())
        .expect("the launcher's creation time")
        .0;
    let workers: Vec<&Pod> =
        all.iter()
            .filter(|p| {
                p.metadata.labels.as_ref().is_some_and(|l| {
                    l.get("ringmaster.dev/role").map(String::as_str) == Some("worker")
                })
            })
            .collect();
    assert_eq!(workers.len(), 2, "two workers");
    for worker in &workers {
        let ready = ready_since(worker).unwrap_or_else(|| {
            panic!(
                "{} is not Ready while the launcher runs",
                worker.metadata.name.as_deref().unwrap_or_default()
            )
        });
        // Timestamps have whole seconds: Ready no later than the launcher's creation.
        assert!(
            ready <= launcher_made,
            "{:?} became Ready at {ready}, after the launcher was made at {launcher_made}",
            worker.metadata.name
        );
    }
    workers
        .iter()
        .map(|w| w.metadata.name.clone().unwrap())
        .collect()
}

/// The launcher's termination message, as the trainer's summary.
async fn launcher_summary(client: &kube::Client, ns: &str, job: &str) -> Summary {
    let launcher = Api::<Pod>::namespaced(client.clone(), ns)
        .get(&common::current_launcher(client, ns, job).await)
        .await
        .unwrap();
    let terminated = launcher
        .status
        .and_then(|s| s.container_statuses)
        .and_then(|c| c.into_iter().next())
        .and_then(|c| c.state)
        .and_then(|s| s.terminated)
        .expect("the launcher container terminated");
    assert_eq!(terminated.exit_code, 0);
    let message = terminated.message.unwrap_or_default();
    Summary::find_in(&message)
        .unwrap_or_else(|| panic!("no trainer summary in the termination message: {message}"))
}

/// What every successful run must show in its status: the trainer's own figures.
fn assert_result_is_the_trainers(status: &Value, summary: &Summary, steps: u64) {
    assert_eq!(summary.world_size, 4, "2 workers × 2 ranks");
    assert_eq!(summary.steps, steps);
    assert!(summary.images_per_second > 0.0, "{summary:?}");
    assert_eq!(
        status["result"]["imagesPerSecond"].as_f64(),
        Some(summary.images_per_second),
        "{status:#}"
    );
    assert_eq!(status["result"]["steps"].as_u64(), Some(steps));
    assert_eq!(
        status["result"]["finalLoss"].as_f64(),
        summary.final_loss,
        "{status:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cpu_sample_trains_across_real_pods_over_ssh_with_open_mpi() {
    let _node = REAL_NODE_IN_USE.lock().await;
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "real-ompi").await;
    let _operator = Operator::start(&client, &ns.name).await;
    let job = sample_on_real_node("sample", |_| {});
    let steps = job["spec"]["trainer"]["steps"].as_u64().unwrap();
    apply(&client, &job, &ns.name, false).await.unwrap();

    let workers = launcher_started_after_ready_workers(&client, &ns.name, "sample").await;
    // The probe really logged in: sshd in the worker accepted the job's key, for the image's
    // own non-root user, whose private copy of the key is its own, mode 0600.
    let sshd_log = logs(&client, &ns.name, &workers[0]).await;
    assert!(
        sshd_log.contains("Accepted publickey for trainer"),
        "{sshd_log}"
    );
    assert_eq!(
        user_and_key_copy(&ns.name, &workers[0]),
        ("1000".into(), "600 trainer".into())
    );
    // ssh pinned the job's host key (the probe and mpirun got through with it), and the
    // image's user reads the ranks' rendezvous key from the mounted Secret.
    let known_hosts = exec(
        &ns.name,
        &workers[0],
        &["cat", "/etc/ringmaster/ssh/known_hosts"],
    );
    assert!(known_hosts.starts_with("* ssh-ed25519 "), "{known_hosts}");
    let key_bytes = exec(
        &ns.name,
        &workers[1],
        &["wc", "-c", "/etc/ringmaster/ssh-secret/rendezvous-key"],
    );
    assert!(key_bytes.starts_with("32 "), "{key_bytes}");

    let status = wait_phase(
        &client,
        &ns.name,
        "sample",
        TrainingJobPhase::Succeeded,
        300,
    )
    .await;
    let summary = launcher_summary(&client, &ns.name, "sample").await;
    assert_result_is_the_trainers(&status, &summary, steps);
    let notes: Vec<String> = events_for(&client, &ns.name, "sample")
        .await
        .into_iter()
        .filter_map(|e| e.note)
        .collect();
    assert_eq!(
        status["restarts"], 0,
        "no restart expected; the job's Events: {notes:#?}"
    );
    // Every rank ran: the launcher printed rank 0's steps, and `mpirun` reached both workers.
    let launcher_log = logs(&client, &ns.name, "sample-launcher").await;
    assert!(launcher_log.contains(r#""event":"step""#), "{launcher_log}");
}

/// A real launcher reports its ranks' progress to the operator's endpoint (HTTPS on the
/// node's bridge, a token the kubelet projected for the launcher pod): while the job trains,
/// `kubectl get tj` shows PROGRESS and ETA, and the status the whole run's figures at the end
/// (issue 40, item 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_launcher_reports_progress_that_kubectl_shows_while_the_job_trains() {
    let _node = REAL_NODE_IN_USE.lock().await;
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "real-progress").await;
    let config = ringmaster::controller::OperatorConfig {
        restart_backoff: std::time::Duration::from_millis(500),
        data_stage_destinations: common::e2e_destinations(),
        ..ringmaster::controller::OperatorConfig::default()
    };
    let bridge = Some(NODE_BRIDGE_ADDRESS.parse().unwrap());
    let operator = Operator::start_reporting(&client, &ns.name, config, bridge).await;
    let job = sample_on_real_node("progress", |spec| {
        // Long enough for a progress write after the hold-back (30 s) while it runs.
        spec["trainer"]["steps"] = json!(150);
        spec["trainer"]["imageSize"] = json!(32);
        spec["trainer"]["extraArgs"] = json!(["--log-every=5"]);
        spec["worker"]["env"] =
            json!([{"name": "RINGMASTER_PROGRESS_INTERVAL_SECONDS", "value": "2"}]);
    });
    apply(&client, &job, &ns.name, false).await.unwrap();
    wait_phase(
        &client,
        &ns.name,
        "progress",
        TrainingJobPhase::Running,
        240,
    )
    .await;

    let kubectl = |args: &[&str]| {
        let out = std::process::Command::new(common::tool("kubectl"))
            .arg("--kubeconfig")
            .arg(ringmaster_e2e::cluster::kubeconfig_path())
            .args(args)
            .output()
            .expect("kubectl runs");
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let mut table = String::new();
    let mut progress = Value::Null;
    for _ in 0..120 {
        let status = common::job_status(&client, &ns.name, "progress").await;
        progress = status["progress"].clone();
        if progress["timeRemaining"].is_string() {
            table = kubectl(&["get", "tj", "-n", &ns.name, "-o", "wide"]);
            break;
        }
        assert!(
            !phase_is(&status, TrainingJobPhase::Succeeded),
            "ended before any progress was shown: {status:#}"
        );
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
    eprintln!("kubectl get tj -o wide, while it trains:\n{table}");
    assert_eq!(progress["totalSteps"], 150, "{progress:#}");
    let step = progress["step"].as_i64().unwrap();
    assert!(step > 0 && step < 150, "{progress:#}");
    assert!(
        progress["imagesPerSecond"].as_i64().unwrap() > 0,
        "{progress:#}"
    );
    let row = table.lines().nth(1).unwrap_or_default();
    assert!(
        row.contains(progress["percentDone"].as_str().unwrap()),
        "{table}"
    );
    let metrics = operator.get("/metrics").await;
    assert!(
        metrics.contains("ringmaster_trainingjob_progress_steps{name=\"progress\""),
        "{metrics}"
    );
    // Its fabric: the TCP ring, on every rank, as the trainer said it.
    let status = common::job_status(&client, &ns.name, "progress").await;
    assert_eq!(status["fabric"]["collective"], "tcp-ring", "{status:#}");
    assert_eq!(status["fabric"]["worldSize"], 4, "{status:#}");
    // No Kubernetes API rights in the launcher: its token is for the report audience only.
    let launcher = common::current_launcher(&client, &ns.name, "progress").await;
    let api = exec(
        &ns.name,
        &launcher,
        &[
            "sh",
            "-c",
            "ls /var/run/secrets/kubernetes.io 2>&1; cat /var/run/secrets/ringmaster.dev/progress/token | cut -d. -f2 | wc -c",
        ],
    );
    assert!(api.contains("No such file"), "no API token mounted: {api}");

    let jobs: Api<ringmaster::api::TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    jobs.delete("progress", &Default::default()).await.unwrap();
}

/// A user's own program (`command`) under Open MPI gets the variables PyTorch DDP and
/// Horovod read, per rank: RANK and WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE on each
/// worker, and MASTER_ADDR/MASTER_PORT naming worker 0 (issue 40, item 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_program_gets_each_ranks_framework_environment_from_open_mpi() {
    let _node = REAL_NODE_IN_USE.lock().await;
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "real-ddp-env").await;
    let _operator = Operator::start(&client, &ns.name).await;
    let job = sample_on_real_node("ddp-env", |spec| {
        spec.as_object_mut().unwrap().remove("trainer");
        spec["command"] = json!([
            "sh",
            "-c",
            "echo rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK/$LOCAL_WORLD_SIZE master=$MASTER_ADDR:$MASTER_PORT host=$(hostname)"
        ]);
    });
    apply(&client, &job, &ns.name, false).await.unwrap();
    wait_phase(
        &client,
        &ns.name,
        "ddp-env",
        TrainingJobPhase::Succeeded,
        240,
    )
    .await;
    let log = logs(&client, &ns.name, "ddp-env-launcher").await;
    let lines: Vec<Vec<&str>> = log
        .lines()
        .filter(|l| l.starts_with("rank="))
        .map(|l| l.split(' ').collect())
        .collect();
    assert_eq!(lines.len(), 4, "{log}");
    let mut ranks: Vec<&str> = lines.iter().map(|f| f[0]).collect();
    ranks.sort();
    assert_eq!(ranks, ["rank=0", "rank=1", "rank=2", "rank=3"], "{log}");
    // Two ranks on each worker, local ranks 0 and 1 of 2 there.
    let mut placed: Vec<String> = lines.iter().map(|f| format!("{} {}", f[4], f[2])).collect();
    placed.sort();
    assert_eq!(
        placed,
        [
            "host=ddp-env-worker-0 local=0/2",
            "host=ddp-env-worker-0 local=1/2",
            "host=ddp-env-worker-1 local=0/2",
            "host=ddp-env-worker-1 local=1/2"
        ],
        "{log}"
    );
    for fields in &lines {
        assert_eq!(fields[1], "world=4", "{log}");
        assert!(
            fields[3].starts_with("master=ddp-env-worker-0.") && fields[3].ends_with(":29500"),
            "{log}"
        );
    }
}

/// The PyTorch DDP sample (config/samples/pytorch-ddp/train.py, gloo on the CPU) in a user's
/// image built on the trainer's: 2 workers × 2 ranks train to Succeeded, its progress shows in
/// the status while it trains (its JSON lines, reported by the launcher), and its summary
/// line is the job's result (issue 40, item 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pytorch_ddp_sample_trains_two_workers_of_two_ranks_with_its_progress_in_the_status() {
    let _node = REAL_NODE_IN_USE.lock().await;
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "real-ddp").await;
    let bridge = Some(NODE_BRIDGE_ADDRESS.parse().unwrap());
    let config = ringmaster::controller::OperatorConfig {
        data_stage_destinations: common::e2e_destinations(),
        ..ringmaster::controller::OperatorConfig::default()
    };
    let _operator = Operator::start_reporting(&client, &ns.name, config, bridge).await;
    // About 75 s on the real node's two cores: the first progress write comes ~30 s in.
    let steps = 3000;
    let job = sample_on_real_node("ddp", |spec| {
        spec.as_object_mut().unwrap().remove("trainer");
        spec["image"] = json!(PYTORCH_IMAGE);
        // Long enough for a progress write after the hold-back (30 s) while it trains.
        spec["command"] = json!([
            "python3",
            "/opt/ringmaster/samples/pytorch-ddp/train.py",
            format!("--steps={steps}"),
            "--batch-size=32",
            "--log-every=25"
        ]);
        spec["worker"]["env"] =
            json!([{"name": "RINGMASTER_PROGRESS_INTERVAL_SECONDS", "value": "2"}]);
    });
    apply(&client, &job, &ns.name, false).await.unwrap();
    wait_phase(&client, &ns.name, "ddp", TrainingJobPhase::Running, 240).await;
    let mut progress = Value::Null;
    for _ in 0..150 {
        let status = common::job_status(&client, &ns.name, "ddp").await;
        progress = status["progress"].clone();
        if progress["timeRemaining"].is_string() {
            break;
        }
        assert!(
            !phase_is(&status, TrainingJobPhase::Succeeded),
            "ended before any progress was shown: {status:#}"
        );
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
    eprintln!("the DDP job's progress while it trains: {progress}");
    assert_eq!(progress["totalSteps"], steps, "{progress:#}");
    let step = progress["step"].as_i64().unwrap();
    assert!(step > 0 && step < steps, "{progress:#}");
    assert!(
        progress["imagesPerSecond"].as_i64().unwrap() > 0,
        "{progress:#}"
    );

    let status = wait_phase(&client, &ns.name, "ddp", TrainingJobPhase::Succeeded, 600).await;
    let log = logs(
        &client,
        &ns.name,
        &common::current_launcher(&client, &ns.name, "ddp").await,
    )
    .await;
    let summary = Summary::find_in(&log).unwrap_or_else(|| panic!("no summary line: {log}"));
    assert_eq!(
        (summary.world_size, summary.global_batch),
        (4, 128),
        "{summary:?}"
    );
    assert_eq!(status["result"]["steps"], steps, "{status:#}");
    assert_eq!(
        status["result"]["finalLoss"].as_f64(),
        summary.final_loss,
        "{status:#}"
    );
    // It learned: the loss is well under chance's ln 10 = 2.30.
    assert!(summary.final_loss.unwrap() < 1.0, "{summary:?}");
    assert_eq!(status["restarts"], 0, "{status:#}");
}

/// A DDP script whose rank 1 raises while the others wait in a barrier: the job fails at
/// once (a program's own failure is not retried), and its message is the Python exception's
/// last line and the rank, not `mpirun`'s banner (issue 40, item 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ddp_script_that_raises_fails_the_job_with_the_exceptions_last_line() {
    let _node = REAL_NODE_IN_USE.lock().await;
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "real-ddp-raise").await;
    let _operator = Operator::start(&client, &ns.name).await;
    let script = "import torch.distributed as dist\n\
                  dist.init_process_group('gloo')\n\
                  if dist.get_rank() == 1:\n    raise ValueError('the labels have 3 classes, the model 10')\n\
                  dist.barrier()\n";
    let job = sample_on_real_node("ddp-raise", |spec| {
        spec.as_object_mut().unwrap().remove("trainer");
        spec["image"] = json!(PYTORCH_IMAGE);
        spec["command"] = json!(["python3", "-c", script]);
    });
    apply(&client, &job, &ns.name, false).await.unwrap();
    let status = wait_phase(
        &client,
        &ns.name,
        "ddp-raise",
        TrainingJobPhase::Failed,
        300,
    )
    .await;
    let failed = common::condition(&status, "Failed");
    let message = failed["message"].as_str().unwrap_or_default();
    eprintln!("the job's Failed condition: {message}");
    assert!(
        message.contains("rank 1: ValueError: the labels have 3 classes, the model 10"),
        "{failed:#}"
    );
    assert_eq!(
        status["restarts"], 0,
        "a verdict, not a restart: {status:#}"
    );
    assert!(
        status["lastFailure"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("ValueError: the labels have 3 classes")),
        "{status:#}"
    );
}

/// `infiniband.preflight` with InfiniBand off (the real node has no GPU, no RDMA): the
/// ranks time their TCP ring across the pods before the first step and, below an
/// impossible threshold, every rank stops; the job fails at once (no restart) with reason
/// `PreflightFailed` and the trainer's words: the measured bus bandwidth, the threshold and
/// the slowest pair of ranks, with the worker pods' host names (issue 39 E).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fabric_below_the_preflights_minimum_fails_the_job_naming_the_slowest_pair() {
    use ringmaster_contract::trainer::{Failure, Line, exit};
    let _node = REAL_NODE_IN_USE.lock().await;
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "real-preflight").await;
    let _operator = Operator::start(&client, &ns.name).await;
    // Far beyond any TCP ring: 10 TB/s of bus bandwidth.
    let job = sample_on_real_node("preflight", |spec| {
        spec["infiniband"] = json!({"enabled": false, "preflight": {"minBusBandwidthGbps": 10000, "messageBytes": 4194304}});
    });
    apply(&client, &job, &ns.name, false).await.unwrap();
    launcher_started_after_ready_workers(&client, &ns.name, "preflight").await;

    let status = wait_phase(
        &client,
        &ns.name,
        "preflight",
        TrainingJobPhase::Failed,
        180,
    )
    .await;
    assert_eq!(
        status["restarts"], 0,
        "a verdict, not a restart: {status:#}"
    );
    let failed = common::condition(&status, "Failed");
    assert_eq!(failed["reason"], "PreflightFailed", "{failed}");
    let message = failed["message"].as_str().unwrap();
    // rank 0's preflight line, in the launcher's log, has the figures the message names.
    let launcher_log = logs(
        &client,
        &ns.name,
        &common::current_launcher(&client, &ns.name, "preflight").await,
    )
    .await;
    let preflight = launcher_log
        .lines()
        .find_map(|line| match serde_json::from_str::<Line>(line.trim()) {
            Ok(Line::Preflight(preflight)) => Some(preflight),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no preflight line: {launcher_log}"));
    assert!(!preflight.passed, "{preflight:?}");
    assert_eq!(
        (preflight.world_size, preflight.links.len()),
        (4, 4),
        "2 workers × 2 ranks, a link each"
    );
    let least = preflight
        .links
        .iter()
        .map(|l| l.gbps)
        .fold(f64::INFINITY, f64::min);
    assert_eq!(preflight.slowest.gbps, least, "{preflight:?}");
    assert_eq!(preflight.slowest.to, (preflight.slowest.from + 1) % 4);
    for host in [&preflight.slowest.from_host, &preflight.slowest.to_host] {
        assert!(
            host.as_deref()
                .is_some_and(|h| h.starts_with("preflight-worker-")),
            "the ranks' hosts are the worker pods: {preflight:?}"
        );
    }
    for words in [
        "exited with code 69".to_string(),
        "the fabric is too slow".to_string(),
        "below the minimum of 10000 GB/s".to_string(),
        format!("the slowest link is {}", preflight.slowest),
    ] {
        assert!(message.contains(&words), "{words:?} in {message}");
    }
    assert!(
        !launcher_log.contains(r#""event":"step""#),
        "failed before the first step: {launcher_log}"
    );
    let failure = Failure::find_in(&launcher_log).expect("the ranks' failure lines");
    assert_eq!(failure.exit_code, exit::FABRIC_TOO_SLOW);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mpich_trains_across_real_pods_as_root() {
    let _node = REAL_NODE_IN_USE.lock().await;
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "real-mpich").await;
    let _operator = Operator::start(&client, &ns.name).await;
    let job = sample_on_real_node("mpich", |spec| {
        as_root(spec);
        spec["mpi"] = json!({"implementation": "MPICH"});
        spec["trainer"]["imageSize"] = json!(32);
        spec["trainer"]["steps"] = json!(8);
    });
    apply(&client, &job, &ns.name, false).await.unwrap();

    let workers = launcher_started_after_ready_workers(&client, &ns.name, "mpich").await;
    // As root, the key copy is root's own, mode 0600 (the Secret's file is group-readable
    // through fsGroup, which ssh refuses from its owner).
    assert_eq!(
        user_and_key_copy(&ns.name, &workers[1]),
        ("0".into(), "600 root".into())
    );

    let status = wait_phase(&client, &ns.name, "mpich", TrainingJobPhase::Succeeded, 300).await;
    let summary = launcher_summary(&client, &ns.name, "mpich").await;
    assert_result_is_the_trainers(&status, &summary, 8);
}

/// In a namespace whose Pod Security admission enforces `restricted`, the CPU sample's pods
/// are admitted as Ringmaster builds them (non-root, no privilege escalation, every
/// capability dropped, seccomp RuntimeDefault) and the job succeeds. A job whose pods the
/// namespace refuses (InfiniBand's IPC_LOCK; a worker override adding NET_ADMIN, which no
/// level below `privileged` allows either) is `Stalled` with reason `ChildRejected` and the admission's own words, with a
/// Warning Event, while the operator retries with backoff: never a silent retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cpu_sample_succeeds_where_restricted_is_enforced_and_refused_pods_stall_their_job() {
    let _node = REAL_NODE_IN_USE.lock().await;
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "real-restricted").await;
    enforce_pod_security(&client, &ns.name, "restricted").await;
    let _operator = Operator::start(&client, &ns.name).await;

    let infiniband = sample_on_real_node("infiniband", |spec| {
        spec["gpusPerWorker"] = json!(2);
        spec["infiniband"] = json!({"enabled": true});
    });
    // (Not `privileged: true`: an API server run with --allow-privileged=false, the flag's
    // default, refuses that before Pod Security admission does.)
    let net_admin = sample_on_real_node("net-admin", |spec| {
        spec["worker"]["containerSecurityContext"] =
            json!({"capabilities": {"add": ["NET_ADMIN"]}});
    });
    for job in [&infiniband, &net_admin] {
        apply(&client, job, &ns.name, false).await.unwrap();
    }
    let job = sample_on_real_node("sample", |_| {});
    apply(&client, &job, &ns.name, false).await.unwrap();

    for (name, words) in [("infiniband", "IPC_LOCK"), ("net-admin", "NET_ADMIN")] {
        eventually(
            Duration::from_secs(60),
            &format!("{name}: Stalled=True, ChildRejected"),
            || async {
                let status = common::job_status(&client, &ns.name, name).await;
                let stalled = common::condition(&status, "Stalled");
                stalled["status"] == "True" && stalled["reason"] == "ChildRejected"
            },
        )
        .await;
        let status = common::job_status(&client, &ns.name, name).await;
        let message = common::condition(&status, "Stalled")["message"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(
            message.starts_with(&format!("creating Pod {name}-worker-"))
                && message.contains("violates PodSecurity \"restricted:latest\"")
                && message.contains(words),
            "{message}"
        );
        assert_eq!(
            common::condition(&status, "Ready")["reason"],
            "ChildRejected"
        );
        eventually(
            Duration::from_secs(30),
            &format!("{name}: a ChildRejected Warning Event"),
            || async {
                !common::warnings_for(&client, &ns.name, name, "ChildRejected")
                    .await
                    .is_empty()
            },
        )
        .await;
        assert!(
            pods(&client, &ns.name, name).await.is_empty(),
            "{name}: no pod was admitted"
        );
    }

    let status = wait_phase(
        &client,
        &ns.name,
        "sample",
        TrainingJobPhase::Succeeded,
        300,
    )
    .await;
    assert_eq!(status["restarts"], 0, "{status:#}");
    let summary = launcher_summary(&client, &ns.name, "sample").await;
    assert_result_is_the_trainers(
        &status,
        &summary,
        job["spec"]["trainer"]["steps"].as_u64().unwrap(),
    );
    // The refused jobs are still said to be refused: the retries met the same refusal.
    for name in ["infiniband", "net-admin"] {
        let status = common::job_status(&client, &ns.name, name).await;
        assert_eq!(
            common::condition(&status, "Stalled")["reason"],
            "ChildRejected",
            "{status:#}"
        );
    }
}

/// The job's Ready condition once its reason is `reason`, and the Warning Events of that
/// reason published by then.
async fn blocked_with(
    client: &kube::Client,
    ns: &str,
    job: &str,
    reason: &str,
) -> (Value, Vec<k8s_openapi::api::events::v1::Event>) {
    eventually(
        Duration::from_secs(120),
        &format!("{job}: Ready=False, {reason}, and a Warning Event"),
        || async {
            let status = common::job_status(client, ns, job).await;
            common::condition(&status, "Ready")["reason"] == reason
                && !common::warnings_for(client, ns, job, reason)
                    .await
                    .is_empty()
        },
    )
    .await;
    let status = common::job_status(client, ns, job).await;
    let warnings = common::warnings_for(client, ns, job, reason).await;
    (common::condition(&status, "Ready").clone(), warnings)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_the_kubelet_cannot_start_blocks_the_job_visibly_until_it_is_fixed() {
    let _node = REAL_NODE_IN_USE.lock().await;
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "real-blocked").await;
    let _operator = Operator::start(&client, &ns.name).await;

    // An image the node does not have and cannot pull (no registry answers here): the
    // kubelet's ErrImagePull / ImagePullBackOff, on the job.
    let typo = format!("{IMAGE}-typo");
    let job = sample_on_real_node("typo", |spec| spec["image"] = json!(typo));
    apply(&client, &job, &ns.name, false).await.unwrap();
    let (ready, warnings) = blocked_with(&client, &ns.name, "typo", "ImagePullFailed").await;
    let message = ready["message"].as_str().unwrap();
    assert!(
        message.starts_with("worker typo-worker-") && message.contains(&typo),
        "{ready:#}"
    );
    let status = common::job_status(&client, &ns.name, "typo").await;
    assert_eq!(
        common::condition(&status, "WorkersReady")["reason"],
        "ImagePullFailed"
    );
    assert!(
        common::phase_is(&status, TrainingJobPhase::Starting),
        "{status:#}"
    );
    // The kubelet retries (ErrImagePull, then ImagePullBackOff): one Event for the block.
    tokio::time::sleep(Duration::from_secs(15)).await;
    let again = events_for(&client, &ns.name, "typo")
        .await
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("ImagePullFailed"))
        .count();
    assert_eq!((warnings.len(), again), (1, 1), "one Warning for one block");
    // Published once: kube's recorder would count a repeat as a series of the same Event.
    let published = events_for(&client, &ns.name, "typo")
        .await
        .into_iter()
        .find(|e| e.reason.as_deref() == Some("ImagePullFailed"))
        .unwrap();
    assert!(published.series.is_none(), "{:?}", published.series);
    let jobs: Api<ringmaster::api::TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    jobs.delete("typo", &Default::default()).await.unwrap();

    // A Secret the workers' environment names, not there yet: CreateContainerConfigError.
    // Once it exists the kubelet starts the containers and the job runs: nothing was lost.
    let job = sample_on_real_node("secret", |spec| {
        spec["worker"]["env"] = json!([{"name": "HUB_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "hub", "key": "token"}}}]);
    });
    apply(&client, &job, &ns.name, false).await.unwrap();
    let (ready, _) = blocked_with(&client, &ns.name, "secret", "ContainerCannotStart").await;
    let message = ready["message"].as_str().unwrap();
    assert!(
        message.contains("CreateContainerConfigError") && message.contains("hub"),
        "{ready:#}"
    );
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(client.clone(), &ns.name);
    let secret = serde_json::from_value(json!({
        "metadata": {"name": "hub"},
        "stringData": {"token": "not-a-real-token"},
    }))
    .unwrap();
    secrets.create(&Default::default(), &secret).await.unwrap();
    let status = wait_phase(&client, &ns.name, "secret", TrainingJobPhase::Running, 180).await;
    assert_eq!(common::condition(&status, "Ready")["reason"], "Running");
    assert_eq!(status["restarts"], 0, "{status:#}");
}

/// The workers' environment reaches every rank over ssh: a plain value (and Ringmaster's own,
/// the rendezvous key's file among them) through mpirun, and entries each worker resolves
/// for itself (its pod's name, and a value with quotes built from
/// it) with that worker's values, which its sshd sets from its `authorized_keys` options
/// (mpirun used to send the launcher's on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rank_gets_the_worker_environment_with_its_own_workers_values() {
    let _node = REAL_NODE_IN_USE.lock().await;
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "real-env").await;
    let _operator = Operator::start(&client, &ns.name).await;
    // Open MPI as the image's user, and MPICH's Hydra as root: each passes the worker's
    // session environment on to its ranks.
    for (name, implementation, root, rank_var) in [
        ("env", "OpenMPI", false, "OMPI_COMM_WORLD_RANK"),
        ("env-mpich", "MPICH", true, "PMI_RANK"),
    ] {
        let job = sample_on_real_node(name, |spec| {
            spec.as_object_mut().unwrap().remove("trainer");
            if root {
                as_root(spec);
            }
            spec["mpi"] = json!({"implementation": implementation});
            spec["command"] = json!([
                "sh",
                "-c",
                format!(
                    "echo \"rank=${rank_var} pod=$POD_NAME team=$TEAM greeting=$GREETING key=$RINGMASTER_RENDEZVOUS_KEY_FILE\""
                )
            ]);
            spec["worker"]["env"] = json!([
                {"name": "TEAM", "value": "vision"},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "GREETING", "value": "say \"hi\" to $(POD_NAME)"},
            ]);
        });
        apply(&client, &job, &ns.name, false).await.unwrap();
        wait_phase(&client, &ns.name, name, TrainingJobPhase::Succeeded, 180).await;
        let log = logs(&client, &ns.name, &format!("{name}-launcher")).await;
        let mut ranks: Vec<&str> = log.lines().filter(|l| l.starts_with("rank=")).collect();
        ranks.sort();
        // Two slots per worker, in order: ranks 0 and 1 on worker 0, 2 and 3 on worker 1.
        let expected: Vec<String> = (0..4)
            .map(|rank| {
                let pod = format!("{name}-worker-{}", rank / 2);
                format!("rank={rank} pod={pod} team=vision greeting=say \"hi\" to {pod} key=/etc/ringmaster/ssh-secret/rendezvous-key")
            })
            .collect();
        assert_eq!(ranks, expected, "{implementation}: {log}");
    }
}

/// `mpi.sshPort: 22` with the image's non-root user: sshd listens on the privileged port
/// (the pod's own network opens it to every user), and mpirun reaches every rank through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_root_worker_serves_ssh_on_port_22() {
    let _node = REAL_NODE_IN_USE.lock().await;
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "real-port22").await;
    let _operator = Operator::start(&client, &ns.name).await;
    let job = sample_on_real_node("port22", |spec| {
        spec.as_object_mut().unwrap().remove("trainer");
        spec["mpi"] = json!({"sshPort": 22});
        spec["command"] = json!([
            "sh",
            "-c",
            "echo \"rank=$OMPI_COMM_WORLD_RANK uid=`id -u`\""
        ]);
    });
    apply(&client, &job, &ns.name, false).await.unwrap();
    let workers = launcher_started_after_ready_workers(&client, &ns.name, "port22").await;
    let sshd_log = logs(&client, &ns.name, &workers[0]).await;
    assert!(
        sshd_log.contains("Server listening on 0.0.0.0 port 22.")
            && sshd_log.contains("Accepted publickey for trainer"),
        "{sshd_log}"
    );
    let status = wait_phase(
        &client,
        &ns.name,
        "port22",
        TrainingJobPhase::Succeeded,
        180,
    )
    .await;
    assert_eq!(status["restarts"], 0, "{status:#}");
    let log = logs(&client, &ns.name, "port22-launcher").await;
    let mut ranks: Vec<&str> = log.lines().filter(|l| l.starts_with("rank=")).collect();
    ranks.sort();
    assert_eq!(
        ranks,
        [
            "rank=0 uid=1000",
            "rank=1 uid=1000",
            "rank=2 uid=1000",
            "rank=3 uid=1000"
        ],
        "{log}"
    );
}

/// Kills a container through containerd (SIGKILL to its task), as the OOM killer or a crash
/// would end it: the kubelet sees it exit.
fn kill_container(container_id: &str) {
    let id = container_id
        .strip_prefix("containerd://")
        .unwrap_or(container_id);
    let socket = repo_root().join("e2e/.state/node/containerd/containerd.sock");
    let out = Command::new(tool("ctr"))
        .arg("--address")
        .arg(&socket)
        .args([
            "--namespace",
            "k8s.io",
            "tasks",
            "kill",
            "--signal",
            "SIGKILL",
            id,
        ])
        .output()
        .expect("running ctr");
    assert!(
        out.status.success(),
        "ctr tasks kill {id}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_training_restarts_the_gang_which_goes_on_from_its_checkpoint() {
    let _node = REAL_NODE_IN_USE.lock().await;
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "real-kill").await;
    let _operator = Operator::start(&client, &ns.name).await;
    // The job's output folder, on the node: the trainer's checkpoint goes there.
    let dir = repo_root().join("e2e/.state/node/volumes").join(&ns.name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let volume = local_volume(&client, &ns.name, "kill-output", &dir).await;
    let job = sample_on_real_node("kill", |spec| {
        spec["trainer"]["imageSize"] = json!(32);
        spec["trainer"]["steps"] = json!(30);
        spec["trainer"]["extraArgs"] = json!(["--checkpoint-every=5"]);
        spec["output"] = json!({"persistentVolumeClaim": {"claimName": "kill-output"}});
        spec["runPolicy"]["backoffLimit"] = json!(2);
    });
    apply(&client, &job, &ns.name, false).await.unwrap();
    launcher_started_after_ready_workers(&client, &ns.name, "kill").await;

    // Training is under way, and has a checkpoint, once rank 0 has said it wrote one.
    eventually(Duration::from_secs(180), "a checkpoint", || async {
        logs(&client, &ns.name, "kill-launcher")
            .await
            .contains(r#""event":"checkpoint""#)
    })
    .await;
    let worker = Api::<Pod>::namespaced(client.clone(), &ns.name)
        .get("kill-worker-1")
        .await
        .unwrap();
    let container_id = worker
        .status
        .and_then(|s| s.container_statuses)
        .and_then(|c| c.into_iter().next())
        .and_then(|c| c.container_id)
        .expect("worker 1's container id");
    kill_container(&container_id);

    let status = wait_phase(&client, &ns.name, "kill", TrainingJobPhase::Succeeded, 400).await;
    assert_eq!(status["restarts"], 1, "{status:#}");
    let note = common::restarting_event_note(&client, &ns.name, "kill").await;
    assert!(
        note.contains("kill-worker-1 exited with code 137"),
        "the Event names the killed worker and its exit: {note}"
    );
    let summary = launcher_summary(&client, &ns.name, "kill").await;
    assert_result_is_the_trainers(&status, &summary, 30);
    // The failed attempt is kept in the status; its launcher, when it had failed by the
    // restart (mpirun notices the lost rank within moments), is kept with its log.
    let failure = &status["lastFailure"];
    assert_eq!(failure["pod"], "kill-worker-1", "{status:#}");
    assert_eq!(failure["exitCode"], 137, "{status:#}");
    if let Some(kept) = failure["launcher"].as_str() {
        assert_eq!(kept, "kill-launcher");
        let pod = Api::<Pod>::namespaced(client.clone(), &ns.name)
            .get(kept)
            .await
            .expect("the failed attempt's launcher is kept");
        assert_eq!(pod.status.and_then(|s| s.phase).as_deref(), Some("Failed"));
        assert!(!logs(&client, &ns.name, kept).await.is_empty());
    }
    // The restarted gang trained only what the first had not: it went on from a checkpoint
    // of this job (every 5 steps; the last step writes the model instead).
    let resumed = summary
        .resumed_from_step
        .expect("the restarted gang resumed from the checkpoint");
    assert!(
        resumed % 5 == 0 && (5..30).contains(&resumed),
        "{summary:?}"
    );
    assert_eq!(
        status["result"]["resumedFromStep"].as_u64(),
        Some(resumed),
        "{status:#}"
    );
    let uid = Api::<ringmaster::api::TrainingJob>::namespaced(client.clone(), &ns.name)
        .get("kill")
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap();
    // In the run's own folder (issue 38, item 5): its last checkpoint, step 25.
    let run_dir = run_dir(&dir.join("kill"), Some(&uid));
    let metadata = checkpoint_metadata(&run_dir.join(checkpoint_file(25)));
    assert_eq!(metadata["run"], uid, "written under the job's UID");
    assert!(
        dir.join("kill").join(MODEL_FILE).exists(),
        "the final model"
    );

    let volumes: Api<k8s_openapi::api::core::v1::PersistentVolume> = Api::all(client.clone());
    volumes.delete(&volume, &Default::default()).await.ok();
}

/// The string metadata of a safetensors file: its header is a little-endian u64 length, then
/// that much JSON, whose `__metadata__` holds it.
fn checkpoint_metadata(path: &std::path::Path) -> Value {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let length = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + length]).unwrap();
    header["__metadata__"].clone()
}

/// The trainer binary node.sh built (release) for the image.
fn trainer_binary() -> std::path::PathBuf {
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| repo_root().join("target"));
    target.join("release/ringmaster-trainer")
}

/// Uploads every file under `dir` as a blob named `prefix` + its relative path.
fn upload_folder(
    azurite: &azurite::Azurite,
    container: &str,
    dir: &std::path::Path,
    prefix: &str,
) -> usize {
    let mut count = 0;
    let mut pending = vec![dir.to_path_buf()];
    while let Some(folder) = pending.pop() {
        for entry in std::fs::read_dir(&folder).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            let name = path.strip_prefix(dir).unwrap().to_str().unwrap();
            let status = azurite.put_blob(
                container,
                &format!("{prefix}{name}"),
                &std::fs::read(&path).unwrap(),
            );
            assert_eq!(status, 201, "uploading {name}");
            count += 1;
        }
    }
    count
}

/// A PersistentVolume on a folder of the real node (`local`: this kernel has no NFS client),
/// and a claim bound to it.
async fn local_volume(
    client: &kube::Client,
    ns: &str,
    claim: &str,
    dir: &std::path::Path,
) -> String {
    let volume_name = format!("{ns}-{claim}");
    let volume = json!({
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": volume_name},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "ringmaster-local",
            "local": {"path": dir.to_str().unwrap()},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": [REAL_NODE]},
            ]}]}},
        },
    });
    let volumes: Api<k8s_openapi::api::core::v1::PersistentVolume> = Api::all(client.clone());
    volumes
        .create(
            &Default::default(),
            &serde_json::from_value(volume).unwrap(),
        )
        .await
        .unwrap();
    let claim = json!({
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "ringmaster-local",
            "volumeName": volume_name,
            "resources": {"requests": {"storage": "1Gi"}},
        },
    });
    apply(client, &claim, ns, false).await.unwrap();
    volume_name
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_datastage_copies_from_azurite_onto_the_node_and_a_job_trains_on_the_folder() {
    let _node = REAL_NODE_IN_USE.lock().await;
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "real-data").await;
    // The stager and the training pods all meet `restricted`.
    enforce_pod_security(&client, &ns.name, "restricted").await;
    let _operator = Operator::start_with(
        &client,
        &ns.name,
        ringmaster::controller::OperatorConfig {
            restart_backoff: Duration::from_millis(500),
            stager_image: STAGER_IMAGE.into(),
            ..Default::default()
        },
    )
    .await;

    // The trainer's own learnable data set (4 classes of JPEGs), in Azurite where the node's
    // pods reach it.
    let source = tempfile::tempdir().unwrap();
    let made = Command::new(trainer_binary())
        .args([
            "make-dataset",
            "--classes",
            "4",
            "--per-class",
            "16",
            "--image-size",
            "32",
            "--out",
        ])
        .arg(source.path())
        .output()
        .expect("ringmaster-trainer make-dataset");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let azurite = azurite::Azurite::start_on(NODE_BRIDGE_ADDRESS);
    azurite.create_container("datasets");
    let files = upload_folder(&azurite, "datasets", source.path(), "tiny/");
    assert_eq!(files, 64);
    sas_secret(
        &client,
        &ns.name,
        &azurite::container_sas(azurite::KEY, "datasets", "rl"),
    )
    .await;

    // The destination: a folder on the real node, made by its administrator (root).
    let dir = repo_root().join("e2e/.state/node/volumes").join(&ns.name);
    std::fs::create_dir_all(&dir).unwrap();
    let volume = local_volume(&client, &ns.name, "tiny-local", &dir).await;

    let stage = json!({
        "apiVersion": "ringmaster.dev/v1alpha1",
        "kind": "DataStage",
        "metadata": {"name": "tiny"},
        "spec": {
            "source": {"azureBlob": {
                "account": azurite::ACCOUNT,
                "container": "datasets",
                "prefix": "tiny/",
                "endpoint": azurite.endpoint(),
                "allowInsecureEndpoint": true,
                "auth": {"sasTokenSecretRef": {"name": "blob-sas", "key": "sasToken"}},
            }},
            "destination": {"existingClaim": {"claimName": "tiny-local"}},
            "nodeSelector": {REAL_NODE_LABEL: "true"},
            "tolerations": [{"key": REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
        },
    });
    apply(&client, &stage, &ns.name, false).await.unwrap();
    // A job that trains on the staged folder: 6 steps of 4 ranks × 8 images.
    let on_the_folder = |name| {
        sample_on_real_node(name, |spec| {
            spec["dataStageRef"] = json!({"name": "tiny"});
            spec["trainer"] = json!({
                "model": "resnet18", "data": "imageFolder", "dataPath": "train",
                "imageSize": 32, "batchSize": 8, "steps": 6,
            });
        })
    };
    apply(&client, &on_the_folder("fed"), &ns.name, false)
        .await
        .unwrap();

    // The stager pod copied every blob onto the node, reporting progress as it went.
    let status = wait_stage_phase(&client, &ns.name, "tiny", "Ready").await;
    assert_eq!(status["progress"]["filesDone"], 64, "{status:#}");
    assert_eq!(status["progress"]["filesTotal"], 64, "{status:#}");
    let mut copied = 0;
    let mut pending = vec![dir.join("train")];
    while let Some(folder) = pending.pop() {
        for entry in std::fs::read_dir(&folder).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "jpg") {
                let relative = path.strip_prefix(&dir).unwrap();
                assert_eq!(
                    std::fs::read(&path).unwrap(),
                    std::fs::read(source.path().join(relative)).unwrap(),
                    "{}",
                    relative.display()
                );
                copied += 1;
            }
        }
    }
    assert_eq!(copied, 64, "JPEGs on the node");

    // The job waited for the data, then trained on the folder.
    let status = wait_phase(&client, &ns.name, "fed", TrainingJobPhase::Succeeded, 300).await;
    let summary = launcher_summary(&client, &ns.name, "fed").await;
    assert_result_is_the_trainers(&status, &summary, 6);

    // A JPEG broken on the volume stops the next job on it, and the job says so in the
    // trainer's words (the rank's failure line that `launch` kept), not in mpirun's: every
    // epoch of 3 reads 64 of the 65 images.
    std::fs::write(dir.join("train/class-001/zz-broken.jpg"), b"not a JPEG").unwrap();
    apply(&client, &on_the_folder("broken"), &ns.name, false)
        .await
        .unwrap();
    let status = wait_phase(&client, &ns.name, "broken", TrainingJobPhase::Failed, 300).await;
    let failed = common::condition(&status, "Failed");
    let message = failed["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("launcher broken-launcher exited with code 1 (Error): rank ")
            && message.contains(": decoding /")
            && message.contains("/train/class-001/zz-broken.jpg: "),
        "{status:#}"
    );
    assert!(!message.contains("mpirun"), "{message}");

    let volumes: Api<k8s_openapi::api::core::v1::PersistentVolume> = Api::all(client.clone());
    volumes.delete(&volume, &Default::default()).await.ok();
}

/// A copy whose volume cannot be mounted (a local PersistentVolume whose folder is not on the
/// node: the kubelet's FailedMount) does not wait out the Job's two-day deadline: after
/// `startTimeoutSeconds` the DataStage is Failed with the kubelet's words, and a Warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_whose_volume_cannot_be_mounted_fails_the_datastage_with_the_kubelets_words() {
    let _node = REAL_NODE_IN_USE.lock().await;
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "real-mount").await;
    let _operator = Operator::start_with(
        &client,
        &ns.name,
        ringmaster::controller::OperatorConfig {
            stager_image: STAGER_IMAGE.into(),
            ..Default::default()
        },
    )
    .await;
    sas_secret(&client, &ns.name, "sv=2025-11-05&sig=unused").await;
    let missing = repo_root()
        .join("e2e/.state/node/volumes")
        .join(format!("{}-never-made", ns.name));
    let volume = local_volume(&client, &ns.name, "nowhere", &missing).await;
    let stage = json!({
        "apiVersion": "ringmaster.dev/v1alpha1",
        "kind": "DataStage",
        "metadata": {"name": "unmountable"},
        "spec": {
            "source": {"azureBlob": {
                "account": azurite::ACCOUNT,
                "container": "datasets",
                "endpoint": format!("http://{NODE_BRIDGE_ADDRESS}:10000/{}", azurite::ACCOUNT),
                "allowInsecureEndpoint": true,
                "auth": {"sasTokenSecretRef": {"name": "blob-sas", "key": "sasToken"}},
            }},
            "destination": {"existingClaim": {"claimName": "nowhere"}},
            "startTimeoutSeconds": 30,
            "nodeSelector": {REAL_NODE_LABEL: "true"},
            "tolerations": [{"key": REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
        },
    });
    apply(&client, &stage, &ns.name, false).await.unwrap();
    let status = wait_stage_phase(&client, &ns.name, "unmountable", "Failed").await;
    let ready = common::condition(&status, "Ready");
    assert_eq!(ready["reason"], "StartTimeout", "{status:#}");
    let message = ready["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("cannot mount its volumes (FailedMount: ")
            && message.contains("never-made"),
        "the kubelet's words, naming the folder: {status:#}"
    );
    eventually(
        Duration::from_secs(20),
        "a StartTimeout Warning",
        || async {
            !common::warnings_for(&client, &ns.name, "unmountable", "StartTimeout")
                .await
                .is_empty()
        },
    )
    .await;
    assert!(!missing.exists(), "nothing made the folder");
    let volumes: Api<k8s_openapi::api::core::v1::PersistentVolume> = Api::all(client.clone());
    volumes.delete(&volume, &Default::default()).await.ok();
}

/// What a TCP connection from a pod came to.
#[derive(Debug, PartialEq)]
enum Reach {
    /// Connected, and the server's first bytes (sshd's banner) came back.
    Connected,
    /// No answer within 3 s: the SYN was dropped.
    TimedOut,
}

/// Connects from `pod` (its bash's `/dev/tcp`) to `ip:port` and reads 7 bytes. Anything but
/// sshd's banner or a timeout (a refusal, kubectl failing) fails the test: a policy drops.
fn tcp_connect(ns: &str, pod: &str, ip: &str, port: u16) -> Reach {
    let out = Command::new(tool("kubectl"))
        .arg("--kubeconfig")
        .arg(ringmaster_e2e::cluster::kubeconfig_path())
        .args(["exec", "-n", ns, pod, "--", "timeout", "3", "bash", "-c"])
        .args([
            "exec 3<>/dev/tcp/$0/$1 && head -c 7 <&3",
            ip,
            &port.to_string(),
        ])
        .output()
        .expect("running kubectl exec");
    let stdout = String::from_utf8_lossy(&out.stdout);
    match out.status.code() {
        Some(0) if stdout == "SSH-2.0" => Reach::Connected,
        Some(124) => Reach::TimedOut,
        code => panic!(
            "{pod} → {ip}:{port}: exit {code:?}, {stdout:?}, {}",
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// A pod on the real node in the root image, running `command`, with `labels`; made in `ns`
/// and waited for until Ready. Its IP.
async fn pod_on_real_node(
    client: &kube::Client,
    ns: &str,
    name: &str,
    labels: &Value,
    command: &[&str],
    probe_port: Option<u16>,
) -> String {
    let mut pod = json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "nodeSelector": {REAL_NODE_LABEL: "true"},
            "tolerations": [{"key": REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": "main", "image": ROOT_IMAGE, "command": command,
                "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
            }],
        },
    });
    if let Some(port) = probe_port {
        pod["spec"]["containers"][0]["readinessProbe"] =
            json!({"tcpSocket": {"port": port}, "periodSeconds": 1, "failureThreshold": 2});
    }
    let api = Api::<Pod>::namespaced(client.clone(), ns);
    api.create(&Default::default(), &serde_json::from_value(pod).unwrap())
        .await
        .unwrap();
    eventually(
        Duration::from_secs(90),
        &format!("{ns}/{name} Ready"),
        || async { api.get(name).await.is_ok_and(|p| ready_since(&p).is_some()) },
    )
    .await;
    let pod = api.get(name).await.unwrap();
    pod.status.and_then(|s| s.pod_ip).expect("a pod IP")
}

/// NetworkPolicies are enforced on the real node (kube-network-policies, node.sh): a policy
/// of the shape the operator gives a job's pods (only the job's own pods may connect to
/// them) drops a connection from another namespace's pod to a worker's sshd, while the job's
/// own pods connect, and so does the kubelet's probe from the node; without the policy the
/// other namespace's pod connects, before and after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_network_policy_keeps_other_namespaces_off_a_jobs_workers() {
    let _node = REAL_NODE_IN_USE.lock().await;
    let client = client().await;
    let job_ns = TestNamespace::new(&client, "real-netpol").await;
    let other_ns = TestNamespace::new(&client, "real-netpol-other").await;
    let job_labels = json!({
        "ringmaster.dev/job-name": "j",
        "ringmaster.dev/job-uid": "3f1c9a52-6b1e-4d8a-9c53-2f0a7e4b8d10",
        "app.kubernetes.io/managed-by": "ringmaster",
    });
    const SSH_PORT: u16 = 2222;
    let sshd = format!("ssh-keygen -A -q && exec /usr/sbin/sshd -D -e -p {SSH_PORT}");
    let worker_ip = pod_on_real_node(
        &client,
        &job_ns.name,
        "j-worker-0",
        &job_labels,
        &["sh", "-c", &sshd],
        Some(SSH_PORT),
    )
    .await;
    let sleep = ["sleep", "infinity"];
    pod_on_real_node(
        &client,
        &job_ns.name,
        "j-launcher",
        &job_labels,
        &sleep,
        None,
    )
    .await;
    pod_on_real_node(
        &client,
        &other_ns.name,
        "outsider",
        &json!({}),
        &sleep,
        None,
    )
    .await;
    let from_job = || tcp_connect(&job_ns.name, "j-launcher", &worker_ip, SSH_PORT);
    let from_other = || tcp_connect(&other_ns.name, "outsider", &worker_ip, SSH_PORT);

    // No policy: every pod connects.
    assert_eq!(from_other(), Reach::Connected, "no policy yet");
    assert_eq!(from_job(), Reach::Connected, "no policy yet");

    let policies: Api<k8s_openapi::api::networking::v1::NetworkPolicy> =
        Api::namespaced(client.clone(), &job_ns.name);
    let policy = json!({
        "metadata": {"name": "j"},
        "spec": {
            "podSelector": {"matchLabels": job_labels},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": job_labels}}]}],
        },
    });
    policies
        .create(
            &Default::default(),
            &serde_json::from_value(policy).unwrap(),
        )
        .await
        .unwrap();
    // The engine sees the policy within moments; from then on the other namespace's pod
    // cannot connect, every time.
    eventually(
        Duration::from_secs(30),
        "the outsider's connection dropped",
        || async move { from_other() == Reach::TimedOut },
    )
    .await;
    assert_eq!(from_job(), Reach::Connected, "the job's own pod");
    assert_eq!(from_other(), Reach::TimedOut, "the outsider, again");
    assert_eq!(from_job(), Reach::Connected, "the job's own pod, again");
    // The kubelet's probe comes from the node, which the policy does not police: the worker
    // stayed Ready (two failed probes a second apart would have made it unready by now).
    let worker = Api::<Pod>::namespaced(client.clone(), &job_ns.name)
        .get("j-worker-0")
        .await
        .unwrap();
    assert!(
        worker
            .status
            .and_then(|s| s.conditions)
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True")),
        "the worker's readiness probe failed under the policy"
    );

    // Without the policy the outsider connects again.
    policies.delete("j", &Default::default()).await.unwrap();
    eventually(
        Duration::from_secs(30),
        "the outsider connecting once the policy is gone",
        || async move { from_other() == Reach::Connected },
    )
    .await;
}
