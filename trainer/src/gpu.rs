//! What this machine offers the CUDA engine, found without initialising anything that could
//! panic: the driver and its GPUs, and the versions of cuDNN, cuBLAS, NVRTC and NCCL that
//! `cudarc` can load. `info` prints it; `--device auto` decides with it.
//!
//! Every library is looked for with cudarc's own `is_culib_present` (a `dlopen` of the
//! names cudarc tries) before any of its functions is called: cudarc panics on a library it
//! cannot load.

use ringmaster_contract::trainer::{Capabilities, Device};

/// A GPU the driver sees.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Gpu {
    /// Its name (`NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// Compute capability, `major.minor` (`9.0` for Hopper).
    pub compute_capability: String,
    /// Device memory in bytes.
    pub memory_bytes: u64,
}

/// The GPUs and CUDA libraries of this machine.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuProbe {
    /// The CUDA version the driver supports (`13.0`), when the driver loads.
    pub driver: Option<String>,
    /// The GPUs.
    pub gpus: Vec<Gpu>,
    /// cuDNN's version, when it loads.
    pub cudnn: Option<String>,
    /// cuBLAS's version, when it loads.
    pub cublas: Option<String>,
    /// NVRTC's version, when it loads.
    pub nvrtc: Option<String>,
    /// NCCL's version, when it loads.
    pub nccl: Option<String>,
    /// Why the CUDA engine could not compute here (the first missing piece), if so.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub missing: Option<String>,
}

/// `major.minor.patch` from a version number `major × 10000 + minor × 100 + patch` (cuDNN 9,
/// NCCL 2.9+).
fn dotted(code: i64) -> String {
    format!("{}.{}.{}", code / 10000, (code / 100) % 100, code % 100)
}

impl GpuProbe {
    /// Looks for the driver, the GPUs and the libraries.
    pub fn detect() -> Self {
        // SAFETY (every `is_culib_present`): a `dlopen` of cudarc's candidate names, the
        // handle dropped at once. The calls after each are made only when it succeeded.
        let driver = unsafe { cudarc::driver::sys::is_culib_present() }
            .then(|| {
                let mut version = 0;
                // SAFETY: the driver loaded; the out-pointer is a live local.
                let status = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) };
                (status == cudarc::driver::sys::CUresult::CUDA_SUCCESS)
                    .then(|| format!("{}.{}", version / 1000, (version % 1000) / 10))
            })
            .flatten();
        let gpus = if driver.is_some() {
            let count = cudarc::driver::CudaContext::device_count()
                .unwrap_or(0)
                .max(0);
            (0..count as usize)
                .filter_map(|ordinal| {
                    let context = cudarc::driver::CudaContext::new(ordinal).ok()?;
                    let (major, minor) = context.compute_capability().ok()?;
                    Some(Gpu {
                        name: context.name().ok()?,
                        compute_capability: format!("{major}.{minor}"),
                        memory_bytes: context.total_mem().ok()? as u64,
                    })
                })
                .collect()
        } else {
            Vec::new()
        };
        let cudnn = unsafe { cudarc::cudnn::sys::is_culib_present() }.then(|| {
            // SAFETY: cuDNN loaded; `cudnnGetVersion` takes nothing and needs no handle.
            dotted(unsafe { cudarc::cudnn::sys::cudnnGetVersion() } as i64)
        });
        let cublas = unsafe { cudarc::cublas::sys::is_culib_present() }.then(|| {
            use cudarc::cublas::sys::{cublasGetProperty, libraryPropertyType};
            let part = |which| {
                let mut value = 0;
                // SAFETY: cuBLAS loaded; the out-pointer is a live local; no handle needed.
                unsafe { cublasGetProperty(which, &mut value) };
                value
            };
            format!(
                "{}.{}.{}",
                part(libraryPropertyType::MAJOR_VERSION),
                part(libraryPropertyType::MINOR_VERSION),
                part(libraryPropertyType::PATCH_LEVEL)
            )
        });
        let nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() }.then(|| {
            let (mut major, mut minor) = (0, 0);
            // SAFETY: NVRTC loaded; the out-pointers are live locals.
            unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
            format!("{major}.{minor}")
        });
        let nccl = unsafe { cudarc::nccl::sys::is_culib_present() }.then(|| {
            let mut code = 0;
            // SAFETY: NCCL loaded; the out-pointer is a live local.
            unsafe { cudarc::nccl::sys::ncclGetVersion(&mut code) };
            dotted(i64::from(code))
        });
        let missing = if driver.is_none() {
            Some("no CUDA driver (libcuda.so.1 does not load: no NVIDIA driver here, or the container was started without the GPU runtime)".to_string())
        } else if gpus.is_empty() {
            Some("the CUDA driver sees no GPU".to_string())
        } else if cudnn.is_none() {
            Some(
                "cuDNN (libcudnn.so.9) does not load: add its folder to LD_LIBRARY_PATH"
                    .to_string(),
            )
        } else if cublas.is_none() {
            Some(
                "cuBLAS (libcublas.so) does not load: add its folder to LD_LIBRARY_PATH"
                    .to_string(),
            )
        } else if nvrtc.is_none() {
            Some("NVRTC (libnvrtc.so) does not load: add its folder to LD_LIBRARY_PATH".to_string())
        } else {
            None
        };
        Self {
            driver,
            gpus,
            cudnn,
            cublas,
            nvrtc,
            nccl,
            missing,
        }
    }
}

