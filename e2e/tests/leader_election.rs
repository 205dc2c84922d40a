//! Two operator replicas with leader election on one Lease: only the leader reconciles;
//! when it dies (its tasks dropped, the Lease not released) the other takes over within
//! the Lease's duration.

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use common::{TestNamespace, apply, client, ensure_crds, eventually};
use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, Client};
use ringmaster::api::TrainingJob;
use ringmaster::controller::{self, Context, OperatorConfig, Scope};
use ringmaster::leader::{self, Election};
use ringmaster::metrics::Metrics;
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// Short, so the takeover is quick to wait for; long enough that the leader's renewal, due a
/// third of it (3 s) before expiry, is never late on a loaded machine (at 4 s it had 1 s, and a
/// late renewal would hand the Lease to the follower while the leader lives).
const LEASE_SECONDS: u64 = 9;

struct Replica {
    metrics: Metrics,
    task: tokio::task::JoinHandle<Result<(), leader::LeaderError>>,
}

fn replica(client: &Client, ns: &str, identity: &str) -> Replica {
    let metrics = Metrics::new();
    let ctx = Arc::new(Context::new(
        client.clone(),
        metrics.clone(),
        Some(identity.into()),
        OperatorConfig::default(),
    ));
    let election = Election {
        namespace: ns.into(),
        lease: "ringmaster-leader".into(),
        identity: identity.into(),
        duration: Duration::from_secs(LEASE_SECONDS),
    };
    let scope = Scope {
        namespace: Some(ns.into()),
    };
    let task = tokio::spawn(leader::run(
        client.clone(),
        election,
        CancellationToken::new(),
        move |stop| controller::run(ctx, scope, Arc::new(AtomicBool::new(false)), stop),
    ));
    Replica { metrics, task }
}

