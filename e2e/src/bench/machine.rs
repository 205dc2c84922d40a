//! The machine around a run: how fast one core does a fixed piece of work, how busy the CPUs
//! were and with what (waiting for the disk, taken by the hypervisor), how much written data
//! was still on its way to the disk, and which processes used the CPU. The local cluster
//! shares this machine's cores with everything else on it, so a run the machine slowed shows
//! here, not in the operator's own figures.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use super::process::name_and_cpu_seconds;

/// The machine-wide CPU counters of /proc/stat's `cpu` line, in ticks (USER_HZ).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CpuTicks {
    /// user + nice + system + irq + softirq.
    pub busy: u64,
    pub idle: u64,
    /// Idle while a disk request of this machine was outstanding.
    pub iowait: u64,
    /// Time the hypervisor ran something else while this machine wanted its CPU.
    pub steal: u64,
}

impl CpuTicks {
    /// Now, from /proc/stat.
    pub fn now() -> Option<Self> {
        Self::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    /// From the text of /proc/stat.
    pub fn parse(stat: &str) -> Option<Self> {
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let fields: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        let field = |i: usize| fields.get(i).copied().unwrap_or(0);
        // user nice system idle iowait irq softirq steal (guest time is counted in user).
        Some(Self {
            busy: field(0) + field(1) + field(2) + field(5) + field(6),
            idle: field(3),
            iowait: field(4),
            steal: field(7),
        })
    }

    /// How the CPUs' time between `self` and `later` was spent, in percent of all of it.
    pub fn shares_until(&self, later: &Self) -> CpuShares {
        let busy = later.busy.saturating_sub(self.busy) as f64;
        let idle = later.idle.saturating_sub(self.idle) as f64;
        let iowait = later.iowait.saturating_sub(self.iowait) as f64;
        let steal = later.steal.saturating_sub(self.steal) as f64;
        let total = busy + idle + iowait + steal;
        if total == 0.0 {
            return CpuShares::default();
        }
        CpuShares {
            busy_percent: 100.0 * busy / total,
            iowait_percent: 100.0 * iowait / total,
            steal_percent: 100.0 * steal / total,
        }
    }
}

/// Shares of every CPU's time over an interval, in percent.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CpuShares {
    pub busy_percent: f64,
    pub iowait_percent: f64,
    pub steal_percent: f64,
}

/// Written data not yet on the disk (/proc/meminfo `Dirty` and `Writeback`), MiB.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Unwritten {
    pub dirty_mib: f64,
    pub writeback_mib: f64,
}

impl Unwritten {
    pub fn now() -> Option<Self> {
        Self::parse(&std::fs::read_to_string("/proc/meminfo").ok()?)
    }

    /// From the text of /proc/meminfo.
    pub fn parse(meminfo: &str) -> Option<Self> {
        let mib = |key: &str| -> Option<f64> {
            let line = meminfo.lines().find(|l| l.starts_with(key))?;
            let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib / 1024.0)
        };
        Some(Self {
            dirty_mib: mib("Dirty:")?,
            writeback_mib: mib("Writeback:")?,
        })
    }
}

/// CPU seconds used so far by every live process, by PID, with its command name.
pub fn cpu_by_process() -> BTreeMap<u32, (String, f64)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return BTreeMap::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            let (name, seconds) = name_and_cpu_seconds(&stat)?;
            Some((pid, (name, seconds)))
        })
        .collect()
}

/// CPU seconds each command used between two [`cpu_by_process`] readings, largest first. A
/// process started in between counts from its start; one that ended in between is missed.
pub fn cpu_used_between(
    before: &BTreeMap<u32, (String, f64)>,
    after: &BTreeMap<u32, (String, f64)>,
) -> Vec<(String, f64)> {
    let mut by_name: BTreeMap<&str, f64> = BTreeMap::new();
    for (pid, (name, seconds)) in after {
        let earlier = match before.get(pid) {
            Some((same, earlier)) if same == name => *earlier,
            _ => 0.0,
        };
        *by_name.entry(name).or_default() += (seconds - earlier).max(0.0);
    }
    let mut used: Vec<(String, f64)> = by_name
        .into_iter()
        .filter(|(_, seconds)| *seconds > 0.0)
        .map(|(name, seconds)| (name.to_string(), seconds))
        .collect();
    used.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    used
}

