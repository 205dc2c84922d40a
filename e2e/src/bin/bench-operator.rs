//! `bench-operator`: Ringmaster and Kubeflow MPI Operator side by side on the local cluster,
//! in one run. Each operator (a release build, its own process, its own ServiceAccount) is
//! given the same JOBS jobs of WORKERS workers at once, in a fresh namespace, and measured
//! until every job is Running; then the namespace is deleted and the next one goes. A
//! benchmark that prints figures, not a pass/fail test.
//!
//! Figures per operator: seconds until every job is Running, the operator's CPU seconds and
//! peak RSS, the API server's and etcd's CPU seconds meanwhile, and the API requests the
//! operator made, by verb and resource, as the API server's audit log counts them; and the
//! machine around the run (one core's speed at a fixed piece of work, how busy the CPUs were
//! and with which processes, data still on its way to the disk), since every part of the
//! local cluster shares its cores. With
//! `--failures N`, for each Ringmaster: with every job Running, N worker pods fail one after
//! another and the time from each failure to its job's Restarting phase is measured.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use ringmaster::controller::training_job::names;
use ringmaster_e2e::bench::audit::{AuditLog, RequestCounts};
use ringmaster_e2e::bench::contender::{Contender, FLOOR_LABEL, LAUNCHER_PRIORITY_CLASS, Operator};
use ringmaster_e2e::bench::machine::{self, MachineFigures, MachineWatch, Settled};
use ringmaster_e2e::bench::process::Usage;
use ringmaster_e2e::bench::{counter_delta, delta, identity, percentile};
use ringmaster_e2e::nodes::{self, PoolMode, PoolShape};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Brings JOBS jobs × WORKERS workers up with each operator in turn and prints what it cost.
#[derive(Parser, Debug)]
#[command(name = "bench-operator", version)]
struct Args {
    /// A Ringmaster operator binary to measure: PATH, or LABEL=PATH (repeatable: `--ringmaster
    /// 539e17c=... --ringmaster ...` measures an earlier build beside this one in one run).
    #[arg(long = "ringmaster", value_parser = parse_labelled, required = true)]
    ringmasters: Vec<(String, PathBuf)>,
    /// Kubeflow MPI Operator's binary (e2e/tools/peers.sh mpi-operator); measured with every
    /// limit raised, then with its defaults. Its CRD is read from `<PATH>.crd.yaml`.
    #[arg(long)]
    mpi_operator: Option<PathBuf>,
    /// Run the Ringmaster contender of this label (`ringmaster` for an unlabelled one) with
    /// a launcher PriorityClass (made here, as the Helm chart makes its own), as the chart
    /// runs it; repeat for more.
    #[arg(long = "launcher-priority-class-for", value_name = "LABEL")]
    launcher_priority_for: Vec<String>,
    /// Measure MPI Operator with its default limits too (slow: its client sends 5 requests
    /// a second).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    mpi_operator_defaults: bool,
    /// Measure the floor too: the same pods with no operator, each job a ReplicaSet of
    /// WORKERS + 1 pods made by the controller manager. What the cluster itself spends on
    /// them is the least any operator's run can take on this machine; the summary shows each
    /// contender above it.
    #[arg(long)]
    floor: bool,
    /// Jobs to apply at once.
    #[arg(long, default_value_t = 100)]
    jobs: u32,
    /// Workers per job.
    #[arg(long, default_value_t = 4)]
    workers: u32,
    /// Worker failures to time with every job Running (Ringmaster only; 0: none).
    #[arg(long, default_value_t = 0)]
    failures: u32,
    /// Measure every contender this many times, the order reversed each time (the first
    /// contender of one repeat is the last of the next), and report median, min and max.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=20))]
    repeats: u32,
    /// Start every run after the first (each contender in each repeat) on a freshly started
    /// local cluster (e2e/cluster.sh down, then up), so that no run inherits another's etcd,
    /// nodes or watch caches. The API server sizes a new watch's buffer from the traffic its
    /// cache has seen (about one second of it, at least 10 events), so on a cluster shared
    /// within a repeat the contender that went second had its watches' buffers grown by the
    /// first one's pods, and the first had its watches closed as too slow: the order changed
    /// the time. `false`: one cluster for the whole run.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    fresh_cluster: bool,
    /// Before every run, write back what is waiting for the disk and wait until the machine's
    /// CPUs are less busy than this (percent, over 5 s), for at most --settle-seconds: work
    /// left over from before (a build, a cluster starting) would run inside the measured run.
    #[arg(long, default_value_t = 30.0)]
    settle_below: f64,
    /// The longest wait for a quiet machine before a run (0: do not wait, do not write back).
    #[arg(long, default_value_t = 180)]
    settle_seconds: u64,
    /// With every job Running (Ringmaster only): each job's launcher reports its progress
    /// every 15 s for this many seconds, and what that costs is measured (0: no reports).
    #[arg(long, default_value_t = 0)]
    report_seconds: u64,
    /// Port of Ringmaster's progress endpoint (with --report-seconds).
    #[arg(long, default_value_t = 18443)]
    progress_port: u16,
    /// Port of Ringmaster's metrics and readiness.
    #[arg(long, default_value_t = 18089)]
    metrics_port: u16,
    /// Stop waiting for one operator after this many seconds and report how far it got.
    #[arg(long, default_value_t = 900)]
    timeout: u64,
    /// The same for MPI Operator with its defaults, when it should wait less (at 1,000 × 8
    /// its 5 requests a second need over an hour).
    #[arg(long)]
    mpi_operator_defaults_timeout: Option<u64>,
}

/// `PATH` (labelled `ringmaster`) or `LABEL=PATH` (labelled `ringmaster-LABEL`).
fn parse_labelled(text: &str) -> Result<(String, PathBuf), String> {
    let Some((label, path)) = text.split_once('=') else {
        return Ok(("ringmaster".into(), PathBuf::from(text)));
    };
    if label.is_empty()
        || !label
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    {
        return Err(format!(
            "label {label:?}: lowercase letters, digits and '-' only"
        ));
    }
    Ok((format!("ringmaster-{label}"), PathBuf::from(path)))
}

