//! The CUDA backend against the CPU reference, on a real GPU. Built only with the
//! `gpu-tests` feature (`make test-gpu`, or `trainer/gpu/run.sh tests` on a GPU machine with
//! the binary built elsewhere), never by `make test`: every test here needs a GPU, cuDNN,
//! cuBLAS and NVRTC, and fails — never skips — without them.
//!
//! Tolerances: f32 on the GPU is true f32 (no TF32), so results agree with the CPU to
//! rounding (relative 1e-4 of the largest value); bf16 keeps 8 bits of mantissa, so its
//! results agree to 2 % of the largest value for one operation.
#![cfg(feature = "gpu-tests")]

use ringmaster_trainer::collective::{
    self, Collective, CollectiveKind, NcclCollective, ReduceOp, RingConfig,
};
use ringmaster_trainer::engine::backend::cuda::BatchNormEngine;
use ringmaster_trainer::engine::backend::{
    BatchNormConfig, BnEpilogue, BnEpilogueGrad, ConvShape, CudaBackend, Matrix, PoolShape,
};
use ringmaster_trainer::engine::buckets::GradientBuckets;
use ringmaster_trainer::engine::data::{LearnableData, SyntheticData};
use ringmaster_trainer::engine::step::{RecordedStep, WARMUP_STEPS};
use ringmaster_trainer::engine::tensor::{DType, Tensor};
use ringmaster_trainer::engine::{Arch, Backend, CpuBackend, Model, Sgd};
use ringmaster_trainer::world::World;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use ringmaster_contract::trainer::TrainArgs;

mod common;

/// Several ranks sharing the GPU, through the trainer's command line under mpirun.
#[path = "gpu/ranks.rs"]
mod ranks;

/// The image-folder loader with nvJPEG.
#[path = "gpu/loader.rs"]
mod loader;

const F32_TOL: f32 = 1e-4;
const BF16_TOL: f32 = 2e-2;

fn gpu() -> CudaBackend {
    // The arena as training sizes it: from the first step's peak.
    CudaBackend::new(0, None).expect("the CUDA backend starts on GPU 0")
}

/// Normal samples rounded to bf16, so the CPU in f32 and the GPU in bf16 start from the same
/// values (and a max pool's winners are the same on both).
fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut v = Tensor::randn(&[len], 1.0, &mut rng).data;
    v.iter_mut().for_each(|x| *x = bf16_exact(*x));
    v
}

/// The nearest bf16 value (round to nearest even), as an f32.
fn bf16_exact(x: f32) -> f32 {
    let u = x.to_bits();
    f32::from_bits((u + 0x7fff + ((u >> 16) & 1)) & 0xffff_0000)
}

/// Largest difference relative to the largest magnitude of `want`.
fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
    let (i, worst) = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .enumerate()
        .fold((0, 0.0f32), |b, (i, d)| if d > b.1 { (i, d) } else { b });
    assert!(
        worst <= tol * scale && got.iter().all(|x| x.is_finite()),
        "{what}: element {i} is {} where the CPU has {} (difference {worst}, tolerance {} × {scale})",
        got[i],
        want[i],
        tol
    );
}

fn tol(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => F32_TOL,
        DType::Bf16 => BF16_TOL,
    }
}

/// Runs one convolution forward and backward on `be`; returns (y, dx, dweight) on the host,
/// dx only when `input_grad` (the model's first layer asks for none).
fn conv_on<B: Backend>(
    be: &B,
    dtype: DType,
    s: &ConvShape,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    input_grad: bool,
) -> (Vec<f32>, Option<Vec<f32>>, Vec<f32>) {
    let (oh, ow) = s.output_size();
    let xs = [s.n, s.c, s.h, s.w];
    let ys = [s.n, s.out_channels, oh, ow];
    let xt = Tensor::upload(be, &Tensor::from_vec(&xs, x.to_vec()), dtype);
    let wt = be.upload(w, &[w.len()], DType::F32);
    let dyt = Tensor::upload(be, &Tensor::from_vec(&ys, dy.to_vec()), dtype);
    let mut y = Tensor::<B>::alloc(be, &ys, dtype);
    let mut dx = Tensor::<B>::alloc(be, &xs, dtype);
    // Accumulation: dweight starts at 1 and must end at 1 + the gradient.
    let mut dw = be.upload(&vec![1.0; w.len()], &[w.len()], DType::F32);
    let saved = be.conv2d_forward(s, xt.view(be), be.view(&wt, 0..w.len()), y.view_mut(be));
    be.conv2d_backward(
        s,
        &saved,
        xt.view(be),
        be.view(&wt, 0..w.len()),
        dyt.view(be),
        input_grad.then(|| dx.view_mut(be)),
        be.view_mut(&mut dw, 0..w.len()),
    );
    (
        y.download(be).data,
        input_grad.then(|| dx.download(be).data),
        be.download(&dw, &[w.len()]),
    )
}

