//! The CUDA backend's own kernels (`cuda_kernels.cu`) as Rust calls: one definition of each
//! kernel's parameters (their C types, in order), of the arguments the backend passes from
//! its shapes, and of how many threads each runs over.
//!
//! The CUDA backend launches them through [`KernelLauncher`] with `cuLaunchKernel`. Because
//! the calls are plain data (addresses, counts, flags), a machine without a GPU checks them
//! too: [`SIGNATURES`] against the C declarations (a unit test below), and every call here
//! run on the CPU, the kernels' source compiled by the host's C++ compiler under an
//! emulation of CUDA's grid, against the CPU backend (`tests/kernels_on_cpu.rs`).

use std::ffi::c_void;

use super::{BatchNormConfig, BnEpilogue, BnEpilogueGrad, ConvShape, PoolShape};
use crate::engine::tensor::DType;

/// The kernels' source, compiled by NVRTC when the CUDA backend starts.
pub const SOURCE: &str = include_str!("cuda_kernels.cu");

/// Threads per block.
pub const BLOCK: u32 = 256;

/// Blocks of [`BLOCK`] threads for a kernel over `threads` outputs: one output a thread,
/// up to a cap past which the kernels' grid-stride loops take several each.
pub fn blocks(threads: usize) -> u32 {
    threads.div_ceil(BLOCK as usize).min(65_535 * 8) as u32
}

/// Runs a kernel of [`SOURCE`]: the CUDA backend on its stream, or an emulation.
pub trait KernelLauncher {
    /// Launches kernel `name` with [`blocks`]`(threads)` blocks of [`BLOCK`] threads;
    /// `args` point at the arguments, in order, each of the C type the kernel declares
    /// (`cuLaunchKernel`'s `kernelParams`). Nothing happens when `threads` is 0.
    fn launch(&self, name: &'static str, threads: usize, args: &mut [*mut c_void]);
}

/// Memory a kernel reads or writes: its address (on the device, for the CUDA backend), its
/// element count and their type. Made only by [`Operand::new`], whose caller vouches for
/// the memory: that is what makes the calls below safe to make.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Operand {
    ptr: u64,
    len: usize,
    dtype: DType,
}

impl Operand {
    /// `len` elements of `dtype` at `ptr`.
    ///
    /// # Safety
    ///
    /// `ptr` is the address of `len` elements of `dtype`, aligned for them (and for f64s in
    /// the scratch of [`softmax_cross_entropy`] and the batch norms), memory the launcher's
    /// kernels can reach (device memory for the CUDA backend, host memory for an
    /// emulation), live and not used by anything else until the kernels given it have run.
    pub unsafe fn new(ptr: u64, len: usize, dtype: DType) -> Self {
        Self { ptr, len, dtype }
    }

    /// The kernels' `bf` flag: 1 for bf16 elements, 0 for f32.
    fn bf(&self) -> i32 {
        i32::from(self.dtype == DType::Bf16)
    }

    fn f32_only(&self, what: &str) {
        assert_eq!(self.dtype, DType::F32, "{what} is f32");
    }
}

/// The C type of a kernel parameter, as [`SIGNATURES`] lists them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CType {
    /// Any pointer (a `u64` device address).
    Pointer,
    /// `int` (`i32`).
    Int,
    /// `long long` (`i64`).
    LongLong,
    /// `float` (`f32`).
    Float,
}

/// A Rust type passed to a kernel, and the C type it stands for.
trait KernelArg {
    const C: CType;
}

impl KernelArg for u64 {
    const C: CType = CType::Pointer;
}

impl KernelArg for i32 {
    const C: CType = CType::Int;
}

impl KernelArg for i64 {
    const C: CType = CType::LongLong;
}

impl KernelArg for f32 {
    const C: CType = CType::Float;
}

