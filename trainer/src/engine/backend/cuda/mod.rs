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
//!   before (see [`memory::Staging`]).
//! * Convolution algorithms are found once per shape with `cudnnFind…Ex` on the real
//!   buffers (as PyTorch's `cudnn.benchmark`) and cached with their workspace needs.
//!
//! Every library is loaded at run time by `cudarc`, so this builds and the rest of the
//! trainer runs on machines without CUDA; [`CudaBackend::new`] says what is missing.
//! Failures inside an operation (a cuDNN status, an exhausted arena) panic with the call
//! and the shapes: the [`Backend`] contract has no error path, like a shape mismatch.

mod batch_norm;
mod conv;
mod cudnn;
mod gemm;
mod graph;
mod memory;
mod nvrtc;

use std::cell::RefCell;
use std::collections::HashMap;
use std::ops::Range;
use std::rc::Rc;
use std::sync::Arc;

use cudarc::cublas::sys as cublas_sys;
use cudarc::cudnn::sys as cudnn_sys;
use cudarc::driver::sys::CUstream;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream};

pub use batch_norm::{BATCH_NORM_ENV, BatchNormEngine, BatchNormPlan, CudaBnSaved};
pub use conv::{AlgorithmSearch, CudaConvSaved};
pub use memory::{CudaBuf, DevPtr, DevView, DevViewMut};
pub use nvrtc::compile_kernels;

use self::batch_norm::{BnBackwardCall, BnInferenceCall, BnKey, BnPlan, BnTrainingCall};
use self::conv::ConvPlan;
use self::memory::{Arena, Staging};
use super::kernels;
use super::{Backend, BatchNormConfig, BnEpilogue, BnEpilogueGrad, ConvShape, Matrix, PoolShape};
use crate::collective::{Collective, CollectiveError, ReduceOp};
use crate::engine::image_folder::gpu::DeviceImages;
use crate::engine::tensor::DType;

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

/// A driver call's failure while the backend starts, with what was being done.
fn driver<T>(
    context: impl FnOnce() -> String,
    r: Result<T, cudarc::driver::DriverError>,
) -> Result<T, CudaError> {
    r.map_err(|source| CudaError::Driver {
        context: context(),
        source,
    })
}

/// A cuDNN or cuBLAS call's failure while the backend starts: `status` unless it is
/// `success`.
fn library_at_start<S: PartialEq + std::fmt::Debug>(
    status: S,
    success: S,
    call: &'static str,
) -> Result<(), CudaError> {
    if status == success {
        Ok(())
    } else {
        Err(CudaError::Library {
            call,
            status: format!("{status:?}"),
        })
    }
}

/// What a max pool keeps: the winners' indices.
#[derive(Clone, Debug)]
pub struct CudaPoolSaved {
    argmax: CudaBuf,
}

