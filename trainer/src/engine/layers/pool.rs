//! Max pooling (the ImageNet stem) and global average pooling (before the classifier).

use crate::engine::backend::{Backend, PoolShape};
use crate::engine::params::ParamStore;
use crate::engine::tensor::Tensor;

/// Square max pooling; padding never wins (it counts as negative infinity).
#[derive(Debug, Clone)]
pub struct MaxPool2d {
    /// Window size.
    pub kernel: usize,
    /// Stride.
    pub stride: usize,
    /// Implicit padding on every side.
    pub padding: usize,
    /// Input shape and, per output element, the index of the winning input in its plane.
    cache: Option<(Vec<usize>, Vec<u32>)>,
}

impl MaxPool2d {
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
        be: &dyn Backend,
        _params: &mut ParamStore,
        input: &Tensor,
        train: bool,
    ) -> Tensor {
        let (n, c, h, w) = input.dims4();
        let shape = self.shape(n, c, h, w);
        let (oh, ow) = shape.output_size();
        let mut out = Tensor::zeros(&[n, c, oh, ow]);
        let mut argmax = vec![0u32; out.len()];
        be.max_pool_forward(&shape, &input.data, &mut out.data, &mut argmax);
        self.cache = train.then(|| (input.shape.clone(), argmax));
        out
    }

    /// Routes each output gradient to the input that won the max.
    pub fn backward(
        &mut self,
        be: &dyn Backend,
        _params: &mut ParamStore,
        grad_output: &Tensor,
    ) -> Tensor {
        let (input_shape, argmax) = self
            .cache
            .take()
            .expect("max-pool backward without a training forward");
        let shape = self.shape(
            input_shape[0],
            input_shape[1],
            input_shape[2],
            input_shape[3],
        );
        let mut grad_input = Tensor::zeros(&input_shape);
        be.max_pool_backward(&shape, &argmax, &grad_output.data, &mut grad_input.data);
        grad_input
    }
}

/// Averages each channel over all positions: `[N, C, H, W]` to `[N, C]`, for any input
/// size (torchvision's adaptive average pool to 1x1).
#[derive(Debug, Clone, Default)]
pub struct GlobalAvgPool {
    input_shape: Option<Vec<usize>>,
}

impl GlobalAvgPool {
    /// A pool with no cached state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Averages every plane.
    pub fn forward(
        &mut self,
        be: &dyn Backend,
        _params: &mut ParamStore,
        input: &Tensor,
        train: bool,
    ) -> Tensor {
        let (n, c, h, w) = input.dims4();
        let mut out = Tensor::zeros(&[n, c]);
        be.global_avg_pool_forward(h * w, &input.data, &mut out.data);
        self.input_shape = train.then(|| input.shape.clone());
        out
    }

    /// Spreads each gradient evenly over its plane.
    pub fn backward(
        &mut self,
        be: &dyn Backend,
        _params: &mut ParamStore,
        grad_output: &Tensor,
    ) -> Tensor {
        let shape = self
            .input_shape
            .take()
            .expect("average-pool backward without a training forward");
        let mut grad_input = Tensor::zeros(&shape);
        be.global_avg_pool_backward(shape[2] * shape[3], &grad_output.data, &mut grad_input.data);
        grad_input
    }
}
