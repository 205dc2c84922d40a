//! The reconcile tier: whole reconciles of a TrainingJob, kube's own client talking to an
//! API server mocked in memory (`tower-test`, as kube-rs's controller examples test theirs),
//! in milliseconds. What the end-to-end tests see only with a cluster under load is set up
//! here directly: pods made but not in the cache yet, a name held by an earlier job's pod,
//! a create refused with 409 by a pod the cache does not hold.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::client::Body;
use kube::core::error_boundary::DeserializeGuard;
use serde_json::{Value, json};

use super::reconcile;
use crate::api::TrainingJob;
use crate::controller::{Context, OperatorConfig};
use crate::metrics::Metrics;

const PODS: &str = "/api/v1/namespaces/ml/pods";
const SECRETS: &str = "/api/v1/namespaces/ml/secrets";
const THE_JOB: &str = "/apis/ringmaster.dev/v1alpha1/namespaces/ml/trainingjobs/resnet18-cpu";
const JOB: &str = "resnet18-cpu";
const UID: &str = "uid-1";

/// One request the fake API server answered: its verb, what it was about (the path's last
/// resource kind, or `status`), and its body.
#[derive(Clone, Debug)]
struct Request_ {
    method: Method,
    path: String,
    body: Value,
}

impl Request_ {
    /// `POST pods`, `PATCH status`, `POST events`, …
    fn gist(&self) -> String {
        let segments: Vec<&str> = self.path.split('/').collect();
        let kind = match segments.as_slice() {
            [.., "status"] => "status",
            [.., kind, _name] if matches!(self.method, Method::GET | Method::DELETE) => kind,
            [.., kind] => kind,
            [] => "",
        };
        format!("{} {kind}", self.method)
    }
}

/// An API server that keeps the pods it is told of, makes what it is asked to make, and
/// logs every request.
#[derive(Default)]
struct FakeApi {
    job: Value,
    pods: BTreeMap<String, Value>,
    secrets: BTreeMap<String, Value>,
    log: Vec<Request_>,
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
           "reason": reason, "message": message})
}

impl FakeApi {
    fn answer(&mut self, method: &Method, path: &str, body: Value) -> (StatusCode, Value) {
        self.log.push(Request_ {
            method: method.clone(),
            path: path.to_string(),
            body: body.clone(),
        });
        let name = path.rsplit('/').next().unwrap_or_default().to_string();
        match (method.as_str(), path) {
            ("POST", PODS) => create(&mut self.pods, "pods", body),
            ("GET", p) if p.starts_with(PODS) => read(&self.pods, &name),
            ("DELETE", p) if p.starts_with(PODS) => {
                self.pods.remove(&name);
                let gone = json!({"kind": "Status", "apiVersion": "v1", "status": "Success"});
                (StatusCode::OK, gone)
            }
            ("POST", SECRETS) => create(&mut self.secrets, "secrets", body),
            ("GET", p) if p.starts_with(SECRETS) => read(&self.secrets, &name),
            ("PATCH", p) if p.ends_with("/status") => (StatusCode::OK, self.job.clone()),
            ("GET", THE_JOB) | ("PATCH", THE_JOB) => (StatusCode::OK, self.job.clone()),
            // Services, NetworkPolicies, Events: made as asked.
            ("POST", _) => (StatusCode::CREATED, body),
            _ => (StatusCode::NOT_FOUND, status(404, "NotFound", "not served")),
        }
    }
}

/// A create into `store`: 409 when the name is taken, as the API server answers.
fn create(store: &mut BTreeMap<String, Value>, kind: &str, body: Value) -> (StatusCode, Value) {
    let name = body["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    if store.contains_key(&name) {
        let words = format!("{kind} \"{name}\" already exists");
        return (StatusCode::CONFLICT, status(409, "AlreadyExists", &words));
    }
    store.insert(name, body.clone());
    (StatusCode::CREATED, body)
}

/// A read from `store`: the object, or 404.
fn read(store: &BTreeMap<String, Value>, name: &str) -> (StatusCode, Value) {
    match store.get(name) {
        Some(object) => (StatusCode::OK, object.clone()),
        None => (StatusCode::NOT_FOUND, status(404, "NotFound", "not found")),
    }
}

