//! Helpers every end-to-end test shares: a client for the local cluster, the CRDs installed,
//! a namespace of its own, polling with a deadline, and the repository's YAML.
#![allow(dead_code)] // each test binary uses a part of these

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::{Api, Client, ResourceExt};
use ringmaster::controller::{self, Context, OperatorConfig, Scope};
use ringmaster::metrics::Metrics;
use ringmaster::server::{self, ServerState};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// The field manager of objects the tests write.
pub const MANAGER: &str = "ringmaster-e2e";

/// A client for the cluster `make cluster-up` started; fails the test when it is not up.
pub async fn client() -> Client {
    ringmaster_e2e::cluster::client()
        .await
        .unwrap_or_else(|e| panic!("the end-to-end tests need the local cluster: {e}"))
}

/// Installs the CRDs as generated now (server-side apply) and waits until both are Established.
pub async fn ensure_crds(client: &Client) {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in ringmaster::crdgen::all() {
        let name = crd.name_any();
        let mut body = serde_json::to_value(&crd).unwrap();
        body["apiVersion"] = "apiextensions.k8s.io/v1".into();
        body["kind"] = "CustomResourceDefinition".into();
        api.patch(
            &name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
        .unwrap_or_else(|e| panic!("applying CRD {name}: {e}"));
        eventually(
            Duration::from_secs(30),
            &format!("CRD {name} Established"),
            || async {
                api.get(&name)
                    .await
                    .ok()
                    .and_then(|crd| crd.status)
                    .is_some_and(|s| {
                        s.conditions
                            .unwrap_or_default()
                            .iter()
                            .any(|c| c.type_ == "Established" && c.status == "True")
                    })
            },
        )
        .await;
    }
}

/// A namespace of the test's own, deleted when dropped (the delete is not awaited: the
/// namespace controller finishes it in the background).
pub struct TestNamespace {
    pub name: String,
}

impl TestNamespace {
    /// Creates `e2e-<prefix>-<random>`.
    pub async fn new(client: &Client, prefix: &str) -> Self {
        let suffix = format!(
            "{:x}",
            std::process::id() ^ (Instant::now().elapsed().subsec_nanos()) ^ rand_u32()
        );
        let name = format!("e2e-{prefix}-{}", &suffix[..suffix.len().min(6)]);
        let api: Api<Namespace> = Api::all(client.clone());
        let ns: Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap();
        api.create(&PostParams::default(), &ns)
            .await
            .expect("namespace created");
        Self { name }
    }
}

impl Drop for TestNamespace {
    /// Deletes the namespace (the namespace controller removes its contents afterwards).
    /// Runs on a thread of its own with a client of its own, since the test's runtime may be
    /// a single thread blocked on this very drop.
    fn drop(&mut self) {
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            runtime.block_on(async {
                let client = ringmaster_e2e::cluster::client().await.ok()?;
                Api::<Namespace>::all(client)
                    .delete(&name, &DeleteParams::background())
                    .await
                    .ok()
            })
        })
        .join();
    }
}

fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    h.finish() as u32
}

/// Polls `check` every 200 ms until it is true; panics naming `what` after `timeout`.
pub async fn eventually<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if check().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The root of the checkout being tested, found at run time:
/// [`ringmaster_e2e::cluster::repo_root`].
pub fn repo_root() -> PathBuf {
    ringmaster_e2e::cluster::repo_root().unwrap_or_else(|e| panic!("{e}"))
}

/// Every YAML document of a file.
pub fn documents(path: &Path) -> Vec<Value> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_saphyr::from_multiple::<Value>(&text)
        .unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

/// The first document of kind `kind` in `config/samples/<file>`.
pub fn sample(file: &str, kind: &str) -> Value {
    documents(&repo_root().join("config/samples").join(file))
        .into_iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} in config/samples/{file}"))
}

/// The `.yaml` files of a folder under the repository root, sorted.
pub fn yaml_files(dir: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo_root().join(dir))
        .unwrap_or_else(|e| panic!("listing {dir}: {e}"))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

/// A dynamic API for any object's kind, in `namespace`.
pub fn dynamic_api(client: &Client, object: &Value, namespace: &str) -> Api<DynamicObject> {
    let api_version = object["apiVersion"].as_str().expect("apiVersion");
    let kind = object["kind"].as_str().expect("kind");
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    let gvk = GroupVersionKind::gvk(group, version, kind);
    let plural = format!("{}s", kind.to_lowercase());
    Api::namespaced_with(
        client.clone(),
        namespace,
        &ApiResource::from_gvk_with_plural(&gvk, &plural),
    )
}

