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
