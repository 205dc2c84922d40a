//! ResNets: torchvision's ImageNet family and the CIFAR family of He et al.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use ringmaster_contract::trainer::Model as ModelName;

use super::backend::{Backend, CpuBackend};
use super::layers::{
    BatchNorm2d, Conv2d, GlobalAvgPool, Linear, MaxPool2d, ResidualBlock, softmax_cross_entropy,
};
use super::params::ParamStore;
use super::tensor::{DType, Tensor};

/// Which ResNet to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Basic blocks `[2, 2, 2, 2]`.
    ResNet18,
    /// Basic blocks `[3, 4, 6, 3]`.
    ResNet34,
    /// Bottlenecks `[3, 4, 6, 3]`.
    ResNet50,
    /// Bottlenecks `[3, 4, 23, 3]`.
    ResNet101,
    /// Bottlenecks `[3, 8, 36, 3]`.
    ResNet152,
    /// The CIFAR ResNet: 3x3 stem, three stages of `(depth - 2) / 6` basic blocks with
    /// `width`, `2 * width` and `4 * width` channels.
    CifarResNet {
        /// `6n + 2`: 8, 14, 20, 32, 44, 56, 110.
        depth: usize,
        /// Channels of the first stage (16 in the paper).
        width: usize,
    },
}

impl Arch {
    /// The network a model name stands for (`width`: the CIFAR ResNets' first stage).
    pub fn of(model: ModelName, width: usize) -> Self {
        match model {
            ModelName::Resnet18 => Arch::ResNet18,
            ModelName::Resnet34 => Arch::ResNet34,
            ModelName::Resnet50 => Arch::ResNet50,
            ModelName::Resnet101 => Arch::ResNet101,
            ModelName::Resnet152 => Arch::ResNet152,
            ModelName::Cifar8 => Arch::CifarResNet { depth: 8, width },
            ModelName::Cifar20 => Arch::CifarResNet { depth: 20, width },
        }
    }
}

/// Loss and accuracy of one batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Mean loss over the batch.
    pub loss: f32,
    /// Correctly classified samples.
    pub correct: usize,
    /// Samples in the batch.
    pub batch: usize,
}

/// A batch's loss totals while its forward and backward passes are still queued on the
/// backend ([`Model::queue_step`]); [`Model::stats_of`] waits for them.
#[must_use = "the totals are read with Model::stats_of"]
pub struct QueuedStats<B: Backend> {
    totals: B::Buf,
    batch: usize,
}

/// Told during backward that every gradient from a parameter offset to the end of the flat
/// gradient buffer is final, with the backend and that buffer; the offsets fall to 0.
pub type GradientsFinal<'a, B> = &'a mut dyn FnMut(&B, &mut <B as Backend>::Buf, usize);

/// A ResNet with its parameters.
#[derive(Debug, Clone)]
pub struct Model<B: Backend = CpuBackend> {
    arch: Arch,
    num_classes: usize,
    params: ParamStore<B>,
    stem_conv: Conv2d<B>,
    /// With the stem's ReLU fused in.
    stem_bn: BatchNorm2d<B>,
    maxpool: Option<MaxPool2d<B>>,
    blocks: Vec<ResidualBlock<B>>,
    pool: GlobalAvgPool<B>,
    fc: Linear<B>,
    backend: B,
    /// The activations' type (parameters stay f32).
    dtype: DType,
}

impl Model {
    /// Builds `arch` for `num_classes` classes on the CPU, initialised deterministically
    /// from `seed`. Panics for a CIFAR depth that is not `6n + 2`.
    pub fn new(arch: Arch, num_classes: usize, seed: u64) -> Self {
        Self::with_backend(arch, num_classes, seed, CpuBackend)
    }
}

