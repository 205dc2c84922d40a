//! The process's TLS provider.
//!
//! Two rustls providers are linked: `ring` (kube, the Blob client) and `aws-lc-rs` (pulled
//! in by `azure_identity`). With both, rustls cannot pick one by itself and panics on the
//! first TLS client; every entry point that builds a client calls [`install_provider`]
//! first.

/// Makes `ring` the process-wide rustls provider; later calls do nothing.
pub fn install_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