fn reconciles(metrics: &Metrics) -> u64 {
    metrics
        .render()
        .lines()
        .filter(|l| l.starts_with("ringmaster_reconcile_duration_seconds_count"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

async fn holder(client: &Client, ns: &str) -> Option<String> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    leases
        .get_opt("ringmaster-leader")
        .await
        .unwrap()
        .and_then(|l| l.spec?.holder_identity)
}

fn job(name: &str) -> serde_json::Value {
    json!({
        "apiVersion": "ringmaster.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {"workers": 1, "image": "ringmaster-trainer:e2e", "trainer": {"model": "resnet18", "steps": 5}},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leader_reconciles_and_the_other_takes_over_when_it_dies() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "leader").await;
    let a = replica(&client, &ns.name, "replica-a");
    eventually(Duration::from_secs(20), "replica-a leads", || async {
        holder(&client, &ns.name).await.as_deref() == Some("replica-a")
    })
    .await;
    let b = replica(&client, &ns.name, "replica-b");

    apply(&client, &job("first"), &ns.name, false)
        .await
        .unwrap();
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    eventually(Duration::from_secs(30), "the leader reconciles", || async {
        jobs.get("first").await.unwrap().status.is_some()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(reconciles(&a.metrics) > 0);
    assert_eq!(reconciles(&b.metrics), 0, "the follower reconciled");
    assert_eq!(
        holder(&client, &ns.name).await.as_deref(),
        Some("replica-a")
    );

    // The leader dies without releasing the Lease.
    a.task.abort();
    let died = Instant::now();
    eventually(
        Duration::from_secs(LEASE_SECONDS * 3),
        "replica-b takes over",
        || async { holder(&client, &ns.name).await.as_deref() == Some("replica-b") },
    )
    .await;
    let took = died.elapsed();
    apply(&client, &job("second"), &ns.name, false)
        .await
        .unwrap();
    eventually(
        Duration::from_secs(30),
        "the new leader reconciles",
        || async { jobs.get("second").await.unwrap().status.is_some() },
    )
    .await;
    // The status is written inside the reconcile; its count only once that returns.
    eventually(
        Duration::from_secs(10),
        "replica-b counts its reconcile",
        || async { reconciles(&b.metrics) > 0 },
    )
    .await;
    println!(
        "takeover after {:.1} s (lease {LEASE_SECONDS} s)",
        took.as_secs_f64()
    );
    assert!(
        took < Duration::from_secs(LEASE_SECONDS * 2 + 2),
        "took {took:?}"
    );
    b.task.abort();
}

/// A TCP relay to the API server that the test can pause: while paused it moves no byte in
/// either direction (requests in flight wait in it, as on a partitioned network), and on
/// resume delivers what was held.
struct PausableRelay {
    port: u16,
    paused: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl PausableRelay {
    async fn start(upstream: std::net::SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let paused = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let held = paused.clone();
        let task = tokio::spawn(async move {
            while let Ok((downstream, _)) = listener.accept().await {
                let Ok(upstream) = tokio::net::TcpStream::connect(upstream).await else {
                    continue;
                };
                let (down_read, down_write) = downstream.into_split();
                let (up_read, up_write) = upstream.into_split();
                tokio::spawn(relay(down_read, up_write, held.clone()));
                tokio::spawn(relay(up_read, down_write, held.clone()));
            }
        });
        Self { port, paused, task }
    }

    fn pause(&self, on: bool) {
        self.paused.store(on, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for PausableRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    paused: Arc<std::sync::atomic::AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        while paused.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        // Bytes read just as the pause began wait for the resume too.
        while paused.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}

fn writer_of(job: &TrainingJob) -> Option<String> {
    job.status.as_ref().and_then(|s| s.written_by.clone())
}

/// The fence every TrainingJob status write carries, against the real API server: a write
/// that expects the status its writer last saw lands; one from a view another writer has
/// overwritten since is refused whole (422), and what the other wrote stands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_write_from_a_stale_view_is_refused_and_the_newer_one_stands() {
    use kube::api::{Patch, PatchParams};
    use ringmaster::controller::Fence;
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "fence").await;
    apply(&client, &job("fenced"), &ns.name, false)
        .await
        .unwrap();
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    let write = |fence: Fence, status: serde_json::Value| {
        let jobs = jobs.clone();
        async move {
            jobs.patch_status(
                "fenced",
                &PatchParams::default(),
                &Patch::<()>::Json(fence.patch(status)),
            )
            .await
        }
    };
    // Refused, and told apart from a status the schema refuses, as the operator does.
    let refused = |result: Result<TrainingJob, kube::Error>| match result {
        Err(error) => assert!(ringmaster::controller::is_failed_fence(&error), "{error:?}"),
        Ok(job) => panic!("the write landed: {:?}", job.status),
    };
    let a = || Some("replica-a/0000000a".to_string());
    let b = || Some("replica-b/0000000b".to_string());
    // The first write finds no status, as it expects.
    write(
        Fence::NoStatus,
        json!({"phase": "Pending", "writtenBy": a()}),
    )
    .await
    .unwrap();
    // One that still expects no status is refused now.
    refused(
        write(
            Fence::NoStatus,
            json!({"phase": "Starting", "writtenBy": b()}),
        )
        .await,
    );
    // The new leader read replica-a's status and writes over it.
    write(
        Fence::WrittenBy(a()),
        json!({"phase": "Starting", "writtenBy": b()}),
    )
    .await
    .unwrap();
    // The old leader, from its view before that, is refused; the new leader's status stands.
    refused(
        write(
            Fence::WrittenBy(a()),
            json!({"phase": "Running", "writtenBy": a()}),
        )
        .await,
    );
    let now = jobs.get("fenced").await.unwrap();
    assert_eq!(writer_of(&now), b());
    assert_eq!(
        now.status.unwrap().phase,
        ringmaster::api::TrainingJobPhase::Starting
    );
    // A status the schema refuses is not taken for a fence.
    let invalid = write(
        Fence::WrittenBy(b()),
        json!({"phase": "NoSuchPhase", "writtenBy": b()}),
    )
    .await
    .unwrap_err();
    assert!(
        !ringmaster::controller::is_failed_fence(&invalid),
        "{invalid:?}"
    );
    // A status an operator before writtenBy wrote: a fence expecting no writer holds on it.
    write(Fence::WrittenBy(b()), json!({"phase": "Starting"}))
        .await
        .unwrap();
    write(
        Fence::WrittenBy(None),
        json!({"phase": "Starting", "writtenBy": a()}),
    )
    .await
    .unwrap();
}

/// The leader is cut off from the API server (its traffic held by a relay, not killed) just
/// as the job changes; the other replica takes the Lease and writes. When the old leader's
/// traffic flows again, nothing it had in flight or planned from its old view lands after
/// the new leader's first write, and it stops leading.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_the_api_server_writes_nothing_after_the_new_leader() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "cutoff").await;
    let mut config = ringmaster_e2e::cluster::config().await.unwrap();
    let upstream = config.cluster_url.authority().unwrap().as_str().to_string();
    let upstream: std::net::SocketAddr = upstream.parse().expect("the API server at an IP:port");
    let relay = PausableRelay::start(upstream).await;
    config.cluster_url = format!("https://127.0.0.1:{}", relay.port).parse().unwrap();
    let through_relay = Client::try_from(config).unwrap();

    let a = replica(&through_relay, &ns.name, "replica-a");
    eventually(Duration::from_secs(20), "replica-a leads", || async {
        holder(&client, &ns.name).await.as_deref() == Some("replica-a")
    })
    .await;
    let b = replica(&client, &ns.name, "replica-b");
    apply(&client, &job("cut"), &ns.name, false).await.unwrap();
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    eventually(
        Duration::from_secs(30),
        "replica-a writes the status",
        || async {
            writer_of(&jobs.get("cut").await.unwrap()).is_some_and(|w| w.starts_with("replica-a/"))
        },
    )
    .await;

    // Every status write from here on, in order, as the API server stores them.
    let writers = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let seen = writers.clone();
    let watch_jobs = jobs.clone();
    let watching = tokio::spawn(async move {
        use futures::StreamExt;
        let config = kube::runtime::watcher::Config::default().fields("metadata.name=cut");
        let mut events = std::pin::pin!(kube::runtime::watcher(watch_jobs, config));
        while let Some(Ok(event)) = events.next().await {
            if let kube::runtime::watcher::Event::Apply(job) = event
                && let Some(writer) = writer_of(&job)
            {
                let mut seen = seen.lock().unwrap();
                if seen.last() != Some(&writer) {
                    seen.push(writer);
                }
            }
        }
    });

    // The job changes, and at once the leader is cut off: its reaction is in flight, held,
    // or not yet planned.
    jobs.patch(
        "cut",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(json!({"spec": {"runPolicy": {"suspend": true}}})),
    )
    .await
    .unwrap();
    relay.pause(true);
    eventually(
        Duration::from_secs(LEASE_SECONDS * 3),
        "replica-b takes over",
        || async { holder(&client, &ns.name).await.as_deref() == Some("replica-b") },
    )
    .await;
    eventually(Duration::from_secs(30), "replica-b writes", || async {
        writer_of(&jobs.get("cut").await.unwrap()).is_some_and(|w| w.starts_with("replica-b/"))
    })
    .await;
    relay.pause(false);
    // The old leader's traffic flows again: it learns it lost the Lease and stops.
    let stopped = tokio::time::timeout(Duration::from_secs(LEASE_SECONDS * 2), a.task)
        .await
        .expect("the old leader stops once it can see the Lease");
    assert!(
        matches!(stopped, Ok(Err(leader::LeaderError::Lost { .. }))),
        "{stopped:?}"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    watching.abort();
    let writers = writers.lock().unwrap().clone();
    let first_b = writers
        .iter()
        .position(|w| w.starts_with("replica-b/"))
        .unwrap_or_else(|| panic!("replica-b's write was seen: {writers:?}"));
    assert!(
        writers[first_b..]
            .iter()
            .all(|w| w.starts_with("replica-b/")),
        "a write of the old leader landed after the new one's: {writers:?}"
    );
    let job = jobs.get("cut").await.unwrap();
    assert_eq!(
        job.status.unwrap().phase,
        ringmaster::api::TrainingJobPhase::Suspended
    );
    b.task.abort();
}