/// What one operator's run came to.
#[derive(Debug, Default)]
struct Figures {
    label: String,
    jobs_running: usize,
    /// Seconds from the first apply until every job was Running; `None` if it timed out.
    all_running: Option<f64>,
    /// Seconds from the first apply until half the jobs were Running: what a typical job
    /// waited, where the last one's wait is the scheduler's whole backlog.
    half_running: Option<f64>,
    /// Seconds the run was measured over.
    measured: f64,
    operator: Usage,
    requests: RequestCounts,
    /// Seconds from a worker's failure to its job's Restarting phase, as the benchmark's
    /// watches saw both.
    failure_to_restarting: Vec<f64>,
    /// Seconds the API server spent answering everyone, and how many requests, by request.
    apiserver_time: BTreeMap<String, (f64, f64)>,
    /// The progress-report phase (`--report-seconds`).
    reporting: Option<Reporting>,
    /// The API server's time by client (flow schema): seconds executing, requests.
    apiserver_by_client: BTreeMap<String, (f64, f64)>,
    /// Watchers the API server closed as too slow during the run, every client's, by
    /// resource ([`ringmaster_e2e::bench::terminated_watchers`]).
    terminated_watchers: BTreeMap<String, f64>,
    /// Which repeat (from 1).
    repeat: u32,
    /// The machine over the run, with every process's CPU seconds.
    machine: MachineFigures,
}

/// The rest of the local cluster, by command name (/proc/PID/comm, cut at 15 bytes), and how
/// the tables name it: what every run's pods cost outside the operator and the API server.
const CLUSTER_PROCESSES: [(&str, &str); 3] = [
    ("kube-controller", "controller manager CPU (s)"),
    ("kube-scheduler", "scheduler CPU (s)"),
    ("kwok-controller", "KWOK (simulated kubelets) CPU (s)"),
];

impl Figures {
    /// The API server's CPU seconds over the run.
    fn apiserver_cpu(&self) -> f64 {
        self.machine.cpu_of("kube-apiserver")
    }

    fn etcd_cpu(&self) -> f64 {
        self.machine.cpu_of("etcd")
    }
}

