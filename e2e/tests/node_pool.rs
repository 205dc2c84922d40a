//! TrainingJobs that bring their own AKS agent pool, against the **simulated AKS**
//! (`ringmaster_e2e::simulated_aks`: a local server with ARM's agent-pool semantics that
//! adds KWOK nodes shaped like the VM size when a pool succeeds).

mod common;

use std::collections::BTreeSet;
use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use common::{Operator, TestNamespace, apply, client, ensure_crds, eventually, pods};
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use ringmaster::aks::{ArmClient, ArmConfig, TokenSource, arm::API_VERSION};
use ringmaster::api::TrainingJob;
use ringmaster::controller::OperatorConfig;
use ringmaster_e2e::simulated_aks::{ArmFailure, SimulatedAks};
use serde_json::{Value, json};

/// Every log line the operators of this test binary write, to grep for secrets.
fn logs() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buffer = Arc::new(Mutex::new(Vec::new()));
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter("debug")
            .with_writer(move || LogWriter(writer.clone()))
            .finish();
        let _ = tracing::subscriber::set_global_default(subscriber);
        buffer
    })
}

struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The simulated AKS, an operator that uses it, and the token they share.
struct Setup {
    aks: SimulatedAks,
    operator: Operator,
    token: String,
    _token_file: tempfile::NamedTempFile,
}

async fn setup(client: &Client, ns: &str, create_delay: Duration) -> Setup {
    logs();
    let token = format!("eyJ0eXAiOiJKV1QiLCJhbGciOiJSUzI1NiJ9.simulated-{ns}.s1gn4tur3");
    let mut token_file = tempfile::NamedTempFile::new().unwrap();
    token_file.write_all(token.as_bytes()).unwrap();
    let aks = SimulatedAks::start(
        client.clone(),
        &token,
        API_VERSION,
        create_delay,
        Duration::from_millis(500),
    )
    .await
    .unwrap();
    let operator = start_operator(client, ns, &aks, token_file.path()).await;
    Setup {
        aks,
        operator,
        token,
        _token_file: token_file,
    }
}

async fn start_operator(
    client: &Client,
    ns: &str,
    aks: &SimulatedAks,
    token_file: &std::path::Path,
) -> Operator {
    let arm = ArmClient::new(
        ArmConfig {
            endpoint: aks.endpoint(),
            subscription: "00000000-0000-0000-0000-000000000000".into(),
            resource_group: "rg-ml".into(),
            cluster: "aks-gpu".into(),
        },
        TokenSource::File(token_file.to_path_buf()),
    )
    .unwrap();
    Operator::start_with(
        client,
        ns,
        OperatorConfig {
            restart_backoff: Duration::from_millis(500),
            arm: Some(arm),
            ..OperatorConfig::default()
        },
    )
    .await
}

/// A 2-worker GPU job with InfiniBand in its own Standard_ND96asr_v4 pool.
fn gpu_job(name: &str, edit: impl FnOnce(&mut Value)) -> Value {
    let mut job = json!({
        "apiVersion": "ringmaster.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "workers": 2,
            "gpusPerWorker": 8,
            "image": "ringmaster-trainer:e2e",
            "command": common::own_gpu_program(),
            "infiniband": {"enabled": true},
            "nodePool": {"provisioner": "aks", "vmSize": "Standard_ND96asr_v4"},
            "launcher": {"annotations": {
                "kwok.ringmaster.dev/exit-code": "0",
                "kwok.ringmaster.dev/exit-after": "2s",
                "kwok.ringmaster.dev/termination-message": common::trainer_summary(2500.0, 10, 2.0),
            }},
        }
    });
    edit(&mut job["spec"]);
    job
}

async fn status(client: &Client, ns: &str, name: &str) -> Value {
    let api: Api<TrainingJob> = Api::namespaced(client.clone(), ns);
    api.get_opt(name)
        .await
        .unwrap()
        .and_then(|j| j.status)
        .map(|s| serde_json::to_value(s).unwrap())
        .unwrap_or(Value::Null)
}