/// Where `requested` computes on a trainer with `capabilities`, and why when `auto` did not
/// pick the GPU. `probe` looks at the machine; it is called only when `auto` could take the
/// GPU. `cpu` and `cuda` are taken as asked (the settings check refuses what the trainer
/// cannot do).
pub fn resolve_device(
    requested: Device,
    capabilities: &Capabilities,
    probe: impl FnOnce() -> GpuProbe,
) -> (Device, Option<String>) {
    match requested {
        Device::Auto if !capabilities.devices.contains(&Device::Cuda) => (
            Device::Cpu,
            Some("this ringmaster-trainer has no CUDA engine".into()),
        ),
        Device::Auto => match probe().missing {
            None => (Device::Cuda, None),
            Some(why) => (Device::Cpu, Some(why)),
        },
        other => (other, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(missing: Option<&str>) -> GpuProbe {
        GpuProbe {
            driver: Some("13.0".into()),
            gpus: Vec::new(),
            cudnn: None,
            cublas: None,
            nvrtc: None,
            nccl: None,
            missing: missing.map(String::from),
        }
    }

    #[test]
    fn auto_takes_the_gpu_only_when_the_engine_and_the_machine_have_one() {
        let cpu_only = Capabilities {
            devices: vec![Device::Cpu],
            ..Capabilities::this_release()
        };
        let with_cuda = Capabilities::this_release();
        let never = || -> GpuProbe { panic!("no probe needed") };
        let (device, why) = resolve_device(Device::Auto, &cpu_only, never);
        assert_eq!(device, Device::Cpu);
        assert!(why.unwrap().contains("no CUDA engine"));
        assert_eq!(
            resolve_device(Device::Auto, &with_cuda, || probe(None)),
            (Device::Cuda, None)
        );
        let (device, why) = resolve_device(Device::Auto, &with_cuda, || probe(Some("no GPU")));
        assert_eq!((device, why.as_deref()), (Device::Cpu, Some("no GPU")));
        assert_eq!(
            resolve_device(Device::Cpu, &with_cuda, never),
            (Device::Cpu, None)
        );
    }

    #[test]
    fn versions_read_as_dotted_numbers() {
        assert_eq!(dotted(91900), "9.19.0");
        assert_eq!(dotted(22803), "2.28.3");
    }
}
