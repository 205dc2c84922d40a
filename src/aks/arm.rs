//! A small Azure Resource Manager client for AKS agent pools: create (PUT with
//! `If-None-Match: *`), GET and DELETE (with `If-Match` on the eTag read) of
//! `…/managedClusters/{cluster}/agentPools/{pool}` at one pinned api-version, and GET of a
//! long-running operation's status.
//!
//! The bearer token goes only to the configured endpoint's origin: every URL the client
//! requests is an [`ArmUrl`], which only [`ArmClient::own_url`] makes (same scheme, host and
//! port as the endpoint, no user info). An operation URL from a response or from a job's
//! status that is not one is dropped, never requested; redirects are not followed.
//!
//! Calls do not wait or retry inside a reconcile: throttling (429) and "another operation
//! is in progress" (409) come back as errors that carry when to try again, and the
//! controller requeues. Every call first takes its turn from one rate limit shared by all
//! jobs ([`ArmLimit`]), which a 429 pauses for everyone; a call that would wait for it
//! longer than a second is not sent and comes back as [`ArmError::RateLimited`]. ARM's error bodies (`{"error": {"code", "message"}}`) become
//! messages with a hint of what to do.

use std::time::Duration;

use reqwest::Url;
use serde::{Deserialize, Serialize};

use super::limit::{ArmLimit, Held};
use super::token::{TokenError, TokenSource};

/// The AKS API version every call uses.
pub const API_VERSION: &str = "2025-07-01";

/// Where the agent pools live.
#[derive(Clone, Debug)]
pub struct ArmConfig {
    /// ARM's endpoint (`https://management.azure.com`; another for sovereign clouds or the
    /// simulated AKS).
    pub endpoint: String,
    /// Subscription id.
    pub subscription: String,
    /// Resource group of the managed cluster.
    pub resource_group: String,
    /// Name of the managed cluster.
    pub cluster: String,
}

/// What the controller asks ARM for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentPoolRequest {
    /// VM size.
    pub vm_size: String,
    /// Number of nodes.
    pub count: u32,
    /// Labels on every node.
    pub node_labels: std::collections::BTreeMap<String, String>,
    /// Taints (`key=value:Effect`).
    pub node_taints: Vec<String>,
    /// Spot VMs (evictable, cheaper).
    pub spot: bool,
    /// Let AKS install the NVIDIA driver (`Install`) or not (`None`: the GPU operator does).
    pub gpu_driver_install: bool,
    /// Tags on the pool's Azure resources.
    pub tags: std::collections::BTreeMap<String, String>,
}

impl AgentPoolRequest {
    /// The ARM request body.
    pub fn body(&self) -> serde_json::Value {
        let mut properties = serde_json::json!({
            "count": self.count,
            "vmSize": self.vm_size,
            "mode": "User",
            "osType": "Linux",
            "type": "VirtualMachineScaleSets",
            "nodeLabels": self.node_labels,
            "nodeTaints": self.node_taints,
            "tags": self.tags,
            "gpuProfile": {"driver": if self.gpu_driver_install { "Install" } else { "None" }},
        });
        if self.spot {
            properties["scaleSetPriority"] = "Spot".into();
            properties["scaleSetEvictionPolicy"] = "Delete".into();
            properties["spotMaxPrice"] = (-1).into();
        }
        serde_json::json!({ "properties": properties })
    }
}

/// An agent pool as ARM reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentPool {
    /// `Creating`, `Succeeded`, `Failed`, `Deleting`, `Canceled`, `Updating`…
    pub provisioning_state: String,
    /// Nodes asked for.
    pub count: u32,
    /// VM size.
    pub vm_size: String,
    /// Tags on the pool (the job that made it, for one Ringmaster made).
    pub tags: std::collections::BTreeMap<String, String>,
    /// The pool's eTag (`properties.eTag`), when ARM reports one: a delete sends it as
    /// `If-Match`, so a pool replaced since it was read is not deleted.
    pub etag: Option<String>,
}

