//! bench-operator's parts: the operators it measures side by side, the identities that let
//! the API server's audit log count each one's requests, and the /proc readings of CPU and
//! memory, and the progress reports of running jobs.

pub mod audit;
pub mod contender;
pub mod identity;
pub mod machine;
pub mod process;
pub mod reports;

use std::collections::BTreeMap;

/// Where the API server's time went: seconds spent answering and requests answered, by
/// "VERB resource[/subresource]", summed over every client, from the text of its /metrics
/// (`apiserver_request_duration_seconds`). Watches and other long-running requests are left
/// out: their duration is how long they stayed open.
pub fn apiserver_time_by_request(metrics: &str) -> BTreeMap<String, (f64, f64)> {
    histogram_sums(metrics, "apiserver_request_duration_seconds", |labels| {
        let label = |name| labels.get(name);
        let verb = label("verb");
        if matches!(verb, "WATCH" | "CONNECT") {
            return None;
        }
        let resource = match label("subresource") {
            "" => label("resource").to_string(),
            sub => format!("{}/{sub}", label("resource")),
        };
        Some(format!("{verb} {resource}"))
    })
}

/// Where the API server's time went by client: seconds it spent executing requests and
/// requests executed, by API Priority and Fairness flow schema (`kube-scheduler`,
/// `kube-controller-manager`, `service-accounts` — the operators —, `global-default`, …),
/// from `apiserver_flowcontrol_request_execution_seconds` in its /metrics. The API server's
/// own per-client profile, at no cost (an audit log of every client would cost it more than
/// what it measures).
pub fn apiserver_time_by_client(metrics: &str) -> BTreeMap<String, (f64, f64)> {
    histogram_sums(
        metrics,
        "apiserver_flowcontrol_request_execution_seconds",
        |labels| {
            Some(match labels.get("flow_schema") {
                "" => "?".to_string(),
                flow => flow.to_string(),
            })
        },
    )
}

/// Watchers the API server closed because their client read too slowly, by resource
/// (`pods`, `mpijobs.kubeflow.org`), from `apiserver_terminated_watchers_total`: its watch
/// cache waits only so long for a client's buffer before it drops the watch. Each is a watch
/// its client (any client: the scheduler, KWOK, the operators) must open again, and list
/// again when its place has left the cache: the watch restarts seen under load.
pub fn terminated_watchers(metrics: &str) -> BTreeMap<String, f64> {
    let mut closed = BTreeMap::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("apiserver_terminated_watchers_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        let labels = Labels(labels);
        let resource = match labels.get("group") {
            "" => labels.get("resource").to_string(),
            group => format!("{}.{group}", labels.get("resource")),
        };
        *closed.entry(resource).or_insert(0.0) += value;
    }
    closed
}

/// `after` less `before`, counter by counter; counters that did not grow are left out.
pub fn counter_delta(
    before: &BTreeMap<String, f64>,
    after: BTreeMap<String, f64>,
) -> BTreeMap<String, f64> {
    after
        .into_iter()
        .map(|(what, n)| {
            let grown = n - before.get(&what).copied().unwrap_or_default();
            (what, grown)
        })
        .filter(|(_, grown)| *grown > 0.0)
        .collect()
}

/// A series' labels, as Prometheus text writes them (`a="x",b="y"`).
struct Labels<'a>(&'a str);

impl<'a> Labels<'a> {
    /// Label `name`'s value; "" when the series has none.
    fn get(&self, name: &str) -> &'a str {
        self.0
            .split(',')
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix("=\""))
            .map(|v| v.trim_end_matches('"'))
            .unwrap_or("")
    }
}

/// The `_sum` and `_count` of histogram `name` in Prometheus text, added up by the key
/// `key` makes of each series' labels (`None` leaves the series out).
fn histogram_sums(
    metrics: &str,
    name: &str,
    key: impl Fn(&Labels) -> Option<String>,
) -> BTreeMap<String, (f64, f64)> {
    let (sum_prefix, count_prefix) = (format!("{name}_sum{{"), format!("{name}_count{{"));
    let mut sums: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for line in metrics.lines() {
        let (is_sum, rest) = if let Some(rest) = line.strip_prefix(&sum_prefix) {
            (true, rest)
        } else if let Some(rest) = line.strip_prefix(&count_prefix) {
            (false, rest)
        } else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        let Some(what) = key(&Labels(labels)) else {
            continue;
        };
        let entry = sums.entry(what).or_default();
        if is_sum {
            entry.0 += value;
        } else {
            entry.1 += value;
        }
    }
    sums
}

/// `after` less `before`, entry by entry, keeping those that grew.
pub fn delta(
    before: &BTreeMap<String, (f64, f64)>,
    after: BTreeMap<String, (f64, f64)>,
) -> BTreeMap<String, (f64, f64)> {
    after
        .into_iter()
        .map(|(what, (seconds, count))| {
            let (s0, c0) = before.get(&what).copied().unwrap_or_default();
            (what, (seconds - s0, count - c0))
        })
        .filter(|(_, (seconds, _))| *seconds > 0.0)
        .collect()
}

