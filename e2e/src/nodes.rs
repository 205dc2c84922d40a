//! Simulated AKS nodes: KWOK Node objects labelled and sized the way AKS labels and sizes the
//! VMs of an agent pool. KWOK's controller (kwok.x-k8s.io/node=fake) keeps them Ready and
//! plays their pods; no kubelet, container or GPU exists behind them.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, NodeSpec, NodeStatus, Taint};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use ringmaster::api::vm_sizes::{self, VmSize};

/// Field manager of the nodes this module writes.
pub const FIELD_MANAGER: &str = "ringmaster-e2e-nodes";
/// AKS's agent-pool label.
pub const AGENT_POOL_LABEL: &str = "kubernetes.azure.com/agentpool";
/// The RDMA shared device plugin's resource on InfiniBand nodes.
pub const RDMA_RESOURCE: &str = "rdma/shared_ib";
/// How many pods may share the RDMA device (the plugin's `rdmaHcaMax`).
pub const RDMA_SHARES: u32 = 1000;
/// The annotation KWOK's controller selects the nodes it plays by.
pub const KWOK_NODE_ANNOTATION: &str = "kwok.x-k8s.io/node";

/// Errors adding or removing nodes.
#[derive(Debug, thiserror::Error)]
pub enum NodesError {
    /// The VM size is not in Ringmaster's table.
    #[error("unknown VM size {0}; known sizes: {1}")]
    UnknownVmSize(String, String),
    /// The API server refused a request.
    #[error("{action} node {node}: {source}")]
    Api {
        action: &'static str,
        node: String,
        #[source]
        source: kube::Error,
    },
}

/// Whether a pool runs system pods or user workloads (AKS `mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PoolMode {
    /// CoreDNS, metrics and operators.
    System,
    /// Workloads.
    User,
}

/// An agent pool to simulate.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolShape {
    /// The agent pool's name.
    pub pool: String,
    /// The VM size of its nodes.
    pub vm_size: &'static VmSize,
    /// System or user pool.
    pub mode: PoolMode,
    /// Taints on every node, as AKS `nodeTaints`.
    pub taints: Vec<Taint>,
    /// Extra node labels, as AKS `nodeLabels`.
    pub labels: BTreeMap<String, String>,
}

impl PoolShape {
    /// A pool of `vm_size` nodes, looked up in Ringmaster's VM size table.
    pub fn new(pool: &str, vm_size: &str, mode: PoolMode) -> Result<Self, NodesError> {
        let vm_size = vm_sizes::find(vm_size).ok_or_else(|| {
            let known: Vec<&str> = vm_sizes::KNOWN_VM_SIZES.iter().map(|s| s.name).collect();
            NodesError::UnknownVmSize(vm_size.to_string(), known.join(", "))
        })?;
        Ok(Self {
            pool: pool.to_string(),
            vm_size,
            mode,
            taints: Vec::new(),
            labels: BTreeMap::new(),
        })
    }

    /// This shape with the taint `key=value:NoSchedule` on every node, so that only pods
    /// tolerating it land there.
    pub fn tainted(mut self, key: &str, value: &str) -> Self {
        self.taints.push(Taint {
            key: key.to_string(),
            value: Some(value.to_string()),
            effect: "NoSchedule".to_string(),
            time_added: None,
        });
        self
    }

    /// The name AKS gives the pool's `index`th VM: `aks-<pool>-<8 digits>-vmss<6 base-36 digits>`.
    pub fn node_name(&self, index: u32) -> String {
        // AKS derives the digits from the cluster and pool; a hash of the pool name keeps
        // names stable across runs.
        let digits = self.pool.bytes().fold(2166136261u32, |h, b| {
            (h ^ u32::from(b)).wrapping_mul(16777619)
        }) % 100_000_000;
        format!("aks-{}-{digits:08}-vmss{}", self.pool, base36(index, 6))
    }