#[test]
fn convolutions_match_the_cpu_forward_and_both_backward_halves() {
    let be = gpu();
    let shapes = [
        (3, 1, 1, 9),  // 3x3, stride 1 (the basic block)
        (3, 2, 1, 9),  // 3x3, stride 2 (the first block of a stage)
        (1, 1, 0, 8),  // 1x1 (the bottleneck)
        (1, 2, 0, 8),  // 1x1 stride 2 (the projection shortcut)
        (7, 2, 3, 16), // the ImageNet stem
    ];
    for dtype in [DType::F32, DType::Bf16] {
        for (i, &(kernel, stride, padding, size)) in shapes.iter().enumerate() {
            let s = ConvShape {
                n: 2,
                c: if kernel == 7 { 3 } else { 8 },
                h: size,
                w: size,
                out_channels: 16,
                kernel,
                stride,
                padding,
            };
            let x = random(s.n * s.c * s.h * s.w, 1 + i as u64);
            let w = random(s.out_channels * s.c * kernel * kernel, 11 + i as u64);
            let dy = random(s.output_len(), 21 + i as u64);
            // The stem's input is the image: the model asks for no gradient of it (and
            // cuDNN need not have a backward-data algorithm for 3 channels in bf16).
            let input_grad = kernel != 7;
            let want = conv_on(&CpuBackend, DType::F32, &s, &x, &w, &dy, input_grad);
            let got = conv_on(&be, dtype, &s, &x, &w, &dy, input_grad);
            let what = format!("{dtype:?} conv {kernel}x{kernel}/{stride}");
            assert_close(&format!("{what} forward"), &got.0, &want.0, tol(dtype));
            assert_eq!(got.1.is_some(), input_grad, "{what}");
            if let (Some(got_dx), Some(want_dx)) = (&got.1, &want.1) {
                assert_close(
                    &format!("{what} backward data"),
                    got_dx,
                    want_dx,
                    tol(dtype),
                );
            }
            assert_close(
                &format!("{what} backward filter"),
                &got.2,
                &want.2,
                tol(dtype),
            );
        }
    }
}

/// What follows a batch norm in the test: nothing, a ReLU, or the residual add then a ReLU.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Then {
    Nothing,
    Relu,
    AddRelu,
}

/// Batch norm training forward (with `then` fused), backward (with the residual's gradient
/// for `AddRelu`) and the running statistics, then inference. Backward's ReLU passes the
/// gradient where `relu_open` (a forward output) is positive, or the forward's own output.
fn batch_norm_on<B: Backend>(
    be: &B,
    dtype: DType,
    dims: (usize, usize, usize),
    then: Then,
    relu_open: Option<&[f32]>,
) -> Vec<Vec<f32>> {
    let (n, c, hw) = dims;
    let shape = [n, c, hw, 1];
    let len = n * c * hw;
    let config = BatchNormConfig {
        momentum: 0.1,
        eps: 1e-5,
    };
    // Shifted and scaled so the statistics are not the trivial ones.
    let x: Vec<f32> = random(len, 3)
        .iter()
        .map(|v| bf16_exact(3.0 * v + 0.5))
        .collect();
    let xt = Tensor::upload(be, &Tensor::from_vec(&shape, x), dtype);
    let dyt = Tensor::upload(be, &Tensor::from_vec(&shape, random(len, 4)), dtype);
    let zt = Tensor::upload(be, &Tensor::from_vec(&shape, residual(len)), dtype);
    let gamma = be.upload(&random(c, 5), &[c], DType::F32);
    let beta = be.upload(&random(c, 6), &[c], DType::F32);
    let mut stats = be.upload(&[vec![0.0; c], vec![1.0; c]].concat(), &[2 * c], DType::F32);
    let mut grads = be.upload(&vec![0.5; 2 * c], &[2 * c], DType::F32);
    let mut y = Tensor::<B>::alloc(be, &shape, dtype);
    let mut dx = Tensor::<B>::alloc(be, &shape, dtype);
    let mut dz = Tensor::<B>::alloc(be, &shape, dtype);
    let (mean, var) = be.view_mut_pair(&mut stats, 0..c, c..2 * c);
    let epilogue = match then {
        Then::Nothing => BnEpilogue::Identity,
        Then::Relu => BnEpilogue::Relu,
        Then::AddRelu => BnEpilogue::AddRelu(zt.view(be)),
    };
    let saved = be.batch_norm_forward_training(
        dims,
        config,
        xt.view(be),
        be.view(&gamma, 0..c),
        be.view(&beta, 0..c),
        mean,
        var,
        epilogue,
        y.view_mut(be),
    );
    let (dgamma, dbeta) = be.view_mut_pair(&mut grads, 0..c, c..2 * c);
    let open = relu_open.map(|o| Tensor::upload(be, &Tensor::from_vec(&shape, o.to_vec()), dtype));
    let open = open.as_ref().unwrap_or(&y);
    let epilogue = match then {
        Then::Nothing => BnEpilogueGrad::Identity,
        Then::Relu => BnEpilogueGrad::Relu { y: open.view(be) },
        Then::AddRelu => BnEpilogueGrad::AddRelu {
            y: open.view(be),
            dz: dz.view_mut(be),
        },
    };
    be.batch_norm_backward(
        dims,
        config,
        &saved,
        be.view(&gamma, 0..c),
        be.view(&beta, 0..c),
        epilogue,
        dyt.view(be),
        dx.view_mut(be),
        dgamma,
        dbeta,
    );
    let mut inference = Tensor::<B>::alloc(be, &shape, dtype);
    be.batch_norm_forward_inference(
        dims,
        config,
        xt.view(be),
        be.view(&gamma, 0..c),
        be.view(&beta, 0..c),
        be.view(&stats, 0..c),
        be.view(&stats, c..2 * c),
        inference.view_mut(be),
    );
    let mut parts = vec![
        y.download(be).data,
        dx.download(be).data,
        be.download(&grads, &[2 * c]),
        be.download(&stats, &[2 * c]),
        inference.download(be).data,
    ];
    if then == Then::AddRelu {
        parts.push(dz.download(be).data);
    }
    parts
}