/// Server-side applies a namespaced object (optionally as a dry run).
pub async fn apply(
    client: &Client,
    object: &Value,
    namespace: &str,
    dry_run: bool,
) -> Result<DynamicObject, kube::Error> {
    let api = dynamic_api(client, object, namespace);
    let name = object["metadata"]["name"].as_str().expect("metadata.name");
    let mut params = PatchParams::apply(MANAGER).force();
    params.dry_run = dry_run;
    api.patch(name, &params, &Patch::Apply(object)).await
}

/// The path of a binary the control plane's build made (kubectl, kwokctl, ...).
pub fn tool(name: &str) -> PathBuf {
    let out = std::process::Command::new(repo_root().join("e2e/tools/build.sh"))
        .output()
        .expect("running e2e/tools/build.sh");
    assert!(
        out.status.success(),
        "build.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()).join(name)
}

/// The operator's controllers and HTTP endpoints, stopped when dropped.
pub struct Operator {
    shutdown: CancellationToken,
    controllers: tokio::task::JoinHandle<()>,
    server: tokio::task::JoinHandle<Result<(), ringmaster::server::ServerError>>,
    pub http: std::net::SocketAddr,
}

impl Operator {
    /// Starts the controllers (watching `namespace`) and the HTTP endpoints; returns once the
    /// caches have synced.
    pub async fn start(client: &Client, namespace: &str) -> Self {
        Self::start_with(
            client,
            namespace,
            OperatorConfig {
                restart_backoff: Duration::from_millis(500),
                data_stage_destinations: e2e_destinations(),
                ..OperatorConfig::default()
            },
        )
        .await
    }

    /// [`Operator::start`] with settings of the test's choosing.
    pub async fn start_with(client: &Client, namespace: &str, config: OperatorConfig) -> Self {
        Self::start_reporting(client, namespace, config, None).await
    }

    /// [`Operator::start_with`], and its progress endpoint on `progress_ip` (a free port),
    /// its certificate in a Secret of `namespace`, when given.
    pub async fn start_reporting(
        client: &Client,
        namespace: &str,
        mut config: OperatorConfig,
        progress_ip: Option<std::net::IpAddr>,
    ) -> Self {
        let mut progress_listener = None;
        if let Some(ip) = progress_ip {
            use ringmaster::report::{ProgressEndpoint, tls};
            let host = ip.to_string();
            let secret = "ringmaster-progress-tls";
            let cert = tls::serving_cert(client, namespace, secret, &host)
                .await
                .unwrap();
            let listener = tokio::net::TcpListener::bind((ip, 0)).await.unwrap();
            let port = listener.local_addr().unwrap().port();
            config.progress = Some(ProgressEndpoint {
                url: format!("https://{host}:{port}"),
                ca_pem: cert.cert_pem.clone(),
            });
            let listener = tls::TlsListener::new(listener, cert.server_config().unwrap());
            progress_listener = Some(listener);
        }
        let shutdown = CancellationToken::new();
        let metrics = Metrics::new();
        let ready = Arc::new(AtomicBool::new(false));
        let listener = server::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let http = listener.local_addr().unwrap();
        let state = ServerState {
            metrics: metrics.clone(),
            ready: ready.clone(),
        };
        let server = tokio::spawn(server::serve(listener, state, shutdown.clone()));
        let ctx = Arc::new(Context::new(
            client.clone(),
            metrics,
            Some("e2e".into()),
            config,
        ));
        let scope = Scope {
            namespace: Some(namespace.to_string()),
        };
        if let Some(listener) = progress_listener {
            tokio::spawn(ringmaster::report::serve(
                listener,
                ctx.clone(),
                shutdown.clone(),
            ));
        }
        let controllers =
            tokio::spawn(controller::run(ctx, scope, ready.clone(), shutdown.clone()));
        eventually(Duration::from_secs(30), "operator caches synced", || {
            let ready = ready.clone();
            async move { ready.load(Ordering::Acquire) }
        })
        .await;
        Self {
            shutdown,
            controllers,
            server,
            http,
        }
    }

    /// Whether the controllers are still running (they end only when told to, or on a panic).
    pub fn is_running(&self) -> bool {
        !self.controllers.is_finished()
    }

    /// Stops the operator the way a crash would: every task dropped wherever it is.
    pub fn kill(self) {
        self.controllers.abort();
        self.server.abort();
    }

    /// GETs a path of the operator's HTTP endpoints; the whole response, head included.
    pub async fn get(&self, path: &str) -> String {
        let mut stream = tokio::net::TcpStream::connect(self.http).await.unwrap();
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        response
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// The line the trainer's launcher wrapper writes to the launcher's termination message
/// (the contract's summary), for KWOK launchers to "write".
pub fn trainer_summary(images_per_second: f64, steps: u64, final_loss: f64) -> String {
    ringmaster_contract::trainer::Summary {
        images_per_second,
        steps,
        final_loss: Some(final_loss),
        final_accuracy: Some(0.5),
        world_size: 4,
        global_batch: 64,
        parameters: 25_557_032,
        seconds: 60.0,
        resumed_from_step: None,
        resumed_from_run: None,
    }
    .to_line()
}

/// A user's own GPU program in place of the built-in trainer (KWOK runs neither: the tests
/// of scheduling, pools and queues that use it are about the pods, not what they run).
pub fn own_gpu_program() -> serde_json::Value {
    serde_json::json!(["python3", "/workspace/train.py"])
}

/// The Events about the object `name` in `namespace`.
pub async fn events_for(
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> Vec<k8s_openapi::api::events::v1::Event> {
    let api: kube::Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), namespace);
    api.list(&kube::api::ListParams::default().fields(&format!("regarding.name={name}")))
        .await
        .map(|l| l.items)
        .unwrap_or_default()
}

/// The Warning Events of `reason` about the object `name` in `namespace`.
pub async fn warnings_for(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    reason: &str,
) -> Vec<k8s_openapi::api::events::v1::Event> {
    events_for(client, namespace, name)
        .await
        .into_iter()
        .filter(|e| e.type_.as_deref() == Some("Warning") && e.reason.as_deref() == Some(reason))
        .collect()
}

/// The TrainingJob's status as JSON (null while it has none, or is gone).
pub async fn job_status(client: &Client, ns: &str, name: &str) -> Value {
    let jobs: Api<ringmaster::api::TrainingJob> = Api::namespaced(client.clone(), ns);
    jobs.get_opt(name)
        .await
        .unwrap()
        .and_then(|j| j.status)
        .map(|s| serde_json::to_value(s).unwrap())
        .unwrap_or(Value::Null)
}

/// Whether the status is in `phase`.
pub fn phase_is(status: &Value, phase: ringmaster::api::TrainingJobPhase) -> bool {
    status["phase"] == serde_json::to_value(phase).unwrap()
}

/// Polls until the job is in `phase`; panics with the last status after `timeout` seconds.
pub async fn wait_phase(
    client: &Client,
    ns: &str,
    name: &str,
    phase: ringmaster::api::TrainingJobPhase,
    timeout: u64,
) -> Value {
    let what = format!("{name} {phase:?}");
    let mut last = Value::Null;
    let deadline = std::time::Instant::now() + Duration::from_secs(timeout);
    while std::time::Instant::now() < deadline {
        last = job_status(client, ns, name).await;
        if phase_is(&last, phase) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("timed out waiting for {what}; last status: {last:#}");
}

/// The condition `type_` of a status (null when absent).
pub fn condition<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .unwrap_or(&Value::Null)
}

/// The job's pods (every attempt).
pub async fn pods(client: &Client, ns: &str, job: &str) -> Vec<k8s_openapi::api::core::v1::Pod> {
    let api: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), ns);
    api.list(&kube::api::ListParams::default().labels(&format!("ringmaster.dev/job-name={job}")))
        .await
        .unwrap()
        .items
}

