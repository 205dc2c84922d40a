//! The operator (run in this process against the local cluster) reports what its validate
//! step finds on the resources' status and in Events, and serves its metrics.

mod common;

use std::time::Duration;

use common::{Operator, TestNamespace, apply, client, ensure_crds, eventually};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use ringmaster::api::{DataStage, TrainingJob, TrainingJobPhase};
use serde_json::{Value, json};

fn condition<'a>(status: &'a Value, type_: &str) -> Option<&'a Value> {
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

fn sample(file: &str, kind: &str) -> Value {
    common::documents(&common::repo_root().join("config/samples").join(file))
        .into_iter()
        .find(|d| d["kind"] == kind)
        .unwrap()
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

    let job = sample("trainingjob-cpu-small.yaml", "TrainingJob");
    apply(&client, &job, &ns.name, false).await.unwrap();
    let stage = sample("datastage-azurite.yaml", "DataStage");
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

/// A CRD without the current rules, as an older install or one applied with validation
/// off would leave: the API server stores an invalid object, and the operator's validate
/// step still refuses it on the status and in a Warning Event, then accepts the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_spec_that_got_past_the_api_server_is_reported() {
    let client = client().await;
    install_lax_training_job_crd(&client).await;
    let ns = TestNamespace::new(&client, "op-invalid").await;
    let _operator = Operator::start(&client, &ns.name).await;

    let mut job = sample("trainingjob-resnet50-nd96asr-v4.yaml", "TrainingJob");
    job["spec"]["nodePool"]["poolName"] = json!("GPU-pool");
    job["spec"]["workers"] = json!(0);
    apply(&client, &job, &ns.name, false)
        .await
        .expect("the lax CRD stores the invalid object");

    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    let name = "resnet50-imagenet";
    let spec_valid = || async {
        let status = serde_json::to_value(jobs.get(name).await.unwrap().status).unwrap();
        (condition(&status, "SpecValid").cloned(), status)
    };
    eventually(
        Duration::from_secs(30),
        "SpecValid=False on the status",
        || async { spec_valid().await.0.is_some_and(|c| c["status"] == "False") },
    )
    .await;
    let (condition_now, status) = spec_valid().await;
    let condition_now = condition_now.unwrap();
    assert_eq!(condition_now["reason"], "InvalidSpec");
    let message = condition_now["message"].as_str().unwrap();
    assert!(message.contains("spec.nodePool.poolName"), "{message}");
    assert!(message.contains("spec.workers"), "{message}");
    assert_eq!(
        status["phase"],
        serde_json::to_value(TrainingJobPhase::Pending).unwrap()
    );
    assert_eq!(condition(&status, "Ready").unwrap()["status"], "False");
    eventually(
        Duration::from_secs(30),
        "a Warning Event naming the field",
        || async {
            common::events_for(&client, &ns.name, name)
                .await
                .iter()
                .any(|e| {
                    e.type_.as_deref() == Some("Warning")
                        && e.reason.as_deref() == Some("InvalidSpec")
                        && e.note
                            .as_deref()
                            .is_some_and(|n| n.contains("spec.nodePool.poolName"))
                })
        },
    )
    .await;

    // The operator waits for a change; the fix is one. The schema passes then, and the
    // trainer's own settings check refuses the GPU job the built-in trainer cannot run yet.
    let fix = json!({"spec": {"workers": 2, "nodePool": {"poolName": "gpupool"}}});
    let api = common::dynamic_api(&client, &job, &ns.name);
    api.patch(name, &PatchParams::default(), &Patch::Merge(&fix))
        .await
        .expect("fix applied");
    eventually(
        Duration::from_secs(30),
        "SpecValid=False naming gpusPerWorker and the CUDA engine",
        || async {
            let (c, status) = spec_valid().await;
            c.is_some_and(|c| {
                c["status"] == "False"
                    && c["message"].as_str().is_some_and(|m| {
                        m.contains("spec.gpusPerWorker") && m.contains("CUDA engine")
                    })
            }) && status["observedGeneration"] == 2
        },
    )
    .await;
    // The user's own GPU program runs.
    let own = json!({"spec": {"trainer": null, "command": common::own_gpu_program()}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&own))
        .await
        .expect("own program applied");
    eventually(
        Duration::from_secs(30),
        "SpecValid=True with the user's own program",
        || async {
            let (c, status) = spec_valid().await;
            c.is_some_and(|c| c["status"] == "True") && status["observedGeneration"] == 3
        },
    )
    .await;
    ensure_crds(&client).await;
}

/// Applies the TrainingJob CRD with every validation rule removed.
async fn install_lax_training_job_crd(client: &Client) {
    ensure_crds(client).await;
    let crd = ringmaster::crdgen::all()
        .into_iter()
        .find(|c| c.spec.names.kind == "TrainingJob")
        .unwrap();
    let mut body = serde_json::to_value(&crd).unwrap();
    fn strip(v: &mut Value) {
        if let Value::Object(map) = v {
            for key in [
                "x-kubernetes-validations",
                "minimum",
                "maximum",
                "pattern",
                "enum",
                "maxLength",
                "minLength",
            ] {
                map.remove(key);
            }
            map.values_mut().for_each(strip);
        } else if let Value::Array(items) = v {
            items.iter_mut().for_each(strip);
        }
    }
    strip(&mut body["spec"]);
    body["apiVersion"] = "apiextensions.k8s.io/v1".into();
    body["kind"] = "CustomResourceDefinition".into();
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    api.patch(
        "trainingjobs.ringmaster.dev",
        &PatchParams::apply(common::MANAGER).force(),
        &Patch::Apply(&body),
    )
    .await
    .expect("lax CRD applied");
    // The API server reloads the schema asynchronously.
    tokio::time::sleep(Duration::from_secs(2)).await;
}
