//! Live progress of running jobs: the operator's report endpoint (HTTPS), where each job's
//! launcher POSTs its newest `step` and `fabric` lines ([`ringmaster_contract::progress`]).
//!
//! Why an endpoint and not the pods' logs: reading a thousand launchers' logs every interval
//! costs the API server (and each kubelet) a request per job per look, and needs the right to
//! read every pod's log. Here a report costs no API request (the token's TokenReview is
//! remembered for its hour), the training pods need no API rights (a projected token bound
//! to the launcher pod and to [`AUDIENCE`]), and the status is written at most once per job
//! per hold-back interval (30 s or more, [`crate::controller::progress`]) however often
//! launchers report. Kubeflow Trainer v2.2 chose the same shape.
//!
//! * [`board`] — the newest report per job, and the status's progress made from it.
//! * [`auth`] — whose token it is, and whether that pod is the job's launcher.
//! * [`tls`] — the endpoint's self-signed certificate (kept in a Secret) and TLS listener.

pub mod auth;
pub mod board;
pub mod tls;

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use kube::core::error_boundary::DeserializeGuard;
use kube::runtime::reflector::ObjectRef;
use ringmaster_contract::progress::{MAX_BODY_BYTES, Report};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use tokio_util::sync::CancellationToken;

use crate::api::TrainingJob;
use crate::controller::Context;

/// Where launchers report, as the operator tells them.
#[derive(Clone, Debug, PartialEq)]
pub struct ProgressEndpoint {
    /// The endpoint's base URL (`https://host:port`); a job's reports go to its
    /// [`ringmaster_contract::progress::report_path`] under it.
    pub url: String,
    /// The endpoint's certificate, PEM (public).
    pub ca_pem: String,
}

impl ProgressEndpoint {
    /// The URL of the job `namespace/name`'s reports.
    pub fn job_url(&self, namespace: &str, name: &str) -> String {
        let path = ringmaster_contract::progress::report_path(namespace, name);
        format!("{}{path}", self.url.trim_end_matches('/'))
    }
}

/// A reconcile asked for by a report.
pub type Trigger = ObjectRef<DeserializeGuard<TrainingJob>>;

/// The reports the endpoint took in, and the reconciles they ask for.
#[derive(Debug)]
pub struct Reports {
    /// The newest report per job.
    pub board: board::Board,
    checker: auth::TokenChecker,
    trigger: UnboundedSender<Trigger>,
    triggered: Mutex<Option<UnboundedReceiver<Trigger>>>,
}

impl Default for Reports {
    fn default() -> Self {
        let (trigger, triggered) = tokio::sync::mpsc::unbounded_channel();
        Self {
            board: board::Board::default(),
            checker: auth::TokenChecker::default(),
            trigger,
            triggered: Mutex::new(Some(triggered)),
        }
    }
}

impl Reports {
    /// The reconciles reports ask for, for the controller (taken once).
    pub fn take_triggers(&self) -> Option<UnboundedReceiver<Trigger>> {
        self.triggered.lock().expect("triggers").take()
    }
}

/// The board's key of a job.
pub fn job_key(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

/// The endpoint's routes.
pub fn router(ctx: Arc<Context>) -> Router {
    Router::new()
        .route(
            "/progress/v1/namespaces/{namespace}/trainingjobs/{name}",
            post(take_report),
        )
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(ctx)
}

/// Serves the endpoint on `listener` until `shutdown`.
pub async fn serve(
    listener: tls::TlsListener,
    ctx: Arc<Context>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(ctx))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

/// One report: who sent it, then onto the board; a reconcile is asked for when none waits.
async fn take_report(
    State(ctx): State<Arc<Context>>,
    Path((namespace, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: String,
) -> (StatusCode, String) {
    if !ctx.caches_synced() {
        // A replica that does not lead: the launcher's next report opens a new connection,
        // which the Service may give the leader.
        let said = "this operator replica does not lead; report again\n";
        return (StatusCode::SERVICE_UNAVAILABLE, said.into());
    }
    let token = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty());
    let caller = match token {
        None => Err(auth::AuthError::NoToken),
        Some(token) => ctx.reports.checker.caller(&ctx.client, token).await,
    };
    let checked = caller.and_then(|caller| {
        let pod = ctx
            .pods
            .get(&ObjectRef::new(&caller.pod).within(&caller.namespace));
        auth::check_launcher(&caller, pod.as_deref(), &namespace, &name).map(|()| caller)
    });
    let caller = match checked {
        Ok(caller) => caller,
        Err(error) => {
            tracing::info!(job = %job_key(&namespace, &name), %error, "progress report refused");
            return (error.status(), format!("{error}\n"));
        }
    };
    let report = Report::from_body(&body);
    if report.is_empty() {
        let said = "no step or fabric line in the report (see docs/progress.md)\n";
        return (StatusCode::BAD_REQUEST, said.into());
    }
    let key = job_key(&namespace, &name);
    let now = k8s_openapi::jiff::Timestamp::now();
    let ask = ctx.reports.board.record(&key, &caller.pod_uid, report, now);
    if let Some(entry) = ctx.reports.board.read(&key)
        && let Some(progress) = entry.progress()
    {
        let remaining = progress
            .estimated_completion_time
            .as_ref()
            .map(|t| t.0.duration_since(now).as_secs_f64().max(0.0));
        ctx.metrics
            .set_job_progress(&namespace, &name, &progress, remaining);
    }
    if ask {
        let _ = ctx
            .reports
            .trigger
            .send(ObjectRef::new(&name).within(&namespace));
    }
    (StatusCode::ACCEPTED, String::new())
}
