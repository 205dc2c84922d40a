//! Copy progress: counters the workers bump, and the reporters that show them (a bar in a
//! terminal, log lines otherwise, the DataStage's status in a cluster).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kube::api::{Api, Patch, PatchParams};

use crate::api::{DataStage, Progress};

/// Counters shared by the copy workers.
#[derive(Debug, Default)]
pub struct Counters {
    /// Files to copy or verify.
    pub files_total: AtomicU64,
    /// Files copied or verified.
    pub files_done: AtomicU64,
    /// Bytes of all listed files.
    pub bytes_total: AtomicU64,
    /// Bytes copied or verified.
    pub bytes_done: AtomicU64,
    /// Bytes downloaded in this run (excludes skipped files).
    pub bytes_downloaded: AtomicU64,
}

/// A moment's view of the counters.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Snapshot {
    /// Files to copy or verify.
    pub files_total: u64,
    /// Files copied or verified.
    pub files_done: u64,
    /// Bytes of all files.
    pub bytes_total: u64,
    /// Bytes copied or verified.
    pub bytes_done: u64,
    /// Bytes downloaded in this run.
    pub bytes_downloaded: u64,
}

impl Counters {
    /// Reads every counter.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            files_total: self.files_total.load(Ordering::Relaxed),
            files_done: self.files_done.load(Ordering::Relaxed),
            bytes_total: self.bytes_total.load(Ordering::Relaxed),
            bytes_done: self.bytes_done.load(Ordering::Relaxed),
            bytes_downloaded: self.bytes_downloaded.load(Ordering::Relaxed),
        }
    }
}

/// Bytes per second over the last report interval.
pub fn rate(previous: u64, now: u64, elapsed: Duration) -> u64 {
    let secs = elapsed.as_secs_f64();
    if secs <= 0.0 {
        0
    } else {
        (now.saturating_sub(previous) as f64 / secs) as u64
    }
}

/// `1.5 GiB/s`-style text.
pub fn human_rate(bytes_per_second: u64) -> String {
    format!("{}/s", human_bytes(bytes_per_second))
}

/// Bytes in binary units with one decimal.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// The status `progress` block for a snapshot.
pub fn status_progress(s: &Snapshot, bytes_per_second: u64) -> Progress {
    let percent = if s.bytes_total == 0 {
        if s.files_done >= s.files_total {
            100.0
        } else {
            0.0
        }
    } else {
        s.bytes_done as f64 * 100.0 / s.bytes_total as f64
    };
    Progress {
        files_total: s.files_total as i64,
        files_done: s.files_done as i64,
        bytes_total: s.bytes_total as i64,
        bytes_done: s.bytes_done as i64,
        bytes_per_second: bytes_per_second as i64,
        percent: Some(format!("{percent:.1}%")),
        rate: Some(human_rate(bytes_per_second)),
    }
}

/// Where progress goes.
pub enum Reporter {
    /// An interactive bar on stderr.
    Bar(indicatif::ProgressBar),
    /// A log line per interval.
    Log,
    /// The `status.progress` of a DataStage (merge patch on the status subresource).
    Status {
        /// The DataStage's API.
        api: Box<Api<DataStage>>,
        /// Its name.
        name: String,
    },
}

impl Reporter {
    /// Shows one snapshot.
    pub async fn report(&self, s: &Snapshot, bytes_per_second: u64) {
        match self {
            Reporter::Bar(bar) => {
                bar.set_length(s.bytes_total);
                bar.set_position(s.bytes_done);
                bar.set_message(format!("{}/{} files", s.files_done, s.files_total));
            }
            Reporter::Log => tracing::info!(
                files_done = s.files_done,
                files_total = s.files_total,
                bytes_done = s.bytes_done,
                bytes_total = s.bytes_total,
                rate = %human_rate(bytes_per_second),
                "copy progress"
            ),
            Reporter::Status { api, name } => {
                let patch = serde_json::json!({
                    "status": { "progress": status_progress(s, bytes_per_second) }
                });
                // Progress is advisory: a failed patch is logged, never fatal to the copy.
                if let Err(error) = api
                    .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    tracing::warn!(%error, "could not report progress to the DataStage");
                }
            }
        }
    }

    /// Reports every `interval` until `done` resolves, then once more.
    pub async fn run(
        &self,
        counters: &Counters,
        interval: Duration,
        done: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(done);
        let mut last = (Instant::now(), counters.snapshot().bytes_downloaded);
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut current_rate = 0;
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = &mut done => break,
            }
            let s = counters.snapshot();
            current_rate = rate(last.1, s.bytes_downloaded, last.0.elapsed());
            last = (Instant::now(), s.bytes_downloaded);
            self.report(&s, current_rate).await;
        }
        self.report(&counters.snapshot(), current_rate).await;
        if let Reporter::Bar(bar) = self {
            bar.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_percent() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_rate(3 * 1024 * 1024 * 1024), "3.0 GiB/s");
        let s = Snapshot {
            files_total: 4,
            files_done: 1,
            bytes_total: 1000,
            bytes_done: 250,
            bytes_downloaded: 250,
        };
        let p = status_progress(&s, 2048);
        assert_eq!(p.percent.as_deref(), Some("25.0%"));
        assert_eq!(p.rate.as_deref(), Some("2.0 KiB/s"));
        let empty = Snapshot::default();
        assert_eq!(
            status_progress(&empty, 0).percent.as_deref(),
            Some("100.0%")
        );
        assert_eq!(rate(0, 1000, Duration::from_millis(500)), 2000);
    }
}
