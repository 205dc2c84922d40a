//! The CPU training engine: tensors, layers with explicit forward and backward passes,
//! ResNets, SGD, data sources and checkpoints.
//!
//! There is no autograd: every layer caches what its backward pass needs during a
//! training forward pass, and gradients are accumulated into one flat
//! [`params::ParamStore`] so that data-parallel all-reduce works on a single buffer.

pub mod backend;
pub mod buckets;
pub mod checkpoint;
pub mod data;
pub mod image_folder;
pub mod layers;
pub mod model;
pub mod optim;
pub mod params;
pub mod step;
pub mod tensor;

pub use backend::{Backend, CpuBackend};
pub use model::{Arch, Model, QueuedStats, StepStats};
pub use optim::{LrKind, LrSchedule, Sgd};
pub use params::{ParamEntry, ParamStore};
pub use tensor::Tensor;
