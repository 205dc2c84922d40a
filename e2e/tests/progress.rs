//! Live progress end to end: the operator's report endpoint (HTTPS, in this process) against
//! the real API server, which issues the launcher's pod-bound tokens and checks them
//! (TokenRequest, TokenReview). KWOK plays the pods, so the reports are sent here by the
//! launcher's own reporter code (`ringmaster_trainer::report`), with tokens the API server
//! issued for the job's pods; the real-node test (`real_node.rs`) has a real launcher send them.

mod common;

use std::time::Duration;

use common::{
    Operator, TestNamespace, apply, client, ensure_crds, eventually, job_status, wait_phase,
};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::PostParams;
use kube::{Api, ResourceExt};
use ringmaster::api::TrainingJobPhase;
use ringmaster::controller::OperatorConfig;
use ringmaster_contract::progress::{AUDIENCE, CA_ENV, Report, URL_ENV};
use ringmaster_contract::trainer::Progress;
use ringmaster_trainer::report::{Endpoint, ReportError, send_once};
use serde_json::json;

/// A token the API server issues for `pod` (through the namespace's default
/// ServiceAccount), for `audience`.
async fn token_for(client: &kube::Client, ns: &str, pod: &Pod, audience: &str) -> String {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    eventually(
        Duration::from_secs(30),
        "the default ServiceAccount",
        || {
            let accounts = accounts.clone();
            async move { accounts.get_opt("default").await.ok().flatten().is_some() }
        },
    )
    .await;
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: Some(vec![audience.to_string()]),
            bound_object_ref: Some(BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(pod.name_any()),
                uid: pod.uid(),
            }),
            expiration_seconds: Some(600),
        }),
        ..TokenRequest::default()
    };
    let issued = accounts
        .create_token_request("default", &PostParams::default(), &request)
        .await
        .expect("a token request");
    issued.status.and_then(|s| s.token).expect("a token")
}

/// The endpoint as the launcher's environment names it, with `token` in a file.
fn endpoint_of(launcher: &Pod, token: Option<&str>, dir: &std::path::Path) -> Endpoint {
    let env = launcher.spec.as_ref().unwrap().containers[0]
        .env
        .clone()
        .unwrap_or_default();
    let value = |name: &str| {
        env.iter()
            .find(|e| e.name == name)
            .and_then(|e| e.value.clone())
            .unwrap_or_else(|| panic!("{name} in the launcher's environment"))
    };
    let token_file = token.map(|token| {
        let path = dir.join(format!(
            "token-{}",
            token.len() ^ token.as_bytes()[20] as usize
        ));
        std::fs::write(&path, token).unwrap();
        path
    });
    Endpoint {
        url: value(URL_ENV),
        ca_pem: Some(value(CA_ENV)),
        token_file,
        interval: Duration::from_secs(15),
    }
}

fn step(step: u64, total: u64) -> Report {
    Report {
        step: Some(Progress {
            step,
            loss: Some(2.25),
            accuracy: Some(0.1),
            learning_rate: 0.1,
            images_per_second: Some(900.0),
            recent_images_per_second: Some(1000.4),
            total_steps: Some(total),
        }),
        fabric: None,
    }
}

