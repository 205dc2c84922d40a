//! The newest report of each running job, and what the status makes of it: percent done,
//! the recent rate, the time left. In memory only: after a restart of the operator the next
//! report (15 s later) fills it again, and the status keeps the last written progress
//! meanwhile.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use ringmaster_contract::progress::Report;
use ringmaster_contract::trainer::Fabric;

use crate::api::{FabricStatus, TrainingProgress};

/// How far back the recent rate looks.
pub const RATE_WINDOW: Duration = Duration::from_secs(300);

/// What the board keeps of one job's launcher.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// The launcher pod that reported (a new attempt's launcher starts a new window).
    pub launcher_uid: String,
    /// (steps done, when reported), oldest first, within [`RATE_WINDOW`] of the newest.
    pub steps: VecDeque<(u64, Timestamp)>,
    /// The newest report's progress line and when it came.
    pub latest: Option<(ringmaster_contract::trainer::Progress, Timestamp)>,
    /// The fabric line, once reported.
    pub fabric: Option<Fabric>,
    /// Whether a reconcile was asked for and has not read the entry yet.
    pub pending: bool,
}

impl Entry {
    fn new(launcher_uid: &str) -> Self {
        Self {
            launcher_uid: launcher_uid.to_string(),
            steps: VecDeque::new(),
            latest: None,
            fabric: None,
            pending: false,
        }
    }

    fn take(&mut self, report: Report, at: Timestamp) {
        if let Some(step) = report.step {
            // A step lower than the last is a restart from a checkpoint: the rate starts over.
            if self.steps.back().is_some_and(|(s, _)| *s > step.step) {
                self.steps.clear();
            }
            self.steps.push_back((step.step, at));
            while self.steps.len() > 2
                && self
                    .steps
                    .front()
                    .is_some_and(|(_, t)| at.duration_since(*t).unsigned_abs() > RATE_WINDOW)
            {
                self.steps.pop_front();
            }
            self.latest = Some((step, at));
        }
        if report.fabric.is_some() {
            self.fabric = report.fabric;
        }
    }

    /// Steps per second over the window: none before two reports with steps between them.
    pub fn steps_per_second(&self) -> Option<f64> {
        let ((first, from), (last, to)) = (self.steps.front()?, self.steps.back()?);
        let seconds = to.duration_since(*from).as_secs_f64();
        (last > first && seconds > 0.0).then(|| (last - first) as f64 / seconds)
    }

    /// The status's progress.
    pub fn progress(&self) -> Option<TrainingProgress> {
        let (step, at) = self.latest.as_ref()?;
        let total = step.total_steps.filter(|t| *t > 0);
        let remaining = total.and_then(|total| {
            let rate = self.steps_per_second()?;
            let seconds = total.saturating_sub(step.step) as f64 / rate;
            seconds
                .is_finite()
                .then(|| Duration::from_secs_f64(seconds))
        });
        let images_per_second = step.recent_images_per_second.or(step.images_per_second);
        Some(TrainingProgress {
            step: i64::try_from(step.step).unwrap_or(i64::MAX),
            total_steps: total.map(|t| i64::try_from(t).unwrap_or(i64::MAX)),
            percent_done: total.map(|t| format!("{}%", (step.step.min(t) * 100) / t)),
            loss: step.loss.filter(|l| l.is_finite()),
            images_per_second: images_per_second
                .filter(|r| r.is_finite())
                .map(|r| r.round() as i64),
            time_remaining: remaining.map(human_duration),
            estimated_completion_time: remaining.and_then(|r| {
                let end = at.checked_add(r).ok()?;
                Some(Time(end.round(k8s_openapi::jiff::Unit::Second).ok()?))
            }),
            report_time: Time(*at),
        })
    }
}

/// `1h12m`, `5m30s`, `45s`: as kubectl writes ages.
pub fn human_duration(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{}s", s / 60, s % 60),
        3600..86_400 => format!("{}h{}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d{}h", s / 86_400, (s % 86_400) / 3600),
    }
}

/// The fabric in the status's words.
pub fn fabric_status(fabric: &Fabric) -> FabricStatus {
    FabricStatus {
        collective: fabric.collective.clone(),
        network: fabric.network.clone(),
        transports: fabric.transports.clone(),
        gpu_direct_rdma: fabric.gpu_direct_rdma,
        ranks_on_infiniband: i64::try_from(fabric.ranks_on_infiniband).unwrap_or(i64::MAX),
        world_size: i64::try_from(fabric.world_size).unwrap_or(i64::MAX),
    }
}

/// The newest reports, by job (`namespace/name`).
#[derive(Debug, Default)]
pub struct Board {
    entries: Mutex<HashMap<String, Entry>>,
}

impl Board {
    /// Takes in a report from the launcher `launcher_uid` of the job `key`; whether a
    /// reconcile should be asked for (none is waiting to read it already).
    pub fn record(&self, key: &str, launcher_uid: &str, report: Report, at: Timestamp) -> bool {
        let mut entries = self.entries.lock().expect("report board poisoned");
        let entry = entries
            .entry(key.to_string())
            .or_insert_with(|| Entry::new(launcher_uid));
        if entry.launcher_uid != launcher_uid {
            *entry = Entry::new(launcher_uid);
        }
        entry.take(report, at);
        !std::mem::replace(&mut entry.pending, true)
    }

