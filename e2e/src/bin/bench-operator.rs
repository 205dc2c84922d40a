//! `bench-operator`: applies many TrainingJobs at once to the local cluster with the operator
//! (a release build, run as its own process) and reports how fast and how cheaply it brings
//! them up. A benchmark that prints figures, not a pass/fail test.
//!
//! Figures: seconds until every launcher exists, seconds until every job is Running, the
//! operator's CPU seconds and peak RSS, and API requests per job (the operator's own count).

use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, Client, ResourceExt};
use ringmaster::api::{TrainingJob, TrainingJobPhase};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Applies JOBS TrainingJobs of WORKERS workers at once and measures the operator.
#[derive(Parser, Debug)]
#[command(name = "bench-operator", version)]
struct Args {
    /// The operator binary (build it with `cargo build --release`).
    #[arg(long)]
    operator: std::path::PathBuf,
    /// TrainingJobs to apply.
    #[arg(long, default_value_t = 100)]
    jobs: u32,
    /// Workers per job.
    #[arg(long, default_value_t = 4)]
    workers: u32,
    /// Port of the operator's metrics.
    #[arg(long, default_value_t = 18089)]
    metrics_port: u16,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("bench-operator: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn http_get(port: u16, path: &str) -> Option<String> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    Some(response)
}

/// CPU seconds (user + system) and peak RSS in MiB of a process, from /proc.
fn process_usage(pid: u32) -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // Fields 14 and 15 of stat (utime, stime), counted after the command's closing paren.
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let hwm_kib: f64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    // Linux reports times in USER_HZ, 100 on every architecture Kubernetes runs on.
    Some((ticks / 100.0, hwm_kib / 1024.0))
}

fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| {
            l.rsplit_once(' ')
                .and_then(|(_, v)| v.trim().parse::<f64>().ok())
        })
        .sum()
}

async fn ensure_crds(client: &Client) -> Result<(), String> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in ringmaster::crdgen::all() {
        let mut body = serde_json::to_value(&crd).map_err(|e| e.to_string())?;
        body["apiVersion"] = "apiextensions.k8s.io/v1".into();
        body["kind"] = "CustomResourceDefinition".into();
        api.patch(
            &crd.name_any(),
            &PatchParams::apply("bench-operator").force(),
            &Patch::Apply(&body),
        )
        .await
        .map_err(|e| format!("applying CRD: {e}"))?;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    Ok(())
}

async fn run(args: Args) -> Result<(), String> {
    let client = ringmaster_e2e::cluster::client()
        .await
        .map_err(|e| e.to_string())?;
    ensure_crds(&client).await?;
    let namespace = format!("bench-{}", std::process::id());
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": namespace}})).unwrap();
    namespaces
        .create(&PostParams::default(), &ns)
        .await
        .map_err(|e| e.to_string())?;

    let mut operator = tokio::process::Command::new(&args.operator)
        .args(["run", "--namespace", &namespace, "--metrics-bind-address"])
        .arg(format!("127.0.0.1:{}", args.metrics_port))
        .env("KUBECONFIG", ringmaster_e2e::cluster::kubeconfig_path())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("starting {}: {e}", args.operator.display()))?;
    let pid = operator.id().ok_or("the operator exited at once")?;
    let ready_deadline = Instant::now() + Duration::from_secs(30);
    while !http_get(args.metrics_port, "/readyz")
        .await
        .is_some_and(|r| r.starts_with("HTTP/1.0 200"))
    {
        if Instant::now() > ready_deadline {
            return Err("the operator did not become ready in 30 s".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let idle_requests = metric_sum(
        &http_get(args.metrics_port, "/metrics")
            .await
            .unwrap_or_default(),
        "ringmaster_kube_requests_total",
    );
    let (idle_cpu, _) = process_usage(pid).unwrap_or_default();

    println!(
        "applying {} TrainingJobs × {} workers at once (namespace {namespace})",
        args.jobs, args.workers
    );
    let jobs: Api<TrainingJob> = Api::namespaced(client.clone(), &namespace);
    let start = Instant::now();
    let applies = (0..args.jobs).map(|i| {
        let jobs = jobs.clone();
        let workers = args.workers;
        async move {
            let job = json!({
                "apiVersion": "ringmaster.dev/v1alpha1", "kind": "TrainingJob",
                "metadata": {"name": format!("bench-{i:04}")},
                "spec": {"workers": workers, "image": "ringmaster-trainer:bench",
                         "trainer": {"model": "resnet18", "steps": 10}},
            });
            jobs.patch(
                &format!("bench-{i:04}"),
                &PatchParams::apply("bench-operator"),
                &Patch::Apply(&job),
            )
            .await
            .map(|_| ())
        }
    });
    for result in futures::future::join_all(applies).await {
        result.map_err(|e| format!("applying a job: {e}"))?;
    }
    let applied = start.elapsed().as_secs_f64();

    // Watch (not poll) the jobs and launchers, so measuring adds next to no load.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let (launchers, launchers_writer) = reflector::store();
    let launcher_watch = watcher(
        pods,
        watcher::Config::default().labels("ringmaster.dev/role=launcher"),
    )
    .reflect(launchers_writer)
    .for_each(|_| async {});
    let (job_store, jobs_writer) = reflector::store::<TrainingJob>();
    let job_watch = watcher(jobs.clone(), watcher::Config::default())
        .reflect(jobs_writer)
        .for_each(|_| async {});
    tokio::spawn(launcher_watch);
    tokio::spawn(job_watch);
    let mut all_launchers = None;
    let mut all_running = None;
    let deadline = start + Duration::from_secs(args.timeout);
    while all_running.is_none() {
        if Instant::now() > deadline {
            return Err(format!("not every job Running after {} s", args.timeout));
        }
        if all_launchers.is_none() && launchers.len() as u32 >= args.jobs {
            all_launchers = Some(start.elapsed().as_secs_f64());
        }
        let running = job_store
            .state()
            .iter()
            .filter(|j| {
                j.status
                    .as_ref()
                    .is_some_and(|s| s.phase == TrainingJobPhase::Running)
            })
            .count();
        if running as u32 >= args.jobs && all_launchers.is_some() {
            all_running = Some(start.elapsed().as_secs_f64());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let metrics = http_get(args.metrics_port, "/metrics")
        .await
        .unwrap_or_default();
    let requests = metric_sum(&metrics, "ringmaster_kube_requests_total") - idle_requests;
    let reconciles = metric_sum(&metrics, "ringmaster_reconcile_total{");
    let (cpu, rss) = process_usage(pid).ok_or("reading /proc of the operator")?;

    println!("jobs applied in                  {applied:8.2} s");
    println!(
        "every launcher exists after      {:8.2} s",
        all_launchers.unwrap_or_default()
    );
    println!(
        "every job Running after          {:8.2} s",
        all_running.unwrap_or_default()
    );
    println!("operator CPU while bringing up   {:8.2} s", cpu - idle_cpu);
    println!("operator peak RSS                {rss:8.1} MiB");
    println!(
        "API requests by the operator     {requests:8.0} ({:.1} per job)",
        requests / f64::from(args.jobs)
    );
    println!(
        "reconciles                       {reconciles:8.0} ({:.1} per job)",
        reconciles / f64::from(args.jobs)
    );

    let _ = operator.kill().await;
    let _ = namespaces
        .delete(&namespace, &DeleteParams::background())
        .await;
    Ok(())
}