/// The residual `AddRelu` adds.
fn residual(len: usize) -> Vec<f32> {
    random(len, 9)
}

/// Where the GPU's ReLU and the CPU's disagree (one passes the gradient, the other not), the
/// input to the ReLU must be on its edge: within rounding of 0. In bf16 the GPU rounds the
/// batch norm's output before adding the residual (as PyTorch's mixed precision does), so
/// `bf16(b) + z` can be exactly 0 where the CPU's `b + z` is not; in f32 the two `b` differ
/// by summation order. Backward is then compared against the CPU run with the GPU's ReLU.
fn assert_relu_differs_only_on_its_edge(
    what: &str,
    gpu_y: &[f32],
    cpu_y: &[f32],
    bn: &[f32],
    z: &[f32],
    dtype: DType,
) {
    // bf16's half-unit (2^-8) of the larger operand, with room; f32 rounding of O(1) terms.
    let margin = match dtype {
        DType::Bf16 => 2f32.powi(-7),
        DType::F32 => 1e-5,
    };
    let mut differ = 0;
    for i in 0..gpu_y.len() {
        if (gpu_y[i] > 0.0) != (cpu_y[i] > 0.0) {
            differ += 1;
            let input = bn[i] + z[i];
            assert!(
                input.abs() <= margin * (bn[i].abs() + z[i].abs() + 1.0),
                "{what}: element {i}'s ReLU is {} on the GPU and {} on the CPU, but its input \
                 {input} (batch norm {}, residual {}) is not within rounding of 0",
                if gpu_y[i] > 0.0 { "open" } else { "shut" },
                if cpu_y[i] > 0.0 { "open" } else { "shut" },
                bn[i],
                z[i]
            );
        }
    }
    if differ > 0 {
        eprintln!(
            "{what}: {differ} of {} ReLUs decided otherwise on the edge",
            gpu_y.len()
        );
    }
}

#[test]
fn batch_norm_matches_the_cpu_in_training_backward_and_inference_on_each_engine() {
    let be = gpu();
    let parts = [
        "forward",
        "backward",
        "gamma/beta gradients",
        "running statistics",
        "inference",
        "residual gradient",
    ];
    // Each engine: cuDNN's fused calls (the default), cuDNN's plain calls with our own add
    // and ReLU kernels (what runs wherever cuDNN does not fuse), and our own batch-norm
    // kernels. Shapes: a small one, one of ResNet-50's first stage (cuDNN may pick other
    // kernels there; ours fold their partial sums three times), and 6 channels, which
    // cuDNN's fused NHWC kernels do not take (so the plain path runs even when fusing is
    // allowed). The gradients start at 0.5, so accumulation is checked too.
    for engine in BatchNormEngine::ALL {
        be.set_batch_norm(engine);
        let name = engine.name();
        for dims in [(4, 16, 25), (32, 64, 56 * 56), (4, 6, 25)] {
            for dtype in [DType::F32, DType::Bf16] {
                let len = dims.0 * dims.1 * dims.2;
                let bn = batch_norm_on(&CpuBackend, DType::F32, dims, Then::Nothing, None)
                    .swap_remove(0);
                for then in [Then::Nothing, Then::Relu, Then::AddRelu] {
                    let got = batch_norm_on(&be, dtype, dims, then, None);
                    let want = batch_norm_on(&CpuBackend, DType::F32, dims, then, Some(&got[0]));
                    assert_eq!(got.len(), want.len());
                    if then != Then::Nothing {
                        let z = match then {
                            Then::AddRelu => residual(len),
                            _ => vec![0.0; len],
                        };
                        let what = format!("{dtype:?} batch norm {dims:?} then {then:?} ({name})");
                        assert_relu_differs_only_on_its_edge(
                            &what, &got[0], &want[0], &bn, &z, dtype,
                        );
                    }
                    for ((g, w), part) in got.iter().zip(&want).zip(parts) {
                        let what =
                            format!("{dtype:?} batch norm {dims:?} then {then:?} ({name}) {part}");
                        assert_close(&what, g, w, tol(dtype));
                    }
                }
            }
        }
        let plans = be.batch_norm_plans();
        eprintln!("cuDNN's batch-norm plans (engine {name}): {plans:#?}");
        // What cuDNN fused is printed above; at least one plan must have taken the fused
        // calls when allowed, or the first pass of this test checked nothing of them.
        assert_eq!(
            plans.iter().any(|p| p.fused),
            engine == BatchNormEngine::CudnnFused,
            "{plans:?}"
        );
        assert!(plans.iter().all(|p| !p.fused || p.dims.1 % 4 == 0));
    }
}

