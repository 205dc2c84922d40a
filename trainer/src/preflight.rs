//! The opt-in preflight (`--preflight-min-bus-gbps`): before the first step, the gang checks
//! the fabric instead of assuming it. Every rank takes part:
//!
//! 1. The job's own all-reduce of `--preflight-bytes` per rank, timed as `bench-allreduce`
//!    times it ([`bench::run`]: nccl-tests' bus bandwidth, algbw × 2(n−1)/n). NCCL reduces
//!    GPU memory and TCP ring host memory, so whichever fabric the collective uses is what
//!    is measured: InfiniBand, NCCL's sockets, or kernel TCP.
//! 2. Each link of the ring: every rank sends the same bytes to the next rank at once
//!    ([`Collective::time_from_previous`]: the ring's own socket, or NCCL's send and
//!    receive), and times what arrives from the previous one. A slow link shows in its
//!    receiver's time alone, so the slowest pair of ranks is the link with the least
//!    bandwidth.
//! 3. One all-reduce gathers every rank's figures, so each rank reaches the same verdict
//!    with no further word; a second one gathers the host names of the slowest pair.
//!
//! Rank 0 prints the figures ([`Line::Preflight`]). Below the threshold, every rank fails
//! with [`exit::FABRIC_TOO_SLOW`], its error naming the bus bandwidth, the threshold and the
//! slowest pair.

use ringmaster_contract::trainer::{LinkBandwidth, Preflight, TrainArgs, exit};

use crate::bench;
use crate::collective::{Collective, CollectiveError, ReduceOp};

/// Untimed runs before timing: the first connects NCCL's channels or fills TCP's windows.
const WARMUP: usize = 1;

/// Timed runs of each measurement: a few, so one hiccup does not decide the verdict and a
/// slow fabric is still told within seconds.
const ITERATIONS: usize = 4;

/// The most bytes of a host name gathered (a pod's name has at most 63).
const HOST_NAME_BYTES: usize = 64;

/// Errors of the preflight.
#[derive(Debug, thiserror::Error)]
pub enum PreflightError {
    /// The measurement itself failed (a peer is gone, NCCL failed).
    #[error("the preflight's measurement: {0}")]
    Collective(#[from] CollectiveError),
    /// The fabric is slower than the job accepts.
    #[error(
        "the fabric is too slow: the preflight's all-reduce of {bytes} bytes per rank over {world} ranks ({collective}) reached a bus bandwidth of {bus:.3} GB/s, below the minimum of {min} GB/s (infiniband.preflight.minBusBandwidthGbps, --preflight-min-bus-gbps); the slowest link is {slowest} at {slowest_gbps:.3} GB/s",
        bytes = .0.bytes,
        world = .0.world_size,
        collective = .0.collective,
        bus = .0.bus_bandwidth_gbps,
        min = .0.min_bus_bandwidth_gbps,
        slowest = .0.slowest,
        slowest_gbps = .0.slowest.gbps
    )]
    TooSlow(Box<Preflight>),
}

impl PreflightError {
    /// The process's exit code ([`exit`]): a slow fabric is a verdict on the nodes, a lost
    /// peer can be retried by restarting the gang.
    pub fn exit_code(&self) -> u8 {
        match self {
            PreflightError::TooSlow(_) => exit::FABRIC_TOO_SLOW,
            PreflightError::Collective(e) if e.is_peer_lost() => exit::PEER_LOST,
            PreflightError::Collective(_) => exit::FAILED,
        }
    }
}

/// Runs the preflight when `args` asks for one and there are ranks to measure between;
/// `Ok(None)` otherwise. The figures on every rank, `passed` or an error.
pub fn run(
    args: &TrainArgs,
    collective: &mut dyn Collective,
) -> Result<Option<Preflight>, PreflightError> {
    let Some(min) = args.preflight_min_bus_gbps else {
        return Ok(None);
    };
    if collective.world_size() < 2 {
        return Ok(None);
    }
    let preflight = measure(collective, args.preflight_bytes as usize, min)?;
    Ok(Some(preflight))
}

