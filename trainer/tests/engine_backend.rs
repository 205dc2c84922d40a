//! The layers do no arithmetic of their own: a backend that counts its calls and delegates
//! to the CPU backend sees every kernel of a ResNet step, and gives bit-identical results.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use ringmaster_trainer::engine::backend::{
    BatchNormConfig, BatchNormSaved, BnEpilogue, BnEpilogueGrad, ConvShape, Matrix, PoolShape,
};
use ringmaster_trainer::engine::data::SyntheticData;
use ringmaster_trainer::engine::tensor::DType;
use ringmaster_trainer::engine::{Arch, Backend, CpuBackend, Model, Sgd};

/// Counts calls per operation, then lets the CPU backend compute.
#[derive(Clone, Debug, Default)]
struct Counting {
    calls: Arc<Mutex<BTreeMap<&'static str, usize>>>,
}

impl Counting {
    fn hit(&self, op: &'static str) {
        *self.calls.lock().unwrap().entry(op).or_default() += 1;
    }
    fn count(&self, op: &str) -> usize {
        self.calls.lock().unwrap().get(op).copied().unwrap_or(0)
    }
}

type HostMatrix<'a> = Matrix<&'a [f32]>;

impl Backend for Counting {
    type Buf = Vec<f32>;
    type View<'a> = &'a [f32];
    type ViewMut<'a> = &'a mut [f32];
    type ConvSaved = ();
    type BnSaved = BatchNormSaved;
    type PoolSaved = Vec<u32>;
    type Recording = std::convert::Infallible;