/// A client whose requests `api` answers.
fn client(api: Arc<Mutex<FakeApi>>) -> Client {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    tokio::spawn(async move {
        while let Some((request, respond)) = handle.next_request().await {
            let (parts, body) = request.into_parts();
            let bytes = body.collect().await.expect("a body").to_bytes();
            let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            let (code, answer) = api
                .lock()
                .unwrap()
                .answer(&parts.method, parts.uri.path(), body);
            let bytes = serde_json::to_vec(&answer).expect("JSON");
            respond.send_response(
                Response::builder()
                    .status(code)
                    .body(Body::from(bytes))
                    .unwrap(),
            );
        }
    });
    Client::new(service, "ml")
}

/// The small CPU sample (two workers), in namespace `ml`.
fn job() -> Value {
    let yaml = include_str!("../../../config/samples/trainingjob-cpu-small.yaml");
    let mut job: Value = serde_saphyr::from_str(yaml).expect("the sample parses");
    job["metadata"]["namespace"] = json!("ml");
    job["metadata"]["uid"] = json!(UID);
    job["metadata"]["generation"] = json!(1);
    job["metadata"]["creationTimestamp"] = json!("2026-11-26T00:00:00Z");
    job
}

/// A fake API server, a context on it whose pod cache holds `cached`, and the job.
fn harness(
    cached: Vec<Pod>,
) -> (
    Arc<Mutex<FakeApi>>,
    Arc<Context>,
    Arc<DeserializeGuard<TrainingJob>>,
) {
    let api = Arc::new(Mutex::new(FakeApi {
        job: job(),
        ..FakeApi::default()
    }));
    let ctx = Context::new(
        client(api.clone()),
        Metrics::default(),
        None,
        OperatorConfig::default(),
    );
    ctx.cache_pods(cached);
    let object = serde_json::from_value(job()).expect("a TrainingJob");
    (api, Arc::new(ctx), Arc::new(object))
}

/// What the reconciles asked for, without Events (a courtesy, checked where they matter).
fn asked(api: &Mutex<FakeApi>) -> Vec<String> {
    let api = api.lock().unwrap();
    let mut gists: Vec<String> = api
        .log
        .iter()
        .map(Request_::gist)
        .filter(|g| !g.ends_with(" events"))
        .collect();
    // Workers are made concurrently: their order is the pods'.
    gists.sort_by_key(|g| match g.as_str() {
        "POST secrets" | "GET secrets" => 0,
        "POST services" | "POST networkpolicies" => 1,
        "POST pods" | "GET pods" => 2,
        _ => 3,
    });
    gists
}

/// The last status write's JSON Patch operations.
fn last_status_patch(api: &Mutex<FakeApi>) -> Vec<Value> {
    let api = api.lock().unwrap();
    let patch = api
        .log
        .iter()
        .rev()
        .find(|r| r.gist() == "PATCH status")
        .expect("a status write");
    patch.body.as_array().expect("a JSON Patch").clone()
}

/// The status the last status write carried.
fn written_status(api: &Mutex<FakeApi>) -> Value {
    last_status_patch(api)
        .into_iter()
        .find(|op| op["op"] == "add" && op["path"] == "/status")
        .expect("the status replaced")["value"]
        .clone()
}

/// The fence the last status write carried (its first operation, a test).
fn written_fence(api: &Mutex<FakeApi>) -> Value {
    last_status_patch(api)[0].clone()
}

/// A pod of this job's name and worker index `index`, controlled by `controller` (kind,
/// UID), being deleted when `deleting`.
fn worker(index: u32, controller: Option<(&str, &str)>, deleting: bool) -> Value {
    let mut pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": format!("{JOB}-worker-{index}"), "namespace": "ml", "uid": format!("pod-{index}"),
        "labels": {"ringmaster.dev/job-name": JOB, "ringmaster.dev/role": "worker",
                   "ringmaster.dev/worker-index": index.to_string(), "ringmaster.dev/attempt": "0"}}});
    if let Some((kind, uid)) = controller {
        pod["metadata"]["ownerReferences"] = json!([{"apiVersion": "ringmaster.dev/v1alpha1",
            "kind": kind, "name": JOB, "uid": uid, "controller": true}]);
    }
    if deleting {
        pod["metadata"]["deletionTimestamp"] = json!(crate::controller::now().0.to_string());
    }
    pod
}

