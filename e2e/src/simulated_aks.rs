//! **Simulated AKS**: a local HTTP server that speaks the Azure Resource Manager agent-pool
//! API the operator uses, for tests. It is not Azure: it exists because ARM cannot run here.
//!
//! What it does as ARM does: `PUT …/agentPools/{pool}` answers 201 with an
//! `Azure-AsyncOperation` URL and the pool in `Creating`; after a delay the pool is
//! `Succeeded` and KWOK nodes shaped like the VM size (GPUs, RDMA, labels, taints from the
//! request) join the local cluster. `DELETE` answers 202, the pool is `Deleting`, its nodes
//! leave, then it is gone (404). A PUT while the pool is being made or deleted is 409
//! `OperationNotAllowed`. Conditional requests are honoured as ARM honours them: a PUT with
//! `If-None-Match: *` gets 412 `PreconditionFailed` when a pool of that name exists (also
//! one still being made or being deleted), and a PUT or DELETE with `If-Match` gets 412
//! unless the pool's eTag (`properties.eTag`, new at each write) matches. Bearer tokens are
//! checked; the api-version must be the one the operator pins. Tests can make the next PUT
//! fail synchronously (quota, unknown size) or asynchronously (capacity), throttle the next
//! requests with 429 + `Retry-After`, and count the PUTs each pool got.
//!
//! Started with [`SimulatedAks::start_without_cluster`] it needs no cluster: pools succeed
//! without nodes (for tests of the ARM client and the pool step alone).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use k8s_openapi::api::core::v1::Taint;
use kube::Client;

use crate::nodes::{self, PoolMode, PoolShape};

/// A failure to answer with, as ARM would.
#[derive(Clone, Debug)]
pub struct ArmFailure {
    /// HTTP status of a synchronous failure.
    pub status: u16,
    /// ARM error code (`InsufficientVCPUQuota`, `AllocationFailed`, …).
    pub code: String,
    /// ARM error message.
    pub message: String,
}

/// A pool as the simulated AKS holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pool {
    /// Provisioning state (`Creating`, `Succeeded`, `Failed`, `Deleting`, `Canceled`).
    pub state: String,
    /// VM size.
    pub vm_size: String,
    /// Nodes.
    pub count: u32,
    /// Tags of the last PUT.
    pub tags: BTreeMap<String, String>,
    /// eTag, new at each write.
    pub etag: String,
}

#[derive(Default)]
struct Inner {
    pools: HashMap<String, Pool>,
    operations: HashMap<String, serde_json::Value>,
    puts: HashMap<String, usize>,
    deletes: HashMap<String, usize>,
    preconditions_failed: HashMap<String, usize>,
    next_etag: u64,
    fail_next_put: Option<ArmFailure>,
    fail_deletes: usize,
    delete_failure: Option<ArmFailure>,
    fail_next_async: Option<ArmFailure>,
    throttle_next: usize,
    throttled: usize,
    /// The next requests (any kind) answered with this failure, and how many more.
    burst: Option<(usize, ArmFailure)>,
    /// Requests that reached the handlers (past the listener), for rate assertions.
    requests: usize,
    /// GETs of a pool that hang this long before they are answered, and how many more.
    hang: Option<(usize, Duration)>,
    next_operation: u64,
}

struct Shared {
    inner: Mutex<Inner>,
    token: String,
    api_version: String,
    /// The cluster the pools' nodes join; none: pools succeed without nodes.
    client: Option<Client>,
    create_delay: Duration,
    delete_delay: Duration,
    base_url: Mutex<String>,
}

/// A running simulated AKS.
pub struct SimulatedAks {
    /// Where it listens (127.0.0.1).
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for SimulatedAks {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn arm_error(status: u16, code: &str, message: &str) -> Response {
    let body = serde_json::json!({"error": {"code": code, "message": message}});
    (
        StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST),
        axum::Json(body),
    )
        .into_response()
}

fn pool_body(name: &str, pool: &Pool) -> serde_json::Value {
    serde_json::json!({
        "name": name,
        "type": "Microsoft.ContainerService/managedClusters/agentPools",
        "properties": {
            "provisioningState": pool.state,
            "count": pool.count,
            "vmSize": pool.vm_size,
            "mode": "User",
            "tags": pool.tags,
            "eTag": pool.etag,
        }
    })
}

fn parse_taint(text: &str) -> Option<Taint> {
    let (kv, effect) = text.split_once(':')?;
    let (key, value) = kv.split_once('=').unwrap_or((kv, ""));
    Some(Taint {
        key: key.into(),
        value: Some(value.into()),
        effect: effect.into(),
        time_added: None,
    })
}

impl SimulatedAks {
    /// Starts on a free loopback port; accepts only `Bearer {token}` and `api_version`.
    /// Pools take `create_delay` to be made and `delete_delay` to go.
    pub async fn start(
        client: Client,
        token: &str,
        api_version: &str,
        create_delay: Duration,
        delete_delay: Duration,
    ) -> std::io::Result<Self> {
        Self::serve(Some(client), token, api_version, create_delay, delete_delay).await
    }