/// Milliseconds one core takes for a fixed piece of work (random reads over 64 MiB, so the
/// caches and memory count as well as the core), the median of three tries. The same build
/// on a machine that is not slowed takes the same time every run: a run that starts with a
/// higher figure ran on a slower machine.
pub fn calibration_ms() -> f64 {
    let mut tries: Vec<f64> = (0..3).map(|_| fixed_work().as_secs_f64() * 1e3).collect();
    tries.sort_by(f64::total_cmp);
    tries[1]
}

fn fixed_work() -> Duration {
    const WORDS: usize = 8 << 20;
    let table: Vec<u64> = (0..WORDS as u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    let start = Instant::now();
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut sum = 0u64;
    for _ in 0..4_000_000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        sum = sum.wrapping_add(black_box(&table)[(state as usize) % WORDS]);
    }
    black_box(sum);
    start.elapsed()
}

/// The machine around one run: every part of the local cluster shares its cores, so a run
/// the machine slowed shows here, not in the operator's own figures.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MachineFigures {
    /// How the wait for a quiet machine before the run went (`--settle-below`).
    pub settled: Option<Settled>,
    /// Milliseconds one core took for a fixed piece of work just before the run.
    pub calibration_ms: f64,
    /// Written data still on its way to the disk when the run started.
    pub unwritten_at_start: Unwritten,
    /// How every CPU's time was spent over the run.
    pub shares: CpuShares,
    /// CPU seconds by command over the run, largest first.
    pub cpu_by_command: Vec<(String, f64)>,
}

impl MachineFigures {
    /// CPU seconds the processes whose command name (/proc/PID/comm, at most 15 bytes) is
    /// `command` used over the run; 0 when none ran.
    pub fn cpu_of(&self, command: &str) -> f64 {
        self.cpu_by_command
            .iter()
            .find(|(name, _)| name == command)
            .map_or(0.0, |(_, seconds)| *seconds)
    }
}

/// The machine's counters when a run starts; [`MachineWatch::finish`] reads them again when
/// it ends and gives the run's [`MachineFigures`].
#[derive(Debug)]
pub struct MachineWatch {
    settled: Option<Settled>,
    calibration_ms: f64,
    unwritten_at_start: Unwritten,
    ticks: CpuTicks,
    processes: BTreeMap<u32, (String, f64)>,
}

impl MachineWatch {
    /// Times one core's fixed work, then reads the counters: call it just before the run,
    /// with how the wait for a quiet machine went, if there was one.
    pub async fn start(settled: Option<Settled>) -> Result<Self, tokio::task::JoinError> {
        let calibration_ms = tokio::task::spawn_blocking(calibration_ms).await?;
        Ok(Self {
            settled,
            calibration_ms,
            unwritten_at_start: Unwritten::now().unwrap_or_default(),
            ticks: CpuTicks::now().unwrap_or_default(),
            processes: cpu_by_process(),
        })
    }

    /// What the machine did since [`MachineWatch::start`].
    pub fn finish(self) -> MachineFigures {
        MachineFigures {
            settled: self.settled,
            calibration_ms: self.calibration_ms,
            unwritten_at_start: self.unwritten_at_start,
            shares: self
                .ticks
                .shares_until(&CpuTicks::now().unwrap_or_default()),
            cpu_by_command: cpu_used_between(&self.processes, &cpu_by_process()),
        }
    }
}

/// How [`settle`] went.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Settled {
    /// Seconds spent writing data back and waiting for quiet.
    pub waited_s: f64,
    /// How busy the CPUs were over the last window looked at, percent.
    pub busy_percent: f64,
    /// Whether that was below the threshold (`false`: it stopped waiting at `max`).
    pub quiet: bool,
}

