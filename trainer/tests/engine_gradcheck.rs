//! Finite-difference gradient checks for every layer of the CPU engine.
//!
//! Each check builds the scalar `L = Σ out · R` for a fixed random `R` (summed in f64),
//! takes the analytic gradients from one backward pass with `grad_output = R`, and
//! compares them with central differences `(L(θ+ε) - L(θ-ε)) / 2ε` on a random subset
//! of input and parameter coordinates.
//!
//! Tolerance: a coordinate passes when `|analytic - numeric|` is at most
//! `2e-2 * max(|a|, |n|) + 5e-3 * rms`, where `rms` is the root-mean-square of all
//! analytic gradients of that tensor (the absolute term absorbs f32 rounding on
//! near-zero gradients). Layers with kinks (max-pool, ReLU inside blocks) may fail on
//! at most 5 % of the sampled coordinates, where a perturbation can cross a kink;
//! smooth layers must pass all. Smooth layers use `eps = 1e-2`, kinked ones `1e-3`.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ringmaster_trainer::engine::layers::{
    BatchNorm2d, Conv2d, GlobalAvgPool, Linear, MaxPool2d, Relu, ResidualBlock,
    softmax_cross_entropy,
};
use ringmaster_trainer::engine::{Arch, CpuBackend, Model, ParamStore, Tensor};

trait Layer {
    fn fwd(&mut self, p: &mut ParamStore, x: &Tensor) -> Tensor;
    fn bwd(&mut self, p: &mut ParamStore, g: &Tensor) -> Tensor;
}

macro_rules! impl_layer {
    ($($t:ty),*) => {$(
        impl Layer for $t {
            fn fwd(&mut self, p: &mut ParamStore, x: &Tensor) -> Tensor {
                self.forward(&CpuBackend, p, x, true)
            }
            fn bwd(&mut self, p: &mut ParamStore, g: &Tensor) -> Tensor {
                self.backward(&CpuBackend, p, g)
            }
        }
    )*};
}
impl_layer!(Conv2d, BatchNorm2d, Relu, MaxPool2d, GlobalAvgPool, Linear);

impl Layer for ResidualBlock {
    fn fwd(&mut self, p: &mut ParamStore, x: &Tensor) -> Tensor {
        self.forward(&CpuBackend, p, x, true)
    }
    // A block takes its output's gradient (it drops it once used).
    fn bwd(&mut self, p: &mut ParamStore, g: &Tensor) -> Tensor {
        self.backward(&CpuBackend, p, g.clone())
    }
}

#[derive(Clone, Copy)]
struct Tol {
    eps: f32,
    max_bad_fraction: f64,
}

const SMOOTH: Tol = Tol {
    eps: 1e-2,
    max_bad_fraction: 0.0,
};
const KINKED: Tol = Tol {
    eps: 1e-3,
    max_bad_fraction: 0.05,
};
const SAMPLES: usize = 30;

fn dot(out: &Tensor, r: &[f32]) -> f64 {
    out.data
        .iter()
        .zip(r)
        .map(|(&a, &b)| a as f64 * b as f64)
        .sum()
}

fn rms(v: &[f32]) -> f64 {
    (v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / v.len().max(1) as f64).sqrt()
}

/// Compares analytic and numeric gradients at sampled coordinates; returns the number
/// of coordinates checked and the failures.
fn compare(
    what: &str,
    analytic: &[f32],
    coords: &[usize],
    mut numeric: impl FnMut(usize) -> f64,
) -> (usize, Vec<String>) {
    let scale = rms(analytic);
    let mut bad = Vec::new();
    for &i in coords {
        let a = analytic[i] as f64;
        let n = numeric(i);
        let tol = 2e-2 * a.abs().max(n.abs()) + 5e-3 * scale;
        if (a - n).abs() > tol {
            bad.push(format!("{what}[{i}]: analytic {a:.6} numeric {n:.6}"));
        }
    }
    (coords.len(), bad)
}

fn sample(len: usize, rng: &mut impl Rng) -> Vec<usize> {
    if len <= SAMPLES {
        (0..len).collect()
    } else {
        (0..SAMPLES).map(|_| rng.random_range(0..len)).collect()
    }
}