/// What jobs' progress reports cost, over the report phase.
#[derive(Debug, Default)]
struct Reporting {
    reports: ringmaster_e2e::bench::reports::ReportFigures,
    operator_cpu: f64,
    apiserver_cpu: f64,
    requests: RequestCounts,
    /// Jobs whose status showed reported progress at the end.
    jobs_with_progress: usize,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run(Args::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("bench-operator: {message}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The contenders, in the order of the first repeat: each `--ringmaster`, then MPI Operator
/// (raised, then with its defaults) and the floor when asked for.
fn contenders_of(args: &Args) -> Result<Vec<Contender>, String> {
    let mut contenders: Vec<Contender> = args
        .ringmasters
        .iter()
        .map(|(label, binary)| Contender {
            label: label.clone(),
            operator: Operator::Ringmaster,
            binary: binary.clone(),
            launcher_priority_class: args
                .launcher_priority_for
                .contains(label)
                .then(|| LAUNCHER_PRIORITY_CLASS.to_string()),
        })
        .collect();
    if let Some(unknown) = args
        .launcher_priority_for
        .iter()
        .find(|l| !contenders.iter().any(|c| &c.label == *l))
    {
        return Err(format!(
            "--launcher-priority-class-for {unknown}: no Ringmaster contender has that label"
        ));
    }
    if let Some(binary) = &args.mpi_operator {
        contenders.push(Contender {
            label: "mpi-operator-raised".into(),
            operator: Operator::MpiOperatorRaised,
            binary: binary.clone(),
            launcher_priority_class: None,
        });
        if args.mpi_operator_defaults {
            contenders.push(Contender {
                label: "mpi-operator-defaults".into(),
                operator: Operator::MpiOperatorDefaults,
                binary: binary.clone(),
                launcher_priority_class: None,
            });
        }
    }
    if args.floor {
        contenders.push(Contender {
            label: FLOOR_LABEL.into(),
            operator: Operator::ReplicaSetFloor,
            binary: PathBuf::new(),
            launcher_priority_class: None,
        });
    }
    Ok(contenders)
}

async fn run(args: Args) -> Result<(), String> {
    let client = ringmaster_e2e::cluster::client()
        .await
        .map_err(|e| e.to_string())?;
    let kubeconfig = ringmaster_e2e::cluster::kubeconfig_path();
    let audit = AuditLog::beside(&kubeconfig);
    if !audit.path().exists() {
        return Err(format!(
            "no audit log at {}: restart the cluster (e2e/cluster.sh down; e2e/cluster.sh up) so the API server records the operators' requests",
            audit.path().display()
        ));
    }
    let contenders = contenders_of(&args)?;
    let pods = args.jobs * (args.workers + 1);
    let node_count = pods.div_ceil(100);
    println!(
        "{} jobs × {} workers ({pods} pods) on {node_count} more KWOK nodes; {} in turn",
        args.jobs,
        args.workers,
        contenders
            .iter()
            .map(|c| c.label.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut runs = Vec::new();
    let mut client = client;
    for repeat in 1..=args.repeats {
        // Alternate: every contender goes first in some repeat and last in another.
        let mut order: Vec<&Contender> = contenders.iter().collect();
        if repeat % 2 == 0 {
            order.reverse();
        }
        let names: Vec<&str> = order.iter().map(|c| c.label.as_str()).collect();
        println!(
            "\n=== repeat {repeat} of {}: {}",
            args.repeats,
            names.join(", ")
        );
        let mut all = Vec::new();
        for (place, contender) in order.into_iter().enumerate() {
            let first_run = repeat == 1 && place == 0;
            if args.fresh_cluster && !first_run {
                client = fresh_cluster().await?;
            }
            if args.fresh_cluster || place == 0 {
                prepare(&client, &args, node_count).await?;
            }
            let settled = settle(&args).await;
            let run = Run { repeat, settled };
            let figures = measure(&client, &kubeconfig, &audit, contender, &args, run).await?;
            print_one(&figures, args.jobs);
            all.push(figures);
        }
        all.sort_by_key(|f| contenders.iter().position(|c| c.label == f.label));
        print_table(&all, args.jobs, args.workers);
        runs.extend(all);
        nodes::remove(&client, "bench")
            .await
            .map_err(|e| e.to_string())?;
    }
    if args.repeats > 1 {
        print_summary(&runs, &contenders, &args);
    }
    if !args.launcher_priority_for.is_empty() {
        Api::<k8s_openapi::api::scheduling::v1::PriorityClass>::all(client.clone())
            .delete(LAUNCHER_PRIORITY_CLASS, &Default::default())
            .await
            .map_err(|e| format!("deleting PriorityClass {LAUNCHER_PRIORITY_CLASS}: {e}"))?;
    }
    Ok(())
}

/// What every repeat needs on its cluster: the CRDs, the launchers' PriorityClass when
/// asked for, and the KWOK nodes the jobs' pods go to.
async fn prepare(client: &Client, args: &Args, node_count: u32) -> Result<(), String> {
    if !args.launcher_priority_for.is_empty() {
        apply_launcher_priority_class(client).await?;
    }
    if let Some(binary) = &args.mpi_operator {
        let mut crd = binary.clone().into_os_string();
        crd.push(".crd.yaml");
        apply_crd_file(client, std::path::Path::new(&crd)).await?;
    }
    apply_ringmaster_crds(client).await?;
    let shape =
        PoolShape::new("bench", "Standard_D4s_v5", PoolMode::User).map_err(|e| e.to_string())?;
    nodes::add(client, &shape, node_count)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Waits for a quiet machine (`--settle-below`, `--settle-seconds`) and says how it went.
async fn settle(args: &Args) -> Option<Settled> {
    if args.settle_seconds == 0 {
        return None;
    }
    let settled = machine::settle(
        args.settle_below,
        Duration::from_secs(5),
        Duration::from_secs(args.settle_seconds),
    )
    .await;
    if settled.quiet {
        println!(
            "\nthe machine was quiet after {:.0} s (CPUs {:.0} % busy over 5 s)",
            settled.waited_s, settled.busy_percent
        );
    } else {
        println!(
            "\nthe machine was still {:.0} % busy after {:.0} s: measuring anyway (see the CPU by process below)",
            settled.busy_percent, settled.waited_s
        );
    }
    Some(settled)
}

/// Stops the local cluster and starts it again (e2e/cluster.sh), and a client of the new one.
async fn fresh_cluster() -> Result<Client, String> {
    let root = ringmaster_e2e::cluster::repo_root().map_err(|e| e.to_string())?;
    for step in ["down", "up"] {
        println!("\n(e2e/cluster.sh {step}: a fresh cluster for the next run)");
        let status = tokio::process::Command::new(root.join("e2e/cluster.sh"))
            .arg(step)
            .stdout(std::process::Stdio::null())
            .status()
            .await
            .map_err(|e| format!("running e2e/cluster.sh {step}: {e}"))?;
        if !status.success() {
            return Err(format!("e2e/cluster.sh {step} failed ({status})"));
        }
    }
    ringmaster_e2e::cluster::client()
        .await
        .map_err(|e| e.to_string())
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

async fn apply_crd(client: &Client, body: serde_json::Value) -> Result<(), String> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let name = body["metadata"]["name"]
        .as_str()
        .ok_or("a CRD without a name")?
        .to_string();
    api.patch(
        &name,
        &PatchParams::apply("bench-operator").force(),
        &Patch::Apply(&body),
    )
    .await
    .map_err(|e| format!("applying CRD {name}: {e}"))?;
    Ok(())
}

/// The launchers' PriorityClass, as the Helm chart makes it: ahead of the workers in the
/// scheduler's queue, never preempting.
async fn apply_launcher_priority_class(client: &Client) -> Result<(), String> {
    let class = json!({
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
        "metadata": {"name": LAUNCHER_PRIORITY_CLASS},
        "value": 1000, "preemptionPolicy": "Never", "globalDefault": false,
    });
    Api::<k8s_openapi::api::scheduling::v1::PriorityClass>::all(client.clone())
        .patch(
            LAUNCHER_PRIORITY_CLASS,
            &PatchParams::apply("bench-operator").force(),
            &Patch::Apply(&class),
        )
        .await
        .map(|_| ())
        .map_err(|e| format!("applying PriorityClass {LAUNCHER_PRIORITY_CLASS}: {e}"))
}

async fn apply_ringmaster_crds(client: &Client) -> Result<(), String> {
    for crd in ringmaster::crdgen::all() {
        let mut body = serde_json::to_value(&crd).map_err(|e| e.to_string())?;
        body["apiVersion"] = "apiextensions.k8s.io/v1".into();
        body["kind"] = "CustomResourceDefinition".into();
        apply_crd(client, body).await?;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    Ok(())
}

async fn apply_crd_file(client: &Client, path: &std::path::Path) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        format!(
            "reading MPI Operator's CRD {} (e2e/tools/peers.sh mpi-operator puts it there): {e}",
            path.display()
        )
    })?;
    let body: serde_json::Value =
        serde_saphyr::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    apply_crd(client, body).await
}

/// Deletes `namespace` if it exists and waits until it is gone.
async fn delete_namespace(client: &Client, namespace: &str) -> Result<(), String> {
    let api: Api<Namespace> = Api::all(client.clone());
    let deadline = Instant::now() + Duration::from_secs(900);
    match api.delete(namespace, &DeleteParams::background()).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
        Err(e) => return Err(format!("deleting namespace {namespace}: {e}")),
    }
    while api
        .get_opt(namespace)
        .await
        .map_err(|e| e.to_string())?
        .is_some()
    {
        if Instant::now() > deadline {
            return Err(format!("namespace {namespace} still there after 900 s"));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    Ok(())
}

/// Waits until the operator can take jobs: Ringmaster's readiness (its caches synced), MPI
/// Operator's leader-election lock taken (its informers start right after).
async fn wait_ready(
    client: &Client,
    contender: &Contender,
    namespace: &str,
    metrics_port: u16,
) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let leases: Api<Lease> = Api::namespaced(client.clone(), namespace);
    loop {
        let ready = match contender.operator {
            Operator::Ringmaster => http_get(metrics_port, "/readyz")
                .await
                .is_some_and(|r| r.starts_with("HTTP/1.0 200")),
            Operator::MpiOperatorDefaults | Operator::MpiOperatorRaised => leases
                .get_opt("mpi-operator")
                .await
                .ok()
                .flatten()
                .and_then(|l| l.spec)
                .and_then(|s| s.holder_identity)
                .is_some_and(|h| !h.is_empty()),
            Operator::ReplicaSetFloor => true,
        };
        if ready {
            if contender.operator != Operator::Ringmaster {
                // Its informers list an empty namespace once it leads.
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("{} was not ready after 60 s", contender.label));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Which run this is, and how the machine settled before it.
struct Run {
    repeat: u32,
    settled: Option<Settled>,
}

/// Whether the contender's launchers report progress after the run (`--report-seconds`,
/// Ringmaster only: MPI Operator has no progress reports).
fn reports_wanted(args: &Args, contender: &Contender) -> bool {
    args.report_seconds > 0 && contender.operator == Operator::Ringmaster
}

/// One contender's run: its operator started in a fresh namespace, JOBS jobs applied at once,
/// timed until every job is Running (or `--timeout`), with the machine, the API server and
/// the operator's requests measured over it; then the failure and report phases when asked.
async fn measure(
    client: &Client,
    kubeconfig: &std::path::Path,
    audit: &AuditLog,
    contender: &Contender,
    args: &Args,
    run: Run,
) -> Result<Figures, String> {
    let namespace = format!("bench-{}", contender.label);
    fresh_namespace(client, &namespace).await?;
    let mut operator = start_operator(client, kubeconfig, contender, args, &namespace).await?;
    // None for the floor, which has no operator process.
    let usage =
        |operator: &Option<RunningOperator>| operator.as_ref().and_then(|o| Usage::of(o.pid));

    let resource = contender.job_resource();
    let jobs: Api<DynamicObject> = Api::namespaced_with(client.clone(), &namespace, &resource);
    let job_writer = reflector::store::Writer::<DynamicObject>::new(resource.clone());
    let job_store = job_writer.as_reader();
    let watch = watcher(jobs.clone(), watcher::Config::default())
        .default_backoff()
        .reflect(job_writer)
        .for_each(|_| async {});
    let watch = tokio::spawn(watch);
    job_store
        .wait_until_ready()
        .await
        .map_err(|e| e.to_string())?;

    let machine = MachineWatch::start(run.settled)
        .await
        .map_err(|e| e.to_string())?;
    let (apiserver_time_before, by_client_before, closed_before) = apiserver_time(client).await;
    let mark = audit.mark();
    let operator_before = usage(&operator).unwrap_or_default();
    let start = Instant::now();
    apply_jobs(&jobs, contender, args).await?;
    let progress = wait_for_running(&job_store, contender, args, start).await;
    let machine = machine.finish();
    let (apiserver_time_after, by_client_after, closed_after) = apiserver_time(client).await;
    let operator_after = usage(&operator).unwrap_or_default();
    // The audit log is appended as each response completes: give the last ones a moment.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let requests = match &operator {
        Some(operator) => audit
            .requests_since(mark, &operator.identity.username)
            .map_err(|e| format!("reading {}: {e}", audit.path().display()))?,
        None => RequestCounts::default(),
    };

    let failure_to_restarting = if contender.operator == Operator::Ringmaster
        && progress.all_running.is_some()
        && args.failures > 0
    {
        time_failures(client, &namespace, &job_store, &resource, args).await?
    } else {
        Vec::new()
    };
    let reporting = match &operator {
        Some(operator) if reports_wanted(args, contender) && progress.all_running.is_some() => {
            let (pid, identity) = (operator.pid, &operator.identity.username);
            let measured =
                measure_reports(client, audit, pid, &namespace, &job_store, identity, args);
            Some(measured.await?)
        }
        _ => None,
    };
    let peak = usage(&operator).unwrap_or(operator_after).peak_rss_mib;
    if let Some(operator) = &mut operator {
        let _ = operator.child.kill().await;
    }
    watch.abort();
    delete_namespace(client, &namespace).await?;
    Ok(Figures {
        label: contender.label.clone(),
        jobs_running: progress.jobs_running,
        all_running: progress.all_running,
        half_running: progress.half_running,
        measured: progress.measured,
        operator: Usage {
            cpu_seconds: operator_after.cpu_seconds - operator_before.cpu_seconds,
            peak_rss_mib: peak,
        },
        requests,
        failure_to_restarting,
        apiserver_time: delta(&apiserver_time_before, apiserver_time_after),
        reporting,
        apiserver_by_client: delta(&by_client_before, by_client_after),
        terminated_watchers: counter_delta(&closed_before, closed_after),
        repeat: run.repeat,
        machine,
    })
}

/// Deletes `namespace` if an earlier run left it, and makes it again, empty.
async fn fresh_namespace(client: &Client, namespace: &str) -> Result<(), String> {
    delete_namespace(client, namespace).await?;
    let ns = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}});
    Api::<Namespace>::all(client.clone())
        .patch(
            namespace,
            &PatchParams::apply("bench-operator"),
            &Patch::Apply(&ns),
        )
        .await
        .map(|_| ())
        .map_err(|e| format!("making namespace {namespace}: {e}"))
}

/// A contender's operator process, running as its own ServiceAccount.
struct RunningOperator {
    child: tokio::process::Child,
    pid: u32,
    identity: identity::Identity,
}

/// Starts the contender's operator on `namespace` with its own identity and log, and waits
/// until it can take jobs; none for the floor.
async fn start_operator(
    client: &Client,
    kubeconfig: &std::path::Path,
    contender: &Contender,
    args: &Args,
    namespace: &str,
) -> Result<Option<RunningOperator>, String> {
    if !contender.has_operator() {
        println!(
            "\n== {} (no operator: the controller manager's ReplicaSet controller makes the pods) in namespace {namespace}",
            contender.label
        );
        return Ok(None);
    }
    let progress_port = reports_wanted(args, contender).then_some(args.progress_port);
    let identity = identity::for_operator(client, kubeconfig, &contender.label, 4)
        .await
        .map_err(|e| e.to_string())?;
    let log_path = kubeconfig.with_file_name(format!("bench-{}.log", contender.label));
    let log = std::fs::File::create(&log_path)
        .map_err(|e| format!("creating {}: {e}", log_path.display()))?;
    let child = contender
        .command(
            &identity.kubeconfig,
            namespace,
            args.metrics_port,
            progress_port,
            log,
        )
        .ok_or_else(|| format!("{} has no operator to start", contender.label))?
        .spawn()
        .map_err(|e| format!("starting {}: {e}", contender.binary.display()))?;
    let pid = child.id().ok_or("the operator exited at once")?;
    wait_ready(client, contender, namespace, args.metrics_port).await?;
    println!(
        "\n== {} ({}) in namespace {namespace}; its log: {}",
        contender.label,
        contender.binary.display(),
        log_path.display()
    );
    Ok(Some(RunningOperator {
        child,
        pid,
        identity,
    }))
}

/// Applies every job at once (64 requests in flight), as a user's `kubectl apply` of a
/// directory would.
async fn apply_jobs(
    jobs: &Api<DynamicObject>,
    contender: &Contender,
    args: &Args,
) -> Result<(), String> {
    let start = Instant::now();
    let applies = futures::stream::iter(0..args.jobs)
        .map(|i| {
            let name = job_name(i);
            let body = contender.job(&name, args.workers);
            async move {
                jobs.patch(
                    &name,
                    &PatchParams::apply("bench-operator"),
                    &Patch::Apply(&body),
                )
                .await
                .map(|_| ())
                .map_err(|e| format!("applying {name}: {e}"))
            }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await;
    applies.into_iter().collect::<Result<Vec<()>, String>>()?;
    println!(
        "applied {} jobs in {:.2} s",
        args.jobs,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// How far the jobs got, seconds from the first apply.
struct Progress {
    /// Until every job was Running; `None` if the benchmark stopped waiting.
    all_running: Option<f64>,
    half_running: Option<f64>,
    jobs_running: usize,
    /// How long it watched.
    measured: f64,
}

/// Watches the jobs until every one is Running or the contender's timeout passes, saying
/// how many are Running every 30 s.
async fn wait_for_running(
    job_store: &Store<DynamicObject>,
    contender: &Contender,
    args: &Args,
    start: Instant,
) -> Progress {
    let timeout = match (&contender.operator, args.mpi_operator_defaults_timeout) {
        (Operator::MpiOperatorDefaults, Some(seconds)) => seconds,
        _ => args.timeout,
    };
    let deadline = start + Duration::from_secs(timeout);
    let mut last_report = Instant::now();
    let mut half_running = None;
    loop {
        let running = job_store
            .state()
            .iter()
            .filter(|j| contender.is_running(j))
            .count();
        let seconds = start.elapsed().as_secs_f64();
        if half_running.is_none() && 2 * running as u32 >= args.jobs {
            half_running = Some(seconds);
        }
        let all = running as u32 >= args.jobs;
        if all || Instant::now() > deadline {
            return Progress {
                all_running: all.then_some(seconds),
                half_running,
                jobs_running: running,
                measured: seconds,
            };
        }
        if last_report.elapsed() > Duration::from_secs(30) {
            println!("  {running}/{} Running after {seconds:.0} s", args.jobs);
            last_report = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every job's launcher reports for `--report-seconds`; the operator's and the API server's
/// CPU and the operator's API requests meanwhile, and how many jobs' status shows progress.
async fn measure_reports(
    client: &Client,
    audit: &AuditLog,
    pid: u32,
    namespace: &str,
    job_store: &Store<DynamicObject>,
    username: &str,
    args: &Args,
) -> Result<Reporting, String> {
    use ringmaster_contract::progress::DEFAULT_INTERVAL_SECONDS;
    let mark = audit.mark();
    let operator_before = Usage::of(pid).unwrap_or_default();
    let machine = MachineWatch::start(None).await.map_err(|e| e.to_string())?;
    let interval = Duration::from_secs(DEFAULT_INTERVAL_SECONDS);
    let reports =
        ringmaster_e2e::bench::reports::run(client, namespace, args.report_seconds, interval)
            .await?;
    let operator_after = Usage::of(pid).unwrap_or_default();
    let machine = machine.finish();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let requests = audit
        .requests_since(mark, username)
        .map_err(|e| format!("reading {}: {e}", audit.path().display()))?;
    let jobs_with_progress = job_store
        .state()
        .iter()
        .filter(|j| {
            j.data["status"]["progress"]["step"]
                .as_u64()
                .is_some_and(|s| s > 0)
        })
        .count();
    Ok(Reporting {
        reports,
        operator_cpu: operator_after.cpu_seconds - operator_before.cpu_seconds,
        apiserver_cpu: machine.cpu_of("kube-apiserver"),
        requests,
        jobs_with_progress,
    })
}

fn print_reporting(r: &Reporting, jobs: u32) {
    let f = &r.reports;
    let mut latencies = f.latencies.clone();
    latencies.sort_by(f64::total_cmp);
    let at =
        |p: f64| percentile(&latencies, p).map_or("-".into(), |s| format!("{:.1} ms", s * 1000.0));
    println!(
        "progress reports: {jobs} jobs, every 15 s, over {:.0} s",
        f.seconds
    );
    println!(
        "  reports sent / accepted        {:8} / {}",
        f.sent, f.accepted
    );
    if let Some(error) = &f.first_error {
        println!("  first refusal or error: {error}");
    }
    println!(
        "  report latency p50 / p99       {} / {}",
        at(50.0),
        at(99.0)
    );
    println!(
        "  reports per second             {:8.1}",
        f.sent as f64 / f.seconds
    );
    println!(
        "  operator CPU                   {:8.2} s ({:.1} ms per report)",
        r.operator_cpu,
        1000.0 * r.operator_cpu / f.accepted.max(1) as f64
    );
    println!("  API server CPU                 {:8.2} s", r.apiserver_cpu);
    println!(
        "  operator's API requests        {:8} ({:.2} per second)",
        r.requests.total(),
        r.requests.total() as f64 / f.seconds
    );
    for (what, n) in &r.requests.0 {
        println!(
            "    {what:<40} {n:7} ({:.2} per job)",
            *n as f64 / f64::from(jobs)
        );
    }
    println!(
        "  jobs whose status shows progress {} of {jobs}",
        r.jobs_with_progress
    );
}

/// The API server's time by request and by client, and the watchers it closed as too slow,
/// from its /metrics (see
/// [`ringmaster_e2e::bench::apiserver_time_by_request`] and `…_by_client`).
async fn apiserver_time(client: &Client) -> (TimeBy, TimeBy, BTreeMap<String, f64>) {
    let request = http::Request::get("/metrics")
        .body(Vec::new())
        .expect("a GET request");
    let text = client.request_text(request).await.unwrap_or_default();
    (
        ringmaster_e2e::bench::apiserver_time_by_request(&text),
        ringmaster_e2e::bench::apiserver_time_by_client(&text),
        ringmaster_e2e::bench::terminated_watchers(&text),
    )
}

/// Seconds and requests, by request or by client.
type TimeBy = BTreeMap<String, (f64, f64)>;

/// Every contender over the repeats: median [min–max] of each figure, the spread of its
/// time to all Running, and the API server's per-client profile of its slowest and fastest
/// repeat.
fn print_summary(runs: &[Figures], contenders: &[Contender], args: &Args) {
    let jobs = f64::from(args.jobs);
    println!(
        "\n{} jobs × {} workers, {} repeats (order alternated{}): median [min–max]\n",
        args.jobs,
        args.workers,
        args.repeats,
        if args.fresh_cluster {
            ", a fresh cluster for every run"
        } else {
            ""
        }
    );
    let of = |label: &str| -> Vec<&Figures> { runs.iter().filter(|f| f.label == label).collect() };
    let mut header = String::from("| |");
    let mut rule = String::from("|---|");
    for c in contenders {
        header.push_str(&format!(" {} |", c.label));
        rule.push_str("---:|");
    }
    println!("{header}\n{rule}");
    let row = |name: &str, value: &dyn Fn(&Figures) -> Option<f64>, digits: usize| {
        let cells: String = contenders
            .iter()
            .map(|c| {
                let values: Vec<f64> = of(&c.label).into_iter().filter_map(value).collect();
                match ringmaster_e2e::bench::spread(&values) {
                    Some((m, lo, hi)) => format!(" {m:.digits$} [{lo:.digits$}–{hi:.digits$}] |"),
                    None => " – |".into(),
                }
            })
            .collect();
        println!("| {name} |{cells}");
    };
    row("every job Running after (s)", &|f| f.all_running, 1);
    row("half the jobs Running after (s)", &|f| f.half_running, 1);
    row("operator CPU (s)", &|f| Some(f.operator.cpu_seconds), 1);
    row(
        "operator peak RSS (MiB)",
        &|f| Some(f.operator.peak_rss_mib),
        0,
    );
    row("API server CPU (s)", &|f| Some(f.apiserver_cpu()), 1);
    row("etcd CPU (s)", &|f| Some(f.etcd_cpu()), 1);
    for (command, name) in CLUSTER_PROCESSES {
        row(name, &|f| Some(f.machine.cpu_of(command)), 1);
    }
    row(
        "pod watches closed as too slow (every client)",
        &|f| {
            Some(
                f.terminated_watchers
                    .get("pods")
                    .copied()
                    .unwrap_or_default(),
            )
        },
        0,
    );
    row(
        "API requests per job",
        &|f| Some(f.requests.total() as f64 / jobs),
        1,
    );
    row(
        "one core's fixed work before the run (ms)",
        &|f| Some(f.machine.calibration_ms),
        0,
    );
    row("CPUs busy (%)", &|f| Some(f.machine.shares.busy_percent), 0);
    row(
        "CPUs waiting for the disk (%)",
        &|f| Some(f.machine.shares.iowait_percent),
        1,
    );
    let ratios: String = contenders
        .iter()
        .map(|c| {
            let times: Vec<f64> = of(&c.label).iter().filter_map(|f| f.all_running).collect();
            match ringmaster_e2e::bench::spread(&times) {
                Some((_, lo, hi)) if lo > 0.0 => format!(" {:.2} |", hi / lo),
                _ => " – |".into(),
            }
        })
        .collect();
    println!("| max/min of every job Running |{ratios}");
    print_above_floor(runs, contenders);
    for c in contenders {
        let mut timed: Vec<&Figures> = of(&c.label)
            .into_iter()
            .filter(|f| f.all_running.is_some())
            .collect();
        timed.sort_by(|a, b| {
            a.all_running
                .partial_cmp(&b.all_running)
                .expect("finite times")
        });
        let ends = [("fastest", timed.first()), ("slowest", timed.last())];
        for (which, figures) in ends {
            if let Some(f) = figures {
                print_client_profile(&c.label, which, f);
            }
        }
    }
}

/// One figure of a run, where the run has it.
type FigureOf = dyn Fn(&Figures) -> Option<f64>;

/// With the floor measured: each contender's median time to every job Running and API-server
/// CPU above the floor's median, the part an operator adds and can change.
fn print_above_floor(runs: &[Figures], contenders: &[Contender]) {
    let median = |label: &str, value: &FigureOf| {
        let values: Vec<f64> = runs
            .iter()
            .filter(|f| f.label == label)
            .filter_map(value)
            .collect();
        ringmaster_e2e::bench::spread(&values).map(|(m, _, _)| m)
    };
    let measures: [(&str, &FigureOf); 2] = [
        ("every job Running, above the floor (s)", &|f| f.all_running),
        ("API server CPU, above the floor (s)", &|f| {
            Some(f.apiserver_cpu())
        }),
    ];
    for (name, value) in measures {
        let Some(floor) = median(FLOOR_LABEL, value) else {
            continue;
        };
        let cells: String = contenders
            .iter()
            .map(|c| match median(&c.label, value) {
                Some(m) => format!(" {:.1} |", m - floor),
                None => " – |".into(),
            })
            .collect();
        println!("| {name} |{cells}");
    }
}

/// The API server's time by client during one run.
fn print_client_profile(label: &str, which: &str, f: &Figures) {
    println!(
        "\nAPI server's time by client, {label}'s {which} repeat (repeat {}, {:.1} s to all Running):",
        f.repeat,
        f.all_running.unwrap_or(f.measured)
    );
    if f.apiserver_by_client.is_empty() {
        // kwokctl's --disable-qps-limits (e2e/cluster.sh) starts the API server with
        // --enable-priority-and-fairness=false, and with it go the flowcontrol metrics.
        println!(
            "  none: the API server publishes no apiserver_flowcontrol_request_execution_seconds \
             (API Priority and Fairness is off on the local cluster: kwokctl --disable-qps-limits); \
             the time by request above is all there is"
        );
        return;
    }
    let mut clients: Vec<(&String, &(f64, f64))> = f.apiserver_by_client.iter().collect();
    clients.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
    for (flow, (seconds, requests)) in clients.into_iter().take(8) {
        println!("  {flow:<32} {seconds:8.1} s executing, {requests:8.0} requests");
    }
}

fn job_name(index: u32) -> String {
    format!("bench-{index:04}")
}

/// Fails worker 0 of `args.failures` jobs spread over the run, one after another, and times
/// each from the pod's Failed phase to its job's Restarting phase, both as this benchmark's
/// watches saw them (so both carry the same watch delay).
async fn time_failures(
    client: &Client,
    namespace: &str,
    job_store: &Store<DynamicObject>,
    resource: &kube::api::ApiResource,
    args: &Args,
) -> Result<Vec<f64>, String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let (pod_store, writer) = reflector::store::<Pod>();
    let config =
        watcher::Config::default().labels(&format!("{}={}", names::ROLE_LABEL, names::WORKER_ROLE));
    let watch = tokio::spawn(
        watcher(pods.clone(), config)
            .default_backoff()
            .reflect(writer)
            .for_each(|_| async {}),
    );
    pod_store
        .wait_until_ready()
        .await
        .map_err(|e| e.to_string())?;
    println!(
        "failing {} workers one after another, {} jobs Running",
        args.failures, args.jobs
    );
    let mut latencies = Vec::new();
    for k in 0..args.failures {
        let job = job_name(k * args.jobs / args.failures);
        let pod = names::worker_pod(&job, 0);
        let fail = json!({"metadata": {"annotations": {
            "kwok.ringmaster.dev/exit-code": "1",
            "kwok.ringmaster.dev/reason": "Error",
        }}});
        pods.patch(&pod, &PatchParams::default(), &Patch::Merge(&fail))
            .await
            .map_err(|e| format!("failing pod {pod}: {e}"))?;
        let pod_ref = ObjectRef::<Pod>::new(&pod).within(namespace);
        let job_ref =
            ObjectRef::<DynamicObject>::new_with(&job, resource.clone()).within(namespace);
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut failed_at = None;
        loop {
            if failed_at.is_none()
                && pod_store.get(&pod_ref).is_some_and(|p| {
                    p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed")
                })
            {
                failed_at = Some(Instant::now());
            }
            let restarting = job_store
                .get(&job_ref)
                .is_some_and(|j| j.data["status"]["phase"] == "Restarting");
            if let (Some(failed), true) = (failed_at, restarting) {
                latencies.push(failed.elapsed().as_secs_f64());
                break;
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "job {job} did not reach Restarting within 120 s of failing {pod}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    watch.abort();
    Ok(latencies)
}

fn print_one(f: &Figures, jobs: u32) {
    if let Some(reporting) = &f.reporting {
        print_reporting(reporting, jobs);
    }
    match f.all_running {
        Some(s) => println!("every job Running after          {s:8.2} s"),
        None => println!(
            "{}/{jobs} jobs Running when the benchmark stopped waiting, at {:.0} s",
            f.jobs_running, f.measured
        ),
    }
    if let Some(s) = f.half_running {
        println!("half the jobs Running after      {s:8.2} s");
    }
    println!(
        "operator CPU                     {:8.2} s",
        f.operator.cpu_seconds
    );
    println!(
        "operator peak RSS                {:8.1} MiB",
        f.operator.peak_rss_mib
    );
    println!(
        "API server CPU                   {:8.2} s",
        f.apiserver_cpu()
    );
    println!("etcd CPU                         {:8.2} s", f.etcd_cpu());
    print_machine(&f.machine);
    let closed: Vec<String> = f
        .terminated_watchers
        .iter()
        .map(|(resource, n)| format!("{resource} {n:.0}"))
        .collect();
    println!(
        "watches the API server closed as too slow (every client): {}",
        if closed.is_empty() {
            "none".to_string()
        } else {
            closed.join(", ")
        }
    );
    println!(
        "API requests (audit log)         {:8} ({:.1} per job)",
        f.requests.total(),
        f.requests.total() as f64 / f64::from(jobs)
    );
    for (what, n) in &f.requests.0 {
        println!(
            "  {what:<40} {n:7} ({:.2} per job)",
            *n as f64 / f64::from(jobs)
        );
    }
    let mut busiest: Vec<_> = f.apiserver_time.iter().collect();
    busiest.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
    println!("API server time answering, every client (top 8):");
    for (what, (seconds, count)) in busiest.into_iter().take(8) {
        println!("  {what:<40} {seconds:8.1} s  {count:7.0} requests");
    }
    if !f.failure_to_restarting.is_empty() {
        println!(
            "worker failure → Restarting      p50 {:.3} s, p99 {:.3} s, max {:.3} s over {}",
            percentile(&f.failure_to_restarting, 50.0).unwrap_or_default(),
            percentile(&f.failure_to_restarting, 99.0).unwrap_or_default(),
            percentile(&f.failure_to_restarting, 100.0).unwrap_or_default(),
            f.failure_to_restarting.len()
        );
    }
}

fn print_machine(m: &MachineFigures) {
    if let Some(s) = m.settled {
        println!(
            "before the run: waited {:.0} s for a quiet machine ({}, CPUs {:.0} % busy)",
            s.waited_s,
            if s.quiet { "quiet" } else { "not quiet" },
            s.busy_percent
        );
    }
    println!(
        "the machine: one core's fixed work took {:.0} ms before the run; over it the CPUs were \
         {:.0} % busy, {:.1} % waiting for the disk, {:.1} % taken by the hypervisor; \
         {:.0} MiB dirty and {:.0} MiB in writeback at the start",
        m.calibration_ms,
        m.shares.busy_percent,
        m.shares.iowait_percent,
        m.shares.steal_percent,
        m.unwritten_at_start.dirty_mib,
        m.unwritten_at_start.writeback_mib
    );
    println!("CPU by process over the run (top 8):");
    for (name, seconds) in m.cpu_by_command.iter().take(8) {
        println!("  {name:<32} {seconds:8.1} s");
    }
}

/// The side-by-side table (Markdown), one column per operator.
fn print_table(all: &[Figures], jobs: u32, workers: u32) {
    println!("\n{jobs} jobs × {workers} workers, one run:\n");
    let mut header = String::from("| |");
    let mut rule = String::from("|---|");
    for f in all {
        header.push_str(&format!(" {} |", f.label));
        rule.push_str("---:|");
    }
    println!("{header}\n{rule}");
    let row = |name: &str, cell: &dyn Fn(&Figures) -> String| {
        let cells: String = all.iter().map(|f| format!(" {} |", cell(f))).collect();
        println!("| {name} |{cells}");
    };
    row("every job Running after (s)", &|f| match f.all_running {
        Some(s) => format!("{s:.1}"),
        None => format!("{}/{jobs} at {:.0}", f.jobs_running, f.measured),
    });
    row("half the jobs Running after (s)", &|f| {
        f.half_running
            .map_or_else(|| "–".to_string(), |s| format!("{s:.1}"))
    });
    row("operator CPU (s)", &|f| {
        format!("{:.1}", f.operator.cpu_seconds)
    });
    row("operator peak RSS (MiB)", &|f| {
        format!("{:.0}", f.operator.peak_rss_mib)
    });
    row("API server CPU (s)", &|f| {
        format!("{:.1}", f.apiserver_cpu())
    });
    row("API server CPU per job (ms)", &|f| {
        format!("{:.1}", 1000.0 * f.apiserver_cpu() / f64::from(jobs))
    });
    row("etcd CPU (s)", &|f| format!("{:.1}", f.etcd_cpu()));
    for (command, name) in CLUSTER_PROCESSES {
        row(name, &|f| format!("{:.1}", f.machine.cpu_of(command)));
    }
    row("one core's fixed work before the run (ms)", &|f| {
        format!("{:.0}", f.machine.calibration_ms)
    });
    row("CPUs busy / disk wait / stolen (%)", &|f| {
        let s = f.machine.shares;
        format!(
            "{:.0} / {:.1} / {:.1}",
            s.busy_percent, s.iowait_percent, s.steal_percent
        )
    });
    row("wait for a quiet machine before (s)", &|f| {
        f.machine
            .settled
            .map_or_else(|| "–".to_string(), |s| format!("{:.0}", s.waited_s))
    });
    row("dirty + writeback at the start (MiB)", &|f| {
        let u = f.machine.unwritten_at_start;
        format!("{:.0}", u.dirty_mib + u.writeback_mib)
    });
    row("API requests per job", &|f| {
        format!("{:.1}", f.requests.total() as f64 / f64::from(jobs))
    });
    let mut kinds: BTreeMap<&str, ()> = BTreeMap::new();
    for f in all {
        for what in f.requests.0.keys() {
            kinds.insert(what, ());
        }
    }
    for what in kinds.keys() {
        row(&format!("  {what}"), &|f| {
            let n = f.requests.0.get(*what).copied().unwrap_or(0);
            format!("{:.2}", n as f64 / f64::from(jobs))
        });
    }
    if all.iter().any(|f| !f.failure_to_restarting.is_empty()) {
        row("worker failure → Restarting p50 / p99 (ms)", &|f| match (
            percentile(&f.failure_to_restarting, 50.0),
            percentile(&f.failure_to_restarting, 99.0),
        ) {
            (Some(p50), Some(p99)) => format!("{:.0} / {:.0}", p50 * 1000.0, p99 * 1000.0),
            _ => "–".into(),
        });
    }
}
