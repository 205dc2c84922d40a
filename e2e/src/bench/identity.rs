//! A ServiceAccount and a kubeconfig of its own for each operator bench-operator measures, so
//! the API server's audit log tells its requests from everyone else's (the benchmark's own,
//! KWOK's, the scheduler's). The accounts live in namespace [`NAMESPACE`], which the audit
//! policy records (e2e/kwok/audit-policy.yaml), and are bound to cluster-admin: the
//! benchmark measures cost, not permissions.

use std::path::{Path, PathBuf};

use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::api::{Patch, PatchParams, PostParams};
use kube::config::{AuthInfo, Kubeconfig, NamedAuthInfo};
use kube::{Api, Client};
use serde_json::json;

/// The namespace of the measured operators' ServiceAccounts (and the audit policy's).
pub const NAMESPACE: &str = "ringmaster-bench";

const FIELD_MANAGER: &str = "bench-operator";

/// Errors making an identity.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// The API server refused a step.
    #[error("{action} for {account}: {source}")]
    Api {
        action: &'static str,
        account: String,
        #[source]
        source: kube::Error,
    },
    /// The admin kubeconfig could not be read or the operator's written.
    #[error("kubeconfig {path}: {message}")]
    Kubeconfig { path: String, message: String },
}

/// An operator's identity: its user name as the audit log records it, and a kubeconfig that
/// authenticates as it.
#[derive(Clone, Debug)]
pub struct Identity {
    /// `system:serviceaccount:ringmaster-bench:<account>`.
    pub username: String,
    /// A kubeconfig beside the admin's, holding the account's token.
    pub kubeconfig: PathBuf,
}

/// Makes (or reuses) ServiceAccount `account`, binds it to cluster-admin, and writes a
/// kubeconfig for it beside `admin_kubeconfig`, with a token good for `hours`.
pub async fn for_operator(
    client: &Client,
    admin_kubeconfig: &Path,
    account: &str,
    hours: i64,
) -> Result<Identity, IdentityError> {
    let api_error = |action: &'static str| {
        let account = account.to_string();
        move |source| IdentityError::Api {
            action,
            account,
            source,
        }
    };
    let apply = PatchParams::apply(FIELD_MANAGER).force();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let namespace =
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}});
    namespaces
        .patch(NAMESPACE, &apply, &Patch::Apply(&namespace))
        .await
        .map_err(api_error("making namespace ringmaster-bench"))?;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), NAMESPACE);
    let sa = json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account}});
    accounts
        .patch(account, &apply, &Patch::Apply(&sa))
        .await
        .map_err(api_error("making the ServiceAccount"))?;
    let binding_name = format!("{NAMESPACE}:{account}");
    let binding = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": binding_name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}],
    });
    Api::<ClusterRoleBinding>::all(client.clone())
        .patch(&binding_name, &apply, &Patch::Apply(&binding))
        .await
        .map_err(api_error("binding cluster-admin"))?;
    let request: TokenRequest = serde_json::from_value(json!({
        "spec": {"audiences": [], "expirationSeconds": hours * 3600}
    }))
    .expect("a TokenRequest");
    let token = accounts
        .create_token_request(account, &PostParams::default(), &request)
        .await
        .map_err(api_error("requesting a token"))?
        .status
        .and_then(|s| s.token)
        .ok_or_else(|| IdentityError::Kubeconfig {
            path: admin_kubeconfig.display().to_string(),
            message: format!("the API server issued no token for {account}"),
        })?;

    let shown = admin_kubeconfig.display().to_string();
    let kubeconfig_error = |message: String| IdentityError::Kubeconfig {
        path: shown.clone(),
        message,
    };
    let mut config =
        Kubeconfig::read_from(admin_kubeconfig).map_err(|e| kubeconfig_error(e.to_string()))?;
    let user = format!("{NAMESPACE}-{account}");
    config.auth_infos = vec![NamedAuthInfo {
        name: user.clone(),
        auth_info: Some(AuthInfo {
            token: Some(token.into()),
            ..AuthInfo::default()
        }),
        other: Default::default(),
    }];
    for context in &mut config.contexts {
        if let Some(context) = context.context.as_mut() {
            context.user = Some(user.clone());
        }
    }
    let path = admin_kubeconfig.with_file_name(format!("bench-{account}.kubeconfig"));
    let text = serde_json::to_string(&config).map_err(|e| kubeconfig_error(e.to_string()))?;
    // It holds a token: readable by its owner only.
    let write = || -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)?
            .write_all(text.as_bytes())
    };
    write().map_err(|e| IdentityError::Kubeconfig {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    Ok(Identity {
        username: format!("system:serviceaccount:{NAMESPACE}:{account}"),
        kubeconfig: path,
    })
}
