//! Rectified linear unit.

use crate::engine::params::ParamStore;
use crate::engine::tensor::Tensor;

/// `max(x, 0)`; caches which outputs were positive.
#[derive(Debug, Clone, Default)]
pub struct Relu {
    mask: Option<(Vec<usize>, Vec<bool>)>,
}

impl Relu {
    /// A ReLU with no cached state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies the ReLU.
    pub fn forward(&mut self, _params: &mut ParamStore, input: &Tensor, train: bool) -> Tensor {
        let out = Tensor {
            shape: input.shape.clone(),
            data: input.data.iter().map(|&x| x.max(0.0)).collect(),
        };
        self.mask = train.then(|| {
            (
                input.shape.clone(),
                input.data.iter().map(|&x| x > 0.0).collect(),
            )
        });
        out
    }

    /// Passes the gradient where the input was positive.
    pub fn backward(&mut self, _params: &mut ParamStore, grad_output: &Tensor) -> Tensor {
        let (shape, mask) = self
            .mask
            .take()
            .expect("relu backward without a training forward");
        assert_eq!(shape, grad_output.shape);
        Tensor {
            shape,
            data: grad_output
                .data
                .iter()
                .zip(&mask)
                .map(|(&g, &m)| if m { g } else { 0.0 })
                .collect(),
        }
    }
}
