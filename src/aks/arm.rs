//! A small Azure Resource Manager client for AKS agent pools: PUT, GET and DELETE of
//! `…/managedClusters/{cluster}/agentPools/{pool}` at one pinned api-version, and GET of a
//! long-running operation's status.
//!
//! Calls do not wait or retry inside a reconcile: throttling (429) and "another operation
//! is in progress" (409) come back as errors that carry when to try again, and the
//! controller requeues. ARM's error bodies (`{"error": {"code", "message"}}`) become
//! messages with a hint of what to do.

use std::time::Duration;

use serde::{Deserialize, Serialize};

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
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Accepted {
    /// The operation to follow (`Azure-AsyncOperation`, else `Location`), when ARM gave one.
    pub operation: Option<String>,
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
    /// Another operation on the pool or cluster is running (409): try again later.
    #[error("another operation on the cluster or pool is in progress ({message}); retrying in {} s", retry_after.as_secs())]
    Busy {
        message: String,
        retry_after: Duration,
    },
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
            ArmError::Refused { status, .. } => *status >= 500,
        }
    }

    /// When to try again.
    pub fn retry_after(&self) -> Duration {
        match self {
            ArmError::Throttled { retry_after } | ArmError::Busy { retry_after, .. } => {
                *retry_after
            }
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

/// The client.
#[derive(Clone, Debug)]
pub struct ArmClient {
    http: reqwest::Client,
    config: ArmConfig,
    tokens: TokenSource,
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
    /// A client for `config`, signing in with `tokens`.
    pub fn new(config: ArmConfig, tokens: TokenSource) -> Result<Self, ArmError> {
        crate::tls::install_provider();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .map_err(|e| ArmError::Transport {
                endpoint: config.endpoint.clone(),
                message: e.to_string(),
            })?;
        Ok(Self {
            http,
            config,
            tokens,
        })
    }

    /// The settings.
    pub fn config(&self) -> &ArmConfig {
        &self.config
    }

    fn pool_url(&self, pool: &str) -> String {
        let c = &self.config;
        format!(
            "{}/subscriptions/{}/resourceGroups/{}/providers/Microsoft.ContainerService/managedClusters/{}/agentPools/{pool}?api-version={API_VERSION}",
            c.endpoint.trim_end_matches('/'),
            c.subscription,
            c.resource_group,
            c.cluster
        )
    }

    async fn send(
        &self,
        method: reqwest::Method,
        url: &str,
        body: Option<serde_json::Value>,
    ) -> Result<reqwest::Response, ArmError> {
        let token = self.tokens.token().await?;
        let mut request = self.http.request(method, url).bearer_auth(token.secret());
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.map_err(|e| ArmError::Transport {
            endpoint: self.config.endpoint.clone(),
            // reqwest's message names the URL, never headers.
            message: e.without_url().to_string(),
        })?;
        let status = response.status().as_u16();
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
            429 => ArmError::Throttled {
                retry_after: retry_after.unwrap_or(Duration::from_secs(30)),
            },
            409 => ArmError::Busy {
                message: if message.is_empty() { code } else { message },
                retry_after: retry_after.unwrap_or(Duration::from_secs(15)),
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
            .send(reqwest::Method::GET, &self.pool_url(pool), None)
            .await?;
        if response.status().as_u16() == 404 {
            return Ok(None);
        }
        let value: serde_json::Value = response.json().await.map_err(|e| ArmError::Transport {
            endpoint: self.config.endpoint.clone(),
            message: format!("reading agent pool {pool}: {}", e.without_url()),
        })?;
        let p = &value["properties"];
        Ok(Some(AgentPool {
            provisioning_state: p["provisioningState"]
                .as_str()
                .unwrap_or("Unknown")
                .to_string(),
            count: p["count"].as_u64().unwrap_or(0) as u32,
            vm_size: p["vmSize"].as_str().unwrap_or_default().to_string(),
            tags: serde_json::from_value(p["tags"].clone()).unwrap_or_default(),
        }))
    }

    /// Creates (or updates) the pool; returns the operation to follow.
    pub async fn put_pool(
        &self,
        pool: &str,
        request: &AgentPoolRequest,
    ) -> Result<Accepted, ArmError> {
        let response = self
            .send(
                reqwest::Method::PUT,
                &self.pool_url(pool),
                Some(request.body()),
            )
            .await?;
        Ok(accepted(&response))
    }

    /// Deletes the pool; a pool already gone is fine.
    pub async fn delete_pool(&self, pool: &str) -> Result<Accepted, ArmError> {
        let response = self
            .send(reqwest::Method::DELETE, &self.pool_url(pool), None)
            .await?;
        Ok(accepted(&response))
    }

    /// The status of a long-running operation (from `Azure-AsyncOperation`).
    pub async fn operation(&self, url: &str) -> Result<Operation, ArmError> {
        let response = self.send(reqwest::Method::GET, url, None).await?;
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

fn accepted(response: &reqwest::Response) -> Accepted {
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    Accepted {
        operation: header("azure-asyncoperation").or_else(|| header("location")),
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