/// The launcher of the job's latest gang attempt (`<job>-launcher`, then `<job>-launcher-<n>`
/// after the n-th restart; a failed earlier one may still be there, kept with its log).
pub async fn current_launcher(client: &Client, ns: &str, job: &str) -> String {
    let attempt = |p: &k8s_openapi::api::core::v1::Pod| {
        p.labels()
            .get("ringmaster.dev/attempt")
            .and_then(|a| a.parse::<i32>().ok())
            .unwrap_or(-1)
    };
    pods(client, ns, job)
        .await
        .into_iter()
        .filter(|p| p.labels().get("ringmaster.dev/role").map(String::as_str) == Some("launcher"))
        .max_by_key(attempt)
        .map(|p| p.name_any())
        .unwrap_or_else(|| panic!("job {job} has no launcher"))
}

/// When the pod last became Ready, if it is.
pub fn ready_since(pod: &k8s_openapi::api::core::v1::Pod) -> Option<k8s_openapi::jiff::Timestamp> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready" && c.status == "True")
        .and_then(|c| c.last_transition_time.as_ref())
        .map(|t| t.0)
}

/// The DataStage's status as JSON (null while it has none).
pub async fn stage_status(client: &Client, ns: &str, name: &str) -> Value {
    let api: Api<ringmaster::api::DataStage> = Api::namespaced(client.clone(), ns);
    api.get_opt(name)
        .await
        .unwrap()
        .and_then(|s| s.status)
        .map(|s| serde_json::to_value(s).unwrap())
        .unwrap_or(Value::Null)
}