/// Declares each kernel once: a function taking its parameters as typed Rust values (the
/// thread count from the parameters named after `over`), and its row of [`SIGNATURES`].
macro_rules! kernels {
    ($( fn $name:ident($($arg:ident: $ty:ty),+ $(,)?) over [$($count:expr),+]; )+) => {
        /// Every kernel of [`SOURCE`] with its parameters' C types, in order.
        pub const SIGNATURES: &[(&str, &[CType])] =
            &[$((stringify!($name), &[$(<$ty as KernelArg>::C),+])),+];

        /// One function a kernel: its C parameters, in order.
        mod raw {
            use super::*;
            $(
                #[allow(clippy::too_many_arguments)]
                pub(super) fn $name(l: &(impl KernelLauncher + ?Sized), $($arg: $ty),+) {
                    let threads = [$(($count) as usize),+].iter().product::<usize>();
                    l.launch(stringify!($name), threads, &mut [$(&mut { $arg } as *mut $ty as *mut c_void),+]);
                }
            )+
        }
    };
}

kernels! {
    fn convert(x: u64, xbf: i32, y: u64, ybf: i32, n: i64) over [n];
    fn nchw_to_nhwc(x: u64, y: u64, ybf: i32, n: i32, c: i32, hw: i32) over [n, c, hw];
    fn nhwc_to_nchw(x: u64, xbf: i32, y: u64, n: i32, c: i32, hw: i32) over [n, c, hw];
    fn kcrs_to_krsc(w: u64, out: u64, obf: i32, k: i32, c: i32, rs: i32) over [k, c, rs];
    fn krsc_add_to_kcrs(dw: u64, dbf: i32, grad: u64, k: i32, c: i32, rs: i32) over [k, c, rs];
    fn relu_forward(x: u64, y: u64, bf: i32, n: i64) over [n];
    fn relu_backward(y: u64, dy: u64, dx: u64, bf: i32, n: i64) over [n];
    fn add_assign(a: u64, b: u64, bf: i32, n: i64) over [n];
    fn add_assign_8(a: u64, b: u64, bf: i32, chunks: i64) over [chunks];
    fn max_pool_forward(x: u64, y: u64, argmax: u64, bf: i32, n: i32, c: i32, h: i32, w: i32,
        oh: i32, ow: i32, k: i32, stride: i32, pad: i32) over [n, oh, ow, c];
    fn max_pool_backward(argmax: u64, dy: u64, dx: u64, bf: i32, n: i32, c: i32, h: i32,
        w: i32, oh: i32, ow: i32, k: i32, stride: i32, pad: i32) over [n, h, w, c];
    fn global_avg_pool_forward(x: u64, bf: i32, y: u64, n: i32, c: i32, hw: i32) over [n, c];
    fn global_avg_pool_backward(dy: u64, dx: u64, bf: i32, n: i32, c: i32, hw: i32)
        over [n, hw, c];
    fn broadcast_rows(bias: u64, y: u64, cols: i32, n: i64) over [n];
    fn sum_rows(x: u64, sums: u64, rows: i32, cols: i32) over [cols];
    fn sgd_update(w: u64, g: u64, v: u64, lr: f32, momentum: f32, wd: f32, n: i64) over [n];
    fn sgd_update_all(w: u64, g: u64, v: u64, lr: f32, momentum: f32, wd: f32, bounds: u64,
        nbounds: i32, n: i64) over [n];
    fn softmax_cross_entropy(logits: u64, labels: u64, dlogits: u64, row_stats: u64, n: i32,
        k: i32, smoothing: f32, scale: f32) over [n];
    fn sum_row_stats(row_stats: u64, totals: u64, n: i32) over [1];
    fn bn_stats_partial(x: u64, bf: i32, rows: i64, c: i32, chunk: i32, partial: u64)
        over [(rows + chunk as i64 - 1) / chunk as i64, c];
    fn bn_grad_partial(x: u64, dy: u64, y: u64, bf: i32, rows: i64, c: i32, chunk: i32,
        mean: u64, inv_std: u64, partial: u64) over [(rows + chunk as i64 - 1) / chunk as i64, c];
    fn bn_fold(input: u64, groups: i64, c: i32, fan: i32, out: u64)
        over [(groups + fan as i64 - 1) / fan as i64, c];
    fn bn_stats_finish(sums: u64, x: u64, bf: i32, rows: i64, c: i32, momentum: f32, eps: f32,
        running_mean: u64, running_var: u64, mean: u64, inv_std: u64) over [c];
    fn bn_forward_apply(x: u64, z: u64, y: u64, bf: i32, rows: i64, c: i32, mean: u64,
        inv_std: u64, gamma: u64, beta: u64, relu: i32) over [rows, c];
    fn bn_backward_apply(x: u64, dy: u64, y: u64, dz: u64, dx: u64, bf: i32, rows: i64, c: i32,
        mean: u64, inv_std: u64, gamma: u64, sums: u64) over [rows, c];
    fn bn_grad_finish(sums: u64, c: i32, dgamma: u64, dbeta: u64) over [c];
}

