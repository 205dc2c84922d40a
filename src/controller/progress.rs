//! Holding back status writes that are only progress (worker counts, messages): a job's
//! progress reaches the API server at most about once per [`PROGRESS_WRITE_INTERVAL`],
//! while phases, restarts and problems are written at once. One write per pod event would
//! cost the API server most of a job's requests.
//!
//! The interval grows with the number of objects whose progress waits, so that progress
//! writes of the whole operator stay near [`PROGRESS_WRITES_PER_SECOND`]: a thousand jobs
//! starting at once (each Starting for minutes while the scheduler works through their pods)
//! would otherwise send a thousand writes every 30 s to an API server that is already the
//! cluster's bottleneck, for words nobody needs sooner.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long progress may wait for the next write, with few objects waiting.
pub const PROGRESS_WRITE_INTERVAL: Duration = Duration::from_secs(30);

/// The progress writes a second the whole operator aims at when many objects wait: client-go's
/// default client rate, what a controller is given when nobody raised it.
pub const PROGRESS_WRITES_PER_SECOND: u32 = 5;

/// The longest progress waits, however many objects wait.
pub const PROGRESS_WRITE_INTERVAL_MAX: Duration = Duration::from_secs(300);

/// How long past its due time an entry is kept for its object to come back and write.
const FORGET_AFTER: Duration = PROGRESS_WRITE_INTERVAL_MAX;

/// How long new progress waits while `waiting` objects have progress waiting: the base
/// interval, or long enough for all of them to go out at [`PROGRESS_WRITES_PER_SECOND`],
/// at most [`PROGRESS_WRITE_INTERVAL_MAX`].
pub fn interval_for(waiting: usize) -> Duration {
    let spread = Duration::from_secs_f64(waiting as f64 / f64::from(PROGRESS_WRITES_PER_SECOND));
    spread.clamp(PROGRESS_WRITE_INTERVAL, PROGRESS_WRITE_INTERVAL_MAX)
}

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
    /// waits the whole interval, as long as [`interval_for`] the objects waiting then.
    pub fn wait(&self, key: &str, now: Instant) -> Option<Duration> {
        let mut due = self.due.lock().expect("progress map poisoned");
        match due.get(key) {
            Some(at) if *at <= now => {
                due.remove(key);
                None
            }
            Some(at) => Some(*at - now),
            None => {
                // Progress overdue by more than the longest wait is of objects deleted while
                // it waited: forgotten. A live one that comes back late (a busy operator)
                // still finds its entry due, and writes.
                due.retain(|_, at| *at + FORGET_AFTER > now);
                // Only what still waits counts: overdue entries are written or forgotten.
                let waiting = due.values().filter(|at| **at > now).count();
                let interval = interval_for(waiting + 1);
                due.insert(key.to_string(), now + interval);
                Some(interval)
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
    fn the_interval_grows_with_the_objects_waiting_so_their_writes_keep_to_the_rate() {
        assert_eq!(interval_for(1), PROGRESS_WRITE_INTERVAL);
        assert_eq!(
            interval_for(150),
            PROGRESS_WRITE_INTERVAL,
            "150 at 5/s is 30 s"
        );
        assert_eq!(interval_for(1000), Duration::from_secs(200));
        assert_eq!(interval_for(100_000), PROGRESS_WRITE_INTERVAL_MAX);

        let gate = ProgressGate::default();
        let t0 = Instant::now();
        for i in 0..999 {
            gate.wait(&i.to_string(), t0);
        }
        assert_eq!(
            gate.wait("last", t0),
            Some(Duration::from_secs(200)),
            "the thousandth job waiting waits 200 s: a thousand writes in 200 s is 5 a second"
        );
        assert_eq!(
            gate.wait("0", t0 + PROGRESS_WRITE_INTERVAL),
            None,
            "the first one waited only the interval of its time"
        );
    }

    #[test]
    fn a_job_that_comes_back_late_still_writes_and_is_not_counted_as_waiting() {
        let gate = ProgressGate::default();
        let t0 = Instant::now();
        gate.wait("late", t0);
        // A busy operator looks at "late" 70 s after its progress was due; another job's
        // progress comes first.
        let later = t0 + PROGRESS_WRITE_INTERVAL + Duration::from_secs(70);
        assert_eq!(
            gate.wait("other", later),
            Some(PROGRESS_WRITE_INTERVAL),
            "an overdue entry is not counted as waiting"
        );
        assert_eq!(gate.wait("late", later), None, "it writes, not waits again");
    }

    #[test]
    fn progress_of_jobs_long_gone_is_forgotten() {
        let gate = ProgressGate::default();
        let t0 = Instant::now();
        for i in 0..2000 {
            gate.wait(&i.to_string(), t0);
        }
        let much_later = t0 + 2 * PROGRESS_WRITE_INTERVAL_MAX + PROGRESS_WRITE_INTERVAL;
        assert_eq!(
            gate.wait("new", much_later),
            Some(PROGRESS_WRITE_INTERVAL),
            "the gone ones do not make the new one wait longer"
        );
        assert_eq!(gate.waiting(), 1);
    }
}
