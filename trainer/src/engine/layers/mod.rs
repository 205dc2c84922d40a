//! Layers with explicit forward and backward passes.
//!
//! Every layer follows the same contract: `forward(params, input, train)` computes the
//! output and, when `train` is set, caches what `backward` needs; `backward(params,
//! grad_output)` returns the gradient with respect to the input and *adds* the
//! parameter gradients into `params.grads` (never overwrites them, so micro-batches can
//! be accumulated). Shape mismatches are programming errors and panic.

mod activation;
mod batchnorm;
mod block;
mod conv;
mod linear;
mod loss;
mod pool;

pub use activation::Relu;
pub use batchnorm::BatchNorm2d;
pub use block::ResidualBlock;
pub use conv::Conv2d;
pub use linear::Linear;
pub use loss::{LossOutput, softmax_cross_entropy};
pub use pool::{GlobalAvgPool, MaxPool2d};
