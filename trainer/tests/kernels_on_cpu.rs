//! The CUDA backend's own kernels, run on the CPU: `cuda_kernels.cu` compiled unchanged by
//! the host's C++ compiler under an emulation of CUDA's grid (`cpu_grid/cuda_on_cpu.h`:
//! every (block, thread) of the launch, one after another), and called through
//! `engine::backend::kernels` exactly as the CUDA backend calls them, with the same
//! arguments from the same shapes, on host memory. Each is checked against the CPU backend
//! (or, for layouts and bf16 rounding, an independent reference), twice: with the blocks
//! the GPU would get, and with 2 blocks, so every grid-stride loop takes several turns.
//!
//! This is what a machine without a GPU can check of the kernels: their arithmetic and
//! indexing, and that the backend's calls agree with them. A GPU checks the rest (NVRTC's
//! code, the device's maths library, concurrency) in `tests/gpu.rs`.

use std::ffi::{CString, c_char, c_void};
use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

use half::bf16;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use ringmaster_trainer::engine::backend::kernels::{
    self, BLOCK, KernelLauncher, Operand, SIGNATURES, SOURCE,
};
use ringmaster_trainer::engine::backend::{
    BatchNormConfig, BnEpilogue, BnEpilogueGrad, ConvShape, PoolShape,
};
use ringmaster_trainer::engine::tensor::{DType, Tensor};
use ringmaster_trainer::engine::{Backend, CpuBackend};

/// The kernels built for the CPU, once per test run.
fn library() -> &'static libloading::Library {
    static LIBRARY: OnceLock<libloading::Library> = OnceLock::new();
    LIBRARY.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("kernels-on-cpu-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a build folder for the kernels");
        // The very text NVRTC compiles.
        std::fs::write(dir.join("cuda_kernels.cu"), SOURCE).expect("writing the kernels' source");
        let list: String = SIGNATURES.iter().map(|(name, _)| format!(" RINGMASTER_KERNEL({name})")).collect();
        std::fs::write(
            dir.join("kernels_on_cpu.cpp"),
            format!(
                "#include \"cuda_on_cpu.h\"\n#include \"cuda_kernels.cu\"\n#define RINGMASTER_KERNELS{list}\n#include \"launch.h\"\n"
            ),
        )
        .expect("writing the emulation's main file");
        let shim = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cpu_grid");
        let lib = dir.join("libkernels_on_cpu.so");
        let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let out = Command::new(&compiler)
            .args(["-std=c++17", "-O2", "-ffp-contract=off", "-Wall", "-Werror", "-shared", "-fPIC"])
            .arg("-I")
            .arg(&shim)
            .arg("-o")
            .arg(&lib)
            .arg(dir.join("kernels_on_cpu.cpp"))
            .output()
            .unwrap_or_else(|e| panic!("running the C++ compiler `{compiler}` (set CXX, or install g++): {e}"));
        assert!(
            out.status.success(),
            "the kernels do not compile for the CPU emulation:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // SAFETY: a library we just built, whose initialisers do nothing.
        unsafe { libloading::Library::new(&lib) }.expect("loading the kernels built for the CPU")
    })
}

/// Launches kernels on the CPU emulation of CUDA's grid.
struct CpuGrid {
    /// Blocks at most (`None`: as many as the CUDA backend launches).
    max_blocks: Option<u32>,
}

impl KernelLauncher for CpuGrid {
    fn launch(&self, name: &'static str, threads: usize, args: &mut [*mut c_void]) {
        if threads == 0 {
            return;
        }
        type Launch = unsafe extern "C" fn(*const c_char, u32, u32, *mut *mut c_void) -> i32;
        // SAFETY: the symbol is `ringmaster_launch` of launch.h, of this signature.
        let launch =
            unsafe { library().get::<Launch>(b"ringmaster_launch\0") }.expect("ringmaster_launch");
        let blocks = kernels::blocks(threads).min(self.max_blocks.unwrap_or(u32::MAX));
        let c_name = CString::new(name).expect("a kernel name");
        // SAFETY: `args` point at live values of the kernel's parameter types (what the
        // signature test checks), naming host memory of the lengths the kernel walks.
        let status = unsafe { launch(c_name.as_ptr(), blocks, BLOCK, args.as_mut_ptr()) };
        assert_eq!(status, 0, "the emulation has no kernel {name}");
    }
}

