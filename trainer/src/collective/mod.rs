//! Collectives behind one trait: a single rank, a TCP ring, and (with GPUs) NCCL.

mod auth;
pub mod fabric;
mod nccl;
pub mod overlap;
mod ring;
mod single;

pub use auth::{Refused, RendezvousKey};
pub use nccl::{NcclCollective, NcclProbe};
pub use ring::{RingConfig, TcpRing};
pub use single::SingleRank;

use crate::world::World;

/// How values are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum over ranks.
    Sum,
    /// Sum over ranks divided by the world size.
    Average,
}

/// Errors of collectives. A lost or stuck peer is an error, never a hang.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// The rendezvous on rank 0 could not be reached or served.
    #[error("rendezvous at {addr}: {message}")]
    Rendezvous { addr: String, message: String },
    /// A peer closed its connection or the connection broke.
    #[error("rank {peer} ({direction}) is gone: {source}")]
    PeerLost {
        peer: usize,
        direction: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// A peer sent nothing within the timeout.
    #[error("rank {peer} ({direction}) sent nothing for {seconds} s")]
    PeerTimeout {
        peer: usize,
        direction: &'static str,
        seconds: u64,
    },
    /// An operation on the GPU did not finish within the timeout (a peer died or hangs).
    #[error("{operation} did not finish within {seconds} s: a peer is gone or stuck")]
    Stalled {
        operation: &'static str,
        seconds: u64,
    },
    /// The backend cannot run on this machine.
    #[error("{backend} is unavailable: {reason}")]
    Unavailable {
        backend: &'static str,
        reason: String,
    },
    /// The rendezvous key cannot be read, or is too short to be one.
    #[error("rendezvous key {path}: {message}")]
    Key { path: String, message: String },
    /// A CUDA or NCCL call failed.
    #[error("GPU: {message}")]
    Device { message: String },
}

impl CollectiveError {
    /// Whether the error means a peer rank is gone or stuck (the gang is incomplete, and
    /// restarting it can succeed), as opposed to a backend that cannot work here.
    pub fn is_peer_lost(&self) -> bool {
        matches!(
            self,
            CollectiveError::Rendezvous { .. }
                | CollectiveError::PeerLost { .. }
                | CollectiveError::PeerTimeout { .. }
                | CollectiveError::Stalled { .. }
        )
    }
}

/// Data-parallel collectives over the ranks of a job.
pub trait Collective: Send {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// A short name for logs (`single`, `tcp-ring`, `nccl`).
    fn name(&self) -> &'static str;
    /// Combines `data` over all ranks, in place, on every rank.
    fn all_reduce(&mut self, data: &mut [f32], op: ReduceOp) -> Result<(), CollectiveError>;
    /// Copies `root`'s `data` to every rank.
    fn broadcast(&mut self, data: &mut [f32], root: usize) -> Result<(), CollectiveError>;
    /// Returns once every rank has called it.
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        let mut token = [0.0f32];
        self.all_reduce(&mut token, ReduceOp::Sum)
    }
    /// Seconds one summing all-reduce of `data` takes, the mean of `iterations` after
    /// `warmup` untimed ones and a barrier, on the memory the collective reduces where it
    /// lies (host memory here; NCCL times GPU memory, as nccl-tests does, not the copies to
    /// and from it). `data` holds the sums of the last all-reduce afterwards.
    fn time_all_reduce(
        &mut self,
        data: &mut [f32],
        warmup: usize,
        iterations: usize,
    ) -> Result<f64, CollectiveError> {
        for _ in 0..warmup {
            self.all_reduce(data, ReduceOp::Sum)?;
        }
        self.barrier()?;
        let start = std::time::Instant::now();
        for _ in 0..iterations {
            self.all_reduce(data, ReduceOp::Sum)?;
        }
        Ok(start.elapsed().as_secs_f64() / iterations.max(1) as f64)
    }
    /// Seconds one transfer of `count` f32s from the previous rank of the ring took to
    /// arrive here, the mean of `iterations` after `warmup` untimed ones and a barrier.
    /// Every rank sends to the next at the same time (point-to-point: the TCP ring's own
    /// link, NCCL's send and receive), so each link is loaded as a ring all-reduce loads
    /// it, and a slow link shows only in its receiver's time. What the preflight names the
    /// slowest pair of ranks by.
    fn time_from_previous(
        &mut self,
        count: usize,
        warmup: usize,
        iterations: usize,
    ) -> Result<f64, CollectiveError> {
        let _ = (count, warmup, iterations);
        Err(CollectiveError::Unavailable {
            backend: self.name(),
            reason: "it has no links between ranks to time".into(),
        })
    }
    /// The same collective reducing GPU memory where it lies, when it can (NCCL).
    fn on_device(&mut self) -> Option<&mut dyn DeviceAllReduce> {
        None
    }
    /// What NCCL said of the fabric this rank uses (the network, the transports of the
    /// channels connected so far); `None` for the collectives without NCCL or when its
    /// account could not be read.
    fn fabric(&self) -> Option<fabric::FabricSeen> {
        None
    }
}

