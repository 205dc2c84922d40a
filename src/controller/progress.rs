//! Holding back status writes that are only progress (worker counts, messages): a job's
//! progress reaches the API server at most about once per [`PROGRESS_WRITE_INTERVAL`],
//! while phases, restarts and problems are written at once. One write per pod event would
//! cost the API server most of a job's requests.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long progress may wait for the next write.
pub const PROGRESS_WRITE_INTERVAL: Duration = Duration::from_secs(30);

/// Objects to forget progress of once this many wait: jobs deleted while theirs waited.
const PRUNE_AT: usize = 4096;

/// When each object's held-back progress is due. In memory only: after a restart of the
/// operator, progress waits one interval more and nothing is lost (the next reconcile
/// computes the status from the pods again).
#[derive(Debug, Default)]
pub struct ProgressGate {
    due: Mutex<HashMap<String, Instant>>,
}

impl ProgressGate {
    /// For progress of `key` at `now`: `None` when it may be written now, else how long it
    /// is held back (the caller requeues after that). The first progress after a write
    /// waits the whole interval.
    pub fn wait(&self, key: &str, now: Instant) -> Option<Duration> {
        let mut due = self.due.lock().expect("progress map poisoned");
        match due.get(key) {
            Some(at) if *at <= now => {
                due.remove(key);
                None
            }
            Some(at) => Some(*at - now),
            None => {
                if due.len() >= PRUNE_AT {
                    due.retain(|_, at| *at + PROGRESS_WRITE_INTERVAL > now);
                }
                due.insert(key.to_string(), now + PROGRESS_WRITE_INTERVAL);
                Some(PROGRESS_WRITE_INTERVAL)
            }
        }
    }

    /// The status of `key` was written, progress and all: nothing of it waits any more.
    pub fn written(&self, key: &str) {
        self.due.lock().expect("progress map poisoned").remove(key);
    }

    /// How many objects have progress waiting.
    pub fn waiting(&self) -> usize {
        self.due.lock().expect("progress map poisoned").len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_waits_one_interval_then_goes_out() {
        let gate = ProgressGate::default();
        let t0 = Instant::now();
        assert_eq!(gate.wait("a", t0), Some(PROGRESS_WRITE_INTERVAL));
        let later = t0 + Duration::from_secs(4);
        assert_eq!(
            gate.wait("a", later),
            Some(PROGRESS_WRITE_INTERVAL - Duration::from_secs(4)),
            "more progress does not push the write back"
        );
        assert_eq!(gate.wait("a", t0 + PROGRESS_WRITE_INTERVAL), None);
        assert_eq!(gate.waiting(), 0);
        assert_eq!(
            gate.wait("a", t0 + PROGRESS_WRITE_INTERVAL),
            Some(PROGRESS_WRITE_INTERVAL),
            "after a write, the next progress waits again"
        );
    }

    #[test]
    fn another_write_takes_the_progress_along() {
        let gate = ProgressGate::default();
        let t0 = Instant::now();
        gate.wait("a", t0);
        gate.wait("b", t0);
        gate.written("a");
        assert_eq!(gate.waiting(), 1);
        assert_eq!(gate.wait("a", t0), Some(PROGRESS_WRITE_INTERVAL));
    }

    #[test]
    fn progress_of_jobs_long_gone_is_forgotten() {
        let gate = ProgressGate::default();
        let t0 = Instant::now();
        for i in 0..PRUNE_AT {
            gate.wait(&i.to_string(), t0);
        }
        gate.wait("new", t0 + 3 * PROGRESS_WRITE_INTERVAL);
        assert_eq!(gate.waiting(), 1);
    }
}