/// The HTTP status a refused report got.
fn refused_with(result: Result<(), ReportError>) -> u16 {
    match result {
        Err(ReportError::Send {
            status: Some(status),
            ..
        }) => status,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launchers_reports_show_as_progress_in_the_status_kubectl_and_metrics_and_no_other_pod_may_report()
 {
    let client = client().await;
    ensure_crds(&client).await;
    let ns = TestNamespace::new(&client, "progress").await;
    let config = OperatorConfig {
        restart_backoff: Duration::from_millis(500),
        data_stage_destinations: common::e2e_destinations(),
        ..OperatorConfig::default()
    };
    let localhost = Some("127.0.0.1".parse().unwrap());
    let operator = Operator::start_reporting(&client, &ns.name, config, localhost).await;
    let job = json!({
        "apiVersion": "ringmaster.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "live"},
        "spec": {
            "workers": 2,
            "slotsPerWorker": 2,
            "image": "ringmaster-trainer:e2e",
            "trainer": {"model": "resnet18", "imageSize": 64, "batchSize": 16, "steps": 100},
        }
    });
    apply(&client, &job, &ns.name, false).await.unwrap();
    wait_phase(&client, &ns.name, "live", TrainingJobPhase::Running, 60).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let launcher = pods
        .get(&common::current_launcher(&client, &ns.name, "live").await)
        .await
        .unwrap();
    let spec = launcher.spec.as_ref().unwrap();
    let projected = spec
        .volumes
        .iter()
        .flatten()
        .find_map(|v| v.projected.as_ref())
        .expect("the token's projected volume");
    let source = projected.sources.as_ref().unwrap()[0]
        .service_account_token
        .as_ref()
        .unwrap();
    assert_eq!(source.audience.as_deref(), Some(AUDIENCE));
    assert_ne!(
        spec.automount_service_account_token,
        Some(true),
        "no API token in the pod"
    );

    let dir = tempfile::tempdir().unwrap();
    let token = token_for(&client, &ns.name, &launcher, AUDIENCE).await;
    let endpoint = endpoint_of(&launcher, Some(&token), dir.path());
    assert!(endpoint.url.ends_with(&format!(
        "/progress/v1/namespaces/{}/trainingjobs/live",
        ns.name
    )));
    let blocking = |endpoint: Endpoint, report: Report| {
        tokio::task::spawn_blocking(move || send_once(endpoint, &report))
    };
    blocking(endpoint.clone(), step(10, 100))
        .await
        .unwrap()
        .expect("the launcher's report");
    tokio::time::sleep(Duration::from_secs(2)).await;
    blocking(endpoint.clone(), step(30, 100))
        .await
        .unwrap()
        .expect("the launcher's report");

    // At most one status write per hold-back (30 s): the progress shows within it.
    let mut progress = serde_json::Value::Null;
    for _ in 0..250 {
        progress = job_status(&client, &ns.name, "live").await["progress"].clone();
        if progress["step"] == 30 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(progress["step"], 30, "{progress:#}");
    assert_eq!(progress["percentDone"], "30%");
    assert_eq!(progress["imagesPerSecond"], 1000);
    assert_eq!(progress["loss"], 2.25);
    let remaining = progress["timeRemaining"].as_str().expect("a time left");
    assert!(remaining.ends_with('s'), "{remaining}");

    let kubectl = std::process::Command::new(common::tool("kubectl"))
        .arg("--kubeconfig")
        .arg(ringmaster_e2e::cluster::kubeconfig_path())
        .args(["get", "tj", "-n", &ns.name])
        .output()
        .expect("kubectl runs");
    let table = String::from_utf8_lossy(&kubectl.stdout);
    eprintln!("kubectl get tj:\n{table}");
    let header = table.lines().next().unwrap();
    assert!(
        header.contains("PROGRESS") && header.contains("ETA"),
        "{table}"
    );
    assert!(table.lines().nth(1).unwrap().contains("30%"), "{table}");

    let metrics = operator.get("/metrics").await;
    let series = format!(
        "ringmaster_trainingjob_progress_steps{{name=\"live\",namespace=\"{}\"}} 30",
        ns.name
    );
    assert!(metrics.contains(&series), "{series} in\n{metrics}");

    // Nobody else reports for it: a worker's token, a token for the API server, no token.
    let worker = pods.get("live-worker-0").await.unwrap();
    let worker_token = token_for(&client, &ns.name, &worker, AUDIENCE).await;
    let as_worker = endpoint_of(&launcher, Some(&worker_token), dir.path());
    assert_eq!(
        refused_with(blocking(as_worker, step(99, 100)).await.unwrap()),
        403
    );
    let api_token = token_for(
        &client,
        &ns.name,
        &launcher,
        "https://kubernetes.default.svc",
    )
    .await;
    let for_the_api = endpoint_of(&launcher, Some(&api_token), dir.path());
    assert_eq!(
        refused_with(blocking(for_the_api, step(99, 100)).await.unwrap()),
        401
    );
    let anonymous = endpoint_of(&launcher, None, dir.path());
    assert_eq!(
        refused_with(blocking(anonymous, step(99, 100)).await.unwrap()),
        401
    );
    // The job's own launcher, for another job's path.
    let elsewhere = Endpoint {
        url: endpoint
            .url
            .replace("/trainingjobs/live", "/trainingjobs/other"),
        ..endpoint.clone()
    };
    assert_eq!(
        refused_with(blocking(elsewhere, step(99, 100)).await.unwrap()),
        403
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        job_status(&client, &ns.name, "live").await["progress"]["step"],
        30,
        "refused reports are not taken"
    );

    // Finished: the whole run's figures, and the series gone.
    common::end_launcher(&client, &ns.name, "live").await;
    let status = wait_phase(&client, &ns.name, "live", TrainingJobPhase::Succeeded, 60).await;
    assert_eq!(status["progress"]["percentDone"], "100%", "{status:#}");
    assert!(status["progress"]["timeRemaining"].is_null());
    let metrics = operator.get("/metrics").await;
    assert!(
        !metrics.contains("trainingjob_progress_steps{name=\"live\""),
        "{metrics}"
    );
}