/// The launch geometries each check runs under.
fn grids() -> [CpuGrid; 2] {
    [
        CpuGrid { max_blocks: None },
        CpuGrid {
            max_blocks: Some(2),
        },
    ]
}

/// Host memory standing in for device memory: 8-byte aligned (the loss keeps f64s).
/// Outputs start as NaN, so an element a kernel forgets to write shows.
struct Mem {
    words: Vec<u64>,
    len: usize,
    dtype: DType,
}

impl Mem {
    fn with(values: &[f32], dtype: DType) -> Self {
        let mut m = Self {
            words: vec![0; (values.len() * dtype.size()).div_ceil(8)],
            len: values.len(),
            dtype,
        };
        let bytes = bytemuck::cast_slice_mut::<u64, u8>(&mut m.words);
        for (i, &v) in values.iter().enumerate() {
            match dtype {
                DType::F32 => bytes[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes()),
                DType::Bf16 => {
                    bytes[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(v).to_le_bytes())
                }
            }
        }
        m
    }

    fn nan(len: usize, dtype: DType) -> Self {
        Self::with(&vec![f32::NAN; len], dtype)
    }

    fn op(&mut self) -> Operand {
        // SAFETY: `words` holds `len` elements of `dtype`, 8-byte aligned, and lives through
        // the test's launches (each runs to the end before the call returns); the tests
        // read it back only after.
        unsafe { Operand::new(self.words.as_mut_ptr() as u64, self.len, self.dtype) }
    }

    fn values(&self) -> Vec<f32> {
        let bytes = bytemuck::cast_slice::<u64, u8>(&self.words);
        (0..self.len)
            .map(|i| match self.dtype {
                DType::F32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()),
                DType::Bf16 => {
                    bf16::from_le_bytes(bytes[2 * i..2 * i + 2].try_into().unwrap()).to_f32()
                }
            })
            .collect()
    }

    fn ints(&self) -> Vec<i32> {
        bytemuck::cast_slice::<u64, i32>(&self.words)[..self.len].to_vec()
    }
}

/// Normal samples, rounded to bf16 when the kernel's operands are bf16 (so the CPU in f32
/// starts from the same values).
fn random(len: usize, seed: u64, dtype: DType) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let v = Tensor::randn(&[len], 1.0, &mut rng).data;
    v.into_iter().map(|x| in_type(x, dtype)).collect()
}

/// `x` as an element of `dtype` holds it.
fn in_type(x: f32, dtype: DType) -> f32 {
    match dtype {
        DType::F32 => x,
        DType::Bf16 => bf16::from_f32(x).to_f32(),
    }
}

/// Every element within `tol` of the largest magnitude of `want` (0: bit for bit, NaN
/// nowhere).
fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            !g.is_nan() && (g - w).abs() <= tol * scale,
            "{what}: element {i} is {g} where the reference has {w} (tolerance {tol} × {scale})"
        );
    }
}

/// NCHW → NHWC, by the definition.
fn to_nhwc(x: &[f32], [n, c, h, w]: [usize; 4]) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for img in 0..n {
        for ch in 0..c {
            for p in 0..h * w {
                out[(img * h * w + p) * c + ch] = x[(img * c + ch) * h * w + p];
            }
        }
    }
    out
}

/// NHWC → NCHW, by the definition.
fn to_nchw(x: &[f32], [n, c, h, w]: [usize; 4]) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for img in 0..n {
        for ch in 0..c {
            for p in 0..h * w {
                out[(img * c + ch) * h * w + p] = x[(img * h * w + p) * c + ch];
            }
        }
    }
    out
}

const DTYPES: [DType; 2] = [DType::F32, DType::Bf16];

