//! The CUDA backend: cuDNN for convolutions and batch norm, cuBLAS for the classifier's
//! GEMMs, NVRTC kernels (`cuda_kernels.cu`) for the rest, all on one stream of one GPU.
//!
//! * Layout: 4-D activations are NHWC; conv weights get a KRSC working copy of the
//!   activations' type each forward pass (the f32 KCRS masters stay what PyTorch and the
//!   checkpoints have), and weight gradients come back the same way into the f32 gradients.
//! * Precision: activations in f32 or bf16 (cuDNN computes in f32 either way, with tensor
//!   cores for bf16); parameters, gradients, batch-norm statistics, the classifier and the
//!   loss in f32.
//! * Memory: step temporaries ([`Backend::alloc`]) come from one arena ([`super::arena`]),
//!   each freed as soon as nothing holds it (gradients of activations layer by layer, each
//!   activation once its backward has run), recycled whole by [`Backend::begin_step`] and
//!   sized from the peak the first step measured, so a step allocates nothing from the
//!   driver and lands on the same addresses every time (what a CUDA graph capture needs).
//!   Parameters, optimizer state and uploads own their allocations.
//! * Images reach the GPU without stopping it: each 4-D upload is copied into page-locked
//!   memory and sent on a stream of its own, while the compute stream still runs the step
//!   before (see [`Staging`]).
//! * Convolution algorithms are found once per shape with `cudnnFind…Ex` on the real
//!   buffers (as PyTorch's `cudnn.benchmark`) and cached with their workspace needs.
//!
//! Every library is loaded at run time by `cudarc`, so this builds and the rest of the
//! trainer runs on machines without CUDA; [`CudaBackend::new`] says what is missing.
//! Failures inside an operation (a cuDNN status, an exhausted arena) panic with the call
//! and the shapes: the [`Backend`] contract has no error path, like a shape mismatch.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::ops::Range;
use std::rc::Rc;
use std::sync::Arc;

use cudarc::cublas::sys as cublas;
use cudarc::cudnn::sys as cudnn;
use cudarc::driver::sys::{CUdeviceptr, CUstream};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice, result,
};

use crate::collective::{Collective, CollectiveError, ReduceOp};

use super::arena::{ArenaBook, Lease, Placement};
use super::kernels::{self, KernelLauncher, Operand};
use super::{
    Backend, BatchNormConfig, BnEpilogue, BnEpilogueGrad, BnEpilogueKind, ConvShape, Matrix,
    PoolShape,
};
use crate::engine::tensor::DType;

/// Workspace cuDNN's algorithm search may use (algorithms needing more are not tried). On
/// an H200 at batch 256 the fastest algorithms of ResNet-50 need 212 MB at most; the
/// search's workspace is live while the first step's activations are, so it counts in the
/// process's peak memory.
const FIND_WORKSPACE_BYTES: usize = 256 << 20;

/// How convolution algorithms are chosen (`RINGMASTER_CUDNN_SEARCH`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AlgorithmSearch {
    /// cuDNN's Find: every algorithm timed on the call's own buffers, the fastest kept (as
    /// PyTorch's `cudnn.benchmark`). The choice can differ between processes and runs.
    Find,
    /// cuDNN's heuristics: no timing, the same choice in every process and run (for
    /// reproducible results, as PyTorch without `cudnn.benchmark`).
    Heuristic,
}

impl AlgorithmSearch {
    /// The variable that chooses.
    pub const ENV: &'static str = "RINGMASTER_CUDNN_SEARCH";

    /// From `RINGMASTER_CUDNN_SEARCH` (`find`, the default, or `heuristic`).
    pub fn from_env() -> Result<Self, CudaError> {
        match std::env::var(Self::ENV).as_deref() {
            Err(_) | Ok("find") => Ok(Self::Find),
            Ok("heuristic") => Ok(Self::Heuristic),
            Ok(other) => Err(CudaError::Setting {
                name: Self::ENV,
                value: other.to_string(),
                expected: "find (time the algorithms, the default) or heuristic (cuDNN's heuristics: the same choice in every process)",
            }),
        }
    }
}

/// Alignment of arena allocations (cuDNN and tensor cores want 128 bytes or more).
const ARENA_ALIGN: usize = 256;

/// The arena grows in steps of this (the driver's allocation granularity for large blocks).
const ARENA_GRANULE: usize = 2 << 20;

/// cuBLAS's workspace: what NVIDIA recommends for Hopper (32 MiB).
const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// Upload lengths whose [`Staging`] is kept; a new one past this many drops the others
/// (a training run uploads batches of one or two shapes).
const STAGING_KEPT: usize = 4;

/// Why the CUDA backend could not start.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A library is not on the library path.
    #[error("{library} does not load ({hint})")]
    Missing {
        /// The library.
        library: &'static str,
        /// What to do about it.
        hint: &'static str,
    },
    /// The process's GPU is not among those it sees.
    #[error(
        "GPU {ordinal} is not there: this process sees {devices} (one process per GPU, GPU = local rank: give each worker as many GPUs as it runs processes)"
    )]
    NoSuchGpu {
        /// The GPU asked for.
        ordinal: usize,
        /// GPUs visible.
        devices: usize,
    },
    /// A setting's value is not one it takes.
    #[error("{name}={value}: expected {expected}")]
    Setting {
        /// The environment variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What it takes.
        expected: &'static str,
    },
    /// A driver call failed.
    #[error("CUDA driver: {context}: {source}")]
    Driver {
        /// What was being done.
        context: String,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// The kernels did not compile.
    #[error("NVRTC compiling the backend's kernels for sm_{arch}: {message}")]
    Nvrtc {
        /// The GPU architecture.
        arch: String,
        /// NVRTC's error and log.
        message: String,
    },
    /// A cuDNN or cuBLAS call failed at start.
    #[error("{call} returned {status}")]
    Library {
        /// The call.
        call: &'static str,
        /// Its status.
        status: String,
    },
    /// The arena does not fit.
    #[error(
        "the arena of {wanted} bytes does not fit in the GPU's {free} free bytes (set RINGMASTER_CUDA_ARENA_MIB lower)"
    )]
    ArenaTooLarge {
        /// Requested.
        wanted: usize,
        /// Free on the device.
        free: usize,
    },
}

/// The arena to reserve at start, in MiB, from `RINGMASTER_CUDA_ARENA_MIB` (0 when unset:
/// the arena is sized from the first step's peak instead).
fn arena_mib_setting() -> Result<usize, CudaError> {
    const NAME: &str = "RINGMASTER_CUDA_ARENA_MIB";
    match std::env::var(NAME) {
        Err(_) => Ok(0),
        Ok(value) => value.trim().parse().map_err(|_| CudaError::Setting {
            name: NAME,
            value,
            expected: "a whole number of MiB to reserve for step temporaries at start",
        }),
    }
}

/// NVRTC is missing: the one check before cudarc, which panics on a library it cannot load.
fn nvrtc_missing() -> Option<CudaError> {
    // SAFETY: a dlopen probe.
    (!unsafe { cudarc::nvrtc::sys::is_culib_present() }).then_some(CudaError::Missing {
        library: "libnvrtc.so",
        hint: "add NVRTC's folder (with libnvrtc-builtins) to LD_LIBRARY_PATH",
    })
}

/// CUDA `source` (such as [`kernels::SOURCE`]) as machine code for compute capability
/// `major.minor` (`sm_XY` CUBIN): PTX would be compiled again by the driver, which refuses
/// PTX from an NVRTC newer than itself. Needs NVRTC only, no GPU, so the kernels are
/// checked on machines without one.
pub fn compile_kernels(source: &str, major: i32, minor: i32) -> Result<Vec<u8>, CudaError> {
    use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
    if let Some(missing) = nvrtc_missing() {
        return Err(missing);
    }
    let arch = format!("{major}{minor}");
    let fail = |message: String| CudaError::Nvrtc {
        arch: arch.clone(),
        message,
    };
    let source = std::ffi::CString::new(source).map_err(|e| fail(e.to_string()))?;
    let name = std::ffi::CString::new("ringmaster_kernels.cu").expect("no NUL");
    let program = nvrtc::create_program(&source, Some(&name)).map_err(|e| fail(e.to_string()))?;
    let options = [
        format!("--gpu-architecture=sm_{arch}"),
        "-default-device".to_string(),
    ];
    // SAFETY: `program` is live until destroyed at the end; the out-pointers are live locals
    // and the CUBIN buffer has the size NVRTC reported.
    let result = unsafe {
        match nvrtc::compile_program(program, &options) {
            Err(e) => {
                let log = nvrtc::get_program_log(program)
                    .map(|log| {
                        log.iter()
                            .take_while(|&&c| c != 0)
                            .map(|&c| c as u8 as char)
                            .collect::<String>()
                    })
                    .unwrap_or_default();
                Err(fail(format!("{e}: {log}")))
            }
            Ok(()) => {
                let mut size = 0usize;
                nvrtc_sys::nvrtcGetCUBINSize(program, &mut size);
                let mut cubin = vec![0u8; size];
                let status = nvrtc_sys::nvrtcGetCUBIN(program, cubin.as_mut_ptr().cast());
                if size == 0 || status != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
                    Err(fail(format!("no CUBIN ({status:?}, {size} bytes)")))
                } else {
                    Ok(cubin)
                }
            }
        }
    };
    // SAFETY: created above, destroyed once.
    unsafe { nvrtc::destroy_program(program) }.ok();
    result
}

fn driver<T>(
    context: impl FnOnce() -> String,
    r: Result<T, cudarc::driver::DriverError>,
) -> Result<T, CudaError> {
    r.map_err(|source| CudaError::Driver {
        context: context(),
        source,
    })
}

/// Panics with the call's name when cuDNN did not succeed (inside operations).
fn check_cudnn(status: cudnn::cudnnStatus_t, call: &str) {
    assert!(
        status == cudnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS,
        "{call} returned {status:?}"
    );
}

fn check_cublas(status: cublas::cublasStatus_t, call: &str) {
    assert!(
        status == cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS,
        "{call} returned {status:?}"
    );
}

/// A cuDNN call's failure while the backend starts.
fn cudnn_at_start(status: cudnn::cudnnStatus_t, call: &'static str) -> Result<(), CudaError> {
    match status {
        cudnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS => Ok(()),
        status => Err(CudaError::Library {
            call,
            status: format!("{status:?}"),
        }),
    }
}

/// A cuBLAS call's failure while the backend starts.
fn cublas_at_start(status: cublas::cublasStatus_t, call: &'static str) -> Result<(), CudaError> {
    match status {
        cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
        status => Err(CudaError::Library {
            call,
            status: format!("{status:?}"),
        }),
    }
}

/// A temporary's hold on its place in the arena (spilled ones own their memory).
type ArenaLease = Lease<CudaSlice<u8>>;

/// What keeps a buffer's memory.
#[derive(Clone, Debug)]
enum Owner {
    /// An allocation of its own, freed with the last clone.
    Slice { _memory: Rc<CudaSlice<u8>> },
    /// A place in the arena, free again with the last clone (or at the next step).
    Arena { _lease: Rc<ArenaLease> },
}

/// Memory on the GPU: a place, a length and a type, kept by `owner`. Arena buffers are
/// valid until the last clone is dropped, at most until the next [`Backend::begin_step`].
#[derive(Clone)]
pub struct CudaBuf {
    ptr: CUdeviceptr,
    len: usize,
    dtype: DType,
    owner: Owner,
}