impl<B: Backend> Model<B> {
    /// [`Model::new`] computing on `backend` in f32: the same initial parameters on every
    /// backend (they are drawn on the host and copied over).
    pub fn with_backend(arch: Arch, num_classes: usize, seed: u64, backend: B) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut store = ParamStore::new();
        let (stem_conv, stem_bn, maxpool, stem_out) = match arch {
            Arch::CifarResNet { width, .. } => (
                Conv2d::new(&mut store, "conv1", 3, width, 3, 1, 1, &mut rng),
                BatchNorm2d::new(&mut store, "bn1", width).with_relu(),
                None,
                width,
            ),
            _ => (
                Conv2d::new(&mut store, "conv1", 3, 64, 7, 2, 3, &mut rng),
                BatchNorm2d::new(&mut store, "bn1", 64).with_relu(),
                Some(MaxPool2d::new(3, 2, 1)),
                64,
            ),
        };
        // (blocks per stage, channels of the first stage, bottleneck?)
        let (stages, base, bottleneck): (Vec<usize>, usize, bool) = match arch {
            Arch::ResNet18 => (vec![2, 2, 2, 2], 64, false),
            Arch::ResNet34 => (vec![3, 4, 6, 3], 64, false),
            Arch::ResNet50 => (vec![3, 4, 6, 3], 64, true),
            Arch::ResNet101 => (vec![3, 4, 23, 3], 64, true),
            Arch::ResNet152 => (vec![3, 8, 36, 3], 64, true),
            Arch::CifarResNet { depth, width } => {
                assert!(
                    depth >= 8 && (depth - 2) % 6 == 0,
                    "CIFAR ResNet depth must be 6n + 2, got {depth}"
                );
                (vec![(depth - 2) / 6; 3], width, false)
            }
        };
        let mut blocks = Vec::new();
        let mut channels = stem_out;
        for (s, &count) in stages.iter().enumerate() {
            let planes = base << s;
            for b in 0..count {
                let stride = if s > 0 && b == 0 { 2 } else { 1 };
                let prefix = format!("layer{}.{b}", s + 1);
                let block = if bottleneck {
                    ResidualBlock::bottleneck(
                        &mut store, &prefix, channels, planes, stride, &mut rng,
                    )
                } else {
                    ResidualBlock::basic(&mut store, &prefix, channels, planes, stride, &mut rng)
                };
                blocks.push(block);
                channels = if bottleneck { planes * 4 } else { planes };
            }
        }
        let fc = Linear::new(&mut store, "fc", channels, num_classes, &mut rng);
        Self {
            arch,
            num_classes,
            params: store.to_backend(&backend),
            stem_conv,
            stem_bn,
            maxpool,
            blocks,
            pool: GlobalAvgPool::new(),
            fc,
            backend,
            dtype: DType::F32,
        }
    }

    /// Computes activations in `dtype` (bf16 for mixed precision); panics when the backend
    /// cannot (the trainer's settings check refuses such a pairing first).
    pub fn with_activations(mut self, dtype: DType) -> Self {
        assert!(
            self.backend.supports(dtype),
            "the {} backend does not compute in {dtype:?}",
            self.backend.name()
        );
        self.dtype = dtype;
        self
    }

    /// The backend the model computes on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The activations' type.
    pub fn activations(&self) -> DType {
        self.dtype
    }

    /// The architecture.
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// Number of output classes.
    pub fn num_classes(&self) -> usize {
        self.num_classes
    }

    /// Number of learnable scalars (batch-norm running statistics excluded).
    pub fn num_parameters(&self) -> usize {
        self.params.num_parameters()
    }

    /// Parameters, gradients and buffers.
    pub fn params(&self) -> &ParamStore<B> {
        &self.params
    }

    /// Mutable parameters, e.g. for all-reduce, the optimizer or loading a checkpoint.
    pub fn params_mut(&mut self) -> &mut ParamStore<B> {
        &mut self.params
    }

    /// Logits `[N, classes]` (on the host) for NCHW host images with 3 channels, any size.
    /// `train` selects batch statistics (and caching for backward) over running statistics.
    pub fn forward(&mut self, images: &Tensor, train: bool) -> Tensor {
        self.backend.begin_step();
        let images = Tensor::upload(&self.backend, images, self.dtype);
        let logits = self.forward_on_device(&images, train);
        logits.download(&self.backend)
    }

    /// [`Model::forward`] on images already on the backend, in the activations' type;
    /// logits stay there too.
    pub fn forward_on_device(&mut self, images: &Tensor<B>, train: bool) -> Tensor<B> {
        let (be, p) = (&self.backend, &mut self.params);
        let mut h = self.stem_conv.forward(be, p, images, train);
        h = self.stem_bn.forward(be, p, &h, train);
        if let Some(pool) = &mut self.maxpool {
            h = pool.forward(be, p, &h, train);
        }
        for block in &mut self.blocks {
            h = block.forward(be, p, &h, train);
        }
        h = self.pool.forward(be, p, &h, train);
        self.fc.forward(be, p, &h, train)
    }

    /// Back-propagates, telling `final_from` each time the gradients from a parameter
    /// offset to the end of the buffer are final (down to 0), e.g. to all-reduce them while
    /// the rest is computed.
    fn backward(&mut self, grad_logits: &Tensor<B>, final_from: GradientsFinal<'_, B>) {
        let (be, p) = (&self.backend, &mut self.params);
        let mut g = self.fc.backward(be, p, grad_logits);
        final_from(be, &mut p.grads, self.fc.weight.start);
        g = self.pool.backward(be, p, &g);
        for block in self.blocks.iter_mut().rev() {
            g = block.backward(be, p, g);
            final_from(be, &mut p.grads, block.first_parameter());
        }
        if let Some(pool) = &mut self.maxpool {
            g = pool.backward(be, p, &g);
        }
        g = self.stem_bn.backward(be, p, &g);
        // The image needs no gradient: only the stem's weight gradient is computed.
        self.stem_conv.backward_weight(be, p, &g);
        final_from(be, &mut p.grads, 0);
    }

    /// Sets every gradient to zero.
    pub fn zero_grads(&mut self) {
        self.params.zero_grads_on(&self.backend);
    }

    /// Adds `grad_scale` times the gradient of this micro-batch's mean loss into
    /// `params().grads` without zeroing first.
    ///
    /// Accumulating `k` micro-batches with `grad_scale = 1/k` yields the average of the
    /// gradients `k` data-parallel ranks would all-reduce.
    pub fn forward_backward(
        &mut self,
        images: &Tensor,
        labels: &[usize],
        label_smoothing: f32,
        grad_scale: f32,
    ) -> StepStats {
        let images = Tensor::upload(&self.backend, images, self.dtype);
        self.forward_backward_on_device(&images, labels, label_smoothing, grad_scale)
    }

    /// [`Model::forward_backward`] on images already on the backend, in the activations'
    /// type (an owned upload: the step's temporaries are recycled at its start).
    pub fn forward_backward_on_device(
        &mut self,
        images: &Tensor<B>,
        labels: &[usize],
        label_smoothing: f32,
        grad_scale: f32,
    ) -> StepStats {
        self.forward_backward_on_device_with(
            images,
            labels,
            label_smoothing,
            grad_scale,
            &mut |_, _, _| {},
        )
    }

    /// [`Model::forward_backward_on_device`], telling `final_from` during backward which
    /// gradients are final (see [`GradientsFinal`]).
    pub fn forward_backward_on_device_with(
        &mut self,
        images: &Tensor<B>,
        labels: &[usize],
        label_smoothing: f32,
        grad_scale: f32,
        final_from: GradientsFinal<'_, B>,
    ) -> StepStats {
        let queued = self.queue_step(images, labels, label_smoothing, grad_scale, final_from);
        self.stats_of(queued)
    }

    /// [`Model::forward_backward_on_device_with`] without waiting for the loss: the caller
    /// queues what else it can (the next batch's upload) before [`Model::stats_of`] waits,
    /// so that work overlaps this step's. The totals live until the next step starts
    /// ([`Backend::begin_step`]).
    pub fn queue_step(
        &mut self,
        images: &Tensor<B>,
        labels: &[usize],
        label_smoothing: f32,
        grad_scale: f32,
        final_from: GradientsFinal<'_, B>,
    ) -> QueuedStats<B> {
        let be = self.backend.clone();
        be.begin_step();
        let n = labels.len();
        assert_eq!(images.shape[0], n, "one label per image");
        let labels = be.upload(&self.loss_labels(labels), &[n], DType::F32);
        let mut totals = be.alloc(2, DType::F32);
        be.fill_zero(be.view_mut(&mut totals, 0..2));
        self.queue_forward_backward(
            images,
            &labels,
            label_smoothing,
            grad_scale,
            &mut totals,
            final_from,
        );
        QueuedStats { totals, batch: n }
    }

    /// The loss and accuracy of a [`Model::queue_step`] (waits for them).
    pub fn stats_of(&self, queued: QueuedStats<B>) -> StepStats {
        self.read_totals(&queued.totals, queued.batch)
    }

    /// The loss totals [`Model::queue_forward_backward`] left for a batch of `batch`
    /// images (waits for them).
    pub fn read_totals(&self, totals: &B::Buf, batch: usize) -> StepStats {
        let totals = self.backend.download(totals, &[2]);
        StepStats {
            loss: totals[0],
            correct: totals[1] as usize,
            batch,
        }
    }

    /// `labels` as the loss reads them (class indices as f32), checked against the classes.
    pub fn loss_labels(&self, labels: &[usize]) -> Vec<f32> {
        let classes = self.num_classes;
        assert!(
            labels.iter().all(|&l| l < classes),
            "a label is out of range for {classes} classes"
        );
        labels.iter().map(|&l| l as f32).collect()
    }

    /// Forward, loss and backward on images and labels ([`Model::loss_labels`]) already on
    /// the backend, adding the batch's mean loss and correct count into `totals` (2 f32).
    /// Queues device work only (no upload, download, wait or arena reset: the caller calls
    /// [`Backend::begin_step`]), so a device backend can record it ([`Backend::record`]).
    pub fn queue_forward_backward(
        &mut self,
        images: &Tensor<B>,
        labels: &B::Buf,
        label_smoothing: f32,
        grad_scale: f32,
        totals: &mut B::Buf,
        final_from: GradientsFinal<'_, B>,
    ) {
        let be = self.backend.clone();
        let logits = self.forward_on_device(images, true);
        let (n, classes) = logits.dims2();
        let mut grad_logits = Tensor::alloc(&be, &[n, classes], DType::F32);
        be.softmax_cross_entropy(
            classes,
            logits.view(&be),
            be.view(labels, 0..n),
            label_smoothing,
            grad_scale,
            grad_logits.view_mut(&be),
            be.view_mut(totals, 0..2),
        );
        self.backward(&grad_logits, final_from);
    }

    /// Zeroes the gradients, then leaves this batch's mean-loss gradient in them.
    pub fn train_step(
        &mut self,
        images: &Tensor,
        labels: &[usize],
        label_smoothing: f32,
    ) -> StepStats {
        self.zero_grads();
        self.forward_backward(images, labels, label_smoothing, 1.0)
    }

    /// Loss (without label smoothing) and accuracy in evaluation mode; touches no
    /// gradients or running statistics.
    pub fn evaluate(&mut self, images: &Tensor, labels: &[usize]) -> StepStats {
        let logits = self.forward(images, false);
        let out = softmax_cross_entropy(&logits, labels, 0.0);
        StepStats {
            loss: out.loss,
            correct: out.correct,
            batch: labels.len(),
        }
    }
}