#[test]
fn convert_rounds_f32_to_bf16_to_nearest_even_and_widens_exactly() {
    let mut values = vec![
        0.0,
        -0.0,
        1.0,
        -1.5,
        f32::from_bits(0x3f80_8000), // halfway between two bf16s, the even one below
        f32::from_bits(0x3f81_8000), // halfway, the even one above
        f32::from_bits(0x3f80_8001), // just past halfway
        f32::MAX,                    // rounds to infinity
        f32::MIN_POSITIVE,
        f32::from_bits(1), // the smallest subnormal
        f32::INFINITY,
        f32::NEG_INFINITY,
        1e-40,
        65504.0,
    ];
    values.extend(random(3000, 1, DType::F32).iter().map(|x| x * 1e3));
    values.push(f32::NAN);
    for grid in grids() {
        let mut x = Mem::with(&values, DType::F32);
        let mut narrow = Mem::nan(values.len(), DType::Bf16);
        kernels::convert(&grid, x.op(), narrow.op());
        let bits = bytemuck::cast_slice::<u64, u16>(&narrow.words)[..values.len()].to_vec();
        for (i, (&v, &b)) in values.iter().zip(&bits).enumerate() {
            if v.is_nan() {
                assert!(bf16::from_bits(b).is_nan(), "NaN converts to {b:#06x}");
            } else {
                assert_eq!(
                    b,
                    bf16::from_f32(v).to_bits(),
                    "element {i}: {v:e} ({:#010x})",
                    v.to_bits()
                );
            }
        }
        let mut wide = Mem::nan(values.len(), DType::F32);
        kernels::convert(&grid, narrow.op(), wide.op());
        let want: Vec<f32> = bits.iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
        for (g, w) in wide.values().iter().zip(&want) {
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "bf16 {w} widens to {g}"
            );
        }
        let mut copy = Mem::nan(values.len(), DType::F32);
        kernels::convert(&grid, x.op(), copy.op());
        assert!(
            copy.values()
                .iter()
                .zip(&values)
                .all(|(g, w)| g.to_bits() == w.to_bits() || w.is_nan()),
            "f32 to f32 is a copy"
        );
    }
}

#[test]
fn uploads_and_downloads_lay_batches_out_channels_last_and_back() {
    let shape = [3, 5, 4, 7];
    let len = shape.iter().product();
    for dtype in DTYPES {
        for grid in grids() {
            let nchw = random(len, 2, dtype);
            let mut host = Mem::with(&nchw, DType::F32);
            let mut device = Mem::nan(len, dtype);
            kernels::nchw_to_nhwc(&grid, shape, host.op(), device.op());
            assert_close(
                &format!("{dtype:?} upload"),
                &device.values(),
                &to_nhwc(&nchw, shape),
                0.0,
            );
            let mut back = Mem::nan(len, DType::F32);
            kernels::nhwc_to_nchw(&grid, shape, device.op(), back.op());
            assert_close(&format!("{dtype:?} download"), &back.values(), &nchw, 0.0);
        }
    }
}

#[test]
fn conv_weights_go_to_krsc_and_their_gradients_come_back_added_to_kcrs() {
    let s = ConvShape {
        n: 1,
        c: 6,
        h: 8,
        w: 8,
        out_channels: 5,
        kernel: 3,
        stride: 1,
        padding: 1,
    };
    let (k, c, rs) = (5, 6, 9);
    let len = k * c * rs;
    for dtype in DTYPES {
        for grid in grids() {
            let master = random(len, 3, dtype);
            let mut m = Mem::with(&master, DType::F32);
            let mut working = Mem::nan(len, dtype);
            kernels::weights_to_working(&grid, &s, m.op(), working.op());
            // KCRS is NCHW with (k, c, r·s); KRSC is its channels-last.
            assert_close(
                &format!("{dtype:?} KRSC"),
                &working.values(),
                &to_nhwc(&master, [k, c, 3, 3]),
                0.0,
            );
            let earlier = random(len, 4, DType::F32);
            let mut grad = Mem::with(&earlier, DType::F32);
            kernels::add_weight_grad_to_master(&grid, &s, working.op(), grad.op());
            let want: Vec<f32> = earlier.iter().zip(&master).map(|(a, b)| a + b).collect();
            assert_close(
                &format!("{dtype:?} gradient added"),
                &grad.values(),
                &want,
                0.0,
            );
        }
    }
}

