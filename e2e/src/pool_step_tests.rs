//! The node-pool step of the TrainingJob controller against the simulated AKS, in-process and
//! without a cluster: where the ARM token may go, and two jobs racing for one pool name.
//! (`e2e/tests/node_pool.rs` runs the whole operator against it on the local cluster.)

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::Client;
use ringmaster::aks::{ArmClient, ArmConfig, ArmError, TokenSource, arm::API_VERSION};
use ringmaster::api::NodePoolStatus;
use ringmaster::controller::training_job::pool::{
    JOB_UID_TAG, PoolSeen, Release, after_create, decide, release_pool, step,
};
use ringmaster::controller::training_job::state::PoolState;
use ringmaster::controller::training_job::validate::{ValidatedTrainingJob, validate_value};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::simulated_aks::{ArmFailure, SimulatedAks};

const TOKEN: &str = "pool-step-test-token";

/// A 2-worker job of 8 GPUs each in its own Standard_ND96asr_v4 pool.
fn job(namespace: &str, name: &str, uid: &str, pool_name: Option<&str>) -> ValidatedTrainingJob {
    let mut node_pool = json!({"provisioner": "aks", "vmSize": "Standard_ND96asr_v4"});
    if let Some(pool_name) = pool_name {
        node_pool["poolName"] = json!(pool_name);
    }
    let object = json!({
        "apiVersion": "ringmaster.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": namespace, "uid": uid},
        "spec": {
            "workers": 2,
            "gpusPerWorker": 8,
            "image": "ringmaster-trainer:e2e",
            "command": ["true"],
            "nodePool": node_pool,
        }
    });
    validate_value(&object, None).expect("a valid job")
}

fn pool_name(job: &ValidatedTrainingJob) -> String {
    job.node_pool.as_ref().unwrap().pool_name.clone().unwrap()
}

/// The simulated AKS without a cluster: pools take `create_ms` to be made and `delete_ms`
/// to go.
async fn simulated_aks(create_ms: u64, delete_ms: u64) -> SimulatedAks {
    SimulatedAks::start_without_cluster(
        TOKEN,
        API_VERSION,
        Duration::from_millis(create_ms),
        Duration::from_millis(delete_ms),
    )
    .await
    .unwrap()
}

/// An ARM client for the simulated AKS, with the token in a file.
fn arm_client(aks: &SimulatedAks) -> (ArmClient, tempfile::NamedTempFile) {
    let mut token_file = tempfile::NamedTempFile::new().unwrap();
    token_file.write_all(TOKEN.as_bytes()).unwrap();
    let arm = ArmClient::new(
        ArmConfig {
            endpoint: aks.endpoint(),
            subscription: "00000000-0000-0000-0000-000000000000".into(),
            resource_group: "rg-ml".into(),
            cluster: "aks-gpu".into(),
        },
        TokenSource::File(token_file.path().to_path_buf()),
    )
    .unwrap();
    (arm, token_file)
}

/// A client of no API server: the step only lists nodes for a Succeeded pool whose gang
/// does not exist, which these tests never ask of it (they pass `gang_exists`).
fn no_api_server() -> Client {
    Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap())).unwrap()
}

async fn wait_for_state(aks: &SimulatedAks, pool: &str, state: &str) {
    for _ in 0..200 {
        if aks.pool(pool).is_some_and(|p| p.state == state) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("pool {pool} never {state}: {:?}", aks.pool(pool));
}

/// A TCP listener on loopback that records the first bytes of every connection made to it
/// (and answers an empty JSON object, as an operation endpoint would).
struct Listener {
    port: u16,
    seen: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Listener {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let mut buffer = vec![0u8; 4096];
                let n = socket.read(&mut buffer).await.unwrap_or(0);
                let text = String::from_utf8_lossy(&buffer[..n]).to_string();
                // The request line, and whether a token came with it (not the token).
                let line = text.lines().next().unwrap_or("(connected)").to_string();
                let bearer = text.to_ascii_lowercase().contains("authorization: bearer");
                record
                    .lock()
                    .unwrap()
                    .push(format!("{line} (bearer: {bearer})"));
                let _ = socket
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 22\r\nconnection: close\r\n\r\n{\"status\":\"Succeeded\"}")
                    .await;
            }
        });
        Self { port, seen, task }
    }

    fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test]