    /// Like [`SimulatedAks::start`], without a cluster: pools succeed (or fail as told)
    /// without nodes joining anything.
    pub async fn start_without_cluster(
        token: &str,
        api_version: &str,
        create_delay: Duration,
        delete_delay: Duration,
    ) -> std::io::Result<Self> {
        Self::serve(None, token, api_version, create_delay, delete_delay).await
    }

    async fn serve(
        client: Option<Client>,
        token: &str,
        api_version: &str,
        create_delay: Duration,
        delete_delay: Duration,
    ) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner::default()),
            token: token.to_string(),
            api_version: api_version.to_string(),
            client,
            create_delay,
            delete_delay,
            base_url: Mutex::new(format!("http://{addr}")),
        });
        let app = Router::new()
            .route(
                "/subscriptions/{sub}/resourceGroups/{rg}/providers/Microsoft.ContainerService/managedClusters/{cluster}/agentPools/{pool}",
                get(get_pool).put(put_pool).delete(delete_pool),
            )
            .route(
                "/subscriptions/{sub}/resourceGroups/{rg}/providers/Microsoft.ContainerService/managedClusters/{cluster}/agentPools",
                get(list_pools),
            )
            .route("/operations/{id}", get(get_operation))
            .with_state(shared.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { addr, shared, task })
    }

    /// The endpoint to give the operator (`--arm-endpoint`).
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The next PUT fails at once with `failure` (e.g. 400 `InsufficientVCPUQuota`).
    pub fn fail_next_put(&self, failure: ArmFailure) {
        self.shared.inner.lock().unwrap().fail_next_put = Some(failure);
    }

    /// The next `n` DELETEs of a pool fail at once with `failure` (e.g. 403 when the
    /// operator's identity lost its role).
    pub fn fail_next_deletes(&self, n: usize, failure: ArmFailure) {
        let mut inner = self.shared.inner.lock().unwrap();
        inner.fail_deletes = n;
        inner.delete_failure = Some(failure);
    }

    /// The next pool made fails while being made (its operation carries `failure`).
    pub fn fail_next_async(&self, failure: ArmFailure) {
        self.shared.inner.lock().unwrap().fail_next_async = Some(failure);
    }

    /// The next `n` GETs of a pool hang for `how_long` before they are answered (an ARM
    /// that does not answer in time).
    pub fn hang_next_reads(&self, n: usize, how_long: Duration) {
        self.shared.inner.lock().unwrap().hang = Some((n, how_long));
    }

    /// The next `n` requests, of any kind, fail at once with `failure` after passing the
    /// token check: a burst of 500s from ARM, or of 401 `ExpiredAuthenticationToken`.
    pub fn fail_next_requests(&self, n: usize, failure: ArmFailure) {
        self.shared.inner.lock().unwrap().burst = Some((n, failure));
    }

    /// Requests answered so far (any kind, refused ones too).
    pub fn requests(&self) -> usize {
        self.shared.inner.lock().unwrap().requests
    }

    /// The next `n` requests get 429 with `Retry-After: 1`.
    pub fn throttle_next(&self, n: usize) {
        self.shared.inner.lock().unwrap().throttle_next = n;
    }

    /// Requests answered 429 so far.
    pub fn throttled(&self) -> usize {
        self.shared.inner.lock().unwrap().throttled
    }

    /// PUTs that created or updated `pool` (not refused ones).
    pub fn puts(&self, pool: &str) -> usize {
        *self
            .shared
            .inner
            .lock()
            .unwrap()
            .puts
            .get(pool)
            .unwrap_or(&0)
    }

    /// DELETEs accepted for `pool`.
    pub fn deletes(&self, pool: &str) -> usize {
        *self
            .shared
            .inner
            .lock()
            .unwrap()
            .deletes
            .get(pool)
            .unwrap_or(&0)
    }

    /// PUTs and DELETEs of `pool` refused with 412 (`If-None-Match: *` on an existing
    /// pool, `If-Match` on another eTag).
    pub fn preconditions_failed(&self, pool: &str) -> usize {
        *self
            .shared
            .inner
            .lock()
            .unwrap()
            .preconditions_failed
            .get(pool)
            .unwrap_or(&0)
    }

    /// A pool made outside Ringmaster (a person's, with no tags), already Succeeded. Its
    /// nodes are not added: no job may use it.
    pub fn made_by_hand(&self, name: &str, vm_size: &str, count: u32) {
        let mut inner = self.shared.inner.lock().unwrap();
        let etag = inner.new_etag();
        inner.pools.insert(
            name.into(),
            Pool {
                state: "Succeeded".into(),
                vm_size: vm_size.into(),
                count,
                tags: BTreeMap::new(),
                etag,
            },
        );
    }

    /// Pool `name` as it is now.
    pub fn pool(&self, name: &str) -> Option<Pool> {
        self.shared.inner.lock().unwrap().pools.get(name).cloned()
    }

    /// Pools and their states.
    pub fn pools(&self) -> BTreeMap<String, String> {
        self.shared
            .inner
            .lock()
            .unwrap()
            .pools
            .iter()
            .map(|(k, v)| (k.clone(), v.state.clone()))
            .collect()
    }
}