#[test]
fn relu_and_add_match_the_cpu() {
    let len = 2 * 8 * 9 * 9 + 3;
    let cpu = CpuBackend;
    for dtype in DTYPES {
        for grid in grids() {
            let x = random(len, 5, dtype);
            let dy = random(len, 6, dtype);
            let mut want_y = vec![0.0; len];
            cpu.relu_forward(&x, &mut want_y);
            let mut want_dx = vec![0.0; len];
            cpu.relu_backward(&want_y, &dy, &mut want_dx);
            let mut want_sum = x.clone();
            cpu.add_assign(&mut want_sum, &dy);
            let want_sum: Vec<f32> = want_sum.iter().map(|&v| in_type(v, dtype)).collect();

            let (mut xm, mut dym) = (Mem::with(&x, dtype), Mem::with(&dy, dtype));
            let mut y = Mem::nan(len, dtype);
            kernels::relu_forward(&grid, xm.op(), y.op());
            assert_close(&format!("{dtype:?} relu"), &y.values(), &want_y, 0.0);
            let mut dx = Mem::nan(len, dtype);
            kernels::relu_backward(&grid, y.op(), dym.op(), dx.op());
            assert_close(
                &format!("{dtype:?} relu backward"),
                &dx.values(),
                &want_dx,
                0.0,
            );
            // In place, as the batch norm's epilogue runs it.
            let mut in_place = Mem::with(&x, dtype);
            kernels::relu_forward(&grid, in_place.op(), in_place.op());
            assert_close(
                &format!("{dtype:?} relu in place"),
                &in_place.values(),
                &want_y,
                0.0,
            );
            kernels::add_assign(&grid, xm.op(), dym.op());
            assert_close(&format!("{dtype:?} add"), &xm.values(), &want_sum, 0.0);
            // A length of whole 8-byte words: the kernel that adds a word a thread.
            let whole = len - 3;
            let (mut a, mut b) = (
                Mem::with(&x[..whole], dtype),
                Mem::with(&dy[..whole], dtype),
            );
            kernels::add_assign(&grid, a.op(), b.op());
            assert_close(
                &format!("{dtype:?} add by words"),
                &a.values(),
                &want_sum[..whole],
                0.0,
            );
        }
    }
}

#[test]
fn max_pool_matches_the_cpu_forward_and_backward_at_the_stems_shape_and_others() {
    let cpu = CpuBackend;
    let shapes = [
        // ResNet's stem pool: 3×3, stride 2, padding 1 (overlapping windows).
        ([2, 5, 9, 7], 3, 2, 1),
        ([1, 3, 8, 8], 2, 2, 0),
        ([2, 4, 5, 6], 3, 1, 1),
    ];
    for ([n, c, h, w], kernel, stride, padding) in shapes {
        let s = PoolShape {
            planes: n * c,
            channels: c,
            h,
            w,
            kernel,
            stride,
            padding,
        };
        let (oh, ow) = s.output_size();
        let (in_shape, out_shape) = ([n, c, h, w], [n, c, oh, ow]);
        for dtype in DTYPES {
            for grid in grids() {
                let what =
                    format!("{dtype:?} {kernel}×{kernel}/{stride} pad {padding} over {in_shape:?}");
                let x = random(n * c * h * w, 7, dtype);
                // Small whole numbers: sums of them are exact in any order and type.
                let dy: Vec<f32> = (0..n * c * oh * ow)
                    .map(|i| ((i * 7) % 5) as f32 - 2.0)
                    .collect();
                let mut want_y = vec![0.0; dy.len()];
                let saved = cpu.max_pool_forward(&s, &x, &mut want_y);
                let mut want_dx = vec![0.0; x.len()];
                cpu.max_pool_backward(&s, &saved, &dy, &mut want_dx);

                let mut xm = Mem::with(&to_nhwc(&x, in_shape), dtype);
                let mut y = Mem::nan(dy.len(), dtype);
                let mut argmax = Mem::nan(dy.len(), DType::F32);
                kernels::max_pool_forward(&grid, &s, xm.op(), y.op(), argmax.op());
                assert_close(
                    &format!("{what}: max"),
                    &to_nchw(&y.values(), out_shape),
                    &want_y,
                    0.0,
                );
                let winners: Vec<f32> = argmax.ints().iter().map(|&i| i as f32).collect();
                let want_winners: Vec<f32> = saved.iter().map(|&i| i as f32).collect();
                assert_close(
                    &format!("{what}: winners"),
                    &to_nchw(&winners, out_shape),
                    &want_winners,
                    0.0,
                );
                let mut dym = Mem::with(&to_nhwc(&dy, out_shape), dtype);
                let mut dx = Mem::nan(x.len(), dtype);
                kernels::max_pool_backward(&grid, &s, argmax.op(), dym.op(), dx.op());
                assert_close(
                    &format!("{what}: backward"),
                    &to_nchw(&dx.values(), in_shape),
                    &want_dx,
                    0.0,
                );
            }
        }
    }
}

