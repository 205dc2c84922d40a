//! The classifier's GEMMs on cuBLAS: the handle on the backend's stream, its workspace, and
//! row-major products read as cuBLAS's column-major ones.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::sys as cublas;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::memory::{DevView, DevViewMut};
use super::{CudaBackend, CudaError, driver, library_at_start};
use crate::engine::backend::Matrix;
use crate::engine::tensor::DType;

/// cuBLAS's workspace: what NVIDIA recommends for Hopper (32 MiB).
const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// Panics with the call's name when cuBLAS did not succeed (inside operations).
fn check_cublas(status: cublas::cublasStatus_t, call: &str) {
    assert!(
        status == cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS,
        "{call} returned {status:?}"
    );
}

/// A cuBLAS call's failure while the backend starts.
fn cublas_at_start(status: cublas::cublasStatus_t, call: &'static str) -> Result<(), CudaError> {
    library_at_start(status, cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS, call)
}

/// A cuBLAS handle queuing on `stream`, and the workspace set on it (to be freed after the
/// handle is destroyed).
pub(super) fn cublas_handle(
    stream: &Arc<CudaStream>,
) -> Result<(cublas::cublasHandle_t, CudaSlice<u8>), CudaError> {
    let mut handle = std::ptr::null_mut();
    // SAFETY: an out-pointer to a live local; the stream outlives the handle (Inner).
    unsafe {
        cublas_at_start(cublas::cublasCreate_v2(&mut handle), "cublasCreate_v2")?;
        cublas_at_start(
            cublas::cublasSetStream_v2(handle, stream.cu_stream() as _),
            "cublasSetStream_v2",
        )?;
    }
    // cuBLAS's workspace given up front, so a captured step never makes it allocate.
    let workspace = driver(|| "allocating cuBLAS's workspace".into(), {
        stream.alloc_zeros::<u8>(CUBLAS_WORKSPACE_BYTES)
    })?;
    let (workspace_ptr, sync) = workspace.device_ptr(stream);
    drop(sync);
    // SAFETY: the handle is live and the workspace outlives it (both in Inner, the
    // handle destroyed first).
    let s = unsafe {
        cublas::cublasSetWorkspace_v2(handle, workspace_ptr as *mut c_void, CUBLAS_WORKSPACE_BYTES)
    };
    cublas_at_start(s, "cublasSetWorkspace_v2")?;
    Ok((handle, workspace))
}

impl CudaBackend {
    /// [`Backend::gemm`](crate::engine::backend::Backend::gemm): `c = a·b + beta·c` for
    /// `a` of `m×k` and `b` of `k×n`, in f32.
    pub(super) fn sgemm(
        &self,
        (m, k, n): (usize, usize, usize),
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
}
