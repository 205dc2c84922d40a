//! The NCCL collective: what it does where NCCL cannot run (this CI machine has no GPU), and
//! that `auto` picks what the probe found. On a machine with two or more GPUs and NCCL the
//! same tests all-reduce on them.

use std::time::Duration;

use ringmaster_trainer::collective::{
    self, CollectiveError, CollectiveKind, NcclProbe, ReduceOp, RendezvousKey, RingConfig,
};
use ringmaster_trainer::world::World;

mod common;
use common::free_port;

/// The settings of a test's ranks, with a rendezvous key: NCCL's bootstrap admits the
/// ranks that prove they hold it, as in a job.
fn config(port: u16) -> RingConfig {
    RingConfig {
        rendezvous: format!("127.0.0.1:{port}"),
        timeout: Duration::from_secs(20),
        chunk_bytes: 4096,
        key: Some(RendezvousKey::new(&[3; 32]).unwrap()),
    }
}

/// Connects two ranks with `kind` and all-reduces `[rank + 1; 1000]` on each.
fn two_ranks(kind: CollectiveKind) -> Vec<Result<(&'static str, Vec<f32>), CollectiveError>> {
    let port = free_port();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                scope.spawn(move || {
                    let world = World {
                        rank,
                        size: 2,
                        local_rank: rank,
                        source: "test",
                        ..World::single()
                    };
                    let mut c = collective::connect(&world, kind, config(port))?;
                    let mut data = vec![(rank + 1) as f32; 1000];
                    c.all_reduce(&mut data, ReduceOp::Sum)?;
                    Ok((c.name(), data))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn probe_explains_why_nccl_is_unavailable() {
    let probe = NcclProbe::detect();
    assert_eq!(probe.available(), probe.unavailable.is_none());
    if !probe.driver_loaded {
        let reason = probe.unavailable.as_deref().unwrap();
        assert!(reason.contains("libcuda.so"), "{reason}");
        assert_eq!(probe.devices, 0);
    }
    if probe.driver_loaded && probe.devices > 0 && !probe.nccl_loaded {
        assert!(probe.unavailable.as_deref().unwrap().contains("libnccl"));
    }
}

#[test]
fn nccl_asked_for_is_an_error_with_the_reason_or_a_correct_sum() {
    let probe = NcclProbe::detect();
    if probe.available() && probe.devices < 2 {
        // Two ranks in one process need two GPUs (NCCL refuses a shared one); what can be
        // checked on one GPU is that the communicator reports itself.
        return assert_eq!(probe.devices, 1);
    }
    for result in two_ranks(CollectiveKind::Nccl) {
        match (&probe.unavailable, result) {
            (
                Some(reason),
                Err(CollectiveError::Unavailable {
                    backend,
                    reason: got,
                }),
            ) => {
                assert_eq!(backend, "nccl");
                assert_eq!(&got, reason);
            }
            (None, Ok((name, data))) => {
                assert_eq!(name, "nccl");
                assert!(data.iter().all(|&x| x == 3.0));
            }
            (expected, got) => panic!("probe said {expected:?}, connect gave {got:?}"),
        }
    }
}

#[test]
fn auto_uses_nccl_only_when_the_probe_finds_it() {
    let probe = NcclProbe::detect();
    if probe.available() && probe.devices < 2 {
        return assert_eq!(probe.devices, 1);
    }
    let expected = if probe.available() {
        "nccl"
    } else {
        "tcp-ring"
    };
    for result in two_ranks(CollectiveKind::Auto) {
        let (name, data) = result.expect("auto always connects");
        assert_eq!(name, expected);
        assert!(data.iter().all(|&x| x == 3.0));
    }
}

#[test]
fn unavailable_nccl_reads_well_on_the_command_line() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ringmaster-trainer"))
        .args([
            "bench-allreduce",
            "--collective",
            "nccl",
            "--max-bytes",
            "4K",
        ])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env(
            "RINGMASTER_RENDEZVOUS",
            format!("127.0.0.1:{}", free_port()),
        )
        .env("RINGMASTER_COLLECTIVE_TIMEOUT", "2")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    match NcclProbe::detect().unavailable {
        Some(reason) => {
            assert!(!out.status.success());
            assert!(
                stderr.contains(&format!("rank 0: nccl is unavailable: {reason}")),
                "{stderr}"
            );
            assert!(!stderr.contains("panicked"), "{stderr}");
        }
        // With NCCL, rank 0 waits for a rank 1 that never comes: the timeout, not a hang.
        None => assert!(
            !out.status.success() && !stderr.contains("panicked"),
            "{stderr}"
        ),
    }
}
