//! Real multi-process runs under Debian's Open MPI (`make test` installs it).

use std::time::{Duration, Instant};

mod common;
use common::mpirun;

#[test]
fn four_ranks_under_mpirun_sum_correctly() {
    let out = mpirun(
        4,
        &[
            "bench-allreduce",
            "--min-bytes",
            "4",
            "--max-bytes",
            "256K",
            "--step-factor",
            "8",
            "--iterations",
            "2",
            "--warmup",
            "1",
            "--check",
        ],
        &[],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("4 ranks, tcp-ring"), "{stdout}");
    let rows: Vec<&str> = stdout.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(rows.len(), 6, "{stdout}");
    assert!(
        rows.iter().all(|r| r.trim_end().ends_with(" 0")),
        "{stdout}"
    );
}

#[test]
fn killing_one_rank_makes_the_others_exit_with_an_error() {
    let start = Instant::now();
    let out = mpirun(
        3,
        &[
            "bench-allreduce",
            "--min-bytes",
            "1M",
            "--max-bytes",
            "1M",
            "--vanish-rank",
            "2",
        ],
        &[("RINGMASTER_COLLECTIVE_TIMEOUT", "10")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the job should fail: {stderr}");
    assert!(
        stderr.contains("is gone") || stderr.contains("sent nothing"),
        "{stderr}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "took {:?}",
        start.elapsed()
    );
}

#[test]
fn rank_discovery_reads_open_mpi() {
    let out = mpirun(2, &["info"], &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let mut ranks: Vec<u64> = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| {
            assert_eq!(v["rankSource"], "Open MPI");
            assert_eq!(v["worldSize"], 2);
            v["rank"].as_u64().unwrap()
        })
        .collect();
    ranks.sort();
    assert_eq!(ranks, vec![0, 1]);
}
