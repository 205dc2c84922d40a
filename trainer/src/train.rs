//! `train`: data-parallel SGD over the ranks of the job. Every rank builds the same model from
//! the same seed (rank 0's weights are broadcast anyway), takes its shard of each global
//! batch, computes gradients, averages them with all-reduce, and steps. Rank 0 prints
//! JSON-lines progress and a final summary, and writes the checkpoint.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use clap::ValueEnum;
use serde_json::json;

use crate::collective::{Collective, CollectiveError, CollectiveKind, ReduceOp};
use crate::engine::checkpoint::{self, CheckpointError};
use crate::engine::data::{LearnableData, SyntheticData, shard};
use crate::engine::image_folder::{ImageFolder, ImageFolderError};
use crate::engine::{Arch, LrKind, LrSchedule, Model, Sgd, Tensor};

/// Errors of a training run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A setting that cannot work.
    #[error("{0}")]
    Settings(String),
    /// The all-reduce failed (a peer is gone).
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// Writing the checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// Reading images failed.
    #[error(transparent)]
    Images(#[from] ImageFolderError),
}

/// Networks `train` can build.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModelName {
    /// ResNet-18 (ImageNet topology).
    Resnet18,
    /// ResNet-34.
    Resnet34,
    /// ResNet-50.
    Resnet50,
    /// ResNet-101.
    Resnet101,
    /// ResNet-152.
    Resnet152,
    /// CIFAR ResNet-8 (for tests and small images).
    Cifar8,
    /// CIFAR ResNet-20.
    Cifar20,
}

/// Where the computation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// The CPU engine on all cores.
    Cpu,
    /// NVIDIA GPUs (cuDNN, cuBLAS, NCCL).
    Cuda,
}

/// Arithmetic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Precision {
    /// 32-bit floats.
    Fp32,
    /// bfloat16 with fp32 master weights (GPU only).
    Bf16,
}

/// Learning-rate schedule after warm-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Schedule {
    /// Cosine decay to zero.
    Cosine,
    /// ×0.1 every third of the run.
    Step,
    /// Constant.
    Constant,
}

/// Settings of `ringmaster-trainer train` (they mirror a TrainingJob's `trainer:` section).
#[derive(clap::Args, Clone, Debug)]
pub struct TrainArgs {
    /// The network.
    #[arg(long, value_enum, default_value_t = ModelName::Resnet50)]
    pub model: ModelName,
    /// Channels of the first stage of the CIFAR ResNets.
    #[arg(long, default_value_t = 16)]
    pub width: usize,
    /// How gradients are averaged over ranks.
    #[arg(long, value_enum, default_value_t = CollectiveKind::Auto, env = "RINGMASTER_COLLECTIVE")]
    pub collective: CollectiveKind,
    /// Where to compute.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// Arithmetic.
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub precision: Precision,
    /// Images per rank per step.
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// Split each rank's batch into this many micro-batches whose gradients are accumulated
    /// (batch norm sees each micro-batch alone, as separate ranks would).
    #[arg(long, default_value_t = 1)]
    pub micro_batches: usize,
    /// Side of the square images.
    #[arg(long, default_value_t = 224)]
    pub image_size: usize,
    /// Steps to train (exclusive with --epochs).
    #[arg(long, conflicts_with = "epochs")]
    pub steps: Option<usize>,
    /// Passes over the dataset.
    #[arg(long)]
    pub epochs: Option<usize>,
    /// Peak learning rate (default: 0.1 × global batch / 256).
    #[arg(long)]
    pub learning_rate: Option<f32>,
    /// Warm-up steps of the learning rate.
    #[arg(long, default_value_t = 0)]
    pub warmup_steps: usize,
    /// Schedule after warm-up.
    #[arg(long, value_enum, default_value_t = Schedule::Cosine)]
    pub schedule: Schedule,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f32,
    /// L2 weight decay.
    #[arg(long, default_value_t = 5e-5)]
    pub weight_decay: f32,
    /// Label smoothing of the cross-entropy.
    #[arg(long, default_value_t = 0.0)]
    pub label_smoothing: f32,
    /// Random images (the reference architecture's benchmark mode). The default.
    #[arg(long, conflicts_with_all = ["data_dir", "learnable_classes"])]
    pub synthetic: bool,
    /// An ImageNet-style folder of JPEG class folders.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// A generated dataset of this many classes that a small network can learn (tests, demos).
    #[arg(long)]
    pub learnable_classes: Option<usize>,
    /// Samples in the synthetic or generated dataset.
    #[arg(long, default_value_t = 4096)]
    pub dataset_size: usize,
    /// Classes of the synthetic data and the classifier (ImageNet: 1000).
    #[arg(long, default_value_t = 1000)]
    pub classes: usize,
    /// Seed of weights, data and shuffling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Folder for the checkpoint (`model.safetensors`) and nothing else.
    #[arg(long)]
    pub output_dir: Option<PathBuf>,
    /// Print a progress line every this many steps.
    #[arg(long, default_value_t = 10)]
    pub log_every: usize,
}

