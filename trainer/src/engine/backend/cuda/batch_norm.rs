//! Batch norm on the GPU: the engines that compute training batch norm
//! ([`BatchNormEngine`]: cuDNN's fused `…Ex` calls, its plain calls, or our kernels), a
//! plan per shape, type and epilogue, and the forward and backward passes.

use std::ffi::c_void;
use std::rc::Rc;

use cudarc::cudnn::sys as cudnn;
use cudarc::driver::result;
use cudarc::driver::sys::CUdeviceptr;

use super::cudnn::{TensorDesc, check_cudnn};
use super::memory::{ArenaLease, CudaBuf, DevPtr, DevView, DevViewMut};
use super::{CudaBackend, CudaError};
use crate::engine::backend::kernels::{self, Operand};
use crate::engine::backend::{BatchNormConfig, BnEpilogue, BnEpilogueGrad, BnEpilogueKind};
use crate::engine::tensor::DType;

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

/// Batch norm's `(n, c, hw)`, activations' type and fused operations.
pub(super) type BnKey = (usize, usize, usize, DType, BnEpilogueKind);

/// Batch norm's descriptors for one input shape and epilogue.
pub(super) struct BnPlan {
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

impl CudaBackend {
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

/// A batch norm's forward operands, as the [`Backend`](crate::engine::backend::Backend)
/// calls take them, less the epilogue. `Running`: the running statistics' views, written
/// in training ([`DevViewMut`]), read in inference ([`DevView`]).
pub(super) struct BnForwardCall<'a, Running> {
    pub(super) dims: (usize, usize, usize),
    pub(super) config: BatchNormConfig,
    pub(super) x: DevView<'a>,
    pub(super) gamma: DevView<'a>,
    pub(super) beta: DevView<'a>,
    pub(super) running_mean: Running,
    pub(super) running_var: Running,
    pub(super) y: DevViewMut<'a>,
}

/// A training batch norm's operands, which update the running statistics.
pub(super) type BnTrainingCall<'a> = BnForwardCall<'a, DevViewMut<'a>>;

/// An inference batch norm's operands, which read the running statistics.
pub(super) type BnInferenceCall<'a> = BnForwardCall<'a, DevView<'a>>;

/// A batch norm's backward operands, as
/// [`Backend::batch_norm_backward`](crate::engine::backend::Backend::batch_norm_backward)
/// takes them, less the epilogue.
pub(super) struct BnBackwardCall<'a> {
    pub(super) dims: (usize, usize, usize),
    pub(super) config: BatchNormConfig,
    pub(super) saved: &'a CudaBnSaved,
    pub(super) gamma: DevView<'a>,
    pub(super) beta: DevView<'a>,
    pub(super) dy: DevView<'a>,
    pub(super) dx: DevViewMut<'a>,
    pub(super) dgamma: DevViewMut<'a>,
    pub(super) dbeta: DevViewMut<'a>,
}

/// The batch's mean and inverse deviation, which training batch norm writes for backward.
struct BatchStatistics {
    mean: CudaBuf,
    inv_var: CudaBuf,
}

/// The backward pass's view of the epilogue: the forward output (a ReLU's mask) and where
/// the residual's gradient goes.
struct EpilogueGrads<'a, 'b> {
    y: Option<DevView<'a>>,
    dz: Option<&'b DevViewMut<'a>>,
}

impl CudaBackend {
    /// A training batch norm on the chosen [`BatchNormEngine`]; what it keeps for backward.
    pub(super) fn bn_forward_training(
        &self,
        call: BnTrainingCall<'_>,
        epilogue: BnEpilogue<DevView<'_>>,
    ) -> CudaBnSaved {
        let statistics = BatchStatistics {
            mean: self.arena_alloc(call.dims.1, DType::F32),
            inv_var: self.arena_alloc(call.dims.1, DType::F32),
        };
        let reserve = if self.inner.batch_norm.get() == BatchNormEngine::Own {
            self.own_forward_training(&call, epilogue, &statistics);
            None
        } else {
            self.cudnn_forward_training(&call, epilogue, &statistics)
        };
        CudaBnSaved {
            x: call.x.into(),
            _x_held: self.hold(call.x.ptr),
            mean: statistics.mean,
            inv_var: statistics.inv_var,
            reserve,
        }
    }