/// ReLU, max pool, average pool and the residual add, forward and backward.
fn elementwise_on<B: Backend>(be: &B, dtype: DType) -> Vec<Vec<f32>> {
    let shape = [2, 8, 9, 9];
    let len = shape.iter().product();
    let x = Tensor::upload(be, &Tensor::from_vec(&shape, random(len, 7)), dtype);
    let dy = Tensor::upload(be, &Tensor::from_vec(&shape, random(len, 8)), dtype);
    let mut out = Vec::new();

    let mut y = Tensor::<B>::alloc(be, &shape, dtype);
    be.relu_forward(x.view(be), y.view_mut(be));
    let mut dx = Tensor::<B>::alloc(be, &shape, dtype);
    be.relu_backward(y.view(be), dy.view(be), dx.view_mut(be));
    out.push(y.download(be).data);
    out.push(dx.download(be).data);

    let pool = PoolShape {
        planes: 16,
        channels: 8,
        h: 9,
        w: 9,
        kernel: 3,
        stride: 2,
        padding: 1,
    };
    let (oh, ow) = pool.output_size();
    let pooled_shape = [2, 8, oh, ow];
    let mut pooled = Tensor::<B>::alloc(be, &pooled_shape, dtype);
    let saved = be.max_pool_forward(&pool, x.view(be), pooled.view_mut(be));
    let dpooled = Tensor::upload(
        be,
        &Tensor::from_vec(&pooled_shape, random(2 * 8 * oh * ow, 9)),
        dtype,
    );
    let mut dpool_in = Tensor::<B>::alloc(be, &shape, dtype);
    be.max_pool_backward(&pool, &saved, dpooled.view(be), dpool_in.view_mut(be));
    out.push(pooled.download(be).data);
    out.push(dpool_in.download(be).data);

    let mut avg = Tensor::<B>::alloc(be, &[2, 8], DType::F32);
    be.global_avg_pool_forward((2, 8, 81), x.view(be), avg.view_mut(be));
    let davg = Tensor::upload(be, &Tensor::from_vec(&[2, 8], random(16, 10)), DType::F32);
    let mut davg_in = Tensor::<B>::alloc(be, &shape, dtype);
    be.global_avg_pool_backward((2, 8, 81), davg.view(be), davg_in.view_mut(be));
    out.push(avg.download(be).data);
    out.push(davg_in.download(be).data);

    let mut sum = Tensor::upload(be, &x.download(be), dtype);
    be.add_assign(sum.view_mut(be), dy.view(be));
    out.push(sum.download(be).data);
    out
}

#[test]
fn activation_pooling_and_add_match_the_cpu() {
    let be = gpu();
    let parts = [
        "relu",
        "relu backward",
        "max pool",
        "max pool backward",
        "average pool",
        "average pool backward",
        "add",
    ];
    for dtype in [DType::F32, DType::Bf16] {
        let want = elementwise_on(&CpuBackend, DType::F32);
        let got = elementwise_on(&be, dtype);
        for ((g, w), part) in got.iter().zip(&want).zip(parts) {
            assert_close(&format!("{dtype:?} {part}"), g, w, tol(dtype));
        }
    }
}

/// The classifier's GEMMs in their three stride patterns, bias broadcast and sums, and SGD.
fn dense_on<B: Backend>(be: &B) -> Vec<Vec<f32>> {
    let (m, k, n) = (5, 7, 3);
    let a = be.upload(&random(m * k, 12), &[m * k], DType::F32);
    let b = be.upload(&random(k * n, 13), &[k * n], DType::F32);
    let bt = be.upload(&random(n * k, 14), &[n * k], DType::F32);
    let at = be.upload(&random(k * m, 15), &[k * m], DType::F32);
    let mut out = Vec::new();
    for (i, (ma, mb)) in [
        (
            Matrix::rows(be.view(&a, 0..m * k), k),
            Matrix::rows(be.view(&b, 0..k * n), n),
        ),
        (
            Matrix::rows(be.view(&a, 0..m * k), k),
            Matrix::transposed(be.view(&bt, 0..n * k), k),
        ),
        (
            Matrix::transposed(be.view(&at, 0..k * m), m),
            Matrix::rows(be.view(&b, 0..k * n), n),
        ),
    ]
    .into_iter()
    .enumerate()
    {
        // beta = 1 on a non-zero C checks accumulation.
        let mut c = be.upload(&vec![i as f32; m * n], &[m * n], DType::F32);
        be.gemm(m, k, n, ma, mb, 1.0, be.view_mut(&mut c, 0..m * n));
        out.push(be.download(&c, &[m * n]));
    }
    let bias = be.upload(&random(n, 16), &[n], DType::F32);
    let mut rows = be.zeros(m * n, DType::F32);
    be.broadcast_rows(be.view(&bias, 0..n), be.view_mut(&mut rows, 0..m * n));
    out.push(be.download(&rows, &[m * n]));
    let mut sums = be.upload(&[1.0; 3], &[n], DType::F32);
    be.sum_rows(be.view(&a, 0..m * n), be.view_mut(&mut sums, 0..n));
    out.push(be.download(&sums, &[n]));
    let len = 1000;
    let mut w = be.upload(&random(len, 17), &[len], DType::F32);
    let g = be.upload(&random(len, 18), &[len], DType::F32);
    let mut v = be.upload(&random(len, 19), &[len], DType::F32);
    be.sgd_update(
        be.view_mut(&mut w, 0..len),
        be.view(&g, 0..len),
        be.view_mut(&mut v, 0..len),
        0.1,
        0.9,
        1e-4,
    );
    out.push(be.download(&w, &[len]));
    out.push(be.download(&v, &[len]));
    // The loss: 37 rows of 1000 classes (ImageNet's), smoothed; ties broken by the first
    // maximum (row 0 is all equal); totals start non-zero to show they accumulate.
    let (rows, classes) = (37, 1000);
    let mut logits = random(rows * classes, 20);
    logits[..classes].fill(0.25);
    let labels: Vec<f32> = (0..rows).map(|r| ((r * 271) % classes) as f32).collect();
    let logits = be.upload(&logits, &[rows * classes], DType::F32);
    let labels = be.upload(&labels, &[rows], DType::F32);
    let mut dlogits = be.zeros(rows * classes, DType::F32);
    let mut totals = be.upload(&[1.5, 2.0], &[2], DType::F32);
    be.softmax_cross_entropy(
        classes,
        be.view(&logits, 0..rows * classes),
        be.view(&labels, 0..rows),
        0.1,
        0.5,
        be.view_mut(&mut dlogits, 0..rows * classes),
        be.view_mut(&mut totals, 0..2),
    );
    out.push(be.download(&dlogits, &[rows * classes]));
    out.push(be.download(&totals, &[2]));
    out
}