impl std::fmt::Debug for CudaBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBuf")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("dtype", &self.dtype)
            .field("owned", &matches!(self.owner, Owner::Slice { .. }))
            .finish()
    }
}

/// A read-only view of device memory.
#[derive(Clone, Copy, Debug)]
pub struct DevView<'a> {
    ptr: CUdeviceptr,
    len: usize,
    dtype: DType,
    _borrow: PhantomData<&'a ()>,
}

/// A writable view of device memory.
#[derive(Debug)]
pub struct DevViewMut<'a> {
    ptr: CUdeviceptr,
    len: usize,
    dtype: DType,
    _borrow: PhantomData<&'a mut ()>,
}

/// A place in device memory that outlives the borrow it came from (saved state).
#[derive(Clone, Copy, Debug)]
pub struct DevPtr {
    ptr: CUdeviceptr,
    len: usize,
    dtype: DType,
}

impl From<DevView<'_>> for DevPtr {
    fn from(v: DevView<'_>) -> Self {
        Self {
            ptr: v.ptr,
            len: v.len,
            dtype: v.dtype,
        }
    }
}

impl From<&DevViewMut<'_>> for DevPtr {
    fn from(v: &DevViewMut<'_>) -> Self {
        Self {
            ptr: v.ptr,
            len: v.len,
            dtype: v.dtype,
        }
    }
}

/// Memory the NVRTC kernels take ([`kernels::Operand`]): buffers, views and saved places.
macro_rules! operand {
    ($($t:ty),+) => {$(
        impl $t {
            fn op(&self) -> Operand {
                // SAFETY: device memory of this context holding `len` elements of `dtype`
                // (owned, an arena temporary, or a view of either), 256-byte aligned at
                // its start and element-aligned within; work on it is ordered on our one
                // stream.
                unsafe { Operand::new(self.ptr, self.len, self.dtype) }
            }
        }
    )+};
}

operand!(CudaBuf, DevView<'_>, DevViewMut<'_>, DevPtr);

/// What a convolution keeps: the KRSC working copy of its weight.
#[derive(Clone, Debug)]
pub struct CudaConvSaved {
    weight: CudaBuf,
}

/// What a training batch norm keeps: its input (held in the arena until backward), the
/// batch's mean and inverse deviation, and cuDNN's reserve space when the fused `…Ex` call
/// ran.
#[derive(Clone, Debug)]
pub struct CudaBnSaved {
    x: DevPtr,
    /// The arena temporary `x` lies in, kept alive for backward.
    _x_held: Option<Rc<ArenaLease>>,
    mean: CudaBuf,
    inv_var: CudaBuf,
    /// The reserve space (and its length in bytes) the fused forward pass filled for its
    /// backward.
    reserve: Option<(CudaBuf, usize)>,
}

/// What a max pool keeps: the winners' indices.
#[derive(Clone, Debug)]
pub struct CudaPoolSaved {
    argmax: CudaBuf,
}

fn cudnn_type(dtype: DType) -> cudnn::cudnnDataType_t {
    match dtype {
        DType::F32 => cudnn::cudnnDataType_t::CUDNN_DATA_FLOAT,
        DType::Bf16 => cudnn::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
    }
}

/// An NHWC tensor descriptor.
struct TensorDesc(cudnn::cudnnTensorDescriptor_t);

impl TensorDesc {
    fn nhwc(dtype: DType, n: usize, c: usize, h: usize, w: usize) -> Self {
        Self::new(
            cudnn::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
            dtype,
            [n, c, h, w],
        )
    }

    fn new(format: cudnn::cudnnTensorFormat_t, dtype: DType, [n, c, h, w]: [usize; 4]) -> Self {
        let mut d = std::ptr::null_mut();
        // SAFETY: out-pointer to a live local; the descriptor is destroyed in Drop.
        unsafe {
            check_cudnn(
                cudnn::cudnnCreateTensorDescriptor(&mut d),
                "cudnnCreateTensorDescriptor",
            );
            check_cudnn(
                cudnn::cudnnSetTensor4dDescriptor(
                    d,
                    format,
                    cudnn_type(dtype),
                    n as i32,
                    c as i32,
                    h as i32,
                    w as i32,
                ),
                "cudnnSetTensor4dDescriptor",
            );
        }
        Self(d)
    }

    /// The f32 `1×c×1×1` descriptor batch norm wants for its scale, bias and statistics,
    /// made explicitly: `cudnnDeriveBNTensorDescriptor` promises f32 for half inputs only,
    /// and the parameters are f32 whatever the activations' type. Contiguous NCHW, as
    /// PyTorch describes them (for 1×c×1×1 NHWC's strides differ only where the size is 1).
    fn batch_norm_params(c: usize) -> Self {
        Self::new(
            cudnn::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
            DType::F32,
            [1, c, 1, 1],
        )
    }
}

impl Drop for TensorDesc {
    fn drop(&mut self) {
        // SAFETY: created by cudnnCreateTensorDescriptor, destroyed once.
        unsafe { cudnn::cudnnDestroyTensorDescriptor(self.0) };
    }
}

struct FilterDesc(cudnn::cudnnFilterDescriptor_t);

impl Drop for FilterDesc {
    fn drop(&mut self) {
        // SAFETY: created by cudnnCreateFilterDescriptor, destroyed once.
        unsafe { cudnn::cudnnDestroyFilterDescriptor(self.0) };
    }
}

struct ConvDesc(cudnn::cudnnConvolutionDescriptor_t);

impl Drop for ConvDesc {
    fn drop(&mut self) {
        // SAFETY: created by cudnnCreateConvolutionDescriptor, destroyed once.
        unsafe { cudnn::cudnnDestroyConvolutionDescriptor(self.0) };
    }
}

/// Batch norm over N, H and W per channel, in the plain calls (inference, and training
/// where the fused calls are not supported).
const BN_MODE: cudnn::cudnnBatchNormMode_t = cudnn::cudnnBatchNormMode_t::CUDNN_BATCHNORM_SPATIAL;

/// The fused `…Ex` calls' mode: the NHWC mode PyTorch takes for channels-last training in
/// f32 and f16 (for bf16 PyTorch uses its own kernels), and the only mode in which cuDNN
/// fuses the ReLU and the residual add. Whether cuDNN runs bf16 through it fast is for the
/// benchmark to say (it runs each [`BatchNormEngine`]).
const BN_EX_MODE: cudnn::cudnnBatchNormMode_t =
    cudnn::cudnnBatchNormMode_t::CUDNN_BATCHNORM_SPATIAL_PERSISTENT;

/// Chooses the [`BatchNormEngine`]: `fused` (the default), `plain` or `own`.
pub const BATCH_NORM_ENV: &str = "RINGMASTER_CUDA_BATCH_NORM";

/// What computes training batch norm on the GPU ([`BATCH_NORM_ENV`]); inference always takes
/// cuDNN's plain call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchNormEngine {
    /// cuDNN's fused `…Ex` calls where cuDNN takes the shape, type and epilogue, else its
    /// plain calls with our add and ReLU kernels (`fused`, the default).
    CudnnFused,
    /// cuDNN's plain calls with our add and ReLU kernels (`plain`: to compare, or to step
    /// around a cuDNN problem).
    CudnnPlain,
    /// Our kernels ([`kernels::batch_norm_forward_training`]), the epilogue in the same pass
    /// and the output rounded once (`own`).
    Own,
}

impl BatchNormEngine {
    /// Every engine, in the order the benchmark runs them.
    pub const ALL: [Self; 3] = [Self::CudnnFused, Self::CudnnPlain, Self::Own];

    /// Its value of [`BATCH_NORM_ENV`].
    pub fn name(self) -> &'static str {
        match self {
            Self::CudnnFused => "fused",
            Self::CudnnPlain => "plain",
            Self::Own => "own",
        }
    }

    /// The engine [`BATCH_NORM_ENV`] names (the default when unset).
    pub fn from_env() -> Result<Self, CudaError> {
        if let Ok(value) = std::env::var("RINGMASTER_CUDA_FUSED_BN") {
            return Err(CudaError::Setting {
                name: "RINGMASTER_CUDA_FUSED_BN",
                value,
                expected: "nothing: RINGMASTER_CUDA_BATCH_NORM=plain (or fused, or own) replaces it",
            });
        }
        match std::env::var(BATCH_NORM_ENV) {
            Err(_) => Ok(Self::CudnnFused),
            Ok(value) => {
                Self::ALL
                    .into_iter()
                    .find(|e| e.name() == value)
                    .ok_or(CudaError::Setting {
                        name: BATCH_NORM_ENV,
                        value,
                        expected: "fused, plain or own",
                    })
            }
        }
    }
}

/// What a training batch norm fuses, as cuDNN names it.
fn bn_ops(kind: BnEpilogueKind) -> cudnn::cudnnBatchNormOps_t {
    use cudnn::cudnnBatchNormOps_t::*;
    match kind {
        BnEpilogueKind::Identity => CUDNN_BATCHNORM_OPS_BN,
        BnEpilogueKind::Relu => CUDNN_BATCHNORM_OPS_BN_ACTIVATION,
        BnEpilogueKind::AddRelu => CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION,
    }
}

/// A ReLU activation descriptor (the fused batch norm's).
struct ActivationDesc(cudnn::cudnnActivationDescriptor_t);

impl ActivationDesc {
    fn relu() -> Self {
        let mut d = std::ptr::null_mut();
        // SAFETY: out-pointer to a live local; destroyed in Drop.
        unsafe {
            check_cudnn(
                cudnn::cudnnCreateActivationDescriptor(&mut d),
                "cudnnCreateActivationDescriptor",
            );
            check_cudnn(
                cudnn::cudnnSetActivationDescriptor(
                    d,
                    cudnn::cudnnActivationMode_t::CUDNN_ACTIVATION_RELU,
                    cudnn::cudnnNanPropagation_t::CUDNN_PROPAGATE_NAN,
                    0.0,
                ),
                "cudnnSetActivationDescriptor",
            );
        }
        Self(d)
    }
}

impl Drop for ActivationDesc {
    fn drop(&mut self) {
        // SAFETY: created by cudnnCreateActivationDescriptor, destroyed once.
        unsafe { cudnn::cudnnDestroyActivationDescriptor(self.0) };
    }
}

/// A cuDNN algorithm search result.
trait AlgoPerf {
    type Algo: Copy;
    fn succeeded(&self) -> bool;
    fn algo(&self) -> Self::Algo;
    fn math(&self) -> cudnn::cudnnMathType_t;
}

macro_rules! algo_perf {
    ($($perf:ty => $algo:ty),+) => {$(
        impl AlgoPerf for $perf {
            type Algo = $algo;
            fn succeeded(&self) -> bool {
                self.status == cudnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS
            }
            fn algo(&self) -> $algo {
                self.algo
            }
            fn math(&self) -> cudnn::cudnnMathType_t {
                self.mathType
            }
        }
    )+};
}

algo_perf!(
    cudnn::cudnnConvolutionFwdAlgoPerf_t => cudnn::cudnnConvolutionFwdAlgo_t,
    cudnn::cudnnConvolutionBwdDataAlgoPerf_t => cudnn::cudnnConvolutionBwdDataAlgo_t,
    cudnn::cudnnConvolutionBwdFilterAlgoPerf_t => cudnn::cudnnConvolutionBwdFilterAlgo_t
);

/// The math type a convolution in `dtype` is searched with: f32 stays true f32 (FMA, no
/// TF32), so it matches the CPU reference tightly; bf16 may use tensor cores.
fn search_math(dtype: DType) -> cudnn::cudnnMathType_t {
    match dtype {
        DType::F32 => cudnn::cudnnMathType_t::CUDNN_FMA_MATH,
        DType::Bf16 => cudnn::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
    }
}