impl Inner {
    fn new_etag(&mut self) -> String {
        self.next_etag += 1;
        format!("\"etag-{}\"", self.next_etag)
    }

    /// ARM's answer to a request whose `If-None-Match` / `If-Match` does not hold for pool
    /// `name` (counted), or `None` when it holds.
    fn precondition(&mut self, name: &str, headers: &HeaderMap) -> Option<Response> {
        let header = |h: &str| headers.get(h).and_then(|v| v.to_str().ok());
        let existing = self.pools.get(name);
        let failed = match (header("if-none-match"), header("if-match")) {
            (Some("*"), _) if existing.is_some() => Some(format!(
                "The agent pool {name} already exists (it is {}), and If-None-Match: * asks that it does not.",
                existing.map(|p| p.state.as_str()).unwrap_or_default()
            )),
            (_, Some(tag)) if existing.is_none_or(|p| tag != "*" && tag != p.etag) => Some(
                format!("The agent pool {name} does not have the eTag {tag} If-Match asks for."),
            ),
            _ => None,
        }?;
        *self.preconditions_failed.entry(name.into()).or_default() += 1;
        Some(arm_error(412, "PreconditionFailed", &failed))
    }
}

/// Auth, api-version and throttling, as ARM checks them before anything else; then the
/// injected burst of failures, if one is due.
fn gate(shared: &Shared, headers: &HeaderMap, query: &HashMap<String, String>) -> Option<Response> {
    shared.inner.lock().unwrap().requests += 1;
    let expected = format!("Bearer {}", shared.token);
    if headers.get("authorization").and_then(|v| v.to_str().ok()) != Some(expected.as_str()) {
        return Some(arm_error(
            401,
            "InvalidAuthenticationToken",
            "The access token is invalid.",
        ));
    }
    if query.get("api-version") != Some(&shared.api_version) {
        return Some(arm_error(
            400,
            "InvalidApiVersionParameter",
            "The api-version is not supported by the simulated AKS.",
        ));
    }
    let mut inner = shared.inner.lock().unwrap();
    if inner.throttle_next > 0 {
        inner.throttle_next -= 1;
        inner.throttled += 1;
        let mut response = arm_error(429, "TooManyRequests", "The request is being throttled.");
        response
            .headers_mut()
            .insert("retry-after", "1".parse().unwrap());
        return Some(response);
    }
    if let Some((n, failure)) = inner.burst.take() {
        let response = arm_error(failure.status, &failure.code, &failure.message);
        if n > 1 {
            inner.burst = Some((n - 1, failure));
        }
        return Some(response);
    }
    None
}

type PoolPath = Path<(String, String, String, String)>;

