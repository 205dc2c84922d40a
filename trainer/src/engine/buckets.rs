//! Which gradients to all-reduce while backward still runs: buckets of the flat gradient
//! buffer, launched as soon as every gradient in them is final, as PyTorch's DDP does.
//!
//! Parameters are registered in forward order, so backward finishes them from the end of
//! the buffer towards its start: after a layer's backward, every gradient from its first
//! parameter to the end is final.

use std::ops::Range;

/// DDP's default bucket: 25 MiB of f32 gradients. Smaller buckets start sooner and overlap
/// more of backward; each all-reduce also pays a fixed latency.
pub const BUCKET_ELEMENTS: usize = 25 * 1024 * 1024 / 4;

/// The buckets of one backward pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GradientBuckets {
    bucket: usize,
    /// Gradients from here to the end have been launched.
    launched_from: usize,
}

impl GradientBuckets {
    /// Buckets of at least `bucket` elements over a buffer of `len`.
    pub fn new(len: usize, bucket: usize) -> Self {
        assert!(bucket > 0, "a bucket holds at least one gradient");
        Self {
            bucket,
            launched_from: len,
        }
    }

    /// Backward has made every gradient from `final_from` on final: the range to launch now,
    /// if the ones not yet launched fill a bucket, or are the last (`final_from` is 0).
    pub fn ready(&mut self, final_from: usize) -> Option<Range<usize>> {
        assert!(
            final_from <= self.launched_from,
            "gradients became final out of order: {final_from} after {}",
            self.launched_from
        );
        let pending = final_from..self.launched_from;
        let launch = !pending.is_empty() && (pending.len() >= self.bucket || final_from == 0);
        launch.then(|| {
            self.launched_from = final_from;
            pending
        })
    }

    /// Whether every gradient has been launched.
    pub fn done(&self) -> bool {
        self.launched_from == 0
    }
}
