//! The operator (run in this process against the local cluster) reports what its validate
//! step finds on the resources' status and in Events, and serves its metrics.

mod common;

use std::time::Duration;

use common::{Operator, TestNamespace, apply, client, ensure_crds, eventually};
use kube::Api;
use ringmaster::api::{DataStage, TrainingJob};
use serde_json::Value;

fn condition<'a>(status: &'a Value, type_: &str) -> Option<&'a Value> {
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

/// The samples pass the validate step: the TrainingJob is SpecValid and starts, with a Normal
/// `Starting` Event (Events mark phase changes only); the DataStage, whose claim does not exist here, waits in Pending and says
/// why (VolumeBound False, ClaimNotFound), with a Warning for its account-key auth. The
/// operator's metrics and probes answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valid_samples_are_accepted_and_a_stage_without_its_claim_waits_and_says_why() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "op-valid").await;
    let operator = Operator::start(&client, &ns.name).await;

    let job = common::sample("trainingjob-cpu-small.yaml", "TrainingJob");
    apply(&client, &job, &ns.name, false).await.unwrap();
    let stage = common::sample("datastage-azurite.yaml", "DataStage");
    apply(&client, &stage, &ns.name, false).await.unwrap();

    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    eventually(
        Duration::from_secs(30),
        "TrainingJob status written",
        || async { jobs.get("resnet18-cpu").await.unwrap().status.is_some() },
    )
    .await;
    let status = serde_json::to_value(jobs.get("resnet18-cpu").await.unwrap().status).unwrap();
    assert!(
        status["phase"] == "Starting" || status["phase"] == "Running",
        "{status:#}"
    );
    assert_eq!(status["observedGeneration"], 1);
    assert_eq!(condition(&status, "SpecValid").unwrap()["status"], "True");

    let stages: Api<DataStage> = Api::namespaced(client.clone(), &ns.name);
    eventually(
        Duration::from_secs(30),
        "DataStage status written",
        || async { stages.get("tiny-images").await.unwrap().status.is_some() },
    )
    .await;
    // The sample stages into a claim that does not exist here: it waits and says why.
    let status = serde_json::to_value(stages.get("tiny-images").await.unwrap().status).unwrap();
    assert_eq!(status["phase"], "Pending");
    let bound = condition(&status, "VolumeBound").unwrap();
    assert_eq!(
        (bound["status"].as_str(), bound["reason"].as_str()),
        (Some("False"), Some("ClaimNotFound"))
    );
    assert_eq!(condition(&status, "Ready").unwrap()["status"], "False");
    assert_eq!(condition(&status, "Reconciling").unwrap()["status"], "True");
    // Account-key auth is allowed, and warned about in an Event.
    eventually(
        Duration::from_secs(30),
        "the InsecureAuth warning Event",
        || async {
            !common::warnings_for(&client, &ns.name, "tiny-images", "InsecureAuth")
                .await
                .is_empty()
        },
    )
    .await;
    eventually(
        Duration::from_secs(30),
        "a Normal Event for the job's first phase",
        || async {
            common::events_for(&client, &ns.name, "resnet18-cpu")
                .await
                .iter()
                .any(|e| {
                    e.reason.as_deref() == Some("Starting") && e.type_.as_deref() == Some("Normal")
                })
        },
    )
    .await;
    // Events only for phase changes: a valid spec is said on the status, not in an Event.
    let events = common::events_for(&client, &ns.name, "resnet18-cpu").await;
    assert!(
        events.iter().all(|e| e.reason.as_deref() != Some("Valid")),
        "{events:?}"
    );

    let metrics = operator.get("/metrics").await;
    assert!(
        metrics.contains(r#"ringmaster_reconcile_total{controller="trainingjob"}"#),
        "{metrics}"
    );
    assert!(operator.get("/readyz").await.starts_with("HTTP/1.0 200"));
    assert!(operator.get("/healthz").await.starts_with("HTTP/1.0 200"));
}
