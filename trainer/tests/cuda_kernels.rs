//! The CUDA backend's NVRTC kernels, compiled by a real NVRTC on a machine without a GPU
//! (`make unit` installs NVIDIA's NVRTC wheel and puts it on `LD_LIBRARY_PATH`; built only
//! with the `nvrtc-tests` feature). That they compute the right thing is checked on the CPU
//! (`tests/kernels_on_cpu.rs`) and on a GPU (`tests/gpu.rs`); that the source declares the
//! kernels the backend calls, with the parameter types it passes, by a unit test of
//! `engine::backend::kernels`.

use ringmaster_trainer::engine::backend::CudaError;
use ringmaster_trainer::engine::backend::cuda::compile_kernels;
use ringmaster_trainer::engine::backend::kernels::{SIGNATURES, SOURCE};

/// The architectures the trainer meets on AKS: A100 (8.0), A10/A40 (8.6), L4/L40S (8.9),
/// H100/H200 (9.0), B200 (10.0).
const ARCHES: &[(i32, i32)] = &[(8, 0), (8, 6), (8, 9), (9, 0), (10, 0)];

fn compile(major: i32, minor: i32) -> Vec<u8> {
    compile_kernels(SOURCE, major, minor).unwrap_or_else(|e| {
        panic!("the kernels do not compile for sm_{major}{minor}: {e} (run through `make unit`, which installs NVRTC)")
    })
}

#[test]
fn the_kernels_compile_to_machine_code_for_every_gpu_generation_on_aks() {
    for &(major, minor) in ARCHES {
        let cubin = compile(major, minor);
        assert!(
            cubin.starts_with(b"\x7fELF"),
            "sm_{major}{minor}: NVRTC returned {} bytes that are not an ELF CUBIN",
            cubin.len()
        );
        for (name, _) in SIGNATURES {
            let symbol = [b"\0", name.as_bytes(), b"\0"].concat();
            assert!(
                cubin.windows(symbol.len()).any(|w| w == symbol),
                "sm_{major}{minor}: the CUBIN has no symbol {name}, which the backend loads"
            );
        }
    }
}

#[test]
fn a_kernel_that_does_not_compile_is_reported_with_nvrtcs_log() {
    let broken = "extern \"C\" __global__ void broken(float* y) {\n    y[0] = undeclared;\n}\n";
    match compile_kernels(broken, 9, 0) {
        Err(CudaError::Nvrtc { arch, message }) => {
            assert_eq!(arch, "90");
            assert!(
                message.contains("undeclared") && message.contains("ringmaster_kernels.cu(2)"),
                "the error should carry NVRTC's log, naming the line: {message}"
            );
        }
        other => panic!("expected an NVRTC error, got {other:?}"),
    }
}

/// The GPU loader's crop kernel (`image_folder/crop.cu`) compiles for the same GPUs.
#[test]
fn the_gpu_loaders_crop_kernel_compiles_for_every_gpu_generation_on_aks() {
    use ringmaster_trainer::engine::image_folder::gpu;
    for &(major, minor) in ARCHES {
        let cubin = compile_kernels(gpu::SOURCE, major, minor)
            .unwrap_or_else(|e| panic!("crop.cu does not compile for sm_{major}{minor}: {e}"));
        let symbol = b"\0crop_resize_normalize\0";
        assert!(
            cubin.windows(symbol.len()).any(|w| w == symbol),
            "sm_{major}{minor}: no crop_resize_normalize in the CUBIN"
        );
    }
}
