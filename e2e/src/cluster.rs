//! Reaching the local control plane that `make cluster-up` started.

use std::path::PathBuf;

use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

/// Errors connecting.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// No kubeconfig where `make cluster-up` writes it.
    #[error("no kubeconfig at {path}: start the local cluster with `make cluster-up` ({source})")]
    NoKubeconfig {
        path: String,
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// The kubeconfig could not be turned into a client.
    #[error("using kubeconfig {path}: {message}")]
    Client { path: String, message: String },
}

/// The kubeconfig `make cluster-up` writes: `$RINGMASTER_KUBECONFIG`, else
/// `e2e/.state/kubeconfig`.
pub fn kubeconfig_path() -> PathBuf {
    std::env::var_os("RINGMASTER_KUBECONFIG")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".state/kubeconfig"))
}

/// A client for the local cluster, as its admin.
pub async fn client() -> Result<Client, ClusterError> {
    ringmaster::tls::install_provider();
    let path = kubeconfig_path();
    let shown = path.display().to_string();
    let kubeconfig = Kubeconfig::read_from(&path).map_err(|source| ClusterError::NoKubeconfig {
        path: shown.clone(),
        source,
    })?;
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| ClusterError::Client {
            path: shown.clone(),
            message: e.to_string(),
        })?;
    Client::try_from(config).map_err(|e| ClusterError::Client {
        path: shown,
        message: e.to_string(),
    })
}