#[test]
fn global_average_pool_matches_the_cpu_forward_and_backward() {
    let cpu = CpuBackend;
    let [n, c, h, w] = [3, 6, 7, 7];
    let hw = h * w;
    for dtype in DTYPES {
        for grid in grids() {
            let x = random(n * c * hw, 8, dtype);
            let dy = random(n * c, 9, DType::F32);
            let mut want_y = vec![0.0; n * c];
            cpu.global_avg_pool_forward((n, c, hw), &x, &mut want_y);
            let mut want_dx = vec![0.0; x.len()];
            cpu.global_avg_pool_backward((n, c, hw), &dy, &mut want_dx);
            let want_dx: Vec<f32> = want_dx.iter().map(|&v| in_type(v, dtype)).collect();

            let mut xm = Mem::with(&to_nhwc(&x, [n, c, h, w]), dtype);
            let mut y = Mem::nan(n * c, DType::F32);
            kernels::global_avg_pool_forward(&grid, (n, c, hw), xm.op(), y.op());
            assert_close(&format!("{dtype:?} average"), &y.values(), &want_y, 1e-6);
            let mut dym = Mem::with(&dy, DType::F32);
            let mut dx = Mem::nan(x.len(), dtype);
            kernels::global_avg_pool_backward(&grid, (n, c, hw), dym.op(), dx.op());
            assert_close(
                &format!("{dtype:?} average backward"),
                &to_nchw(&dx.values(), [n, c, h, w]),
                &want_dx,
                0.0,
            );
        }
    }
}

