//! Fully connected layer.

use std::ops::Range;

use rand::Rng;

use crate::engine::backend::{Backend, CpuBackend, Matrix};
use crate::engine::params::ParamStore;
use crate::engine::tensor::{DType, Tensor, fill_uniform_seeded};

/// `y = x W^T + b` with `W` of shape `[out, in]`, as `torch.nn.Linear`.
#[derive(Debug, Clone)]
pub struct Linear<B: Backend = CpuBackend> {
    /// Weight's range in the parameter store.
    pub weight: Range<usize>,
    /// Bias's range in the parameter store.
    pub bias: Range<usize>,
    /// Input features.
    pub in_features: usize,
    /// Output features.
    pub out_features: usize,
    input: Option<Tensor<B>>,
}

impl<B: Backend> Linear<B> {
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

    /// Applies the layer to `[N, in]` (f32).
    pub fn forward(
        &mut self,
        be: &B,
        params: &mut ParamStore<B>,
        input: &Tensor<B>,
        train: bool,
    ) -> Tensor<B> {
        let (n, i) = input.dims2();
        assert_eq!(i, self.in_features, "linear input features");
        let o = self.out_features;
        let mut out = Tensor::alloc(be, &[n, o], DType::F32);
        be.broadcast_rows(be.view(&params.values, self.bias.clone()), out.view_mut(be));
        // y[n, o] = x[n, i] * W^T[i, o] + y
        let weight = be.view(&params.values, self.weight.clone());
        let (x, w_t) = (
            Matrix::rows(input.view(be), i),
            Matrix::transposed(weight, i),
        );
        be.gemm(n, i, o, x, w_t, 1.0, out.view_mut(be));
        self.input = train.then(|| input.clone());
        out
    }

    /// Back-propagates through the last training forward pass.
    pub fn backward(
        &mut self,
        be: &B,
        params: &mut ParamStore<B>,
        grad_output: &Tensor<B>,
    ) -> Tensor<B> {
        let input = self
            .input
            .take()
            .expect("linear backward without a training forward");
        let (n, i) = input.dims2();
        let o = self.out_features;
        assert_eq!(grad_output.shape, [n, o]);
        let dy = grad_output.view(be);
        let ParamStore { values, grads, .. } = params;
        // dW[o, i] += dy^T[o, n] * x[n, i]
        let (dy_t, x) = (Matrix::transposed(dy, o), Matrix::rows(input.view(be), i));
        be.gemm(
            o,
            n,
            i,
            dy_t,
            x,
            1.0,
            be.view_mut(grads, self.weight.clone()),
        );
        be.sum_rows(dy, be.view_mut(grads, self.bias.clone()));
        let mut grad_input = Tensor::alloc(be, &[n, i], DType::F32);
        // dx[n, i] = dy[n, o] * W[o, i]
        let weight = Matrix::rows(be.view(values, self.weight.clone()), i);
        be.gemm(
            n,
            o,
            i,
            Matrix::rows(dy, o),
            weight,
            0.0,
            grad_input.view_mut(be),
        );
        grad_input
    }
}