/// Polls until the DataStage is in `phase` (at most a minute); panics with its last status.
pub async fn wait_stage_phase(client: &Client, ns: &str, name: &str, phase: &str) -> Value {
    let mut last = Value::Null;
    for _ in 0..300 {
        last = stage_status(client, ns, name).await;
        if last["phase"] == phase {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("DataStage {name} never reached {phase}: {last:#}");
}

/// The Secret `blob-sas` with the SAS token under `sasToken`.
pub async fn sas_secret(client: &Client, ns: &str, sas: &str) {
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), ns);
    let secret: k8s_openapi::api::core::v1::Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "blob-sas"},
        "stringData": {"sasToken": sas},
    }))
    .unwrap();
    secrets
        .create(&kube::api::PostParams::default(), &secret)
        .await
        .unwrap();
}

/// The note of the job's `Restarting` Event, which must be a Warning.
pub async fn restarting_event_note(client: &kube::Client, namespace: &str, job: &str) -> String {
    let restarting = events_for(client, namespace, job)
        .await
        .into_iter()
        .find(|e| e.reason.as_deref() == Some("Restarting"))
        .expect("a Restarting Event");
    assert_eq!(restarting.type_.as_deref(), Some("Warning"));
    restarting.note.unwrap_or_default()
}

/// A client that acts as `system:serviceaccount:{ns}:{name}`.
pub async fn impersonating(ns: &str, name: &str) -> Client {
    let kubeconfig =
        kube::config::Kubeconfig::read_from(ringmaster_e2e::cluster::kubeconfig_path()).unwrap();
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    config.auth_info.impersonate = Some(format!("system:serviceaccount:{ns}:{name}"));
    config.auth_info.impersonate_groups = Some(vec![
        "system:serviceaccounts".into(),
        format!("system:serviceaccounts:{ns}"),
        "system:authenticated".into(),
    ]);
    Client::try_from(config).unwrap()
}

/// Makes the chart's ServiceAccount (`{release}-ringmaster` in `namespace`) and the
/// ClusterRole the chart renders with `set` (`helm template --set`), bound to it; a test's
/// operator then acts as it ([`impersonating`]) with exactly the chart's rights. `grants` is
/// a text the rendered rules must hold (the API group `set` adds). Server-side applied:
/// idempotent.
pub async fn apply_chart_rbac(
    admin: &Client,
    namespace: &str,
    release: &str,
    set: &str,
    grants: &str,
) {
    let ns = serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}});
    Api::<Namespace>::all(admin.clone())
        .patch(
            namespace,
            &PatchParams::apply("e2e").force(),
            &Patch::Apply(&ns),
        )
        .await
        .ok();
    let chart = repo_root().join("charts/ringmaster");
    let out = tokio::process::Command::new(tool("helm"))
        .args([
            "template",
            release,
            chart.to_str().unwrap(),
            "--namespace",
            namespace,
            "--set",
            set,
            "--kube-version",
            "1.36.0",
            "--show-only",
            "templates/clusterrole.yaml",
            "--show-only",
            "templates/serviceaccount.yaml",
        ])
        .output()
        .await
        .expect("helm template");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains(grants),
        "the chart grants {grants} with {set}"
    );
    for object in serde_saphyr::from_multiple::<Value>(&text).unwrap() {
        if !object.is_object() {
            continue;
        }
        let (group, version) = object["apiVersion"]
            .as_str()
            .unwrap()
            .rsplit_once('/')
            .unwrap_or(("", object["apiVersion"].as_str().unwrap()));
        let kind = object["kind"].as_str().unwrap();
        let plural = format!("{}s", kind.to_lowercase());
        let resource = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk(group, version, kind),
            &plural,
        );
        let api: Api<DynamicObject> = if kind == "ServiceAccount" {
            Api::namespaced_with(admin.clone(), namespace, &resource)
        } else {
            Api::all_with(admin.clone(), &resource)
        };
        api.patch(
            object["metadata"]["name"].as_str().unwrap(),
            &PatchParams::apply("e2e").force(),
            &Patch::Apply(&object),
        )
        .await
        .unwrap_or_else(|e| panic!("{kind}: {e}"));
    }
}

