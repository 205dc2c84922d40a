//! Max pooling (the ImageNet stem) and global average pooling (before the classifier).

use crate::engine::backend::{Backend, CpuBackend, PoolShape};
use crate::engine::params::ParamStore;
use crate::engine::tensor::{DType, Tensor};

/// Square max pooling; padding never wins (it counts as negative infinity).
#[derive(Debug, Clone)]
pub struct MaxPool2d<B: Backend = CpuBackend> {
    /// Window size.
    pub kernel: usize,
    /// Stride.
    pub stride: usize,
    /// Implicit padding on every side.
    pub padding: usize,
    /// Input shape and, per output element, the index of the winning input in its plane.
    cache: Option<(Vec<usize>, DType, B::PoolSaved)>,
}

impl<B: Backend> MaxPool2d<B> {
    /// A `kernel` x `kernel` max pool.
    pub fn new(kernel: usize, stride: usize, padding: usize) -> Self {
        Self {
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

    fn shape(&self, n: usize, c: usize, h: usize, w: usize) -> PoolShape {
        PoolShape {
            planes: n * c,
            channels: c,
            h,
            w,
            kernel: self.kernel,
            stride: self.stride,
            padding: self.padding,
        }
    }

    /// Pools every plane.
    pub fn forward(
        &mut self,
        be: &B,
        _params: &mut ParamStore<B>,
        input: &Tensor<B>,
        train: bool,
    ) -> Tensor<B> {
        let (n, c, h, w) = input.dims4();
        let shape = self.shape(n, c, h, w);
        let (oh, ow) = shape.output_size();
        let mut out = Tensor::alloc(be, &[n, c, oh, ow], input.dtype);
        let saved = be.max_pool_forward(&shape, input.view(be), out.view_mut(be));
        self.cache = train.then(|| (input.shape.clone(), input.dtype, saved));
        out
    }

    /// Routes each output gradient to the input that won the max.
    pub fn backward(
        &mut self,
        be: &B,
        _params: &mut ParamStore<B>,
        grad_output: &Tensor<B>,
    ) -> Tensor<B> {
        let (input_shape, dtype, saved) = self
            .cache
            .take()
            .expect("max-pool backward without a training forward");
        let shape = self.shape(
            input_shape[0],
            input_shape[1],
            input_shape[2],
            input_shape[3],
        );
        let mut grad_input = Tensor::alloc(be, &input_shape, dtype);
        be.max_pool_backward(
            &shape,
            &saved,
            grad_output.view(be),
            grad_input.view_mut(be),
        );
        grad_input
    }
}

/// Averages each channel over all positions: `[N, C, H, W]` to `[N, C]`, for any input
/// size (torchvision's adaptive average pool to 1x1).
#[derive(Debug, Clone)]
pub struct GlobalAvgPool<B: Backend = CpuBackend> {
    /// The input's shape and type, from a training forward pass.
    input: Option<(Vec<usize>, DType)>,
    backend: std::marker::PhantomData<B>,
}

impl<B: Backend> Default for GlobalAvgPool<B> {
    fn default() -> Self {
        Self {
            input: None,
            backend: std::marker::PhantomData,
        }
    }
}

impl<B: Backend> GlobalAvgPool<B> {
    /// A pool with no cached state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Averages every plane.
    pub fn forward(
        &mut self,
        be: &B,
        _params: &mut ParamStore<B>,
        input: &Tensor<B>,
        train: bool,
    ) -> Tensor<B> {
        let (n, c, h, w) = input.dims4();
        // The classifier after the pool computes in f32 whatever the activations' type.
        let mut out = Tensor::alloc(be, &[n, c], DType::F32);
        be.global_avg_pool_forward((n, c, h * w), input.view(be), out.view_mut(be));
        self.input = train.then(|| (input.shape.clone(), input.dtype));
        out
    }

    /// Spreads each gradient evenly over its plane.
    pub fn backward(
        &mut self,
        be: &B,
        _params: &mut ParamStore<B>,
        grad_output: &Tensor<B>,
    ) -> Tensor<B> {
        let (shape, dtype) = self
            .input
            .take()
            .expect("average-pool backward without a training forward");
        let mut grad_input = Tensor::alloc(be, &shape, dtype);
        let dims = (shape[0], shape[1], shape[2] * shape[3]);
        be.global_avg_pool_backward(dims, grad_output.view(be), grad_input.view_mut(be));
        grad_input
    }
}