#[test]
fn bias_rows_column_sums_and_sgd_match_the_cpu() {
    let cpu = CpuBackend;
    let (rows, cols) = (37, 10);
    for grid in grids() {
        let bias = random(cols, 10, DType::F32);
        let mut want = vec![0.0; rows * cols];
        cpu.broadcast_rows(&bias, &mut want);
        let (mut b, mut y) = (
            Mem::with(&bias, DType::F32),
            Mem::nan(rows * cols, DType::F32),
        );
        kernels::broadcast_rows(&grid, b.op(), y.op());
        assert_close("bias rows", &y.values(), &want, 0.0);

        // Sums accumulate: they start non-zero.
        let x = random(rows * cols, 11, DType::F32);
        let start = random(cols, 12, DType::F32);
        let mut want = start.clone();
        cpu.sum_rows(&x, &mut want);
        let (mut xm, mut sums) = (Mem::with(&x, DType::F32), Mem::with(&start, DType::F32));
        kernels::sum_rows(&grid, xm.op(), sums.op());
        assert_close("column sums", &sums.values(), &want, 1e-6);

        let len = 3000;
        let (w, g, v) = (
            random(len, 13, DType::F32),
            random(len, 14, DType::F32),
            random(len, 15, DType::F32),
        );
        let (mut want_w, mut want_v) = (w.clone(), v.clone());
        cpu.sgd_update(&mut want_w, &g, &mut want_v, 0.1, 0.9, 1e-4);
        let (mut wm, mut gm, mut vm) = (
            Mem::with(&w, DType::F32),
            Mem::with(&g, DType::F32),
            Mem::with(&v, DType::F32),
        );
        kernels::sgd_update(&grid, wm.op(), gm.op(), vm.op(), 0.1, 0.9, 1e-4);
        assert_close("SGD weights", &wm.values(), &want_w, 1e-6);
        assert_close("SGD momenta", &vm.values(), &want_v, 1e-6);

        // All tensors at once: the ranges without weight decay (a batch norm's scale and
        // shift between two weights, a bias at the end) get none, the rest do.
        let undecayed = [700..764, 764..828, 2990..3000];
        let (mut want_w, mut want_v) = (w.clone(), v.clone());
        let mut start = 0;
        for r in undecayed.iter().cloned().chain(std::iter::once(len..len)) {
            let (a, b) = (start..r.start, r.clone());
            for (range, wd) in [(a, 1e-4), (b, 0.0)] {
                cpu.sgd_update(
                    &mut want_w[range.clone()],
                    &g[range.clone()],
                    &mut want_v[range],
                    0.1,
                    0.9,
                    wd,
                );
            }
            start = r.end;
        }
        let bounds = kernels::sgd_bounds(&undecayed);
        let (mut wm, mut gm, mut vm, mut bm) = (
            Mem::with(&w, DType::F32),
            Mem::with(&g, DType::F32),
            Mem::with(&v, DType::F32),
            Mem::with(&bounds, DType::F32),
        );
        kernels::sgd_update_all(&grid, [wm.op(), gm.op(), vm.op()], 0.1, 0.9, 1e-4, bm.op());
        assert_close("SGD weights, all at once", &wm.values(), &want_w, 1e-6);
        assert_close("SGD momenta, all at once", &vm.values(), &want_v, 1e-6);
        // The undecayed ranges did take no decay (the decayed step differs there).
        assert_ne!(
            want_w[710],
            w[710] - 0.1 * (0.9 * v[710] + g[710] + 1e-4 * w[710])
        );
    }
}

#[test]
fn the_loss_matches_the_cpu_with_smoothing_ties_and_accumulating_totals() {
    let cpu = CpuBackend;
    // ImageNet's 1000 classes; row 0 all equal (the first maximum wins), rows of 300 (more
    // threads than a block) in the second shape.
    for (rows, classes) in [(37, 1000), (300, 10)] {
        for grid in grids() {
            let mut logits = random(rows * classes, 16, DType::F32);
            logits[..classes].fill(0.25);
            let labels: Vec<f32> = (0..rows).map(|r| ((r * 271) % classes) as f32).collect();
            let mut want_d = vec![0.0; rows * classes];
            let mut want_totals = vec![1.5, 2.0];
            cpu.softmax_cross_entropy(
                classes,
                &logits,
                &labels,
                0.1,
                0.5,
                &mut want_d,
                &mut want_totals,
            );

            let (mut l, mut lab) = (
                Mem::with(&logits, DType::F32),
                Mem::with(&labels, DType::F32),
            );
            let mut d = Mem::nan(rows * classes, DType::F32);
            let mut stats = Mem::nan(kernels::loss_row_stats_bytes(rows) / 4, DType::F32);
            let mut totals = Mem::with(&[1.5, 2.0], DType::F32);
            kernels::softmax_cross_entropy(
                &grid,
                classes,
                l.op(),
                lab.op(),
                0.1,
                0.5,
                d.op(),
                stats.op(),
                totals.op(),
            );
            let what = format!("{rows}×{classes}");
            assert_close(&format!("{what} dlogits"), &d.values(), &want_d, 1e-6);
            assert_close(
                &format!("{what} loss total"),
                &totals.values()[..1],
                &want_totals[..1],
                1e-6,
            );
            assert_eq!(totals.values()[1], want_totals[1], "{what}: correct count");
        }
    }
}