fn int(x: usize, what: &str) -> i32 {
    i32::try_from(x).unwrap_or_else(|_| panic!("{what} ({x}) exceeds the kernels' int"))
}

fn same_len(a: &Operand, b: &Operand, what: &str) {
    assert_eq!(
        a.len, b.len,
        "{what}: operands of {} and {} elements",
        a.len, b.len
    );
}

/// Same length and element type: the kernels read and write both with one `bf` flag.
fn alike(a: &Operand, b: &Operand, what: &str) {
    same_len(a, b, what);
    assert_eq!(
        a.dtype, b.dtype,
        "{what}: operands of {:?} and {:?}",
        a.dtype, b.dtype
    );
}

/// `y = x`, converted to `y`'s element type (bf16 rounded to nearest even).
pub fn convert(l: &(impl KernelLauncher + ?Sized), x: Operand, y: Operand) {
    same_len(&x, &y, "convert");
    raw::convert(l, x.ptr, x.bf(), y.ptr, y.bf(), x.len as i64);
}

/// An NCHW f32 batch `[n, c, h, w]` (host order) into NHWC of `y`'s type.
pub fn nchw_to_nhwc(
    l: &(impl KernelLauncher + ?Sized),
    [n, c, h, w]: [usize; 4],
    x: Operand,
    y: Operand,
) {
    x.f32_only("an NCHW upload");
    same_len(&x, &y, "nchw_to_nhwc");
    assert_eq!(x.len, n * c * h * w, "nchw_to_nhwc shape");
    raw::nchw_to_nhwc(
        l,
        x.ptr,
        y.ptr,
        y.bf(),
        int(n, "n"),
        int(c, "c"),
        int(h * w, "h·w"),
    );
}

/// An NHWC batch `[n, c, h, w]` of `x`'s type into NCHW f32 (host order).
pub fn nhwc_to_nchw(
    l: &(impl KernelLauncher + ?Sized),
    [n, c, h, w]: [usize; 4],
    x: Operand,
    y: Operand,
) {
    y.f32_only("an NCHW download");
    same_len(&x, &y, "nhwc_to_nchw");
    assert_eq!(x.len, n * c * h * w, "nhwc_to_nchw shape");
    raw::nhwc_to_nchw(
        l,
        x.ptr,
        x.bf(),
        y.ptr,
        int(n, "n"),
        int(c, "c"),
        int(h * w, "h·w"),
    );
}

fn filter_dims(s: &ConvShape) -> (i32, i32, i32) {
    (
        int(s.out_channels, "output channels"),
        int(s.c, "input channels"),
        int(s.kernel * s.kernel, "kernel area"),
    )
}

/// A convolution's f32 KCRS master weight into the KRSC working copy cuDNN reads, of
/// `working`'s type.
pub fn weights_to_working(
    l: &(impl KernelLauncher + ?Sized),
    s: &ConvShape,
    master: Operand,
    working: Operand,
) {
    master.f32_only("a master weight");
    same_len(&master, &working, "weights_to_working");
    let (k, c, rs) = filter_dims(s);
    assert_eq!(
        master.len,
        (k * c * rs) as usize,
        "weights_to_working shape"
    );
    raw::kcrs_to_krsc(l, master.ptr, working.ptr, working.bf(), k, c, rs);
}

/// Adds cuDNN's KRSC weight gradient (the activations' type) into the f32 KCRS gradient.
pub fn add_weight_grad_to_master(
    l: &(impl KernelLauncher + ?Sized),
    s: &ConvShape,
    dw: Operand,
    grad: Operand,
) {
    grad.f32_only("a parameter gradient");
    same_len(&dw, &grad, "add_weight_grad_to_master");
    let (k, c, rs) = filter_dims(s);
    assert_eq!(
        grad.len,
        (k * c * rs) as usize,
        "add_weight_grad_to_master shape"
    );
    raw::krsc_add_to_kcrs(l, dw.ptr, dw.bf(), grad.ptr, k, c, rs);
}