    fn name(&self) -> &'static str {
        "counting"
    }
    fn supports(&self, dtype: DType) -> bool {
        CpuBackend.supports(dtype)
    }
    fn alloc(&self, len: usize, dtype: DType) -> Vec<f32> {
        CpuBackend.alloc(len, dtype)
    }
    fn zeros(&self, len: usize, dtype: DType) -> Vec<f32> {
        CpuBackend.zeros(len, dtype)
    }
    fn upload(&self, host: &[f32], shape: &[usize], dtype: DType) -> Vec<f32> {
        CpuBackend.upload(host, shape, dtype)
    }
    fn upload_into(&self, host: &[f32], shape: &[usize], buf: &mut Vec<f32>) {
        CpuBackend.upload_into(host, shape, buf)
    }
    fn replay(&self, recording: &Self::Recording) {
        match *recording {}
    }
    fn download(&self, buf: &Vec<f32>, shape: &[usize]) -> Vec<f32> {
        CpuBackend.download(buf, shape)
    }
    fn with_host<R>(&self, buf: &mut Vec<f32>, f: impl FnOnce(&mut [f32]) -> R) -> R {
        CpuBackend.with_host(buf, f)
    }
    fn begin_step(&self) {
        self.hit("begin_step");
    }
    fn view<'a>(&self, buf: &'a Vec<f32>, range: Range<usize>) -> &'a [f32] {
        CpuBackend.view(buf, range)
    }
    fn view_mut<'a>(&self, buf: &'a mut Vec<f32>, range: Range<usize>) -> &'a mut [f32] {
        CpuBackend.view_mut(buf, range)
    }
    fn view_mut_pair<'a>(
        &self,
        buf: &'a mut Vec<f32>,
        a: Range<usize>,
        b: Range<usize>,
    ) -> (&'a mut [f32], &'a mut [f32]) {
        CpuBackend.view_mut_pair(buf, a, b)
    }
    fn fill_zero(&self, x: &mut [f32]) {
        self.hit("fill_zero");
        CpuBackend.fill_zero(x)
    }
    fn gemm(
        &self,
        m: usize,
        k: usize,
        n: usize,
        a: HostMatrix,
        b: HostMatrix,
        beta: f32,
        c: &mut [f32],
    ) {
        self.hit("gemm");
        CpuBackend.gemm(m, k, n, a, b, beta, c)
    }
    fn conv2d_forward(&self, s: &ConvShape, x: &[f32], w: &[f32], y: &mut [f32]) {
        self.hit("conv2d_forward");
        CpuBackend.conv2d_forward(s, x, w, y)
    }
    fn conv2d_backward(
        &self,
        s: &ConvShape,
        saved: &(),
        x: &[f32],
        w: &[f32],
        dy: &[f32],
        dx: Option<&mut [f32]>,
        dw: &mut [f32],
    ) {
        self.hit("conv2d_backward");
        CpuBackend.conv2d_backward(s, saved, x, w, dy, dx, dw)
    }
    fn batch_norm_forward_training(
        &self,
        dims: (usize, usize, usize),
        config: BatchNormConfig,
        x: &[f32],
        gamma: &[f32],
        beta: &[f32],
        rm: &mut [f32],
        rv: &mut [f32],
        epilogue: BnEpilogue<&[f32]>,
        y: &mut [f32],
    ) -> BatchNormSaved {
        self.hit("batch_norm_forward_training");
        self.hit(match epilogue {
            BnEpilogue::Identity => "batch_norm_forward_training+identity",
            BnEpilogue::Relu => "batch_norm_forward_training+relu",
            BnEpilogue::AddRelu(_) => "batch_norm_forward_training+add_relu",
        });
        CpuBackend.batch_norm_forward_training(dims, config, x, gamma, beta, rm, rv, epilogue, y)
    }
    fn batch_norm_forward_inference(
        &self,
        dims: (usize, usize, usize),
        config: BatchNormConfig,
        x: &[f32],
        gamma: &[f32],
        beta: &[f32],
        rm: &[f32],
        rv: &[f32],
        y: &mut [f32],
    ) {
        self.hit("batch_norm_forward_inference");
        CpuBackend.batch_norm_forward_inference(dims, config, x, gamma, beta, rm, rv, y)
    }
    fn batch_norm_backward(
        &self,
        dims: (usize, usize, usize),
        config: BatchNormConfig,
        saved: &BatchNormSaved,
        gamma: &[f32],
        beta: &[f32],
        epilogue: BnEpilogueGrad<&[f32], &mut [f32]>,
        dy: &[f32],
        dx: &mut [f32],
        dgamma: &mut [f32],
        dbeta: &mut [f32],
    ) {
        self.hit("batch_norm_backward");
        self.hit(match epilogue {
            BnEpilogueGrad::Identity => "batch_norm_backward+identity",
            BnEpilogueGrad::Relu { .. } => "batch_norm_backward+relu",
            BnEpilogueGrad::AddRelu { .. } => "batch_norm_backward+add_relu",
        });
        CpuBackend.batch_norm_backward(
            dims, config, saved, gamma, beta, epilogue, dy, dx, dgamma, dbeta,
        )
    }
    fn relu_forward(&self, x: &[f32], y: &mut [f32]) {
        self.hit("relu_forward");
        CpuBackend.relu_forward(x, y)
    }
    fn relu_backward(&self, y: &[f32], dy: &[f32], dx: &mut [f32]) {
        self.hit("relu_backward");
        CpuBackend.relu_backward(y, dy, dx)
    }
    fn max_pool_forward(&self, s: &PoolShape, x: &[f32], y: &mut [f32]) -> Vec<u32> {
        self.hit("max_pool_forward");
        CpuBackend.max_pool_forward(s, x, y)
    }
    fn max_pool_backward(&self, s: &PoolShape, am: &Vec<u32>, dy: &[f32], dx: &mut [f32]) {
        self.hit("max_pool_backward");
        CpuBackend.max_pool_backward(s, am, dy, dx)
    }
    fn global_avg_pool_forward(&self, dims: (usize, usize, usize), x: &[f32], y: &mut [f32]) {
        self.hit("global_avg_pool_forward");
        CpuBackend.global_avg_pool_forward(dims, x, y)
    }
    fn global_avg_pool_backward(&self, dims: (usize, usize, usize), dy: &[f32], dx: &mut [f32]) {
        self.hit("global_avg_pool_backward");
        CpuBackend.global_avg_pool_backward(dims, dy, dx)
    }
    fn broadcast_rows(&self, bias: &[f32], y: &mut [f32]) {
        self.hit("broadcast_rows");
        CpuBackend.broadcast_rows(bias, y)
    }
    fn sum_rows(&self, x: &[f32], sums: &mut [f32]) {
        self.hit("sum_rows");
        CpuBackend.sum_rows(x, sums)
    }
    fn add_assign(&self, a: &mut [f32], b: &[f32]) {
        self.hit("add_assign");
        CpuBackend.add_assign(a, b)
    }
    fn softmax_cross_entropy(
        &self,
        classes: usize,
        logits: &[f32],
        labels: &[f32],
        label_smoothing: f32,
        grad_scale: f32,
        dlogits: &mut [f32],
        totals: &mut [f32],
    ) {
        self.hit("softmax_cross_entropy");
        CpuBackend.softmax_cross_entropy(
            classes,
            logits,
            labels,
            label_smoothing,
            grad_scale,
            dlogits,
            totals,
        )
    }
    fn sgd_update(
        &self,
        w: &mut [f32],
        g: &[f32],
        v: &mut [f32],
        lr: f32,
        momentum: f32,
        weight_decay: f32,
    ) {
        self.hit("sgd_update");
        CpuBackend.sgd_update(w, g, v, lr, momentum, weight_decay)
    }
}