    /// Training batch norm with our kernels, the epilogue in the same pass.
    fn own_forward_training(
        &self,
        call: &BnTrainingCall<'_>,
        epilogue: BnEpilogue<DevView<'_>>,
        statistics: &BatchStatistics,
    ) {
        let scratch = self.batch_norm_scratch(call.dims);
        let epilogue = match epilogue {
            BnEpilogue::Identity => BnEpilogue::Identity,
            BnEpilogue::Relu => BnEpilogue::Relu,
            BnEpilogue::AddRelu(z) => BnEpilogue::AddRelu(z.op()),
        };
        kernels::batch_norm_forward_training(
            self,
            call.dims,
            call.config,
            call.x.op(),
            call.gamma.op(),
            call.beta.op(),
            call.running_mean.op(),
            call.running_var.op(),
            epilogue,
            call.y.op(),
            statistics.mean.op(),
            statistics.inv_var.op(),
            scratch.op(),
        );
    }

    /// Training batch norm on cuDNN: the fused call where the plan has it and cuDNN takes
    /// it, else the plain call and our kernels for the epilogue. The fused call's reserve
    /// space (and its length in bytes), when it ran.
    fn cudnn_forward_training(
        &self,
        call: &BnTrainingCall<'_>,
        epilogue: BnEpilogue<DevView<'_>>,
        statistics: &BatchStatistics,
    ) -> Option<(CudaBuf, usize)> {
        let plan = self.bn_plan(call.dims, call.x.dtype, epilogue.kind());
        let residual = match epilogue {
            BnEpilogue::AddRelu(z) => {
                assert_eq!(
                    (z.len, z.dtype),
                    (call.x.len, call.x.dtype),
                    "batch-norm residual"
                );
                Some(z)
            }
            BnEpilogue::Identity | BnEpilogue::Relu => None,
        };
        let reserve = plan.fused().and_then(|fused| {
            self.fused_forward_training(&plan, fused, call, residual, statistics)
        });
        if reserve.is_none() {
            self.plain_forward_training(&plan, call, statistics);
            if let Some(z) = residual {
                kernels::add_assign(self, call.y.op(), z.op());
            }
            if epilogue.has_relu() {
                // In place: each thread reads its element before writing it.
                kernels::relu_forward(self, call.y.op(), call.y.op());
            }
        }
        reserve
    }