/// `y = max(x, 0)`; `y` may be `x`.
pub fn relu_forward(l: &(impl KernelLauncher + ?Sized), x: Operand, y: Operand) {
    alike(&x, &y, "relu_forward");
    raw::relu_forward(l, x.ptr, y.ptr, x.bf(), x.len as i64);
}

/// `dx = dy` where the forward output `y` is positive, else 0.
pub fn relu_backward(l: &(impl KernelLauncher + ?Sized), y: Operand, dy: Operand, dx: Operand) {
    alike(&y, &dy, "relu_backward");
    alike(&y, &dx, "relu_backward");
    raw::relu_backward(l, y.ptr, dy.ptr, dx.ptr, y.bf(), y.len as i64);
}

/// `a += b`, element-wise.
pub fn add_assign(l: &(impl KernelLauncher + ?Sized), a: Operand, b: Operand) {
    alike(&a, &b, "add_assign");
    let bytes = a.len * a.dtype.size();
    if (a.ptr | b.ptr | bytes as u64).is_multiple_of(8) {
        // Eight bytes a thread where both start and the length allow.
        raw::add_assign_8(l, a.ptr, b.ptr, a.bf(), (bytes / 8) as i64);
        return;
    }
    raw::add_assign(l, a.ptr, b.ptr, a.bf(), a.len as i64);
}

/// The pool kernels' shape arguments, in their order: n, c, h, w, oh, ow, k, stride, pad.
fn pool_dims(s: &PoolShape) -> [i32; 9] {
    let (oh, ow) = s.output_size();
    assert_eq!(
        s.planes % s.channels,
        0,
        "pool planes are images × channels"
    );
    [
        int(s.planes / s.channels, "images"),
        int(s.channels, "channels"),
        int(s.h, "height"),
        int(s.w, "width"),
        int(oh, "output height"),
        int(ow, "output width"),
        int(s.kernel, "window"),
        int(s.stride, "stride"),
        int(s.padding, "padding"),
    ]
}

/// Max pool over an NHWC batch; `argmax` (i32, one per output: 4 bytes an element) gets
/// each winner's index within its plane, for [`max_pool_backward`].
pub fn max_pool_forward(
    l: &(impl KernelLauncher + ?Sized),
    s: &PoolShape,
    x: Operand,
    y: Operand,
    argmax: Operand,
) {
    let (oh, ow) = s.output_size();
    assert_eq!(x.len, s.planes * s.h * s.w, "max_pool_forward input shape");
    assert_eq!(x.dtype, y.dtype, "max_pool_forward types");
    assert_eq!(y.len, s.planes * oh * ow, "max_pool_forward output shape");
    assert!(
        argmax.len == y.len && argmax.dtype.size() == 4,
        "max_pool_forward argmax: one i32 an output"
    );
    let [n, c, h, w, oh, ow, k, stride, pad] = pool_dims(s);
    raw::max_pool_forward(
        l,
        x.ptr,
        y.ptr,
        argmax.ptr,
        x.bf(),
        n,
        c,
        h,
        w,
        oh,
        ow,
        k,
        stride,
        pad,
    );
}

/// Each input's gradient: the sum of those of the outputs it won; overwrites `dx`.
pub fn max_pool_backward(
    l: &(impl KernelLauncher + ?Sized),
    s: &PoolShape,
    argmax: Operand,
    dy: Operand,
    dx: Operand,
) {
    let (oh, ow) = s.output_size();
    assert_eq!(dy.len, s.planes * oh * ow, "max_pool_backward output shape");
    assert_eq!(
        dx.len,
        s.planes * s.h * s.w,
        "max_pool_backward input shape"
    );
    assert_eq!(dy.dtype, dx.dtype, "max_pool_backward types");
    assert_eq!(argmax.len, dy.len, "max_pool_backward argmax");
    let [n, c, h, w, oh, ow, k, stride, pad] = pool_dims(s);
    raw::max_pool_backward(
        l,
        argmax.ptr,
        dy.ptr,
        dx.ptr,
        dy.bf(),
        n,
        c,
        h,
        w,
        oh,
        ow,
        k,
        stride,
        pad,
    );
}

