//! The operator's Kubernetes client: kube's default stack, plus a count of every request it
//! sends (by HTTP method) in the metrics, so API load per job can be measured.

use kube::client::{Body, ClientBuilder};
use kube::{Client, Config};

use crate::metrics::Metrics;

/// Errors making the client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No usable configuration (in-cluster, $KUBECONFIG or ~/.kube/config).
    #[error(
        "finding Kubernetes credentials (in-cluster ServiceAccount, $KUBECONFIG or ~/.kube/config): {0}"
    )]
    Config(#[from] kube::config::InferConfigError),
    /// The configuration could not be turned into a client.
    #[error("building the Kubernetes client: {0}")]
    Build(#[from] kube::Error),
}

/// A client from the inferred configuration whose requests are counted in `metrics`.
pub async fn connect(metrics: &Metrics) -> Result<Client, ClientError> {
    crate::tls::install_provider();
    let config = Config::infer().await?;
    counted(config, metrics)
}

/// A client for `config` whose requests are counted in `metrics`.
pub fn counted(config: Config, metrics: &Metrics) -> Result<Client, ClientError> {
    let metrics = metrics.clone();
    let count = tower::util::MapRequestLayer::new(move |request: http::Request<Body>| {
        metrics.kube_request(request.method().as_str());
        request
    });
    Ok(ClientBuilder::try_from(config)?.with_layer(&count).build())
}
