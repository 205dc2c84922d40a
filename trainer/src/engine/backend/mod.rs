//! The compute under the layers: every arithmetic kernel a layer needs, behind one trait.
//!
//! Layers keep their shapes, parameters' places and what backward needs; a [`Backend`] does
//! the arithmetic. The operations are the ones cuDNN and cuBLAS offer (convolution forward
//! and its two backward halves, batch-norm training/inference/backward, pooling, activation,
//! GEMM, tensor add), so a CUDA backend maps each to a library call or one NVRTC kernel.
//! [`CpuBackend`] is the reference: im2col + `matrixmultiply`'s SGEMM, rayon over all cores.
//!
//! Memory belongs to the backend: [`Backend::Buf`] is a host `Vec<f32>` for the CPU and
//! device memory for CUDA, and operations take views of buffers ([`Backend::View`],
//! [`Backend::ViewMut`]), so layers never touch host memory on the GPU path. Tensor shapes
//! are logical (NCHW); how a backend lays a 4-D activation out in memory is its own affair
//! (NCHW on the CPU, NHWC on CUDA), and only [`Backend::upload`] and [`Backend::download`]
//! convert. Parameters live in one flat fp32 buffer in PyTorch's layout on every backend.
//!
//! What an operation saves for its backward pass is the backend's own type
//! ([`Backend::ConvSaved`], [`Backend::BnSaved`], [`Backend::PoolSaved`]).

pub mod arena;
mod cpu;
pub mod cuda;
pub mod kernels;

pub use cpu::CpuBackend;
pub use cuda::{CudaBackend, CudaError};

use std::ops::Range;

use crate::collective::{Collective, CollectiveError, ReduceOp};
use crate::engine::image_folder::gpu::DeviceImages;
use crate::engine::tensor::DType;

/// Shapes of a 2-D convolution over an NCHW batch with a `[out, in, k, k]` weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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
    /// Channels per image (a channels-last backend walks planes by image and channel).
    pub channels: usize,
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

/// What a training batch norm applies to its output in the same pass, as cuDNN's `…Ex`
/// calls fuse it (`CUDNN_BATCHNORM_OPS_BN`, `…_BN_ACTIVATION`, `…_BN_ADD_ACTIVATION`): the
/// ReLU after a conv-BN pair, and a residual block's add-then-ReLU.
#[derive(Clone, Copy, Debug)]
pub enum BnEpilogue<V> {
    /// `y = bn(x)`.
    Identity,
    /// `y = max(bn(x), 0)`.
    Relu,
    /// `y = max(bn(x) + z, 0)`; `z` is the residual, shaped and typed like `x`.
    AddRelu(V),
}

/// What follows a batch norm ([`BnEpilogue`], [`BnEpilogueGrad`]), without its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BnEpilogueKind {
    /// Nothing.
    Identity,
    /// A ReLU.
    Relu,
    /// The residual add, then a ReLU.
    AddRelu,
}

impl<V> BnEpilogue<V> {
    /// Which epilogue this is.
    pub fn kind(&self) -> BnEpilogueKind {
        match self {
            Self::Identity => BnEpilogueKind::Identity,
            Self::Relu => BnEpilogueKind::Relu,
            Self::AddRelu(_) => BnEpilogueKind::AddRelu,
        }
    }

    /// Whether a ReLU ends it (backward then needs the forward's output).
    pub fn has_relu(&self) -> bool {
        self.kind() != BnEpilogueKind::Identity
    }
}

/// The backward pass of a [`BnEpilogue`]: what it needs from the forward pass and where the
/// residual's gradient goes.
#[derive(Debug)]
pub enum BnEpilogueGrad<V, M> {
    /// The forward pass had [`BnEpilogue::Identity`].
    Identity,
    /// [`BnEpilogue::Relu`]; `y` is the forward pass's output.
    Relu {
        /// The forward pass's output.
        y: V,
    },
    /// [`BnEpilogue::AddRelu`]; `dz` receives the residual's gradient (overwritten).
    AddRelu {
        /// The forward pass's output.
        y: V,
        /// The residual's gradient.
        dz: M,
    },
}

impl<V, M> BnEpilogueGrad<V, M> {
    /// Which epilogue's backward pass this is.
    pub fn kind(&self) -> BnEpilogueKind {
        match self {
            Self::Identity => BnEpilogueKind::Identity,
            Self::Relu { .. } => BnEpilogueKind::Relu,
            Self::AddRelu { .. } => BnEpilogueKind::AddRelu,
        }
    }
}

