//! `train`: data-parallel SGD over the ranks of the job. Every rank builds the same model from
//! the same seed (rank 0's weights are broadcast anyway), takes its shard of each global
//! batch, computes gradients, averages them with all-reduce, and steps. Rank 0 prints
//! JSON-lines progress and a final summary, and writes the checkpoint.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use ringmaster_contract::trainer::{
    Capabilities, DeviceChoice, Fabric, Line, MODEL_FILE, Progress, SettingsError, Summary, exit,
};
pub use ringmaster_contract::trainer::{
    Device, Model as ModelName, Precision, Schedule, TrainArgs,
};

use crate::collective::{Collective, CollectiveError, ReduceOp, overlap};
use crate::engine::backend::{CudaBackend, CudaError};
use crate::engine::buckets::{BUCKET_ELEMENTS, GradientBuckets};
use crate::engine::checkpoint::{self, CheckpointError};
use crate::engine::data::{LearnableData, SyntheticData, shard};
use crate::engine::image_folder::{ImageFolder, ImageFolderError};
use crate::engine::step::{self, RecordedStep};
use crate::engine::tensor::DType;
use crate::engine::{
    Arch, Backend, CpuBackend, LrKind, LrSchedule, Model, ParamStore, Sgd, Tensor,
};
use crate::resume::{self, Checkpointer, Identity, ResumeError};

