//! What holds a job back or ended its gang, in words for its conditions and Events: pods
//! stuck being deleted, pods that cannot be scheduled or started, a pod's exit; and which
//! pods go when the job finishes.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::api::CleanPodPolicy;
use crate::controller::training_job::condition_names::reasons;
use crate::controller::training_job::observe::{
    Exit, Observed, PodLife, PodRef, PodState, StuckKind,
};
use crate::controller::training_job::state::{
    TERMINATING_PATIENCE, past_terminating_patience, seconds_between, still_being_deleted,
};

/// The job's own pods still being deleted past [`TERMINATING_PATIENCE`], said as
/// [`reasons::POD_STUCK_TERMINATING`] with what to do, since nothing else ends the wait.
pub struct StuckPods {
    /// One holding back the workers: of an earlier gang (the new gang's pods reuse their
    /// names, and none is made until every one is gone), or a worker of this gang.
    pub workers: Option<Block>,
    /// This gang's launcher.
    pub launcher: Option<Block>,
    /// When the next pod being deleted passes the patience: its deletion wakes nothing
    /// before then (a pod on a lost node sends no further event).
    pub next_look: Option<Duration>,
}

pub fn stuck_terminating(observed: &Observed, namespace: &str, now: &Time) -> StuckPods {
    // The earliest stuck, then by name: the same one on every look, whatever the cache's
    // order, so the words do not change between reconciles.
    let first = |pods: &mut dyn Iterator<Item = &PodState>| {
        pods.filter_map(|pod| {
            let grace_over = pod.deletion.as_ref()?;
            past_terminating_patience(grace_over, now).then_some((grace_over, pod))
        })
        .min_by(|(a, p), (b, q)| a.0.cmp(&b.0).then_with(|| p.name.cmp(&q.name)))
        .map(|(grace_over, pod)| {
            let gang = pod
                .attempt
                .map_or_else(String::new, |a| format!(" of gang attempt {a}"));
            Block {
                reason: reasons::POD_STUCK_TERMINATING,
                message: format!(
                    "pod {}{gang} {}; the job's next pods reuse its name and are made once it \
                     is gone",
                    pod.name,
                    still_being_deleted(&pod.name, namespace, pod.node.as_deref(), grace_over)
                ),
                pod: pod.about(),
            }
        })
    };
    let patience = TERMINATING_PATIENCE.as_secs_f64();
    StuckPods {
        workers: first(
            &mut observed
                .stale
                .iter()
                .chain(observed.workers.iter().flatten()),
        ),
        launcher: first(&mut observed.launcher.iter()),
        next_look: observed
            .all()
            .filter_map(|pod| pod.deletion.as_ref())
            .map(|grace_over| patience - seconds_between(grace_over, now))
            .filter(|left| *left >= 0.0)
            .min_by(f64::total_cmp)
            .map(|left| Duration::from_secs_f64(left) + Duration::from_secs(1)),
    }
}

/// What holds the job's start back, for its conditions and Warning Event.
#[derive(Clone, Debug)]
pub struct Block {
    /// The condition reason.
    pub reason: &'static str,
    /// What to say.
    pub message: String,
    /// The pod it is about.
    pub pod: PodRef,
}

/// A pod's exit in words: the failing rank's own error (its first 500 bytes) when the
/// termination message holds the trainer's failure line (`ringmaster-trainer launch`
/// leaves it), else the message's last 300 characters (the log's tail, `mpirun`'s report as
/// often as not); secret-looking values in it redacted ([`redact`]): the words go into
/// conditions, Events and `status.lastFailure`, which more people read than the pod's log.
pub fn describe(pod: &PodState, exit: &Exit) -> String {
    redact(&describe_unredacted(pod, exit))
}

/// Values of secret-looking settings (`sig=`, `AccountKey=`, `token=`, `password=`, …, as
/// in SAS URLs and connection strings) and bearer or basic credentials, replaced by
/// `<redacted>`.
pub fn redact(text: &str) -> String {
    use std::sync::LazyLock;
    static SETTINGS: LazyLock<regex::Regex> = LazyLock::new(|| {
        regex::Regex::new(
            r"(?i)\b(sig|signature|accountkey|sharedaccesssignature|sharedaccesskey|token|access_token|password|passwd|secret|client_secret|apikey|api_key)(\s*[=:]\s*)[^&\s;,'\x22]+",
        )
        .expect("a valid pattern")
    });
    static CREDENTIALS: LazyLock<regex::Regex> = LazyLock::new(|| {
        regex::Regex::new(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}")
            .expect("a valid pattern")
    });
    let text = SETTINGS.replace_all(text, "$1$2<redacted>");
    CREDENTIALS.replace_all(&text, "$1 <redacted>").into_owned()
}