/// The f32 `[n, c]` means of an NHWC batch's planes of `hw` elements.
pub fn global_avg_pool_forward(
    l: &(impl KernelLauncher + ?Sized),
    (n, c, hw): (usize, usize, usize),
    x: Operand,
    y: Operand,
) {
    y.f32_only("the average pool's output");
    assert_eq!(
        (x.len, y.len),
        (n * c * hw, n * c),
        "global_avg_pool_forward shapes"
    );
    raw::global_avg_pool_forward(
        l,
        x.ptr,
        x.bf(),
        y.ptr,
        int(n, "n"),
        int(c, "c"),
        int(hw, "h·w"),
    );
}

/// Spreads each f32 `[n, c]` gradient evenly over its plane of the NHWC `dx`.
pub fn global_avg_pool_backward(
    l: &(impl KernelLauncher + ?Sized),
    (n, c, hw): (usize, usize, usize),
    dy: Operand,
    dx: Operand,
) {
    dy.f32_only("the average pool's output gradient");
    assert_eq!(
        (dy.len, dx.len),
        (n * c, n * c * hw),
        "global_avg_pool_backward shapes"
    );
    raw::global_avg_pool_backward(
        l,
        dy.ptr,
        dx.ptr,
        dx.bf(),
        int(n, "n"),
        int(c, "c"),
        int(hw, "h·w"),
    );
}

/// Every row of the f32 `y` (rows of `bias`'s length) set to `bias`.
pub fn broadcast_rows(l: &(impl KernelLauncher + ?Sized), bias: Operand, y: Operand) {
    bias.f32_only("a bias");
    y.f32_only("broadcast_rows' output");
    assert!(
        bias.len > 0 && y.len.is_multiple_of(bias.len),
        "broadcast_rows shapes"
    );
    raw::broadcast_rows(l, bias.ptr, y.ptr, int(bias.len, "columns"), y.len as i64);
}

/// Adds the column sums of the f32 `x` (rows of `sums`'s length) into `sums`.
pub fn sum_rows(l: &(impl KernelLauncher + ?Sized), x: Operand, sums: Operand) {
    x.f32_only("sum_rows' input");
    sums.f32_only("sum_rows' output");
    assert!(
        sums.len > 0 && x.len.is_multiple_of(sums.len),
        "sum_rows shapes"
    );
    raw::sum_rows(
        l,
        x.ptr,
        sums.ptr,
        int(x.len / sums.len, "rows"),
        int(sums.len, "columns"),
    );
}

/// PyTorch's SGD over f32 parameters: `v = momentum v + (g + wd w)`, `w -= lr v`.
pub fn sgd_update(
    l: &(impl KernelLauncher + ?Sized),
    w: Operand,
    g: Operand,
    v: Operand,
    lr: f32,
    momentum: f32,
    weight_decay: f32,
) {
    for (x, what) in [(&w, "weights"), (&g, "gradients"), (&v, "momenta")] {
        x.f32_only(what);
        same_len(&w, x, "sgd_update");
    }
    raw::sgd_update(
        l,
        w.ptr,
        g.ptr,
        v.ptr,
        lr,
        momentum,
        weight_decay,
        w.len as i64,
    );
}

/// The table [`sgd_update_all`] reads: the ranges of parameters without weight decay as
/// their bounds (`start, end, start, end, …`, sorted), each an `i32` carried in an f32's
/// bits (the buffers are f32; the kernel reads them as `int`). Panics past `i32::MAX`
/// parameters.
pub fn sgd_bounds(undecayed: &[std::ops::Range<usize>]) -> Vec<f32> {
    let mut bounds = Vec::with_capacity(2 * undecayed.len());
    for r in undecayed {
        assert!(
            bounds.last().is_none_or(|&end: &usize| end <= r.start),
            "undecayed ranges sorted and disjoint"
        );
        bounds.extend([r.start, r.end]);
    }
    bounds
        .into_iter()
        .map(|b| f32::from_bits(i32::try_from(b).expect("parameters fit an int") as u32))
        .collect()
}

