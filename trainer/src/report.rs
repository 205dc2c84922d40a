//! The launcher's progress reports to the operator ([`ringmaster_contract::progress`]): the
//! newest `step` line and the `fabric` line, POSTed every few seconds from a thread of their
//! own, so training never waits for the operator. A report that fails is said once on stderr
//! and tried again at the next interval; the job goes on.

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ringmaster_contract::progress::{
    CA_ENV, DEFAULT_INTERVAL_SECONDS, INTERVAL_ENV, Report, TOKEN_FILE_ENV, URL_ENV,
};

/// Errors sending a report.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The certificate in the environment is not PEM.
    #[error("${CA_ENV} holds no PEM certificate: {0}")]
    Certificate(String),
    /// The token file could not be read.
    #[error("reading the report token {path}: {source}")]
    Token {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The request failed, or the operator refused it (`status`: its answer's code).
    #[error("reporting progress to {url}: {reason}")]
    Send {
        url: String,
        status: Option<u16>,
        reason: String,
    },
}

/// Where and how to report, from the launcher's environment.
#[derive(Clone, Debug)]
pub struct Endpoint {
    /// The job's report URL.
    pub url: String,
    /// The PEM certificate the endpoint's chains to.
    pub ca_pem: Option<String>,
    /// The projected token's file.
    pub token_file: Option<PathBuf>,
    /// Time between reports.
    pub interval: Duration,
}

impl Endpoint {
    /// From the environment: none when no URL is set (reports are off).
    pub fn from_env() -> Option<Self> {
        let url = std::env::var(URL_ENV).ok().filter(|u| !u.is_empty())?;
        let seconds = std::env::var(INTERVAL_ENV)
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .filter(|s| *s > 0.0)
            .unwrap_or(DEFAULT_INTERVAL_SECONDS as f64);
        Some(Self {
            url,
            ca_pem: std::env::var(CA_ENV).ok().filter(|c| !c.is_empty()),
            token_file: std::env::var_os(TOKEN_FILE_ENV).map(PathBuf::from),
            interval: Duration::from_secs_f64(seconds),
        })
    }
}

/// Sends reports to one endpoint.
struct ReportSender {
    endpoint: Endpoint,
    agent: ureq::Agent,
}

impl ReportSender {
    fn new(endpoint: Endpoint) -> Result<Self, ReportError> {
        let mut tls = ureq::tls::TlsConfig::builder();
        if let Some(pem) = &endpoint.ca_pem {
            let certificates = ureq::tls::parse_pem(pem.as_bytes())
                .filter_map(|item| match item {
                    Ok(ureq::tls::PemItem::Certificate(c)) => Some(Ok(c)),
                    Ok(_) => None,
                    Err(error) => Some(Err(ReportError::Certificate(error.to_string()))),
                })
                .collect::<Result<Vec<_>, _>>()?;
            if certificates.is_empty() {
                return Err(ReportError::Certificate("no CERTIFICATE block".into()));
            }
            tls = tls.root_certs(ureq::tls::RootCerts::Specific(Arc::new(certificates)));
        }
        let agent = ureq::Agent::config_builder()
            .tls_config(tls.build())
            .timeout_global(Some(Duration::from_secs(5)))
            .http_status_as_error(false)
            .build()
            .into();
        Ok(Self { endpoint, agent })
    }

    fn send(&self, report: &Report) -> Result<(), ReportError> {
        let url = &self.endpoint.url;
        let failed = |status: Option<u16>, reason: String| ReportError::Send {
            url: url.clone(),
            status,
            reason,
        };
        let mut request = self
            .agent
            .post(url)
            .header("Content-Type", "application/x-ndjson");
        if let Some(path) = &self.endpoint.token_file {
            let token = std::fs::read_to_string(path).map_err(|source| ReportError::Token {
                path: path.clone(),
                source,
            })?;
            request = request.header("Authorization", format!("Bearer {}", token.trim()));
        }
        let mut response = request
            .send(report.to_body())
            .map_err(|e| failed(None, e.to_string()))?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let body = response.body_mut().read_to_string().unwrap_or_default();
        let said = ringmaster_contract::shorten(body.trim(), 300);
        Err(failed(Some(status.as_u16()), format!("{status}: {said}")))
    }
}

/// Sends one report now (for a program that reports by itself, and for tests).
pub fn send_once(endpoint: Endpoint, report: &Report) -> Result<(), ReportError> {
    ReportSender::new(endpoint)?.send(report)
}

/// The reporting thread's handle: lines go in with [`Reporter::line`]; [`Reporter::finish`]
/// sends what is left and stops it.
pub struct Reporter {
    lines: Sender<String>,
    thread: std::thread::JoinHandle<()>,
    sent: Arc<Mutex<u64>>,
}

impl Reporter {
    /// Starts reporting to `endpoint`; a certificate that cannot be read is said on stderr
    /// and reports stay off (training does not depend on them).
    pub fn start(endpoint: Endpoint) -> Option<Self> {
        let sender = match ReportSender::new(endpoint) {
            Ok(sender) => sender,
            Err(error) => {
                eprintln!("ringmaster-trainer launch: progress reports off: {error}");
                return None;
            }
        };
        let (lines, received) = std::sync::mpsc::channel();
        let sent = Arc::new(Mutex::new(0));
        let counted = sent.clone();
        let thread = std::thread::spawn(move || report_loop(&sender, &received, &counted));
        Some(Self {
            lines,
            thread,
            sent,
        })
    }

    /// One line of the ranks' output.
    pub fn line(&self, line: &str) {
        let _ = self.lines.send(line.to_string());
    }

    /// Sends the last report and stops; how many reports reached the operator.
    pub fn finish(self) -> u64 {
        drop(self.lines);
        let _ = self.thread.join();
        *self.sent.lock().expect("report count")
    }
}

/// Collects lines; every interval, and at once for the first fabric line, sends what is new.
fn report_loop(sender: &ReportSender, lines: &Receiver<String>, sent: &Mutex<u64>) {
    let mut report = Report::default();
    let mut fresh = false;
    let mut complained = false;
    let mut next = std::time::Instant::now() + sender.endpoint.interval;
    loop {
        let wait = next.saturating_duration_since(std::time::Instant::now());
        let ended = match lines.recv_timeout(wait) {
            Ok(line) => {
                let fabric_before = report.fabric.is_some();
                fresh |= report.take(&line);
                // The fabric says at once whether InfiniBand is used: not held back.
                if fabric_before || report.fabric.is_none() {
                    continue;
                }
                false
            }
            Err(RecvTimeoutError::Timeout) => false,
            Err(RecvTimeoutError::Disconnected) => true,
        };
        if fresh {
            match sender.send(&report) {
                Ok(()) => {
                    *sent.lock().expect("report count") += 1;
                    fresh = false;
                }
                Err(error) if !complained => {
                    eprintln!("ringmaster-trainer launch: {error} (training goes on)");
                    complained = true;
                }
                Err(_) => {}
            }
        }
        if ended {
            return;
        }
        next = std::time::Instant::now() + sender.endpoint.interval;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Read, Write};

    /// The requests a test server saw: (authorization header, body).
    type Seen = Arc<Mutex<Vec<(String, String)>>>;

    /// A one-connection-at-a-time HTTP server on loopback that keeps each request's
    /// authorization header and body, answering `status`.
    fn server(status: u16) -> (String, Seen) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!(
            "http://{}/progress/v1/namespaces/ns/trainingjobs/j",
            listener.local_addr().unwrap()
        );
        let seen = Arc::new(Mutex::new(Vec::new()));
        let kept = seen.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let mut stream = stream.unwrap();
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let (mut length, mut auth) = (0, String::new());
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap() == 0 || line == "\r\n" {
                        break;
                    }
                    let lower = line.to_ascii_lowercase();
                    if let Some(v) = lower.strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap();
                    }
                    if lower.starts_with("authorization:") {
                        auth = line["authorization:".len()..].trim().to_string();
                    }
                }
                let mut body = vec![0; length];
                reader.read_exact(&mut body).unwrap();
                kept.lock()
                    .unwrap()
                    .push((auth, String::from_utf8(body).unwrap()));
                let said = "refused by the test";
                write!(
                    stream,
                    "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{said}",
                    said.len()
                )
                .unwrap();
            }
        });
        (url, seen)
    }

    fn step(step: u64) -> String {
        format!(
            r#"{{"event":"step","step":{step},"loss":1.0,"accuracy":null,"learningRate":0.1,"imagesPerSecond":10.0,"totalSteps":100}}"#
        )
    }

    #[test]
    fn the_newest_step_goes_each_interval_the_fabric_at_once_with_the_token_of_the_moment() {
        let (url, seen) = server(202);
        let token = std::env::temp_dir().join(format!("report-token-{}", std::process::id()));
        std::fs::write(&token, "token-1\n").unwrap();
        let endpoint = Endpoint {
            url,
            ca_pem: None,
            token_file: Some(token.clone()),
            interval: Duration::from_millis(1000),
        };
        let reporter = Reporter::start(endpoint).unwrap();
        for s in 1..=5 {
            reporter.line(&step(s));
        }
        reporter.line("mpirun: some banner");
        std::thread::sleep(Duration::from_millis(1500));
        // The kubelet renewed the token.
        std::fs::write(&token, "token-2").unwrap();
        reporter.line(r#"{"event":"fabric","collective":"tcp-ring","transports":[],"ranksOnInfiniband":0,"worldSize":2}"#);
        std::thread::sleep(Duration::from_millis(300));
        reporter.line(&step(6));
        let sent = reporter.finish();
        let seen = seen.lock().unwrap().clone();
        assert_eq!(sent, 3, "{seen:?}");
        let reports: Vec<Report> = seen
            .iter()
            .map(|(_, body)| Report::from_body(body))
            .collect();
        assert_eq!(
            reports[0].step.as_ref().unwrap().step,
            5,
            "only the newest step"
        );
        assert!(reports[0].fabric.is_none());
        assert_eq!(seen[0].0, "Bearer token-1");
        assert!(
            reports[1].fabric.is_some(),
            "the fabric went at once, before the interval"
        );
        assert_eq!(reports[1].step.as_ref().unwrap().step, 5);
        assert_eq!(seen[1].0, "Bearer token-2");
        assert_eq!(
            reports[2].step.as_ref().unwrap().step,
            6,
            "what was left, at the end"
        );
        std::fs::remove_file(token).ok();
    }

    #[test]
    fn a_refused_report_does_not_stop_the_launcher_and_bad_certificates_turn_reports_off() {
        let (url, seen) = server(403);
        let endpoint = Endpoint {
            url,
            ca_pem: None,
            token_file: None,
            interval: Duration::from_millis(100),
        };
        let reporter = Reporter::start(endpoint.clone()).unwrap();
        reporter.line(&step(1));
        std::thread::sleep(Duration::from_millis(250));
        reporter.line(&step(2));
        assert_eq!(reporter.finish(), 0, "none accepted");
        assert!(
            seen.lock().unwrap().len() >= 2,
            "tried again after a refusal"
        );
        let bad = Endpoint {
            ca_pem: Some("not a certificate".into()),
            ..endpoint
        };
        assert!(Reporter::start(bad).is_none());
    }
}
