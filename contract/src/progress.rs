//! How a running job tells the operator how far it got: the launcher POSTs the latest of the
//! ranks' JSON lines ([`crate::trainer::Line`]: a `step` line, and the `fabric` line once) to
//! the operator's report endpoint over HTTPS, with a Kubernetes service-account token bound to
//! the launcher pod and to [`AUDIENCE`] (a projected volume, renewed by the kubelet). The
//! operator checks the token with a TokenReview and that the pod it names is the job's
//! launcher. No Kubernetes API rights in the training pods, and no API request per report.
//!
//! Any program can report the same way: print the `step` line ([`crate::trainer::Progress`])
//! on stdout under `ringmaster-trainer launch`, or POST it here itself.

use serde::{Deserialize, Serialize};

use crate::trainer::{Fabric, Line, Progress};

/// The audience of the token a launcher presents: the API server and anything else refuse it,
/// and the operator refuses tokens meant for others.
pub const AUDIENCE: &str = "ringmaster.dev/progress";

/// The launcher's environment: the job's report URL ([`report_path`] on the operator's
/// endpoint). Absent: nothing is reported.
pub const URL_ENV: &str = "RINGMASTER_PROGRESS_URL";

/// The launcher's environment: the PEM certificate the endpoint's must chain to (the
/// operator's own, self-signed; public).
pub const CA_ENV: &str = "RINGMASTER_PROGRESS_CA";

/// The launcher's environment: the file holding the projected token (re-read at each report:
/// the kubelet renews it).
pub const TOKEN_FILE_ENV: &str = "RINGMASTER_PROGRESS_TOKEN_FILE";

/// The launcher's environment: seconds between reports (default [`DEFAULT_INTERVAL_SECONDS`]).
pub const INTERVAL_ENV: &str = "RINGMASTER_PROGRESS_INTERVAL_SECONDS";

/// Seconds between a launcher's reports: half the status's write hold-back (30 s), so each
/// status write has a report of the last 15 s.
pub const DEFAULT_INTERVAL_SECONDS: u64 = 15;

/// The most a report's body may hold.
pub const MAX_BODY_BYTES: usize = 16 * 1024;

/// The path of a job's reports on the operator's endpoint.
pub fn report_path(namespace: &str, job: &str) -> String {
    format!("/progress/v1/namespaces/{namespace}/trainingjobs/{job}")
}

/// What one report says: the newest step line and the fabric line, either may be missing.
/// Sent as JSON lines (each a [`Line`]); other lines are ignored.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The newest progress line.
    pub step: Option<Progress>,
    /// The fabric the gradients cross.
    pub fabric: Option<Fabric>,
}

impl Report {
    /// Takes `line` in when it is a step or fabric line; whether it was.
    pub fn take(&mut self, line: &str) -> bool {
        match serde_json::from_str::<Line>(line.trim()) {
            Ok(Line::Step(progress)) => self.step = Some(progress),
            Ok(Line::Fabric(fabric)) => self.fabric = Some(fabric),
            _ => return false,
        }
        true
    }

    /// The report's lines, as it is sent.
    pub fn to_body(&self) -> String {
        let lines = self
            .step
            .clone()
            .map(Line::Step)
            .into_iter()
            .chain(self.fabric.clone().map(Line::Fabric));
        lines
            .map(|line| serde_json::to_string(&line).expect("a line serializes") + "\n")
            .collect()
    }

    /// A report from a body of JSON lines.
    pub fn from_body(body: &str) -> Self {
        let mut report = Self::default();
        for line in body.lines() {
            report.take(line);
        }
        report
    }

    /// Whether it says nothing.
    pub fn is_empty(&self) -> bool {
        self.step.is_none() && self.fabric.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_goes_as_json_lines_and_comes_back_the_same() {
        let mut report = Report::default();
        assert!(!report.take("mpirun: starting 4 ranks"));
        assert!(!report.take(r#"{"event":"checkpoint","step":3,"path":"/x","seconds":0.1}"#));
        assert!(report.take(r#"{"event":"step","step":1,"loss":7.0,"accuracy":0.0,"learningRate":0.1,"imagesPerSecond":null}"#));
        assert!(report.take(r#"{"event":"step","step":2,"loss":6.0,"accuracy":0.1,"learningRate":0.1,"imagesPerSecond":80.0,"totalSteps":10}"#));
        assert!(report.take(r#"{"event":"fabric","collective":"nccl","network":"Socket","transports":["NET/Socket"],"rankOnInfiniband":0,"ranksOnInfiniband":0,"worldSize":2}"#));
        let step = report.step.as_ref().unwrap();
        assert_eq!((step.step, step.total_steps), (2, Some(10)));
        assert_eq!(
            report.fabric.as_ref().unwrap().network.as_deref(),
            Some("Socket")
        );
        let body = report.to_body();
        assert_eq!(body.lines().count(), 2);
        assert_eq!(Report::from_body(&body), report);
        assert!(Report::from_body("not json\n").is_empty());
    }
}
