//! Fully connected layer.

use std::ops::Range;

use rand::Rng;

use crate::engine::backend::{Backend, Matrix};
use crate::engine::params::ParamStore;
use crate::engine::tensor::{Tensor, fill_uniform_seeded};

/// `y = x W^T + b` with `W` of shape `[out, in]`, as `torch.nn.Linear`.
#[derive(Debug, Clone)]
pub struct Linear {
    /// Weight's range in the parameter store.
    pub weight: Range<usize>,
    /// Bias's range in the parameter store.
    pub bias: Range<usize>,
    /// Input features.
    pub in_features: usize,
    /// Output features.
    pub out_features: usize,
    input: Option<Tensor>,
}

impl Linear {
    /// Registers `{name}.weight` and `{name}.bias`, both uniform in
    /// `±1/sqrt(in_features)` — what PyTorch's default initialisation amounts to.
    pub fn new(
        store: &mut ParamStore,
        name: &str,
        in_features: usize,
        out_features: usize,
        rng: &mut impl Rng,
    ) -> Self {
        let bound = 1.0 / (in_features as f32).sqrt();
        let mut w = vec![0.0; in_features * out_features];
        fill_uniform_seeded(&mut w, bound, rng.random());
        let mut b = vec![0.0; out_features];
        fill_uniform_seeded(&mut b, bound, rng.random());
        let weight = store.add(&format!("{name}.weight"), &[out_features, in_features], w);
        let bias = store.add(&format!("{name}.bias"), &[out_features], b);
        Self {
            weight,
            bias,
            in_features,
            out_features,
            input: None,
        }
    }

    /// Applies the layer to `[N, in]`.
    pub fn forward(
        &mut self,
        be: &dyn Backend,
        params: &mut ParamStore,
        input: &Tensor,
        train: bool,
    ) -> Tensor {
        let (n, i) = input.dims2();
        assert_eq!(i, self.in_features, "linear input features");
        let o = self.out_features;
        let mut out = Tensor::zeros(&[n, o]);
        be.broadcast_rows(&params.values[self.bias.clone()], &mut out.data);
        // y[n, o] = x[n, i] * W^T[i, o] + y
        let weight = &params.values[self.weight.clone()];
        let (x, w_t) = (Matrix::rows(&input.data, i), Matrix::transposed(weight, i));
        be.gemm(n, i, o, x, w_t, 1.0, &mut out.data);
        self.input = train.then(|| input.clone());
        out
    }

    /// Back-propagates through the last training forward pass.
    pub fn backward(
        &mut self,
        be: &dyn Backend,
        params: &mut ParamStore,
        grad_output: &Tensor,
    ) -> Tensor {
        let input = self
            .input
            .take()
            .expect("linear backward without a training forward");
        let (n, i) = input.dims2();
        let o = self.out_features;
        assert_eq!(grad_output.shape, [n, o]);
        let dy = &grad_output.data;
        // dW[o, i] += dy^T[o, n] * x[n, i]
        let (dy_t, x) = (Matrix::transposed(dy, o), Matrix::rows(&input.data, i));
        be.gemm(
            o,
            n,
            i,
            dy_t,
            x,
            1.0,
            &mut params.grads[self.weight.clone()],
        );
        be.sum_rows(dy, &mut params.grads[self.bias.clone()]);
        let mut grad_input = Tensor::zeros(&[n, i]);
        // dx[n, i] = dy[n, o] * W[o, i]
        let weight = Matrix::rows(&params.values[self.weight.clone()], i);
        be.gemm(
            n,
            o,
            i,
            Matrix::rows(dy, o),
            weight,
            0.0,
            &mut grad_input.data,
        );
        grad_input
    }
}