/// What follows the batch norm.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Then {
    Nothing,
    Relu,
    AddRelu,
}

/// Our batch norm against the CPU's on `x` (NCHW over `(n, c, hw)`, values of `dtype`), with
/// each epilogue, on each grid.
fn check_our_batch_norm((n, c, hw): (usize, usize, usize), x: &[f32], dtype: DType) {
    let cpu = CpuBackend;
    let config = BatchNormConfig {
        momentum: 0.1,
        eps: 1e-5,
    };
    let len = n * c * hw;
    let shape = [n, c, hw, 1];
    let (tol, grad_tol) = match dtype {
        DType::F32 => (1e-5, 1e-5),
        DType::Bf16 => (1e-2, 1e-4),
    };
    let z = random(len, 21, dtype);
    let dy = random(len, 22, dtype);
    let (gamma, beta) = (random(c, 23, DType::F32), random(c, 24, DType::F32));
    for then in [Then::Nothing, Then::Relu, Then::AddRelu] {
        for grid in grids() {
            let what = format!("{dtype:?} batch norm {:?} then {then:?}", (n, c, hw));
            let mut xm = Mem::with(&to_nhwc(x, shape), dtype);
            let mut zm = Mem::with(&to_nhwc(&z, shape), dtype);
            let (mut g, mut b) = (Mem::with(&gamma, DType::F32), Mem::with(&beta, DType::F32));
            let (mut rm, mut rv) = (
                Mem::with(&vec![0.0; c], DType::F32),
                Mem::with(&vec![1.0; c], DType::F32),
            );
            let (mut mean, mut inv_std) = (Mem::nan(c, DType::F32), Mem::nan(c, DType::F32));
            let mut scratch = Mem::nan(kernels::batch_norm_scratch_len(n * hw, c), DType::F32);
            let mut y = Mem::nan(len, dtype);
            let epilogue = match then {
                Then::Nothing => BnEpilogue::Identity,
                Then::Relu => BnEpilogue::Relu,
                Then::AddRelu => BnEpilogue::AddRelu(zm.op()),
            };
            kernels::batch_norm_forward_training(
                &grid,
                (n, c, hw),
                config,
                xm.op(),
                g.op(),
                b.op(),
                rm.op(),
                rv.op(),
                epilogue,
                y.op(),
                mean.op(),
                inv_std.op(),
                scratch.op(),
            );
            let (mut dym, mut dx, mut dz) = (
                Mem::with(&to_nhwc(&dy, shape), dtype),
                Mem::nan(len, dtype),
                Mem::nan(len, dtype),
            );
            // Gradients start non-zero: they accumulate.
            let (mut dg, mut db) = (
                Mem::with(&vec![0.5; c], DType::F32),
                Mem::with(&vec![0.5; c], DType::F32),
            );
            let epilogue = match then {
                Then::Nothing => BnEpilogueGrad::Identity,
                Then::Relu => BnEpilogueGrad::Relu { y: y.op() },
                Then::AddRelu => BnEpilogueGrad::AddRelu {
                    y: y.op(),
                    dz: dz.op(),
                },
            };
            kernels::batch_norm_backward(
                &grid,
                (n, c, hw),
                xm.op(),
                mean.op(),
                inv_std.op(),
                g.op(),
                epilogue,
                dym.op(),
                dx.op(),
                dg.op(),
                db.op(),
                scratch.op(),
            );

            let (mut want_rm, mut want_rv) = (vec![0.0; c], vec![1.0; c]);
            let mut want_y = vec![0.0; len];
            let epilogue = match then {
                Then::Nothing => BnEpilogue::Identity,
                Then::Relu => BnEpilogue::Relu,
                Then::AddRelu => BnEpilogue::AddRelu(&z[..]),
            };
            let saved = cpu.batch_norm_forward_training(
                (n, c, hw),
                config,
                x,
                &gamma,
                &beta,
                &mut want_rm,
                &mut want_rv,
                epilogue,
                &mut want_y,
            );
            // Backward through the ReLU as ours decided it: where an input is within
            // rounding of 0 the two may decide otherwise, and that is not under test.
            let our_y = to_nchw(&y.values(), shape);
            let (mut want_dx, mut want_dz) = (vec![0.0; len], vec![0.0; len]);
            let (mut want_dg, mut want_db) = (vec![0.5; c], vec![0.5; c]);
            let epilogue = match then {
                Then::Nothing => BnEpilogueGrad::Identity,
                Then::Relu => BnEpilogueGrad::Relu { y: &our_y[..] },
                Then::AddRelu => BnEpilogueGrad::AddRelu {
                    y: &our_y[..],
                    dz: &mut want_dz[..],
                },
            };
            cpu.batch_norm_backward(
                (n, c, hw),
                config,
                &saved,
                &gamma,
                &beta,
                epilogue,
                &dy,
                &mut want_dx,
                &mut want_dg,
                &mut want_db,
            );

            assert_close(&format!("{what}: output"), &our_y, &want_y, tol);
            assert_close(
                &format!("{what}: running mean"),
                &rm.values(),
                &want_rm,
                1e-5,
            );
            assert_close(
                &format!("{what}: running variance"),
                &rv.values(),
                &want_rv,
                1e-5,
            );
            assert_close(
                &format!("{what}: inverse deviation"),
                &inv_std.values(),
                &saved.inv_std,
                1e-5,
            );
            assert_close(
                &format!("{what}: input gradient"),
                &to_nchw(&dx.values(), shape),
                &want_dx,
                tol,
            );
            assert_close(&format!("{what}: dγ"), &dg.values(), &want_dg, grad_tol);
            assert_close(&format!("{what}: dβ"), &db.values(), &want_db, grad_tol);
            if then == Then::AddRelu {
                assert_close(
                    &format!("{what}: residual gradient"),
                    &to_nchw(&dz.values(), shape),
                    &want_dz,
                    0.0,
                );
            }
        }
    }
}