#[tokio::test]
async fn a_new_job_makes_its_secret_service_and_workers_then_says_it_is_starting() {
    let (api, ctx, object) = harness(Vec::new());
    let action = reconcile(object, ctx).await.expect("it reconciles");
    assert_eq!(
        asked(&api),
        [
            "POST secrets",
            "POST services",
            "POST networkpolicies",
            "POST pods",
            "POST pods",
            "PATCH status"
        ]
    );
    // No pod is open to other pods for a moment: the NetworkPolicy goes out before them.
    let order: Vec<String> = api.lock().unwrap().log.iter().map(Request_::gist).collect();
    let position = |gist: &str| order.iter().position(|g| g == gist).unwrap();
    assert!(
        position("POST networkpolicies") < position("POST pods"),
        "{order:?}"
    );
    let status = written_status(&api);
    assert_eq!(status["phase"], "Starting");
    assert_eq!(status["workers"]["active"], 2, "the pods made are counted");
    // The write names its writer and holds only while the job has no status yet (a
    // replica that lost the Lease cannot overwrite a newer leader's).
    assert!(
        status["writtenBy"]
            .as_str()
            .is_some_and(|w| w.starts_with("ringmaster/") && w.len() == "ringmaster/".len() + 8),
        "{status}"
    );
    assert_eq!(
        written_fence(&api),
        serde_json::json!({"op": "test", "path": "/status", "value": null})
    );
    assert!(
        api.lock()
            .unwrap()
            .pods
            .contains_key("resnet18-cpu-worker-1")
    );
    // Nothing to wait for but the pods' events.
    assert_eq!(action, kube::runtime::controller::Action::await_change());
}

/// The bodies of the requests `gist` (`POST secrets`, `POST pods`, …) the API server took.
fn bodies(api: &Mutex<FakeApi>, gist: &str) -> Vec<Value> {
    let api = api.lock().unwrap();
    api.log
        .iter()
        .filter(|r| r.gist() == gist)
        .map(|r| r.body.clone())
        .collect()
}

/// A job's Secret holds a rendezvous key of 32 bytes drawn for it (another job's is
/// another), written once with the SSH key; its pods name the key's file in the mounted
/// Secret, and none holds the key itself, in any spelling.
#[tokio::test]
async fn the_secret_holds_a_rendezvous_key_drawn_for_the_job_that_no_pod_holds() {
    use base64::Engine;
    use ringmaster_contract::trainer::{
        RENDEZVOUS_KEY, RENDEZVOUS_KEY_BYTES, RENDEZVOUS_KEY_FILE_ENV,
    };
    let mut drawn = Vec::new();
    for _ in 0..2 {
        let (api, ctx, object) = harness(Vec::new());
        reconcile(object.clone(), ctx.clone())
            .await
            .expect("it reconciles");
        reconcile(object, ctx).await.expect("it reconciles again");
        let secrets = bodies(&api, "POST secrets");
        assert_eq!(secrets.len(), 1, "the Secret is written once: {secrets:?}");
        let encoded = secrets[0]["data"][RENDEZVOUS_KEY]
            .as_str()
            .expect("a rendezvous key")
            .to_string();
        let key = base64::engine::general_purpose::STANDARD
            .decode(&encoded)
            .unwrap();
        assert_eq!(key.len(), RENDEZVOUS_KEY_BYTES);
        let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
        let numbers = serde_json::to_string(&key).unwrap();
        let pods = bodies(&api, "POST pods");
        assert_eq!(pods.len(), 2);
        for pod in pods {
            let text = pod.to_string();
            for spelling in [&encoded, &hex, &hex.to_uppercase(), &numbers] {
                assert!(!text.contains(spelling.as_str()), "{spelling} in {text}");
            }
            let env = pod["spec"]["containers"][0]["env"]
                .as_array()
                .unwrap()
                .clone();
            let file = env
                .iter()
                .find(|e| e["name"] == RENDEZVOUS_KEY_FILE_ENV)
                .expect("the key's file is named");
            assert_eq!(
                file,
                &json!({"name": RENDEZVOUS_KEY_FILE_ENV,
                        "value": format!("/etc/ringmaster/ssh-secret/{RENDEZVOUS_KEY}")})
            );
        }
        drawn.push(key);
    }
    assert_ne!(drawn[0], drawn[1], "each job draws its own");
}