/// [`sgd_update`] over every parameter at once: weight decay except on the ranges `bounds`
/// ([`sgd_bounds`]) names.
pub fn sgd_update_all(
    l: &(impl KernelLauncher + ?Sized),
    [w, g, v]: [Operand; 3],
    lr: f32,
    momentum: f32,
    weight_decay: f32,
    bounds: Operand,
) {
    for (x, what) in [(&w, "weights"), (&g, "gradients"), (&v, "momenta")] {
        x.f32_only(what);
        same_len(&w, x, "sgd_update_all");
    }
    raw::sgd_update_all(
        l,
        w.ptr,
        g.ptr,
        v.ptr,
        lr,
        momentum,
        weight_decay,
        bounds.ptr,
        bounds.len as i32,
        w.len as i64,
    );
}

/// Bytes of the scratch [`softmax_cross_entropy`] needs for `rows` rows (two f64s a row).
pub fn loss_row_stats_bytes(rows: usize) -> usize {
    16 * rows
}

/// Softmax cross-entropy with label smoothing over `labels.len()` rows of `classes` f32
/// logits (labels are class indices held as f32): `dlogits` = `grad_scale` × the gradient
/// of the mean loss; the mean loss and the count of rows whose first arg-max is the label
/// are added to `totals[0]` and `totals[1]`. `row_stats` is scratch of
/// [`loss_row_stats_bytes`].
#[allow(clippy::too_many_arguments)]
pub fn softmax_cross_entropy(
    l: &(impl KernelLauncher + ?Sized),
    classes: usize,
    logits: Operand,
    labels: Operand,
    label_smoothing: f32,
    grad_scale: f32,
    dlogits: Operand,
    row_stats: Operand,
    totals: Operand,
) {
    let n = labels.len;
    for (x, what) in [
        (&logits, "logits"),
        (&labels, "labels"),
        (&dlogits, "dlogits"),
        (&totals, "loss totals"),
    ] {
        x.f32_only(what);
    }
    assert_eq!(
        (logits.len, dlogits.len),
        (n * classes, n * classes),
        "loss shapes"
    );
    assert!(totals.len >= 2, "loss totals: two f32s");
    assert!(
        row_stats.len * row_stats.dtype.size() >= loss_row_stats_bytes(n),
        "loss row statistics: two f64s a row"
    );
    raw::softmax_cross_entropy(
        l,
        logits.ptr,
        labels.ptr,
        dlogits.ptr,
        row_stats.ptr,
        int(n, "rows"),
        int(classes, "classes"),
        label_smoothing,
        grad_scale,
    );
    raw::sum_row_stats(l, row_stats.ptr, totals.ptr, int(n, "rows"));
}

/// Rows each of a batch norm's partial sums covers.
pub const BN_CHUNK_ROWS: usize = 64;

/// Groups of a batch norm's partial sums folded into one at a time.
pub const BN_FOLD: usize = 32;

/// f32 slots of the scratch [`batch_norm_forward_training`] and [`batch_norm_backward`] need
/// over `rows` rows of `c` channels: two regions of f64 pairs a channel, one per chunk of
/// [`BN_CHUNK_ROWS`] rows and one per [`BN_FOLD`] chunks, folded into each other in turn.
pub fn batch_norm_scratch_len(rows: usize, c: usize) -> usize {
    let chunks = rows.div_ceil(BN_CHUNK_ROWS);
    4 * c * (chunks + chunks.div_ceil(BN_FOLD))
}

fn batch_norm_scratch(scratch: &Operand, rows: usize, c: usize) -> usize {
    assert_eq!(
        scratch.ptr % 8,
        0,
        "batch-norm scratch holds f64s: 8-byte aligned"
    );
    assert!(
        scratch.len * scratch.dtype.size() >= 4 * batch_norm_scratch_len(rows, c),
        "batch-norm scratch of {} elements for {rows} rows of {c} channels",
        scratch.len
    );
    rows.div_ceil(BN_CHUNK_ROWS)
}

