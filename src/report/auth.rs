//! Who is reporting: the token a launcher presents is checked by the API server (a
//! TokenReview for [`AUDIENCE`]), which names the pod it was issued to; that pod must be the
//! job's launcher, made by the operator, in the job's namespace. A tenant's pod cannot report
//! for another namespace's job, nor for a job it is not the launcher of. A token checked once
//! is remembered until it expires (an hour), so a report costs no API request.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, TokenReviewStatus};
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::{Api, Client, ResourceExt};
use ringmaster_contract::progress::AUDIENCE;
use ssh_key::sha2::{Digest, Sha256};

use crate::controller::training_job::names::{JOB_NAME_LABEL, LAUNCHER_ROLE, ROLE_LABEL};

/// Why a report is refused. The messages go back to the launcher (and its log), never a
/// token.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// No `Authorization: Bearer` header.
    #[error("no bearer token: the launcher presents its projected token ({AUDIENCE})")]
    NoToken,
    /// The API server did not authenticate the token (expired, for another audience, forged).
    #[error("the token was not accepted for audience {AUDIENCE}: {0}")]
    NotAuthenticated(String),
    /// The token was issued to something other than a pod.
    #[error("the token is not bound to a pod (user {0})")]
    NotBoundToPod(String),
    /// The pod is not the job's launcher.
    #[error("pod {pod} may not report for TrainingJob {job}: {why}")]
    NotTheLauncher {
        pod: String,
        job: String,
        why: &'static str,
    },
    /// The TokenReview could not be made.
    #[error("checking the token with the API server: {0}")]
    Review(#[source] kube::Error),
}

