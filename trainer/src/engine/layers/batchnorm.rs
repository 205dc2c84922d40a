//! Batch normalisation over the channels of an NCHW tensor.

use std::ops::Range;

use crate::engine::backend::{Backend, BatchNormConfig, CpuBackend};
use crate::engine::params::ParamStore;
use crate::engine::tensor::Tensor;

/// PyTorch's defaults: running-statistics momentum 0.1, epsilon 1e-5.
const CONFIG: BatchNormConfig = BatchNormConfig {
    momentum: 0.1,
    eps: 1e-5,
};

/// `BatchNorm2d` with learnable scale (`weight`, gamma) and shift (`bias`, beta).
///
/// Training uses the batch's statistics and updates the running mean and (unbiased)
/// variance buffers, which evaluation then uses, as PyTorch does.
#[derive(Debug, Clone)]
pub struct BatchNorm2d<B: Backend = CpuBackend> {
    /// Gamma's range in the parameter values.
    pub gamma: Range<usize>,
    /// Beta's range in the parameter values.
    pub beta: Range<usize>,
    /// Running mean's range in the store's buffers.
    pub running_mean: Range<usize>,
    /// Running variance's range in the store's buffers.
    pub running_var: Range<usize>,
    /// Number of channels.
    pub channels: usize,
    /// Input shape and the statistics backward needs.
    cache: Option<(Vec<usize>, B::BnSaved)>,
}

impl<B: Backend> BatchNorm2d<B> {
    /// Registers `{name}.weight` = 1, `{name}.bias` = 0 and the running buffers
    /// `{name}.running_mean` = 0, `{name}.running_var` = 1.
    pub fn new(store: &mut ParamStore, name: &str, channels: usize) -> Self {
        let gamma = store.add(&format!("{name}.weight"), &[channels], vec![1.0; channels]);
        let beta = store.add(&format!("{name}.bias"), &[channels], vec![0.0; channels]);
        let running_mean = store.add_buffer(
            &format!("{name}.running_mean"),
            &[channels],
            vec![0.0; channels],
        );
        let running_var = store.add_buffer(
            &format!("{name}.running_var"),
            &[channels],
            vec![1.0; channels],
        );
        Self {
            gamma,
            beta,
            running_mean,
            running_var,
            channels,
            cache: None,
        }
    }

    /// Normalises with batch statistics when `train`, running statistics otherwise.
    pub fn forward(
        &mut self,
        be: &B,
        params: &mut ParamStore<B>,
        input: &Tensor<B>,
        train: bool,
    ) -> Tensor<B> {
        let (n, c, h, w) = input.dims4();
        assert_eq!(c, self.channels, "batch-norm channels");
        let dims = (n, c, h * w);
        let mut out = Tensor::alloc(be, &input.shape, input.dtype);
        let ParamStore {
            values, buffers, ..
        } = params;
        let gamma = be.view(values, self.gamma.clone());
        let beta = be.view(values, self.beta.clone());
        if train {
            let (mean, var) =
                be.view_mut_pair(buffers, self.running_mean.clone(), self.running_var.clone());
            let saved = be.batch_norm_forward_training(
                dims,
                CONFIG,
                input.view(be),
                gamma,
                beta,
                mean,
                var,
                out.view_mut(be),
            );
            self.cache = Some((input.shape.clone(), saved));
        } else {
            be.batch_norm_forward_inference(
                dims,
                CONFIG,
                input.view(be),
                gamma,
                beta,
                be.view(buffers, self.running_mean.clone()),
                be.view(buffers, self.running_var.clone()),
                out.view_mut(be),
            );
            self.cache = None;
        }
        out
    }

    /// Back-propagates through the last training forward pass, including the
    /// dependence of the batch statistics on every input.
    pub fn backward(
        &mut self,
        be: &B,
        params: &mut ParamStore<B>,
        grad_output: &Tensor<B>,
    ) -> Tensor<B> {
        let (shape, saved) = self
            .cache
            .take()
            .expect("batch-norm backward without a training forward");
        assert_eq!(grad_output.shape, shape);
        let (n, c, h, w) = grad_output.dims4();
        let mut grad_input = Tensor::alloc(be, &shape, grad_output.dtype);
        let ParamStore { values, grads, .. } = params;
        // gamma and beta were registered one after the other.
        let (dgamma, dbeta) = be.view_mut_pair(grads, self.gamma.clone(), self.beta.clone());
        be.batch_norm_backward(
            (n, c, h * w),
            CONFIG,
            &saved,
            be.view(values, self.gamma.clone()),
            grad_output.view(be),
            grad_input.view_mut(be),
            dgamma,
            dbeta,
        );
        grad_input
    }
}
