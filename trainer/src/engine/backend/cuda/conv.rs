//! Convolutions on cuDNN: descriptors, a plan per shape and type, the algorithm search
//! ([`AlgorithmSearch`]: cuDNN's Find on the call's own buffers, or its heuristics) and the
//! forward and backward calls.

use std::ffi::c_void;
use std::rc::Rc;

use cudarc::cudnn::sys as cudnn;
use cudarc::driver::sys::CUdeviceptr;

use super::cudnn::{TensorDesc, check_cudnn, cudnn_type};
use super::memory::{CudaBuf, DevView, DevViewMut};
use super::{CudaBackend, CudaError};
use crate::engine::backend::ConvShape;
use crate::engine::backend::kernels;
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

/// What a convolution keeps: the KRSC working copy of its weight.
#[derive(Clone, Debug)]
pub struct CudaConvSaved {
    weight: CudaBuf,
}

/// A convolution's weight descriptor.
struct FilterDesc(cudnn::cudnnFilterDescriptor_t);

impl FilterDesc {
    /// The KRSC working copy of the weight of `s`, in `dtype`.
    fn krsc(s: &ConvShape, dtype: DType) -> Self {
        let mut d = std::ptr::null_mut();
        // SAFETY: an out-pointer to a live local; the descriptor is destroyed in Drop.
        unsafe {
            check_cudnn(
                cudnn::cudnnCreateFilterDescriptor(&mut d),
                "cudnnCreateFilterDescriptor",
            );
            let desc = Self(d);
            check_cudnn(
                cudnn::cudnnSetFilter4dDescriptor(
                    d,
                    cudnn_type(dtype),
                    cudnn::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
                    s.out_channels as i32,
                    s.c as i32,
                    s.kernel as i32,
                    s.kernel as i32,
                ),
                "cudnnSetFilter4dDescriptor",
            );
            desc
        }
    }
}

impl Drop for FilterDesc {
    fn drop(&mut self) {
        // SAFETY: created by cudnnCreateFilterDescriptor, destroyed once.
        unsafe { cudnn::cudnnDestroyFilterDescriptor(self.0) };
    }
}

/// A convolution's padding and stride (the math type is set per call, see [`Found`]).
struct ConvDesc(cudnn::cudnnConvolutionDescriptor_t);

impl ConvDesc {
    /// The cross-correlation of `s`, accumulated in f32.
    fn of(s: &ConvShape) -> Self {
        let mut d = std::ptr::null_mut();
        // SAFETY: an out-pointer to a live local; the descriptor is destroyed in Drop.
        unsafe {
            check_cudnn(
                cudnn::cudnnCreateConvolutionDescriptor(&mut d),
                "cudnnCreateConvolutionDescriptor",
            );
            let desc = Self(d);
            check_cudnn(
                cudnn::cudnnSetConvolution2dDescriptor(
                    d,
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
            desc
        }
    }
}

impl Drop for ConvDesc {
    fn drop(&mut self) {
        // SAFETY: created by cudnnCreateConvolutionDescriptor, destroyed once.
        unsafe { cudnn::cudnnDestroyConvolutionDescriptor(self.0) };
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
pub(super) struct ConvPlan {
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

impl CudaBackend {
    /// The convolution's descriptors for this shape and type, made the first time it runs;
    /// each direction's algorithm is searched when that direction first runs.
    fn conv_plan(&self, s: &ConvShape, dtype: DType) -> Rc<ConvPlan> {
        if let Some(plan) = self.inner.conv_plans.borrow().get(&(*s, dtype)) {
            return plan.clone();
        }
        let (oh, ow) = s.output_size();
        let xd = TensorDesc::nhwc(dtype, s.n, s.c, s.h, s.w);
        let yd = TensorDesc::nhwc(dtype, s.n, s.out_channels, oh, ow);
        let plan = Rc::new(ConvPlan {
            x: xd,
            y: yd,
            w: FilterDesc::krsc(s, dtype),
            conv: ConvDesc::of(s),
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

    /// [`Backend::conv2d_forward`](crate::engine::backend::Backend::conv2d_forward): `y`
    /// from `x` and a KRSC working copy of `weight`, which is kept for backward.
    pub(super) fn conv_forward(
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

    /// [`Backend::conv2d_backward`](crate::engine::backend::Backend::conv2d_backward): the
    /// input's gradient when asked for, then the weight's, added to `dweight`.
    pub(super) fn conv_backward(
        &self,
        s: &ConvShape,
        saved: &CudaConvSaved,
        x: DevView<'_>,
        dy: DevView<'_>,
        dx: Option<DevViewMut<'_>>,
        dweight: DevViewMut<'_>,
    ) {
        let dtype = x.dtype;
        assert_eq!(saved.weight.len, dweight.len, "conv backward weight shape");
        let plan = self.inner.conv_plans.borrow()[&(*s, dtype)].clone();
        if let Some(dx) = dx {
            self.conv_backward_data(&plan, s, &saved.weight, dy, dx);
        }
        self.conv_backward_filter(&plan, s, x, dy, dweight);
    }

    /// The gradient of the input, `dx`, from the working weight `weight` and `dy`.
    fn conv_backward_data(
        &self,
        plan: &ConvPlan,
        s: &ConvShape,
        weight: &CudaBuf,
        dy: DevView<'_>,
        dx: DevViewMut<'_>,
    ) {
        let (one, zero) = (1.0f32, 0.0f32);
        let found = self.backward_data_found(plan, s, weight.ptr, dy.ptr, dx.ptr);
        plan.use_math(found.math);
        let (ws, ws_len, _held) = self.workspace(found.workspace);
        // SAFETY: buffers match the plan's descriptors; alpha/beta are host f32s.
        let status = unsafe {
            cudnn::cudnnConvolutionBackwardData(
                self.inner.cudnn,
                &one as *const f32 as *const c_void,
                plan.w.0,
                weight.ptr as *const c_void,
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

    /// The weight's gradient from `x` and `dy`, computed in the activations' type and
    /// layout and added to the f32 KCRS `dweight`.
    fn conv_backward_filter(
        &self,
        plan: &ConvPlan,
        s: &ConvShape,
        x: DevView<'_>,
        dy: DevView<'_>,
        dweight: DevViewMut<'_>,
    ) {
        let (one, zero) = (1.0f32, 0.0f32);
        let dw = self.arena_alloc(dweight.len, x.dtype);
        let found = self.backward_filter_found(plan, s, x.ptr, dy.ptr, dw.ptr);
        plan.use_math(found.math);
        let (ws, ws_len, _held) = self.workspace(found.workspace);
        // SAFETY: buffers match the plan's descriptors; alpha/beta are host f32s.
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
}