fn gradcheck(name: &str, layer: &mut impl Layer, store: &mut ParamStore, input: &Tensor, tol: Tol) {
    let mut rng = ChaCha8Rng::seed_from_u64(99);
    let out = layer.fwd(store, input);
    let r = Tensor::randn(&out.shape, 1.0, &mut rng);
    store.zero_grads();
    let grad_input = layer.bwd(store, &r);
    assert_eq!(
        grad_input.shape, input.shape,
        "{name}: input-gradient shape"
    );
    let param_grads = store.grads.clone();
    let eps = tol.eps;

    let mut x = input.clone();
    let (n_in, mut bad) = compare(
        &format!("{name} input"),
        &grad_input.data,
        &sample(input.len(), &mut rng),
        |i| {
            let orig = x.data[i];
            x.data[i] = orig + eps;
            let plus = dot(&layer.fwd(store, &x), &r.data);
            x.data[i] = orig - eps;
            let minus = dot(&layer.fwd(store, &x), &r.data);
            x.data[i] = orig;
            (plus - minus) / (2.0 * eps as f64)
        },
    );
    let coords = sample(store.values.len(), &mut rng);
    let (n_p, bad_p) = compare(&format!("{name} param"), &param_grads, &coords, |j| {
        let orig = store.values[j];
        store.values[j] = orig + eps;
        let plus = dot(&layer.fwd(store, input), &r.data);
        store.values[j] = orig - eps;
        let minus = dot(&layer.fwd(store, input), &r.data);
        store.values[j] = orig;
        (plus - minus) / (2.0 * eps as f64)
    });
    bad.extend(bad_p);
    let allowed = (tol.max_bad_fraction * (n_in + n_p) as f64).floor() as usize;
    assert!(
        bad.len() <= allowed,
        "{name}: {} of {} coordinates off (allowed {allowed}):\n{}",
        bad.len(),
        n_in + n_p,
        bad.join("\n")
    );
}

/// Moves the one-dimensional parameters (batch-norm gamma/beta, biases) off their
/// initial 1/0 so their gradients are exercised in general position.
fn jitter_vectors(store: &mut ParamStore, rng: &mut impl Rng) {
    for e in store.entries.clone() {
        if e.shape.len() == 1 {
            for v in &mut store.values[e.range()] {
                *v += rng.random_range(-0.3..0.3);
            }
        }
    }
}

fn rng() -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(7)
}

#[test]
fn conv_3x3_stride1_pad1() {
    let mut rng = rng();
    let mut store = ParamStore::new();
    let mut conv = Conv2d::new(&mut store, "c", 3, 4, 3, 1, 1, &mut rng);
    let x = Tensor::randn(&[2, 3, 5, 5], 1.0, &mut rng);
    gradcheck("conv3x3", &mut conv, &mut store, &x, SMOOTH);
}

#[test]
fn conv_3x3_stride2_pad1_odd_input() {
    let mut rng = rng();
    let mut store = ParamStore::new();
    let mut conv = Conv2d::new(&mut store, "c", 3, 4, 3, 2, 1, &mut rng);
    let x = Tensor::randn(&[2, 3, 7, 6], 1.0, &mut rng);
    gradcheck("conv3x3/2", &mut conv, &mut store, &x, SMOOTH);
}

#[test]
fn conv_7x7_stride2_pad3_stem() {
    let mut rng = rng();
    let mut store = ParamStore::new();
    let mut conv = Conv2d::new(&mut store, "c", 3, 2, 7, 2, 3, &mut rng);
    let x = Tensor::randn(&[1, 3, 9, 9], 1.0, &mut rng);
    gradcheck("conv7x7/2", &mut conv, &mut store, &x, SMOOTH);
}

