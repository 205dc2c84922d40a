//! The progress-report load of running jobs, for `bench-operator --report-seconds`: each
//! job's launcher (a KWOK pod, which runs nothing) reports as a real one would, every
//! [`ringmaster_contract::progress::DEFAULT_INTERVAL_SECONDS`], with a token the API server
//! issued for that launcher pod, to the operator's real endpoint over HTTPS. What it costs
//! the operator and the API server is measured by the caller.

use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::{ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use ringmaster_contract::progress::{AUDIENCE, CA_ENV, Report, URL_ENV};
use ringmaster_contract::trainer::Progress;

/// One launcher's way to report.
struct Launcher {
    url: String,
    token: String,
}

/// What the reports came to.
#[derive(Debug, Default)]
pub struct ReportFigures {
    /// Reports sent.
    pub sent: u64,
    /// Reports the operator accepted (202).
    pub accepted: u64,
    /// Each report's time to its answer, seconds.
    pub latencies: Vec<f64>,
    /// Seconds the load ran.
    pub seconds: f64,
    /// The first refusal or error, if any.
    pub first_error: Option<String>,
}

/// Every launcher in `namespace`, with a token for it (made here, as the kubelet would).
async fn launchers(client: &Client, namespace: &str) -> Result<(Vec<Launcher>, String), String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let selector = ListParams::default().labels("ringmaster.dev/role=launcher");
    let list = pods
        .list(&selector)
        .await
        .map_err(|e| format!("listing launchers: {e}"))?;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let mut ca = None;
    let made = futures::stream::iter(list.items)
        .map(|pod| {
            let accounts = accounts.clone();
            async move {
                let env = pod.spec.as_ref()?.containers[0].env.clone()?;
                let value = |name: &str| env.iter().find(|e| e.name == name)?.value.clone();
                let request: k8s_openapi::api::authentication::v1::TokenRequest =
                    serde_json::from_value(serde_json::json!({"spec": {
                        "audiences": [AUDIENCE], "expirationSeconds": 3600,
                        "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod.name_any(), "uid": pod.uid()},
                    }}))
                    .ok()?;
                let token = accounts
                    .create_token_request("default", &PostParams::default(), &request)
                    .await
                    .ok()?
                    .status?
                    .token?;
                Some((Launcher { url: value(URL_ENV)?, token }, value(CA_ENV)?))
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await;
    let mut all = Vec::new();
    for (launcher, pem) in made.into_iter().flatten() {
        ca.get_or_insert(pem);
        all.push(launcher);
    }
    Ok((
        all,
        ca.ok_or("no launcher has a report URL: is the endpoint on?")?,
    ))
}

/// Every launcher in `namespace` reports every `interval` for `seconds`, spread evenly over
/// the interval; step `n` of `total` in its `n`-th report.
pub async fn run(
    client: &Client,
    namespace: &str,
    seconds: u64,
    interval: Duration,
) -> Result<ReportFigures, String> {
    ringmaster::tls::install_provider();
    let (launchers, ca) = launchers(client, namespace).await?;
    let certificate = reqwest::Certificate::from_pem(ca.as_bytes()).map_err(|e| e.to_string())?;
    let http = reqwest::Client::builder()
        .tls_certs_only([certificate])
        .timeout(Duration::from_secs(10))
        .build()
        .map_err(|e| e.to_string())?;
    println!(
        "  {} launchers report every {} s for {seconds} s",
        launchers.len(),
        interval.as_secs()
    );
    let start = Instant::now();
    let rounds = (seconds as f64 / interval.as_secs_f64()).floor().max(1.0) as u64;
    let n = launchers.len().max(1);
    let schedule = (0..rounds).flat_map(|round| {
        (0..launchers.len()).map(move |i| {
            let at = interval.mul_f64(round as f64 + i as f64 / n as f64);
            (round, i, at)
        })
    });
    let results = futures::stream::iter(schedule)
        .map(|(round, i, at)| {
            let (http, launcher) = (http.clone(), &launchers[i]);
            async move {
                tokio::time::sleep_until((start + at).into()).await;
                let report = Report {
                    step: Some(Progress {
                        step: (round + 1) * 10,
                        loss: Some(2.0),
                        accuracy: None,
                        learning_rate: 0.1,
                        images_per_second: Some(1000.0),
                        recent_images_per_second: Some(1000.0),
                        total_steps: Some(10_000),
                    }),
                    fabric: None,
                };
                let sent = Instant::now();
                let answer = http
                    .post(&launcher.url)
                    .bearer_auth(&launcher.token)
                    .body(report.to_body())
                    .send()
                    .await;
                let took = sent.elapsed().as_secs_f64();
                match answer {
                    Ok(r) if r.status().as_u16() == 202 => Ok(took),
                    Ok(r) => Err(format!(
                        "{}: {}",
                        r.status(),
                        r.text().await.unwrap_or_default()
                    )),
                    Err(e) => Err(e.to_string()),
                }
            }
        })
        .buffer_unordered(256)
        .collect::<Vec<_>>()
        .await;
    let mut figures = ReportFigures {
        seconds: start.elapsed().as_secs_f64(),
        ..ReportFigures::default()
    };
    for result in results {
        figures.sent += 1;
        match result {
            Ok(took) => {
                figures.accepted += 1;
                figures.latencies.push(took);
            }
            Err(error) => {
                figures.first_error.get_or_insert(error);
            }
        }
    }
    Ok(figures)
}
