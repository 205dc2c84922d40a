//! `ringmaster`: the operator (`run`) and its tools (`crd`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use ringmaster::controller::{self, Context, OperatorConfig, Scope};
use ringmaster::crdgen;
use ringmaster::metrics::Metrics;
use ringmaster::server::{self, ServerState};
use ringmaster::telemetry::{self, LogFormat};

/// Ringmaster runs distributed deep-learning training on Kubernetes: DataStages copy
/// datasets from Azure Blob Storage onto NFS, TrainingJobs run MPI training on GPU nodes.
#[derive(Parser, Debug)]
#[command(name = "ringmaster", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the operator: the TrainingJob and DataStage controllers, with metrics and health
    /// endpoints. Connects with the in-cluster ServiceAccount, or $KUBECONFIG / ~/.kube/config.
    // Boxed: the operator's settings are large beside the other commands' arguments.
    Run(Box<RunArgs>),
    /// Copy every blob under a prefix of an Azure Blob container into a folder: parallel,
    /// resumable (files already there and intact are skipped), atomic per file. What a
    /// DataStage's Job runs; works on a workstation too. Credentials come from the
    /// environment only: $AZURE_STORAGE_SAS_TOKEN, $AZURE_STORAGE_ACCOUNT_KEY, workload or
    /// managed identity. Prints a JSON summary.
    Stage(ringmaster::stage::StageArgs),
    /// Print the CustomResourceDefinitions as YAML (or write one file each with --output-dir).
    Crd {
        /// Write `<name>.yaml` per CRD into this folder instead of printing.
        #[arg(long, value_name = "DIR")]
        output_dir: Option<PathBuf>,
        /// Also write the API reference (Markdown, every field of both kinds) to this file.
        #[arg(long, value_name = "FILE")]
        api_reference: Option<PathBuf>,
    },
}

/// Whose PodGroups the gang scheduler reads (`--gang-scheduler-api`).
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum GangSchedulerApi {
    /// scheduler-plugins' Coscheduling: `scheduling.x-k8s.io/v1alpha1` PodGroups.
    SchedulerPlugins,
    /// Volcano: `scheduling.volcano.sh/v1beta1` PodGroups.
    Volcano,
}

