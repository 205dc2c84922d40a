//! What convolution and batch norm share of cuDNN: the handle, status checks, the data
//! type and tensor descriptors.

use std::sync::Arc;

use cudarc::cudnn::sys as cudnn;
use cudarc::driver::CudaStream;

use super::{CudaError, library_at_start};
use crate::engine::tensor::DType;

/// Panics with the call's name when cuDNN did not succeed (inside operations).
pub(super) fn check_cudnn(status: cudnn::cudnnStatus_t, call: &str) {
    assert!(
        status == cudnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS,
        "{call} returned {status:?}"
    );
}

/// A cuDNN call's failure while the backend starts.
fn cudnn_at_start(status: cudnn::cudnnStatus_t, call: &'static str) -> Result<(), CudaError> {
    library_at_start(status, cudnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS, call)
}

/// cuDNN's name for an activations' type.
pub(super) fn cudnn_type(dtype: DType) -> cudnn::cudnnDataType_t {
    match dtype {
        DType::F32 => cudnn::cudnnDataType_t::CUDNN_DATA_FLOAT,
        DType::Bf16 => cudnn::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
    }
}

/// An NHWC tensor descriptor.
pub(super) struct TensorDesc(pub(super) cudnn::cudnnTensorDescriptor_t);

impl TensorDesc {
    pub(super) fn nhwc(dtype: DType, n: usize, c: usize, h: usize, w: usize) -> Self {
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
    pub(super) fn batch_norm_params(c: usize) -> Self {
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

/// A cuDNN handle queuing on `stream` (which must outlive it).
pub(super) fn cudnn_handle(stream: &Arc<CudaStream>) -> Result<cudnn::cudnnHandle_t, CudaError> {
    let mut handle = std::ptr::null_mut();
    // SAFETY: an out-pointer to a live local; the stream outlives the handle (Inner).
    unsafe {
        cudnn_at_start(cudnn::cudnnCreate(&mut handle), "cudnnCreate")?;
        cudnn_at_start(
            cudnn::cudnnSetStream(handle, stream.cu_stream() as _),
            "cudnnSetStream",
        )?;
    }
    Ok(handle)
}
