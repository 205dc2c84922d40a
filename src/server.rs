//! The operator's HTTP endpoints: `/metrics`, `/healthz` (alive) and `/readyz` (the
//! controllers' caches have synced).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// Errors of the HTTP server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The address could not be bound (in use, or not an address of this host).
    #[error("binding the metrics and health address {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// The server stopped with an I/O error.
    #[error("serving metrics and health: {0}")]
    Serve(std::io::Error),
}

/// What the endpoints read.
#[derive(Clone)]
pub struct ServerState {
    /// The operator's metrics.
    pub metrics: Metrics,
    /// Set once the controllers' caches have synced.
    pub ready: Arc<AtomicBool>,
}

/// The routes, for serving and for tests.
pub fn router(state: ServerState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

async fn metrics(
    State(state): State<ServerState>,
) -> ([(axum::http::HeaderName, &'static str); 1], String) {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        state.metrics.render(),
    )
}

async fn readyz(State(state): State<ServerState>) -> (StatusCode, &'static str) {
    if state.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "caches not synced yet")
    }
}

/// Binds `addr` (before the controllers start, so a port in use fails fast).
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, ServerError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ServerError::Bind { addr, source })
}

/// Serves on `listener` until `shutdown` is cancelled.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: ServerState,
    shutdown: CancellationToken,
) -> Result<(), ServerError> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    }
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
        .map_err(ServerError::Serve)
}