/// A long-running operation's outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Operation {
    /// Still running.
    InProgress,
    /// Done.
    Succeeded,
    /// Failed or canceled, with ARM's reason.
    Failed { code: String, message: String },
}

/// What a PUT or DELETE started.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Accepted {
    /// The operation to follow (`Azure-AsyncOperation`, else `Location`), when ARM gave one
    /// on its own origin ([`ArmClient::own_url`]).
    pub operation: Option<String>,
    /// An operation URL the response named that is not on ARM's origin: dropped, never
    /// followed (said in a Warning).
    pub ignored_operation: Option<String>,
}

/// Errors of ARM calls. Messages never carry the token.
#[derive(Debug, thiserror::Error)]
pub enum ArmError {
    /// No token.
    #[error(transparent)]
    Token(#[from] TokenError),
    /// ARM could not be reached.
    #[error("reaching Azure Resource Manager at {endpoint}: {message}")]
    Transport { endpoint: String, message: String },
    /// Throttled: try again after the time ARM asked for.
    #[error("Azure Resource Manager is throttling requests (429); retrying in {} s", retry_after.as_secs())]
    Throttled { retry_after: Duration },
    /// Not sent: the operator's own ARM budget is spent (`--arm-requests-per-second`), or ARM
    /// asked every caller to pause (an earlier 429). Try again after `retry_after`.
    #[error("{}; retrying in {} s", if *by_arm { "Azure Resource Manager asked the operator to pause its requests (429)".to_string() } else { format!("the operator's Azure Resource Manager requests are at their limit ({per_second} per second, --arm-requests-per-second)") }, retry_after.as_secs().max(1))]
    RateLimited {
        retry_after: Duration,
        by_arm: bool,
        per_second: u32,
    },
    /// Another operation on the pool or cluster is running (409): try again later.
    #[error("another operation on the cluster or pool is in progress ({message}); retrying in {} s", retry_after.as_secs())]
    Busy {
        message: String,
        retry_after: Duration,
    },
    /// A condition of the request did not hold (412): the pool a create (`If-None-Match: *`)
    /// was to make exists already, or the pool a delete (`If-Match`) was to remove changed
    /// since it was read. Nothing was written; look at the pool again.
    #[error("the agent pool exists already or changed since it was read (412 Precondition Failed{})", if message.is_empty() { String::new() } else { format!(": {message}") })]
    PreconditionFailed { message: String },
    /// The configured endpoint is not an `https://` (or `http://`) URL.
    #[error("the Azure Resource Manager endpoint {endpoint} is not usable: {message}")]
    Endpoint { endpoint: String, message: String },
    /// ARM refused the request.
    #[error("{code}: {message}{}", hint_text(code))]
    Refused {
        status: u16,
        code: String,
        message: String,
    },
}

impl ArmError {
    /// Whether trying again later can help (the controller requeues) or the request itself
    /// is wrong (the job fails with the message).
    pub fn is_transient(&self) -> bool {
        match self {
            ArmError::Token(_) | ArmError::Transport { .. } => true,
            ArmError::Throttled { .. } | ArmError::Busy { .. } => true,
            ArmError::RateLimited { .. } => true,
            // Looked at again: the next look decides with what is there now.
            ArmError::PreconditionFailed { .. } => true,
            ArmError::Endpoint { .. } => false,
            // 401: the token expired or was revoked mid-flight; the next call takes a new
            // one (the identity credential renews, the token file is read again). 408: ARM
            // timed out. 5xx: ARM's own trouble.
            ArmError::Refused { status, .. } => matches!(status, 401 | 408 | 500..),
        }
    }