    /// cuDNN's fused training call, the residual `z` added before the ReLU when given; its
    /// reserve space and length, or `None` when cuDNN refused (see [`BnPlan::refuses`]).
    fn fused_forward_training(
        &self,
        plan: &BnPlan,
        fused: &FusedBn,
        call: &BnTrainingCall<'_>,
        z: Option<DevView<'_>>,
        statistics: &BatchStatistics,
    ) -> Option<(CudaBuf, usize)> {
        let (one, zero) = (1.0f32, 0.0f32);
        let reserve = self.arena_alloc(fused.reserve.div_ceil(4), DType::F32);
        let (ws, ws_len, _held) = self.workspace(fused.workspace[0]);
        let (z_desc, z_ptr) = z.map_or((std::ptr::null_mut(), 0), |z| (plan.x.0, z.ptr));
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
                call.x.ptr as *const c_void,
                z_desc,
                z_ptr as *const c_void,
                plan.x.0,
                call.y.ptr as *mut c_void,
                plan.params.0,
                call.gamma.ptr as *const c_void,
                call.beta.ptr as *const c_void,
                f64::from(call.config.momentum),
                call.running_mean.ptr as *mut c_void,
                call.running_var.ptr as *mut c_void,
                f64::from(call.config.eps),
                statistics.mean.ptr as *mut c_void,
                statistics.inv_var.ptr as *mut c_void,
                fused.activation(),
                ws as *mut c_void,
                ws_len,
                reserve.ptr as *mut c_void,
                fused.reserve,
            )
        };
        let reserve_len = fused.reserve;
        (!plan.refuses(status, BnCall::Forward)).then_some((reserve, reserve_len))
    }

    /// cuDNN's plain training call: the normalisation alone.
    fn plain_forward_training(
        &self,
        plan: &BnPlan,
        call: &BnTrainingCall<'_>,
        statistics: &BatchStatistics,
    ) {
        let (one, zero) = (1.0f32, 0.0f32);
        // SAFETY: as in the fused call, without the fused parts.
        let status = unsafe {
            cudnn::cudnnBatchNormalizationForwardTraining(
                self.inner.cudnn,
                BN_MODE,
                &one as *const f32 as *const c_void,
                &zero as *const f32 as *const c_void,
                plan.x.0,
                call.x.ptr as *const c_void,
                plan.x.0,
                call.y.ptr as *mut c_void,
                plan.params.0,
                call.gamma.ptr as *const c_void,
                call.beta.ptr as *const c_void,
                f64::from(call.config.momentum),
                call.running_mean.ptr as *mut c_void,
                call.running_var.ptr as *mut c_void,
                f64::from(call.config.eps),
                statistics.mean.ptr as *mut c_void,
                statistics.inv_var.ptr as *mut c_void,
            )
        };
        check_cudnn(status, "cudnnBatchNormalizationForwardTraining");
    }

    /// Inference batch norm: cuDNN's plain call with the running statistics, whatever the
    /// engine.
    pub(super) fn bn_forward_inference(&self, call: BnInferenceCall<'_>) {
        let plan = self.bn_plan(call.dims, call.x.dtype, BnEpilogueKind::Identity);
        let (one, zero) = (1.0f32, 0.0f32);
        // SAFETY: as in the training pass.
        let status = unsafe {
            cudnn::cudnnBatchNormalizationForwardInference(
                self.inner.cudnn,
                BN_MODE,
                &one as *const f32 as *const c_void,
                &zero as *const f32 as *const c_void,
                plan.x.0,
                call.x.ptr as *const c_void,
                plan.x.0,
                call.y.ptr as *mut c_void,
                plan.params.0,
                call.gamma.ptr as *const c_void,
                call.beta.ptr as *const c_void,
                call.running_mean.ptr as *const c_void,
                call.running_var.ptr as *const c_void,
                f64::from(call.config.eps),
            )
        };
        check_cudnn(status, "cudnnBatchNormalizationForwardInference");
    }

    /// A batch norm's backward pass on the chosen [`BatchNormEngine`], the epilogue's first.
    pub(super) fn bn_backward(
        &self,
        call: BnBackwardCall<'_>,
        epilogue: BnEpilogueGrad<DevView<'_>, DevViewMut<'_>>,
    ) {
        assert_eq!(call.saved.x.len, call.dy.len, "batch-norm backward shape");
        if self.inner.batch_norm.get() == BatchNormEngine::Own {
            self.own_backward(&call, epilogue);
            return;
        }
        let plan = self.bn_plan(call.dims, call.saved.x.dtype, epilogue.kind());
        let (y, dz) = match epilogue {
            BnEpilogueGrad::Identity => (None, None),
            BnEpilogueGrad::Relu { y } => (Some(y), None),
            BnEpilogueGrad::AddRelu { y, dz } => (Some(y), Some(dz)),
        };
        let epilogue = EpilogueGrads { y, dz: dz.as_ref() };
        // cuDNN writes the parameter gradients into scratch (beta 0, as PyTorch asks for
        // them), and our kernel adds them: accumulation does not depend on every cuDNN
        // kernel honouring a beta of 1.
        let param_grads = self.arena_alloc(2 * call.dims.1, DType::F32);
        if !self.fused_backward(&plan, &call, &epilogue, &param_grads) {
            self.plain_backward(&plan, &call, &epilogue, &param_grads);
        }
        let [scratch_dgamma, scratch_dbeta] = param_grad_halves(&param_grads, call.dims.1);
        kernels::add_assign(self, call.dgamma.op(), scratch_dgamma);
        kernels::add_assign(self, call.dbeta.op(), scratch_dbeta);
    }

    /// The backward pass with our kernels, from the saved mean and inverse deviation,
    /// whichever engine ran forward.
    fn own_backward(
        &self,
        call: &BnBackwardCall<'_>,
        epilogue: BnEpilogueGrad<DevView<'_>, DevViewMut<'_>>,
    ) {
        let scratch = self.batch_norm_scratch(call.dims);
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
            call.dims,
            call.saved.x.op(),
            call.saved.mean.op(),
            call.saved.inv_var.op(),
            call.gamma.op(),
            epilogue,
            call.dy.op(),
            call.dx.op(),
            call.dgamma.op(),
            call.dbeta.op(),
            scratch.op(),
        );
    }

    /// cuDNN's fused backward call, the parameter gradients into `param_grads`; whether it
    /// ran (it needs the plan's fused calls and the forward pass's reserve space, and
    /// cuDNN may refuse it, see [`BnPlan::refuses`]).
    fn fused_backward(
        &self,
        plan: &BnPlan,
        call: &BnBackwardCall<'_>,
        epilogue: &EpilogueGrads<'_, '_>,
        param_grads: &CudaBuf,
    ) -> bool {
        let (Some(fused), Some((reserve, reserve_len))) = (plan.fused(), &call.saved.reserve)
        else {
            return false;
        };
        let (one, zero) = (1.0f32, 0.0f32);
        let (ws, ws_len, _held) = self.workspace(fused.workspace[1]);
        let null = std::ptr::null_mut();
        let (y_desc, y_ptr) = epilogue.y.map_or((null, 0), |y| (plan.x.0, y.ptr));
        let (dz_desc, dz_ptr) = epilogue.dz.map_or((null, 0), |dz| (plan.x.0, dz.ptr));
        let [scratch_dgamma, scratch_dbeta] = param_grad_places(param_grads, call.dims.1);
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
                call.saved.x.ptr as *const c_void,
                y_desc,
                y_ptr as *const c_void,
                plan.x.0,
                call.dy.ptr as *const c_void,
                dz_desc,
                dz_ptr as *mut c_void,
                plan.x.0,
                call.dx.ptr as *mut c_void,
                plan.params.0,
                call.gamma.ptr as *const c_void,
                call.beta.ptr as *const c_void,
                scratch_dgamma as *mut c_void,
                scratch_dbeta as *mut c_void,
                f64::from(call.config.eps),
                call.saved.mean.ptr as *const c_void,
                call.saved.inv_var.ptr as *const c_void,
                fused.activation(),
                ws as *mut c_void,
                ws_len,
                reserve.ptr as *mut c_void,
                *reserve_len,
            )
        };
        !plan.refuses(status, BnCall::Backward)
    }

    /// The plain path (also after a fused forward pass: it needs only the saved mean and
    /// inverse deviation): through the ReLU with our kernel (its result is also the
    /// residual's gradient), then cuDNN's plain backward call, the parameter gradients into
    /// `param_grads`.
    fn plain_backward(
        &self,
        plan: &BnPlan,
        call: &BnBackwardCall<'_>,
        epilogue: &EpilogueGrads<'_, '_>,
        param_grads: &CudaBuf,
    ) {
        let (one, zero) = (1.0f32, 0.0f32);
        // Held to the end: the batch norm below reads it.
        let masked = epilogue
            .y
            .map(|y| self.relu_backward_into_residual(y, call.dy, epilogue.dz));
        let dy_ptr = masked.as_ref().map_or(call.dy.ptr, |m| m.ptr);
        let [scratch_dgamma, scratch_dbeta] = param_grad_places(param_grads, call.dims.1);
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
                call.saved.x.ptr as *const c_void,
                plan.x.0,
                dy_ptr as *const c_void,
                plan.x.0,
                call.dx.ptr as *mut c_void,
                plan.params.0,
                call.gamma.ptr as *const c_void,
                scratch_dgamma as *mut c_void,
                scratch_dbeta as *mut c_void,
                f64::from(call.config.eps),
                call.saved.mean.ptr as *const c_void,
                call.saved.inv_var.ptr as *const c_void,
            )
        };
        check_cudnn(status, "cudnnBatchNormalizationBackward");
    }

    /// `dy` through the ReLU whose output was `y`, into a temporary, which is copied to
    /// the residual's gradient `dz` when there is one.
    fn relu_backward_into_residual(
        &self,
        y: DevView<'_>,
        dy: DevView<'_>,
        dz: Option<&DevViewMut<'_>>,
    ) -> CudaBuf {
        let dtype = dy.dtype;
        let masked = self.arena_alloc(dy.len, dtype);
        kernels::relu_backward(self, y.op(), dy.op(), masked.op());
        if let Some(dz) = dz {
            // SAFETY: both are live device buffers of `len` elements of `dtype`.
            unsafe {
                result::memcpy_dtod_async(dz.ptr, masked.ptr, dz.len * dtype.size(), self.stream())
            }
            .unwrap_or_else(|e| panic!("copying the residual's gradient: {e}"));
        }
        masked
    }
}

/// Where cuDNN writes the gradients of gamma and beta: the halves of `param_grads`, `c`
/// f32s each.
fn param_grad_places(param_grads: &CudaBuf, c: usize) -> [CUdeviceptr; 2] {
    [param_grads.ptr, param_grads.ptr + (c * 4) as u64]
}

/// The halves of `param_grads` (see [`param_grad_places`]) as kernel operands.
fn param_grad_halves(param_grads: &CudaBuf, c: usize) -> [Operand; 2] {
    // SAFETY: each half of `param_grads`, `c` f32s of this step's arena.
    param_grad_places(param_grads, c).map(|ptr| unsafe { Operand::new(ptr, c, DType::F32) })
}