async fn get_pool(
    State(shared): State<Arc<Shared>>,
    Path((_, _, _, name)): PoolPath,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    if let Some(refused) = gate(&shared, &headers, &query) {
        return refused;
    }
    let hang = {
        let mut inner = shared.inner.lock().unwrap();
        match inner.hang {
            Some((n, how_long)) if n > 0 => {
                inner.hang = Some((n - 1, how_long));
                Some(how_long)
            }
            _ => None,
        }
    };
    if let Some(how_long) = hang {
        tokio::time::sleep(how_long).await;
    }
    match shared.inner.lock().unwrap().pools.get(&name) {
        Some(pool) => axum::Json(pool_body(&name, pool)).into_response(),
        None => arm_error(
            404,
            "NotFound",
            &format!("Agent pool {name} was not found."),
        ),
    }
}

/// `GET …/agentPools`: every pool, two to a page (ARM pages its lists; the operator follows
/// `nextLink`), in name order.
async fn list_pools(
    State(shared): State<Arc<Shared>>,
    Path((sub, rg, cluster)): Path<(String, String, String)>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    if let Some(refused) = gate(&shared, &headers, &query) {
        return refused;
    }
    const PAGE: usize = 2;
    let page: usize = query.get("page").and_then(|p| p.parse().ok()).unwrap_or(0);
    let inner = shared.inner.lock().unwrap();
    let mut names: Vec<&String> = inner.pools.keys().collect();
    names.sort();
    let value: Vec<serde_json::Value> = names
        .iter()
        .skip(page * PAGE)
        .take(PAGE)
        .map(|name| pool_body(name, &inner.pools[*name]))
        .collect();
    let mut body = serde_json::json!({"value": value});
    if names.len() > (page + 1) * PAGE {
        let base = shared.base_url.lock().unwrap().clone();
        body["nextLink"] = serde_json::json!(format!(
            "{base}/subscriptions/{sub}/resourceGroups/{rg}/providers/Microsoft.ContainerService/managedClusters/{cluster}/agentPools?api-version={}&page={}",
            shared.api_version,
            page + 1
        ));
    }
    axum::Json(body).into_response()
}

async fn put_pool(
    State(shared): State<Arc<Shared>>,
    Path((_, _, _, name)): PoolPath,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    axum::Json(body): axum::Json<serde_json::Value>,
) -> Response {
    if let Some(refused) = gate(&shared, &headers, &query) {
        return refused;
    }
    let p = &body["properties"];
    let vm_size = p["vmSize"].as_str().unwrap_or_default().to_string();
    let count = p["count"].as_u64().unwrap_or(0) as u32;
    let (operation, pool) = {
        let mut inner = shared.inner.lock().unwrap();
        if let Some(refused) = inner.precondition(&name, &headers) {
            return refused;
        }
        if let Some(failure) = inner.fail_next_put.take() {
            return arm_error(failure.status, &failure.code, &failure.message);
        }
        if let Some(existing) = inner.pools.get(&name)
            && existing.state != "Succeeded"
            && existing.state != "Failed"
        {
            return arm_error(
                409,
                "OperationNotAllowed",
                &format!(
                    "Operation is not allowed: agent pool {name} is {}.",
                    existing.state
                ),
            );
        }
        let Ok(mut shape) = PoolShape::new(&name, &vm_size, PoolMode::User) else {
            return arm_error(
                400,
                "VMSizeNotSupported",
                &format!("The VM size {vm_size} is not supported in this region."),
            );
        };
        shape.taints = p["nodeTaints"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| parse_taint(t.as_str()?))
            .collect();
        shape.labels = serde_json::from_value(p["nodeLabels"].clone()).unwrap_or_default();
        *inner.puts.entry(name.clone()).or_default() += 1;
        inner.next_operation += 1;
        let id = format!("op{}", inner.next_operation);
        inner
            .operations
            .insert(id.clone(), serde_json::json!({"status": "InProgress"}));
        let pool = Pool {
            state: "Creating".into(),
            vm_size,
            count,
            tags: serde_json::from_value(p["tags"].clone()).unwrap_or_default(),
            etag: inner.new_etag(),
        };
        inner.pools.insert(name.clone(), pool.clone());
        let fail = inner.fail_next_async.take();
        let shared2 = shared.clone();
        let (name2, id2) = (name.clone(), id.clone());
        tokio::spawn(async move {
            tokio::time::sleep(shared2.create_delay).await;
            // A pool deleted while being made is not made (ARM cancels the creation).
            let still_wanted = shared2
                .inner
                .lock()
                .unwrap()
                .pools
                .get(&name2)
                .is_some_and(|p| p.state == "Creating");
            let (state, outcome) = match (still_wanted, fail) {
                (false, _) => (
                    "Canceled",
                    serde_json::json!({"status": "Canceled", "error": {"code": "OperationCanceled", "message": "the pool was deleted while being created"}}),
                ),
                (true, Some(f)) => (
                    "Failed",
                    serde_json::json!({"status": "Failed", "error": {"code": f.code, "message": f.message}}),
                ),
                (true, None) => {
                    let added = match &shared2.client {
                        Some(client) => nodes::add(client, &shape, count).await.map(|_| ()),
                        None => Ok(()),
                    };
                    match added {
                        Ok(()) => ("Succeeded", serde_json::json!({"status": "Succeeded"})),
                        Err(e) => (
                            "Failed",
                            serde_json::json!({"status": "Failed", "error": {"code": "InternalError", "message": e.to_string()}}),
                        ),
                    }
                }
            };
            let mut inner = shared2.inner.lock().unwrap();
            let etag = inner.new_etag();
            if let Some(pool) = inner.pools.get_mut(&name2)
                && pool.state == "Creating"
            {
                pool.state = state.into();
                pool.etag = etag;
            }
            inner.operations.insert(id2, outcome);
        });
        (id, pool)
    };
    let response = (StatusCode::CREATED, axum::Json(pool_body(&name, &pool))).into_response();
    with_operation(response, &shared, &operation)
}