#[tokio::test]
async fn pods_made_but_not_yet_in_the_cache_are_not_made_again() {
    let (api, ctx, object) = harness(Vec::new());
    reconcile(object.clone(), ctx.clone())
        .await
        .expect("the first reconcile");
    let first = asked(&api).len();
    // The watch has not brought the pods (nor the status) yet: the cache is as before.
    reconcile(object, ctx).await.expect("the second reconcile");
    let again = asked(&api)[first..].to_vec();
    assert!(again.is_empty(), "nothing is written again: {again:?}");
}

#[tokio::test]
async fn a_name_held_by_an_earlier_jobs_pod_on_its_way_out_is_waited_for_quietly() {
    let earlier: Pod =
        serde_json::from_value(worker(0, Some(("TrainingJob", "uid-0")), true)).expect("a pod");
    let (api, ctx, object) = harness(vec![earlier]);
    let action = reconcile(object, ctx).await.expect("it reconciles");
    let made: Vec<String> = api
        .lock()
        .unwrap()
        .log
        .iter()
        .filter(|r| r.gist() == "POST pods")
        .map(|r| r.body["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        made,
        ["resnet18-cpu-worker-1"],
        "worker 0 waits for its name"
    );
    assert_eq!(
        action,
        kube::runtime::controller::Action::requeue(Duration::from_secs(1)),
        "and looks again soon: the earlier pod's deletion is not this job's event"
    );
    assert_ne!(written_status(&api)["conditions"], Value::Null);
}

#[tokio::test]
async fn a_409_from_a_pod_the_cache_does_not_hold_is_said_on_the_job_with_a_warning() {
    let (api, ctx, object) = harness(Vec::new());
    // A pod of that name without a controller (left by `kubectl delete --cascade=orphan`),
    // without the job's labels: not in the job's cache, only the create's 409 tells.
    let mut orphan = worker(1, None, false);
    orphan["metadata"]["labels"] = json!({});
    api.lock()
        .unwrap()
        .pods
        .insert(format!("{JOB}-worker-1"), orphan);
    reconcile(object, ctx).await.expect("it reconciles");
    assert_eq!(
        asked(&api),
        [
            "POST secrets",
            "POST services",
            "POST networkpolicies",
            "POST pods",
            "POST pods",
            "GET pods",
            "PATCH status"
        ]
    );
    let status = written_status(&api);
    let ready = status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Ready")
        .expect("a Ready condition")
        .clone();
    assert_eq!(ready["reason"], "NameInUse");
    assert!(
        ready["message"]
            .as_str()
            .unwrap()
            .contains("worker resnet18-cpu-worker-1 cannot be made"),
        "{ready}"
    );
    let warned = api.lock().unwrap().log.iter().any(|r| {
        r.gist() == "POST events" && r.body["reason"] == "NameInUse" && r.body["type"] == "Warning"
    });
    assert!(warned, "a Warning Event says it too");
}

/// The name of the job's SSH Secret, as a reconcile makes it.
async fn ssh_secret_name() -> String {
    let (api, ctx, object) = harness(Vec::new());
    reconcile(object, ctx).await.expect("it reconciles");
    bodies(&api, "POST secrets")[0]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_string()
}

/// A Secret of the job's SSH Secret name that a namespace user made first (keys of their
/// choosing) is not used: the job stalls naming it, with a Warning, and makes no pod.
#[tokio::test]
async fn an_ssh_secret_of_the_jobs_name_it_does_not_control_stalls_it_with_a_warning() {
    let name = ssh_secret_name().await;
    let (api, ctx, object) = harness(Vec::new());
    let planted = json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": name, "namespace": "ml", "uid": "planted"},
        "data": {"ssh-privatekey": "c3F1YXR0ZXI="}});
    api.lock().unwrap().secrets.insert(name.clone(), planted);
    let error = reconcile(object, ctx).await.expect_err("it does not go on");
    assert!(error.to_string().contains(&name), "{error}");
    assert_eq!(asked(&api), ["POST secrets", "GET secrets", "PATCH status"]);
    let status = written_status(&api);
    let stalled = status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Stalled")
        .expect("a Stalled condition")
        .clone();
    assert_eq!(
        (&stalled["status"], &stalled["reason"]),
        (&json!("True"), &json!("ChildRejected"))
    );
    let message = stalled["message"].as_str().unwrap();
    assert!(
        message.contains(&format!(
            "Secret {name} exists and this job does not control it (its controller: none)"
        )),
        "{message}"
    );
    assert!(
        !message.contains("c3F1YXR0ZXI="),
        "nothing of its data: {message}"
    );
    let warned = api.lock().unwrap().log.iter().any(|r| {
        r.gist() == "POST events"
            && r.body["reason"] == "ChildRejected"
            && r.body["type"] == "Warning"
    });
    assert!(warned, "a Warning Event says it too");
}

