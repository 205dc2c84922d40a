//! Reaching the local control plane that `make cluster-up` started.

use std::path::{Path, PathBuf};

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
    /// Neither `$RINGMASTER_KUBECONFIG` nor `$RINGMASTER_REPO_ROOT` is set, and the current
    /// directory is not inside a checkout.
    #[error(
        "{variable} is not set and no directory from {start} up holds e2e/cluster.sh: run this \
         inside a Ringmaster checkout, or set {variable} (e2e/cluster.sh, e2e/test.sh and make set it)"
    )]
    NoCheckout {
        variable: &'static str,
        start: String,
    },
}

/// Where `e2e/cluster.sh up` writes the kubeconfig, under the checkout's root.
const KUBECONFIG_IN_CHECKOUT: &str = "e2e/.state/kubeconfig";

/// The root of the checkout being tested: `$RINGMASTER_REPO_ROOT` (the e2e scripts and make
/// set it), else the checkout around the current directory (cargo runs tests in `e2e/`).
///
/// Decided at run time, never with `env!("CARGO_MANIFEST_DIR")`: checkouts that share one
/// cargo target directory (a CI clone and a working tree) build binaries of the same names,
/// and a path baked in by whichever built last would point at the other checkout's cluster.
pub fn repo_root() -> Result<PathBuf, ClusterError> {
    if let Some(root) = std::env::var_os("RINGMASTER_REPO_ROOT") {
        return Ok(PathBuf::from(root));
    }
    checkout_around_cwd("RINGMASTER_REPO_ROOT")
}

/// The nearest directory at or above `start` that holds `e2e/cluster.sh`: the root of the
/// checkout `start` is in.
pub fn find_repo_root(start: &Path) -> Option<PathBuf> {
    start
        .ancestors()
        .find(|dir| dir.join("e2e/cluster.sh").is_file())
        .map(Path::to_path_buf)
}

/// The checkout around the current directory; the error names `variable` as the way out.
fn checkout_around_cwd(variable: &'static str) -> Result<PathBuf, ClusterError> {
    let start = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
    find_repo_root(&start).ok_or_else(|| ClusterError::NoCheckout {
        variable,
        start: start.display().to_string(),
    })
}

/// The kubeconfig `make cluster-up` writes: `$RINGMASTER_KUBECONFIG` (the e2e scripts and make
/// set it), else `e2e/.state/kubeconfig` of [`repo_root`]. Decided at run time, as
/// [`repo_root`] says why.
pub fn locate_kubeconfig() -> Result<PathBuf, ClusterError> {
    if let Some(path) = std::env::var_os("RINGMASTER_KUBECONFIG") {
        return Ok(PathBuf::from(path));
    }
    let root = match std::env::var_os("RINGMASTER_REPO_ROOT") {
        Some(root) => PathBuf::from(root),
        None => checkout_around_cwd("RINGMASTER_KUBECONFIG")?,
    };
    Ok(root.join(KUBECONFIG_IN_CHECKOUT))
}

/// [`locate_kubeconfig`], for callers that already have a [`client`] (so it was found).
///
/// # Panics
///
/// With [`locate_kubeconfig`]'s error when there is no kubeconfig to point at.
pub fn kubeconfig_path() -> PathBuf {
    locate_kubeconfig().unwrap_or_else(|e| panic!("{e}"))
}

/// A client for the local cluster, as its admin.
pub async fn client() -> Result<Client, ClusterError> {
    let config = config().await?;
    Client::try_from(config).map_err(|e| ClusterError::Client {
        path: "the local cluster's kubeconfig".into(),
        message: e.to_string(),
    })
}

/// The local cluster's client configuration (a test may point it elsewhere, e.g. through a
/// proxy of its own).
pub async fn config() -> Result<Config, ClusterError> {
    ringmaster::tls::install_provider();
    let path = locate_kubeconfig()?;
    let shown = path.display().to_string();
    let kubeconfig = Kubeconfig::read_from(&path).map_err(|source| ClusterError::NoKubeconfig {
        path: shown.clone(),
        source,
    })?;
    Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| ClusterError::Client {
            path: shown,
            message: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_repo_root_is_the_nearest_directory_holding_e2e_cluster_sh() {
        let dir = tempfile::tempdir().unwrap();
        let outer = dir.path().join("outer");
        let checkout = outer.join("checkout");
        let deep = checkout.join("e2e/tests/deeper");
        std::fs::create_dir_all(&deep).unwrap();
        std::fs::create_dir_all(outer.join("e2e")).unwrap();
        std::fs::write(outer.join("e2e/cluster.sh"), "").unwrap();
        std::fs::write(checkout.join("e2e/cluster.sh"), "").unwrap();

        assert_eq!(find_repo_root(&deep), Some(checkout.clone()));
        assert_eq!(
            find_repo_root(&checkout.join("e2e")),
            Some(checkout.clone())
        );
        assert_eq!(find_repo_root(&checkout), Some(checkout));
        assert_eq!(find_repo_root(&outer.join("e2e")), Some(outer));
    }

    #[test]
    fn no_repo_root_outside_a_checkout() {
        let dir = tempfile::tempdir().unwrap();
        // A folder named e2e, or e2e/cluster.sh as a folder, is not a checkout.
        std::fs::create_dir_all(dir.path().join("a/e2e/cluster.sh")).unwrap();
        assert_eq!(find_repo_root(&dir.path().join("a/e2e")), None);
        assert_eq!(find_repo_root(dir.path()), None);
    }
}