/// Waits for a quiet machine before a run: every written byte is put on the disk first
/// (`sync`), then it waits until the CPUs are less than `busy_below` percent busy over a
/// `window`, for at most `max`. Work left over from before the run (a build's output still
/// being written back, processes still busy) would otherwise run inside the measured run.
pub async fn settle(busy_below: f64, window: Duration, max: Duration) -> Settled {
    let start = Instant::now();
    // An error leaves the data to the kernel's own writeback; the CPU figures still say it.
    let _ = tokio::process::Command::new("sync").status().await;
    loop {
        let before = CpuTicks::now().unwrap_or_default();
        tokio::time::sleep(window).await;
        let busy = before
            .shares_until(&CpuTicks::now().unwrap_or_default())
            .busy_percent;
        let quiet = busy < busy_below;
        if quiet || start.elapsed() >= max {
            return Settled {
                waited_s: start.elapsed().as_secs_f64(),
                busy_percent: busy,
                quiet,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_line_is_split_into_busy_idle_iowait_and_steal() {
        let stat = "cpu  100 5 50 800 30 2 3 10 0 0\ncpu0 50 2 25 400 15 1 1 5 0 0\nintr 1\n";
        let ticks = CpuTicks::parse(stat).unwrap();
        assert_eq!(
            ticks,
            CpuTicks {
                busy: 160,
                idle: 800,
                iowait: 30,
                steal: 10
            }
        );
        let later = CpuTicks {
            busy: 260,
            idle: 850,
            iowait: 70,
            steal: 20,
        };
        let shares = ticks.shares_until(&later);
        assert_eq!(shares.busy_percent, 50.0);
        assert_eq!(shares.iowait_percent, 20.0);
        assert_eq!(shares.steal_percent, 5.0);
        assert_eq!(ticks.shares_until(&ticks), CpuShares::default());
    }

    #[test]
    fn unwritten_data_is_read_in_mib() {
        let meminfo = "MemTotal: 1000 kB\nDirty:     204800 kB\nWriteback:   1024 kB\n";
        let unwritten = Unwritten::parse(meminfo).unwrap();
        assert_eq!(unwritten.dirty_mib, 200.0);
        assert_eq!(unwritten.writeback_mib, 1.0);
        assert!(Unwritten::parse("MemTotal: 1 kB\n").is_none());
    }

    #[test]
    fn cpu_is_summed_by_command_counting_new_processes_from_their_start() {
        let stat = "7 (kube sched) S 1 7 7 0 -1 4194560 1 0 0 0 300 100 0 0";
        assert_eq!(
            name_and_cpu_seconds(stat),
            Some(("kube sched".to_string(), 4.0))
        );
        let before = BTreeMap::from([
            (1, ("etcd".to_string(), 10.0)),
            (2, ("kwok".to_string(), 5.0)),
            (3, ("kwok".to_string(), 1.0)),
        ]);
        let after = BTreeMap::from([
            (1, ("etcd".to_string(), 12.5)),
            (2, ("kwok".to_string(), 9.0)),
            // Pid 3 ended; pid 4 is new, and pid 5 reuses nothing.
            (4, ("kwok".to_string(), 2.0)),
            (5, ("idle".to_string(), 0.0)),
        ]);
        assert_eq!(
            cpu_used_between(&before, &after),
            vec![("kwok".to_string(), 6.0), ("etcd".to_string(), 2.5)]
        );
    }

    #[tokio::test]
    async fn settling_stops_waiting_at_its_limit_on_a_busy_machine() {
        // Nothing is below 0 % busy: it must give up at `max` and say it was not quiet.
        let settled = settle(0.0, Duration::from_millis(100), Duration::from_millis(300)).await;
        assert!(!settled.quiet);
        assert!(settled.waited_s >= 0.3, "{settled:?}");
        // Everything is below 101 %: one window is enough.
        let settled = settle(101.0, Duration::from_millis(100), Duration::from_secs(60)).await;
        assert!(settled.quiet, "{settled:?}");
        assert!(settled.waited_s < 30.0, "{settled:?}");
    }

    #[tokio::test]
    async fn a_watch_finds_the_cpu_this_process_used_under_its_command_name() {
        let watch = MachineWatch::start(None).await.unwrap();
        // The calibration ran before the counters were read: this work must show on its own.
        let spin = Instant::now();
        while spin.elapsed() < Duration::from_millis(300) {
            black_box(fixed_work());
        }
        let figures = watch.finish();
        assert!(figures.calibration_ms > 0.0, "{figures:?}");
        let me = std::fs::read_to_string("/proc/self/comm").unwrap();
        let used = figures.cpu_of(me.trim_end());
        assert!(used >= 0.2, "{used} s under {me:?} in {figures:?}");
        assert_eq!(figures.cpu_of("no-such-command"), 0.0);
    }

    #[test]
    fn this_machine_has_cpu_counters_and_a_calibration() {
        let before = CpuTicks::now().unwrap();
        let ms = calibration_ms();
        assert!(ms > 0.0, "{ms}");
        let after = CpuTicks::now().unwrap();
        assert!(before.shares_until(&after).busy_percent > 0.0);
        assert!(Unwritten::now().is_some());
        assert!(cpu_by_process().contains_key(&std::process::id()));
    }
}