#[test]
fn gemm_bias_sums_sgd_and_the_loss_match_the_cpu() {
    let be = gpu();
    for (i, (g, w)) in dense_on(&be).iter().zip(&dense_on(&CpuBackend)).enumerate() {
        assert_close(&format!("dense part {i}"), g, w, F32_TOL);
    }
}

#[test]
fn uploads_and_downloads_keep_values_and_layout() {
    let be = gpu();
    let host = Tensor::from_vec(&[2, 3, 4, 5], random(120, 20));
    for dtype in [DType::F32, DType::Bf16] {
        let back = Tensor::upload(&be, &host, dtype).download(&be);
        assert_close(
            &format!("{dtype:?} round trip"),
            &back.data,
            &host.data,
            tol(dtype) / 4.0,
        );
    }
    let mut flat = be.upload(&[1.0, 2.0, 3.0], &[3], DType::F32);
    be.with_host(&mut flat, |v| v[1] = 20.0);
    assert_eq!(be.download(&flat, &[3]), [1.0, 20.0, 3.0]);
}

#[test]
fn batches_uploaded_back_to_back_reach_each_reader_in_order() {
    // Batches of an ImageNet shape, uploaded into one buffer one after another without a
    // wait, each read by a kernel before the next comes: the page-locked staging and the
    // copy stream must hand each to its reader whole, and reuse the staging only after.
    let be = gpu();
    let shape = [64, 3, 224, 224];
    let len = shape.iter().product();
    let batches: Vec<Vec<f32>> = (0..4).map(|i| random(len, 30 + i)).collect();
    for dtype in [DType::F32, DType::Bf16] {
        let mut input = be.zeros(len, dtype);
        let read: Vec<_> = batches
            .iter()
            .map(|batch| {
                be.upload_into(batch, &shape, &mut input);
                let mut copy = be.zeros(len, dtype);
                be.add_assign(be.view_mut(&mut copy, 0..len), be.view(&input, 0..len));
                copy
            })
            .collect();
        for (i, (copy, batch)) in read.iter().zip(&batches).enumerate() {
            // bf16-exact values: both types carry them unchanged.
            assert!(
                be.download(copy, &shape) == *batch,
                "{dtype:?}: batch {i} did not reach its reader as uploaded"
            );
        }
    }
    // More batch shapes than the backend keeps staging for, so it lets some go while their
    // copies may still run; then a backend dropped straight after an upload.
    let shapes: Vec<[usize; 4]> = (1..=7).map(|n| [n * 8, 3, 64, 64]).collect();
    let read: Vec<_> = shapes
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let host = random(shape.iter().product(), 40 + i as u64);
            let uploaded = be.upload(&host, shape, DType::F32);
            (host, uploaded)
        })
        .collect();
    for ((host, uploaded), shape) in read.iter().zip(&shapes) {
        assert!(
            be.download(uploaded, shape) == *host,
            "a batch of {shape:?} did not arrive as uploaded"
        );
    }
    let short_lived = gpu();
    let _ = short_lived.upload(&batches[0], &shape, DType::Bf16);
    drop(short_lived);
}

#[test]
fn a_cifar_step_on_the_gpu_gives_the_cpu_gradients_in_f32() {
    let data = SyntheticData::new(10, 16, 8, 3);
    let (images, labels) = data.batch(&(0..8).collect::<Vec<_>>());
    let arch = Arch::CifarResNet { depth: 8, width: 8 };
    let mut cpu = Model::new(arch, 10, 5);
    let mut gpu_model = Model::with_backend(arch, 10, 5, gpu());
    let a = cpu.train_step(&images, &labels, 0.1);
    let b = gpu_model.train_step(&images, &labels, 0.1);
    assert!(
        (a.loss - b.loss).abs() <= 1e-4 * a.loss.abs(),
        "loss {} vs {}",
        b.loss,
        a.loss
    );
    let be = gpu_model.backend().clone();
    let host = gpu_model.params().to_host(&be);
    assert_close("gradients", &host.grads, &cpu.params().grads, 1e-3);
    assert_close(
        "running statistics",
        &host.buffers,
        &cpu.params().buffers,
        F32_TOL,
    );
}

