//! A TrainingJob CRD without its validation rules, as an older install or one applied with
//! validation off would leave. In a test binary of its own: test binaries run one at a time,
//! and a test beside it in the same binary would put the strict CRD back (`ensure_crds`)
//! while this one relies on the lax one.

mod common;

use std::time::Duration;

use common::{Operator, TestNamespace, apply, client, condition, ensure_crds, eventually};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use ringmaster::api::{TrainingJob, TrainingJobPhase};
use serde_json::{Value, json};

/// A CRD without the current rules, as an older install or one applied with validation
/// off would leave: the API server stores an invalid object, and the operator's validate
/// step still refuses it on the status and in a Warning Event, then accepts the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_spec_that_got_past_the_api_server_is_reported() {
    let client = client().await;
    install_lax_training_job_crd(&client).await;
    let ns = TestNamespace::new(&client, "op-invalid").await;
    let _operator = Operator::start(&client, &ns.name).await;

    let mut job = common::sample("trainingjob-resnet50-nd96asr-v4.yaml", "TrainingJob");
    job["spec"]["nodePool"]["poolName"] = json!("GPU-pool");
    job["spec"]["workers"] = json!(0);
    // The API server takes up the new schema a moment after the apply returns.
    eventually(
        Duration::from_secs(30),
        "the lax CRD storing the invalid object",
        || async { apply(&client, &job, &ns.name, false).await.is_ok() },
    )
    .await;

    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &ns.name);
    let name = "resnet50-imagenet";
    let spec_valid = || async {
        let status = serde_json::to_value(jobs.get(name).await.unwrap().status).unwrap();
        (condition(&status, "SpecValid").clone(), status)
    };
    eventually(
        Duration::from_secs(30),
        "SpecValid=False on the status",
        || async { spec_valid().await.0["status"] == "False" },
    )
    .await;
    let (condition_now, status) = spec_valid().await;
    assert_eq!(condition_now["reason"], "InvalidSpec");
    let message = condition_now["message"].as_str().unwrap();
    assert!(message.contains("spec.nodePool.poolName"), "{message}");
    assert!(message.contains("spec.workers"), "{message}");
    assert_eq!(
        status["phase"],
        serde_json::to_value(TrainingJobPhase::Pending).unwrap()
    );
    assert_eq!(condition(&status, "Ready")["status"], "False");
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

    // The operator waits for a change; the fix is one. The schema passes then, and so does
    // the trainer's own settings check: the flagship sample's trainer runs on its GPUs.
    let fix = json!({"spec": {"workers": 2, "nodePool": {"poolName": "gpupool"}}});
    let api = common::dynamic_api(&client, &job, &ns.name);
    api.patch(name, &PatchParams::default(), &Patch::Merge(&fix))
        .await
        .expect("fix applied");
    eventually(
        Duration::from_secs(30),
        "SpecValid=True once fixed",
        || async {
            let (c, status) = spec_valid().await;
            c["status"] == "True" && status["observedGeneration"] == 2
        },
    )
    .await;

    // The trainer's own settings check, which the operator runs on the launcher's exact
    // command line: a flag the trainer would refuse at start is refused on the status,
    // naming the field, and its removal accepted.
    let refused = json!({"spec": {"trainer": {"extraArgs": ["--micro-batches=3"]}}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&refused))
        .await
        .expect("extra flag applied");
    eventually(
        Duration::from_secs(30),
        "SpecValid=False naming trainer.extraArgs and the trainer's reason",
        || async {
            let (c, status) = spec_valid().await;
            c["status"] == "False"
                && c["message"].as_str().is_some_and(|m| {
                    m.contains("spec.trainer.extraArgs")
                        && m.contains("--micro-batches: 3 must divide the batch size 256")
                })
                && status["observedGeneration"] == 3
        },
    )
    .await;
    let removed = json!({"spec": {"trainer": {"extraArgs": null}}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&removed))
        .await
        .expect("extra flag removed");
    eventually(
        Duration::from_secs(30),
        "SpecValid=True without the flag",
        || async {
            let (c, status) = spec_valid().await;
            c["status"] == "True" && status["observedGeneration"] == 4
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
}
