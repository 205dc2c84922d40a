//! The CUDA backend's NVRTC kernels, compiled by a real NVRTC on a machine without a GPU
//! (`make unit` installs NVIDIA's NVRTC wheel and puts it on `LD_LIBRARY_PATH`; built only
//! with the `nvrtc-tests` feature). What a GPU alone can check (that they compute the right
//! thing) is in `tests/gpu.rs`.

use std::collections::BTreeSet;

use ringmaster_trainer::engine::backend::CudaError;
use ringmaster_trainer::engine::backend::cuda::{KERNEL_NAMES, KERNELS, compile_kernels};

/// The architectures the trainer meets on AKS: A100 (8.0), A10/A40 (8.6), L4/L40S (8.9),
/// H100/H200 (9.0), B200 (10.0).
const ARCHES: &[(i32, i32)] = &[(8, 0), (8, 6), (8, 9), (9, 0), (10, 0)];

fn compile(major: i32, minor: i32) -> Vec<u8> {
    compile_kernels(KERNELS, major, minor).unwrap_or_else(|e| {
        panic!("the kernels do not compile for sm_{major}{minor}: {e} (run through `make unit`, which installs NVRTC)")
    })
}

/// `extern "C" __global__ void NAME(` in the source, in order.
fn kernels_declared(source: &str) -> BTreeSet<String> {
    source
        .split("extern \"C\" __global__ void ")
        .skip(1)
        .map(|rest| {
            rest.split('(')
                .next()
                .unwrap_or_default()
                .trim()
                .to_string()
        })
        .collect()
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
        for name in KERNEL_NAMES {
            let symbol = [b"\0", name.as_bytes(), b"\0"].concat();
            assert!(
                cubin.windows(symbol.len()).any(|w| w == symbol),
                "sm_{major}{minor}: the CUBIN has no symbol {name}, which the backend loads"
            );
        }
    }
}

#[test]
fn every_kernel_in_the_source_is_loaded_and_every_loaded_one_is_in_the_source() {
    let declared = kernels_declared(KERNELS);
    let loaded: BTreeSet<String> = KERNEL_NAMES.iter().map(|n| n.to_string()).collect();
    assert_eq!(
        declared, loaded,
        "cuda_kernels.cu and KERNEL_NAMES disagree"
    );
    assert_eq!(
        loaded.len(),
        KERNEL_NAMES.len(),
        "KERNEL_NAMES lists a kernel twice"
    );
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