#[test]
fn gradients_on_the_gpu_agree_with_finite_differences() {
    let be = gpu();
    let data = SyntheticData::new(4, 8, 4, 9);
    let (images, labels) = data.batch(&[0, 1, 2, 3]);
    let arch = Arch::CifarResNet { depth: 8, width: 4 };
    let mut model = Model::with_backend(arch, 4, 2, be.clone());
    // The training-mode loss (batch statistics) is what `train_step` differentiates.
    model.train_step(&images, &labels, 0.0);
    let analytic = model.params().to_host(&be).grads;
    let entries: Vec<_> = model.params().entries.clone();
    let eps = 1e-3f32;
    let (mut checked, mut bad) = (0, Vec::new());
    for entry in entries.iter().step_by(5) {
        let j = entry.offset;
        let mut host = model.params().to_host(&be);
        let orig = host.values[j];
        host.values[j] = orig + eps;
        model.params_mut().load_from_host(&be, &host);
        let plus = model.training_loss(&images, &labels);
        host.values[j] = orig - eps;
        model.params_mut().load_from_host(&be, &host);
        let minus = model.training_loss(&images, &labels);
        host.values[j] = orig;
        model.params_mut().load_from_host(&be, &host);
        let numeric = (plus - minus) / (2.0 * eps);
        checked += 1;
        if (numeric - analytic[j]).abs() > 5e-2 * analytic[j].abs().max(2e-2) {
            bad.push(format!(
                "{}: analytic {} vs numeric {numeric}",
                entry.name, analytic[j]
            ));
        }
    }
    // As the CPU check: a difference step can cross a ReLU's kink, so 5 % may miss.
    assert!(
        bad.len() as f64 <= 0.05 * checked as f64,
        "{} of {checked} coordinates disagree: {bad:?}",
        bad.len()
    );
}

/// The training-mode loss of a batch without touching the gradients' meaning (they are
/// zeroed and recomputed) — the quantity `train_step`'s gradient differentiates.
trait TrainingLoss {
    fn training_loss(&mut self, images: &Tensor, labels: &[usize]) -> f32;
}

impl<B: Backend> TrainingLoss for Model<B> {
    fn training_loss(&mut self, images: &Tensor, labels: &[usize]) -> f32 {
        let be = self.backend().clone();
        let saved = self.params().to_host(&be);
        let loss = self.train_step(images, labels, 0.0).loss;
        // Undo the running-statistics update so every evaluation sees the same model.
        self.params_mut().load_from_host(&be, &saved);
        loss
    }
}

// ResNet-18 at these sizes (width 8, 32 px, batches of 8 random labels) is chaotic: on the
// CPU alone, weights moved by a relative 1e-6 move the loss 1.6 % by the third step and
// 6 % by the sixth (lr 0.005 as much by the fifth). Two runs left to drift apart compare
// rounding, not engines (the first GPU run failed so, at step 2, by 1.4 %). So each step
// below starts both sides from the same state (weights, running statistics, momentum), and
// every step's loss, gradients' effect, statistics and momentum must agree.

/// The largest difference of `got` from `want` relative to `want`'s largest magnitude.
fn relative_difference(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
    got.iter()
        .zip(want)
        .fold(0.0f32, |m, (g, w)| m.max((g - w).abs()))
        / scale
}

#[test]
fn resnet18_trains_the_same_on_the_gpu_and_the_cpu_for_five_steps() {
    let data = SyntheticData::new(10, 32, 64, 4);
    let arch = Arch::ResNet18;
    let mut cpu = Model::new(arch, 10, 8);
    let cpu_be = *cpu.backend();
    let be = gpu();
    let mut gpu_model = Model::with_backend(arch, 10, 8, be.clone());
    let mut cpu_sgd = Sgd::new(cpu.params(), 0.9, 1e-4);
    let mut gpu_sgd = Sgd::on(&be, gpu_model.params(), 0.9, 1e-4);
    let n = cpu.num_parameters();
    let buffers = cpu.params().num_buffer_values();
    for step in 0..5 {
        // The GPU starts the step from the CPU's state.
        let state = cpu.params().weights_to_host(&cpu_be);
        gpu_model.params_mut().load_from_host(&be, &state);
        let velocity = cpu_be.download(cpu_sgd.velocity_mut(), &[n]);
        be.upload_into(&velocity, &[n], gpu_sgd.velocity_mut());

        let idx: Vec<usize> = (step * 8..step * 8 + 8).collect();
        let (images, labels) = data.batch(&idx);
        let a = cpu.train_step(&images, &labels, 0.0);
        let b = gpu_model.train_step(&images, &labels, 0.0);
        cpu_sgd.step(cpu.params_mut(), 0.05);
        gpu_sgd.step(gpu_model.params_mut(), 0.05);

        let want = cpu.params().weights_to_host(&cpu_be);
        let got = gpu_model.params().weights_to_host(&be);
        let want_velocity = cpu_be.download(cpu_sgd.velocity_mut(), &[n]);
        let got_velocity = be.download(gpu_sgd.velocity_mut(), &[n]);
        println!(
            "step {step}: loss GPU {} CPU {}; relative differences: weights {:.1e}, running statistics {:.1e}, momentum {:.1e}",
            b.loss,
            a.loss,
            relative_difference(&got.values, &want.values),
            relative_difference(&got.buffers, &want.buffers),
            relative_difference(&got_velocity, &want_velocity),
        );
        assert!(
            (a.loss - b.loss).abs() <= 1e-3 * a.loss.abs(),
            "step {step}: GPU loss {} vs CPU {}",
            b.loss,
            a.loss
        );
        assert!(
            a.correct.abs_diff(b.correct) <= 1,
            "step {step}: correct predictions"
        );
        // The weights moved by 0.05 × the momentum, which is the gradients summed: 18
        // layers of fp32 in another order.
        assert_close(
            &format!("step {step}: weights"),
            &got.values,
            &want.values,
            1e-3,
        );
        assert_eq!(got.buffers.len(), buffers);
        assert_close(
            &format!("step {step}: running statistics"),
            &got.buffers,
            &want.buffers,
            F32_TOL,
        );
        assert_close(
            &format!("step {step}: momentum"),
            &got_velocity,
            &want_velocity,
            1e-3,
        );
    }
}