async fn wait_phase(client: &Client, ns: &str, name: &str, phase: &str, secs: u64) -> Value {
    let mut last = Value::Null;
    for _ in 0..secs * 5 {
        last = status(client, ns, name).await;
        if last["phase"] == phase {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("{name} never reached {phase}: {last:#}");
}

fn condition(status: &Value, type_: &str) -> Value {
    status["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == type_)
        .cloned()
        .unwrap_or(Value::Null)
}

async fn pool_nodes(client: &Client, pool: &str) -> BTreeSet<String> {
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .list(&ListParams::default().labels(&format!("kubernetes.azure.com/agentpool={pool}")))
        .await
        .unwrap()
        .items
        .iter()
        .map(|n| n.name_any())
        .collect()
}

/// Neither the status, nor the namespace's Events, nor any log line has the token.
async fn assert_token_nowhere(client: &Client, ns: &str, token: &str) {
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), ns);
    for job in jobs.list(&ListParams::default()).await.unwrap() {
        assert!(
            !serde_json::to_string(&job).unwrap().contains(token),
            "token in {}",
            job.name_any()
        );
    }
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    for event in events.list(&ListParams::default()).await.unwrap() {
        assert!(!serde_json::to_string(&event).unwrap().contains(token));
    }
    let logs = String::from_utf8_lossy(&logs().lock().unwrap()).to_string();
    assert!(!logs.is_empty(), "the log capture works");
    assert!(!logs.contains(token), "token in the operator's logs");
    assert!(!logs.contains("s1gn4tur3"));
}

#[tokio::test]
async fn a_job_makes_its_pool_runs_on_exactly_its_nodes_and_gives_it_back() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "pool-ok").await;
    let s = setup(&client, &ns.name, Duration::from_secs(2)).await;
    s.aks.throttle_next(2);
    // The launcher runs until the test has seen the job Running and its pods placed.
    apply(
        &client,
        &gpu_job("bert", |spec| spec["launcher"] = json!({})),
        &ns.name,
        false,
    )
    .await
    .unwrap();

    let st = wait_phase(&client, &ns.name, "bert", "ProvisioningNodes", 30).await;
    let pool = st["nodePool"]["name"].as_str().unwrap().to_string();
    assert!(pool.starts_with("bert"), "{pool}");
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    assert!(
        jobs.get("bert")
            .await
            .unwrap()
            .finalizers()
            .contains(&"ringmaster.dev/agent-pool".to_string())
    );

    // The workers run on the pool's nodes (selector and toleration of its taint).
    wait_phase(&client, &ns.name, "bert", "Running", 90).await;
    let nodes = pool_nodes(&client, &pool).await;
    assert_eq!(nodes.len(), 2);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    for name in ["bert-worker-0", "bert-worker-1", "bert-launcher"] {
        let spec = pods.get(name).await.unwrap().spec.unwrap();
        let node = spec.node_name.clone().unwrap_or_default();
        assert!(nodes.contains(&node), "{name} on {node}, not in {nodes:?}");
        assert_eq!(
            spec.node_selector.unwrap()["kubernetes.azure.com/agentpool"],
            pool
        );
    }

    common::end_launcher(&client, &ns.name, "bert").await;
    let st = wait_phase(&client, &ns.name, "bert", "Succeeded", 90).await;
    assert_eq!(condition(&st, "NodesReady")["status"], "True");
    assert!(s.aks.throttled() >= 2, "throttled requests were retried");
    assert_eq!(s.aks.puts(&pool), 1, "one PUT");

    // Given back after Succeeded: pool deleted, nodes gone, finalizer released.
    eventually(Duration::from_secs(60), "the pool deleted", || async {
        !s.aks.pools().contains_key(&pool) && pool_nodes(&client, &pool).await.is_empty()
    })
    .await;
    eventually(
        Duration::from_secs(30),
        "the finalizer released",
        || async { jobs.get("bert").await.unwrap().finalizers().is_empty() },
    )
    .await;
    assert_token_nowhere(&client, &ns.name, &s.token).await;
    drop(s.operator);
}

