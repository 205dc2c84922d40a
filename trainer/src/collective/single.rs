//! One rank: every collective is the identity.

use super::{Collective, CollectiveError, ReduceOp};

/// The collective of a job with one rank.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleRank;

impl Collective for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn name(&self) -> &'static str {
        "single"
    }
    fn all_reduce(&mut self, _data: &mut [f32], _op: ReduceOp) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn broadcast(&mut self, _data: &mut [f32], _root: usize) -> Result<(), CollectiveError> {
        Ok(())
    }
}
