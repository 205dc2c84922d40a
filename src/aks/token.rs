//! Bearer tokens for Azure Resource Manager.
//!
//! In AKS the operator's pod gets a token from Azure AD through workload identity (the
//! webhook sets `AZURE_FEDERATED_TOKEN_FILE`, `AZURE_CLIENT_ID`, `AZURE_TENANT_ID`) or the
//! node's managed identity; both come from `azure_identity`. A fixed token from a file is
//! for the simulated AKS of the tests and for short experiments (`az account
//! get-access-token`). A token is never logged: [`Token`]'s `Debug` hides it.

use std::path::PathBuf;
use std::sync::Arc;

use azure_core::credentials::TokenCredential;

/// The scope of an ARM token.
pub const ARM_SCOPE: &str = "https://management.azure.com/.default";

/// A bearer token; `Debug` and `Display` never show it.
#[derive(Clone)]
pub struct Token(String);

impl Token {
    /// The secret, for the `Authorization` header only.
    pub fn secret(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// Why no token could be had (messages never contain one).
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// Reading the token file failed.
    #[error("reading the ARM token file {path}: {source}")]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Azure AD refused or could not be reached.
    #[error("getting an ARM token from {method}: {message}")]
    Identity {
        method: &'static str,
        message: String,
    },
}

/// Where tokens come from.
#[derive(Clone)]
pub enum TokenSource {
    /// Re-read from a file at each use (a rotating projected token works).
    File(PathBuf),
    /// An `azure_identity` credential (workload or managed identity); it caches and renews.
    Identity {
        /// What it is, for messages.
        method: &'static str,
        /// The credential.
        credential: Arc<dyn TokenCredential>,
    },
}

impl std::fmt::Debug for TokenSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenSource::File(path) => write!(f, "TokenSource::File({})", path.display()),
            TokenSource::Identity { method, .. } => write!(f, "TokenSource::Identity({method})"),
        }
    }
}

impl TokenSource {
    /// Workload identity when its environment is set (AKS injects it), else the managed
    /// identity of the node (`AZURE_CLIENT_ID` picks a user-assigned one).
    pub fn from_environment() -> Result<Self, TokenError> {
        let identity_error = |method| {
            move |e: azure_core::Error| TokenError::Identity {
                method,
                message: e.to_string(),
            }
        };
        if std::env::var_os("AZURE_FEDERATED_TOKEN_FILE").is_some() {
            let credential = azure_identity::WorkloadIdentityCredential::new(None)
                .map_err(identity_error("workload identity"))?;
            return Ok(Self::Identity {
                method: "workload identity",
                credential,
            });
        }
        let options = std::env::var("AZURE_CLIENT_ID").ok().map(|id| {
            azure_identity::ManagedIdentityCredentialOptions {
                user_assigned_id: Some(azure_identity::UserAssignedId::ClientId(id)),
                ..Default::default()
            }
        });
        let credential = azure_identity::ManagedIdentityCredential::new(options)
            .map_err(identity_error("managed identity"))?;
        Ok(Self::Identity {
            method: "managed identity",
            credential,
        })
    }

    /// A token for ARM.
    pub async fn token(&self) -> Result<Token, TokenError> {
        match self {
            TokenSource::File(path) => tokio::fs::read_to_string(path)
                .await
                .map(|t| Token(t.trim().to_string()))
                .map_err(|source| TokenError::File {
                    path: path.clone(),
                    source,
                }),
            TokenSource::Identity { method, credential } => credential
                .get_token(&[ARM_SCOPE], None)
                .await
                .map(|t| Token(t.token.secret().to_string()))
                .map_err(|e| TokenError::Identity {
                    method,
                    message: e.to_string(),
                }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_file_token_is_read_at_each_use_and_never_printed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "s3cr3t-one\n").unwrap();
        let source = TokenSource::File(path.clone());
        let token = source.token().await.unwrap();
        assert_eq!(token.secret(), "s3cr3t-one");
        assert!(!format!("{token:?} {source:?}").contains("s3cr3t"));
        std::fs::write(&path, "s3cr3t-two").unwrap();
        assert_eq!(source.token().await.unwrap().secret(), "s3cr3t-two");
        std::fs::remove_file(&path).unwrap();
        let err = source.token().await.unwrap_err().to_string();
        assert!(err.contains("reading the ARM token file"), "{err}");
    }
}
