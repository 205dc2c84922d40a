//! Rectified linear unit.

use crate::engine::backend::Backend;
use crate::engine::params::ParamStore;
use crate::engine::tensor::Tensor;

/// `max(x, 0)`; caches its output, whose sign is all backward needs.
#[derive(Debug, Clone, Default)]
pub struct Relu {
    output: Option<Tensor>,
}

impl Relu {
    /// A ReLU with no cached state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies the ReLU.
    pub fn forward(
        &mut self,
        be: &dyn Backend,
        _params: &mut ParamStore,
        input: &Tensor,
        train: bool,
    ) -> Tensor {
        let mut out = Tensor::zeros(&input.shape);
        be.relu_forward(&input.data, &mut out.data);
        self.output = train.then(|| out.clone());
        out
    }

    /// Passes the gradient where the input was positive.
    pub fn backward(
        &mut self,
        be: &dyn Backend,
        _params: &mut ParamStore,
        grad_output: &Tensor,
    ) -> Tensor {
        let output = self
            .output
            .take()
            .expect("relu backward without a training forward");
        assert_eq!(output.shape, grad_output.shape);
        let mut grad_input = Tensor::zeros(&output.shape);
        be.relu_backward(&output.data, &grad_output.data, &mut grad_input.data);
        grad_input
    }
}