/// A matrix operand: a view of its elements and (row stride, column stride), so a transpose
/// is free.
#[derive(Clone, Copy, Debug)]
pub struct Matrix<V> {
    /// Elements.
    pub data: V,
    /// Distance between rows.
    pub row_stride: usize,
    /// Distance between columns.
    pub col_stride: usize,
}

impl<V> Matrix<V> {
    /// A row-major matrix with `cols` columns.
    pub fn rows(data: V, cols: usize) -> Self {
        Self {
            data,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose of a row-major matrix with `cols` columns.
    pub fn transposed(data: V, cols: usize) -> Self {
        Self {
            data,
            row_stride: 1,
            col_stride: cols,
        }
    }
}

/// The memory and arithmetic of the engine. Shapes are trusted: a mismatch is a programming
/// error and may panic. "Accumulates" means `+=`, so micro-batches add into the same
/// gradients; everything else overwrites its output.
pub trait Backend: Clone + std::fmt::Debug + 'static {
    /// A buffer of elements on this backend's device (its element type is the tensor's).
    type Buf: Clone + std::fmt::Debug;
    /// A read-only view of part of a buffer.
    type View<'a>: Copy
    where
        Self: 'a;
    /// A writable view of part of a buffer.
    type ViewMut<'a>
    where
        Self: 'a;
    /// What a convolution's forward pass keeps for its backward pass.
    type ConvSaved: Clone + std::fmt::Debug;
    /// What a training batch norm keeps for its backward pass.
    type BnSaved: Clone + std::fmt::Debug;
    /// What a max pool keeps for its backward pass.
    type PoolSaved: Clone + std::fmt::Debug;
    /// Device work recorded once, to be queued again with one launch ([`Backend::record`]).
    type Recording;

    /// A short name for logs and `info` (`cpu`, `cuda`).
    fn name(&self) -> &'static str;

    /// Whether this backend computes in `dtype`.
    fn supports(&self, dtype: DType) -> bool;

    /// A buffer of `len` elements of `dtype`. Its contents are unspecified: every operation
    /// overwrites its output unless it says it accumulates.
    fn alloc(&self, len: usize, dtype: DType) -> Self::Buf;

    /// A buffer of `len` zeros of `dtype`.
    fn zeros(&self, len: usize, dtype: DType) -> Self::Buf;

    /// Copies host values in (logical layout; 4-D shapes are NCHW) as `dtype`.
    fn upload(&self, host: &[f32], shape: &[usize], dtype: DType) -> Self::Buf;

    /// [`Backend::upload`] into an existing buffer of `host.len()` elements (its type),
    /// e.g. a step's inputs at the fixed address a recording reads.
    fn upload_into(&self, host: &[f32], shape: &[usize], buf: &mut Self::Buf);

    /// [`Backend::upload_into`] from images the GPU loader made on this backend's GPU
    /// (`images.shape` is NCHW, as an upload's): converted on the device, and
    /// `images.consumed` set to when that is done. Only the CUDA backend is given any.
    fn upload_device_images_into(&self, images: &mut DeviceImages, buf: &mut Self::Buf) {
        let _ = (images, buf);
        unreachable!(
            "the {} backend is given no device images (the GPU loader feeds CUDA only)",
            self.name()
        )
    }

    /// Records the device work `work` queues and queues it once; [`Backend::replay`] then
    /// queues it again with one launch: the same kernels on the same addresses, arena
    /// temporaries included. So `work` may only queue device work (no upload, download or
    /// wait, no allocation outside the arena), and whatever it reads must be at the same
    /// place at every replay. `None` where there is nothing to record: the CPU runs `work`
    /// as it goes.
    fn record(&self, work: &mut dyn FnMut()) -> Option<Self::Recording> {
        work();
        None
    }

    /// Queues a recording again.
    fn replay(&self, recording: &Self::Recording);

    /// Copies a buffer out as `f32` in logical layout (4-D shapes NCHW).
    fn download(&self, buf: &Self::Buf, shape: &[usize]) -> Vec<f32>;

    /// Runs `f` on a flat `f32` buffer's values as a host slice and keeps what it wrote
    /// (the CPU lends the buffer itself; a device stages it through host memory). For the
    /// host-side collectives and checkpoints.
    fn with_host<R>(&self, buf: &mut Self::Buf, f: impl FnOnce(&mut [f32]) -> R) -> R;

    /// Whether [`Backend::queue_all_reduce`] reduces this backend's memory in place through
    /// `collective`, overlapping the work queued after it (a GPU with NCCL), rather than
    /// staging it through the host there and then.
    fn reduces_on_device(&self, _collective: &mut dyn Collective) -> bool {
        false
    }

    /// All-reduces elements `range` of the f32 buffer `buf` over `collective`'s ranks: queued
    /// on the device when [`Backend::reduces_on_device`] (then
    /// [`Backend::join_all_reduces`] waits for it), else now through the host.
    fn queue_all_reduce(
        &self,
        buf: &mut Self::Buf,
        range: Range<usize>,
        collective: &mut dyn Collective,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.with_host(buf, |values| collective.all_reduce(&mut values[range], op))
    }

    /// Returns once every all-reduce queued on the device has finished (at once when none
    /// was): the work queued from here on sees their results.
    fn join_all_reduces(&self, _collective: &mut dyn Collective) -> Result<(), CollectiveError> {
        Ok(())
    }

    /// Waits until everything queued has run (for timing; the CPU computes synchronously).
    fn synchronize(&self) {}

    /// Marks the start of a training or evaluation step: temporaries of the previous step
    /// are dead from here on (a device backend recycles its arena).
    fn begin_step(&self) {}

    /// Elements `range` of `buf`.
    fn view<'a>(&self, buf: &'a Self::Buf, range: Range<usize>) -> Self::View<'a>;