/// Errors of a training run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Settings the trainer cannot run (the same check the operator runs on a TrainingJob).
    #[error("invalid settings: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    InvalidSettings(Vec<SettingsError>),
    /// A setting that cannot work with this world or dataset.
    #[error("{0}")]
    Settings(String),
    /// The all-reduce failed (a peer is gone).
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// Writing the checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The run's checkpoint is there but training cannot go on from it.
    #[error(transparent)]
    Resume(#[from] ResumeError),
    /// Reading images failed.
    #[error(transparent)]
    Images(#[from] ImageFolderError),
    /// The CUDA engine could not start on this rank's GPU.
    #[error("the CUDA engine on GPU {ordinal}: {source}")]
    Cuda {
        /// The GPU (the local rank).
        ordinal: usize,
        #[source]
        source: CudaError,
    },
    /// The output folder could not be made.
    #[error("creating {path}: {source}")]
    OutputDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl TrainError {
    /// The process's exit code for this error ([`exit`]): a lost peer can be retried by
    /// restarting the gang, invalid settings cannot.
    pub fn exit_code(&self) -> u8 {
        match self {
            TrainError::InvalidSettings(_) | TrainError::Settings(_) => exit::INVALID_SETTINGS,
            TrainError::Collective(e) | TrainError::Resume(ResumeError::Collective(e))
                if e.is_peer_lost() =>
            {
                exit::PEER_LOST
            }
            _ => exit::FAILED,
        }
    }
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

/// Trains on `collective`'s ranks, on GPU `gpu_ordinal` (the local rank) when the device
/// is CUDA; returns rank 0's summary.
pub fn run(
    args: &TrainArgs,
    collective: &mut dyn Collective,
    gpu_ordinal: usize,
) -> Result<Summary, TrainError> {
    let capabilities = &Capabilities::this_release();
    // The operator ran this same check on the TrainingJob; a hand-written command meets it here.
    args.check(capabilities)
        .map_err(TrainError::InvalidSettings)?;
    let (device, reason) =
        crate::gpu::resolve_device(args.device, capabilities, crate::gpu::GpuProbe::detect);
    let dtype = match args.precision {
        Precision::Fp32 => DType::F32,
        Precision::Bf16 => DType::Bf16,
    };
    if collective.rank() == 0 {
        let line = Line::Device(DeviceChoice {
            requested: args.device,
            device,
            reason: reason.clone(),
        });
        println!(
            "{}",
            serde_json::to_string(&line).expect("a line serializes")
        );
    }
    match device {
        Device::Cuda => {
            let be = CudaBackend::new(gpu_ordinal, None).map_err(|source| TrainError::Cuda {
                ordinal: gpu_ordinal,
                source,
            })?;
            train_on(args, collective, be, dtype)
        }
        // The check refuses bf16 on `cpu`: only `auto` that found no usable GPU gets here.
        Device::Cpu if dtype == DType::Bf16 => Err(TrainError::Settings(format!(
            "--precision bf16 computes on the CUDA engine only, and --device auto computes on the CPU here: {}",
            reason.as_deref().unwrap_or("no usable GPU")
        ))),
        // `resolve_device` turns `auto` into one of the others.
        Device::Cpu | Device::Auto => train_on(args, collective, CpuBackend, dtype),
    }
}

/// The training loop on backend `be` with activations in `dtype`.
fn train_on<B: Backend>(
    args: &TrainArgs,
    collective: &mut dyn Collective,
    be: B,
    dtype: DType,
) -> Result<Summary, TrainError> {
    if !be.supports(dtype) {
        return Err(TrainError::Settings(format!(
            "the {} engine does not compute in {:?}",
            be.name(),
            args.precision
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
        (None, None) => ringmaster_contract::trainer::defaults::STEPS,
    };
    let global_batch = args.batch_size * world;
    let schedule = LrSchedule {
        base_lr: args
            .learning_rate
            .unwrap_or_else(|| ringmaster_contract::trainer::scaled_learning_rate(global_batch)),
        warmup_steps: warmup_steps(args, steps_per_epoch, total_steps, global_batch),
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

    let mut model = Model::with_backend(
        Arch::of(args.model, args.width),
        classes,
        args.seed,
        be.clone(),
    )
    .with_activations(dtype);
    let mut sgd = Sgd::on(&be, model.params(), args.momentum, args.weight_decay);
    // A run that started before goes on from its checkpoint.
    let identity = Identity::of(args, classes, global_batch, total_steps);
    let start_step = resume::restore(args, &identity, &be, &mut model, &mut sgd, collective)?;
    // The collectives work on host memory (a device backend stages through it).
    be.with_host(&mut model.params_mut().values, |values| {
        collective.broadcast(values, 0)
    })?;
    // Micro-batch m of this rank stands for a rank of a world `micro_batches` times larger
    // (see the shards above), and each rank keeps batch-norm statistics of its own: so
    // does each micro-batch. The model's own, which are saved, are micro-batch 0's, as a
    // world saves rank 0's; the others are copies taken here (after a resume: of rank 0's
    // checkpoint, as every rank takes).
    let mut micro_batch_statistics: Vec<B::Buf> = (1..args.micro_batches)
        .map(|_| statistics_copy(&be, model.params()))
        .collect();
    let mut checkpointer = Checkpointer::new(args, &identity, rank);
    let started = Instant::now();
    let mut timed_from = None;
    let (mut loss, mut accuracy) = (f32::NAN, 0.0f32);
    // A thread reads and decodes the next batches while this one computes.
    let (batches, prefetched) = std::sync::mpsc::sync_channel(2 * args.micro_batches);
    let trained = std::thread::scope(|scope| -> Result<(), TrainError> {
        let source = &source;
        scope.spawn(move || {
            for step in start_step..total_steps {
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
        // On GPUs with NCCL, gradients are all-reduced in buckets while backward still runs;
        // otherwise all at once after it, through the host. One rank reduces nothing.
        let overlap = world > 1 && be.reduces_on_device(collective);
        let num_parameters = model.num_parameters();
        // With RINGMASTER_CUDA_GRAPH=1, a step of one micro-batch whose gradients are not
        // all-reduced during backward is recorded once warm and replayed.
        let mut recorded = (step::recording_requested() && args.micro_batches == 1 && !overlap)
            .then(|| RecordedStep::new(&model, micro, args.image_size, true));
        // Dropped with this closure, on any return or panic, so a reader blocked on a full
        // channel stops and the scope can end.
        let prefetched = prefetched;
        let receive = || {
            prefetched
                .recv()
                .expect("the reader thread sends every batch or an error")
        };
        // Each batch goes onto the device while the one before it still computes, before the
        // host waits for that one's loss: on CUDA its copy runs beside the step, and the
        // conversion queues behind it. The first is received before the loop. A batch the
        // source failed to make is an error when its turn comes, after the step before
        // finished (its all-reduces joined, its update made, its line logged).
        let mut upcoming = Some(receive());
        let mut on_device: Option<(Tensor<B>, Vec<usize>)> = None;
        for step in start_step..total_steps {
            let last_step = step + 1 == total_steps;
            // The first step searches cuDNN's algorithms as its layers first run (the
            // backward halves during backward): its gradients are reduced after it, so the
            // searches time the GPU without all-reduces beside them.
            let overlap_now = overlap && step > start_step;
            let (mut loss_sum, mut correct) = (0.0f32, 0usize);
            if let Some(recorded) = &mut recorded {
                if let Some(batch) = upcoming.take() {
                    let (images, labels) = batch?;
                    recorded.load(&model, &images, &labels);
                }
                let replayed_before = recorded.recorded();
                recorded.run(&mut model, args.label_smoothing);
                if rank == 0 && !replayed_before && recorded.recorded() {
                    eprintln!(
                        "ringmaster-trainer: step {} recorded as a CUDA graph; replayed from here on",
                        step + 1
                    );
                }
                if !last_step {
                    // Into the step's own inputs: the device reads them in order.
                    match receive() {
                        Ok((images, labels)) => recorded.load(&model, &images, &labels),
                        failed => upcoming = Some(failed),
                    }
                }
                let stats = recorded.stats(&model);
                (loss_sum, correct) = (stats.loss, stats.correct);
            } else {
                model.zero_grads();
                for m in 0..args.micro_batches {
                    let (images, labels) = match (on_device.take(), upcoming.take()) {
                        (Some(uploaded), _) => uploaded,
                        (None, Some(batch)) => {
                            let (images, labels) = batch?;
                            (Tensor::upload(&be, &images, dtype), labels)
                        }
                        (None, None) => unreachable!("every micro-batch is received ahead"),
                    };
                    // Micro-batches accumulate: only the last one's backward finishes gradients.
                    let mut buckets = (overlap_now && m + 1 == args.micro_batches)
                        .then(|| GradientBuckets::new(num_parameters, BUCKET_ELEMENTS));
                    let mut failed = Ok(());
                    if let Some(own) = m.checked_sub(1).map(|i| &mut micro_batch_statistics[i]) {
                        std::mem::swap(&mut model.params_mut().buffers, own);
                    }
                    let queued = model.queue_step(
                        &images,
                        &labels,
                        args.label_smoothing,
                        1.0 / args.micro_batches as f32,
                        &mut |be, grads, final_from| {
                            if let Some(range) = buckets.as_mut().and_then(|b| b.ready(final_from))
                                && failed.is_ok()
                            {
                                failed = be.queue_all_reduce(
                                    grads,
                                    range,
                                    &mut *collective,
                                    ReduceOp::Average,
                                );
                            }
                        },
                    );
                    // The step's statistics updates are queued: micro-batch 0's go back.
                    if let Some(own) = m.checked_sub(1).map(|i| &mut micro_batch_statistics[i]) {
                        std::mem::swap(&mut model.params_mut().buffers, own);
                    }
                    failed?;
                    if !(last_step && m + 1 == args.micro_batches) {
                        match receive() {
                            Ok((images, labels)) => {
                                on_device = Some((Tensor::upload(&be, &images, dtype), labels));
                            }
                            failed => upcoming = Some(failed),
                        }
                    }
                    let stats = model.stats_of(queued);
                    debug_assert!(buckets.is_none_or(|b| b.done()));
                    loss_sum += stats.loss;
                    correct += stats.correct;
                }
            }
            let mut all_reduce_timing = None;
            if overlap {
                if !overlap_now {
                    let grads = &mut model.params_mut().grads;
                    be.queue_all_reduce(grads, 0..num_parameters, collective, ReduceOp::Average)?;
                }
                be.join_all_reduces(collective)?;
                all_reduce_timing = collective
                    .on_device()
                    .and_then(|d| overlap::timing((step + 1) as u64, &d.last_buckets()));
            } else if world > 1 {
                let grads = &mut model.params_mut().grads;
                be.queue_all_reduce(grads, 0..num_parameters, collective, ReduceOp::Average)?;
            }
            let lr = schedule.lr(step);
            sgd.step(model.params_mut(), lr);
            // Loss and accuracy over every rank, for the log.
            let mut totals = [loss_sum / args.micro_batches as f32, correct as f32];
            collective.all_reduce(&mut totals, ReduceOp::Sum)?;
            loss = totals[0] / world as f32;
            accuracy = totals[1] / global_batch as f32;
            if step == start_step {
                // The first step pays for allocation and warm-up: throughput counts from here.
                timed_from = Some((Instant::now(), step + 1));
                // Its all-reduce connected NCCL's channels: say which fabric they took.
                if world > 1 {
                    report_fabric(collective, rank, world)?;
                }
            }
            let throughput = timed_from
                .filter(|(_, from)| step + 1 > *from)
                .map(|(t, from)| {
                    ((step + 1 - from) * global_batch) as f64 / t.elapsed().as_secs_f64()
                });
            if rank == 0 && (step % args.log_every.max(1) == 0 || step + 1 == total_steps) {
                let line = Line::Step(Progress {
                    step: (step + 1) as u64,
                    loss: finite(loss),
                    accuracy: finite(accuracy),
                    learning_rate: f64::from(lr),
                    images_per_second: throughput,
                });
                println!(
                    "{}",
                    serde_json::to_string(&line).expect("a line serializes")
                );
                if let Some(timing) = all_reduce_timing {
                    let line = Line::AllReduce(timing);
                    println!(
                        "{}",
                        serde_json::to_string(&line).expect("a line serializes")
                    );
                }
            }
            if let Some(checkpointer) = &mut checkpointer
                && checkpointer.due(step + 1, total_steps)
            {
                checkpointer.write(step + 1, &be, &model, &sgd);
            }
        }
        Ok(())
    });
    // A checkpoint being written is finished, also when training failed: the run that
    // starts again goes on from it.
    if let Some(checkpointer) = &mut checkpointer {
        checkpointer.finish_writing();
    }
    trained?;
    let images_per_second = match timed_from {
        Some((t, from)) if total_steps > from => {
            ((total_steps - from) * global_batch) as f64 / t.elapsed().as_secs_f64()
        }
        _ => ((total_steps - start_step) * global_batch) as f64 / started.elapsed().as_secs_f64(),
    };
    // To a tenth: the job's status and `kubectl get` show it as it is, and the digits past
    // that are noise.
    let images_per_second = (images_per_second * 10.0).round() / 10.0;
    if rank == 0
        && let Some(dir) = &args.output_dir
    {
        std::fs::create_dir_all(dir).map_err(|source| TrainError::OutputDir {
            path: dir.clone(),
            source,
        })?;
        let metadata = BTreeMap::from([
            ("model".to_string(), format!("{:?}", args.model)),
            ("steps".to_string(), total_steps.to_string()),
            ("worldSize".to_string(), world.to_string()),
        ]);
        let params = model.params().weights_to_host(&be);
        checkpoint::save(&dir.join(MODEL_FILE), &params, &metadata)?;
    }
    Ok(Summary {
        images_per_second,
        steps: total_steps as u64,
        final_loss: finite(loss),
        final_accuracy: finite(accuracy),
        world_size: world as u64,
        global_batch: global_batch as u64,
        parameters: model.num_parameters() as u64,
        seconds: started.elapsed().as_secs_f64(),
        resumed_from_step: (start_step > 0).then_some(start_step as u64),
    })
}

/// Rank 0 says which fabric carries the gradients ([`Line::Fabric`]): its NCCL's network
/// and transports, and how many ranks' NCCL uses InfiniBand (every rank takes part).
fn report_fabric(
    collective: &mut dyn Collective,
    rank: usize,
    world: usize,
) -> Result<(), CollectiveError> {
    let seen = collective.fabric();
    let mut on_infiniband = [f32::from(u8::from(
        seen.as_ref().is_some_and(|s| s.on_infiniband()),
    ))];
    collective.all_reduce(&mut on_infiniband, ReduceOp::Sum)?;
    if rank == 0 {
        let seen = seen.unwrap_or_default();
        let line = Line::Fabric(Fabric {
            collective: collective.name().to_string(),
            network: seen.network,
            transports: seen.transports.into_iter().collect(),
            gpu_direct_rdma: seen.gpu_direct_rdma,
            ranks_on_infiniband: on_infiniband[0] as u64,
            world_size: world as u64,
        });
        println!(
            "{}",
            serde_json::to_string(&line).expect("a line serializes")
        );
    }
    Ok(())
}

/// A copy of the batch-norm statistics in memory of its own (a device buffer's clone
/// shares its memory).
fn statistics_copy<B: Backend>(be: &B, params: &ParamStore<B>) -> B::Buf {
    let len = params.num_buffer_values();
    be.upload(&be.download(&params.buffers, &[len]), &[len], DType::F32)
}

/// A number for the JSON lines; NaN and infinities (a diverged run) are `null`.
fn finite(value: f32) -> Option<f64> {
    value.is_finite().then_some(f64::from(value))
}

/// The learning rate's warm-up in steps: `--warmup-epochs` passes over the dataset when given
/// (rounded, at least one step), else `--warmup-steps` when given; never past the end of
/// training. Neither given: Goyal et al.'s 5 epochs for a global batch above 256 (the linear
/// scaling rule's other half), at most a fifth of the run so the schedule still decays.
pub fn warmup_steps(
    args: &TrainArgs,
    steps_per_epoch: usize,
    total_steps: usize,
    global_batch: usize,
) -> usize {
    use ringmaster_contract::trainer::defaults::{
        WARMUP_ABOVE_BATCH, WARMUP_EPOCHS, WARMUP_MAX_SHARE,
    };
    let in_steps = |epochs: f32| ((epochs * steps_per_epoch as f32).round() as usize).max(1);
    let steps = match args.warmup_epochs {
        Some(epochs) if epochs > 0.0 => in_steps(epochs),
        Some(_) => 0,
        None if args.warmup_steps > 0 => args.warmup_steps,
        None if global_batch > WARMUP_ABOVE_BATCH => {
            in_steps(WARMUP_EPOCHS).min(total_steps / WARMUP_MAX_SHARE)
        }
        None => 0,
    };
    steps.min(total_steps)
}