/// The job's own SSH Secret, made by an earlier reconcile the operator does not remember
/// (a restart), is used as it is: the job goes on to its pods.
#[tokio::test]
async fn the_jobs_own_ssh_secret_from_before_a_restart_is_used() {
    let name = ssh_secret_name().await;
    let (api, ctx, object) = harness(Vec::new());
    let own = json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": name, "namespace": "ml", "uid": "earlier",
            "ownerReferences": [{"apiVersion": "ringmaster.dev/v1alpha1", "kind": "TrainingJob",
                "name": JOB, "uid": UID, "controller": true}]}});
    api.lock().unwrap().secrets.insert(name, own);
    reconcile(object, ctx).await.expect("it reconciles");
    assert_eq!(
        asked(&api),
        [
            "POST secrets",
            "GET secrets",
            "POST services",
            "POST networkpolicies",
            "POST pods",
            "POST pods",
            "PATCH status"
        ]
    );
    assert_eq!(written_status(&api)["phase"], "Starting");
}

/// A job being deleted whose stored form no longer parses (here `workers: "two"`, as a
/// newer operator's schema or a hand edit could leave it) still gets its node-pool
/// finalizer step: read as stored, its pool named from that, and, with no AKS settings to
/// delete it with, the finalizer removed (conditionally on the resourceVersion read) and a
/// Warning saying the pool may be left. Before, such a job stayed in Terminating for good.
#[tokio::test]
async fn a_deleted_job_that_no_longer_parses_still_lets_go_of_its_pool_finalizer() {
    let mut stored = job();
    stored["spec"]["workers"] = json!("two");
    stored["spec"]["nodePool"] = json!({"provisioner": "aks", "vmSize": "Standard_ND96asr_v4"});
    stored["metadata"]["finalizers"] = json!(["ringmaster.dev/agent-pool"]);
    stored["metadata"]["resourceVersion"] = json!("42");
    stored["metadata"]["deletionTimestamp"] = json!("2026-11-26T01:00:00Z");
    let api = Arc::new(Mutex::new(FakeApi {
        job: stored.clone(),
        ..FakeApi::default()
    }));
    let ctx = Arc::new(Context::new(
        client(api.clone()),
        Metrics::default(),
        None,
        OperatorConfig::default(),
    ));
    ctx.cache_pods(Vec::new());
    let object: DeserializeGuard<TrainingJob> = serde_json::from_value(stored).unwrap();
    assert!(object.0.is_err(), "the stored form does not parse");
    reconcile(Arc::new(object), ctx)
        .await
        .expect("it reconciles");
    let api = api.lock().unwrap();
    let gists: Vec<String> = api.log.iter().map(Request_::gist).collect();
    // (A PATCH of the object itself is named by its last path segment.)
    assert_eq!(
        gists,
        ["GET trainingjobs", "PATCH resnet18-cpu", "POST events"]
    );
    let patch = &api.log[1].body;
    assert_eq!(
        patch,
        &json!({"metadata": {"finalizers": [], "resourceVersion": "42"}})
    );
    let warning = &api.log[2].body;
    assert_eq!(
        (&warning["type"], &warning["reason"]),
        (&json!("Warning"), &json!("NodePoolLeftBehind"))
    );
    let derived = crate::controller::training_job::names::derive_pool_name(JOB, UID);
    assert!(
        warning["note"]
            .as_str()
            .unwrap()
            .contains(&format!("agent pool {derived} was not deleted")),
        "{warning}"
    );
}