struct Inner {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Where uploads are copied, beside `stream` (see [`memory::Staging`]).
    copy_stream: Arc<CudaStream>,
    /// Staging for 4-D uploads, by length.
    staging: RefCell<HashMap<usize, Staging>>,
    cudnn: cudnn_sys::cudnnHandle_t,
    cublas: cublas_sys::cublasHandle_t,
    /// cuBLAS's workspace (set on the handle; freed after it).
    _cublas_workspace: CudaSlice<u8>,
    kernels: HashMap<&'static str, CudaFunction>,
    /// Where the step's temporaries are placed, and which are held.
    arena: Arena,
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
            cudnn_sys::cudnnDestroy(self.cudnn);
            cublas_sys::cublasDestroy_v2(self.cublas);
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
        if let Some(missing) = missing_library() {
            return Err(missing);
        }
        let ctx = open_gpu(ordinal)?;
        // A stream of our own: the legacy default stream cannot be captured in a graph.
        let stream = driver(|| "creating a CUDA stream".into(), ctx.new_stream())?;
        let copy_stream = driver(|| "creating the upload stream".into(), ctx.new_stream())?;
        let kernels = nvrtc::load_kernels(&ctx)?;
        let cudnn = cudnn::cudnn_handle(&stream)?;
        let (cublas, cublas_workspace) = gemm::cublas_handle(&stream)?;
        let (arena, arena_memory) = memory::reserve_arena(&ctx, &stream, arena_bytes)?;
        Ok(Self {
            inner: Rc::new(Inner {
                ctx,
                stream,
                copy_stream,
                staging: RefCell::new(HashMap::new()),
                cudnn,
                cublas,
                _cublas_workspace: cublas_workspace,
                kernels,
                arena,
                arena_memory: RefCell::new(arena_memory),
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

    /// The compute stream, where every operation queues.
    fn stream(&self) -> CUstream {
        self.inner.stream.cu_stream()
    }
}

/// The first library the backend needs that does not load: checked before cudarc, which
/// panics on a library it cannot load.
fn missing_library() -> Option<CudaError> {
    // SAFETY (each): a dlopen probe; cudarc panics on a library it cannot load.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Some(CudaError::Missing {
            library: "libcuda.so.1",
            hint: "no NVIDIA driver, or the container runs without the GPU runtime",
        });
    }
    if !unsafe { cudnn_sys::is_culib_present() } {
        return Some(CudaError::Missing {
            library: "libcudnn.so.9",
            hint: "add cuDNN's folder to LD_LIBRARY_PATH",
        });
    }
    if !unsafe { cublas_sys::is_culib_present() } {
        return Some(CudaError::Missing {
            library: "libcublas.so",
            hint: "add cuBLAS's folder to LD_LIBRARY_PATH",
        });
    }
    nvrtc::nvrtc_missing()
}

/// A context on GPU `ordinal`, ordered by us alone (no per-buffer events).
fn open_gpu(ordinal: usize) -> Result<Arc<CudaContext>, CudaError> {
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
    Ok(ctx)
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
        self.copy_to_device(host, shape, buf);
    }

    fn upload_device_images_into(&self, images: &mut DeviceImages, buf: &mut CudaBuf) {
        self.convert_device_images(images, buf);
    }

    fn record(&self, work: &mut dyn FnMut()) -> Option<cudarc::driver::CudaGraph> {
        Some(self.record_graph(work))
    }

    fn replay(&self, graph: &cudarc::driver::CudaGraph) {
        self.replay_graph(graph);
    }

    fn download(&self, buf: &CudaBuf, shape: &[usize]) -> Vec<f32> {
        self.copy_to_host(buf, shape)
    }

    fn with_host<R>(&self, buf: &mut CudaBuf, f: impl FnOnce(&mut [f32]) -> R) -> R {
        self.on_host_copy(buf, f)
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
        buf.view(range)
    }

    fn view_mut<'a>(&self, buf: &'a mut CudaBuf, range: Range<usize>) -> DevViewMut<'a> {
        buf.view_mut(range)
    }

    fn view_mut_pair<'a>(
        &self,
        buf: &'a mut CudaBuf,
        a: Range<usize>,
        b: Range<usize>,
    ) -> (DevViewMut<'a>, DevViewMut<'a>) {
        buf.view_mut_pair(a, b)
    }

    fn fill_zero(&self, x: DevViewMut<'_>) {
        self.zero(x);
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
        self.sgemm((m, k, n), a, b, beta, c);
    }

    fn conv2d_forward(
        &self,
        s: &ConvShape,
        x: DevView<'_>,
        weight: DevView<'_>,
        y: DevViewMut<'_>,
    ) -> CudaConvSaved {
        self.conv_forward(s, x, weight, y)
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
        self.conv_backward(s, saved, x, dy, dx, dweight);
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
        let call = BnTrainingCall {
            dims,
            config,
            x,
            gamma,
            beta,
            running_mean,
            running_var,
            y,
        };
        self.bn_forward_training(call, epilogue)
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
        self.bn_forward_inference(BnInferenceCall {
            dims,
            config,
            x,
            gamma,
            beta,
            running_mean,
            running_var,
            y,
        });
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
        let call = BnBackwardCall {
            dims,
            config,
            saved,
            gamma,
            beta,
            dy,
            dx,
            dgamma,
            dbeta,
        };
        self.bn_backward(call, epilogue);
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
