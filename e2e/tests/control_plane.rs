//! The local control plane is the real thing: the CRDs' schema and CEL rules are enforced by
//! the real API server, the scheduler places pods by GPU resources, the garbage collector
//! deletes dependents, and KWOK plays pods the way tests ask.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{TestNamespace, apply, client, ensure_crds, eventually};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{DeleteParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::{Value, json};

#[tokio::test]
async fn every_sample_is_accepted_by_the_api_server() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "samples").await;
    let mut applied = 0;
    for path in common::yaml_files("config/samples") {
        for object in common::documents(&path) {
            apply(&client, &object, &ns.name, false)
                .await
                .unwrap_or_else(|e| panic!("{} ({}) refused: {e}", path.display(), object["kind"]));
            applied += 1;
        }
    }
    assert!(applied >= 6, "applied {applied} objects");
}

/// Each invalid fixture (tests/fixtures/invalid) is refused by the API server, with an error
/// naming the fixture's field and carrying its message — the same rules the operator's
/// validate step evaluates. Fixtures marked `# refused-by: operator` break no schema rule
/// (the trainer's settings check refuses them in validate): the API server stores them, and
/// the operator reports them on the status (tests/validate.rs, and operator.rs here).
#[tokio::test]
async fn every_invalid_fixture_is_refused_with_its_message() {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "invalid").await;
    let mut failures = Vec::new();
    let fixtures = common::yaml_files("tests/fixtures/invalid");
    assert!(fixtures.len() >= 30);
    for path in fixtures {
        let text = std::fs::read_to_string(&path).unwrap();
        let header = |key: &str| {
            text.lines()
                .take_while(|l| l.starts_with('#'))
                .find_map(|l| l.strip_prefix(&format!("# {key}: ")).map(str::to_string))
        };
        let field = header("field").expect("# field: line");
        let object = common::documents(&path).remove(0);
        if let Some(old) = header("old") {
            // A transition rule: the old object must exist for the update to be judged.
            let old = common::documents(&common::repo_root().join(old))
                .into_iter()
                .find(|d| d["kind"] == object["kind"])
                .unwrap();
            apply(&client, &old, &ns.name, false)
                .await
                .expect("old object accepted");
        }
        let operator_only = header("refused-by").is_some_and(|by| by.starts_with("operator"));
        match apply(&client, &object, &ns.name, true).await {
            Ok(_) if operator_only => {}
            Ok(_) => failures.push(format!("{}: accepted", path.display())),
            Err(e) if operator_only => failures.push(format!(
                "{}: the API server refused what only the operator should: {e}",
                path.display()
            )),
            Err(kube::Error::Api(status)) if header("api-refusal").is_some() => {
                // A refusal before validation (server-side apply's own checks): its code and words.
                let wanted = header("api-refusal").unwrap();
                let (code, words) = wanted.split_once(' ').unwrap_or((&wanted, ""));
                if status.code.to_string() != code || !status.message.contains(words) {
                    failures.push(format!(
                        "{}: wanted {wanted}, got {}: {}",
                        path.display(),
                        status.code,
                        status.message
                    ));
                }
            }
            Err(kube::Error::Api(status)) => {
                let message = status.message.clone();
                let ok_field = message.contains(&field);
                let ok_message = header("message").is_none_or(|m| message.contains(&m));
                if status.code != 422 || !ok_field || !ok_message {
                    failures.push(format!(
                        "{}: wanted 422 naming {field} with {:?}, got {}: {message}",
                        path.display(),
                        header("message"),
                        status.code
                    ));
                }
            }
            Err(other) => failures.push(format!("{}: {other}", path.display())),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test]
async fn kubectl_explain_shows_the_field_docs() {
    let client = client().await;
    ensure_crds(&client).await;
    let kubeconfig = ringmaster_e2e::cluster::kubeconfig_path();
    // `kubectl explain` reads the published OpenAPI, which follows a new CRD by a moment.
    let explain = |what: &str| {
        let what = what.to_string();
        let kubeconfig = kubeconfig.clone();
        async move {
            let mut last = String::new();
            for _ in 0..60 {
                let out = std::process::Command::new(common::tool("kubectl"))
                    .arg("--kubeconfig")
                    .arg(&kubeconfig)
                    .args(["explain", &what])
                    .output()
                    .expect("kubectl runs");
                if out.status.success() {
                    return String::from_utf8(out.stdout).unwrap();
                }
                last = String::from_utf8_lossy(&out.stderr).to_string();
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            panic!("kubectl explain {what} kept failing: {last}");
        }
    };
    let text = explain("trainingjob.spec").await;
    assert!(text.contains("Number of worker pods"), "{text}");
    assert!(text.contains("gpusPerWorker"), "{text}");
    let pool = explain("trainingjob.spec.nodePool.vmSize").await;
    assert!(pool.contains("Standard_ND96asr_v4"), "{pool}");
    let stage = explain("dstage.spec.source.azureBlob.auth").await;
    assert!(
        stage.contains("sasTokenSecretRef") && stage.contains("preferred"),
        "{stage}"
    );
}

fn gpu_pod(name: &str, gpus: u32) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "containers": [{
                "name": "main",
                "image": "ringmaster-trainer:test",
                "resources": {"limits": {"nvidia.com/gpu": gpus.to_string(), "rdma/shared_ib": "1"}}
            }],
            "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]
        }
    }))
    .unwrap()
}

