//! 2-D convolution without bias; the backend does the arithmetic.

use std::ops::Range;

use rand::Rng;

use crate::engine::backend::{Backend, ConvShape};
use crate::engine::params::ParamStore;
use crate::engine::tensor::{Tensor, fill_normal_seeded};

/// A bias-free 2-D convolution (ResNets follow every conv with batch norm, which
/// makes a bias redundant). Weight layout is `[out, in, k, k]`.
#[derive(Debug, Clone)]
pub struct Conv2d {
    /// The weight's range in the parameter store.
    pub weight: Range<usize>,
    /// Input channels.
    pub in_channels: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Square kernel size.
    pub kernel: usize,
    /// Stride in both directions.
    pub stride: usize,
    /// Zero padding on every side.
    pub padding: usize,
    input: Option<Tensor>,
}

impl Conv2d {
    /// Registers `{name}.weight`, Kaiming-normal initialised (fan-out, ReLU gain) as
    /// torchvision's ResNets do.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        store: &mut ParamStore,
        name: &str,
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        rng: &mut impl Rng,
    ) -> Self {
        let shape = [out_channels, in_channels, kernel, kernel];
        let mut init = vec![0.0; shape.iter().product()];
        let fan_out = (out_channels * kernel * kernel) as f32;
        fill_normal_seeded(&mut init, (2.0 / fan_out).sqrt(), rng.random());
        let weight = store.add(&format!("{name}.weight"), &shape, init);
        Self {
            weight,
            in_channels,
            out_channels,
            kernel,
            stride,
            padding,
            input: None,
        }
    }

    /// Output height and width for an input of `h` x `w`.
    pub fn output_size(&self, h: usize, w: usize) -> (usize, usize) {
        let o = |x: usize| (x + 2 * self.padding - self.kernel) / self.stride + 1;
        (o(h), o(w))
    }

    fn shape(&self, input: &Tensor) -> ConvShape {
        let (n, c, h, w) = input.dims4();
        assert_eq!(c, self.in_channels, "conv input channels");
        ConvShape {
            n,
            c,
            h,
            w,
            out_channels: self.out_channels,
            kernel: self.kernel,
            stride: self.stride,
            padding: self.padding,
        }
    }

    /// Convolves an NCHW batch.
    pub fn forward(
        &mut self,
        be: &dyn Backend,
        params: &mut ParamStore,
        input: &Tensor,
        train: bool,
    ) -> Tensor {
        let shape = self.shape(input);
        let (oh, ow) = shape.output_size();
        let mut out = Tensor::zeros(&[shape.n, self.out_channels, oh, ow]);
        let weight = &params.values[self.weight.clone()];
        be.conv2d_forward(&shape, &input.data, weight, &mut out.data);
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
            .expect("conv backward without a training forward");
        let shape = self.shape(&input);
        let (oh, ow) = shape.output_size();
        assert_eq!(grad_output.shape, [shape.n, self.out_channels, oh, ow]);
        let mut grad_input = Tensor::zeros(&input.shape);
        let (values, grads) = params.values_and_grads(self.weight.clone());
        be.conv2d_backward(
            &shape,
            &input.data,
            values,
            &grad_output.data,
            &mut grad_input.data,
            grads,
        );
        grad_input
    }
}