    /// The job's entry, for its reconcile. The reconcile it asked for stays asked until
    /// [`Board::settled`]: while the job's status write is held back, its reconcile comes
    /// back by itself when the write is due, and reports meanwhile need not wake it.
    pub fn read(&self, key: &str) -> Option<Entry> {
        let entries = self.entries.lock().expect("report board poisoned");
        entries.get(key).cloned()
    }

    /// The job's status now shows its reports (written, or nothing to write): the next
    /// report asks for a reconcile again.
    pub fn settled(&self, key: &str) {
        let mut entries = self.entries.lock().expect("report board poisoned");
        if let Some(entry) = entries.get_mut(key) {
            entry.pending = false;
        }
    }

    /// Forgets a job that no longer runs; whether it was known.
    pub fn forget(&self, key: &str) -> bool {
        let mut entries = self.entries.lock().expect("report board poisoned");
        entries.remove(key).is_some()
    }

    /// The jobs whose newest report is older than `age` at `now` (launchers gone without a
    /// word, jobs deleted while the operator was elsewhere).
    pub fn stale(&self, now: Timestamp, age: Duration) -> Vec<String> {
        let entries = self.entries.lock().expect("report board poisoned");
        entries
            .iter()
            .filter(|(_, e)| {
                e.latest
                    .as_ref()
                    .is_none_or(|(_, at)| now.duration_since(*at).unsigned_abs() > age)
            })
            .map(|(key, _)| key.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringmaster_contract::trainer::Progress;

    fn step(step: u64, total: Option<u64>) -> Report {
        Report {
            step: Some(Progress {
                step,
                loss: Some(2.5),
                accuracy: None,
                learning_rate: 0.1,
                images_per_second: Some(1000.4),
                recent_images_per_second: Some(1200.6),
                total_steps: total,
            }),
            fabric: None,
        }
    }

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + seconds).unwrap()
    }

    #[test]
    fn percent_rate_and_time_left_come_from_the_reports_in_the_window() {
        let board = Board::default();
        assert!(board.record("ns/a", "uid-1", step(100, Some(1000)), at(0)));
        assert!(
            !board.record("ns/a", "uid-1", step(150, Some(1000)), at(15)),
            "one reconcile"
        );
        let entry = board.read("ns/a").unwrap();
        let progress = entry.progress().unwrap();
        assert_eq!(progress.percent_done.as_deref(), Some("15%"));
        assert_eq!(
            progress.images_per_second,
            Some(1201),
            "the recent rate, rounded"
        );
        // 50 steps in 15 s: 850 left take 255 s.
        assert_eq!(progress.time_remaining.as_deref(), Some("4m15s"));
        assert_eq!(progress.estimated_completion_time, Some(Time(at(15 + 255))));
        assert!(
            !board.record("ns/a", "uid-1", step(155, Some(1000)), at(16)),
            "read, its write held back: no new reconcile"
        );
        board.settled("ns/a");
        assert!(
            board.record("ns/a", "uid-1", step(160, Some(1000)), at(30)),
            "written: the next report asks again"
        );
    }

    #[test]
    fn the_window_drops_old_reports_and_a_new_launcher_or_a_step_back_starts_over() {
        let board = Board::default();
        board.record("ns/a", "uid-1", step(0, Some(100)), at(0));
        board.record("ns/a", "uid-1", step(10, Some(100)), at(10));
        // Much slower now: 10 steps in 400 s; the first report fell out of the window.
        board.record("ns/a", "uid-1", step(20, Some(100)), at(410));
        let entry = board.read("ns/a").unwrap();
        assert_eq!(entry.steps.len(), 2);
        assert!((entry.steps_per_second().unwrap() - 0.025).abs() < 1e-9);
        board.record("ns/a", "uid-1", step(5, Some(100)), at(420));
        assert_eq!(
            board.read("ns/a").unwrap().steps_per_second(),
            None,
            "a step back"
        );
        board.record("ns/a", "uid-2", step(30, Some(100)), at(430));
        let entry = board.read("ns/a").unwrap();
        assert_eq!(
            (entry.launcher_uid.as_str(), entry.steps.len()),
            ("uid-2", 1)
        );
        let progress = entry.progress().unwrap();
        assert_eq!(progress.time_remaining, None, "one report: no rate yet");
        assert_eq!(progress.percent_done.as_deref(), Some("30%"));
    }

    #[test]
    fn without_a_total_there_is_no_percent_nor_time_left_and_stale_jobs_are_found() {
        let board = Board::default();
        board.record("ns/a", "u", step(10, None), at(0));
        board.record("ns/a", "u", step(20, None), at(10));
        board.record("ns/b", "v", step(1, Some(10)), at(100));
        let progress = board.read("ns/a").unwrap().progress().unwrap();
        assert_eq!(
            (progress.percent_done, progress.time_remaining),
            (None, None)
        );
        assert_eq!(board.stale(at(200), Duration::from_secs(150)), ["ns/a"]);
        assert!(board.forget("ns/a") && !board.forget("ns/a"));
    }

    #[test]
    fn durations_read_as_kubectl_writes_ages() {
        let cases = [
            (45, "45s"),
            (330, "5m30s"),
            (4320, "1h12m"),
            (90_000, "1d1h"),
        ];
        for (seconds, text) in cases {
            assert_eq!(human_duration(Duration::from_secs(seconds)), text);
        }
    }
}