/// Batch norm's parameters and statistics: f32, one a channel.
fn per_channel<const N: usize>(c: usize, operands: [(&Operand, &str); N]) {
    for (p, what) in operands {
        p.f32_only(what);
        assert_eq!(p.len, c, "batch-norm {what}: one a channel");
    }
}

/// Folds the `chunks` groups of partial sums at the start of `scratch` down to one, through
/// its second region; the address of the per-channel pairs.
fn fold_to_one(
    l: &(impl KernelLauncher + ?Sized),
    scratch: &Operand,
    c: usize,
    chunks: usize,
) -> u64 {
    let (mut from, mut to) = (scratch.ptr, scratch.ptr + (16 * c * chunks) as u64);
    let mut groups = chunks;
    while groups > 1 {
        raw::bn_fold(
            l,
            from,
            groups as i64,
            int(c, "channels"),
            BN_FOLD as i32,
            to,
        );
        groups = groups.div_ceil(BN_FOLD);
        std::mem::swap(&mut from, &mut to);
    }
    from
}

/// Batch norm with the batch's statistics over an NHWC batch of `n·hw` rows of `c` channels,
/// then `epilogue`, rounded once into `y`; updates the running mean and unbiased variance
/// and writes the batch's mean and `1/sqrt(var + eps)` (what backward needs, as cuDNN's
/// saved statistics). Parameters and statistics f32; `scratch` of
/// [`batch_norm_scratch_len`] f32s.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_forward_training(
    l: &(impl KernelLauncher + ?Sized),
    (n, c, hw): (usize, usize, usize),
    config: BatchNormConfig,
    x: Operand,
    gamma: Operand,
    beta: Operand,
    running_mean: Operand,
    running_var: Operand,
    epilogue: BnEpilogue<Operand>,
    y: Operand,
    mean: Operand,
    inv_std: Operand,
    scratch: Operand,
) {
    let rows = n * hw;
    assert!(rows > 0 && x.len == rows * c, "batch-norm input shape");
    alike(&x, &y, "batch-norm output");
    per_channel(
        c,
        [
            (&gamma, "γ"),
            (&beta, "β"),
            (&running_mean, "running mean"),
            (&running_var, "running variance"),
            (&mean, "mean"),
            (&inv_std, "inverse deviation"),
        ],
    );
    let chunks = batch_norm_scratch(&scratch, rows, c);
    let (rows_i, c_i) = (rows as i64, int(c, "channels"));
    raw::bn_stats_partial(
        l,
        x.ptr,
        x.bf(),
        rows_i,
        c_i,
        BN_CHUNK_ROWS as i32,
        scratch.ptr,
    );
    let sums = fold_to_one(l, &scratch, c, chunks);
    raw::bn_stats_finish(
        l,
        sums,
        x.ptr,
        x.bf(),
        rows_i,
        c_i,
        config.momentum,
        config.eps,
        running_mean.ptr,
        running_var.ptr,
        mean.ptr,
        inv_std.ptr,
    );
    let (z, relu) = match epilogue {
        BnEpilogue::Identity => (0, 0),
        BnEpilogue::Relu => (0, 1),
        BnEpilogue::AddRelu(z) => {
            alike(&x, &z, "batch-norm residual");
            (z.ptr, 1)
        }
    };
    raw::bn_forward_apply(
        l,
        x.ptr,
        z,
        y.ptr,
        x.bf(),
        rows_i,
        c_i,
        mean.ptr,
        inv_std.ptr,
        gamma.ptr,
        beta.ptr,
        relu,
    );
}