#[tokio::test]
async fn the_scheduler_places_gpu_pods_by_their_gpus() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "sched").await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    pods.create(&PostParams::default(), &gpu_pod("eight", 8))
        .await
        .unwrap();
    pods.create(&PostParams::default(), &gpu_pod("nine", 9))
        .await
        .unwrap();

    eventually(Duration::from_secs(30), "the 8-GPU pod Ready", || async {
        pods.get("eight").await.ok().is_some_and(|p| {
            p.status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
        })
    })
    .await;
    let eight = pods.get("eight").await.unwrap();
    let node = eight.spec.unwrap().node_name.expect("scheduled");
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let node = nodes.get(&node).await.unwrap();
    assert_eq!(
        node.labels()["node.kubernetes.io/instance-type"],
        "Standard_ND96asr_v4"
    );

    let unschedulable = || async {
        let pod = pods.get("nine").await.unwrap();
        let status = pod.status.unwrap_or_default();
        status
            .conditions
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_ == "PodScheduled" && c.status == "False")
            .filter(|_| status.phase.as_deref() == Some("Pending"))
            .map(|c| {
                format!(
                    "{}: {}",
                    c.reason.unwrap_or_default(),
                    c.message.unwrap_or_default()
                )
            })
    };
    eventually(
        Duration::from_secs(30),
        "the 9-GPU pod marked Unschedulable",
        || async { unschedulable().await.is_some() },
    )
    .await;
    let reason = unschedulable().await.unwrap();
    assert!(reason.starts_with("Unschedulable"), "{reason}");
    assert!(reason.contains("Insufficient nvidia.com/gpu"), "{reason}");
}

#[tokio::test]
async fn the_garbage_collector_deletes_dependents() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "gc").await;
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let owner = maps
        .create(&PostParams::default(), &config_map("owner", None))
        .await
        .unwrap();
    let reference = OwnerReference {
        api_version: "v1".into(),
        kind: "ConfigMap".into(),
        name: owner.name_any(),
        uid: owner.uid().unwrap(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    };
    maps.create(
        &PostParams::default(),
        &config_map("dependent", Some(reference)),
    )
    .await
    .unwrap();
    maps.delete("owner", &DeleteParams::background())
        .await
        .unwrap();
    eventually(
        Duration::from_secs(60),
        "the dependent deleted by the garbage collector",
        || async { matches!(maps.get_opt("dependent").await, Ok(None)) },
    )
    .await;
}