/// What cuDNN's Find picked for one direction of a convolution: the algorithm, the math
/// type it timed it with, and the workspace it needs with that math type. The math type is
/// set on the descriptor before each call, as PyTorch does: Find picks an (algorithm, math
/// type) pair, and the algorithm run under another math type may be a slower kernel.
#[derive(Clone, Copy, Debug)]
struct Found<A> {
    algo: A,
    math: cudnn::cudnnMathType_t,
    workspace: usize,
}

/// The fastest algorithm that ran, and its math type: cuDNN's `Find` returns its results
/// sorted by time. f32 keeps FMA whatever was timed (no TF32 behind the reference's back).
fn fastest<P: AlgoPerf>(
    results: &[P],
    direction: &str,
    s: &ConvShape,
    dtype: DType,
) -> (P::Algo, cudnn::cudnnMathType_t) {
    let perf = results
        .iter()
        .find(|p| p.succeeded())
        .unwrap_or_else(|| panic!("no {direction} convolution algorithm for {s:?} in {dtype:?}"));
    let math = match dtype {
        DType::F32 => search_math(dtype),
        DType::Bf16 => perf.math(),
    };
    (perf.algo(), math)
}

/// A convolution's descriptors and, per direction, what Find picked. Each direction is
/// searched the first time it runs, with that call's own buffers (as PyTorch's
/// `cudnn.benchmark` does), so a direction never asked for is never searched: the stem's
/// backward-data (the image's gradient, which nothing reads) is not computed at all.
struct ConvPlan {
    x: TensorDesc,
    y: TensorDesc,
    w: FilterDesc,
    conv: ConvDesc,
    dtype: DType,
    forward: std::cell::OnceCell<Found<cudnn::cudnnConvolutionFwdAlgo_t>>,
    backward_data: std::cell::OnceCell<Found<cudnn::cudnnConvolutionBwdDataAlgo_t>>,
    backward_filter: std::cell::OnceCell<Found<cudnn::cudnnConvolutionBwdFilterAlgo_t>>,
}

impl ConvPlan {
    /// Sets `math` on the convolution descriptor: a host-side setting, allowed while a step
    /// is recorded.
    fn use_math(&self, math: cudnn::cudnnMathType_t) {
        // SAFETY: a live descriptor owned by the plan.
        check_cudnn(
            unsafe { cudnn::cudnnSetConvolutionMathType(self.conv.0, math) },
            "cudnnSetConvolutionMathType",
        );
    }
}

/// Batch norm's `(n, c, hw)`, activations' type and fused operations.
type BnKey = (usize, usize, usize, DType, BnEpilogueKind);

/// Batch norm's descriptors for one input shape and epilogue.
struct BnPlan {
    x: TensorDesc,
    params: TensorDesc,
    /// The fused `…Ex` calls, when cuDNN's size queries take them for this shape, type and
    /// epilogue.
    fused: Option<FusedBn>,
    /// Set when a fused call refused what the size queries accepted: the plain calls from
    /// then on (found in the warm-up steps, before any recording).
    refused: std::cell::Cell<bool>,
    /// Whether the fused forward and backward call (in that order) have each succeeded once.
    worked: std::cell::Cell<[bool; 2]>,
}

/// Which fused batch-norm call: the index into [`BnPlan::worked`].
#[derive(Clone, Copy)]
enum BnCall {
    Forward = 0,
    Backward = 1,
}

impl BnPlan {
    /// The fused calls, unless cuDNN refused them.
    fn fused(&self) -> Option<&FusedBn> {
        self.fused.as_ref().filter(|_| !self.refused.get())
    }

    /// Whether `status` (of a fused call) is a refusal to fall back from, which switches
    /// this plan to the plain calls. A call's first failure is taken as one (cuDNN's
    /// detailed codes for what its fused kernels do not take are not all documented; the
    /// plain calls compute the same, and the status is printed), unless the kernel ran and
    /// failed (5xxx); once a call has worked, a failure other than a refusal is a mistake
    /// of ours, and panics.
    fn refuses(&self, status: cudnn::cudnnStatus_t, call: BnCall) -> bool {
        let name = match call {
            BnCall::Forward => "cudnnBatchNormalizationForwardTrainingEx",
            BnCall::Backward => "cudnnBatchNormalizationBackwardEx",
        };
        let mut worked = self.worked.get();
        if status == cudnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
            worked[call as usize] = true;
            self.worked.set(worked);
            return false;
        }
        // An execution failure (5xxx) means the GPU ran the kernel and it faulted: the error
        // can stay with the context, and the plain calls would fail with it under their name.
        if (worked[call as usize] && !is_refusal(status)) || status as u32 / 1000 == 5 {
            panic!("{name} returned {status:?}");
        }
        eprintln!(
            "ringmaster-trainer: {name} returned {status:?}; this batch norm takes cuDNN's plain calls"
        );
        self.refused.set(true);
        true
    }
}

/// Whether a cuDNN status says "not this": cuDNN 9 reports refusals with detailed codes in
/// the 3xxx range (`CUDNN_STATUS_NOT_SUPPORTED`, `…_SHAPE`, `…_LAYOUT`, `…_DATA_TYPE`), and
/// a bare `CUDNN_STATUS_BAD_PARAM` (2000) for a combination it does not take. The other
/// 2xxx codes (null or misaligned pointers, a workspace too small, a stream mismatch) are
/// our mistakes, and panic once the call has worked before.
fn is_refusal(status: cudnn::cudnnStatus_t) -> bool {
    let code = status as u32;
    code == 2000 || code / 1000 == 3
}

/// A batch-norm plan, as [`CudaBackend::batch_norm_plans`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchNormPlan {
    /// `(n, c, hw)`.
    pub dims: (usize, usize, usize),
    /// The activations' type.
    pub dtype: DType,
    /// What follows the normalisation.
    pub epilogue: BnEpilogueKind,
    /// Whether cuDNN's fused `…Ex` calls run it (else the plain calls and our kernels).
    pub fused: bool,
}

/// What the fused batch-norm calls need besides the plain ones.
struct FusedBn {
    ops: cudnn::cudnnBatchNormOps_t,
    relu: ActivationDesc,
    /// Workspace bytes of the forward and backward calls.
    workspace: [usize; 2],
    /// Reserve-space bytes the forward pass fills for the backward pass.
    reserve: usize,
}

impl FusedBn {
    /// The activation descriptor, or null when only batch norm runs (as cuDNN wants it).
    fn activation(&self) -> cudnn::cudnnActivationDescriptor_t {
        if self.ops == cudnn::cudnnBatchNormOps_t::CUDNN_BATCHNORM_OPS_BN {
            std::ptr::null_mut()
        } else {
            self.relu.0
        }
    }
}

/// The way an upload of one length reaches the GPU beside the compute stream: page-locked
/// host memory, which the copy engine reads at full speed while kernels run (from pageable
/// memory the driver would stage the copy itself, and may wait for the stream first), and
/// an f32 device buffer the layout and type conversion then reads on the compute stream.
///
/// Each upload of this length reuses both, taking turns by events: the conversion starts
/// only once the copy has landed, and the host refills the page-locked memory only once
/// the last copy has read it (`copied`, both); the copy stream overwrites the device buffer
/// only once the last conversion has read it (`consumed`). Ours, not the slices' own
/// events, which cudarc records only while it tracks events (the backend turns that off).
struct Staging {
    host: PinnedHostSlice<f32>,
    device: CudaSlice<f32>,
    /// Recorded on the copy stream when the copy has landed (blocking: the host sleeps
    /// while it waits, leaving the core to the loader).
    copied: CudaEvent,
    /// Recorded on the compute stream when the conversion has read `device` (and, first,
    /// when `device` was allocated on it).
    consumed: CudaEvent,
}

struct Inner {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Where uploads are copied, beside `stream` (see [`Staging`]).
    copy_stream: Arc<CudaStream>,
    /// Staging for 4-D uploads, by length.
    staging: RefCell<HashMap<usize, Staging>>,
    cudnn: cudnn::cudnnHandle_t,
    cublas: cublas::cublasHandle_t,
    /// cuBLAS's workspace (set on the handle; freed after it).
    _cublas_workspace: CudaSlice<u8>,
    kernels: HashMap<&'static str, CudaFunction>,
    /// Where the step's temporaries are placed, and which are held.
    arena: Rc<RefCell<ArenaBook<CudaSlice<u8>>>>,
    /// The arena's memory (none until a step has measured what it needs, unless
    /// `RINGMASTER_CUDA_ARENA_MIB` reserves it at start).
    arena_memory: RefCell<Option<CudaSlice<u8>>>,
    /// The largest workspace a library call has asked for (reports; the workspaces
    /// themselves are arena temporaries).
    workspace_peak: std::cell::Cell<usize>,
    conv_plans: RefCell<HashMap<(ConvShape, DType), Rc<ConvPlan>>>,
    bn_plans: RefCell<HashMap<BnKey, Rc<BnPlan>>>,
    /// Whether a recording exists: from then on the workspace must not move, since the
    /// recording holds its address.
    recorded: std::cell::Cell<bool>,
    /// Whether a step is being recorded now: an allocation would become the graph's own
    /// (freed and made again on every replay), a search would break the capture.
    capturing: std::cell::Cell<bool>,
    /// What computes training batch norm.
    batch_norm: std::cell::Cell<BatchNormEngine>,
    /// How convolution algorithms are chosen.
    search: AlgorithmSearch,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // No copy may still read page-locked memory when it is freed.
        self.copy_stream.synchronize().ok();
        self.conv_plans.borrow_mut().clear();
        self.bn_plans.borrow_mut().clear();
        // SAFETY: the handles were created in `new` and are destroyed once, after every
        // descriptor that was used with them.
        unsafe {
            cudnn::cudnnDestroy(self.cudnn);
            cublas::cublasDestroy_v2(self.cublas);
        }
    }
}

/// One GPU, one stream. Cheap to clone (shared); not `Send`, as cuDNN handles are not.
#[derive(Clone)]
pub struct CudaBackend {
    inner: Rc<Inner>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let arena = self.inner.arena.borrow();
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.inner.ctx.ordinal())
            .field("arena_bytes", &arena.size())
            .finish()
    }
}