/// The first layer's backward (no gradient for the image) accumulates the same weight
/// gradient as the full backward, for the stem's shape and a pointwise one.
#[test]
fn a_convs_weight_gradient_is_the_same_without_the_inputs() {
    for (c, k, stride, pad, size) in [(3, 7, 2, 3, 9), (4, 1, 2, 0, 5)] {
        let mut rng = rng();
        let mut store = ParamStore::new();
        let mut conv = Conv2d::new(&mut store, "c", c, 4, k, stride, pad, &mut rng);
        let x = Tensor::randn(&[2, c, size, size], 1.0, &mut rng);
        let y = conv.forward(&CpuBackend, &mut store, &x, true);
        let g = Tensor::randn(&y.shape, 1.0, &mut rng);
        let mut alone = store.clone();
        let dx = conv.backward(&CpuBackend, &mut store, &g);
        assert_eq!(dx.shape, x.shape);
        conv.forward(&CpuBackend, &mut alone, &x, true);
        conv.backward_weight(&CpuBackend, &mut alone, &g);
        assert_eq!(alone.grads, store.grads, "{k}x{k}/{stride}");
        assert!(store.grads.iter().any(|g| *g != 0.0));
    }
}

#[test]
fn conv_1x1_pointwise_and_strided() {
    let mut rng = rng();
    let mut store = ParamStore::new();
    let mut conv = Conv2d::new(&mut store, "c", 4, 3, 1, 1, 0, &mut rng);
    let x = Tensor::randn(&[2, 4, 3, 3], 1.0, &mut rng);
    gradcheck("conv1x1", &mut conv, &mut store, &x, SMOOTH);
    let mut store = ParamStore::new();
    let mut conv = Conv2d::new(&mut store, "c", 4, 3, 1, 2, 0, &mut rng);
    let x = Tensor::randn(&[2, 4, 5, 5], 1.0, &mut rng);
    gradcheck("conv1x1/2", &mut conv, &mut store, &x, SMOOTH);
}

#[test]
fn batchnorm_train_mode() {
    let mut rng = rng();
    let mut store = ParamStore::new();
    let mut bn = BatchNorm2d::new(&mut store, "bn", 3);
    jitter_vectors(&mut store, &mut rng);
    let x = batch_norm_input(&mut rng);
    gradcheck("batchnorm", &mut bn, &mut store, &x, SMOOTH);
}

/// Non-zero means and unequal scales, to exercise the statistics' gradients.
fn batch_norm_input(rng: &mut impl Rng) -> Tensor {
    let mut x = Tensor::randn(&[3, 3, 3, 3], 1.0, rng);
    x.data
        .iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v = *v * 2.0 + (i % 3) as f32);
    x
}

#[test]
fn batchnorm_with_its_relu_fused() {
    let mut rng = rng();
    let mut store = ParamStore::new();
    let mut bn = BatchNorm2d::new(&mut store, "bn", 3).with_relu();
    jitter_vectors(&mut store, &mut rng);
    let x = batch_norm_input(&mut rng);
    gradcheck("batchnorm+relu", &mut bn, &mut store, &x, KINKED);
}

#[test]
fn relu() {
    let mut rng = rng();
    let mut store = ParamStore::new();
    let mut x = Tensor::randn(&[2, 3, 4, 4], 1.0, &mut rng);
    // Keep inputs away from the kink at 0 so the check is exact.
    x.data
        .iter_mut()
        .for_each(|v| *v = v.signum() * (v.abs() + 0.1));
    gradcheck("relu", &mut Relu::new(), &mut store, &x, SMOOTH);
}

#[test]
fn maxpool_3x3_stride2_pad1() {
    let mut rng = rng();
    let mut store = ParamStore::new();
    let x = Tensor::randn(&[2, 2, 7, 7], 1.0, &mut rng);
    gradcheck(
        "maxpool",
        &mut MaxPool2d::new(3, 2, 1),
        &mut store,
        &x,
        KINKED,
    );
}

#[test]
fn global_average_pool() {
    let mut rng = rng();
    let mut store = ParamStore::new();
    let x = Tensor::randn(&[2, 3, 4, 5], 1.0, &mut rng);
    gradcheck("avgpool", &mut GlobalAvgPool::new(), &mut store, &x, SMOOTH);
}

#[test]
fn linear() {
    let mut rng = rng();
    let mut store = ParamStore::new();
    let mut fc = Linear::new(&mut store, "fc", 5, 4, &mut rng);
    let x = Tensor::randn(&[3, 5], 1.0, &mut rng);
    gradcheck("linear", &mut fc, &mut store, &x, SMOOTH);
}

