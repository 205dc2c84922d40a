//! The operator's Kubernetes client: kube's default stack, plus a count of every request it
//! sends (by HTTP method and response status code) in the metrics, so API load per job, and
//! the conflicts, throttling and errors among it, can be measured.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

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
    let count = tower::layer::layer_fn(move |inner| Counted {
        inner,
        metrics: metrics.clone(),
    });
    Ok(ClientBuilder::try_from(config)?.with_layer(&count).build())
}

/// A service that counts each request once its response (or failure) comes.
#[derive(Clone)]
struct Counted<S> {
    inner: S,
    metrics: Metrics,
}

impl<S, B> tower::Service<http::Request<Body>> for Counted<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let method = request.method().clone();
        let metrics = self.metrics.clone();
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await;
            let code = match &response {
                Ok(response) => response.status().as_str().to_owned(),
                Err(_) => "error".to_owned(),
            };
            metrics.kube_request(method.as_str(), &code);
            response
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// An API server that answers every request with 404.
    fn not_found_server() -> std::net::SocketAddr {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for mut stream in listener.incoming().map_while(Result::ok) {
                let mut buffer = [0; 4096];
                let _ = stream.read(&mut buffer);
                let body = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404}"#;
                let response = format!(
                    "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes());
            }
        });
        address
    }

    #[tokio::test]
    async fn counts_requests_by_method_and_status_code() {
        let address = not_found_server();
        let metrics = Metrics::new();
        crate::tls::install_provider();
        let config = Config::new(format!("http://{address}").parse().unwrap());
        let client = counted(config, &metrics).unwrap();
        let pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
            kube::Api::namespaced(client, "team-a");
        assert!(pods.get("missing").await.is_err());
        let text = metrics.render();
        assert!(
            text.contains(r#"ringmaster_kube_requests_total{code="404",method="GET"} 1"#),
            "{text}"
        );
    }
}
