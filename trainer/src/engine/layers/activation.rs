//! Rectified linear unit.

use crate::engine::backend::{Backend, CpuBackend};
use crate::engine::params::ParamStore;
use crate::engine::tensor::Tensor;

/// `max(x, 0)`; caches its output, whose sign is all backward needs.
#[derive(Debug, Clone)]
pub struct Relu<B: Backend = CpuBackend> {
    output: Option<Tensor<B>>,
}

impl<B: Backend> Default for Relu<B> {
    fn default() -> Self {
        Self { output: None }
    }
}

impl<B: Backend> Relu<B> {
    /// A ReLU with no cached state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies the ReLU.
    pub fn forward(
        &mut self,
        be: &B,
        _params: &mut ParamStore<B>,
        input: &Tensor<B>,
        train: bool,
    ) -> Tensor<B> {
        let mut out = Tensor::alloc(be, &input.shape, input.dtype);
        be.relu_forward(input.view(be), out.view_mut(be));
        self.output = train.then(|| out.clone());
        out
    }

    /// Passes the gradient where the output was positive.
    pub fn backward(
        &mut self,
        be: &B,
        _params: &mut ParamStore<B>,
        grad_output: &Tensor<B>,
    ) -> Tensor<B> {
        let output = self
            .output
            .take()
            .expect("relu backward without a training forward");
        assert_eq!(grad_output.shape, output.shape);
        let mut grad_input = Tensor::alloc(be, &output.shape, grad_output.dtype);
        be.relu_backward(
            output.view(be),
            grad_output.view(be),
            grad_input.view_mut(be),
        );
        grad_input
    }
}
