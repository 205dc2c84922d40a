//! 2-D convolution without bias; the backend does the arithmetic.

use std::ops::Range;

use rand::Rng;

use crate::engine::backend::{Backend, ConvShape, CpuBackend};
use crate::engine::params::ParamStore;
use crate::engine::tensor::{Tensor, fill_normal_seeded};

/// A bias-free 2-D convolution (ResNets follow every conv with batch norm, which
/// makes a bias redundant). Weight layout is `[out, in, k, k]`.
#[derive(Debug, Clone)]
pub struct Conv2d<B: Backend = CpuBackend> {
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
    /// The input and the backend's saved state, from a training forward pass.
    cache: Option<(Tensor<B>, B::ConvSaved)>,
}

impl<B: Backend> Conv2d<B> {
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
            cache: None,
        }
    }

    /// Output height and width for an input of `h` x `w`.
    pub fn output_size(&self, h: usize, w: usize) -> (usize, usize) {
        let o = |x: usize| (x + 2 * self.padding - self.kernel) / self.stride + 1;
        (o(h), o(w))
    }

    fn shape(&self, input: &Tensor<B>) -> ConvShape {
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
        be: &B,
        params: &mut ParamStore<B>,
        input: &Tensor<B>,
        train: bool,
    ) -> Tensor<B> {
        let shape = self.shape(input);
        let (oh, ow) = shape.output_size();
        let mut out = Tensor::alloc(be, &[shape.n, self.out_channels, oh, ow], input.dtype);
        let weight = be.view(&params.values, self.weight.clone());
        let saved = be.conv2d_forward(&shape, input.view(be), weight, out.view_mut(be));
        self.cache = train.then(|| (input.clone(), saved));
        out
    }

    /// Back-propagates through the last training forward pass: accumulates the weight's
    /// gradient and returns the input's.
    pub fn backward(
        &mut self,
        be: &B,
        params: &mut ParamStore<B>,
        grad_output: &Tensor<B>,
    ) -> Tensor<B> {
        let (input, saved) = self.take_cache(grad_output);
        let mut grad_input = Tensor::alloc(be, &input.shape, input.dtype);
        self.backward_into(
            be,
            params,
            grad_output,
            &input,
            &saved,
            Some(&mut grad_input),
        );
        grad_input
    }

    /// [`Conv2d::backward`] for a layer whose input needs no gradient (the first layer's,
    /// the image): only the weight's gradient is computed.
    pub fn backward_weight(&mut self, be: &B, params: &mut ParamStore<B>, grad_output: &Tensor<B>) {
        let (input, saved) = self.take_cache(grad_output);
        self.backward_into(be, params, grad_output, &input, &saved, None);
    }

    fn take_cache(&mut self, grad_output: &Tensor<B>) -> (Tensor<B>, B::ConvSaved) {
        let (input, saved) = self
            .cache
            .take()
            .expect("conv backward without a training forward");
        let shape = self.shape(&input);
        let (oh, ow) = shape.output_size();
        assert_eq!(grad_output.shape, [shape.n, self.out_channels, oh, ow]);
        (input, saved)
    }

    fn backward_into(
        &self,
        be: &B,
        params: &mut ParamStore<B>,
        grad_output: &Tensor<B>,
        input: &Tensor<B>,
        saved: &B::ConvSaved,
        grad_input: Option<&mut Tensor<B>>,
    ) {
        let ParamStore { values, grads, .. } = params;
        be.conv2d_backward(
            &self.shape(input),
            saved,
            input.view(be),
            be.view(values, self.weight.clone()),
            grad_output.view(be),
            grad_input.map(|g| g.view_mut(be)),
            be.view_mut(grads, self.weight.clone()),
        );
    }
}