impl CudaBackend {
    /// Starts on GPU `ordinal` (the local rank) with an arena of `arena_bytes` reserved for
    /// step temporaries (`None`: `RINGMASTER_CUDA_ARENA_MIB`, else none: the first step
    /// measures what the arena needs, and it grows to that at the second's start).
    pub fn new(ordinal: usize, arena_bytes: Option<usize>) -> Result<Self, CudaError> {
        let batch_norm = BatchNormEngine::from_env()?;
        let search = AlgorithmSearch::from_env()?;
        // SAFETY (each): a dlopen probe; cudarc panics on a library it cannot load.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::Missing {
                library: "libcuda.so.1",
                hint: "no NVIDIA driver, or the container runs without the GPU runtime",
            });
        }
        if !unsafe { cudnn::is_culib_present() } {
            return Err(CudaError::Missing {
                library: "libcudnn.so.9",
                hint: "add cuDNN's folder to LD_LIBRARY_PATH",
            });
        }
        if !unsafe { cublas::is_culib_present() } {
            return Err(CudaError::Missing {
                library: "libcublas.so",
                hint: "add cuBLAS's folder to LD_LIBRARY_PATH",
            });
        }
        if let Some(missing) = nvrtc_missing() {
            return Err(missing);
        }
        let devices = driver(|| "counting GPUs".into(), CudaContext::device_count())?;
        if ordinal >= devices as usize {
            return Err(CudaError::NoSuchGpu {
                ordinal,
                devices: devices as usize,
            });
        }
        let ctx = driver(
            || format!("opening GPU {ordinal}"),
            CudaContext::new(ordinal),
        )?;
        // One stream, ordered by us: cudarc's per-buffer events are not needed.
        // SAFETY: no buffer has been allocated on this context yet.
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own: the legacy default stream cannot be captured in a graph.
        let stream = driver(|| "creating a CUDA stream".into(), ctx.new_stream())?;
        let copy_stream = driver(|| "creating the upload stream".into(), ctx.new_stream())?;
        let (major, minor) = driver(|| "compute capability".into(), ctx.compute_capability())?;
        let cubin = compile_kernels(kernels::SOURCE, major, minor)?;
        let module = driver(
            || "loading the kernels".into(),
            ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)),
        )?;
        let mut kernels = HashMap::new();
        for &(name, _) in kernels::SIGNATURES {
            let f = driver(|| format!("kernel {name}"), module.load_function(name))?;
            kernels.insert(name, f);
        }
        let mut cudnn_handle = std::ptr::null_mut();
        let mut cublas_handle = std::ptr::null_mut();
        // SAFETY: out-pointers to live locals; the stream outlives the handles (Inner).
        unsafe {
            cudnn_at_start(cudnn::cudnnCreate(&mut cudnn_handle), "cudnnCreate")?;
            cudnn_at_start(
                cudnn::cudnnSetStream(cudnn_handle, stream.cu_stream() as _),
                "cudnnSetStream",
            )?;
            cublas_at_start(
                cublas::cublasCreate_v2(&mut cublas_handle),
                "cublasCreate_v2",
            )?;
            cublas_at_start(
                cublas::cublasSetStream_v2(cublas_handle, stream.cu_stream() as _),
                "cublasSetStream_v2",
            )?;
        }
        // cuBLAS's workspace given up front, so a captured step never makes it allocate.
        let cublas_workspace = driver(|| "allocating cuBLAS's workspace".into(), {
            stream.alloc_zeros::<u8>(CUBLAS_WORKSPACE_BYTES)
        })?;
        let (workspace_ptr, sync) = cublas_workspace.device_ptr(&stream);
        drop(sync);
        // SAFETY: the handle is live and the workspace outlives it (both in Inner, the
        // handle destroyed first).
        let s = unsafe {
            cublas::cublasSetWorkspace_v2(
                cublas_handle,
                workspace_ptr as *mut c_void,
                CUBLAS_WORKSPACE_BYTES,
            )
        };
        cublas_at_start(s, "cublasSetWorkspace_v2")?;
        let (free, _) = driver(|| "free memory".into(), ctx.mem_get_info())?;
        let size = match arena_bytes {
            Some(bytes) => bytes,
            None => arena_mib_setting()? << 20,
        };
        if size > free {
            return Err(CudaError::ArenaTooLarge { wanted: size, free });
        }
        let arena = ArenaBook::new(ARENA_ALIGN);
        let memory = if size > 0 {
            // SAFETY: the arena is only read after kernels or copies wrote it.
            let memory = driver(|| format!("reserving the {size}-byte arena"), unsafe {
                stream.alloc::<u8>(size)
            })?;
            let (base, sync) = memory.device_ptr(&stream);
            drop(sync);
            arena.borrow_mut().set_memory(base, size);
            Some(memory)
        } else {
            None
        };
        Ok(Self {
            inner: Rc::new(Inner {
                ctx,
                stream,
                copy_stream,
                staging: RefCell::new(HashMap::new()),
                cudnn: cudnn_handle,
                cublas: cublas_handle,
                _cublas_workspace: cublas_workspace,
                kernels,
                arena,
                arena_memory: RefCell::new(memory),
                workspace_peak: std::cell::Cell::new(0),
                conv_plans: RefCell::new(HashMap::new()),
                bn_plans: RefCell::new(HashMap::new()),
                recorded: std::cell::Cell::new(false),
                capturing: std::cell::Cell::new(false),
                batch_norm: std::cell::Cell::new(batch_norm),
                search,
            }),
        })
    }

    /// Sets what computes training batch norm from here on (at start, [`BATCH_NORM_ENV`]'s
    /// choice). Forgets the cuDNN plans made so far.
    pub fn set_batch_norm(&self, engine: BatchNormEngine) {
        self.inner.batch_norm.set(engine);
        self.inner.bn_plans.borrow_mut().clear();
    }

    /// What computes training batch norm.
    pub fn batch_norm_engine(&self) -> BatchNormEngine {
        self.inner.batch_norm.get()
    }

    /// Scratch for our batch-norm kernels over `(n, c, hw)`: an arena temporary, held by
    /// the caller while it queues the kernels that use it.
    fn batch_norm_scratch(&self, (n, c, hw): (usize, usize, usize)) -> CudaBuf {
        self.arena_alloc(kernels::batch_norm_scratch_len(n * hw, c), DType::F32)
    }

    /// The batch-norm plans made so far, sorted, and which of them cuDNN's fused calls run.
    pub fn batch_norm_plans(&self) -> Vec<BatchNormPlan> {
        let mut plans: Vec<_> = self
            .inner
            .bn_plans
            .borrow()
            .iter()
            .map(|(&(n, c, hw, dtype, epilogue), plan)| BatchNormPlan {
                dims: (n, c, hw),
                dtype,
                epilogue,
                fused: plan.fused().is_some(),
            })
            .collect();
        plans.sort_by_key(|p| (p.dims, p.dtype == DType::Bf16, p.epilogue));
        plans
    }

    /// The most arena memory one step has used so far, in bytes.
    pub fn arena_peak(&self) -> usize {
        self.inner.arena.borrow().peak()
    }

    /// The largest workspace a library call has asked for so far, in bytes (the
    /// algorithm search's own aside).
    pub fn workspace_bytes(&self) -> usize {
        self.inner.workspace_peak.get()
    }

    /// Device memory: (bytes in use on the GPU by every process, the arena's reservation).
    pub fn memory(&self) -> (usize, usize) {
        let (free, total) = self
            .inner
            .ctx
            .mem_get_info()
            .expect("querying the GPU's memory");
        (total - free, self.inner.arena.borrow().size())
    }

    fn stream(&self) -> CUstream {
        self.inner.stream.cu_stream()
    }

    /// An owned, zeroed allocation of `len` elements of `dtype`.
    fn owned(&self, len: usize, dtype: DType) -> CudaBuf {
        self.not_while_capturing("an allocation outside the arena");
        let bytes = (len * dtype.size()).max(1);
        let memory = self
            .inner
            .stream
            .alloc_zeros::<u8>(bytes)
            .unwrap_or_else(|e| panic!("allocating {bytes} bytes on the GPU: {e}"));
        let (ptr, sync) = memory.device_ptr(&self.inner.stream);
        drop(sync);
        CudaBuf {
            ptr,
            len,
            dtype,
            owner: Owner::Slice {
                _memory: Rc::new(memory),
            },
        }
    }

    /// Queues `host` onto the GPU through the [`Staging`] of its length, then `convert`
    /// on the compute stream from the staged f32 values once they have landed. Returns once
    /// `host` is copied out (the caller may reuse it); the copy runs beside whatever the
    /// compute stream still has queued. The host waits only for the last copy of this
    /// length to have been read (itself queued behind the conversion before it), so it runs
    /// at most about two uploads ahead of the GPU.
    fn staged_upload(&self, host: &[f32], convert: impl FnOnce(Operand)) {
        fn uploading<T>(len: usize, r: Result<T, cudarc::driver::DriverError>) -> T {
            r.unwrap_or_else(|e| panic!("uploading {len} values through page-locked memory: {e}"))
        }
        let len = host.len();
        let mut kept = self.inner.staging.borrow_mut();
        if !kept.contains_key(&len) {
            if kept.len() >= STAGING_KEPT {
                // The device buffers are freed in stream order, after the conversions that
                // read them; the page-locked memory only once no copy reads it.
                for staging in kept.values() {
                    uploading(len, staging.copied.synchronize());
                }
                kept.clear();
            }
            // SAFETY (both): written (by the host, then by the copy) before anything reads
            // them.
            let host = uploading(len, unsafe { self.inner.ctx.alloc_pinned::<f32>(len) });
            let device = uploading(len, unsafe { self.inner.stream.alloc::<f32>(len) });
            // The copy stream's first use of `device` waits for its allocation.
            let consumed = uploading(len, self.inner.stream.record_event(None));
            let blocking = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC);
            let copied = uploading(len, self.inner.ctx.new_event(blocking));
            kept.insert(
                len,
                Staging {
                    host,
                    device,
                    copied,
                    consumed,
                },
            );
        }
        let staging = kept.get_mut(&len).expect("kept above");
        // Waits until the last copy has read the page-locked memory (at once the first time:
        // an event never recorded is complete).
        uploading(len, staging.copied.synchronize());
        // On this thread, not rayon's pool, which may be decoding the next batch: `train`
        // uploads while the GPU still computes the step before, so this copy (150 MB for
        // 256 images at 224 px) is not on the GPU's path.
        uploading(len, staging.host.as_mut_slice()).copy_from_slice(host);
        let (compute, copy) = (&self.inner.stream, &self.inner.copy_stream);
        uploading(len, copy.wait(&staging.consumed));
        uploading(len, copy.memcpy_htod(&staging.host, &mut staging.device));
        uploading(len, staging.copied.record(copy));
        uploading(len, compute.wait(&staging.copied));
        let (staged, _) = staging.device.device_ptr(compute);
        // SAFETY: `len` f32s of device memory, which the copy above filled before the
        // compute stream goes on, and which no copy overwrites before `consumed`.
        convert(unsafe { Operand::new(staged, len, DType::F32) });
        uploading(len, staging.consumed.record(compute));
    }

    /// A step temporary: in the arena, or, past its end, in memory of its own until the
    /// arena grows at the next step's start.
    fn arena_alloc(&self, len: usize, dtype: DType) -> CudaBuf {
        let bytes = len * dtype.size();
        let (offset, placement) = self.inner.arena.borrow_mut().place(bytes);
        let (ptr, spill) = match placement {
            Placement::Arena(ptr) => (ptr, None),
            Placement::Spill => {
                self.not_while_capturing("a temporary past the arena's end");
                let rounded = self.inner.arena.borrow().rounded(bytes);
                // SAFETY: like every temporary, written before it is read.
                let memory =
                    unsafe { self.inner.stream.alloc::<u8>(rounded) }.unwrap_or_else(|e| {
                        panic!("allocating a {rounded}-byte step temporary on the GPU: {e}")
                    });
                let (ptr, sync) = memory.device_ptr(&self.inner.stream);
                drop(sync);
                (ptr, Some(memory))
            }
        };
        let lease = ArenaBook::lease(&self.inner.arena, offset, bytes, ptr, spill);
        CudaBuf {
            ptr,
            len,
            dtype,
            owner: Owner::Arena { _lease: lease },
        }
    }

    /// The arena temporary that holds device address `ptr`, kept alive by the returned
    /// lease (none for memory outside the arena: its owner keeps it).
    fn hold(&self, ptr: CUdeviceptr) -> Option<Rc<ArenaLease>> {
        self.inner.arena.borrow().holder_of(ptr)
    }

    /// Grows the arena to what the steps so far needed at most, unless a recorded step
    /// holds its address. Between steps only: no temporary is alive.
    fn fit_arena(&self) {
        let grow_to = self.inner.arena.borrow_mut().begin_step(ARENA_GRANULE);
        // A recorded step holds the arena's address; a capture may not allocate.
        let fixed = self.inner.recorded.get() || self.inner.capturing.get();
        let Some(size) = grow_to.filter(|_| !fixed) else {
            return;
        };
        let mut memory = self.inner.arena_memory.borrow_mut();
        // The old arena is freed in stream order, after the work queued on it.
        *memory = None;
        // SAFETY: the arena is only read after kernels or copies wrote it.
        let grown = unsafe { self.inner.stream.alloc::<u8>(size) }
            .unwrap_or_else(|e| panic!("growing the CUDA arena to {size} bytes: {e}"));
        let (base, sync) = grown.device_ptr(&self.inner.stream);
        drop(sync);
        self.inner.arena.borrow_mut().set_memory(base, size);
        *memory = Some(grown);
    }

    /// A workspace of `bytes` for one library call, from the arena like any temporary: it is
    /// free again once the call is queued (the caller holds the returned buffer until then),
    /// so it costs the arena's peak only where the step's peak is.
    fn workspace(&self, bytes: usize) -> (CUdeviceptr, usize, CudaBuf) {
        let bytes = bytes.max(1);
        let peak = &self.inner.workspace_peak;
        peak.set(peak.get().max(bytes));
        let held = self.arena_alloc(bytes.div_ceil(DType::F32.size()), DType::F32);
        (held.ptr, bytes, held)
    }

    /// Refuses what a step recorded as a CUDA graph cannot hold: an allocation, an
    /// algorithm search (it synchronises), a workspace that moves. `what` says which.
    fn not_while_capturing(&self, what: &str) {
        assert!(
            !self.inner.capturing.get(),
            "{what} while a step is recorded as a CUDA graph: run the same shapes in a \
             warm-up step first"
        );
    }

    /// The convolution's descriptors for this shape and type, made the first time it runs;
    /// each direction's algorithm is searched when that direction first runs.
    fn conv_plan(&self, s: &ConvShape, dtype: DType) -> Rc<ConvPlan> {
        if let Some(plan) = self.inner.conv_plans.borrow().get(&(*s, dtype)) {
            return plan.clone();
        }
        let (oh, ow) = s.output_size();
        let xd = TensorDesc::nhwc(dtype, s.n, s.c, s.h, s.w);
        let yd = TensorDesc::nhwc(dtype, s.n, s.out_channels, oh, ow);
        let mut wd = std::ptr::null_mut();
        let mut cd = std::ptr::null_mut();
        // SAFETY: out-pointers to live locals; descriptors are owned by the plan.
        unsafe {
            check_cudnn(
                cudnn::cudnnCreateFilterDescriptor(&mut wd),
                "cudnnCreateFilterDescriptor",
            );
            check_cudnn(
                cudnn::cudnnSetFilter4dDescriptor(
                    wd,
                    cudnn_type(dtype),
                    cudnn::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
                    s.out_channels as i32,
                    s.c as i32,
                    s.kernel as i32,
                    s.kernel as i32,
                ),
                "cudnnSetFilter4dDescriptor",
            );
            check_cudnn(
                cudnn::cudnnCreateConvolutionDescriptor(&mut cd),
                "cudnnCreateConvolutionDescriptor",
            );
            check_cudnn(
                cudnn::cudnnSetConvolution2dDescriptor(
                    cd,
                    s.padding as i32,
                    s.padding as i32,
                    s.stride as i32,
                    s.stride as i32,
                    1,
                    1,
                    cudnn::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                    cudnn::cudnnDataType_t::CUDNN_DATA_FLOAT,
                ),
                "cudnnSetConvolution2dDescriptor",
            );
        }
        let plan = Rc::new(ConvPlan {
            x: xd,
            y: yd,
            w: FilterDesc(wd),
            conv: ConvDesc(cd),
            dtype,
            forward: std::cell::OnceCell::new(),
            backward_data: std::cell::OnceCell::new(),
            backward_filter: std::cell::OnceCell::new(),
        });
        self.inner
            .conv_plans
            .borrow_mut()
            .insert((*s, dtype), plan.clone());
        plan
    }

    /// One direction's algorithm for `plan`, searched with `find` (cuDNN's `Find…Ex` on
    /// the call's own buffers, given the workspace, the count to fill and the results) and
    /// its workspace asked of `size` under the math type found. `calls` name the two for
    /// errors.
    #[allow(clippy::too_many_arguments)]
    fn search<P: AlgoPerf>(
        &self,
        plan: &ConvPlan,
        s: &ConvShape,
        direction: &str,
        calls: [&str; 3],
        find: impl FnOnce(*mut c_void, usize, &mut i32, &mut [P]) -> cudnn::cudnnStatus_t,
        heuristic: impl FnOnce(&mut i32, &mut [P]) -> cudnn::cudnnStatus_t,
        size: impl FnOnce(P::Algo, &mut usize) -> cudnn::cudnnStatus_t,
    ) -> Found<P::Algo> {
        self.not_while_capturing(&format!("a convolution's first {direction} pass"));
        plan.use_math(search_math(plan.dtype));
        let mut count = 0;
        // SAFETY: the results are plain C structs cuDNN fills (`count` of them); all-zero
        // is a valid value of each.
        let mut perf: [P; 8] = unsafe { std::mem::zeroed() };
        match self.inner.search {
            AlgorithmSearch::Find => {
                // The search's own workspace, freed once it is done (the algorithms found
                // need theirs, from the arena, when they run).
                let space = self.owned(FIND_WORKSPACE_BYTES / DType::F32.size(), DType::F32);
                let status = find(
                    space.ptr as *mut c_void,
                    FIND_WORKSPACE_BYTES,
                    &mut count,
                    &mut perf,
                );
                check_cudnn(status, calls[0]);
            }
            AlgorithmSearch::Heuristic => check_cudnn(heuristic(&mut count, &mut perf), calls[1]),
        }
        let (algo, math) = fastest(&perf[..count as usize], direction, s, plan.dtype);
        plan.use_math(math);
        let mut workspace = 0;
        check_cudnn(size(algo, &mut workspace), calls[2]);
        Found {
            algo,
            math,
            workspace,
        }
    }

    /// The forward algorithm of `plan`, found the first time it is asked for, with that
    /// call's buffers (the search overwrites `y`).
    fn forward_found(
        &self,
        plan: &ConvPlan,
        s: &ConvShape,
        x: CUdeviceptr,
        w: CUdeviceptr,
        y: CUdeviceptr,
    ) -> Found<cudnn::cudnnConvolutionFwdAlgo_t> {
        let h = self.inner.cudnn;
        *plan.forward.get_or_init(|| {
            self.search(
                plan,
                s,
                "forward",
                [
                    "cudnnFindConvolutionForwardAlgorithmEx",
                    "cudnnGetConvolutionForwardAlgorithm_v7",
                    "cudnnGetConvolutionForwardWorkspaceSize",
                ],
                // SAFETY: every pointer is live device memory of its descriptor's size; the
                // out-pointers are live.
                |ws, ws_len, count, perf: &mut [cudnn::cudnnConvolutionFwdAlgoPerf_t]| unsafe {
                    cudnn::cudnnFindConvolutionForwardAlgorithmEx(
                        h,
                        plan.x.0,
                        x as *const c_void,
                        plan.w.0,
                        w as *const c_void,
                        plan.conv.0,
                        plan.y.0,
                        y as *mut c_void,
                        perf.len() as i32,
                        count,
                        perf.as_mut_ptr(),
                        ws,
                        ws_len,
                    )
                },
                // SAFETY: live handle and descriptors; live out-pointers.
                |count, perf: &mut [cudnn::cudnnConvolutionFwdAlgoPerf_t]| unsafe {
                    cudnn::cudnnGetConvolutionForwardAlgorithm_v7(
                        h,
                        plan.x.0,
                        plan.w.0,
                        plan.conv.0,
                        plan.y.0,
                        perf.len() as i32,
                        count,
                        perf.as_mut_ptr(),
                    )
                },
                // SAFETY: live handle and descriptors; a live out-pointer.
                |algo, bytes| unsafe {
                    cudnn::cudnnGetConvolutionForwardWorkspaceSize(
                        h,
                        plan.x.0,
                        plan.w.0,
                        plan.conv.0,
                        plan.y.0,
                        algo,
                        bytes,
                    )
                },
            )
        })
    }

    /// The backward-data algorithm of `plan`, found the first time it is asked for, with
    /// that call's buffers (the search overwrites `dx`).
    fn backward_data_found(
        &self,
        plan: &ConvPlan,
        s: &ConvShape,
        w: CUdeviceptr,
        dy: CUdeviceptr,
        dx: CUdeviceptr,
    ) -> Found<cudnn::cudnnConvolutionBwdDataAlgo_t> {
        let h = self.inner.cudnn;
        *plan.backward_data.get_or_init(|| {
            self.search(
                plan,
                s,
                "backward-data",
                [
                    "cudnnFindConvolutionBackwardDataAlgorithmEx",
                    "cudnnGetConvolutionBackwardDataAlgorithm_v7",
                    "cudnnGetConvolutionBackwardDataWorkspaceSize",
                ],
                // SAFETY: as for the forward search.
                |ws, ws_len, count, perf: &mut [cudnn::cudnnConvolutionBwdDataAlgoPerf_t]| unsafe {
                    cudnn::cudnnFindConvolutionBackwardDataAlgorithmEx(
                        h,
                        plan.w.0,
                        w as *const c_void,
                        plan.y.0,
                        dy as *const c_void,
                        plan.conv.0,
                        plan.x.0,
                        dx as *mut c_void,
                        perf.len() as i32,
                        count,
                        perf.as_mut_ptr(),
                        ws,
                        ws_len,
                    )
                },
                // SAFETY: as for the forward search.
                |count, perf: &mut [cudnn::cudnnConvolutionBwdDataAlgoPerf_t]| unsafe {
                    cudnn::cudnnGetConvolutionBackwardDataAlgorithm_v7(
                        h,
                        plan.w.0,
                        plan.y.0,
                        plan.conv.0,
                        plan.x.0,
                        perf.len() as i32,
                        count,
                        perf.as_mut_ptr(),
                    )
                },
                // SAFETY: as for the forward search.
                |algo, bytes| unsafe {
                    cudnn::cudnnGetConvolutionBackwardDataWorkspaceSize(
                        h,
                        plan.w.0,
                        plan.y.0,
                        plan.conv.0,
                        plan.x.0,
                        algo,
                        bytes,
                    )
                },
            )
        })
    }

    /// The backward-filter algorithm of `plan`, found the first time it is asked for, with
    /// that call's buffers (the search overwrites `dw`).
    fn backward_filter_found(
        &self,
        plan: &ConvPlan,
        s: &ConvShape,
        x: CUdeviceptr,
        dy: CUdeviceptr,
        dw: CUdeviceptr,
    ) -> Found<cudnn::cudnnConvolutionBwdFilterAlgo_t> {
        let h = self.inner.cudnn;
        *plan.backward_filter.get_or_init(|| {
            self.search(
                plan,
                s,
                "backward-filter",
                [
                    "cudnnFindConvolutionBackwardFilterAlgorithmEx",
                    "cudnnGetConvolutionBackwardFilterAlgorithm_v7",
                    "cudnnGetConvolutionBackwardFilterWorkspaceSize",
                ],
                // SAFETY: as for the forward search.
                |ws, ws_len, count, perf: &mut [cudnn::cudnnConvolutionBwdFilterAlgoPerf_t]| unsafe {
                    cudnn::cudnnFindConvolutionBackwardFilterAlgorithmEx(
                        h,
                        plan.x.0,
                        x as *const c_void,
                        plan.y.0,
                        dy as *const c_void,
                        plan.conv.0,
                        plan.w.0,
                        dw as *mut c_void,
                        perf.len() as i32,
                        count,
                        perf.as_mut_ptr(),
                        ws,
                        ws_len,
                    )
                },
                // SAFETY: as for the forward search.
                |count, perf: &mut [cudnn::cudnnConvolutionBwdFilterAlgoPerf_t]| unsafe {
                    cudnn::cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                        h,
                        plan.x.0,
                        plan.y.0,
                        plan.conv.0,
                        plan.w.0,
                        perf.len() as i32,
                        count,
                        perf.as_mut_ptr(),
                    )
                },
                // SAFETY: as for the forward search.
                |algo, bytes| unsafe {
                    cudnn::cudnnGetConvolutionBackwardFilterWorkspaceSize(
                        h, plan.x.0, plan.y.0, plan.conv.0, plan.w.0, algo, bytes,
                    )
                },
            )
        })
    }

    /// Batch norm's plan for `dims` in `dtype` followed by `epilogue` (inference asks for
    /// the identity and uses only the descriptors).
    fn bn_plan(
        &self,
        (n, c, hw): (usize, usize, usize),
        dtype: DType,
        epilogue: BnEpilogueKind,
    ) -> Rc<BnPlan> {
        let key = (n, c, hw, dtype, epilogue);
        if let Some(plan) = self.inner.bn_plans.borrow().get(&key) {
            return plan.clone();
        }
        // cuDNN sees [n, c, hw, 1]: batch norm does not care how the plane is shaped.
        let x = TensorDesc::nhwc(dtype, n, c, hw, 1);
        let params = TensorDesc::batch_norm_params(c);
        // cuDNN's NHWC fused kernels want whole groups of 4 channels (OneFlow checks the
        // same before fusing); a CIFAR ResNet of another width takes the plain calls.
        let fused = (self.inner.batch_norm.get() == BatchNormEngine::CudnnFused && c % 4 == 0)
            .then(|| self.fused_bn(&x, &params, bn_ops(epilogue)))
            .flatten();
        let plan = Rc::new(BnPlan {
            x,
            params,
            fused,
            refused: std::cell::Cell::new(false),
            worked: std::cell::Cell::new([false; 2]),
        });
        self.inner.bn_plans.borrow_mut().insert(key, plan.clone());
        plan
    }

    /// The fused calls' sizes, or `None` when cuDNN does not take them for this
    /// descriptor and `ops` (it says so through the size queries).
    fn fused_bn(
        &self,
        x: &TensorDesc,
        params: &TensorDesc,
        ops: cudnn::cudnnBatchNormOps_t,
    ) -> Option<FusedBn> {
        let mut fused = FusedBn {
            ops,
            relu: ActivationDesc::relu(),
            workspace: [0; 2],
            reserve: 0,
        };
        let add = ops == cudnn::cudnnBatchNormOps_t::CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION;
        let z = if add { x.0 } else { std::ptr::null_mut() };
        let h = self.inner.cudnn;
        let act = fused.activation();
        let ok = |status| status == cudnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS;
        // SAFETY: live handle and descriptors; the out-pointers are live fields.
        let supported = unsafe {
            ok(
                cudnn::cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(
                    h,
                    BN_EX_MODE,
                    ops,
                    x.0,
                    z,
                    x.0,
                    params.0,
                    act,
                    &mut fused.workspace[0],
                ),
            ) && ok(cudnn::cudnnGetBatchNormalizationBackwardExWorkspaceSize(
                h,
                BN_EX_MODE,
                ops,
                x.0,
                x.0,
                x.0,
                z,
                x.0,
                params.0,
                act,
                &mut fused.workspace[1],
            )) && ok(cudnn::cudnnGetBatchNormalizationTrainingExReserveSpaceSize(
                h,
                BN_EX_MODE,
                ops,
                act,
                x.0,
                &mut fused.reserve,
            ))
        };
        supported.then_some(fused)
    }
}

