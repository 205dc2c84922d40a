//! CPU seconds and peak memory of a process, from /proc.

/// What a process has used so far.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Usage {
    /// User + system CPU seconds.
    pub cpu_seconds: f64,
    /// Peak resident set (VmHWM), MiB.
    pub peak_rss_mib: f64,
}

impl Usage {
    /// The usage of process `pid`, or `None` once it is gone.
    pub fn of(pid: u32) -> Option<Self> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        Self::parse(&stat, &status)
    }

    /// From the text of /proc/PID/stat and /proc/PID/status.
    pub fn parse(stat: &str, status: &str) -> Option<Self> {
        let (_, cpu_seconds) = name_and_cpu_seconds(stat)?;
        let hwm_kib: f64 = status
            .lines()
            .find(|l| l.starts_with("VmHWM:"))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        Some(Self {
            cpu_seconds,
            peak_rss_mib: hwm_kib / 1024.0,
        })
    }
}

/// The command name and user + system CPU seconds, from the text of /proc/PID/stat.
pub fn name_and_cpu_seconds(stat: &str) -> Option<(String, f64)> {
    // The command name may hold spaces and parens: fields are counted after its last ')'.
    let (head, rest) = stat.rsplit_once(')')?;
    let name = head.split_once('(')?.1.to_string();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat, the 12th and 13th after the name.
    let ticks = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // Linux reports times in USER_HZ, 100 on every architecture Kubernetes runs on.
    Some((name, ticks / 100.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_and_peak_memory_are_read_past_a_command_name_with_spaces() {
        let stat = "4242 (kube api) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 75 0 0 20 0 12 0";
        let status =
            "Name:\tkube-apiserver\nVmPeak:\t 900000 kB\nVmHWM:\t  524288 kB\nVmRSS:\t 1000 kB\n";
        let usage = Usage::parse(stat, status).unwrap();
        assert_eq!(usage.cpu_seconds, 3.25);
        assert_eq!(usage.peak_rss_mib, 512.0);
    }

    #[test]
    fn this_process_is_measured() {
        let usage = Usage::of(std::process::id()).unwrap();
        assert!(usage.peak_rss_mib > 0.0);
        assert!(Usage::parse("1 (x) S", "").is_none());
    }
}
