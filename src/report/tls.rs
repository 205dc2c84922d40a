//! The report endpoint's certificate, and a TLS listener for it.
//!
//! The certificate is self-signed and kept in a Secret in the operator's namespace, made by
//! the first replica that needs it: every replica serves the same one, a restart keeps it,
//! and launchers trust exactly it (its PEM is in their environment; it is public). A new
//! endpoint address (another host name in `--progress-url`) makes a new one.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};

/// The annotation that says which host the certificate is for.
const HOST_ANNOTATION: &str = "ringmaster.dev/progress-host";

/// Errors getting the certificate or serving TLS.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// Reading or writing the Secret failed.
    #[error("{action} the report endpoint's certificate Secret {namespace}/{name}: {source}")]
    Secret {
        action: &'static str,
        namespace: String,
        name: String,
        #[source]
        source: Box<kube::Error>,
    },
    /// The certificate could not be made.
    #[error("making the report endpoint's certificate for {host}: {source}")]
    Generate {
        host: String,
        #[source]
        source: rcgen::Error,
    },
    /// The Secret's certificate or key cannot be used.
    #[error(
        "the report endpoint's certificate Secret {0} holds no usable tls.crt and tls.key: {1}"
    )]
    Unusable(String, String),
}

/// A certificate and its key, PEM.
#[derive(Clone)]
pub struct ServingCert {
    /// The certificate (what launchers trust).
    pub cert_pem: String,
    /// Its private key.
    key_pem: String,
}

impl std::fmt::Debug for ServingCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServingCert").finish_non_exhaustive()
    }
}

impl ServingCert {
    /// A new self-signed certificate for `host` (a DNS name or an IP address).
    pub fn generate(host: &str) -> Result<Self, TlsError> {
        let key = rcgen::generate_simple_self_signed(vec![host.to_string()]).map_err(|source| {
            TlsError::Generate {
                host: host.to_string(),
                source,
            }
        })?;
        Ok(Self {
            cert_pem: key.cert.pem(),
            key_pem: key.signing_key.serialize_pem(),
        })
    }

    /// The rustls server configuration.
    pub fn server_config(&self) -> Result<rustls::ServerConfig, TlsError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let unusable = |e: String| TlsError::Unusable("in memory".into(), e);
        let certs = CertificateDer::pem_slice_iter(self.cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| unusable(e.to_string()))?;
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes())
            .map_err(|e| unusable(e.to_string()))?;
        rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| unusable(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| unusable(e.to_string()))
    }
}

/// The certificate for `host` from the Secret `namespace/name`, made (and the Secret
/// written) when there is none for that host.
pub async fn serving_cert(
    client: &Client,
    namespace: &str,
    name: &str,
    host: &str,
) -> Result<ServingCert, TlsError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let failed = |action| {
        move |source| TlsError::Secret {
            action,
            namespace: namespace.to_string(),
            name: name.to_string(),
            source: Box::new(source),
        }
    };
    for _ in 0..3 {
        let existing = api.get_opt(name).await.map_err(failed("reading"))?;
        if let Some(secret) = &existing
            && let Some(cert) = from_secret(secret, host)
        {
            return Ok(cert);
        }
        let cert = ServingCert::generate(host)?;
        let secret = to_secret(name, host, &cert, existing.as_ref());
        let written = match existing {
            Some(_) => api.replace(name, &PostParams::default(), &secret).await,
            None => api.create(&PostParams::default(), &secret).await,
        };
        match written {
            Ok(_) => return Ok(cert),
            // Another replica wrote it meanwhile: read theirs.
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(source) => return Err(failed("writing")(source)),
        }
    }
    Err(TlsError::Unusable(
        format!("{namespace}/{name}"),
        "it kept changing while it was read".into(),
    ))
}

fn from_secret(secret: &Secret, host: &str) -> Option<ServingCert> {
    let for_host = secret.metadata.annotations.as_ref()?.get(HOST_ANNOTATION)?;
    let data = secret.data.as_ref()?;
    let text = |key: &str| String::from_utf8(data.get(key)?.0.clone()).ok();
    let cert = ServingCert {
        cert_pem: text("tls.crt")?,
        key_pem: text("tls.key")?,
    };
    (for_host == host && cert.server_config().is_ok()).then_some(cert)
}

fn to_secret(name: &str, host: &str, cert: &ServingCert, existing: Option<&Secret>) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            resource_version: existing.and_then(|s| s.metadata.resource_version.clone()),
            annotations: Some(BTreeMap::from([(HOST_ANNOTATION.into(), host.into())])),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/name".into(),
                "ringmaster".into(),
            )])),
            ..ObjectMeta::default()
        },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(BTreeMap::from([
            (
                "tls.crt".into(),
                ByteString(cert.cert_pem.clone().into_bytes()),
            ),
            (
                "tls.key".into(),
                ByteString(cert.key_pem.clone().into_bytes()),
            ),
        ])),
        ..Secret::default()
    }
}

/// A listener that hands axum TLS connections, their handshakes done apart from the accept
/// loop (a client that stalls its handshake holds up no one else).
pub struct TlsListener {
    local: SocketAddr,
    ready: tokio::sync::mpsc::Receiver<(
        tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
        SocketAddr,
    )>,
}

/// How long a client has for its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

impl TlsListener {
    /// Serves TLS with `config` on `listener`.
    pub fn new(listener: tokio::net::TcpListener, config: rustls::ServerConfig) -> Self {
        let local = listener
            .local_addr()
            .expect("a bound listener has an address");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let (send, ready) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move {
            loop {
                let Ok((tcp, peer)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                if send.is_closed() {
                    return;
                }
                let (acceptor, send) = (acceptor.clone(), send.clone());
                tokio::spawn(async move {
                    let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp));
                    if let Ok(Ok(tls)) = handshake.await {
                        let _ = send.send((tls, peer)).await;
                    }
                });
            }
        });
        Self { local, ready }
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(connection) => connection,
            // The accept loop ended: nothing more comes.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_certificate_is_kept_in_a_secret_for_its_host_only() {
        let cert = ServingCert::generate("10.244.0.1").unwrap();
        assert!(cert.cert_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        cert.server_config().unwrap();
        let secret = to_secret("progress-tls", "10.244.0.1", &cert, None);
        let back = from_secret(&secret, "10.244.0.1").expect("read back");
        assert_eq!(back.cert_pem, cert.cert_pem);
        assert!(
            from_secret(&secret, "ringmaster.ns.svc").is_none(),
            "another host"
        );
        assert!(
            !format!("{cert:?}").contains("PRIVATE"),
            "the key is never printed"
        );
    }
}