    /// Elements `range` of `buf`, writable.
    fn view_mut<'a>(&self, buf: &'a mut Self::Buf, range: Range<usize>) -> Self::ViewMut<'a>;

    /// Two disjoint ranges of `buf`, writable together; `a` ends before `b` starts.
    fn view_mut_pair<'a>(
        &self,
        buf: &'a mut Self::Buf,
        a: Range<usize>,
        b: Range<usize>,
    ) -> (Self::ViewMut<'a>, Self::ViewMut<'a>);

    /// Sets every element to zero.
    fn fill_zero(&self, x: Self::ViewMut<'_>);

    /// `c[m, n] = a[m, k] · b[k, n] + beta · c`, `c` row-major with `n` columns, all `f32`.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        m: usize,
        k: usize,
        n: usize,
        a: Matrix<Self::View<'_>>,
        b: Matrix<Self::View<'_>>,
        beta: f32,
        c: Self::ViewMut<'_>,
    );

    /// Convolution: `y = conv(x, weight)` (cudnnConvolutionForward); `weight` is the fp32
    /// master in `[out, in, k, k]`, `x` and `y` share the activations' type.
    fn conv2d_forward(
        &self,
        shape: &ConvShape,
        x: Self::View<'_>,
        weight: Self::View<'_>,
        y: Self::ViewMut<'_>,
    ) -> Self::ConvSaved;

    /// Both backward halves of a convolution: overwrites `dx` (backward data) when it is
    /// asked for (the first layer's input, the image, needs no gradient), and accumulates
    /// into the fp32 `dweight` (backward filter).
    #[allow(clippy::too_many_arguments)]
    fn conv2d_backward(
        &self,
        shape: &ConvShape,
        saved: &Self::ConvSaved,
        x: Self::View<'_>,
        weight: Self::View<'_>,
        dy: Self::View<'_>,
        dx: Option<Self::ViewMut<'_>>,
        dweight: Self::ViewMut<'_>,
    );

    /// Batch norm with the batch's statistics over `[n, c, hw]`, then `epilogue` in the same
    /// pass; updates the running mean and unbiased variance, returns what backward needs.
    /// Parameters and statistics are fp32 whatever the activations' type.
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_forward_training(
        &self,
        dims: (usize, usize, usize),
        config: BatchNormConfig,
        x: Self::View<'_>,
        gamma: Self::View<'_>,
        beta: Self::View<'_>,
        running_mean: Self::ViewMut<'_>,
        running_var: Self::ViewMut<'_>,
        epilogue: BnEpilogue<Self::View<'_>>,
        y: Self::ViewMut<'_>,
    ) -> Self::BnSaved;

    /// Batch norm with the running statistics.
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_forward_inference(
        &self,
        dims: (usize, usize, usize),
        config: BatchNormConfig,
        x: Self::View<'_>,
        gamma: Self::View<'_>,
        beta: Self::View<'_>,
        running_mean: Self::View<'_>,
        running_var: Self::View<'_>,
        y: Self::ViewMut<'_>,
    );

    /// Batch-norm backward through the forward pass's epilogue and the batch statistics:
    /// overwrites `dx` (and the epilogue's `dz`), accumulates `dgamma` and `dbeta`.
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_backward(
        &self,
        dims: (usize, usize, usize),
        config: BatchNormConfig,
        saved: &Self::BnSaved,
        gamma: Self::View<'_>,
        beta: Self::View<'_>,
        epilogue: BnEpilogueGrad<Self::View<'_>, Self::ViewMut<'_>>,
        dy: Self::View<'_>,
        dx: Self::ViewMut<'_>,
        dgamma: Self::ViewMut<'_>,
        dbeta: Self::ViewMut<'_>,
    );

    /// `y = max(x, 0)`.
    fn relu_forward(&self, x: Self::View<'_>, y: Self::ViewMut<'_>);

    /// `dx = dy` where the forward output `y` was positive, else 0.
    fn relu_backward(&self, y: Self::View<'_>, dy: Self::View<'_>, dx: Self::ViewMut<'_>);

    /// Max pool; returns what backward needs to route gradients to the winners.
    fn max_pool_forward(
        &self,
        shape: &PoolShape,
        x: Self::View<'_>,
        y: Self::ViewMut<'_>,
    ) -> Self::PoolSaved;

    /// Routes each output gradient to its winner; overwrites `dx`.
    fn max_pool_backward(
        &self,
        shape: &PoolShape,
        saved: &Self::PoolSaved,
        dy: Self::View<'_>,
        dx: Self::ViewMut<'_>,
    );

    /// Mean of each `[n, c]` plane of `hw` elements into an fp32 `[n, c]`.
    fn global_avg_pool_forward(
        &self,
        dims: (usize, usize, usize),
        x: Self::View<'_>,
        y: Self::ViewMut<'_>,
    );

    /// Spreads each fp32 gradient evenly over its plane; overwrites `dx` (the activations'
    /// type).
    fn global_avg_pool_backward(
        &self,
        dims: (usize, usize, usize),
        dy: Self::View<'_>,
        dx: Self::ViewMut<'_>,
    );

    /// `y[r, :] = bias` for every row of `y` (rows of `bias`'s length), `f32`.
    fn broadcast_rows(&self, bias: Self::View<'_>, y: Self::ViewMut<'_>);

    /// Accumulates the column sums of `x` (rows of `sums`'s length) into `sums`, `f32`.
    fn sum_rows(&self, x: Self::View<'_>, sums: Self::ViewMut<'_>);

    /// `a += b` element-wise.
    fn add_assign(&self, a: Self::ViewMut<'_>, b: Self::View<'_>);

    /// Softmax cross-entropy with label smoothing over the f32 `logits` of `n` rows of
    /// `classes` (`n` = `labels.len()`; labels are class indices held as f32): overwrites
    /// `dlogits` with `grad_scale` times the gradient of the batch's mean loss, and adds the
    /// batch's mean loss and its count of rows whose first arg-max is the label to
    /// `totals[0]` and `totals[1]` (f32). On the device, so a step sends no logits to the
    /// host.
    #[allow(clippy::too_many_arguments)]
    fn softmax_cross_entropy(
        &self,
        classes: usize,
        logits: Self::View<'_>,
        labels: Self::View<'_>,
        label_smoothing: f32,
        grad_scale: f32,
        dlogits: Self::ViewMut<'_>,
        totals: Self::ViewMut<'_>,
    );

    /// The table [`Backend::sgd_update_all`] reads, made once for a model: the ranges of
    /// parameters without weight decay (sorted, disjoint). `None` where the backend updates
    /// tensor by tensor ([`Backend::sgd_update`]; the CPU, where a launch costs nothing).
    fn sgd_table(&self, _undecayed: &[Range<usize>]) -> Option<Self::Buf> {
        None
    }

    /// [`Backend::sgd_update`] over every parameter at once (one kernel on a device): weight
    /// decay except on the ranges of `table` ([`Backend::sgd_table`]).
    #[allow(clippy::too_many_arguments)]
    fn sgd_update_all(
        &self,
        _w: Self::ViewMut<'_>,
        _g: Self::View<'_>,
        _v: Self::ViewMut<'_>,
        _lr: f32,
        _momentum: f32,
        _weight_decay: f32,
        _table: &Self::Buf,
    ) {
        unreachable!("{} makes no SGD table", self.name())
    }

    /// One SGD step over one parameter in PyTorch's form: `v = momentum · v + (g + wd · w)`,
    /// `w -= lr · v`; all fp32.
    #[allow(clippy::too_many_arguments)]
    fn sgd_update(
        &self,
        w: Self::ViewMut<'_>,
        g: Self::View<'_>,
        v: Self::ViewMut<'_>,
        lr: f32,
        momentum: f32,
        weight_decay: f32,
    );
}