impl AuthError {
    /// The HTTP status it answers with.
    pub fn status(&self) -> axum::http::StatusCode {
        use axum::http::StatusCode;
        match self {
            Self::NoToken | Self::NotAuthenticated(_) => StatusCode::UNAUTHORIZED,
            Self::NotBoundToPod(_) | Self::NotTheLauncher { .. } => StatusCode::FORBIDDEN,
            Self::Review(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// The pod a token was issued to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// Its namespace (the service account's).
    pub namespace: String,
    /// Its name.
    pub pod: String,
    /// Its UID.
    pub pod_uid: String,
}

/// The caller a TokenReview's answer names, when it authenticated a pod-bound token for
/// [`AUDIENCE`].
pub fn caller_from(status: &TokenReviewStatus) -> Result<Caller, AuthError> {
    if status.authenticated != Some(true) {
        let why = status
            .error
            .clone()
            .unwrap_or_else(|| "not authenticated".into());
        return Err(AuthError::NotAuthenticated(why));
    }
    if !status
        .audiences
        .as_ref()
        .is_some_and(|a| a.iter().any(|a| a == AUDIENCE))
    {
        return Err(AuthError::NotAuthenticated("another audience".into()));
    }
    let user = status.user.clone().unwrap_or_default();
    let username = user.username.unwrap_or_default();
    let extra = user.extra.unwrap_or_default();
    let first = |key: &str| extra.get(key).and_then(|v| v.first()).cloned();
    let namespace = username
        .strip_prefix("system:serviceaccount:")
        .and_then(|rest| rest.split(':').next())
        .map(str::to_string);
    match (
        namespace,
        first("authentication.kubernetes.io/pod-name"),
        first("authentication.kubernetes.io/pod-uid"),
    ) {
        (Some(namespace), Some(pod), Some(pod_uid)) => Ok(Caller {
            namespace,
            pod,
            pod_uid,
        }),
        _ => Err(AuthError::NotBoundToPod(username)),
    }
}

/// Whether `caller` may report for the job `namespace/job`: `pod` (from the operator's
/// cache, by the caller's namespace and name) is that same pod, the launcher the operator
/// made for the job, in its namespace.
pub fn check_launcher(
    caller: &Caller,
    pod: Option<&Pod>,
    namespace: &str,
    job: &str,
) -> Result<(), AuthError> {
    let refused = |why| AuthError::NotTheLauncher {
        pod: format!("{}/{}", caller.namespace, caller.pod),
        job: format!("{namespace}/{job}"),
        why,
    };
    if caller.namespace != namespace {
        return Err(refused("it is in another namespace"));
    }
    let pod = pod.ok_or_else(|| refused("the operator made no such pod"))?;
    if pod.uid().as_deref() != Some(caller.pod_uid.as_str()) {
        return Err(refused("the pod of that name now is another"));
    }
    let labels = pod.labels();
    if labels.get(ROLE_LABEL).map(String::as_str) != Some(LAUNCHER_ROLE)
        || labels.get(JOB_NAME_LABEL).map(String::as_str) != Some(job)
    {
        return Err(refused("it is not the job's launcher"));
    }
    let owned = pod
        .owner_references()
        .iter()
        .any(|o| o.kind == "TrainingJob" && o.name == job && o.controller == Some(true));
    if !owned {
        return Err(refused("the job does not own it"));
    }
    Ok(())
}

/// When a JWT expires, from its `exp` claim (the API server checked it; this only bounds
/// how long the answer is remembered).
fn expires_in(token: &str) -> Option<Duration> {
    use base64::Engine;
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let exp = claims.get("exp")?.as_i64()?;
    let now = k8s_openapi::jiff::Timestamp::now().as_second();
    u64::try_from(exp - now).ok().map(Duration::from_secs)
}

/// The most tokens remembered (a token per running launcher, renewed hourly).
const MAX_REMEMBERED: usize = 20_000;

/// Checks tokens with the API server, remembering the answers by the token's SHA-256.
#[derive(Debug, Default)]
pub struct TokenChecker {
    known: Mutex<HashMap<[u8; 32], (Caller, Instant)>>,
}

impl TokenChecker {
    /// The pod `token` was issued to.
    pub async fn caller(&self, client: &Client, token: &str) -> Result<Caller, AuthError> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let now = Instant::now();
        if let Some((caller, until)) = self.known.lock().expect("tokens").get(&digest)
            && *until > now
        {
            return Ok(caller.clone());
        }
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_string(),
                audiences: Some(vec![AUDIENCE.to_string()]),
            },
            ..TokenReview::default()
        };
        let answer = Api::<TokenReview>::all(client.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(AuthError::Review)?;
        let caller = caller_from(&answer.status.unwrap_or_default())?;
        let lifetime = expires_in(token).unwrap_or(Duration::from_secs(60));
        let mut known = self.known.lock().expect("tokens");
        if known.len() >= MAX_REMEMBERED {
            known.retain(|_, (_, until)| *until > now);
        }
        if known.len() < MAX_REMEMBERED {
            known.insert(digest, (caller.clone(), now + lifetime));
        }
        Ok(caller)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::authentication::v1::UserInfo;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
    use std::collections::BTreeMap;

    fn review(username: &str, pod: Option<(&str, &str)>, audience: &str) -> TokenReviewStatus {
        let mut extra = BTreeMap::new();
        if let Some((name, uid)) = pod {
            extra.insert(
                "authentication.kubernetes.io/pod-name".to_string(),
                vec![name.to_string()],
            );
            extra.insert(
                "authentication.kubernetes.io/pod-uid".to_string(),
                vec![uid.to_string()],
            );
        }
        TokenReviewStatus {
            authenticated: Some(true),
            audiences: Some(vec![audience.to_string()]),
            user: Some(UserInfo {
                username: Some(username.to_string()),
                extra: Some(extra),
                ..UserInfo::default()
            }),
            error: None,
        }
    }

    fn launcher(namespace: &str, job: &str, uid: &str, role: &str) -> Pod {
        let mut pod = Pod::default();
        pod.metadata.name = Some(format!("{job}-launcher"));
        pod.metadata.namespace = Some(namespace.into());
        pod.metadata.uid = Some(uid.into());
        pod.metadata.labels = Some(BTreeMap::from([
            (ROLE_LABEL.to_string(), role.to_string()),
            (JOB_NAME_LABEL.to_string(), job.to_string()),
        ]));
        pod.metadata.owner_references = Some(vec![OwnerReference {
            kind: "TrainingJob".into(),
            name: job.into(),
            controller: Some(true),
            ..OwnerReference::default()
        }]);
        pod
    }

    #[test]
    fn only_a_pod_bound_token_for_our_audience_names_a_caller() {
        let sa = "system:serviceaccount:team-a:default";
        let caller = caller_from(&review(sa, Some(("j-launcher", "u1")), AUDIENCE)).unwrap();
        assert_eq!(
            caller,
            Caller {
                namespace: "team-a".into(),
                pod: "j-launcher".into(),
                pod_uid: "u1".into()
            }
        );
        let other = review(
            sa,
            Some(("j-launcher", "u1")),
            "https://kubernetes.default.svc",
        );
        assert!(matches!(
            caller_from(&other),
            Err(AuthError::NotAuthenticated(_))
        ));
        assert!(matches!(
            caller_from(&review(sa, None, AUDIENCE)),
            Err(AuthError::NotBoundToPod(_))
        ));
        let user = review("alice", Some(("j-launcher", "u1")), AUDIENCE);
        assert!(matches!(
            caller_from(&user),
            Err(AuthError::NotBoundToPod(_))
        ));
        let refused = TokenReviewStatus {
            authenticated: Some(false),
            error: Some("token expired".into()),
            ..TokenReviewStatus::default()
        };
        let error = caller_from(&refused).unwrap_err();
        assert_eq!(error.status(), axum::http::StatusCode::UNAUTHORIZED);
    }

    #[test]
    fn only_the_jobs_own_launcher_in_its_namespace_may_report_for_it() {
        let caller = Caller {
            namespace: "team-a".into(),
            pod: "j-launcher".into(),
            pod_uid: "u1".into(),
        };
        let pod = launcher("team-a", "j", "u1", LAUNCHER_ROLE);
        assert!(check_launcher(&caller, Some(&pod), "team-a", "j").is_ok());
        let cases = [
            (Some(&pod), "team-b", "j", "another namespace"),
            (Some(&pod), "team-a", "k", "not the job's launcher"),
            (None, "team-a", "j", "no such pod"),
        ];
        for (pod, namespace, job, why) in cases {
            let error = check_launcher(&caller, pod, namespace, job).unwrap_err();
            assert!(error.to_string().contains(why), "{error}");
            assert_eq!(error.status(), axum::http::StatusCode::FORBIDDEN);
        }
        let worker = launcher("team-a", "j", "u1", "worker");
        assert!(check_launcher(&caller, Some(&worker), "team-a", "j").is_err());
        let replaced = launcher("team-a", "j", "u2", LAUNCHER_ROLE);
        let error = check_launcher(&caller, Some(&replaced), "team-a", "j").unwrap_err();
        assert!(error.to_string().contains("another"), "{error}");
        let mut unowned = launcher("team-a", "j", "u1", LAUNCHER_ROLE);
        unowned.metadata.owner_references = None;
        assert!(check_launcher(&caller, Some(&unowned), "team-a", "j").is_err());
    }

    #[test]
    fn a_tokens_answer_is_remembered_until_its_exp() {
        use base64::Engine;
        let encode = |v: serde_json::Value| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
        };
        let exp = k8s_openapi::jiff::Timestamp::now().as_second() + 600;
        let token = format!(
            "{}.{}.sig",
            encode(serde_json::json!({"alg":"RS256"})),
            encode(serde_json::json!({"exp": exp}))
        );
        let left = expires_in(&token).unwrap();
        assert!(left <= Duration::from_secs(600) && left >= Duration::from_secs(590));
        assert_eq!(expires_in("not-a-jwt"), None);
        let expired = format!("h.{}.s", encode(serde_json::json!({"exp": 1})));
        assert_eq!(expires_in(&expired), None);
    }
}