    /// When to try again.
    pub fn retry_after(&self) -> Duration {
        match self {
            ArmError::Throttled { retry_after }
            | ArmError::Busy { retry_after, .. }
            | ArmError::RateLimited { retry_after, .. } => *retry_after,
            ArmError::Refused { status: 401, .. } => Duration::from_secs(5),
            ArmError::PreconditionFailed { .. } => Duration::from_secs(2),
            _ => Duration::from_secs(15),
        }
    }
}

/// What a user can do about an ARM error code.
pub fn hint(code: &str) -> Option<&'static str> {
    let code = code.to_ascii_lowercase();
    Some(if code.contains("quota") {
        "the subscription's vCPU quota for this VM family in the cluster's region is too small: request more (Azure portal → Quotas) or ask for fewer workers or a smaller vmSize"
    } else if code.contains("vmsize") || code.contains("skunotavailable") {
        "this VM size is not offered for AKS in the cluster's region (or to this subscription): pick another nodePool.vmSize"
    } else if code.contains("allocation") || code.contains("capacity") {
        "Azure has no capacity for this VM size right now: try later, another region or zone, or spot"
    } else if code.contains("authenticationtoken") {
        "the operator's ARM token was refused (expired or revoked): a new one is taken on the next try; if this goes on, check the operator's workload identity or token file"
    } else if code.contains("authorization") || code.contains("forbidden") {
        "the operator's identity may not manage agent pools: grant it 'Azure Kubernetes Service Contributor' on the cluster"
    } else if code.contains("notfound") {
        "the managed cluster was not found: check the operator's subscription, resource group and cluster settings"
    } else {
        return None;
    })
}

fn hint_text(code: &str) -> String {
    hint(code).map(|h| format!(" ({h})")).unwrap_or_default()
}

/// A URL on the configured ARM endpoint's origin: the only kind the client sends its token
/// to. Made by [`ArmClient::own_url`] (and by the client for its own pool URLs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArmUrl(Url);

impl ArmUrl {
    /// The URL, as sent.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl std::fmt::Display for ArmUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.as_str())
    }
}

/// The longest one ARM request may take: a reconcile worker waits for it, so a hung ARM
/// must not hold one for long. ARM answers in well under a second; a long-running operation
/// is followed by polling, never waited for in one request. A timed-out request is transient:
/// the job looks again later.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);

/// The client.
#[derive(Clone, Debug)]
pub struct ArmClient {
    http: reqwest::Client,
    /// The longest one request may take (its answer included).
    timeout: Duration,
    config: ArmConfig,
    /// The endpoint, parsed: its origin is where the token may go.
    base: Url,
    tokens: TokenSource,
    /// The request budget every clone of this client shares.
    limit: ArmLimit,
}

#[derive(Deserialize)]
struct ErrorBody {
    error: Option<ErrorDetail>,
}

#[derive(Deserialize)]
struct ErrorDetail {
    code: Option<String>,
    message: Option<String>,
}