#[tokio::test]
async fn quota_failure_fails_the_job_with_azures_message() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "pool-quota").await;
    let s = setup(&client, &ns.name, Duration::from_secs(1)).await;
    s.aks.fail_next_put(ArmFailure {
        status: 400,
        code: "InsufficientVCPUQuota".into(),
        message: "Insufficient regional vcpu quota left for location eastus. left regional vcpu quota 0, requested quota 192.".into(),
    });
    apply(&client, &gpu_job("quota", |_| {}), &ns.name, false)
        .await
        .unwrap();
    let st = wait_phase(&client, &ns.name, "quota", "Failed", 30).await;
    let failed = condition(&st, "Failed");
    assert_eq!(failed["reason"], "NodePoolFailed");
    let message = failed["message"].as_str().unwrap();
    assert!(
        message.contains("InsufficientVCPUQuota") && message.contains("requested quota 192"),
        "{message}"
    );
    assert!(message.contains("request more"), "a hint: {message}");

    // A pool that fails while being made (capacity) also fails the job, with the operation's reason.
    s.aks.fail_next_async(ArmFailure {
        status: 200,
        code: "AllocationFailed".into(),
        message: "Allocation failed. We do not have sufficient capacity for the requested VM size in this region.".into(),
    });
    apply(&client, &gpu_job("capacity", |_| {}), &ns.name, false)
        .await
        .unwrap();
    let st = wait_phase(&client, &ns.name, "capacity", "Failed", 60).await;
    let message = condition(&st, "Failed")["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        message.contains("AllocationFailed") && message.contains("sufficient capacity"),
        "{message}"
    );
    assert_token_nowhere(&client, &ns.name, &s.token).await;
}

#[tokio::test]
async fn a_job_naming_a_pool_it_did_not_make_fails_and_leaves_the_pool_alone() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "pool-foreign").await;
    let s = setup(&client, &ns.name, Duration::from_secs(1)).await;

    // A person's pool of the name the job asks for.
    s.aks.made_by_hand("teampool", "Standard_ND96asr_v4", 2);
    apply(
        &client,
        &gpu_job("byhand", |spec| {
            spec["nodePool"]["poolName"] = json!("teampool")
        }),
        &ns.name,
        false,
    )
    .await
    .unwrap();
    let st = wait_phase(&client, &ns.name, "byhand", "Failed", 30).await;
    let failed = condition(&st, "Failed");
    assert_eq!(failed["reason"], "NodePoolFailed");
    let message = failed["message"].as_str().unwrap();
    assert!(
        message.contains(
            "agent pool teampool exists and is not this job's (Ringmaster did not make it)"
        ) && message.contains("nodePool.poolName"),
        "{message}"
    );
    assert!(pods(&client, &ns.name, "byhand").await.is_empty());

    // Another job's pool: the second job of the name fails, the first runs on.
    apply(
        &client,
        &gpu_job("first", |spec| {
            spec["nodePool"]["poolName"] = json!("shared");
            spec["launcher"] = json!({});
        }),
        &ns.name,
        false,
    )
    .await
    .unwrap();
    wait_phase(&client, &ns.name, "first", "Running", 60).await;
    apply(
        &client,
        &gpu_job("second", |spec| {
            spec["nodePool"]["poolName"] = json!("shared")
        }),
        &ns.name,
        false,
    )
    .await
    .unwrap();
    let st = wait_phase(&client, &ns.name, "second", "Failed", 30).await;
    let message = condition(&st, "Failed")["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        message.contains(&format!("(TrainingJob {}.first made it)", ns.name)),
        "{message}"
    );

    // Deleting the failed jobs deletes neither pool; the first job's pool is its own.
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    for job in ["byhand", "second"] {
        jobs.delete(job, &DeleteParams::default()).await.unwrap();
    }
    eventually(Duration::from_secs(30), "the failed jobs gone", || async {
        jobs.get_opt("byhand").await.unwrap().is_none()
            && jobs.get_opt("second").await.unwrap().is_none()
    })
    .await;
    assert_eq!((s.aks.deletes("teampool"), s.aks.deletes("shared")), (0, 0));
    assert_eq!(
        s.aks.pools().get("teampool").map(String::as_str),
        Some("Succeeded")
    );
    assert_eq!(
        status(&client, &ns.name, "first").await["phase"],
        "Running",
        "the pool's own job runs on"
    );
    jobs.delete("first", &DeleteParams::default())
        .await
        .unwrap();
    eventually(
        Duration::from_secs(60),
        "the first job's pool given back",
        || async { !s.aks.pools().contains_key("shared") },
    )
    .await;
    assert_eq!(s.aks.deletes("shared"), 1);
}

/// The notes of the Warning Events of `reason` about `job`.
async fn warnings(client: &Client, ns: &str, job: &str, reason: &str) -> Vec<String> {
    common::warnings_for(client, ns, job, reason)
        .await
        .into_iter()
        .filter_map(|e| e.note)
        .collect()
}