#[test]
fn a_resnet18_step_runs_every_kernel_through_the_backend() {
    let counting = Counting::default();
    let mut counted = Model::with_backend(Arch::ResNet18, 10, 7, counting.clone());
    let mut reference = Model::new(Arch::ResNet18, 10, 7);
    let data = SyntheticData::new(10, 32, 4, 1);
    let (images, labels) = data.batch(&[0, 1, 2, 3]);

    let a = counted.train_step(&images, &labels, 0.1);
    let b = reference.train_step(&images, &labels, 0.1);
    assert_eq!(a.loss.to_bits(), b.loss.to_bits());
    assert_eq!(counted.params().grads, reference.params().grads);
    assert_eq!(counted.params().buffers, reference.params().buffers);

    // ResNet-18: stem conv + 8 blocks × 2 convs + 3 projection shortcuts = 20 convs, each
    // followed by batch norm. Every ReLU is fused into the batch norm before it: the stem's
    // and each block's inner one (9), and each block's add-then-ReLU (8); the projections'
    // batch norms (3) have none. The only adds left are backward's, one per block, where
    // the two paths' input gradients meet.
    let expected = [
        ("conv2d_forward", 20),
        ("conv2d_backward", 20),
        ("batch_norm_forward_training", 20),
        ("batch_norm_forward_training+identity", 3),
        ("batch_norm_forward_training+relu", 9),
        ("batch_norm_forward_training+add_relu", 8),
        ("batch_norm_backward", 20),
        ("batch_norm_backward+identity", 3),
        ("batch_norm_backward+relu", 9),
        ("batch_norm_backward+add_relu", 8),
        ("relu_forward", 0),
        ("relu_backward", 0),
        ("add_assign", 8),
        ("max_pool_forward", 1),
        ("max_pool_backward", 1),
        ("global_avg_pool_forward", 1),
        ("global_avg_pool_backward", 1),
        ("broadcast_rows", 1),
        ("sum_rows", 1),
        ("gemm", 3),
        ("softmax_cross_entropy", 1),
        ("batch_norm_forward_inference", 0),
    ];
    for (op, n) in expected {
        assert_eq!(counting.count(op), n, "{op}");
    }

    // One step: the gradients zeroed once and the loss's totals once, the arena recycled
    // once.
    assert_eq!(counting.count("fill_zero"), 2);
    assert_eq!(counting.count("begin_step"), 1);

    // The optimizer updates each parameter tensor through the backend, as the CPU one does.
    let mut sgd = Sgd::on(&counting, counted.params(), 0.9, 1e-4);
    let mut reference_sgd = Sgd::new(reference.params(), 0.9, 1e-4);
    sgd.step(counted.params_mut(), 0.1);
    reference_sgd.step(reference.params_mut(), 0.1);
    assert_eq!(counting.count("sgd_update"), counted.params().entries.len());
    assert_eq!(counted.params().values, reference.params().values);

    // Evaluation: cuDNN fuses nothing into inference, so the ReLUs and adds run on their own.
    let before =
        ["batch_norm_forward_inference", "relu_forward", "add_assign"].map(|op| counting.count(op));
    counted.evaluate(&images, &labels);
    let after =
        ["batch_norm_forward_inference", "relu_forward", "add_assign"].map(|op| counting.count(op));
    assert_eq!(after, [before[0] + 20, before[1] + 17, before[2] + 8]);
}