/// Adds the `Azure-AsyncOperation` header pointing at operation `id`.
fn with_operation(mut response: Response, shared: &Shared, id: &str) -> Response {
    let url = format!(
        "{}/operations/{id}?api-version={}",
        shared.base_url.lock().unwrap(),
        shared.api_version
    );
    response
        .headers_mut()
        .insert("azure-asyncoperation", url.parse().unwrap());
    response
}

async fn delete_pool(
    State(shared): State<Arc<Shared>>,
    Path((_, _, _, name)): PoolPath,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    if let Some(refused) = gate(&shared, &headers, &query) {
        return refused;
    }
    let id = {
        let mut inner = shared.inner.lock().unwrap();
        if let Some(refused) = inner.precondition(&name, &headers) {
            return refused;
        }
        if inner.fail_deletes > 0 && inner.pools.contains_key(&name) {
            inner.fail_deletes -= 1;
            if let Some(failure) = &inner.delete_failure {
                return arm_error(failure.status, &failure.code, &failure.message);
            }
        }
        let Some(pool) = inner.pools.get_mut(&name) else {
            return StatusCode::NO_CONTENT.into_response();
        };
        if pool.state == "Deleting" {
            return StatusCode::ACCEPTED.into_response();
        }
        pool.state = "Deleting".into();
        let etag = inner.new_etag();
        if let Some(pool) = inner.pools.get_mut(&name) {
            pool.etag = etag;
        }
        *inner.deletes.entry(name.clone()).or_default() += 1;
        inner.next_operation += 1;
        let id = format!("op{}", inner.next_operation);
        inner
            .operations
            .insert(id.clone(), serde_json::json!({"status": "InProgress"}));
        id
    };
    let (shared2, name2, id2) = (shared.clone(), name.clone(), id.clone());
    tokio::spawn(async move {
        tokio::time::sleep(shared2.delete_delay).await;
        let removed = match &shared2.client {
            Some(client) => nodes::remove(client, &name2).await.map(|_| ()),
            None => Ok(()),
        };
        let mut inner = shared2.inner.lock().unwrap();
        inner.pools.remove(&name2);
        let outcome = match removed {
            Ok(_) => serde_json::json!({"status": "Succeeded"}),
            Err(e) => {
                serde_json::json!({"status": "Failed", "error": {"code": "InternalError", "message": e.to_string()}})
            }
        };
        inner.operations.insert(id2, outcome);
    });
    with_operation(StatusCode::ACCEPTED.into_response(), &shared, &id)
}

async fn get_operation(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    if let Some(refused) = gate(&shared, &headers, &query) {
        return refused;
    }
    match shared.inner.lock().unwrap().operations.get(&id) {
        Some(status) => axum::Json(status.clone()).into_response(),
        None => arm_error(404, "NotFound", "No such operation."),
    }
}