impl ArmClient {
    /// A client for `config`, signing in with `tokens`. The endpoint must be an `https://`
    /// URL (an `http://` one is taken, with a warning: the simulated AKS of the tests listens
    /// on loopback without TLS) without user info.
    pub fn new(config: ArmConfig, tokens: TokenSource) -> Result<Self, ArmError> {
        crate::tls::install_provider();
        let refuse = |message: &str| ArmError::Endpoint {
            endpoint: config.endpoint.clone(),
            message: message.to_string(),
        };
        let base = Url::parse(&config.endpoint).map_err(|e| refuse(&e.to_string()))?;
        match base.scheme() {
            "https" => {}
            "http" => tracing::warn!(
                endpoint = %config.endpoint,
                "the Azure Resource Manager endpoint is not https: its token travels unencrypted (only for a local simulated AKS)"
            ),
            _ => return Err(refuse("not an https:// URL")),
        }
        if base.host().is_none() {
            return Err(refuse("no host"));
        }
        if !base.username().is_empty() || base.password().is_some() {
            return Err(refuse("user info in the URL"));
        }
        let http = reqwest::Client::builder()
            // A redirect is a URL from a response: not followed (ARM does not redirect these).
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| ArmError::Transport {
                endpoint: config.endpoint.clone(),
                message: e.to_string(),
            })?;
        Ok(Self {
            http,
            timeout: REQUEST_TIMEOUT,
            config,
            base,
            tokens,
            limit: ArmLimit::default(),
        })
    }

    /// The same client under another shared request limit (`--arm-requests-per-second`).
    pub fn with_limit(mut self, limit: ArmLimit) -> Self {
        self.limit = limit;
        self
    }

    /// The same client with another per-request timeout (the tests' hung ARM).
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The settings.
    pub fn config(&self) -> &ArmConfig {
        &self.config
    }

    /// `url` when the token may go there: an absolute URL with the configured endpoint's
    /// scheme, host and port (so `https` only, unless the endpoint itself is `http`) and no
    /// user info. Anything else (another host or port, `http` for an `https` endpoint,
    /// `https://management.azure.com@elsewhere/`, a relative URL) is `None`.
    pub fn own_url(&self, url: &str) -> Option<ArmUrl> {
        let url = Url::parse(url).ok()?;
        let base = &self.base;
        let same_origin = url.scheme() == base.scheme()
            && url.host().is_some()
            && url.host() == base.host()
            && url.port_or_known_default() == base.port_or_known_default();
        let no_user_info = url.username().is_empty() && url.password().is_none();
        (same_origin && no_user_info).then_some(ArmUrl(url))
    }

    /// The cluster's agent pools (`suffix` empty), or one of them (`suffix` `/<pool>`).
    fn agent_pools_url(&self, suffix: &str) -> Result<ArmUrl, ArmError> {
        let c = &self.config;
        let url = format!(
            "{}/subscriptions/{}/resourceGroups/{}/providers/Microsoft.ContainerService/managedClusters/{}/agentPools{suffix}?api-version={API_VERSION}",
            c.endpoint.trim_end_matches('/'),
            c.subscription,
            c.resource_group,
            c.cluster
        );
        self.own_url(&url).ok_or_else(|| ArmError::Endpoint {
            endpoint: c.endpoint.clone(),
            message: format!("the URL of agentPools{suffix} is not on the endpoint"),
        })
    }

    fn pools_url(&self) -> Result<ArmUrl, ArmError> {
        self.agent_pools_url("")
    }

    fn pool_url(&self, pool: &str) -> Result<ArmUrl, ArmError> {
        self.agent_pools_url(&format!("/{pool}"))
    }

    async fn send(
        &self,
        method: reqwest::Method,
        url: &ArmUrl,
        headers: &[(&str, &str)],
        body: Option<serde_json::Value>,
    ) -> Result<reqwest::Response, ArmError> {
        self.limit.admit().await.map_err(
            |Held {
                 retry_after,
                 by_arm,
             }| ArmError::RateLimited {
                retry_after,
                by_arm,
                per_second: self.limit.per_second(),
            },
        )?;
        let token = self.tokens.token().await?;
        let mut request = self
            .http
            .request(method, url.0.clone())
            .timeout(self.timeout)
            .bearer_auth(token.secret());
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.map_err(|e| ArmError::Transport {
            endpoint: self.config.endpoint.clone(),
            // reqwest's message names the URL, never headers.
            message: e.without_url().to_string(),
        })?;
        let status = response.status().as_u16();
        if (300..400).contains(&status) {
            return Err(ArmError::Refused {
                status,
                code: format!("HTTP{status}"),
                message: "a redirect, not followed: the token goes only to the configured endpoint"
                    .into(),
            });
        }
        if status < 400 || status == 404 {
            return Ok(response);
        }
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .map(|s| Duration::from_secs(s.clamp(1, 600)));
        let body: Option<ErrorBody> = response.json().await.ok();
        let (code, message) = body
            .and_then(|b| b.error)
            .map(|e| (e.code.unwrap_or_default(), e.message.unwrap_or_default()))
            .unwrap_or_default();
        Err(match status {
            429 => {
                let retry_after = retry_after.unwrap_or(Duration::from_secs(30));
                // ARM's budget is the subscription's: every job waits, not only this one.
                self.limit.pause(retry_after);
                ArmError::Throttled { retry_after }
            }
            409 => ArmError::Busy {
                message: if message.is_empty() { code } else { message },
                retry_after: retry_after.unwrap_or(Duration::from_secs(15)),
            },
            412 => ArmError::PreconditionFailed {
                message: if message.is_empty() { code } else { message },
            },
            _ => ArmError::Refused {
                status,
                code: if code.is_empty() {
                    format!("HTTP{status}")
                } else {
                    code
                },
                message,
            },
        })
    }

    /// The pool, or `None` when it does not exist.
    pub async fn get_pool(&self, pool: &str) -> Result<Option<AgentPool>, ArmError> {
        let response = self
            .send(reqwest::Method::GET, &self.pool_url(pool)?, &[], None)
            .await?;
        if response.status().as_u16() == 404 {
            return Ok(None);
        }
        let value = self
            .read_json(response, &format!("agent pool {pool}"))
            .await?;
        Ok(Some(agent_pool(&value)))
    }

    /// Every agent pool of the cluster, by name, following ARM's `nextLink` pages (only
    /// while they are on the configured endpoint: [`ArmClient::own_url`]).
    pub async fn list_pools(&self) -> Result<Vec<(String, AgentPool)>, ArmError> {
        let mut pools = Vec::new();
        let mut next = Some(self.pools_url()?);
        while let Some(url) = next.take() {
            let response = self.send(reqwest::Method::GET, &url, &[], None).await?;
            let page = self.read_json(response, "the list of agent pools").await?;
            for value in page["value"].as_array().into_iter().flatten() {
                let name = value["name"].as_str().unwrap_or_default().to_string();
                pools.push((name, agent_pool(value)));
            }
            next = match page["nextLink"].as_str() {
                Some(link) => Some(self.own_url(link).ok_or_else(|| ArmError::Endpoint {
                    endpoint: self.config.endpoint.clone(),
                    message:
                        "the list of agent pools continues off the endpoint; not followed".into(),
                })?),
                None => None,
            };
        }
        Ok(pools)
    }

    async fn read_json(
        &self,
        response: reqwest::Response,
        what: &str,
    ) -> Result<serde_json::Value, ArmError> {
        response.json().await.map_err(|e| ArmError::Transport {
            endpoint: self.config.endpoint.clone(),
            message: format!("reading {what}: {}", e.without_url()),
        })
    }

    /// Creates the pool, never overwriting one: the PUT carries `If-None-Match: *`, and ARM
    /// answers [`ArmError::PreconditionFailed`] (412) when a pool of that name exists (also
    /// one still being made). Returns the operation to follow.
    pub async fn create_pool(
        &self,
        pool: &str,
        request: &AgentPoolRequest,
    ) -> Result<Accepted, ArmError> {
        let response = self
            .send(
                reqwest::Method::PUT,
                &self.pool_url(pool)?,
                &[("if-none-match", "*")],
                Some(request.body()),
            )
            .await?;
        Ok(self.accepted(&response))
    }

    /// Deletes the pool; a pool already gone is fine. With `etag` (the one read with the
    /// pool whose tags were checked) the DELETE carries `If-Match`, and a pool replaced or
    /// changed since is not deleted ([`ArmError::PreconditionFailed`]).
    pub async fn delete_pool(&self, pool: &str, etag: Option<&str>) -> Result<Accepted, ArmError> {
        let if_match: Vec<(&str, &str)> = etag.map(|e| ("if-match", e)).into_iter().collect();
        let response = self
            .send(
                reqwest::Method::DELETE,
                &self.pool_url(pool)?,
                &if_match,
                None,
            )
            .await?;
        Ok(self.accepted(&response))
    }

    /// The status of a long-running operation (from `Azure-AsyncOperation`), at a URL
    /// [`ArmClient::own_url`] let through.
    pub async fn operation(&self, url: &ArmUrl) -> Result<Operation, ArmError> {
        let response = self.send(reqwest::Method::GET, url, &[], None).await?;
        let value: serde_json::Value = response.json().await.unwrap_or_default();
        Ok(match value["status"].as_str().unwrap_or("InProgress") {
            "Succeeded" => Operation::Succeeded,
            "Failed" | "Canceled" => Operation::Failed {
                code: value["error"]["code"]
                    .as_str()
                    .unwrap_or("Failed")
                    .to_string(),
                message: value["error"]["message"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            },
            _ => Operation::InProgress,
        })
    }
}