impl KernelLauncher for CudaBackend {
    fn launch(&self, name: &'static str, threads: usize, args: &mut [*mut c_void]) {
        if threads == 0 {
            return;
        }
        let f = &self.inner.kernels[name];
        // SAFETY: `kernels` passes each kernel the C types it declares (a unit test checks
        // them against the source); the buffers they name are live device memory of the
        // lengths its asserts checked.
        unsafe {
            result::launch_kernel(
                f.cu_function(),
                (kernels::blocks(threads), 1, 1),
                (kernels::BLOCK, 1, 1),
                0,
                self.stream(),
                args,
            )
        }
        .unwrap_or_else(|e| panic!("launching {name}: {e}"));
    }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type View<'a> = DevView<'a>;
    type ViewMut<'a> = DevViewMut<'a>;
    type ConvSaved = CudaConvSaved;
    type BnSaved = CudaBnSaved;
    type PoolSaved = CudaPoolSaved;
    /// A CUDA graph of the recorded work.
    type Recording = cudarc::driver::CudaGraph;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn supports(&self, _dtype: DType) -> bool {
        true
    }

    fn alloc(&self, len: usize, dtype: DType) -> CudaBuf {
        self.arena_alloc(len, dtype)
    }

    fn zeros(&self, len: usize, dtype: DType) -> CudaBuf {
        self.owned(len, dtype)
    }