#[tokio::test]
async fn a_deleted_jobs_pool_that_azure_will_not_delete_or_no_one_can_is_a_warning() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "pool-undeleted").await;
    let Setup {
        aks,
        operator,
        token: _,
        _token_file: token_file,
    } = setup(&client, &ns.name, Duration::from_secs(1)).await;
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    let running = |name: &'static str| gpu_job(name, |spec| spec["launcher"] = json!({}));

    // Azure refuses the deletion twice (the identity lost its role, then got it back): the
    // job stays, says why, and goes once the pool is deleted.
    apply(&client, &running("refused"), &ns.name, false)
        .await
        .unwrap();
    let st = wait_phase(&client, &ns.name, "refused", "Running", 60).await;
    let pool = st["nodePool"]["name"].as_str().unwrap().to_string();
    aks.fail_next_deletes(
        2,
        ArmFailure {
            status: 403,
            code: "AuthorizationFailed".into(),
            message: "The client does not have authorization to perform action 'Microsoft.ContainerService/managedClusters/agentPools/delete'.".into(),
        },
    );
    jobs.delete("refused", &DeleteParams::default())
        .await
        .unwrap();
    eventually(
        Duration::from_secs(20),
        "a NodePoolDeleteFailed Warning",
        || async {
            warnings(&client, &ns.name, "refused", "NodePoolDeleteFailed")
                .await
                .iter()
                .any(|n| {
                    n.contains(&format!("deleting agent pool {pool}"))
                        && n.contains("AuthorizationFailed")
                })
        },
    )
    .await;
    assert!(
        jobs.get_opt("refused").await.unwrap().is_some(),
        "held by its finalizer"
    );
    eventually(
        Duration::from_secs(60),
        "the pool deleted and the job gone",
        || async {
            !aks.pools().contains_key(&pool) && jobs.get_opt("refused").await.unwrap().is_none()
        },
    )
    .await;
    assert_eq!(aks.deletes(&pool), 1);

    // The operator comes back without its AKS settings: it cannot delete the pool, lets the
    // job go, and warns that the pool may be left in Azure.
    apply(&client, &running("orphan"), &ns.name, false)
        .await
        .unwrap();
    let st = wait_phase(&client, &ns.name, "orphan", "Running", 60).await;
    let pool = st["nodePool"]["name"].as_str().unwrap().to_string();
    operator.kill();
    let _without_aks = Operator::start_with(
        &client,
        &ns.name,
        OperatorConfig {
            restart_backoff: Duration::from_millis(500),
            ..OperatorConfig::default()
        },
    )
    .await;
    jobs.delete("orphan", &DeleteParams::default())
        .await
        .unwrap();
    eventually(
        Duration::from_secs(20),
        "the job gone with a NodePoolLeftBehind Warning",
        || async {
            jobs.get_opt("orphan").await.unwrap().is_none()
                && warnings(&client, &ns.name, "orphan", "NodePoolLeftBehind")
                    .await
                    .iter()
                    .any(|n| n.contains(&format!("agent pool {pool} was not deleted")))
        },
    )
    .await;
    assert_eq!(
        aks.pools().get(&pool).map(String::as_str),
        Some("Succeeded")
    );
    drop(token_file);
}

#[tokio::test]
async fn a_restart_while_creating_makes_one_pool_and_a_deleted_job_gives_it_back() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "pool-restart").await;
    let token_file = {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(b"restart-test-token").unwrap();
        f
    };
    let aks = SimulatedAks::start(
        client.clone(),
        "restart-test-token",
        API_VERSION,
        Duration::from_secs(6),
        Duration::from_millis(500),
    )
    .await
    .unwrap();
    let operator = start_operator(&client, &ns.name, &aks, token_file.path()).await;
    // Long-running so it is still running when deleted.
    apply(
        &client,
        &gpu_job("long", |s| {
            s["launcher"] = json!({});
        }),
        &ns.name,
        false,
    )
    .await
    .unwrap();
    let st = wait_phase(&client, &ns.name, "long", "ProvisioningNodes", 30).await;
    let pool = st["nodePool"]["name"].as_str().unwrap().to_string();
    assert_eq!(aks.pools().get(&pool).map(String::as_str), Some("Creating"));

    // Crash and come back while Azure is still making the pool.
    operator.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let operator = start_operator(&client, &ns.name, &aks, token_file.path()).await;
    wait_phase(&client, &ns.name, "long", "Running", 90).await;
    assert_eq!(aks.puts(&pool), 1, "no second PUT after the restart");
    assert_eq!(aks.pools().len(), 1);

    // Deleted while running: the finalizer holds the job until the pool is gone.
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    jobs.delete("long", &DeleteParams::default()).await.unwrap();
    eventually(
        Duration::from_secs(60),
        "the pool deleted and the job gone",
        || async { aks.pools().is_empty() && jobs.get_opt("long").await.unwrap().is_none() },
    )
    .await;
    assert_eq!(aks.deletes(&pool), 1);
    assert!(pool_nodes(&client, &pool).await.is_empty());

    // Deleted while the pool is still being made.
    apply(&client, &gpu_job("early", |_| {}), &ns.name, false)
        .await
        .unwrap();
    let st = wait_phase(&client, &ns.name, "early", "ProvisioningNodes", 30).await;
    let early_pool = st["nodePool"]["name"].as_str().unwrap().to_string();
    eventually(Duration::from_secs(10), "the PUT", || async {
        aks.puts(&early_pool) == 1
    })
    .await;
    jobs.delete("early", &DeleteParams::default())
        .await
        .unwrap();
    eventually(
        Duration::from_secs(60),
        "the creating pool deleted, the finalizer released",
        || async {
            !aks.pools().contains_key(&early_pool) && jobs.get_opt("early").await.unwrap().is_none()
        },
    )
    .await;
    assert!(pool_nodes(&client, &early_pool).await.is_empty());
    drop(operator);
}