impl GangSchedulerApi {
    fn api(self) -> ringmaster::gang::GangApi {
        match self {
            GangSchedulerApi::SchedulerPlugins => ringmaster::gang::GangApi::SchedulerPlugins,
            GangSchedulerApi::Volcano => ringmaster::gang::GangApi::Volcano,
        }
    }
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// Address for /metrics, /healthz and /readyz. In a pod, use 0.0.0.0:8080.
    #[arg(
        long,
        env = "RINGMASTER_METRICS_BIND_ADDRESS",
        default_value = "127.0.0.1:8080"
    )]
    metrics_bind_address: SocketAddr,
    /// Log format.
    #[arg(long, env = "RINGMASTER_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Watch one namespace only (default: all namespaces).
    #[arg(long, env = "RINGMASTER_NAMESPACE")]
    namespace: Option<String>,
    /// Seconds to wait before starting a failed TrainingJob's gang again; doubles with each
    /// restart, up to 5 minutes.
    #[arg(
        long,
        env = "RINGMASTER_RESTART_BACKOFF_SECONDS",
        default_value_t = 10.0
    )]
    restart_backoff_seconds: f64,
    /// TrainingJobs reconciled at once. Each reconcile makes its gang's pods concurrently over
    /// connections of their own (the Kubernetes client speaks HTTP/1.1), so this bounds the
    /// operator's connections and memory when thousands of jobs arrive at once; the API
    /// server, not this, is what limits how fast they start.
    #[arg(
        long,
        env = "RINGMASTER_MAX_CONCURRENT_RECONCILES",
        default_value_t = 16,
        value_parser = clap::value_parser!(u16).range(1..)
    )]
    max_concurrent_reconciles: u16,
    /// Queue TrainingJobs labelled `kueue.x-k8s.io/queue-name` in Kueue: each gets a Workload
    /// and runs only while Kueue admits it. Needs Kueue's CRDs, and Kueue configured with
    /// `integrations.externalFrameworks: ["TrainingJob.v1alpha1.ringmaster.dev"]`. Off, a
    /// labelled job is not started (its Admitted condition says why).
    #[arg(long, env = "RINGMASTER_KUEUE")]
    kueue: bool,
    /// Gang-schedule TrainingJobs with this scheduler: a scheduler-plugins scheduler running
    /// the Coscheduling plugin (`scheduler-plugins-scheduler` as its chart installs it) or
    /// Volcano's (`volcano`). Each job gets a PodGroup of that scheduler's API and its pods
    /// that `schedulerName`, so all its workers are placed at once or none is. Unset: the
    /// cluster's default scheduler places pods one by one.
    #[arg(
        long,
        env = "RINGMASTER_GANG_SCHEDULER",
        value_name = "SCHEDULER_NAME",
        value_parser = clap::builder::NonEmptyStringValueParser::new()
    )]
    gang_scheduler: Option<String>,
    /// Whose PodGroups the gang scheduler reads: `scheduler-plugins`
    /// (`scheduling.x-k8s.io/v1alpha1`) or `volcano` (`scheduling.volcano.sh/v1beta1`).
    /// Default: `volcano` for a scheduler named `volcano`, `scheduler-plugins` otherwise.
    #[arg(
        long,
        env = "RINGMASTER_GANG_SCHEDULER_API",
        value_enum,
        requires = "gang_scheduler"
    )]
    gang_scheduler_api: Option<GangSchedulerApi>,
    /// PriorityClass of every launcher whose job sets none (`launcher.priorityClassName`).
    /// A launcher is made once its job's workers are ready, so without it the launcher waits
    /// behind every pod the scheduler has queued meanwhile, and the ready workers' GPUs idle;
    /// a class above the workers' puts it first. Make it with `preemptionPolicy: Never` (the
    /// Helm chart's `launcherPriorityClass.create=true` makes one so) so that it never evicts
    /// anything. Not used with a gang scheduler. Unset: launchers get the cluster's default
    /// priority.
    #[arg(
        long,
        env = "RINGMASTER_LAUNCHER_PRIORITY_CLASS",
        value_name = "PRIORITY_CLASS",
        value_parser = clap::builder::NonEmptyStringValueParser::new()
    )]
    launcher_priority_class: Option<String>,
    /// Where DataStages may write, as JSON (the Helm chart renders `dataStage.destinations`):
    /// `{"nfs": [{"server", "path", "mountOptions"?, "namespaces"?}], "azureFileNfs":
    /// [{"storageAccount", "shareName", "resourceGroup"?, "mountOptions"?, "namespaces"}]}`.
    /// Namespace N may stage into an NFS export only under `<path>/<N>`, into a share only
    /// when listed. Unset: only `destination.existingClaim`.
    #[arg(long, env = "RINGMASTER_DATA_STAGE_DESTINATIONS", value_name = "JSON", value_parser = parse_destinations)]
    data_stage_destinations:
        Option<ringmaster::controller::data_stage::destinations::AllowedDestinations>,
    /// Image of a DataStage's copy Job; it runs `ringmaster stage`, so it is the operator's
    /// own image (the Helm chart passes it).
    #[arg(long, env = "RINGMASTER_STAGER_IMAGE", default_value = ringmaster::controller::DEFAULT_STAGER_IMAGE)]
    stager_image: String,
    /// Subscription of the AKS cluster whose agent pools TrainingJobs with
    /// `nodePool.provisioner: aks` create (all three AKS settings, or none).
    #[arg(long, env = "RINGMASTER_AKS_SUBSCRIPTION", requires_all = ["aks_resource_group", "aks_cluster"])]
    aks_subscription: Option<String>,
    /// Resource group of the AKS cluster.
    #[arg(long, env = "RINGMASTER_AKS_RESOURCE_GROUP", requires_all = ["aks_subscription", "aks_cluster"])]
    aks_resource_group: Option<String>,
    /// Name of the AKS cluster.
    #[arg(long, env = "RINGMASTER_AKS_CLUSTER", requires_all = ["aks_subscription", "aks_resource_group"])]
    aks_cluster: Option<String>,
    /// Azure Resource Manager endpoint (sovereign clouds; the simulated AKS in tests).
    #[arg(
        long,
        env = "RINGMASTER_ARM_ENDPOINT",
        default_value = "https://management.azure.com"
    )]
    arm_endpoint: String,
    /// Read the ARM bearer token from this file at each call instead of workload or managed
    /// identity (for the simulated AKS, or a token from `az account get-access-token`).
    #[arg(long, env = "RINGMASTER_ARM_TOKEN_FILE")]
    arm_token_file: Option<PathBuf>,
    /// Azure Resource Manager requests per second the operator allows itself, in bursts of
    /// twice that, shared by every job; a 429 from ARM pauses them all for its Retry-After.
    /// ARM refills a subscription's write budget at 10 per second.
    #[arg(long, env = "RINGMASTER_ARM_REQUESTS_PER_SECOND", default_value_t = ringmaster::aks::limit::DEFAULT_REQUESTS_PER_SECOND, value_parser = clap::value_parser!(u32).range(1..=1000))]
    arm_requests_per_second: u32,
    /// Give each TrainingJob a NetworkPolicy that admits to its pods (sshd, the trainer's
    /// rendezvous, MPI and NCCL ports) only the same job's pods, so that no other tenant's pod
    /// reaches them. Enforced where the cluster runs a NetworkPolicy engine (AKS with
    /// `--network-policy azure`, Cilium or Calico); elsewhere it is made and does nothing.
    #[arg(long, env = "RINGMASTER_JOB_NETWORK_POLICIES", default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    job_network_policies: bool,
    /// What the leader does, at start and every `--orphan-pool-sweep-minutes`, with AKS
    /// agent pools tagged as a TrainingJob's whose job no longer exists (force-removed, or
    /// deleted while the operator had no AKS settings): `delete` them (tags and eTag
    /// checked first), `dry-run` (log each, delete nothing), or `off`. With AKS settings only.
    #[arg(long, env = "RINGMASTER_ORPHAN_POOL_SWEEP", value_enum, default_value_t = ringmaster::controller::training_job::sweep::SweepMode::Delete)]
    orphan_pool_sweep: ringmaster::controller::training_job::sweep::SweepMode,
    /// Minutes between sweeps for agent pools whose TrainingJob is gone.
    #[arg(long, env = "RINGMASTER_ORPHAN_POOL_SWEEP_MINUTES", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    orphan_pool_sweep_minutes: u64,
    /// Run the controllers only while holding a Lease, so several replicas are safe.
    #[arg(long, env = "RINGMASTER_LEADER_ELECT")]
    leader_elect: bool,
    /// Namespace of the leader-election Lease (the operator's own; in a pod, its namespace).
    #[arg(long, env = "POD_NAMESPACE", default_value = "ringmaster-system")]
    leader_election_namespace: String,
    /// Name of the leader-election Lease.
    #[arg(
        long,
        env = "RINGMASTER_LEADER_ELECTION_LEASE",
        default_value = "ringmaster-leader"
    )]
    leader_election_lease: String,
    /// Seconds a Lease lives without renewal: the longest a dead leader holds up the others.
    #[arg(long, default_value_t = 15)]
    leader_election_duration_seconds: u64,
    /// Name of this replica in Events (the pod name in a Deployment).
    #[arg(long, env = "POD_NAME")]
    instance: Option<String>,
    /// Address of the progress-report endpoint (HTTPS), where launchers POST how far training
    /// got. In a pod, use 0.0.0.0:8443. Without it (and --progress-url) jobs report nothing
    /// and their status shows progress only once they end.
    #[arg(
        long,
        env = "RINGMASTER_PROGRESS_BIND_ADDRESS",
        requires = "progress_url"
    )]
    progress_bind_address: Option<SocketAddr>,
    /// The endpoint's URL as launcher pods reach it, e.g. https://ringmaster-progress.ringmaster-system.svc:8443
    /// (its host is the certificate's name).
    #[arg(long, env = "RINGMASTER_PROGRESS_URL", requires = "progress_bind_address", value_parser = parse_progress_url)]
    progress_url: Option<String>,
    /// Secret (in the operator's namespace, --leader-election-namespace) that keeps the
    /// endpoint's self-signed certificate; made when missing.
    #[arg(
        long,
        env = "RINGMASTER_PROGRESS_TLS_SECRET",
        default_value = "ringmaster-progress-tls"
    )]
    progress_tls_secret: String,
}