    fn upload(&self, host: &[f32], shape: &[usize], dtype: DType) -> CudaBuf {
        let mut out = self.owned(host.len(), dtype);
        self.upload_into(host, shape, &mut out);
        out
    }

    fn upload_into(&self, host: &[f32], shape: &[usize], buf: &mut CudaBuf) {
        assert_eq!(
            host.len(),
            buf.len,
            "upload into a buffer of another length"
        );
        let copy_to = |ptr: CUdeviceptr| {
            // SAFETY: `ptr` holds `host.len()` f32s; the copy is ordered on our stream
            // before any use, and the host slice lives through the synchronize below.
            unsafe { result::memcpy_htod_async(ptr, host, self.stream()) }
                .unwrap_or_else(|e| panic!("copying {} values to the GPU: {e}", host.len()));
        };
        if host.is_empty() {
            return;
        }
        match (shape, buf.dtype) {
            // Images: a step may still be reading `buf`; the conversion queues behind it.
            ([n, c, h, w], _) => self.staged_upload(host, |staged| {
                kernels::nchw_to_nhwc(self, [*n, *c, *h, *w], staged, buf.op())
            }),
            (_, DType::F32) => {
                copy_to(buf.ptr);
                self.synchronize();
            }
            (_, DType::Bf16) => {
                let staged = self.owned(host.len(), DType::F32);
                copy_to(staged.ptr);
                kernels::convert(self, staged.op(), buf.op());
                self.synchronize();
            }
        }
    }