#[test]
fn our_batch_norm_matches_the_cpu_in_training_and_backward_with_each_epilogue() {
    // Small; 6 channels (cuDNN's fused kernels want multiples of 4, ours do not); 5000 rows,
    // 79 chunks of partial sums folded twice (79 → 3 → 1); 66 000 rows, folded three times
    // (1032 → 33 → 2 → 1), so the second region is written twice.
    for dims in [(4, 16, 25), (3, 6, 7), (5, 8, 1000), (2, 4, 33_000)] {
        let len = dims.0 * dims.1 * dims.2;
        for dtype in DTYPES {
            // Shifted and scaled, so the statistics are not the trivial ones.
            let x: Vec<f32> = random(len, 20, DType::F32)
                .iter()
                .map(|v| in_type(3.0 * v + 0.5, dtype))
                .collect();
            check_our_batch_norm(dims, &x, dtype);
        }
    }
}

#[test]
fn our_batch_norm_holds_eps_on_a_constant_channel_and_a_small_spread_round_a_large_mean() {
    // Channel 0 is constant: its variance is 0, so 1/sqrt(eps) alone scales it, and eps
    // dropped or misplaced shows. Channel 1 is 1000 + 0.01·v: sums of squares in f32 without
    // the shift by its first value would lose its variance.
    let (n, c, hw) = (4, 2, 300);
    let v = random(n * c * hw, 25, DType::F32);
    let x: Vec<f32> = (0..n * c * hw)
        .map(|i| {
            if (i / hw) % c == 0 {
                0.75
            } else {
                1000.0 + 0.01 * v[i]
            }
        })
        .collect();
    check_our_batch_norm((n, c, hw), &x, DType::F32);
}

#[test]
fn a_kernel_the_emulation_does_not_know_is_an_error() {
    let result = std::panic::catch_unwind(|| {
        CpuGrid { max_blocks: None }.launch("no_such_kernel", 1, &mut [])
    });
    assert!(result.is_err(), "launching an unknown kernel should fail");
}