/// `--progress-url`: an https URL with a host.
fn parse_progress_url(url: &str) -> Result<String, String> {
    progress_host(url).map(|_| url.trim_end_matches('/').to_string())
}

/// The host of an https URL (the certificate's name).
fn progress_host(url: &str) -> Result<String, String> {
    let uri: http::Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
    if uri.scheme_str() != Some("https") {
        return Err(format!(
            "{url}: the progress endpoint is served over https only"
        ));
    }
    let host = uri.host().ok_or_else(|| format!("{url}: no host"))?;
    Ok(host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string())
}

/// `ringmaster stage`: the copy, its summary on stdout, and its outcome in the termination
/// message when asked for one.
fn stage(args: &ringmaster::stage::StageArgs) -> ExitCode {
    use ringmaster::stage::Outcome;
    if args.print_settings {
        println!(
            "{}",
            serde_json::to_string(args).expect("settings serialize")
        );
        return ExitCode::SUCCESS;
    }
    telemetry::init(LogFormat::Text);
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let (outcome, code) = match runtime.block_on(ringmaster::stage::run(args)) {
        Ok(summary) => {
            println!(
                "{}",
                serde_json::to_string(&summary).expect("summary serializes")
            );
            (Outcome::Succeeded(summary), ExitCode::SUCCESS)
        }
        Err(error) => {
            eprintln!("ringmaster stage: {error}");
            (
                Outcome::Failed {
                    error: error.to_string(),
                },
                ExitCode::FAILURE,
            )
        }
    };
    if let Some(path) = &args.termination_message
        && let Err(error) = std::fs::write(path, outcome.to_message())
    {
        // Outside Kubernetes the file may not be writable; the outcome is printed anyway.
        eprintln!(
            "ringmaster stage: writing the termination message {}: {error}",
            path.display()
        );
    }
    code
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    ringmaster::tls::install_provider();
    match cli.command {
        Command::Crd {
            output_dir,
            api_reference,
        } => match api_reference
            .map(|path| ringmaster::apidocs::write(&path).map_err(|e| (path, e)))
        {
            Some(Err((path, error))) => {
                eprintln!("ringmaster crd: writing {}: {error}", path.display());
                ExitCode::FAILURE
            }
            _ => print_crds(output_dir),
        },
        Command::Stage(args) => stage(&args),
        Command::Run(args) => {
            telemetry::init(args.log_format);
            let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
            match runtime.block_on(run(*args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(message) => {
                    tracing::error!("{message}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// The ARM client when the AKS settings are given.
fn arm_client(args: &RunArgs) -> Result<Option<ringmaster::aks::ArmClient>, String> {
    use ringmaster::aks::{ArmClient, ArmConfig, TokenSource};
    let (Some(subscription), Some(resource_group), Some(cluster)) = (
        args.aks_subscription.clone(),
        args.aks_resource_group.clone(),
        args.aks_cluster.clone(),
    ) else {
        return Ok(None);
    };
    let tokens = match &args.arm_token_file {
        Some(path) => TokenSource::File(path.clone()),
        None => TokenSource::from_environment().map_err(|e| e.to_string())?,
    };
    let config = ArmConfig {
        endpoint: args.arm_endpoint.clone(),
        subscription,
        resource_group,
        cluster,
    };
    tracing::info!(endpoint = %config.endpoint, cluster = %config.cluster, tokens = ?tokens, "AKS agent pools enabled");
    let per_second = std::num::NonZeroU32::new(args.arm_requests_per_second)
        .ok_or("--arm-requests-per-second must be at least 1")?;
    ArmClient::new(config, tokens)
        .map(|arm| Some(arm.with_limit(ringmaster::aks::ArmLimit::new(per_second))))
        .map_err(|e| e.to_string())
}

fn print_crds(output_dir: Option<PathBuf>) -> ExitCode {
    let result = match output_dir {
        Some(dir) => crdgen::write_dir(&dir).map(|paths| {
            for path in paths {
                eprintln!("wrote {path}");
            }
        }),
        None => crdgen::all_to_yaml().map(|yaml| print!("{yaml}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("ringmaster crd: {error}");
            ExitCode::FAILURE
        }
    }
}

/// `--data-stage-destinations`: the allow list, checked at start.
fn parse_destinations(
    json: &str,
) -> Result<ringmaster::controller::data_stage::destinations::AllowedDestinations, String> {
    ringmaster::controller::data_stage::destinations::AllowedDestinations::parse(json)
        .map_err(|e| e.to_string())
}

async fn run(args: RunArgs) -> Result<(), String> {
    let arm = arm_client(&args)?;
    let listener = server::bind(args.metrics_bind_address)
        .await
        .map_err(|e| e.to_string())?;
    let metrics = Metrics::new();
    let client = ringmaster::kube_client::connect(&metrics)
        .await
        .map_err(|e| e.to_string())?;
    let ready = Arc::new(AtomicBool::new(false));
    let shutdown = CancellationToken::new();
    tokio::spawn(stop_on_signal(shutdown.clone()));

    let state = ServerState {
        metrics: metrics.clone(),
        ready: ready.clone(),
    };
    let server = tokio::spawn(server::serve(listener, state, shutdown.clone()));
    let progress = progress_endpoint(&args, &client).await?;
    let ctx = Arc::new(Context::new(
        client,
        metrics,
        args.instance.clone(),
        OperatorConfig {
            restart_backoff: std::time::Duration::from_secs_f64(
                args.restart_backoff_seconds.max(0.0),
            ),
            stager_image: args.stager_image,
            arm,
            max_concurrent_reconciles: args.max_concurrent_reconciles,
            kueue: args.kueue,
            gang_scheduler: args.gang_scheduler.map(|name| {
                ringmaster::gang::GangScheduler::new(
                    name,
                    args.gang_scheduler_api.map(GangSchedulerApi::api),
                )
            }),
            launcher_priority_class: args.launcher_priority_class,
            data_stage_destinations: args.data_stage_destinations.unwrap_or_default(),
            job_network_policies: args.job_network_policies,
            orphan_pool_sweep: args.orphan_pool_sweep,
            orphan_pool_sweep_every: std::time::Duration::from_secs(
                args.orphan_pool_sweep_minutes * 60,
            ),
            progress: progress.as_ref().map(|(endpoint, _)| endpoint.clone()),
        },
    ));
    if let Some((_, listener)) = progress {
        tokio::spawn(ringmaster::report::serve(
            listener,
            ctx.clone(),
            shutdown.clone(),
        ));
    }
    let scope = Scope {
        namespace: args.namespace,
    };
    tracing::info!(version = env!("CARGO_PKG_VERSION"), namespace = ?scope.namespace, "starting controllers");
    let controllers = async {
        if !args.leader_elect {
            controller::run(ctx, scope, ready, shutdown.clone()).await;
            return Ok(());
        }
        let election = ringmaster::leader::Election {
            namespace: args.leader_election_namespace.clone(),
            lease: args.leader_election_lease.clone(),
            identity: args.instance.clone().unwrap_or_else(hostname),
            duration: std::time::Duration::from_secs(args.leader_election_duration_seconds),
        };
        let leader_client = ctx.client.clone();
        // A follower is ready (healthy, waiting to lead); a leader once its caches synced.
        ready.store(true, std::sync::atomic::Ordering::Release);
        ringmaster::leader::run(leader_client, election, shutdown.clone(), |stop| {
            ready.store(false, std::sync::atomic::Ordering::Release);
            controller::run(ctx, scope, ready, stop)
        })
        .await
        .map_err(|e| e.to_string())
    };
    tokio::select! {
        led = controllers => led?,
        served = server => {
            // The server only ends early on an I/O error: stop the controllers too.
            shutdown.cancel();
            served.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
        }
    }
    tracing::info!("stopped");
    Ok(())
}

/// The progress endpoint, when asked for: its certificate (from its Secret, made when
/// missing) and its TLS listener, bound now so a port in use fails fast.
async fn progress_endpoint(
    args: &RunArgs,
    client: &kube::Client,
) -> Result<
    Option<(
        ringmaster::report::ProgressEndpoint,
        ringmaster::report::tls::TlsListener,
    )>,
    String,
> {
    let (Some(addr), Some(url)) = (args.progress_bind_address, args.progress_url.clone()) else {
        return Ok(None);
    };
    let host = progress_host(&url)?;
    let namespace = &args.leader_election_namespace;
    let cert =
        ringmaster::report::tls::serving_cert(client, namespace, &args.progress_tls_secret, &host)
            .await
            .map_err(|e| e.to_string())?;
    let config = cert.server_config().map_err(|e| e.to_string())?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("binding the progress endpoint {addr}: {e}"))?;
    tracing::info!(%addr, %url, "progress endpoint serving");
    let endpoint = ringmaster::report::ProgressEndpoint {
        url,
        ca_pem: cert.cert_pem,
    };
    Ok(Some((
        endpoint,
        ringmaster::report::tls::TlsListener::new(listener, config),
    )))
}

/// This machine's name, for a replica identity outside a pod.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| format!("ringmaster-{}", std::process::id()))
}

/// Cancels `shutdown` on SIGTERM (Kubernetes stopping the pod) or SIGINT (Ctrl-C).
async fn stop_on_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
    }
    shutdown.cancel();
}