enum Source {
    Synthetic(SyntheticData),
    Learnable(LearnableData),
    Folder(ImageFolder),
}

impl Source {
    fn batch(
        &self,
        indices: &[usize],
        epoch: usize,
    ) -> Result<(Tensor, Vec<usize>), ImageFolderError> {
        match self {
            Source::Synthetic(d) => Ok(d.batch(indices)),
            Source::Learnable(d) => Ok(d.batch(indices)),
            Source::Folder(d) => d.batch(indices, epoch),
        }
    }
}

fn arch(args: &TrainArgs) -> Arch {
    match args.model {
        ModelName::Resnet18 => Arch::ResNet18,
        ModelName::Resnet34 => Arch::ResNet34,
        ModelName::Resnet50 => Arch::ResNet50,
        ModelName::Resnet101 => Arch::ResNet101,
        ModelName::Resnet152 => Arch::ResNet152,
        ModelName::Cifar8 => Arch::CifarResNet {
            depth: 8,
            width: args.width,
        },
        ModelName::Cifar20 => Arch::CifarResNet {
            depth: 20,
            width: args.width,
        },
    }
}

/// Trains on `collective`'s ranks; returns rank 0's summary.
pub fn run(
    args: &TrainArgs,
    collective: &mut dyn Collective,
) -> Result<serde_json::Value, TrainError> {
    if args.device == Device::Cuda {
        return Err(TrainError::Settings(
            "--device cuda: the CUDA engine is not in this build of ringmaster-trainer; use --device cpu".into(),
        ));
    }
    if args.precision == Precision::Bf16 {
        return Err(TrainError::Settings(
            "--precision bf16 needs the CUDA engine; the CPU engine computes in fp32".into(),
        ));
    }
    if args.micro_batches == 0 || !args.batch_size.is_multiple_of(args.micro_batches) {
        return Err(TrainError::Settings(format!(
            "--batch-size {} must be a multiple of --micro-batches {}",
            args.batch_size, args.micro_batches
        )));
    }
    let (rank, world) = (collective.rank(), collective.world_size());
    let (source, classes, dataset_size) = match (&args.data_dir, args.learnable_classes) {
        (Some(dir), _) => {
            let folder = ImageFolder::open(dir, args.image_size, args.seed)?;
            let (classes, len) = (folder.classes.len(), folder.len());
            (Source::Folder(folder), classes, len)
        }
        (None, Some(classes)) => (
            Source::Learnable(
                LearnableData::new(classes, args.image_size, args.seed).with_len(args.dataset_size),
            ),
            classes,
            args.dataset_size,
        ),
        (None, None) => (
            Source::Synthetic(SyntheticData::new(
                args.classes,
                args.image_size,
                args.dataset_size,
                args.seed,
            )),
            args.classes,
            args.dataset_size,
        ),
    };
    // Every rank emulates `micro_batches` ranks: micro-batch m of rank r is what rank
    // r·k+m of a k-times larger world would take, so k micro-batches on one rank and k
    // ranks of one micro-batch each see the same images.
    let shards = world * args.micro_batches;
    let micro = args.batch_size / args.micro_batches;
    let steps_per_epoch = (dataset_size / shards) / micro;
    if steps_per_epoch == 0 {
        return Err(TrainError::Settings(format!(
            "the dataset ({dataset_size} images) is smaller than one global batch ({world} ranks × {})",
            args.batch_size
        )));
    }
    let total_steps = match (args.steps, args.epochs) {
        (Some(steps), _) => steps,
        (None, Some(epochs)) => epochs * steps_per_epoch,
        (None, None) => 100,
    };
    let global_batch = args.batch_size * world;
    let schedule = LrSchedule {
        base_lr: args
            .learning_rate
            .unwrap_or(0.1 * global_batch as f32 / 256.0),
        warmup_steps: args.warmup_steps,
        total_steps,
        kind: match args.schedule {
            Schedule::Cosine => LrKind::Cosine,
            Schedule::Step => LrKind::Step {
                every: (total_steps / 3).max(1),
                gamma: 0.1,
            },
            Schedule::Constant => LrKind::Constant,
        },
    };

    let mut model = Model::new(arch(args), classes, args.seed);
    collective.broadcast(&mut model.params_mut().values, 0)?;
    let mut sgd = Sgd::new(model.params(), args.momentum, args.weight_decay);
    let started = Instant::now();
    let mut timed_from = None;
    let (mut loss, mut accuracy) = (f32::NAN, 0.0f32);
    // A thread reads and decodes the next batches while this one computes.
    let (batches, prefetched) = std::sync::mpsc::sync_channel(2 * args.micro_batches);
    std::thread::scope(|scope| -> Result<(), TrainError> {
        let source = &source;
        scope.spawn(move || {
            for step in 0..total_steps {
                let epoch = step / steps_per_epoch;
                let in_epoch = step % steps_per_epoch;
                for m in 0..args.micro_batches {
                    let indices = shard(
                        dataset_size,
                        rank * args.micro_batches + m,
                        shards,
                        epoch,
                        args.seed,
                    );
                    let batch =
                        source.batch(&indices[in_epoch * micro..(in_epoch + 1) * micro], epoch);
                    let failed = batch.is_err();
                    if batches.send(batch).is_err() || failed {
                        return;
                    }
                }
            }
        });
        for step in 0..total_steps {
            model.zero_grads();
            let (mut loss_sum, mut correct) = (0.0f32, 0usize);
            for _ in 0..args.micro_batches {
                let (images, labels) = prefetched
                    .recv()
                    .expect("the reader thread sends every batch or an error")?;
                let stats = model.forward_backward(
                    &images,
                    &labels,
                    args.label_smoothing,
                    1.0 / args.micro_batches as f32,
                );
                loss_sum += stats.loss;
                correct += stats.correct;
            }
            collective.all_reduce(&mut model.params_mut().grads, ReduceOp::Average)?;
            let lr = schedule.lr(step);
            sgd.step(model.params_mut(), lr);
            // Loss and accuracy over every rank, for the log.
            let mut totals = [loss_sum / args.micro_batches as f32, correct as f32];
            collective.all_reduce(&mut totals, ReduceOp::Sum)?;
            loss = totals[0] / world as f32;
            accuracy = totals[1] / global_batch as f32;
            if step == 0 {
                // The first step pays for allocation and warm-up: throughput counts from here.
                timed_from = Some((Instant::now(), 1));
            }
            let throughput = timed_from
                .filter(|(_, from)| step + 1 > *from)
                .map(|(t, from)| {
                    ((step + 1 - from) * global_batch) as f64 / t.elapsed().as_secs_f64()
                });
            if rank == 0 && (step % args.log_every.max(1) == 0 || step + 1 == total_steps) {
                println!(
                    "{}",
                    json!({"event": "step", "step": step + 1, "loss": loss, "accuracy": accuracy,
                           "learningRate": lr, "imagesPerSecond": throughput})
                );
            }
        }
        Ok(())
    })?;
    let images_per_second = match timed_from {
        Some((t, from)) if total_steps > from => {
            ((total_steps - from) * global_batch) as f64 / t.elapsed().as_secs_f64()
        }
        _ => (total_steps * global_batch) as f64 / started.elapsed().as_secs_f64(),
    };
    if rank == 0
        && let Some(dir) = &args.output_dir
    {
        std::fs::create_dir_all(dir)
            .map_err(|e| TrainError::Settings(format!("creating {}: {e}", dir.display())))?;
        let metadata = BTreeMap::from([
            ("model".to_string(), format!("{:?}", args.model)),
            ("steps".to_string(), total_steps.to_string()),
            ("worldSize".to_string(), world.to_string()),
        ]);
        checkpoint::save(&dir.join("model.safetensors"), model.params(), &metadata)?;
    }
    Ok(json!({
        "event": "summary",
        "imagesPerSecond": images_per_second,
        "steps": total_steps,
        "finalLoss": loss,
        "finalAccuracy": accuracy,
        "worldSize": world,
        "globalBatch": global_batch,
        "parameters": model.num_parameters(),
        "seconds": started.elapsed().as_secs_f64(),
    }))
}