#[test]
fn softmax_cross_entropy_with_label_smoothing() {
    let mut rng = rng();
    let logits = Tensor::randn(&[4, 5], 2.0, &mut rng);
    let labels = [0, 3, 4, 3];
    for smoothing in [0.0, 0.1] {
        let out = softmax_cross_entropy(&logits, &labels, smoothing);
        let eps = 1e-2;
        let mut x = logits.clone();
        let coords: Vec<usize> = (0..x.len()).collect();
        let (_, bad) = compare("ce", &out.grad_logits.data, &coords, |i| {
            let orig = x.data[i];
            x.data[i] = orig + eps;
            let plus = softmax_cross_entropy(&x, &labels, smoothing).loss as f64;
            x.data[i] = orig - eps;
            let minus = softmax_cross_entropy(&x, &labels, smoothing).loss as f64;
            x.data[i] = orig;
            (plus - minus) / (2.0 * eps as f64)
        });
        assert!(bad.is_empty(), "smoothing {smoothing}:\n{}", bad.join("\n"));
    }
    // Uniform logits: loss is ln(classes) whatever the smoothing.
    let flat = Tensor::zeros(&[2, 5]);
    let out = softmax_cross_entropy(&flat, &[1, 2], 0.1);
    assert!((out.loss - 5f32.ln()).abs() < 1e-6);
}

#[test]
fn basic_block_with_projection() {
    let mut rng = rng();
    let mut store = ParamStore::new();
    let mut block = ResidualBlock::basic(&mut store, "b", 3, 4, 2, &mut rng);
    jitter_vectors(&mut store, &mut rng);
    let x = Tensor::randn(&[2, 3, 6, 6], 1.0, &mut rng);
    gradcheck("basic/2", &mut block, &mut store, &x, KINKED);
}

#[test]
fn basic_block_identity() {
    let mut rng = rng();
    let mut store = ParamStore::new();
    let mut block = ResidualBlock::basic(&mut store, "b", 3, 3, 1, &mut rng);
    jitter_vectors(&mut store, &mut rng);
    let x = Tensor::randn(&[2, 3, 4, 4], 1.0, &mut rng);
    gradcheck("basic", &mut block, &mut store, &x, KINKED);
}

#[test]
fn bottleneck_block_with_projection() {
    let mut rng = rng();
    let mut store = ParamStore::new();
    let mut block = ResidualBlock::bottleneck(&mut store, "b", 4, 2, 2, &mut rng);
    jitter_vectors(&mut store, &mut rng);
    let x = Tensor::randn(&[2, 4, 5, 5], 1.0, &mut rng);
    gradcheck("bottleneck/2", &mut block, &mut store, &x, KINKED);
}

/// End to end: the gradient `forward_backward` leaves in the store matches central
/// differences of the training-mode loss of a whole (tiny) CIFAR ResNet.
#[test]
fn whole_cifar_resnet_parameters() {
    let mut model = Model::new(Arch::CifarResNet { depth: 8, width: 2 }, 3, 5);
    let mut rng = rng();
    jitter_vectors(model.params_mut(), &mut rng);
    let x = Tensor::randn(&[3, 3, 8, 8], 1.0, &mut rng);
    let labels = [0, 2, 1];
    model.zero_grads();
    model.forward_backward(&x, &labels, 0.1, 1.0);
    let analytic = model.params().grads.clone();
    let eps = KINKED.eps;
    let coords = sample(analytic.len(), &mut rng);
    let loss = |m: &mut Model| {
        let logits = m.forward(&x, true);
        softmax_cross_entropy(&logits, &labels, 0.1).loss as f64
    };
    let (n, bad) = compare("model", &analytic, &coords, |j| {
        let orig = model.params().values[j];
        model.params_mut().values[j] = orig + eps;
        let plus = loss(&mut model);
        model.params_mut().values[j] = orig - eps;
        let minus = loss(&mut model);
        model.params_mut().values[j] = orig;
        (plus - minus) / (2.0 * eps as f64)
    });
    assert!(
        bad.len() as f64 <= KINKED.max_bad_fraction * n as f64,
        "{}",
        bad.join("\n")
    );
}
