//! Fully connected layer.

use std::ops::Range;

use rand::Rng;

use super::conv::gemm;
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
    pub fn forward(&mut self, params: &mut ParamStore, input: &Tensor, train: bool) -> Tensor {
        let (n, i) = input.dims2();
        assert_eq!(i, self.in_features, "linear input features");
        let o = self.out_features;
        let bias = &params.values[self.bias.clone()];
        let mut out = Tensor::zeros(&[n, o]);
        for row in out.data.chunks_mut(o) {
            row.copy_from_slice(bias);
        }
        let weight = &params.values[self.weight.clone()];
        gemm(
            n,
            i,
            o,
            &input.data,
            (i, 1),
            weight,
            (1, i),
            1.0,
            &mut out.data,
            o,
        );
        self.input = train.then(|| input.clone());
        out
    }

    /// Back-propagates through the last training forward pass.
    pub fn backward(&mut self, params: &mut ParamStore, grad_output: &Tensor) -> Tensor {
        let input = self
            .input
            .take()
            .expect("linear backward without a training forward");
        let (n, i) = input.dims2();
        let o = self.out_features;
        assert_eq!(grad_output.shape, [n, o]);
        let dy = &grad_output.data;
        // dW[o, i] += dy^T[o, n] * x[n, i]
        gemm(
            o,
            n,
            i,
            dy,
            (1, o),
            &input.data,
            (i, 1),
            1.0,
            &mut params.grads[self.weight.clone()],
            i,
        );
        let db = &mut params.grads[self.bias.clone()];
        for row in dy.chunks(o) {
            db.iter_mut().zip(row).for_each(|(d, g)| *d += g);
        }
        let weight = &params.values[self.weight.clone()];
        let mut grad_input = Tensor::zeros(&[n, i]);
        // dx[n, i] = dy[n, o] * W[o, i]
        gemm(
            n,
            o,
            i,
            dy,
            (o, 1),
            weight,
            (i, 1),
            0.0,
            &mut grad_input.data,
            i,
        );
        grad_input
    }
}