async fn an_operation_url_in_the_status_off_arms_origin_is_never_requested() {
    let aks = simulated_aks(100, 100).await;
    let (arm, _token_file) = arm_client(&aks);
    let client = no_api_server();
    let listener = Listener::start().await;
    let job = job(
        "ml",
        "tampered",
        "6f1c2d3e-0000-4000-8000-00000000abcd",
        None,
    );
    let name = pool_name(&job);

    // The pool is made, and fails while being made: its operation holds Azure's reason.
    aks.fail_next_async(ArmFailure {
        status: 200,
        code: "AllocationFailed".into(),
        message: "no capacity for Standard_ND96asr_v4".into(),
    });
    let look = step(&client, &arm, &job, &NodePoolStatus::default(), true)
        .await
        .unwrap();
    let made = look.status.unwrap();
    let genuine = made.operation.clone().expect("the operation of the create");
    assert!(genuine.starts_with(&aks.endpoint()), "{genuine}");
    wait_for_state(&aks, &name, "Failed").await;

    // Someone who may write the job's status points the operation at their own listener.
    let (port, arm_addr) = (listener.port, aks.addr);
    let tampered = [
        format!("http://127.0.0.1:{port}/operations/op1?api-version={API_VERSION}"),
        format!("http://127.0.0.1:{port}"),
        format!("http://localhost:{port}/operations/op1"),
        format!("https://127.0.0.1:{port}/operations/op1"),
        format!("http://{arm_addr}@127.0.0.1:{port}/operations/op1"),
        format!("http://{arm_addr}:x@127.0.0.1:{port}/operations/op1"),
        format!("//127.0.0.1:{port}/operations/op1"),
    ];
    for url in &tampered {
        let old = NodePoolStatus {
            operation: Some(url.clone()),
            ..made.clone()
        };
        let look = step(&client, &arm, &job, &old, true).await.unwrap();
        assert_eq!(listener.seen(), Vec::<String>::new(), "{url} was requested");
        match &look.state {
            PoolState::Failed { message } => assert!(
                message.contains(&format!("agent pool {name} failed"))
                    && message.contains("was not read"),
                "{url}: {message}"
            ),
            other => panic!("{url}: {other:?}"),
        }
        let status = look.status.unwrap();
        assert_eq!(status.operation, None, "{url} dropped from the status");
        let warning = look.warning.unwrap_or_default();
        assert!(
            warning.contains(url.as_str()) && warning.contains("not requested"),
            "{url}: a Warning says so: {warning}"
        );
    }

    // The operation ARM named is followed: its reason is read.
    let old = NodePoolStatus {
        operation: Some(genuine),
        ..made
    };
    let look = step(&client, &arm, &job, &old, true).await.unwrap();
    match look.state {
        PoolState::Failed { message } => assert!(
            message.contains("AllocationFailed: no capacity for Standard_ND96asr_v4"),
            "{message}"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(look.warning, None);
    assert!(listener.seen().is_empty());
}

/// Steps `job` until its pool is Ready (or Failed); the last look's state and status.
async fn step_until_settled(
    client: &Client,
    arm: &ArmClient,
    job: &ValidatedTrainingJob,
    mut status: NodePoolStatus,
) -> (PoolState, NodePoolStatus) {
    for _ in 0..200 {
        let look = step(client, arm, job, &status, true).await.unwrap();
        status = look.status.unwrap_or(status);
        if matches!(
            look.state,
            PoolState::Ready { .. } | PoolState::Failed { .. }
        ) {
            return (look.state, status);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{} never settled: {status:?}", job.name);
}

#[tokio::test]
async fn two_jobs_racing_for_one_pool_name_never_take_each_others_pool() {
    let aks = simulated_aks(200, 100).await;
    let (arm, _token_file) = arm_client(&aks);
    let client = no_api_server();
    let first_uid = "0a000000-0000-4000-8000-00000000000a";
    let second_uid = "0b000000-0000-4000-8000-00000000000b";
    let first = job("team-a", "first", first_uid, Some("shared"));
    let second = job("team-b", "second", second_uid, Some("shared"));
    let plan = second.node_pool.clone().unwrap();

    // The second job looks first and finds no pool; its PUT comes later (a slow reconcile).
    let stale = arm.get_pool("shared").await;
    assert!(matches!(stale, Ok(None)), "{stale:?}");

    // Meanwhile the first job makes the pool, and it succeeds.
    let (state, _) = step_until_settled(&client, &arm, &first, NodePoolStatus::default()).await;
    assert!(matches!(state, PoolState::Ready { .. }), "{state:?}");
    let made = aks.pool("shared").expect("the first job's pool");
    assert_eq!(
        made.tags.get(JOB_UID_TAG).map(String::as_str),
        Some(first_uid)
    );
    assert_eq!((made.state.as_str(), made.count), ("Succeeded", 2));

    // The second job's create, decided on what it saw: refused, the first's pool untouched.
    let seen = PoolSeen {
        pool: stale,
        ready_nodes: None,
        operation: None,
        ignored_operation: None,
    };
    let decision = decide(&second, &plan, "shared", &NodePoolStatus::default(), seen);
    let request = decision.create.expect("a create");
    let result = arm.create_pool("shared", &request).await;
    assert!(
        matches!(result, Err(ArmError::PreconditionFailed { .. })),
        "{result:?}"
    );
    let look = after_create(&second, &plan, "shared", decision.look, result);
    match &look.state {
        PoolState::Provisioning { message } => {
            assert!(
                message.contains("agent pool shared exists already"),
                "{message}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(aks.pool("shared").as_ref(), Some(&made), "not overwritten");
    assert_eq!(aks.preconditions_failed("shared"), 1);

    // Its next look: the pool is the first job's; the second fails, saying whose it is.
    let (state, status) = step_until_settled(&client, &arm, &second, look.status.unwrap()).await;
    match state {
        PoolState::Failed { message } => assert!(
            message.contains(
                "agent pool shared exists and is not this job's (TrainingJob team-a.first made it)"
            ),
            "{message}"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(status.name, "shared");

    // Deleting the second job gives nothing back: the pool is not its own.
    let released = release_pool(&arm, "team-b", "second", second_uid, "shared").await;
    assert_eq!(released, Release::NotOurs);
    assert_eq!(
        aks.pool("shared").as_ref(),
        Some(&made),
        "still the first's"
    );
    assert_eq!((aks.puts("shared"), aks.deletes("shared")), (1, 0));

    // The first job's deletion gives it back.
    let released = release_pool(&arm, "team-a", "first", first_uid, "shared").await;
    assert!(matches!(released, Release::Pending { .. }), "{released:?}");
    wait_for_state(&aks, "shared", "Deleting").await;
    for _ in 0..200 {
        if aks.pool("shared").is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(
        release_pool(&arm, "team-a", "first", first_uid, "shared").await,
        Release::Gone
    );
    assert_eq!(aks.deletes("shared"), 1);
}

#[tokio::test]
async fn two_jobs_asking_at_once_get_one_pool_and_one_reason() {
    let aks = simulated_aks(200, 100).await;
    let (arm, _token_file) = arm_client(&aks);
    let client = no_api_server();
    let a = job(
        "team-a",
        "a",
        "0a000000-0000-4000-8000-0000000000aa",
        Some("race"),
    );
    let b = job(
        "team-b",
        "b",
        "0b000000-0000-4000-8000-0000000000bb",
        Some("race"),
    );
    let (a_done, b_done) = tokio::join!(
        step_until_settled(&client, &arm, &a, NodePoolStatus::default()),
        step_until_settled(&client, &arm, &b, NodePoolStatus::default()),
    );
    let pool = aks.pool("race").expect("one pool");
    let owner = pool.tags.get(JOB_UID_TAG).cloned().unwrap_or_default();
    let ((winner, won), (loser, lost)) = if owner == a.uid {
        ((&a, a_done), (&b, b_done))
    } else {
        ((&b, b_done), (&a, a_done))
    };
    assert_eq!(owner, winner.uid, "the pool is one of the two jobs'");
    assert!(matches!(won.0, PoolState::Ready { .. }), "{:?}", won.0);
    match lost.0 {
        PoolState::Failed { message } => assert!(
            message.contains(&format!(
                "agent pool race exists and is not this job's (TrainingJob {}.{} made it)",
                winner.namespace, winner.name
            )),
            "{message}"
        ),
        other => panic!("{} of {}: {other:?}", loser.name, loser.namespace),
    }
    assert_eq!((pool.state.as_str(), pool.count), ("Succeeded", 2));
    assert_eq!(aks.puts("race"), 1, "one create, no overwrite");
    let released = release_pool(&arm, &loser.namespace, &loser.name, &loser.uid, "race").await;
    assert_eq!(released, Release::NotOurs);
    assert_eq!(aks.pool("race"), Some(pool));
    assert_eq!(aks.deletes("race"), 0);
}

/// The sweep for pools whose TrainingJob is gone, against the simulated AKS: of four pools
/// the jobs made (more than a page of ARM's list, so `nextLink` is followed), the one whose
/// job is gone and the one whose job was made anew under its name (another UID) are deleted;
/// the one whose job exists and the one whose job could not be looked up are kept; a pool
/// without Ringmaster's tags is never touched. A dry run deletes nothing and names the same
/// two.
#[tokio::test]
async fn the_sweep_deletes_the_pools_of_jobs_that_are_gone_and_nothing_else() {
    use ringmaster::controller::training_job::sweep::{JobSeen, SweepMode, sweep};
    let aks = simulated_aks(50, 50).await;
    let (arm, _token_file) = arm_client(&aks);
    let client = no_api_server();
    let jobs = [
        (
            "team-a",
            "alive",
            "0a000000-0000-4000-8000-00000000000a",
            "alivepool",
        ),
        (
            "team-a",
            "gone",
            "0b000000-0000-4000-8000-00000000000b",
            "gonepool",
        ),
        (
            "team-b",
            "remade",
            "0c000000-0000-4000-8000-00000000000c",
            "remadepool",
        ),
        (
            "team-b",
            "unknown",
            "0d000000-0000-4000-8000-00000000000d",
            "unknownpool",
        ),
    ];
    for (namespace, name, uid, pool) in jobs {
        let job = job(namespace, name, uid, Some(pool));
        let (state, _) = step_until_settled(&client, &arm, &job, NodePoolStatus::default()).await;
        assert!(matches!(state, PoolState::Ready { .. }), "{state:?}");
    }
    // A pool someone made by hand, without Ringmaster's tags.
    let plan = job(
        "team-c",
        "hand",
        "0e000000-0000-4000-8000-00000000000e",
        Some("handpool"),
    )
    .node_pool
    .clone()
    .unwrap();
    let seen = PoolSeen {
        pool: Ok(None),
        ready_nodes: None,
        operation: None,
        ignored_operation: None,
    };
    let hand = job(
        "team-c",
        "hand",
        "0e000000-0000-4000-8000-00000000000e",
        Some("handpool"),
    );
    let mut request = decide(&hand, &plan, "handpool", &NodePoolStatus::default(), seen)
        .create
        .expect("a create");
    request.tags.clear();
    arm.create_pool("handpool", &request).await.unwrap();
    wait_for_state(&aks, "handpool", "Succeeded").await;

    let look = |namespace: String, name: String| async move {
        match (namespace.as_str(), name.as_str()) {
            ("team-a", "alive") => JobSeen::Exists {
                uid: "0a000000-0000-4000-8000-00000000000a".into(),
            },
            ("team-b", "remade") => JobSeen::Exists {
                uid: "0f000000-0000-4000-8000-00000000000f".into(),
            },
            ("team-b", "unknown") => JobSeen::Unknown("the API server did not answer".into()),
            _ => JobSeen::Gone,
        }
    };

    let dry = sweep(&arm, SweepMode::DryRun, look).await.unwrap();
    let mut named = dry.would_delete.clone();
    named.sort();
    assert_eq!(named, ["gonepool", "remadepool"]);
    assert!(dry.deleted.is_empty());
    assert_eq!(aks.pools().len(), 5, "a dry run deletes nothing");
    assert_eq!(aks.deletes("gonepool"), 0);

    let swept = sweep(&arm, SweepMode::Delete, look).await.unwrap();
    let mut deleted = swept.deleted.clone();
    deleted.sort();
    assert_eq!(deleted, ["gonepool", "remadepool"]);
    assert_eq!((swept.kept, swept.problems.len()), (2, 0));
    for gone in ["gonepool", "remadepool"] {
        assert_eq!(aks.deletes(gone), 1, "{gone}");
    }
    for kept in ["alivepool", "unknownpool", "handpool"] {
        assert_eq!(aks.deletes(kept), 0, "{kept}");
        assert!(aks.pool(kept).is_some(), "{kept}");
    }
    // Once they are gone, a sweep finds nothing more to do.
    for _ in 0..200 {
        if !aks.pools().contains_key("gonepool") && !aks.pools().contains_key("remadepool") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let again = sweep(&arm, SweepMode::Delete, look).await.unwrap();
    assert!(again.deleted.is_empty(), "{again:?}");
    assert_eq!(again.kept, 2);
}

/// An ARM that hangs does not hold a reconcile worker past the request timeout, and does
/// not fail the job: the look that timed out is a transient "looking again" (the pool's
/// state unknown for a moment), and the next look finds the pool Ready.
#[tokio::test]
async fn a_hung_arm_read_times_out_as_a_transient_look_and_the_next_look_goes_on() {
    let aks = simulated_aks(50, 50).await;
    let (arm, _token_file) = arm_client(&aks);
    let arm = arm.with_request_timeout(Duration::from_millis(500));
    let client = no_api_server();
    let job = job(
        "team-a",
        "hung",
        "0a000000-0000-4000-8000-0000000000aa",
        Some("hungpool"),
    );
    let (state, status) = step_until_settled(&client, &arm, &job, NodePoolStatus::default()).await;
    assert!(matches!(state, PoolState::Ready { .. }), "{state:?}");

    aks.hang_next_reads(1, Duration::from_secs(30));
    let started = std::time::Instant::now();
    let look = step(&client, &arm, &job, &status, true).await.unwrap();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(5), "held for {took:?}");
    match &look.state {
        PoolState::Provisioning { message } => {
            assert!(message.contains("agent pool hungpool"), "{message}")
        }
        other => panic!("a transient look, not {other:?}"),
    }
    assert!(look.requeue.is_some());
    let again = step(&client, &arm, &job, &look.status.unwrap_or(status), true)
        .await
        .unwrap();
    assert!(
        matches!(again.state, PoolState::Ready { .. }),
        "{:?}",
        again.state
    );
}

/// A ready pool for a job that trains: the looks below are of a running gang's pool.
async fn ready_pool(
    aks: &SimulatedAks,
    arm: &ArmClient,
    name: &str,
    uid: &str,
    pool: &str,
) -> (ValidatedTrainingJob, NodePoolStatus) {
    let job = job("team-a", name, uid, Some(pool));
    let (state, status) =
        step_until_settled(&no_api_server(), arm, &job, NodePoolStatus::default()).await;
    assert!(matches!(state, PoolState::Ready { .. }), "{state:?}");
    assert!(aks.pool(pool).is_some());
    (job, status)
}

fn failure(status: u16, code: &str, message: &str) -> ArmFailure {
    ArmFailure {
        status,
        code: code.into(),
        message: message.into(),
    }
}

/// Bursts of ARM's 500s and of 401s (an expired token) are looks that did not work, not a
/// verdict on the job: its pool stays, the job is told "looking again", and the first look
/// after the burst finds the pool as it was. (Before: a 401 was a refusal that failed the
/// job with "InvalidAuthenticationToken".)
#[tokio::test]
async fn bursts_of_500s_and_401s_are_transient_and_fail_nothing() {
    let aks = simulated_aks(50, 50).await;
    let (arm, _token_file) = arm_client(&aks);
    let client = no_api_server();
    let uid = "0b000000-0000-4000-8000-0000000000bb";
    let (job, status) = ready_pool(&aks, &arm, "bursty", uid, "burstpool").await;
    for fault in [
        failure(500, "InternalServerError", "An internal error occurred."),
        failure(503, "ServiceUnavailable", "The service is unavailable."),
        failure(
            401,
            "ExpiredAuthenticationToken",
            "The access token expiry UTC time is earlier than current UTC time.",
        ),
    ] {
        aks.fail_next_requests(3, fault.clone());
        for _ in 0..3 {
            let look = step(&client, &arm, &job, &status, true).await.unwrap();
            match &look.state {
                PoolState::Provisioning { message } => {
                    assert!(message.contains(&fault.code), "{message}")
                }
                other => panic!(
                    "a {} burst is a transient look, not {other:?}",
                    fault.status
                ),
            }
            assert!(look.requeue.is_some_and(|r| r <= Duration::from_secs(15)));
        }
        let after = step(&client, &arm, &job, &status, true).await.unwrap();
        assert!(
            matches!(after.state, PoolState::Ready { .. }),
            "after the {} burst: {:?}",
            fault.status,
            after.state
        );
    }
    assert_eq!(aks.deletes("burstpool"), 0, "nothing was given back");
    assert_eq!(aks.puts("burstpool"), 1, "nor made twice");

    // A burst while the pool is being made: the create is not lost or doubled.
    let job = job_made_during_a_burst(&aks, &arm).await;
    assert_eq!(aks.puts(&pool_name(&job)), 1);
}

async fn job_made_during_a_burst(aks: &SimulatedAks, arm: &ArmClient) -> ValidatedTrainingJob {
    let job = job(
        "team-a",
        "madeinburst",
        "0c000000-0000-4000-8000-0000000000cc",
        Some("burstmade"),
    );
    aks.fail_next_requests(2, failure(500, "InternalServerError", "try again"));
    let client = no_api_server();
    let look = step(&client, arm, &job, &NodePoolStatus::default(), false)
        .await
        .unwrap();
    assert!(
        matches!(look.state, PoolState::Provisioning { .. }),
        "{:?}",
        look.state
    );
    let (state, _) = step_until_settled(&client, arm, &job, look.status.unwrap_or_default()).await;
    assert!(matches!(state, PoolState::Ready { .. }), "{state:?}");
    job
}

/// ARM throttles the subscription, not one job: after one job meets a 429, the other jobs'
/// looks are held back by the operator until its Retry-After has passed (no request
/// reaches ARM meanwhile), each told when it looks again, and none fails.
#[tokio::test]
async fn a_429_holds_back_every_jobs_arm_calls_until_its_retry_after() {
    let aks = simulated_aks(50, 50).await;
    let (arm, _token_file) = arm_client(&aks);
    let client = no_api_server();
    let (first, first_status) = ready_pool(
        &aks,
        &arm,
        "first",
        "0d000000-0000-4000-8000-0000000000dd",
        "firstpool",
    )
    .await;
    let (second, second_status) = ready_pool(
        &aks,
        &arm,
        "second",
        "0e000000-0000-4000-8000-0000000000ee",
        "secondpool",
    )
    .await;

    aks.throttle_next(1);
    let throttled = step(&client, &arm, &first, &first_status, true)
        .await
        .unwrap();
    assert!(
        matches!(&throttled.state, PoolState::Provisioning { message } if message.contains("429")),
        "{:?}",
        throttled.state
    );
    let reached = aks.requests();
    let held = step(&client, &arm, &second, &second_status, true)
        .await
        .unwrap();
    match &held.state {
        PoolState::Provisioning { message } => {
            assert!(message.contains("asked the operator to pause"), "{message}")
        }
        other => panic!("held back, not {other:?}"),
    }
    assert!(held.requeue.is_some_and(|r| r <= Duration::from_secs(1)));
    assert_eq!(
        aks.requests(),
        reached,
        "no request went to ARM while it asked for a pause"
    );

    tokio::time::sleep(Duration::from_millis(1100)).await;
    for (job, status) in [(&first, &first_status), (&second, &second_status)] {
        let look = step(&client, &arm, job, status, true).await.unwrap();
        assert!(
            matches!(look.state, PoolState::Ready { .. }),
            "{:?}",
            look.state
        );
    }
}

/// Many jobs looking at once stay within the operator's own ARM budget: the requests that
/// reach ARM are at most the burst plus the refill, the rest are handed back at once as
/// "looking again" (no reconcile worker waits past a second), and no job fails.
#[tokio::test]
async fn many_jobs_at_once_stay_within_the_operators_arm_budget() {
    let aks = simulated_aks(50, 50).await;
    let (arm, _token_file) = arm_client(&aks);
    let per_second = std::num::NonZeroU32::new(5).unwrap();
    let arm = arm.with_limit(ringmaster::aks::ArmLimit::new(per_second));
    let client = no_api_server();
    let jobs: Vec<ValidatedTrainingJob> = (0..40)
        .map(|i| {
            job(
                "team-a",
                &format!("many{i}"),
                &format!("0f000000-0000-4000-8000-{i:012}"),
                Some(&format!("many{i}")),
            )
        })
        .collect();
    let fresh = NodePoolStatus::default();
    let started = std::time::Instant::now();
    let looks = futures::future::join_all(
        jobs.iter()
            .map(|job| step(&client, &arm, job, &fresh, false)),
    )
    .await;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(3), "a look waited {took:?}");
    // Burst 10, refill 5/s over at most ~1.5 s: never all 40.
    let reached = aks.requests();
    assert!(
        reached <= 10 + 5 * 2 + 2,
        "{reached} requests reached ARM at once"
    );
    let mut held = 0;
    for look in looks {
        let look = look.unwrap();
        match &look.state {
            PoolState::Provisioning { message } if message.contains("at their limit") => {
                held += 1;
                assert!(look.requeue.is_some_and(|r| r >= Duration::from_secs(1)));
            }
            PoolState::Provisioning { .. } | PoolState::NotNeeded => {}
            other => panic!("no job fails for the operator's own budget: {other:?}"),
        }
    }
    assert!(held >= 20, "{held} of 40 held back");
}
