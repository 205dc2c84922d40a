//! The API server's own count of an operator's requests: bench-operator runs each operator
//! as a ServiceAccount the audit policy records (e2e/kwok/audit-policy.yaml), and reads that
//! account's entries from the audit log. The same count for every operator, whatever its
//! client library says of itself.

use std::collections::{BTreeMap, HashSet};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Requests by "verb resource[/subresource]" (or "verb /path" for non-resource requests).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestCounts(pub BTreeMap<String, u64>);

impl RequestCounts {
    /// Every request counted.
    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }

    /// Counts the requests of `username` in audit-log lines (JSON, one event per line). A
    /// request is counted once whatever stages it was logged at (a watch is logged when its
    /// response starts and again when it ends).
    pub fn from_log_lines(text: &str, username: &str) -> Self {
        let mut seen = HashSet::new();
        let mut counts = BTreeMap::new();
        for line in text.lines() {
            let Ok(event) = serde_json::from_str::<serde_json::Value>(line) else {
                // The last line can be half-written while the API server is appending.
                continue;
            };
            if event["user"]["username"].as_str() != Some(username) {
                continue;
            }
            let id = event["auditID"].as_str().unwrap_or_default().to_string();
            if !seen.insert(id) {
                continue;
            }
            let verb = event["verb"].as_str().unwrap_or("?");
            let what = match event["objectRef"]["resource"].as_str() {
                Some(resource) => match event["objectRef"]["subresource"].as_str() {
                    Some(sub) => format!("{resource}/{sub}"),
                    None => resource.to_string(),
                },
                None => event["requestURI"]
                    .as_str()
                    .unwrap_or("?")
                    .split('?')
                    .next()
                    .unwrap_or("?")
                    .to_string(),
            };
            *counts.entry(format!("{verb} {what}")).or_insert(0) += 1;
        }
        Self(counts)
    }
}

/// The audit log the local cluster's API server writes (e2e/cluster.sh).
#[derive(Clone, Debug)]
pub struct AuditLog {
    path: PathBuf,
}

impl AuditLog {
    /// The log beside `kubeconfig` (both live in e2e/.state).
    pub fn beside(kubeconfig: &Path) -> Self {
        Self {
            path: kubeconfig.with_file_name("audit.log"),
        }
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The log's length now, to count from.
    pub fn mark(&self) -> u64 {
        std::fs::metadata(&self.path).map(|m| m.len()).unwrap_or(0)
    }

    /// The requests of `username` logged since `mark`.
    pub fn requests_since(&self, mark: u64, username: &str) -> std::io::Result<RequestCounts> {
        let mut file = std::fs::File::open(&self.path)?;
        file.seek(SeekFrom::Start(mark))?;
        let mut text = String::new();
        file.read_to_string(&mut text)?;
        Ok(RequestCounts::from_log_lines(&text, username))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const USER: &str = "system:serviceaccount:ringmaster-bench:ringmaster";

    fn line(id: &str, stage: &str, user: &str, verb: &str, object: serde_json::Value) -> String {
        serde_json::json!({
            "kind": "Event", "level": "Metadata", "auditID": id, "stage": stage,
            "requestURI": "/api/v1/namespaces/b/pods?watch=true", "verb": verb,
            "user": {"username": user}, "objectRef": object,
        })
        .to_string()
    }

    #[test]
    fn requests_are_counted_once_by_verb_and_resource_for_one_user() {
        let log = [
            line(
                "1",
                "ResponseComplete",
                USER,
                "create",
                serde_json::json!({"resource": "pods"}),
            ),
            line(
                "2",
                "ResponseComplete",
                USER,
                "create",
                serde_json::json!({"resource": "pods"}),
            ),
            line(
                "3",
                "ResponseStarted",
                USER,
                "watch",
                serde_json::json!({"resource": "pods"}),
            ),
            line(
                "3",
                "ResponseComplete",
                USER,
                "watch",
                serde_json::json!({"resource": "pods"}),
            ),
            line(
                "4",
                "ResponseComplete",
                USER,
                "patch",
                serde_json::json!({"resource": "trainingjobs", "subresource": "status"}),
            ),
            line(
                "5",
                "ResponseComplete",
                "system:kube-scheduler",
                "create",
                serde_json::json!({"resource": "pods", "subresource": "binding"}),
            ),
            line(
                "6",
                "ResponseComplete",
                USER,
                "get",
                serde_json::Value::Null,
            ),
            "{\"kind\": \"Event\", \"auditID\": \"7\", \"us".to_string(),
        ]
        .join("\n");
        let counts = RequestCounts::from_log_lines(&log, USER);
        let expected: BTreeMap<String, u64> = [
            ("create pods", 2),
            ("watch pods", 1),
            ("patch trainingjobs/status", 1),
            ("get /api/v1/namespaces/b/pods", 1),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        assert_eq!(counts.0, expected);
        assert_eq!(counts.total(), 5);
    }
}