/// Batch-norm backward through `epilogue` from the forward pass's input `x`, mean and
/// inverse deviation: overwrites `dx` (and the residual's `dz`), accumulates `dgamma` and
/// `dbeta`; `scratch` of [`batch_norm_scratch_len`] f32s.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_backward(
    l: &(impl KernelLauncher + ?Sized),
    (n, c, hw): (usize, usize, usize),
    x: Operand,
    mean: Operand,
    inv_std: Operand,
    gamma: Operand,
    epilogue: BnEpilogueGrad<Operand, Operand>,
    dy: Operand,
    dx: Operand,
    dgamma: Operand,
    dbeta: Operand,
    scratch: Operand,
) {
    let rows = n * hw;
    assert!(rows > 0 && x.len == rows * c, "batch-norm input shape");
    alike(&x, &dy, "batch-norm output gradient");
    alike(&x, &dx, "batch-norm input gradient");
    per_channel(
        c,
        [
            (&gamma, "γ"),
            (&mean, "mean"),
            (&inv_std, "inverse deviation"),
            (&dgamma, "dγ"),
            (&dbeta, "dβ"),
        ],
    );
    let (y, dz) = match epilogue {
        BnEpilogueGrad::Identity => (0, 0),
        BnEpilogueGrad::Relu { y } => {
            alike(&x, &y, "batch-norm forward output");
            (y.ptr, 0)
        }
        BnEpilogueGrad::AddRelu { y, dz } => {
            alike(&x, &y, "batch-norm forward output");
            alike(&x, &dz, "batch-norm residual gradient");
            (y.ptr, dz.ptr)
        }
    };
    let chunks = batch_norm_scratch(&scratch, rows, c);
    let (rows_i, c_i) = (rows as i64, int(c, "channels"));
    raw::bn_grad_partial(
        l,
        x.ptr,
        dy.ptr,
        y,
        x.bf(),
        rows_i,
        c_i,
        BN_CHUNK_ROWS as i32,
        mean.ptr,
        inv_std.ptr,
        scratch.ptr,
    );
    let sums = fold_to_one(l, &scratch, c, chunks);
    raw::bn_grad_finish(l, sums, c_i, dgamma.ptr, dbeta.ptr);
    raw::bn_backward_apply(
        l,
        x.ptr,
        dy.ptr,
        y,
        dz,
        dx.ptr,
        x.bf(),
        rows_i,
        c_i,
        mean.ptr,
        inv_std.ptr,
        gamma.ptr,
        sums,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `extern "C" __global__ void NAME(PARAMS)` in `source`, in order, with the C types
    /// of the parameters.
    fn declared(source: &str) -> Vec<(String, Vec<CType>)> {
        source
            .split("extern \"C\" __global__ void ")
            .skip(1)
            .map(|rest| {
                let (name, rest) = rest.split_once('(').expect("a kernel's parameters");
                let params = rest.split_once(')').expect("a kernel's parameters").0;
                let types = params
                    .split(',')
                    .map(|p| {
                        let p = p.split_whitespace().collect::<Vec<_>>().join(" ");
                        match p.as_str() {
                            p if p.contains('*') => CType::Pointer,
                            p if p.starts_with("int ") => CType::Int,
                            p if p.starts_with("long long ") => CType::LongLong,
                            p if p.starts_with("float ") => CType::Float,
                            p => panic!("{name}: parameter `{p}` of a type the launcher has no Rust type for"),
                        }
                    })
                    .collect();
                (name.trim().to_string(), types)
            })
            .collect()
    }

    #[test]
    fn every_kernel_is_called_with_the_c_types_it_declares_in_their_order() {
        let declared = declared(SOURCE);
        let called: Vec<(String, Vec<CType>)> = SIGNATURES
            .iter()
            .map(|(n, t)| (n.to_string(), t.to_vec()))
            .collect();
        assert_eq!(
            declared, called,
            "cuda_kernels.cu and the kernels! declarations disagree (each kernel in the source's order)"
        );
    }

    #[test]
    fn the_declaration_check_sees_a_parameter_of_the_wrong_width() {
        let source = "extern \"C\" __global__ void k(const float* x, int n) {}\n\
                      extern \"C\" __global__ void m(long long n, float a) {}";
        assert_eq!(
            declared(source),
            vec![
                ("k".to_string(), vec![CType::Pointer, CType::Int]),
                ("m".to_string(), vec![CType::LongLong, CType::Float]),
            ]
        );
        assert_ne!(declared(source)[0].1, vec![CType::Pointer, CType::LongLong]);
    }

    #[test]
    fn a_launch_covers_every_output_and_stops_growing_at_the_cap() {
        assert_eq!(blocks(1), 1);
        assert_eq!(blocks(BLOCK as usize), 1);
        assert_eq!(blocks(BLOCK as usize + 1), 2);
        assert_eq!(blocks(usize::MAX / 2), 65_535 * 8);
    }
}