/// A collective that reduces GPU memory in place on a stream of its own, so the reduction
/// of one bucket of gradients overlaps the backward pass computing the next (as PyTorch's
/// DDP does).
pub trait DeviceAllReduce {
    /// Queues an in-place all-reduce of the `len` f32s at device address `ptr`, to start
    /// once the work queued on stream `after` so far has run; returns at once.
    fn queue_all_reduce(
        &mut self,
        ptr: u64,
        len: usize,
        op: ReduceOp,
        after: &cudarc::driver::CudaStream,
    ) -> Result<(), CollectiveError>;
    /// Returns once every queued all-reduce has finished, or fails within the collective's
    /// timeout when a peer is gone or stuck.
    fn join(&mut self) -> Result<(), CollectiveError>;
    /// When each all-reduce joined last was ready, started and ended, in order (see
    /// [`overlap::timing`]); empty where the collective does not time them.
    fn last_buckets(&self) -> Vec<overlap::BucketTimes> {
        Vec::new()
    }
}

/// Which collective a process uses (part of the operator ↔ trainer contract).
pub use ringmaster_contract::trainer::CollectiveKind;

/// Connects this process to the job's collective: the identity for a single rank, else the
/// kind asked for.
pub fn connect(
    world: &World,
    kind: CollectiveKind,
    config: RingConfig,
) -> Result<Box<dyn Collective>, CollectiveError> {
    if world.size == 1 {
        return Ok(Box::new(SingleRank));
    }
    let nccl = match kind {
        CollectiveKind::TcpRing => false,
        CollectiveKind::Nccl => true,
        CollectiveKind::Auto => NcclProbe::detect().available(),
    };
    if nccl {
        Ok(Box::new(NcclCollective::connect(world, config)?))
    } else {
        Ok(Box::new(TcpRing::connect(world, config)?))
    }
}

/// Splits `len` elements into `parts` contiguous ranges whose lengths differ by at most one
/// (some are empty when `len < parts`).
pub fn segments(len: usize, parts: usize) -> Vec<std::ops::Range<usize>> {
    let base = len / parts;
    let extra = len % parts;
    let mut start = 0;
    (0..parts)
        .map(|i| {
            let size = base + usize::from(i < extra);
            let range = start..start + size;
            start += size;
            range
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_cover_everything_once() {
        for (len, parts) in [(10, 3), (1, 4), (0, 2), (7, 7), (1_000_003, 8)] {
            let s = segments(len, parts);
            assert_eq!(s.len(), parts);
            assert_eq!(s.first().unwrap().start, 0);
            assert_eq!(s.last().unwrap().end, len);
            assert!(s.windows(2).all(|w| w[0].end == w[1].start));
            let sizes: Vec<usize> = s.iter().map(|r| r.len()).collect();
            assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
        }
    }
}