#[test]
fn a_step_recorded_as_a_cuda_graph_trains_as_the_step_run_as_it_comes() {
    // Both in bf16, as the benchmark and the flagship run; the recording replays from the
    // third step on, reading each batch from the step's own input buffers. Each step starts
    // the recorded model from the other's state (written into the buffers the recording
    // reads): the network is chaotic (above), and the two differ only in the order
    // cuDNN's backward-filter algorithms add in.
    let data = SyntheticData::new(10, 32, 64, 4);
    let arch = Arch::ResNet18;
    let be = gpu();
    let mut eager = Model::with_backend(arch, 10, 8, be.clone()).with_activations(DType::Bf16);
    let mut graphed = Model::with_backend(arch, 10, 8, be.clone()).with_activations(DType::Bf16);
    let mut eager_sgd = Sgd::on(&be, eager.params(), 0.9, 1e-4);
    let mut graphed_sgd = Sgd::on(&be, graphed.params(), 0.9, 1e-4);
    let mut recorded = RecordedStep::new(&graphed, 8, 32, true);
    let n = eager.num_parameters();
    let buffers = eager.params().num_buffer_values();
    for step in 0..WARMUP_STEPS + 4 {
        let values = be.download(&eager.params().values, &[n]);
        be.upload_into(&values, &[n], &mut graphed.params_mut().values);
        let statistics = be.download(&eager.params().buffers, &[buffers]);
        be.upload_into(&statistics, &[buffers], &mut graphed.params_mut().buffers);
        let velocity = be.download(eager_sgd.velocity_mut(), &[n]);
        be.upload_into(&velocity, &[n], graphed_sgd.velocity_mut());

        let idx: Vec<usize> = (step * 8..step * 8 + 8).collect();
        let (images, labels) = data.batch(&idx);
        let want = eager.train_step(&images, &labels, 0.1);
        recorded.load(&graphed, &images, &labels);
        recorded.run(&mut graphed, 0.1);
        let got = recorded.stats(&graphed);
        assert_eq!(recorded.recorded(), step >= WARMUP_STEPS, "step {step}");
        let got_grads = be.download(&graphed.params().grads, &[n]);
        let want_grads = be.download(&eager.params().grads, &[n]);
        println!(
            "step {step}: loss recorded {} eager {}; gradients' relative difference {:.1e}",
            got.loss,
            want.loss,
            relative_difference(&got_grads, &want_grads)
        );
        assert!(got.correct.abs_diff(want.correct) <= 1, "step {step}");
        assert!(
            (got.loss - want.loss).abs() <= 1e-3 * want.loss.abs(),
            "step {step}: recorded loss {} vs {}",
            got.loss,
            want.loss
        );
        assert_close(
            &format!("step {step}: gradients"),
            &got_grads,
            &want_grads,
            // bf16 sums in another order, through 18 layers.
            5e-2,
        );
        eager_sgd.step(eager.params_mut(), 0.05);
        graphed_sgd.step(graphed.params_mut(), 0.05);
    }
    assert_close(
        "weights after the recorded steps",
        &be.download(&graphed.params().values, &[n]),
        &be.download(&eager.params().values, &[n]),
        BF16_TOL,
    );
    assert_close(
        "running statistics after the recorded steps",
        &be.download(&graphed.params().buffers, &[buffers]),
        &be.download(&eager.params().buffers, &[buffers]),
        BF16_TOL,
    );
}

#[test]
fn resnet50_in_bf16_drives_the_loss_down_on_the_learnable_data() {
    let be = gpu();
    let data = LearnableData::new(4, 64, 1).with_len(512);
    let mut model =
        Model::with_backend(Arch::ResNet50, 4, 1, be.clone()).with_activations(DType::Bf16);
    let mut sgd = Sgd::on(&be, model.params(), 0.9, 0.0);
    let mut losses = Vec::new();
    for step in 0..40 {
        let idx: Vec<usize> = (0..32).map(|i| (step * 32 + i) % 512).collect();
        let (images, labels) = data.batch(&idx);
        losses.push(model.train_step(&images, &labels, 0.0).loss);
        sgd.step(model.params_mut(), 0.05);
    }
    let first: f32 = losses[..5].iter().sum::<f32>() / 5.0;
    let last: f32 = losses[35..].iter().sum::<f32>() / 5.0;
    assert!(
        losses.iter().all(|l| l.is_finite()) && last < 0.5 * first,
        "losses did not halve: {losses:?}"
    );
}