/// The figures of `bytes` per rank against `min` GB/s of bus bandwidth, the same on every
/// rank.
fn measure(
    collective: &mut dyn Collective,
    bytes: usize,
    min: f64,
) -> Result<Preflight, PreflightError> {
    let (rank, n) = (collective.rank(), collective.world_size());
    let row = bench::run(collective, &[bytes], WARMUP, ITERATIONS, false)?.remove(0);
    let link_seconds = collective.time_from_previous(bytes / 4, WARMUP, ITERATIONS)?;
    // Each rank's figures in slots of their own; the sum gathers them on every rank.
    let mut figures = vec![0f32; 2 * n];
    figures[rank] = row.busbw_gbs as f32;
    figures[n + rank] = (bytes as f64 / link_seconds / 1e9) as f32;
    collective.all_reduce(&mut figures, ReduceOp::Sum)?;
    let bus_bandwidth_gbps = figures[..n]
        .iter()
        .map(|&gbps| f64::from(gbps))
        .fold(f64::INFINITY, f64::min);
    // Slot r is what rank r received from rank r−1.
    let links: Vec<LinkBandwidth> = (0..n)
        .map(|to| LinkBandwidth {
            from: ((to + n - 1) % n) as u64,
            to: to as u64,
            gbps: f64::from(figures[n + to]),
            from_host: None,
            to_host: None,
        })
        .collect();
    let mut slowest = slowest_link(&links).clone();
    let (from_host, to_host) = gather_host_names(
        collective,
        slowest.from as usize,
        slowest.to as usize,
        &crate::world::host_name(),
    )?;
    slowest.from_host = Some(from_host).filter(|h| !h.is_empty());
    slowest.to_host = Some(to_host).filter(|h| !h.is_empty());
    Ok(Preflight {
        collective: collective.name().to_string(),
        world_size: n as u64,
        bytes: bytes as u64,
        bus_bandwidth_gbps,
        min_bus_bandwidth_gbps: min,
        links,
        slowest,
        passed: bus_bandwidth_gbps >= min,
    })
}

/// The link with the least bandwidth (the first of equals).
pub fn slowest_link(links: &[LinkBandwidth]) -> &LinkBandwidth {
    links
        .iter()
        .reduce(|slowest, link| {
            if link.gbps < slowest.gbps {
                link
            } else {
                slowest
            }
        })
        .expect("a ring of two ranks or more has links")
}

/// The host names of ranks `from` and `to`, gathered on every rank: each puts its own
/// name's bytes, one per value (exact in f32), in its slots, and the sum gathers them.
fn gather_host_names(
    collective: &mut dyn Collective,
    from: usize,
    to: usize,
    own: &str,
) -> Result<(String, String), CollectiveError> {
    let mut names = vec![0f32; 2 * HOST_NAME_BYTES];
    let rank = collective.rank();
    for (slot, of) in [(0, from), (1, to)] {
        if rank == of {
            let bytes = own.bytes().take(HOST_NAME_BYTES);
            for (value, byte) in names[slot * HOST_NAME_BYTES..].iter_mut().zip(bytes) {
                *value = f32::from(byte);
            }
        }
    }
    collective.all_reduce(&mut names, ReduceOp::Sum)?;
    let name = |slot: usize| {
        let bytes: Vec<u8> = names[slot * HOST_NAME_BYTES..(slot + 1) * HOST_NAME_BYTES]
            .iter()
            .map(|&v| v as u8)
            .take_while(|&b| b != 0)
            .collect();
        String::from_utf8_lossy(&bytes).to_string()
    };
    Ok((name(0), name(1)))
}

/// The preflight's verdict on its figures: the error every rank stops with when the bus
/// bandwidth is below the threshold.
pub fn verdict(preflight: Preflight) -> Result<Preflight, PreflightError> {
    if preflight.passed {
        Ok(preflight)
    } else {
        Err(PreflightError::TooSlow(Box::new(preflight)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(from: u64, to: u64, gbps: f64) -> LinkBandwidth {
        LinkBandwidth {
            from,
            to,
            gbps,
            from_host: None,
            to_host: None,
        }
    }

    #[test]
    fn the_slowest_link_is_the_least_bandwidth_and_the_first_of_equals() {
        let links = [
            link(3, 0, 2.0),
            link(0, 1, 0.5),
            link(1, 2, 0.5),
            link(2, 3, 9.0),
        ];
        assert_eq!(slowest_link(&links), &links[1]);
    }

    #[test]
    fn a_slow_fabric_is_a_verdict_that_names_the_threshold_and_the_slowest_pair() {
        let slowest = LinkBandwidth {
            from_host: Some("job-worker-1".into()),
            to_host: Some("job-worker-2".into()),
            ..link(3, 4, 0.125)
        };
        let preflight = Preflight {
            collective: "tcp-ring".into(),
            world_size: 8,
            bytes: 1 << 20,
            bus_bandwidth_gbps: 0.25,
            min_bus_bandwidth_gbps: 100.0,
            links: vec![slowest.clone()],
            slowest,
            passed: false,
        };
        let error = verdict(preflight.clone()).unwrap_err();
        assert_eq!(error.exit_code(), exit::FABRIC_TOO_SLOW);
        let text = error.to_string();
        for words in [
            "bus bandwidth of 0.250 GB/s",
            "minimum of 100 GB/s",
            "slowest link is rank 3 → rank 4 (job-worker-1 → job-worker-2) at 0.125 GB/s",
        ] {
            assert!(text.contains(words), "{words:?} in {text}");
        }
        let passed = Preflight {
            passed: true,
            ..preflight
        };
        assert_eq!(verdict(passed.clone()).unwrap(), passed);
    }
}
