//! Batch normalisation over the channels of an NCHW tensor, with the ReLU (and residual
//! add) that follows it in a ResNet fused into the same backend call.

use std::ops::Range;

use crate::engine::backend::{Backend, BatchNormConfig, BnEpilogue, BnEpilogueGrad, CpuBackend};
use crate::engine::params::ParamStore;
use crate::engine::tensor::Tensor;

/// PyTorch's defaults: running-statistics momentum 0.1, epsilon 1e-5.
const CONFIG: BatchNormConfig = BatchNormConfig {
    momentum: 0.1,
    eps: 1e-5,
};

/// `BatchNorm2d` with learnable scale (`weight`, gamma) and shift (`bias`, beta), and
/// optionally the ReLU after it ([`BatchNorm2d::with_relu`]), with or without a residual
/// added before that ReLU ([`BatchNorm2d::forward_add_relu`]).
///
/// Training uses the batch's statistics and updates the running mean and (unbiased)
/// variance buffers, which evaluation then uses, as PyTorch does. Fusing the ReLU and the
/// add changes no value: it saves a pass over memory and the ReLU's own copy of its output.
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
    /// Whether a ReLU follows.
    relu: bool,
    /// What the last training forward pass left for backward.
    cache: Option<BnCache<B>>,
}

/// What backward needs from a training forward pass.
#[derive(Debug, Clone)]
struct BnCache<B: Backend> {
    shape: Vec<usize>,
    saved: B::BnSaved,
    /// The output, when a ReLU ended the pass.
    output: Option<Tensor<B>>,
    /// Whether a residual was added.
    residual: bool,
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
            relu: false,
            cache: None,
        }
    }

    /// The same batch norm followed by a ReLU: `max(bn(x), 0)`, or `max(bn(x) + z, 0)`
    /// through [`BatchNorm2d::forward_add_relu`].
    pub fn with_relu(mut self) -> Self {
        self.relu = true;
        self
    }

    /// Normalises with batch statistics when `train`, running statistics otherwise (then
    /// the ReLU, if this batch norm has one).
    pub fn forward(
        &mut self,
        be: &B,
        params: &mut ParamStore<B>,
        input: &Tensor<B>,
        train: bool,
    ) -> Tensor<B> {
        self.run(be, params, input, None, train)
    }

    /// `max(bn(x) + residual, 0)`: the end of a residual block. Needs [`Self::with_relu`].
    pub fn forward_add_relu(
        &mut self,
        be: &B,
        params: &mut ParamStore<B>,
        input: &Tensor<B>,
        residual: &Tensor<B>,
        train: bool,
    ) -> Tensor<B> {
        assert!(self.relu, "a residual is added only before a ReLU");
        assert_eq!(residual.shape, input.shape, "residual shapes differ");
        self.run(be, params, input, Some(residual), train)
    }

    fn run(
        &mut self,
        be: &B,
        params: &mut ParamStore<B>,
        input: &Tensor<B>,
        residual: Option<&Tensor<B>>,
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
            let epilogue = match (residual, self.relu) {
                (Some(z), _) => BnEpilogue::AddRelu(z.view(be)),
                (None, true) => BnEpilogue::Relu,
                (None, false) => BnEpilogue::Identity,
            };
            let saved = be.batch_norm_forward_training(
                dims,
                CONFIG,
                input.view(be),
                gamma,
                beta,
                mean,
                var,
                epilogue,
                out.view_mut(be),
            );
            self.cache = Some(BnCache {
                shape: input.shape.clone(),
                saved,
                output: self.relu.then(|| out.clone()),
                residual: residual.is_some(),
            });
            return out;
        }
        // cuDNN fuses nothing into inference: the add and the ReLU are their own passes.
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
        if let Some(z) = residual {
            be.add_assign(out.view_mut(be), z.view(be));
        }
        if !self.relu {
            return out;
        }
        let mut activated = Tensor::alloc(be, &out.shape, out.dtype);
        be.relu_forward(out.view(be), activated.view_mut(be));
        activated
    }

    /// Back-propagates through the last training forward pass (its ReLU included), down
    /// to the dependence of the batch statistics on every input.
    pub fn backward(
        &mut self,
        be: &B,
        params: &mut ParamStore<B>,
        grad_output: &Tensor<B>,
    ) -> Tensor<B> {
        let (grad_input, grad_residual) = self.run_backward(be, params, grad_output, false);
        debug_assert!(grad_residual.is_none());
        grad_input
    }

    /// Backward of [`Self::forward_add_relu`]: the gradients of the input and of the
    /// residual.
    pub fn backward_add_relu(
        &mut self,
        be: &B,
        params: &mut ParamStore<B>,
        grad_output: &Tensor<B>,
    ) -> (Tensor<B>, Tensor<B>) {
        let (grad_input, grad_residual) = self.run_backward(be, params, grad_output, true);
        (
            grad_input,
            grad_residual.expect("a residual gradient from an add-ReLU batch norm"),
        )
    }

    fn run_backward(
        &mut self,
        be: &B,
        params: &mut ParamStore<B>,
        grad_output: &Tensor<B>,
        residual: bool,
    ) -> (Tensor<B>, Option<Tensor<B>>) {
        let cache = self
            .cache
            .take()
            .expect("batch-norm backward without a training forward");
        assert_eq!(grad_output.shape, cache.shape);
        assert_eq!(
            cache.residual, residual,
            "batch-norm backward must match its forward (with or without a residual)"
        );
        let (n, c, h, w) = grad_output.dims4();
        let mut grad_input = Tensor::alloc(be, &cache.shape, grad_output.dtype);
        let mut grad_residual =
            residual.then(|| Tensor::alloc(be, &cache.shape, grad_output.dtype));
        let ParamStore { values, grads, .. } = params;
        // gamma and beta were registered one after the other.
        let (dgamma, dbeta) = be.view_mut_pair(grads, self.gamma.clone(), self.beta.clone());
        let epilogue = match (&cache.output, &mut grad_residual) {
            (None, _) => BnEpilogueGrad::Identity,
            (Some(y), None) => BnEpilogueGrad::Relu { y: y.view(be) },
            (Some(y), Some(dz)) => BnEpilogueGrad::AddRelu {
                y: y.view(be),
                dz: dz.view_mut(be),
            },
        };
        be.batch_norm_backward(
            (n, c, h * w),
            CONFIG,
            &cache.saved,
            be.view(values, self.gamma.clone()),
            be.view(values, self.beta.clone()),
            epilogue,
            grad_output.view(be),
            grad_input.view_mut(be),
            dgamma,
            dbeta,
        );
        (grad_input, grad_residual)
    }
}