/// The annotations that make a KWOK launcher exit with `code` `after` its start (a duration,
/// "0s" for now) with `summary` (a trainer's, [`trainer_summary`]) as its termination message
/// (kwok/stages.yaml).
pub fn launcher_exit_annotations(code: i32, after: &str, summary: String) -> Value {
    serde_json::json!({
        "kwok.ringmaster.dev/exit-code": code.to_string(),
        "kwok.ringmaster.dev/exit-after": after,
        "kwok.ringmaster.dev/termination-message": summary,
    })
}

/// [`launcher_exit_annotations`] for exit 0 with a small run's summary.
pub fn launcher_exits(after: &str) -> Value {
    launcher_exit_annotations(0, after, trainer_summary(100.0, 10, 1.5))
}

/// Ends a running job on KWOK nodes: its launcher exits 0 now.
pub async fn end_launcher(client: &Client, ns: &str, job: &str) {
    end_launcher_with(client, ns, job, launcher_exits("0s")).await;
}

/// Ends a running job on KWOK nodes with `annotations` ([`launcher_exit_annotations`]).
pub async fn end_launcher_with(client: &Client, ns: &str, job: &str, annotations: Value) {
    let launcher = current_launcher(client, ns, job).await;
    Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), ns)
        .patch(
            &launcher,
            &PatchParams::default(),
            &Patch::Merge(&serde_json::json!({"metadata": {"annotations": annotations}})),
        )
        .await
        .unwrap();
}

/// Runs `e2e/<script> up` (kueue.sh, gang-scheduler.sh: a no-op when what it starts runs);
/// fails the test with the script's own words when it fails.
pub async fn script_up(script: &str) {
    let out = tokio::process::Command::new(repo_root().join("e2e").join(script))
        .arg("up")
        .output()
        .await
        .unwrap_or_else(|e| panic!("running e2e/{script}: {e}"));
    assert!(
        out.status.success(),
        "e2e/{script} up failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A finalizer of the test's that holds an object for as long as the test needs (as a backup
/// tool's might): the garbage collector alone takes an owned child within a moment, which a
/// test cannot time.
pub const HOLD: &str = "e2e.ringmaster.dev/hold";

/// Puts [`HOLD`] on the object (`on`) or takes it off, keeping its other finalizers.
pub async fn hold<K>(api: &Api<K>, name: &str, on: bool)
where
    K: kube::Resource + Clone + k8s_openapi::serde::de::DeserializeOwned + std::fmt::Debug,
{
    // The resourceVersion keeps other controllers' finalizer changes; a conflict is retried.
    for _ in 0..20 {
        let object = api.get(name).await.unwrap();
        let mut finalizers = object.finalizers().to_vec();
        finalizers.retain(|f| f != HOLD);
        if on {
            finalizers.push(HOLD.into());
        }
        let patch = serde_json::json!({"metadata": {"finalizers": finalizers, "resourceVersion": object.resource_version()}});
        match api
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => return,
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(error) => panic!("holding {name}: {error}"),
        }
    }
    panic!("holding {name}: 20 conflicts");
}

/// The DataStage destinations the tests' operators allow, as an admin's Helm values would:
/// the NFS server the tests name (it does not exist: KWOK never mounts), each namespace under
/// `/export/<namespace>`.
pub fn e2e_destinations() -> ringmaster::controller::data_stage::destinations::AllowedDestinations {
    ringmaster::controller::data_stage::destinations::AllowedDestinations::parse(
        r#"{"nfs": [{"server": "nfs.example.internal", "path": "/export"}]}"#,
    )
    .expect("the tests' allow list parses")
}