/// Median, least and most of `values` (none when empty). The median of an even count is the
/// mean of the two middle values: of two repeats, not the faster one.
pub fn spread(values: &[f64]) -> Option<(f64, f64, f64)> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let (min, max) = (*sorted.first()?, *sorted.last()?);
    let middle = sorted.len() / 2;
    let median = if sorted.len().is_multiple_of(2) {
        (sorted[middle - 1] + sorted[middle]) / 2.0
    } else {
        sorted[middle]
    };
    Some((median, min, max))
}

/// The `p`th percentile (0..=100) of `values`, nearest rank; `None` when there are none.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

#[cfg(test)]
mod tests {
    use super::{
        apiserver_time_by_client, apiserver_time_by_request, counter_delta, delta, percentile,
        spread, terminated_watchers,
    };

    #[test]
    fn watchers_closed_as_too_slow_are_counted_by_resource_and_their_growth_kept() {
        let before = terminated_watchers(
            "# TYPE apiserver_terminated_watchers_total counter\n\
             apiserver_terminated_watchers_total{group=\"\",resource=\"pods\"} 4\n",
        );
        let after = terminated_watchers(
            "apiserver_terminated_watchers_total{group=\"\",resource=\"pods\"} 181\n\
             apiserver_terminated_watchers_total{group=\"batch\",resource=\"jobs\"} 1\n\
             apiserver_terminated_watchers_total{group=\"kubeflow.org\",resource=\"mpijobs\"} 0\n",
        );
        let grown = counter_delta(&before, after);
        assert_eq!(
            grown.into_iter().collect::<Vec<_>>(),
            [("jobs.batch".to_string(), 1.0), ("pods".to_string(), 177.0)]
        );
    }

    #[test]
    fn the_api_servers_time_is_summed_by_client_and_differenced() {
        let metrics = r#"apiserver_flowcontrol_request_execution_seconds_sum{flow_schema="kube-scheduler",priority_level="workload-high",type="mutating"} 3.5
apiserver_flowcontrol_request_execution_seconds_sum{flow_schema="kube-scheduler",priority_level="workload-high",type="readOnly"} 0.5
apiserver_flowcontrol_request_execution_seconds_count{flow_schema="kube-scheduler",priority_level="workload-high",type="mutating"} 900
apiserver_flowcontrol_request_execution_seconds_bucket{flow_schema="kube-scheduler",priority_level="workload-high",type="mutating",le="0.1"} 800
apiserver_flowcontrol_request_execution_seconds_sum{flow_schema="service-accounts",priority_level="workload-low",type="mutating"} 2
apiserver_flowcontrol_request_execution_seconds_count{flow_schema="service-accounts",priority_level="workload-low",type="mutating"} 100"#;
        let after = apiserver_time_by_client(metrics);
        assert_eq!(after["kube-scheduler"], (4.0, 900.0));
        let before = [("kube-scheduler".to_string(), (1.0, 300.0))].into();
        let grown = delta(&before, after);
        assert_eq!(grown["kube-scheduler"], (3.0, 600.0));
        assert_eq!(grown["service-accounts"], (2.0, 100.0));
        assert_eq!(spread(&[3.0, 1.0, 2.0]), Some((2.0, 1.0, 3.0)));
        assert_eq!(spread(&[148.8, 144.2]), Some((146.5, 144.2, 148.8)));
        assert_eq!(spread(&[]), None);
    }

    #[test]
    fn the_api_servers_time_is_summed_by_verb_and_resource_without_watches() {
        let metrics = r#"# HELP apiserver_request_duration_seconds x
apiserver_request_duration_seconds_sum{component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="binding",verb="POST",version="v1"} 2.5
apiserver_request_duration_seconds_count{component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="binding",verb="POST",version="v1"} 100
apiserver_request_duration_seconds_sum{component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="",verb="PATCH",version="v1"} 1.5
apiserver_request_duration_seconds_sum{component="",dry_run="",group="",resource="pods",scope="resource",subresource="",verb="PATCH",version="v1"} 0.5
apiserver_request_duration_seconds_sum{component="apiserver",dry_run="",group="",resource="pods",scope="namespace",subresource="",verb="WATCH",version="v1"} 900
apiserver_request_duration_seconds_bucket{component="apiserver",le="0.1",resource="pods",verb="PATCH"} 3
"#;
        let by = apiserver_time_by_request(metrics);
        assert_eq!(by["POST pods/binding"], (2.5, 100.0));
        assert_eq!(by["PATCH pods"], (2.0, 0.0));
        assert_eq!(by.len(), 2);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let values: Vec<f64> = (1..=20).rev().map(f64::from).collect();
        assert_eq!(percentile(&values, 50.0), Some(10.0));
        assert_eq!(percentile(&values, 99.0), Some(20.0));
        assert_eq!(percentile(&values, 0.0), Some(1.0));
        assert_eq!(percentile(&[], 50.0), None);
    }
}