/// Batch norm's fused epilogues on the CPU are the separate operations in one pass, to the
/// bit: `relu(bn(x) + z)` forward, and backward the ReLU's mask, the residual's gradient
/// and the batch norm's own gradients. (The GPU tests hold cuDNN's fused calls to this.)
#[test]
fn a_fused_batch_norm_epilogue_equals_the_separate_operations() {
    use rand::SeedableRng;
    use ringmaster_trainer::engine::Tensor;
    let be = CpuBackend;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    let (n, c, hw) = (3, 4, 10);
    let len = n * c * hw;
    let config = BatchNormConfig {
        momentum: 0.1,
        eps: 1e-5,
    };
    let x = Tensor::randn(&[len], 2.0, &mut rng).data;
    let z = Tensor::randn(&[len], 1.0, &mut rng).data;
    let dy = Tensor::randn(&[len], 1.0, &mut rng).data;
    let gamma = Tensor::randn(&[c], 1.0, &mut rng).data;
    let beta = Tensor::randn(&[c], 1.0, &mut rng).data;
    let stats = || (vec![0.0; c], vec![1.0; c]);

    // Fused: one call each way.
    let (mut rm, mut rv) = stats();
    let mut fused_y = vec![0.0; len];
    let saved = be.batch_norm_forward_training(
        (n, c, hw),
        config,
        &x,
        &gamma,
        &beta,
        &mut rm,
        &mut rv,
        BnEpilogue::AddRelu(&z),
        &mut fused_y,
    );
    let (mut fused_dx, mut fused_dz) = (vec![0.0; len], vec![0.0; len]);
    let (mut fused_dgamma, mut fused_dbeta) = (vec![0.0; c], vec![0.0; c]);
    be.batch_norm_backward(
        (n, c, hw),
        config,
        &saved,
        &gamma,
        &beta,
        BnEpilogueGrad::AddRelu {
            y: &fused_y,
            dz: &mut fused_dz,
        },
        &dy,
        &mut fused_dx,
        &mut fused_dgamma,
        &mut fused_dbeta,
    );

    // Separate: batch norm, add, ReLU; then the ReLU's backward and the batch norm's.
    let (mut rm2, mut rv2) = stats();
    let mut normalised = vec![0.0; len];
    let saved = be.batch_norm_forward_training(
        (n, c, hw),
        config,
        &x,
        &gamma,
        &beta,
        &mut rm2,
        &mut rv2,
        BnEpilogue::Identity,
        &mut normalised,
    );
    be.add_assign(&mut normalised, &z);
    let mut y = vec![0.0; len];
    be.relu_forward(&normalised, &mut y);
    let mut dz = vec![0.0; len];
    be.relu_backward(&y, &dy, &mut dz);
    let mut dx = vec![0.0; len];
    let (mut dgamma, mut dbeta) = (vec![0.0; c], vec![0.0; c]);
    be.batch_norm_backward(
        (n, c, hw),
        config,
        &saved,
        &gamma,
        &beta,
        BnEpilogueGrad::Identity,
        &dz,
        &mut dx,
        &mut dgamma,
        &mut dbeta,
    );

    // The ReLU cut some values and kept others.
    assert!(y.contains(&0.0) && y.iter().any(|&v| v > 0.0));
    assert_eq!(fused_y, y, "forward");
    assert_eq!((rm, rv), (rm2, rv2), "running statistics");
    assert_eq!(fused_dz, dz, "the residual's gradient");
    assert_eq!(fused_dx, dx, "the input's gradient");
    assert_eq!(
        (fused_dgamma, fused_dbeta),
        (dgamma, dbeta),
        "gamma and beta"
    );
}
