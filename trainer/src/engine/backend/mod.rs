//! The compute under the layers: every arithmetic kernel a layer needs, behind one trait.
//!
//! Layers keep their shapes, parameters' places and what backward needs; a [`Backend`] does
//! the arithmetic. The operations are the ones cuDNN and cuBLAS offer (convolution forward
//! and its two backward halves, batch-norm training/inference/backward, pooling, activation,
//! GEMM, tensor add), so a CUDA backend maps each to a library call or one NVRTC kernel.
//! [`CpuBackend`] is the reference: im2col + `matrixmultiply`'s SGEMM, rayon over all cores.
//!
//! Buffers are host slices today. The CUDA engine (a later issue) will give the trait an
//! associated buffer type; the shapes and the contract (what is overwritten, what is
//! accumulated) stay as written here.

mod cpu;

pub use cpu::CpuBackend;

/// Shapes of a 2-D convolution over an NCHW batch with a `[out, in, k, k]` weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvShape {
    /// Images.
    pub n: usize,
    /// Input channels.
    pub c: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Square kernel size.
    pub kernel: usize,
    /// Stride in both directions.
    pub stride: usize,
    /// Zero padding on every side.
    pub padding: usize,
}

impl ConvShape {
    /// Output height and width.
    pub fn output_size(&self) -> (usize, usize) {
        let o = |x: usize| (x + 2 * self.padding - self.kernel) / self.stride + 1;
        (o(self.h), o(self.w))
    }

    /// Elements of the output batch.
    pub fn output_len(&self) -> usize {
        let (oh, ow) = self.output_size();
        self.n * self.out_channels * oh * ow
    }
}

/// Shapes of a square max pool over an NCHW batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolShape {
    /// Planes (images × channels).
    pub planes: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Window size.
    pub kernel: usize,
    /// Stride.
    pub stride: usize,
    /// Implicit padding on every side (never wins the max).
    pub padding: usize,
}

impl PoolShape {
    /// Output height and width.
    pub fn output_size(&self) -> (usize, usize) {
        let o = |x: usize| (x + 2 * self.padding - self.kernel) / self.stride + 1;
        (o(self.h), o(self.w))
    }
}

/// Batch-norm statistics of a training forward pass that its backward pass needs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BatchNormSaved {
    /// The normalised input `(x - mean) * inv_std`, same shape as the input.
    pub xhat: Vec<f32>,
    /// `1 / sqrt(var + eps)` per channel.
    pub inv_std: Vec<f32>,
}

/// Settings of batch normalisation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormConfig {
    /// Weight of the new batch statistic in the running ones.
    pub momentum: f32,
    /// Added to the variance.
    pub eps: f32,
}

/// A matrix operand: its elements and (row stride, column stride), so a transpose is free.
#[derive(Clone, Copy, Debug)]
pub struct Matrix<'a> {
    /// Elements.
    pub data: &'a [f32],
    /// Distance between rows.
    pub row_stride: usize,
    /// Distance between columns.
    pub col_stride: usize,
}

impl<'a> Matrix<'a> {
    /// A row-major matrix with `cols` columns.
    pub fn rows(data: &'a [f32], cols: usize) -> Self {
        Self {
            data,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose of a row-major matrix with `cols` columns.
    pub fn transposed(data: &'a [f32], cols: usize) -> Self {
        Self {
            data,
            row_stride: 1,
            col_stride: cols,
        }
    }
}

/// The arithmetic of the engine. Shapes are trusted: a mismatch is a programming error and
/// may panic. "Accumulates" means `+=`, so micro-batches add into the same gradients;
/// everything else overwrites its output.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// A short name for logs and `info` (`cpu`, `cuda`).
    fn name(&self) -> &'static str;

    /// `c[m, n] = a[m, k] · b[k, n] + beta · c`, `c` row-major with `n` columns.
    #[allow(clippy::too_many_arguments)]
    fn gemm(&self, m: usize, k: usize, n: usize, a: Matrix, b: Matrix, beta: f32, c: &mut [f32]);

    /// Convolution: `y = conv(x, weight)` (cudnnConvolutionForward).
    fn conv2d_forward(&self, shape: &ConvShape, x: &[f32], weight: &[f32], y: &mut [f32]);

    /// Both backward halves of a convolution: overwrites `dx` (backward data) and
    /// accumulates into `dweight` (backward filter).
    fn conv2d_backward(
        &self,
        shape: &ConvShape,
        x: &[f32],
        weight: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        dweight: &mut [f32],
    );

    /// Batch norm with the batch's statistics over `[n, c, hw]`; updates the running mean
    /// and unbiased variance, returns what backward needs.
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_forward_training(
        &self,
        dims: (usize, usize, usize),
        config: BatchNormConfig,
        x: &[f32],
        gamma: &[f32],
        beta: &[f32],
        running_mean: &mut [f32],
        running_var: &mut [f32],
        y: &mut [f32],
    ) -> BatchNormSaved;

    /// Batch norm with the running statistics.
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_forward_inference(
        &self,
        dims: (usize, usize, usize),
        config: BatchNormConfig,
        x: &[f32],
        gamma: &[f32],
        beta: &[f32],
        running_mean: &[f32],
        running_var: &[f32],
        y: &mut [f32],
    );

    /// Batch-norm backward through the batch statistics: overwrites `dx`, accumulates
    /// `dgamma` and `dbeta`.
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_backward(
        &self,
        dims: (usize, usize, usize),
        saved: &BatchNormSaved,
        gamma: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        dgamma: &mut [f32],
        dbeta: &mut [f32],
    );

    /// `y = max(x, 0)`.
    fn relu_forward(&self, x: &[f32], y: &mut [f32]);

    /// `dx = dy` where the forward output `y` was positive, else 0.
    fn relu_backward(&self, y: &[f32], dy: &[f32], dx: &mut [f32]);

    /// Max pool; `argmax` gets, per output, the index of the winner within its plane.
    fn max_pool_forward(&self, shape: &PoolShape, x: &[f32], y: &mut [f32], argmax: &mut [u32]);

    /// Routes each output gradient to its winner; overwrites `dx`.
    fn max_pool_backward(&self, shape: &PoolShape, argmax: &[u32], dy: &[f32], dx: &mut [f32]);

    /// Mean of each plane of `plane_len` elements: `y[p] = mean(x[p, ..])`.
    fn global_avg_pool_forward(&self, plane_len: usize, x: &[f32], y: &mut [f32]);

    /// Spreads each gradient evenly over its plane; overwrites `dx`.
    fn global_avg_pool_backward(&self, plane_len: usize, dy: &[f32], dx: &mut [f32]);

    /// `y[r, :] = bias` for every row of `y` (rows of `bias.len()`).
    fn broadcast_rows(&self, bias: &[f32], y: &mut [f32]);

    /// Accumulates the column sums of `x` (rows of `sums.len()`) into `sums`.
    fn sum_rows(&self, x: &[f32], sums: &mut [f32]);

    /// `a += b` element-wise.
    fn add_assign(&self, a: &mut [f32], b: &[f32]);
}