fn config_map(name: &str, owner: Option<OwnerReference>) -> ConfigMap {
    let mut cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": name}, "data": {"k": "v"}})).unwrap();
    cm.metadata.owner_references = owner.map(|o| vec![o]);
    cm
}

fn annotated_pod(name: &str, annotations: &[(&str, &str)]) -> Pod {
    let annotations: BTreeMap<String, String> = annotations
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let mut pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "containers": [{"name": "main", "image": "busybox"}],
            "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]
        }
    }))
    .unwrap();
    pod.metadata.annotations = Some(annotations);
    pod
}

fn terminated(pod: &Pod) -> Option<(String, Value)> {
    let status = pod.status.as_ref()?;
    let phase = status.phase.clone()?;
    let state = status
        .container_statuses
        .as_ref()?
        .first()?
        .state
        .as_ref()?
        .terminated
        .as_ref()?;
    Some((phase, serde_json::to_value(state).unwrap()))
}

#[tokio::test]
async fn kwok_finishes_pods_as_their_annotations_say() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "stages").await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let summary = &common::trainer_summary(2790.5, 100, 1.25);
    for pod in [
        annotated_pod(
            "succeeds",
            &[
                ("kwok.ringmaster.dev/exit-code", "0"),
                ("kwok.ringmaster.dev/exit-after", "2s"),
                ("kwok.ringmaster.dev/termination-message", summary),
            ],
        ),
        annotated_pod(
            "oom",
            &[
                ("kwok.ringmaster.dev/exit-code", "137"),
                ("kwok.ringmaster.dev/reason", "OOMKilled"),
            ],
        ),
        annotated_pod(
            "evicted",
            &[
                ("kwok.ringmaster.dev/exit-code", "137"),
                ("kwok.ringmaster.dev/reason", "ContainerStatusUnknown"),
                ("kwok.ringmaster.dev/pod-reason", "Evicted"),
            ],
        ),
        annotated_pod("runs", &[]),
    ] {
        pods.create(&PostParams::default(), &pod).await.unwrap();
    }

    eventually(
        Duration::from_secs(30),
        "the three annotated pods finished",
        || async {
            let mut done = 0;
            for name in ["succeeds", "oom", "evicted"] {
                if pods
                    .get(name)
                    .await
                    .ok()
                    .as_ref()
                    .and_then(terminated)
                    .is_some()
                {
                    done += 1;
                }
            }
            done == 3
        },
    )
    .await;
    let (phase, state) = terminated(&pods.get("succeeds").await.unwrap()).unwrap();
    assert_eq!(
        (phase.as_str(), state["exitCode"].as_i64()),
        ("Succeeded", Some(0))
    );
    assert_eq!(state["message"], summary.as_str());
    let started = pods
        .get("succeeds")
        .await
        .unwrap()
        .status
        .unwrap()
        .start_time
        .unwrap()
        .0;
    let finished = state["finishedAt"]
        .as_str()
        .unwrap()
        .parse::<k8s_openapi::jiff::Timestamp>()
        .unwrap();
    assert!(
        finished.duration_since(started).as_secs_f64() >= 1.5,
        "exit-after was honoured"
    );

    let (phase, state) = terminated(&pods.get("oom").await.unwrap()).unwrap();
    assert_eq!(
        (phase.as_str(), state["exitCode"].as_i64()),
        ("Failed", Some(137))
    );
    assert_eq!(state["reason"], "OOMKilled");

    let evicted = pods.get("evicted").await.unwrap();
    assert_eq!(
        evicted.status.as_ref().unwrap().reason.as_deref(),
        Some("Evicted")
    );

    eventually(
        Duration::from_secs(30),
        "the pod that runs Running",
        || async {
            pods.get("runs")
                .await
                .unwrap()
                .status
                .and_then(|s| s.phase)
                .as_deref()
                == Some("Running")
        },
    )
    .await;
    pods.delete("runs", &DeleteParams::default()).await.unwrap();
    eventually(Duration::from_secs(30), "the deleted pod gone", || async {
        matches!(pods.get_opt("runs").await, Ok(None))
    })
    .await;
}