    /// The Node object of the `index`th VM, status included.
    pub fn node(&self, index: u32) -> Node {
        let name = self.node_name(index);
        let vm = self.vm_size;
        let mut labels: BTreeMap<String, String> = [
            (AGENT_POOL_LABEL, self.pool.clone()),
            ("agentpool", self.pool.clone()),
            (
                "kubernetes.azure.com/mode",
                match self.mode {
                    PoolMode::System => "system".into(),
                    PoolMode::User => "user".into(),
                },
            ),
            ("node.kubernetes.io/instance-type", vm.name.to_string()),
            ("beta.kubernetes.io/instance-type", vm.name.to_string()),
            ("kubernetes.io/os", "linux".into()),
            ("kubernetes.io/arch", "amd64".into()),
            ("kubernetes.io/hostname", name.clone()),
            ("kubernetes.azure.com/role", "agent".into()),
            ("topology.kubernetes.io/region", "eastus".into()),
            ("topology.kubernetes.io/zone", "0".into()),
            ("type", "kwok".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        if vm.gpus > 0 {
            labels.insert("kubernetes.azure.com/accelerator".into(), "nvidia".into());
        }
        labels.extend(self.labels.clone());

        let mut resources: BTreeMap<String, Quantity> = [
            ("cpu", vm.cpus.to_string()),
            ("memory", format!("{}Gi", vm.memory_gib)),
            ("pods", "110".to_string()),
            ("ephemeral-storage", "1Ti".to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), Quantity(v)))
        .collect();
        if vm.gpus > 0 {
            resources.insert("nvidia.com/gpu".into(), Quantity(vm.gpus.to_string()));
        }
        if vm.infiniband {
            resources.insert(RDMA_RESOURCE.into(), Quantity(RDMA_SHARES.to_string()));
        }
        Node {
            metadata: ObjectMeta {
                name: Some(name),
                labels: Some(labels),
                annotations: Some(BTreeMap::from([
                    (KWOK_NODE_ANNOTATION.to_string(), "fake".to_string()),
                    ("node.alpha.kubernetes.io/ttl".to_string(), "0".to_string()),
                ])),
                ..Default::default()
            },
            spec: Some(NodeSpec {
                taints: (!self.taints.is_empty()).then(|| self.taints.clone()),
                provider_id: Some(format!(
                    "azure:///subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/mc_ringmaster/providers/Microsoft.Compute/virtualMachineScaleSets/aks-{}-vmss/virtualMachines/{index}",
                    self.pool
                )),
                ..Default::default()
            }),
            status: Some(NodeStatus {
                allocatable: Some(resources.clone()),
                capacity: Some(resources),
                ..Default::default()
            }),
        }
    }
}

fn base36(mut n: u32, width: usize) -> String {
    let mut digits = Vec::new();
    loop {
        digits.push(std::char::from_digit(n % 36, 36).expect("digit below 36"));
        n /= 36;
        if n == 0 {
            break;
        }
    }
    while digits.len() < width {
        digits.push('0');
    }
    digits.iter().rev().collect()
}

/// Creates (or updates) nodes `0..count` of `shape`, status included. Idempotent.
pub async fn add(
    client: &Client,
    shape: &PoolShape,
    count: u32,
) -> Result<Vec<String>, NodesError> {
    let api: Api<Node> = Api::all(client.clone());
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let mut names = Vec::new();
    for index in 0..count {
        let mut node = shape.node(index);
        let name = node.name_any();
        let status = node.status.take();
        let api_error = |action: &'static str| {
            let node = name.clone();
            move |source| NodesError::Api {
                action,
                node,
                source,
            }
        };
        let mut body = serde_json::to_value(&node).expect("node serializes");
        body["apiVersion"] = "v1".into();
        body["kind"] = "Node".into();
        api.patch(&node.name_any(), &params, &Patch::Apply(&body))
            .await
            .map_err(api_error("creating"))?;
        let status = serde_json::json!({"apiVersion": "v1", "kind": "Node", "status": status});
        api.patch_status(&node.name_any(), &params, &Patch::Apply(&status))
            .await
            .map_err(api_error("sizing"))?;
        names.push(node.name_any());
    }
    Ok(names)
}

/// Deletes every node of `pool`; returns their names.
pub async fn remove(client: &Client, pool: &str) -> Result<Vec<String>, NodesError> {
    let api: Api<Node> = Api::all(client.clone());
    let selector = format!("{AGENT_POOL_LABEL}={pool}");
    let nodes = api
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(|source| NodesError::Api {
            action: "listing",
            node: selector.clone(),
            source,
        })?;
    let mut names = Vec::new();
    for node in nodes {
        let name = node.name_any();
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => names.push(name),
            Err(kube::Error::Api(status)) if status.code == 404 => names.push(name),
            Err(source) => {
                return Err(NodesError::Api {
                    action: "deleting",
                    node: name,
                    source,
                });
            }
        }
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nd96asr_v4_nodes_look_like_aks() {
        let shape = PoolShape::new("gpu", "Standard_ND96asr_v4", PoolMode::User).unwrap();
        let node = shape.node(11);
        let name = node.name_any();
        assert!(
            name.starts_with("aks-gpu-") && name.ends_with("-vmss00000b"),
            "{name}"
        );
        let labels = node.labels();
        assert_eq!(labels[AGENT_POOL_LABEL], "gpu");
        assert_eq!(
            labels["node.kubernetes.io/instance-type"],
            "Standard_ND96asr_v4"
        );
        let allocatable = node.status.unwrap().allocatable.unwrap();
        assert_eq!(allocatable["nvidia.com/gpu"], Quantity("8".into()));
        assert_eq!(allocatable[RDMA_RESOURCE], Quantity("1000".into()));
        assert_eq!(allocatable["cpu"], Quantity("96".into()));
        assert_eq!(shape.node_name(11), name, "names are stable");
    }

    #[test]
    fn cpu_sizes_have_no_gpus_and_unknown_sizes_are_refused() {
        let shape = PoolShape::new("system", "Standard_D4s_v5", PoolMode::System).unwrap();
        let allocatable = shape.node(0).status.unwrap().allocatable.unwrap();
        assert!(
            !allocatable.contains_key("nvidia.com/gpu") && !allocatable.contains_key(RDMA_RESOURCE)
        );
        let err = PoolShape::new("x", "Standard_Nope", PoolMode::User).unwrap_err();
        assert!(err.to_string().contains("Standard_ND96asr_v4"), "{err}");
    }
}