#[test]
fn nccl_all_reduces_through_the_collective_trait() {
    // One GPU allows one NCCL rank (NCCL refuses two ranks on one device): the collective
    // still goes through NCCL's communicator, stream and event wait.
    let port = common::free_port();
    let world = World {
        rank: 0,
        size: 1,
        local_rank: 0,
        source: "test",
        ..World::single()
    };
    let config = RingConfig {
        rendezvous: format!("127.0.0.1:{port}"),
        timeout: std::time::Duration::from_secs(20),
        chunk_bytes: 4096,
        ..RingConfig::default()
    };
    // `collective::connect` gives one rank the single-rank collective: ask for NCCL itself.
    let mut c = NcclCollective::connect(&world, config).expect("NCCL connects");
    assert_eq!(c.name(), "nccl");
    let mut data: Vec<f32> = (0..1 << 20).map(|i| i as f32).collect();
    c.all_reduce(&mut data, ReduceOp::Sum).expect("all-reduce");
    assert!(data.iter().enumerate().all(|(i, &v)| v == i as f32));
    c.all_reduce(&mut data, ReduceOp::Average)
        .expect("all-reduce");
    assert_eq!(data[12345], 12345.0);

    // The backend's gradients reduced where they lie, in buckets queued during backward on
    // NCCL's stream: the CUDA backend takes that path, and a step gives the gradients a
    // step without it gives. With one rank NCCL's in-place all-reduce moves nothing, so
    // this checks the path, the buckets' ranges and the join, not the ordering between the
    // streams or the arithmetic of several ranks: those need two GPUs.
    let be = gpu();
    assert!(be.reduces_on_device(&mut c));
    let data = SyntheticData::new(10, 32, 8, 1);
    let (images, labels) = data.batch(&(0..8).collect::<Vec<_>>());
    let step = |hooked: bool, c: &mut NcclCollective| {
        let mut model = Model::with_backend(Arch::ResNet18, 10, 3, be.clone());
        let images = Tensor::upload(&be, &images, DType::F32);
        let mut buckets = GradientBuckets::new(model.num_parameters(), model.num_parameters() / 3);
        let mut launched = 0;
        model.zero_grads();
        model.forward_backward_on_device_with(&images, &labels, 0.0, 1.0, &mut |be, g, from| {
            if let Some(range) = buckets.ready(from).filter(|_| hooked) {
                be.queue_all_reduce(g, range, &mut *c, ReduceOp::Average)
                    .expect("queue an all-reduce");
                launched += 1;
            }
        });
        be.join_all_reduces(&mut *c).expect("join the all-reduces");
        (
            launched,
            be.download(&model.params().grads, &[model.num_parameters()]),
        )
    };
    let (none, plain) = step(false, &mut c);
    let (launched, reduced) = step(true, &mut c);
    assert_eq!(none, 0);
    assert!(launched >= 3, "{launched} buckets");
    assert_close("gradients after bucketed NCCL", &reduced, &plain, F32_TOL);
}

#[test]
fn the_flagship_samples_arguments_train_resnet50_on_the_gpu_for_300_steps() {
    // The operator's flags for the flagship sample (ResNet-50, bf16, batch 256, 224 pixels,
    // its learning rate), on a 2,560-image folder of the learnable classes.
    let dir = std::env::temp_dir().join(format!("ringmaster-gpu-flagship-{}", std::process::id()));
    let data = dir.join("data");
    let written = ringmaster_trainer::engine::image_folder::write_learnable(&data, 10, 256, 224, 3)
        .expect("the image folder is written");
    assert_eq!(written, 2560);
    // On its 16 ranks (a global batch of 4,096) the trainer warms the rate up over 5 epochs
    // by default; one rank's global batch is 256, so this run asks for it.
    let mut flags = common::flagship_flags(&data, &dir.join("out"), 300);
    flags.push("--warmup-epochs=5".into());
    // A checkpoint every 100 steps, so the state comes off the device mid-run; the run
    // started again below goes on from the last one (step 200) on the GPU.
    flags.push("--checkpoint-every=100".into());
    flags.push("--run-id=flagship-on-the-gpu".into());
    let args = TrainArgs::parse_flags(flags).expect("the flagship flags parse");
    let world = World {
        rank: 0,
        size: 1,
        local_rank: 0,
        source: "test",
        ..World::single()
    };
    let port = common::free_port();
    let config = RingConfig {
        rendezvous: format!("127.0.0.1:{port}"),
        timeout: std::time::Duration::from_secs(60),
        chunk_bytes: 1 << 20,
        ..RingConfig::default()
    };
    let mut c = collective::connect(&world, CollectiveKind::Auto, config).expect("a collective");
    let summary = ringmaster_trainer::train::run(&args, c.as_mut(), 0)
        .expect("the flagship arguments train on the GPU");
    println!("flagship on the GPU: {}", summary.to_line());
    assert_eq!(summary.steps, 300);
    let loss = summary.final_loss.expect("a finite final loss");
    assert!(
        loss < (10f64).ln(),
        "the loss ({loss}) did not fall below chance (ln 10)"
    );
    assert!(
        dir.join("out/model.safetensors").exists(),
        "the model is written"
    );
    let run_dir =
        ringmaster_trainer::resume::run_dir(&dir.join("out"), Some("flagship-on-the-gpu"));
    let (_, newest) = ringmaster_trainer::resume::checkpoints_in(&run_dir)
        .expect("the run's folder lists")
        .into_iter()
        .next()
        .expect("a checkpoint was written");
    let checkpoint =
        ringmaster_trainer::engine::checkpoint::metadata(&newest).expect("the checkpoint reads");
    assert_eq!(
        checkpoint["step"], "200",
        "the last checkpoint before the end"
    );
    // Started again, as a restarted gang is: it goes on from step 200 on the GPU.
    let resumed = ringmaster_trainer::train::run(&args, c.as_mut(), 0)
        .expect("the run started again goes on from its checkpoint");
    println!("flagship resumed on the GPU: {}", resumed.to_line());
    assert_eq!(resumed.resumed_from_step, Some(200));
    // Weights, statistics and momentum all restored: the last 100 steps end where the
    // uninterrupted run's did (on the H100, to the last digit; cuDNN's backward-filter
    // algorithms may add in another order from run to run).
    let resumed_loss = resumed
        .final_loss
        .expect("a finite final loss after resuming");
    assert!(
        (resumed_loss - loss).abs() <= 1e-2 * loss,
        "the resumed run ends at loss {resumed_loss}, the uninterrupted one at {loss}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
