//! The backend's own kernels ([`crate::engine::backend::kernels`]): compiled by NVRTC for
//! the GPU at start, loaded, and launched on the compute stream.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, result};

use super::{CudaBackend, CudaError, driver};
use crate::engine::backend::kernels::{self, KernelLauncher};

/// NVRTC is missing: the one check before cudarc, which panics on a library it cannot load.
pub(super) fn nvrtc_missing() -> Option<CudaError> {
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

/// Every kernel of [`kernels::SOURCE`], compiled for the GPU of `ctx` and loaded, by name.
pub(super) fn load_kernels(
    ctx: &Arc<CudaContext>,
) -> Result<HashMap<&'static str, CudaFunction>, CudaError> {
    let (major, minor) = driver(|| "compute capability".into(), ctx.compute_capability())?;
    let cubin = compile_kernels(kernels::SOURCE, major, minor)?;
    let module = driver(
        || "loading the kernels".into(),
        ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)),
    )?;
    let mut loaded = HashMap::new();
    for &(name, _) in kernels::SIGNATURES {
        let f = driver(|| format!("kernel {name}"), module.load_function(name))?;
        loaded.insert(name, f);
    }
    Ok(loaded)
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