fn describe_unredacted(pod: &PodState, exit: &Exit) -> String {
    let mut text = format!(
        "{} exited with code {} ({})",
        pod.name, exit.code, exit.reason
    );
    let tail = exit.message.trim();
    if let Some(failure) = ringmaster_contract::trainer::Failure::find_in(tail) {
        // Short enough that the Event's note (1 kB) keeps what follows it.
        let failure = ringmaster_contract::shorten(&failure.to_string(), 500);
        text.push_str(&format!(": {failure}"));
    } else if !tail.is_empty() {
        let tail: String = tail
            .chars()
            .rev()
            .take(300)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        text.push_str(&format!(": {tail}"));
    }
    text
}

/// What keeps a pod that is not running from starting, as a condition reason and words: the
/// scheduler's reason it fits no node, or the kubelet's reason its container cannot start.
/// `None` for a pod on its normal way (or running, or gone).
pub fn blocked(role: &str, pod: &PodState) -> Option<Block> {
    if pod.is_deleting() {
        return None;
    }
    if let PodLife::Pending {
        unschedulable: Some(why),
    } = &pod.life
    {
        return Some(Block {
            reason: reasons::UNSCHEDULABLE,
            message: format!("{role} {} cannot be scheduled: {why}", pod.name),
            pod: pod.about(),
        });
    }
    let stuck = pod.stuck.as_ref()?;
    let reason = match stuck.kind {
        StuckKind::ImagePull => reasons::IMAGE_PULL_FAILED,
        StuckKind::Container => reasons::CONTAINER_CANNOT_START,
    };
    let mut message = format!("{role} {} cannot start ({})", pod.name, stuck.reason);
    if !stuck.message.is_empty() {
        message.push_str(": ");
        message.push_str(&ringmaster_contract::shorten(&stuck.message, 500));
    }
    Some(Block {
        reason,
        message,
        pod: pod.about(),
    })
}

/// Pods to delete when the job finishes, by cleanPodPolicy.
pub fn cleanup(observed: &Observed, policy: CleanPodPolicy) -> Vec<String> {
    observed
        .all()
        .filter(|p| !p.is_deleting())
        .filter(|p| match policy {
            CleanPodPolicy::All => true,
            CleanPodPolicy::Running => !p.is_finished(),
            CleanPodPolicy::None => false,
        })
        .map(|p| p.name.clone())
        .collect()
}

/// What a restart deletes: every pod but the failed attempt's launcher, which stays with its
/// log until a later attempt's launcher fails too or the job ends (then `cleanPodPolicy`
/// decides, as for the job's other finished pods). Its name is the attempt's own, so the
/// next launcher does not wait for it.
pub fn restart_deletions(observed: &Observed) -> Vec<String> {
    let failed = observed.launcher.as_ref().filter(|l| l.failed());
    let kept = match failed {
        Some(launcher) => Some(&launcher.name),
        None => observed.kept_launcher.as_ref().map(|l| &l.name),
    };
    every_pod(observed)
        .into_iter()
        .filter(|name| Some(name) != kept)
        .collect()
}

/// The end of a pod's output, at most `max` bytes on a line boundary when there is one,
/// with secret-looking values redacted.
pub fn log_tail(output: &str, max: usize) -> String {
    let output = output.trim_end();
    let mut start = output.len().saturating_sub(max);
    while !output.is_char_boundary(start) {
        start += 1;
    }
    let tail = &output[start..];
    let tail = match tail.find('\n') {
        Some(newline) if start > 0 && newline + 1 < tail.len() => &tail[newline + 1..],
        _ => tail,
    };
    redact(tail)
}

pub fn every_pod(observed: &Observed) -> Vec<String> {
    observed
        .all()
        .filter(|p| !p.is_deleting())
        .map(|p| p.name.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_launchers_log_tail_is_bounded_on_a_line_and_redacted() {
        let long: String = (0..200)
            .map(|i| format!("line {i} sig=abcdef{i}\n"))
            .collect();
        let tail = log_tail(&long, 100);
        assert!(tail.len() <= 100 && tail.starts_with("line "), "{tail}");
        assert!(tail.ends_with("line 199 sig=<redacted>"), "{tail}");
        assert!(!tail.contains("abcdef"), "{tail}");
        assert_eq!(log_tail("short", 100), "short");
        // A multi-byte character at the cut is not split.
        assert_eq!(log_tail("ééé", 3), "é");
    }
}