#[tokio::test]
async fn two_jobs_in_two_namespaces_racing_for_one_pool_name_leave_each_others_pool_alone() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns_a = TestNamespace::new(&client, "pool-race-a").await;
    let ns_b = TestNamespace::new(&client, "pool-race-b").await;
    logs();
    let token = "race-test-token";
    let token_file = {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(token.as_bytes()).unwrap();
        f
    };
    let aks = SimulatedAks::start(
        client.clone(),
        token,
        API_VERSION,
        Duration::from_secs(2),
        Duration::from_millis(500),
    )
    .await
    .unwrap();
    // One operator per namespace (as two installs scoped to their namespaces), one Azure.
    let _operator_a = start_operator(&client, &ns_a.name, &aks, token_file.path()).await;
    let _operator_b = start_operator(&client, &ns_b.name, &aks, token_file.path()).await;
    let pool = "racepool";
    let job = |name: &str| {
        gpu_job(name, |spec| {
            spec["nodePool"]["poolName"] = json!(pool);
            spec["launcher"] = json!({});
        })
    };
    let (alpha, beta) = (job("alpha"), job("beta"));
    let (a, b) = tokio::join!(
        apply(&client, &alpha, &ns_a.name, false),
        apply(&client, &beta, &ns_b.name, false),
    );
    a.unwrap();
    b.unwrap();

    // One job runs in the pool; the other fails, naming whose the pool is.
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    let phases = loop {
        let phases = (
            status(&client, &ns_a.name, "alpha").await["phase"].clone(),
            status(&client, &ns_b.name, "beta").await["phase"].clone(),
        );
        if matches!(
            (phases.0.as_str(), phases.1.as_str()),
            (Some("Running"), Some("Failed")) | (Some("Failed"), Some("Running"))
        ) {
            break phases;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never one Running and one Failed: {phases:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let ((winner_ns, winner), (loser_ns, loser)) = if phases.0 == "Running" {
        ((&ns_a.name, "alpha"), (&ns_b.name, "beta"))
    } else {
        ((&ns_b.name, "beta"), (&ns_a.name, "alpha"))
    };
    let st = status(&client, loser_ns, loser).await;
    let failed = condition(&st, "Failed");
    assert_eq!(failed["reason"], "NodePoolFailed");
    let message = failed["message"].as_str().unwrap();
    assert!(
        message.contains(&format!(
            "agent pool {pool} exists and is not this job's (TrainingJob {winner_ns}.{winner} made it)"
        )),
        "{message}"
    );
    assert!(pods(&client, loser_ns, loser).await.is_empty());

    // The pool is the winner's: its tags, its two nodes, one create.
    let winners: Api<TrainingJob> = Api::namespaced(client.clone(), winner_ns);
    let winner_uid = winners.get(winner).await.unwrap().uid().unwrap();
    let made = aks.pool(pool).expect("the pool");
    assert_eq!(
        made.tags.get("ringmaster.dev-job-uid"),
        Some(&winner_uid),
        "{:?}",
        made.tags
    );
    assert_eq!((made.state.as_str(), made.count), ("Succeeded", 2));
    assert_eq!(aks.puts(pool), 1, "one create, never overwritten");
    assert_eq!(pool_nodes(&client, pool).await.len(), 2);

    // Deleting the job that lost deletes nothing of the winner's.
    let losers: Api<TrainingJob> = Api::namespaced(client.clone(), loser_ns);
    losers
        .delete(loser, &DeleteParams::default())
        .await
        .unwrap();
    eventually(Duration::from_secs(30), "the losing job gone", || async {
        losers.get_opt(loser).await.unwrap().is_none()
    })
    .await;
    assert_eq!(aks.deletes(pool), 0);
    assert_eq!(aks.pool(pool), Some(made), "the pool as it was");
    assert_eq!(pool_nodes(&client, pool).await.len(), 2);
    assert_eq!(status(&client, winner_ns, winner).await["phase"], "Running");

    // The winner's own deletion gives the pool back.
    winners
        .delete(winner, &DeleteParams::default())
        .await
        .unwrap();
    eventually(
        Duration::from_secs(60),
        "the winner's pool given back",
        || async { !aks.pools().contains_key(pool) && pool_nodes(&client, pool).await.is_empty() },
    )
    .await;
    assert_eq!(aks.deletes(pool), 1);
}

/// A job force-removed (its finalizer taken off by hand, as `kubectl patch` would) while the
/// operator was down leaves its pool: nothing would ever delete it. The next operator's
/// sweep at start finds the pool tagged with a job that is gone and deletes it; a running
/// job's pool beside it stays.
#[tokio::test]
async fn a_pool_whose_job_was_force_removed_is_swept_when_the_operator_starts() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "pool-sweep").await;
    let token = "sweep-test-token";
    let token_file = {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(token.as_bytes()).unwrap();
        f
    };
    let aks = SimulatedAks::start(
        client.clone(),
        token,
        API_VERSION,
        Duration::from_secs(1),
        Duration::from_millis(500),
    )
    .await
    .unwrap();
    let operator = start_operator(&client, &ns.name, &aks, token_file.path()).await;
    for name in ["kept", "removed"] {
        apply(
            &client,
            &gpu_job(name, |s| s["launcher"] = json!({})),
            &ns.name,
            false,
        )
        .await
        .unwrap();
    }
    let kept = wait_phase(&client, &ns.name, "kept", "Running", 90).await["nodePool"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    let removed = wait_phase(&client, &ns.name, "removed", "Running", 90).await["nodePool"]["name"]
        .as_str()
        .unwrap()
        .to_string();

    // The operator is down; the job is removed by force, its finalizer taken off.
    operator.kill();
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    jobs.patch(
        "removed",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    jobs.delete("removed", &DeleteParams::default())
        .await
        .unwrap();
    eventually(Duration::from_secs(30), "the job gone", || async {
        jobs.get_opt("removed").await.unwrap().is_none()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(aks.pools().contains_key(&removed), "left behind, for now");
    assert_eq!(aks.deletes(&removed), 0);

    // The next operator sweeps at start.
    let _operator = start_operator(&client, &ns.name, &aks, token_file.path()).await;
    eventually(
        Duration::from_secs(60),
        "the orphaned pool deleted",
        || async { !aks.pools().contains_key(&removed) },
    )
    .await;
    assert_eq!(aks.deletes(&removed), 1);
    assert_eq!(aks.deletes(&kept), 0, "the running job's pool stays");
    assert!(aks.pools().contains_key(&kept));
    assert_eq!(status(&client, &ns.name, "kept").await["phase"], "Running");
}

#[tokio::test]
async fn invalid_vm_size_or_pool_name_is_refused_by_the_api_server() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "pool-invalid").await;
    for (edit, field) in [
        (
            json!({"provisioner": "aks", "vmSize": "ND96asr_v4"}),
            "spec.nodePool.vmSize",
        ),
        (
            json!({"provisioner": "aks", "vmSize": "Standard_ND96asr_v4", "poolName": "Bad-Name"}),
            "spec.nodePool.poolName",
        ),
        (
            json!({"provisioner": "aks", "vmSize": "Standard_ND96asr_v4", "poolName": "waytoolongpoolname"}),
            "spec.nodePool.poolName",
        ),
    ] {
        let job = gpu_job("bad", |s| s["nodePool"] = edit.clone());
        let err = apply(&client, &job, &ns.name, true).await.unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, kube::Error::Api(ref s) if s.code == 422),
            "{text}"
        );
        assert!(text.contains(field), "{field} not named in: {text}");
    }
}