impl ArmClient {
    /// The operation a PUT or DELETE started, when ARM named one on its own origin.
    fn accepted(&self, response: &reqwest::Response) -> Accepted {
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let Some(url) = header("azure-asyncoperation").or_else(|| header("location")) else {
            return Accepted::default();
        };
        match self.own_url(&url) {
            Some(own) => Accepted {
                operation: Some(own.to_string()),
                ignored_operation: None,
            },
            None => {
                tracing::warn!(operation = %url, endpoint = %self.config.endpoint, "an operation URL not on the ARM endpoint: not followed");
                Accepted {
                    operation: None,
                    ignored_operation: Some(url),
                }
            }
        }
    }
}

/// An agent pool as ARM describes it (one of a list, or one read alone).
fn agent_pool(value: &serde_json::Value) -> AgentPool {
    let p = &value["properties"];
    AgentPool {
        provisioning_state: p["provisioningState"]
            .as_str()
            .unwrap_or("Unknown")
            .to_string(),
        count: p["count"].as_u64().unwrap_or(0) as u32,
        vm_size: p["vmSize"].as_str().unwrap_or_default().to_string(),
        tags: serde_json::from_value(p["tags"].clone()).unwrap_or_default(),
        etag: p["eTag"]
            .as_str()
            .or_else(|| value["etag"].as_str())
            .map(str::to_string),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_body_has_what_aks_needs() {
        let request = AgentPoolRequest {
            vm_size: "Standard_ND96asr_v4".into(),
            count: 2,
            node_labels: [("ringmaster.dev/pool".to_string(), "rmjob1abcd".to_string())].into(),
            node_taints: vec!["ringmaster.dev/pool=rmjob1abcd:NoSchedule".into()],
            spot: true,
            gpu_driver_install: false,
            tags: Default::default(),
        };
        let body = request.body();
        let p = &body["properties"];
        assert_eq!(p["count"], 2);
        assert_eq!(p["mode"], "User");
        assert_eq!(p["scaleSetPriority"], "Spot");
        assert_eq!(p["spotMaxPrice"], -1);
        assert_eq!(p["gpuProfile"]["driver"], "None");
        assert_eq!(
            p["nodeTaints"][0],
            "ringmaster.dev/pool=rmjob1abcd:NoSchedule"
        );
    }

    fn client(endpoint: &str) -> Result<ArmClient, ArmError> {
        ArmClient::new(
            ArmConfig {
                endpoint: endpoint.into(),
                subscription: "sub".into(),
                resource_group: "rg".into(),
                cluster: "aks".into(),
            },
            TokenSource::File("/nonexistent/token".into()),
        )
    }

    #[test]
    fn the_token_goes_only_to_the_endpoints_origin() {
        let arm = client("https://management.azure.com").unwrap();
        let own = |url: &str| arm.own_url(url).map(|u| u.to_string());
        let op = "https://management.azure.com/subscriptions/sub/providers/Microsoft.ContainerService/locations/eastus/operations/1?api-version=2025-07-01";
        assert_eq!(own(op).as_deref(), Some(op));
        // The same origin written differently: default port, upper case, path-less.
        assert!(own("https://management.azure.com:443/operations/1").is_some());
        assert!(own("HTTPS://MANAGEMENT.AZURE.COM/operations/1").is_some());
        assert!(own("https://management.azure.com").is_some());
        for foreign in [
            // Another host, or one that only starts or ends like ARM's.
            "https://evil.example/operations/1",
            "https://evil.example",
            "https://management.azure.com.evil.example/operations/1",
            "https://evilmanagement.azure.com/operations/1",
            "https://management.azure.com./operations/1",
            // Another port; plain http to ARM's host.
            "https://management.azure.com:8443/operations/1",
            "http://management.azure.com/operations/1",
            "http://management.azure.com:443/operations/1",
            // User info: the host is the part after the @.
            "https://management.azure.com@evil.example/",
            "https://management.azure.com:443@evil.example/operations/1",
            "https://user:pass@management.azure.com/operations/1",
            "https://token@management.azure.com/operations/1",
            // Other schemes; relative and scheme-relative URLs; not URLs.
            "ftp://management.azure.com/operations/1",
            "file:///etc/passwd",
            "//evil.example/operations/1",
            "/subscriptions/sub/operations/1",
            "operations/1",
            "",
            "https://",
            "https://[::1]/operations/1",
            "https://127.0.0.1/operations/1",
        ] {
            assert_eq!(own(foreign), None, "{foreign} was let through");
        }
        // A backslash is a slash in a URL: the host stays ARM's.
        assert_eq!(
            arm.own_url("https://management.azure.com\\@evil.example/")
                .map(|u| u.0.host_str().map(str::to_string)),
            Some(Some("management.azure.com".into()))
        );

        // An http endpoint (the simulated AKS on loopback): http to exactly its origin.
        let local = client("http://127.0.0.1:8081/").unwrap();
        assert!(
            local
                .own_url("http://127.0.0.1:8081/operations/op1")
                .is_some()
        );
        for foreign in [
            "http://127.0.0.1:8082/operations/op1",
            "http://127.0.0.1/operations/op1",
            "https://127.0.0.1:8081/operations/op1",
            "http://localhost:8081/operations/op1",
            "http://127.0.0.1:8081@127.0.0.1:8082/operations/op1",
            "http://[::1]:8081/operations/op1",
        ] {
            assert!(
                local.own_url(foreign).is_none(),
                "{foreign} was let through"
            );
        }
        // Its own pool URLs are its own.
        assert!(
            arm.pool_url("pool1")
                .unwrap()
                .as_str()
                .starts_with("https://management.azure.com/subscriptions/sub/resourceGroups/rg/")
        );
    }

    #[test]
    fn an_endpoint_that_is_not_an_http_url_is_refused() {
        for endpoint in [
            "management.azure.com",
            "ftp://management.azure.com",
            "https://user:secret@management.azure.com",
            "",
        ] {
            assert!(
                matches!(client(endpoint), Err(ArmError::Endpoint { .. })),
                "{endpoint}"
            );
        }
        assert!(client("https://management.usgovcloudapi.net/").is_ok());
    }

    #[test]
    fn errors_say_what_to_do_and_which_are_worth_retrying() {
        let quota = ArmError::Refused {
            status: 400,
            code: "InsufficientVCPUQuota".into(),
            message: "Insufficient regional vcpu quota left".into(),
        };
        assert!(quota.to_string().contains("request more"), "{quota}");
        assert!(!quota.is_transient());
        let busy = ArmError::Busy {
            message: "OperationNotAllowed".into(),
            retry_after: Duration::from_secs(7),
        };
        assert!(busy.is_transient());
        assert_eq!(busy.retry_after(), Duration::from_secs(7));
    }
}