    fn record(&self, work: &mut dyn FnMut()) -> Option<cudarc::driver::CudaGraph> {
        use cudarc::driver::sys;
        let stream = &self.inner.stream;
        // Thread-local: a call on this thread that cannot be captured (an allocation, a
        // synchronisation) fails the capture instead of running outside it.
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap_or_else(|e| panic!("starting a CUDA graph capture: {e}"));
        self.inner.capturing.set(true);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(&mut *work));
        self.inner.capturing.set(false);
        if let Err(panic) = outcome {
            // End the capture, so what runs next (drops included) is not captured, and
            // report the failure that broke it.
            stream.end_capture(sys::CUgraphInstantiate_flags(0)).ok();
            std::panic::resume_unwind(panic);
        }
        self.inner.recorded.set(true);
        let graph = stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .unwrap_or_else(|e| panic!("capturing the step as a CUDA graph: {e}"))
            .expect("the recorded work queued something");
        self.replay(&graph);
        Some(graph)
    }

    fn replay(&self, graph: &cudarc::driver::CudaGraph) {
        graph
            .launch()
            .unwrap_or_else(|e| panic!("launching the step's CUDA graph: {e}"));
    }

    fn download(&self, buf: &CudaBuf, shape: &[usize]) -> Vec<f32> {
        let len = shape.iter().product::<usize>();
        assert_eq!(len, buf.len, "download shape");
        let plain = match shape {
            [n, c, h, w] => {
                let out = self.owned(len, DType::F32);
                kernels::nhwc_to_nchw(self, [*n, *c, *h, *w], buf.op(), out.op());
                out
            }
            _ if buf.dtype == DType::F32 => buf.clone(),
            _ => {
                let out = self.owned(len, DType::F32);
                kernels::convert(self, buf.op(), out.op());
                out
            }
        };
        let mut host = vec![0.0f32; len];
        // SAFETY: `plain` holds `len` f32s; synchronize waits for the copy to land.
        unsafe { result::memcpy_dtoh_async(&mut host, plain.ptr, self.stream()) }
            .unwrap_or_else(|e| panic!("copying {len} values from the GPU: {e}"));
        self.synchronize();
        host
    }

    fn with_host<R>(&self, buf: &mut CudaBuf, f: impl FnOnce(&mut [f32]) -> R) -> R {
        assert_eq!(buf.dtype, DType::F32, "with_host needs an f32 buffer");
        let mut host = self.download(buf, &[buf.len]);
        let r = f(&mut host);
        // SAFETY: `buf` holds `host.len()` f32s; synchronize keeps `host` alive until the
        // copy has landed.
        unsafe { result::memcpy_htod_async(buf.ptr, &host, self.stream()) }
            .unwrap_or_else(|e| panic!("copying {} values to the GPU: {e}", host.len()));
        self.synchronize();
        r
    }

    fn reduces_on_device(&self, collective: &mut dyn Collective) -> bool {
        collective.on_device().is_some()
    }

    fn queue_all_reduce(
        &self,
        buf: &mut CudaBuf,
        range: Range<usize>,
        collective: &mut dyn Collective,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        assert_eq!(buf.dtype, DType::F32, "all-reduce of an f32 buffer");
        assert!(
            range.end <= buf.len,
            "all-reduce range {range:?} of {}",
            buf.len
        );
        match collective.on_device() {
            Some(device) => device.queue_all_reduce(
                buf.ptr + (range.start * DType::F32.size()) as u64,
                range.len(),
                op,
                &self.inner.stream,
            ),
            None => self.with_host(buf, |values| collective.all_reduce(&mut values[range], op)),
        }
    }

    fn join_all_reduces(&self, collective: &mut dyn Collective) -> Result<(), CollectiveError> {
        collective
            .on_device()
            .map_or(Ok(()), |device| device.join())
    }

    fn synchronize(&self) {
        self.inner
            .stream
            .synchronize()
            .expect("synchronizing the CUDA stream");
    }

    fn begin_step(&self) {
        self.fit_arena();
    }

    fn view<'a>(&self, buf: &'a CudaBuf, range: Range<usize>) -> DevView<'a> {
        assert!(
            range.end <= buf.len,
            "view {range:?} of {} elements",
            buf.len
        );
        DevView {
            ptr: buf.ptr + (range.start * buf.dtype.size()) as u64,
            len: range.len(),
            dtype: buf.dtype,
            _borrow: PhantomData,
        }
    }

    fn view_mut<'a>(&self, buf: &'a mut CudaBuf, range: Range<usize>) -> DevViewMut<'a> {
        assert!(
            range.end <= buf.len,
            "view {range:?} of {} elements",
            buf.len
        );
        DevViewMut {
            ptr: buf.ptr + (range.start * buf.dtype.size()) as u64,
            len: range.len(),
            dtype: buf.dtype,
            _borrow: PhantomData,
        }
    }

    fn view_mut_pair<'a>(
        &self,
        buf: &'a mut CudaBuf,
        a: Range<usize>,
        b: Range<usize>,
    ) -> (DevViewMut<'a>, DevViewMut<'a>) {
        assert!(a.end <= b.start && b.end <= buf.len, "view_mut_pair ranges");
        let at = |r: Range<usize>| DevViewMut {
            ptr: buf.ptr + (r.start * buf.dtype.size()) as u64,
            len: r.len(),
            dtype: buf.dtype,
            _borrow: PhantomData,
        };
        (at(a), at(b))
    }

    fn fill_zero(&self, x: DevViewMut<'_>) {
        // SAFETY: the view is live device memory of `len` elements.
        unsafe { result::memset_d8_async(x.ptr, 0, x.len * x.dtype.size(), self.stream()) }
            .unwrap_or_else(|e| panic!("zeroing {} bytes: {e}", x.len * x.dtype.size()));
    }

    fn gemm(
        &self,
        m: usize,
        k: usize,
        n: usize,
        a: Matrix<DevView<'_>>,
        b: Matrix<DevView<'_>>,
        beta: f32,
        c: DevViewMut<'_>,
    ) {
        assert!(
            [a.data.dtype, b.data.dtype, c.dtype] == [DType::F32; 3],
            "gemm is f32"
        );
        // Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ. A row-major operand (column stride 1)
        // read column-major with its row stride as leading dimension is its transpose.
        // `rows`, `cols`: the operand's logical shape. cuBLAS wants the leading dimension at
        // least the stored matrix's row count even where it never steps along it (a single
        // row or column, when both strides are 1), hence the `max`.
        let op = |x: &Matrix<DevView<'_>>, rows: usize, cols: usize| {
            if x.col_stride == 1 {
                (
                    cublas::cublasOperation_t::CUBLAS_OP_N,
                    x.row_stride.max(cols),
                )
            } else {
                (
                    cublas::cublasOperation_t::CUBLAS_OP_T,
                    x.col_stride.max(rows),
                )
            }
        };
        let ((op_b, ldb), (op_a, lda)) = (op(&b, k, n), op(&a, m, k));
        let alpha = 1.0f32;
        // SAFETY: the views are live device f32 buffers of the sizes m·k, k·n and m·n that
        // the strides describe; alpha and beta are host values (cuBLAS's default mode).
        let status = unsafe {
            cublas::cublasSgemm_v2(
                self.inner.cublas,
                op_b,
                op_a,
                n as i32,
                m as i32,
                k as i32,
                &alpha,
                b.data.ptr as *const f32,
                ldb as i32,
                a.data.ptr as *const f32,
                lda as i32,
                &beta,
                c.ptr as *mut f32,
                n as i32,
            )
        };
        check_cublas(status, "cublasSgemm_v2");
    }

    fn conv2d_forward(
        &self,
        s: &ConvShape,
        x: DevView<'_>,
        weight: DevView<'_>,
        y: DevViewMut<'_>,
    ) -> CudaConvSaved {
        let dtype = x.dtype;
        let working = self.arena_alloc(weight.len, dtype);
        kernels::weights_to_working(self, s, weight.op(), working.op());
        let plan = self.conv_plan(s, dtype);
        let found = self.forward_found(&plan, s, x.ptr, working.ptr, y.ptr);
        plan.use_math(found.math);
        let (ws, ws_len, _held) = self.workspace(found.workspace);
        let (one, zero) = (1.0f32, 0.0f32);
        // SAFETY: buffers match the plan's descriptors; alpha/beta are host f32s.
        let status = unsafe {
            cudnn::cudnnConvolutionForward(
                self.inner.cudnn,
                &one as *const f32 as *const c_void,
                plan.x.0,
                x.ptr as *const c_void,
                plan.w.0,
                working.ptr as *const c_void,
                plan.conv.0,
                found.algo,
                ws as *mut c_void,
                ws_len,
                &zero as *const f32 as *const c_void,
                plan.y.0,
                y.ptr as *mut c_void,
            )
        };
        check_cudnn(status, "cudnnConvolutionForward");
        CudaConvSaved { weight: working }
    }

    fn conv2d_backward(
        &self,
        s: &ConvShape,
        saved: &CudaConvSaved,
        x: DevView<'_>,
        _weight: DevView<'_>,
        dy: DevView<'_>,
        dx: Option<DevViewMut<'_>>,
        dweight: DevViewMut<'_>,
    ) {
        let dtype = x.dtype;
        assert_eq!(saved.weight.len, dweight.len, "conv backward weight shape");
        let plan = self.inner.conv_plans.borrow()[&(*s, dtype)].clone();
        let (one, zero) = (1.0f32, 0.0f32);
        if let Some(dx) = dx {
            let found = self.backward_data_found(&plan, s, saved.weight.ptr, dy.ptr, dx.ptr);
            plan.use_math(found.math);
            let (ws, ws_len, _held) = self.workspace(found.workspace);
            // SAFETY: buffers match the plan's descriptors; alpha/beta are host f32s.
            let status = unsafe {
                cudnn::cudnnConvolutionBackwardData(
                    self.inner.cudnn,
                    &one as *const f32 as *const c_void,
                    plan.w.0,
                    saved.weight.ptr as *const c_void,
                    plan.y.0,
                    dy.ptr as *const c_void,
                    plan.conv.0,
                    found.algo,
                    ws as *mut c_void,
                    ws_len,
                    &zero as *const f32 as *const c_void,
                    plan.x.0,
                    dx.ptr as *mut c_void,
                )
            };
            check_cudnn(status, "cudnnConvolutionBackwardData");
        }
        let dw = self.arena_alloc(dweight.len, dtype);
        let found = self.backward_filter_found(&plan, s, x.ptr, dy.ptr, dw.ptr);
        plan.use_math(found.math);
        let (ws, ws_len, _held) = self.workspace(found.workspace);
        // SAFETY: as above.
        let status = unsafe {
            cudnn::cudnnConvolutionBackwardFilter(
                self.inner.cudnn,
                &one as *const f32 as *const c_void,
                plan.x.0,
                x.ptr as *const c_void,
                plan.y.0,
                dy.ptr as *const c_void,
                plan.conv.0,
                found.algo,
                ws as *mut c_void,
                ws_len,
                &zero as *const f32 as *const c_void,
                plan.w.0,
                dw.ptr as *mut c_void,
            )
        };
        check_cudnn(status, "cudnnConvolutionBackwardFilter");
        kernels::add_weight_grad_to_master(self, s, dw.op(), dweight.op());
    }

    fn batch_norm_forward_training(
        &self,
        dims: (usize, usize, usize),
        config: BatchNormConfig,
        x: DevView<'_>,
        gamma: DevView<'_>,
        beta: DevView<'_>,
        running_mean: DevViewMut<'_>,
        running_var: DevViewMut<'_>,
        epilogue: BnEpilogue<DevView<'_>>,
        y: DevViewMut<'_>,
    ) -> CudaBnSaved {
        let mean = self.arena_alloc(dims.1, DType::F32);
        let inv_var = self.arena_alloc(dims.1, DType::F32);
        let saved = |reserve| CudaBnSaved {
            x: x.into(),
            _x_held: self.hold(x.ptr),
            mean: mean.clone(),
            inv_var: inv_var.clone(),
            reserve,
        };
        if self.inner.batch_norm.get() == BatchNormEngine::Own {
            let scratch = self.batch_norm_scratch(dims);
            let epilogue = match epilogue {
                BnEpilogue::Identity => BnEpilogue::Identity,
                BnEpilogue::Relu => BnEpilogue::Relu,
                BnEpilogue::AddRelu(z) => BnEpilogue::AddRelu(z.op()),
            };
            kernels::batch_norm_forward_training(
                self,
                dims,
                config,
                x.op(),
                gamma.op(),
                beta.op(),
                running_mean.op(),
                running_var.op(),
                epilogue,
                y.op(),
                mean.op(),
                inv_var.op(),
                scratch.op(),
            );
            return saved(None);
        }
        let plan = self.bn_plan(dims, x.dtype, epilogue.kind());
        let (one, zero) = (1.0f32, 0.0f32);
        let residual = match epilogue {
            BnEpilogue::AddRelu(z) => {
                assert_eq!((z.len, z.dtype), (x.len, x.dtype), "batch-norm residual");
                Some(z)
            }
            BnEpilogue::Identity | BnEpilogue::Relu => None,
        };
        let reserve = plan.fused().and_then(|fused| {
            let reserve = self.arena_alloc(fused.reserve.div_ceil(4), DType::F32);
            let (ws, ws_len, _held) = self.workspace(fused.workspace[0]);
            let (z_desc, z_ptr) = residual.map_or((std::ptr::null_mut(), 0), |z| (plan.x.0, z.ptr));
            // SAFETY: buffers match the plan's descriptors (z is x's shape and type); the
            // per-channel ones are f32 of `c` elements; the workspace and reserve space
            // have the sizes cuDNN asked for; alpha/beta are host f32s.
            let status = unsafe {
                cudnn::cudnnBatchNormalizationForwardTrainingEx(
                    self.inner.cudnn,
                    BN_EX_MODE,
                    fused.ops,
                    &one as *const f32 as *const c_void,
                    &zero as *const f32 as *const c_void,
                    plan.x.0,
                    x.ptr as *const c_void,
                    z_desc,
                    z_ptr as *const c_void,
                    plan.x.0,
                    y.ptr as *mut c_void,
                    plan.params.0,
                    gamma.ptr as *const c_void,
                    beta.ptr as *const c_void,
                    f64::from(config.momentum),
                    running_mean.ptr as *mut c_void,
                    running_var.ptr as *mut c_void,
                    f64::from(config.eps),
                    mean.ptr as *mut c_void,
                    inv_var.ptr as *mut c_void,
                    fused.activation(),
                    ws as *mut c_void,
                    ws_len,
                    reserve.ptr as *mut c_void,
                    fused.reserve,
                )
            };
            let reserve_len = fused.reserve;
            (!plan.refuses(status, BnCall::Forward)).then_some((reserve, reserve_len))
        });
        if reserve.is_none() {
            // SAFETY: as above, without the fused parts.
            let status = unsafe {
                cudnn::cudnnBatchNormalizationForwardTraining(
                    self.inner.cudnn,
                    BN_MODE,
                    &one as *const f32 as *const c_void,
                    &zero as *const f32 as *const c_void,
                    plan.x.0,
                    x.ptr as *const c_void,
                    plan.x.0,
                    y.ptr as *mut c_void,
                    plan.params.0,
                    gamma.ptr as *const c_void,
                    beta.ptr as *const c_void,
                    f64::from(config.momentum),
                    running_mean.ptr as *mut c_void,
                    running_var.ptr as *mut c_void,
                    f64::from(config.eps),
                    mean.ptr as *mut c_void,
                    inv_var.ptr as *mut c_void,
                )
            };
            check_cudnn(status, "cudnnBatchNormalizationForwardTraining");
            if let Some(z) = residual {
                kernels::add_assign(self, y.op(), z.op());
            }
            if epilogue.has_relu() {
                // In place: each thread reads its element before writing it.
                kernels::relu_forward(self, y.op(), y.op());
            }
        }
        saved(reserve)
    }

    fn batch_norm_forward_inference(
        &self,
        dims: (usize, usize, usize),
        config: BatchNormConfig,
        x: DevView<'_>,
        gamma: DevView<'_>,
        beta: DevView<'_>,
        running_mean: DevView<'_>,
        running_var: DevView<'_>,
        y: DevViewMut<'_>,
    ) {
        let plan = self.bn_plan(dims, x.dtype, BnEpilogueKind::Identity);
        let (one, zero) = (1.0f32, 0.0f32);
        // SAFETY: as in the training pass.
        let status = unsafe {
            cudnn::cudnnBatchNormalizationForwardInference(
                self.inner.cudnn,
                BN_MODE,
                &one as *const f32 as *const c_void,
                &zero as *const f32 as *const c_void,
                plan.x.0,
                x.ptr as *const c_void,
                plan.x.0,
                y.ptr as *mut c_void,
                plan.params.0,
                gamma.ptr as *const c_void,
                beta.ptr as *const c_void,
                running_mean.ptr as *const c_void,
                running_var.ptr as *const c_void,
                f64::from(config.eps),
            )
        };
        check_cudnn(status, "cudnnBatchNormalizationForwardInference");
    }

    fn batch_norm_backward(
        &self,
        dims: (usize, usize, usize),
        config: BatchNormConfig,
        saved: &CudaBnSaved,
        gamma: DevView<'_>,
        beta: DevView<'_>,
        epilogue: BnEpilogueGrad<DevView<'_>, DevViewMut<'_>>,
        dy: DevView<'_>,
        dx: DevViewMut<'_>,
        dgamma: DevViewMut<'_>,
        dbeta: DevViewMut<'_>,
    ) {
        assert_eq!(saved.x.len, dy.len, "batch-norm backward shape");
        let dtype = saved.x.dtype;
        if self.inner.batch_norm.get() == BatchNormEngine::Own {
            // From the saved mean and inverse deviation, whichever engine ran forward.
            let scratch = self.batch_norm_scratch(dims);
            let epilogue = match epilogue {
                BnEpilogueGrad::Identity => BnEpilogueGrad::Identity,
                BnEpilogueGrad::Relu { y } => BnEpilogueGrad::Relu { y: y.op() },
                BnEpilogueGrad::AddRelu { y, dz } => BnEpilogueGrad::AddRelu {
                    y: y.op(),
                    dz: dz.op(),
                },
            };
            kernels::batch_norm_backward(
                self,
                dims,
                saved.x.op(),
                saved.mean.op(),
                saved.inv_var.op(),
                gamma.op(),
                epilogue,
                dy.op(),
                dx.op(),
                dgamma.op(),
                dbeta.op(),
                scratch.op(),
            );
            return;
        }
        let plan = self.bn_plan(dims, dtype, epilogue.kind());
        let (y, dz) = match epilogue {
            BnEpilogueGrad::Identity => (None, None),
            BnEpilogueGrad::Relu { y } => (Some(y), None),
            BnEpilogueGrad::AddRelu { y, dz } => (Some(y), Some(dz)),
        };
        let one = 1.0f32;
        let zero = 0.0f32;
        // cuDNN writes the parameter gradients into scratch (beta 0, as PyTorch asks for
        // them), and our kernel adds them: accumulation does not depend on every cuDNN
        // kernel honouring a beta of 1.
        let c = dims.1;
        let param_grads = self.arena_alloc(2 * c, DType::F32);
        let (scratch_dgamma, scratch_dbeta) = (param_grads.ptr, param_grads.ptr + (c * 4) as u64);
        let accumulate = || {
            // SAFETY: each half of `param_grads`, `c` f32s of this step's arena.
            let scratch = |ptr| unsafe { Operand::new(ptr, c, DType::F32) };
            kernels::add_assign(self, dgamma.op(), scratch(scratch_dgamma));
            kernels::add_assign(self, dbeta.op(), scratch(scratch_dbeta));
        };
        if let (Some(fused), Some((reserve, reserve_len))) = (plan.fused(), &saved.reserve) {
            let (ws, ws_len, _held) = self.workspace(fused.workspace[1]);
            let null = std::ptr::null_mut();
            let (y_desc, y_ptr) = y.map_or((null, 0), |y| (plan.x.0, y.ptr));
            let (dz_desc, dz_ptr) = dz.as_ref().map_or((null, 0), |dz| (plan.x.0, dz.ptr));
            // SAFETY: buffers match the plan's descriptors; the reserve space is the one
            // the forward pass filled; the parameter gradients go to scratch of 2·c f32s.
            let status = unsafe {
                cudnn::cudnnBatchNormalizationBackwardEx(
                    self.inner.cudnn,
                    BN_EX_MODE,
                    fused.ops,
                    &one as *const f32 as *const c_void,
                    &zero as *const f32 as *const c_void,
                    &one as *const f32 as *const c_void,
                    &zero as *const f32 as *const c_void,
                    plan.x.0,
                    saved.x.ptr as *const c_void,
                    y_desc,
                    y_ptr as *const c_void,
                    plan.x.0,
                    dy.ptr as *const c_void,
                    dz_desc,
                    dz_ptr as *mut c_void,
                    plan.x.0,
                    dx.ptr as *mut c_void,
                    plan.params.0,
                    gamma.ptr as *const c_void,
                    beta.ptr as *const c_void,
                    scratch_dgamma as *mut c_void,
                    scratch_dbeta as *mut c_void,
                    f64::from(config.eps),
                    saved.mean.ptr as *const c_void,
                    saved.inv_var.ptr as *const c_void,
                    fused.activation(),
                    ws as *mut c_void,
                    ws_len,
                    reserve.ptr as *mut c_void,
                    *reserve_len,
                )
            };
            if !plan.refuses(status, BnCall::Backward) {
                accumulate();
                return;
            }
        }
        // The plain path (also after a fused forward pass: it needs only the saved mean and
        // inverse deviation): through the ReLU with our kernel (its result is also the
        // residual's gradient), then the batch norm.
        // Held to the end: the batch norm below reads it.
        let masked = y.map(|y| {
            let masked = self.arena_alloc(dy.len, dtype);
            kernels::relu_backward(self, y.op(), dy.op(), masked.op());
            if let Some(dz) = &dz {
                // SAFETY: both are live device buffers of `len` elements of `dtype`.
                unsafe {
                    result::memcpy_dtod_async(
                        dz.ptr,
                        masked.ptr,
                        dz.len * dtype.size(),
                        self.stream(),
                    )
                }
                .unwrap_or_else(|e| panic!("copying the residual's gradient: {e}"));
            }
            masked
        });
        let dy_ptr = masked.as_ref().map_or(dy.ptr, |m| m.ptr);
        // SAFETY: as in the training pass; the parameter gradients go to the scratch.
        let status = unsafe {
            cudnn::cudnnBatchNormalizationBackward(
                self.inner.cudnn,
                BN_MODE,
                &one as *const f32 as *const c_void,
                &zero as *const f32 as *const c_void,
                &one as *const f32 as *const c_void,
                &zero as *const f32 as *const c_void,
                plan.x.0,
                saved.x.ptr as *const c_void,
                plan.x.0,
                dy_ptr as *const c_void,
                plan.x.0,
                dx.ptr as *mut c_void,
                plan.params.0,
                gamma.ptr as *const c_void,
                scratch_dgamma as *mut c_void,
                scratch_dbeta as *mut c_void,
                f64::from(config.eps),
                saved.mean.ptr as *const c_void,
                saved.inv_var.ptr as *const c_void,
            )
        };
        check_cudnn(status, "cudnnBatchNormalizationBackward");
        accumulate();
    }

    fn relu_forward(&self, x: DevView<'_>, y: DevViewMut<'_>) {
        kernels::relu_forward(self, x.op(), y.op());
    }

    fn relu_backward(&self, y: DevView<'_>, dy: DevView<'_>, dx: DevViewMut<'_>) {
        kernels::relu_backward(self, y.op(), dy.op(), dx.op());
    }

    fn max_pool_forward(&self, s: &PoolShape, x: DevView<'_>, y: DevViewMut<'_>) -> CudaPoolSaved {
        // i32 indices: the same 4 bytes an f32 takes.
        let argmax = self.arena_alloc(y.len, DType::F32);
        kernels::max_pool_forward(self, s, x.op(), y.op(), argmax.op());
        CudaPoolSaved { argmax }
    }

    fn max_pool_backward(
        &self,
        s: &PoolShape,
        saved: &CudaPoolSaved,
        dy: DevView<'_>,
        dx: DevViewMut<'_>,
    ) {
        kernels::max_pool_backward(self, s, saved.argmax.op(), dy.op(), dx.op());
    }

    fn global_avg_pool_forward(
        &self,
        (n, c, hw): (usize, usize, usize),
        x: DevView<'_>,
        y: DevViewMut<'_>,
    ) {
        kernels::global_avg_pool_forward(self, (n, c, hw), x.op(), y.op());
    }

    fn global_avg_pool_backward(
        &self,
        (n, c, hw): (usize, usize, usize),
        dy: DevView<'_>,
        dx: DevViewMut<'_>,
    ) {
        kernels::global_avg_pool_backward(self, (n, c, hw), dy.op(), dx.op());
    }

    fn broadcast_rows(&self, bias: DevView<'_>, y: DevViewMut<'_>) {
        kernels::broadcast_rows(self, bias.op(), y.op());
    }

    fn sum_rows(&self, x: DevView<'_>, sums: DevViewMut<'_>) {
        kernels::sum_rows(self, x.op(), sums.op());
    }

    fn add_assign(&self, a: DevViewMut<'_>, b: DevView<'_>) {
        kernels::add_assign(self, a.op(), b.op());
    }

    fn softmax_cross_entropy(
        &self,
        classes: usize,
        logits: DevView<'_>,
        labels: DevView<'_>,
        label_smoothing: f32,
        grad_scale: f32,
        dlogits: DevViewMut<'_>,
        totals: DevViewMut<'_>,
    ) {
        let row_stats = self.arena_alloc(
            kernels::loss_row_stats_bytes(labels.len) / DType::F32.size(),
            DType::F32,
        );
        kernels::softmax_cross_entropy(
            self,
            classes,
            logits.op(),
            labels.op(),
            label_smoothing,
            grad_scale,
            dlogits.op(),
            row_stats.op(),
            totals.op(),
        );
    }

    fn sgd_table(&self, undecayed: &[Range<usize>]) -> Option<CudaBuf> {
        let bounds = kernels::sgd_bounds(undecayed);
        Some(self.upload(&bounds, &[bounds.len()], DType::F32))
    }

    fn sgd_update_all(
        &self,
        w: DevViewMut<'_>,
        g: DevView<'_>,
        v: DevViewMut<'_>,
        lr: f32,
        momentum: f32,
        weight_decay: f32,
        table: &CudaBuf,
    ) {
        kernels::sgd_update_all(
            self,
            [w.op(), g.op(), v.op()],
            lr,
            momentum,
            weight_decay,
            table.op(),
        );
    }

    fn sgd_update(
        &self,
        w: DevViewMut<'_>,
        g: DevView<'_>,
        v: DevViewMut<'_>,
        lr: f32,
        momentum: f32,
        weight_decay: f32,
    ) {
        kernels::sgd_update(self, w.op(), g.op(), v.op(), lr, momentum, weight_decay);
    }
}
