//! `train`: data-parallel SGD over the ranks of the job. Every rank builds the same model from
//! the same seed (rank 0's weights are broadcast anyway), takes its shard of each global
//! batch, computes gradients, averages them with all-reduce, and steps. Rank 0 prints
//! JSON-lines progress and a final summary, and writes the checkpoint.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, SyncSender};
use std::time::Instant;

use ringmaster_contract::trainer::{
    AllReduceTiming, Capabilities, DeviceChoice, Fabric, Line, MODEL_FILE, Progress, SettingsError,
    Summary, exit,
};
pub use ringmaster_contract::trainer::{
    Decoder, Device, Model as ModelName, Precision, Schedule, TrainArgs,
};

use crate::collective::{Collective, CollectiveError, ReduceOp, overlap};
use crate::engine::backend::{CudaBackend, CudaError};
use crate::engine::buckets::{BUCKET_ELEMENTS, GradientBuckets};
use crate::engine::checkpoint::{self, CheckpointError};
use crate::engine::data::{LearnableData, SyntheticData, shard};
use crate::engine::image_folder::gpu::{
    DeviceImages, GpuLoader, GpuLoaderError, decode_threads_from_env,
};
use crate::engine::image_folder::{BatchBuffers, ImageFolder, ImageFolderError};
use crate::engine::step::{self, RecordedStep};
use crate::engine::tensor::DType;
use crate::engine::{
    Arch, Backend, CpuBackend, LrKind, LrSchedule, Model, ParamStore, QueuedStats, Sgd, StepStats,
    Tensor,
};
use crate::preflight::{self, PreflightError};
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
    /// Decoding images on the GPU failed, or could not start.
    #[error("the GPU loader: {0}")]
    GpuLoader(#[from] GpuLoaderError),
    /// The CUDA engine could not start on this rank's GPU.
    #[error("the CUDA engine on GPU {ordinal}: {source}")]
    Cuda {
        /// The GPU (the local rank).
        ordinal: usize,
        #[source]
        source: CudaError,
    },
    /// The preflight found the fabric too slow, or could not measure it.
    #[error(transparent)]
    Preflight(#[from] PreflightError),
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
            TrainError::Preflight(e) => e.exit_code(),
            TrainError::Collective(e) | TrainError::Resume(ResumeError::Collective(e))
                if e.is_peer_lost() =>
            {
                exit::PEER_LOST
            }
            _ => exit::FAILED,
        }
    }
}

/// The images a run trains on, and what it knows of them.
struct Dataset {
    images: Source,
    classes: usize,
    len: usize,
}

enum Source {
    Synthetic(SyntheticData),
    Learnable(LearnableData),
    Folder(ImageFolder),
}

impl Dataset {
    /// The images `args` name: a folder (`--data-dir`), learnable synthetic classes
    /// (`--learnable-classes`), or random images.
    fn open(args: &TrainArgs) -> Result<Self, TrainError> {
        Ok(match (&args.data_dir, args.learnable_classes) {
            (Some(dir), _) => {
                let folder = ImageFolder::open(dir, args.image_size, args.seed)?;
                let (classes, len) = (folder.classes.len(), folder.len());
                Self {
                    images: Source::Folder(folder),
                    classes,
                    len,
                }
            }
            (None, Some(classes)) => Self {
                images: Source::Learnable(
                    LearnableData::new(classes, args.image_size, args.seed)
                        .with_len(args.dataset_size),
                ),
                classes,
                len: args.dataset_size,
            },
            (None, None) => Self {
                images: Source::Synthetic(SyntheticData::new(
                    args.classes,
                    args.image_size,
                    args.dataset_size,
                    args.seed,
                )),
                classes: args.classes,
                len: args.dataset_size,
            },
        })
    }

    /// The images of `indices` in `epoch`, made on the CPU (the GPU loader's batches are
    /// [`read_ahead_into_gpu`]'s).
    fn batch(&self, indices: &[usize], epoch: usize) -> ReadBatch {
        let host = |batch: (Tensor, Vec<usize>)| (Images::Host(batch.0, None), batch.1);
        match &self.images {
            Source::Synthetic(d) => Ok(host(d.batch(indices))),
            Source::Learnable(d) => Ok(host(d.batch(indices))),
            Source::Folder(d) => {
                let (images, labels) = d.batch(indices, epoch)?;
                Ok((Images::Host(images, Some(d.buffers())), labels))
            }
        }
    }

    /// The GPU loader for this run, when its images are a folder, it trains on GPU
    /// `gpu` (`None`: on the CPU) and `--decoder` lets it; `auto` falls back to the CPUs
    /// when nvJPEG cannot start, and rank 0 says which it uses.
    fn gpu_loader(
        &self,
        args: &TrainArgs,
        gpu: Option<usize>,
        rank: usize,
    ) -> Result<Option<GpuLoader>, TrainError> {
        let Source::Folder(folder) = &self.images else {
            return Ok(None);
        };
        let say = |what: String| {
            if rank == 0 {
                eprintln!("ringmaster-trainer: decoding JPEGs {what}");
            }
        };
        match (gpu, args.decoder) {
            (_, Decoder::Cpu) => Ok(None),
            (None, Decoder::Nvjpeg) => Err(TrainError::Settings(
                "--decoder nvjpeg decodes on the GPU, and this run trains on the CPU".into(),
            )),
            (None, Decoder::Auto) => Ok(None),
            (Some(ordinal), decoder) => {
                // A wrong setting is an error even where `auto` would fall back.
                let decode_threads =
                    decode_threads_from_env().map_err(|e| TrainError::Settings(e.to_string()))?;
                match this_program().and_then(|program| {
                    GpuLoader::probed(folder.clone(), ordinal, &program, decode_threads)
                }) {
                    Ok(loader) => {
                        say(format!("on the GPU ({})", loader.describe()));
                        Ok(Some(loader))
                    }
                    Err(e) if decoder == Decoder::Auto => {
                        say(format!("on the CPUs: {e}"));
                        Ok(None)
                    }
                    Err(e) => Err(e.into()),
                }
            }
        }
    }
}

/// This trainer's executable, for the GPU loader's probe.
fn this_program() -> Result<PathBuf, GpuLoaderError> {
    std::env::current_exe().map_err(GpuLoaderError::ThisProgram)
}

/// A batch's images, as the reader thread makes them: NCHW on the host (with where its
/// memory goes back once uploaded), or on the GPU (decoded there by nvJPEG).
enum Images {
    Host(Tensor, Option<BatchBuffers>),
    Device(DeviceImages),
}

/// Hands `images` back to `buffers`, if they came from there, once uploaded.
fn uploaded(images: Tensor, buffers: Option<BatchBuffers>) {
    if let Some(buffers) = buffers {
        buffers.give_back(images);
    }
}

impl Images {
    /// On `be`'s device as `dtype`.
    fn upload<B: Backend>(self, be: &B, dtype: DType) -> Tensor<B> {
        match self {
            Images::Host(images, buffers) => {
                let on_device = Tensor::upload(be, &images, dtype);
                uploaded(images, buffers);
                on_device
            }
            Images::Device(mut images) => {
                let mut data = be.zeros(images.shape.iter().product(), dtype);
                be.upload_device_images_into(&mut images, &mut data);
                Tensor {
                    shape: images.shape.to_vec(),
                    dtype,
                    data,
                }
            }
        }
    }
}

/// A batch as the reader thread makes it: its images and their labels, or why the source
/// could not make it.
type ReadBatch = Result<(Images, Vec<usize>), TrainError>;

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
        print_line(&line);
    }
    // Before the model and the data: a fabric too slow for the job stops it in seconds.
    if let Some(preflight) = preflight::run(args, collective)? {
        if collective.rank() == 0 {
            print_line(&Line::Preflight(preflight.clone()));
        }
        preflight::verdict(preflight)?;
    }
    match device {
        Device::Cuda => {
            let be = CudaBackend::new(gpu_ordinal, None).map_err(|source| TrainError::Cuda {
                ordinal: gpu_ordinal,
                source,
            })?;
            train_on(args, collective, be, dtype, Some(gpu_ordinal))
        }
        // The check refuses bf16 on `cpu`: only `auto` that found no usable GPU gets here.
        Device::Cpu if dtype == DType::Bf16 => Err(TrainError::Settings(format!(
            "--precision bf16 computes on the CUDA engine only, and --device auto computes on the CPU here: {}",
            reason.as_deref().unwrap_or("no usable GPU")
        ))),
        // `resolve_device` turns `auto` into one of the others.
        Device::Cpu | Device::Auto => train_on(args, collective, CpuBackend, dtype, None),
    }
}

/// The training loop on backend `be` with activations in `dtype`; `gpu`: its GPU, where
/// the JPEGs may be decoded too.
fn train_on<B: Backend>(
    args: &TrainArgs,
    collective: &mut dyn Collective,
    be: B,
    dtype: DType,
    gpu: Option<usize>,
) -> Result<Summary, TrainError> {
    if !be.supports(dtype) {
        return Err(TrainError::Settings(format!(
            "the {} engine does not compute in {:?}",
            be.name(),
            args.precision
        )));
    }
    let dataset = Dataset::open(args)?;
    let loader = dataset.gpu_loader(args, gpu, collective.rank())?;
    let mut trainer = Trainer::new(args, collective, be, dtype, &dataset)?;
    let trained = trainer.train(&dataset, loader);
    // A checkpoint being written is finished, also when training failed: the run that
    // starts again goes on from it.
    if let Some(checkpointer) = &mut trainer.checkpointer {
        checkpointer.finish_writing();
    }
    trained?;
    trainer.finish()
}

/// How a run divides its dataset: among the ranks, each rank's micro-batches, and steps.
#[derive(Clone, Copy, Debug)]
struct Layout {
    rank: usize,
    world: usize,
    micro_batches: usize,
    /// Images in one micro-batch.
    micro: usize,
    /// What the dataset is sharded into each epoch: a shard per micro-batch of every rank.
    shards: usize,
    dataset_size: usize,
    steps_per_epoch: usize,
    total_steps: usize,
    /// Images in one step over every rank.
    global_batch: usize,
}

impl Layout {
    /// The layout of a run of `args` as rank `rank` of `world` over `dataset_size` images;
    /// an error when one global batch is more than the dataset.
    fn new(
        args: &TrainArgs,
        rank: usize,
        world: usize,
        dataset_size: usize,
    ) -> Result<Self, TrainError> {
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
        Ok(Self {
            rank,
            world,
            micro_batches: args.micro_batches,
            micro,
            shards,
            dataset_size,
            steps_per_epoch,
            total_steps,
            global_batch: args.batch_size * world,
        })
    }
}

/// The learning rate over the run: `--learning-rate`, else the linear scaling rule's for
/// the global batch; warmed up ([`warmup_steps`]), then decayed as `--schedule` says.
fn schedule(args: &TrainArgs, layout: &Layout) -> LrSchedule {
    let total_steps = layout.total_steps;
    LrSchedule {
        base_lr: args.learning_rate.unwrap_or_else(|| {
            ringmaster_contract::trainer::scaled_learning_rate(layout.global_batch)
        }),
        warmup_steps: warmup_steps(
            args,
            layout.steps_per_epoch,
            total_steps,
            layout.global_batch,
        ),
        total_steps,
        kind: match args.schedule {
            Schedule::Cosine => LrKind::Cosine,
            Schedule::Step => LrKind::Step {
                every: (total_steps / 3).max(1),
                gamma: 0.1,
            },
            Schedule::Constant => LrKind::Constant,
        },
    }
}

/// The reader thread: this rank's micro-batches of every step from `start_step` on, in
/// order, into `batches`. Stops after the first batch the source fails to make (its error
/// sent), or when the trainer has dropped the receiving end.
fn read_batches(
    dataset: &Dataset,
    args: &TrainArgs,
    layout: Layout,
    start_step: usize,
    batches: SyncSender<ReadBatch>,
    gpu: Option<GpuLoader>,
) {
    let order = micro_batches(layout, args.seed, start_step);
    let send = |batch: ReadBatch| {
        let failed = batch.is_err();
        batches.send(batch).is_ok() && !failed
    };
    match (&dataset.images, gpu) {
        (Source::Folder(folder), Some(mut loader)) => {
            read_ahead_into_gpu(folder, &mut loader, order, send)
        }
        _ => {
            for (indices, epoch) in order {
                if !send(dataset.batch(&indices, epoch)) {
                    return;
                }
            }
        }
    }
}

/// The indices and epoch of this rank's micro-batches, step by step from `start_step`.
fn micro_batches(
    layout: Layout,
    seed: u64,
    start_step: usize,
) -> impl Iterator<Item = (Vec<usize>, usize)> {
    (start_step..layout.total_steps).flat_map(move |step| {
        let epoch = step / layout.steps_per_epoch;
        let in_epoch = step % layout.steps_per_epoch;
        (0..layout.micro_batches).map(move |m| {
            let indices = shard(
                layout.dataset_size,
                layout.rank * layout.micro_batches + m,
                layout.shards,
                epoch,
                seed,
            );
            let micro = layout.micro;
            (
                indices[in_epoch * micro..(in_epoch + 1) * micro].to_vec(),
                epoch,
            )
        })
    })
}

/// The GPU loader's batches of `order` into `send` (which says whether to go on), each
/// batch's files read while the GPU decodes the one before.
fn read_ahead_into_gpu(
    folder: &ImageFolder,
    loader: &mut GpuLoader,
    order: impl Iterator<Item = (Vec<usize>, usize)>,
    send: impl Fn(ReadBatch) -> bool,
) {
    let mut order = order.peekable();
    let mut files = order.peek().map(|(indices, _)| folder.read_files(indices));
    while let Some((indices, epoch)) = order.next() {
        let (batch, next_files) = match files.take().expect("each batch's files are read ahead") {
            Ok(these) => {
                let next = order.peek().map(|(indices, _)| indices.as_slice());
                let (batch, next_files) = loader.decode_reading_next(&indices, epoch, these, next);
                (batch.map_err(TrainError::from), next_files)
            }
            Err(e) => (Err(e.into()), None),
        };
        files = next_files;
        let batch = batch.map(|batch| (Images::Device(batch.images), batch.labels));
        if !send(batch) {
            return;
        }
    }
}

/// The batches on their way to the steps. Each goes onto the device while the one before
/// it still computes, before the host waits for that one's loss: on CUDA its copy runs
/// beside the step, and the conversion queues behind it. The first is received before the
/// first step. A batch the source failed to make is an error when its turn comes, after
/// the step before finished (its all-reduces joined, its update made, its line logged).
struct Feed<B: Backend> {
    /// From the reader thread. Dropped with the feed, on any return or panic, so a reader
    /// blocked on a full channel stops and the thread scope can end.
    prefetched: Receiver<ReadBatch>,
    /// Received, not yet on the device: the first batch, or a failure waiting for its turn.
    upcoming: Option<ReadBatch>,
    /// On the device, for the next micro-batch.
    on_device: Option<(Tensor<B>, Vec<usize>)>,
}

impl<B: Backend> Feed<B> {
    /// The feed from `prefetched`, with its first batch received.
    fn new(prefetched: Receiver<ReadBatch>) -> Self {
        let mut feed = Self {
            prefetched,
            upcoming: None,
            on_device: None,
        };
        feed.upcoming = Some(feed.receive());
        feed
    }

    fn receive(&self) -> ReadBatch {
        self.prefetched
            .recv()
            .expect("the reader thread sends every batch or an error")
    }

    /// The next batch the source made; a failure is kept for its turn (`None`).
    fn next_received(&mut self) -> Option<(Images, Vec<usize>)> {
        match self.receive() {
            Ok(batch) => Some(batch),
            failed => {
                self.upcoming = Some(failed);
                None
            }
        }
    }

    /// The micro-batch whose turn it is, on the device: uploaded ahead, or now.
    fn next_on_device(
        &mut self,
        be: &B,
        dtype: DType,
    ) -> Result<(Tensor<B>, Vec<usize>), TrainError> {
        Ok(match (self.on_device.take(), self.upcoming.take()) {
            (Some(uploaded), _) => uploaded,
            (None, Some(batch)) => {
                let (images, labels) = batch?;
                (images.upload(be, dtype), labels)
            }
            (None, None) => unreachable!("every micro-batch is received ahead"),
        })
    }

    /// Receives the next micro-batch and queues its upload.
    fn upload_next(&mut self, be: &B, dtype: DType) {
        if let Some((images, labels)) = self.next_received() {
            self.on_device = Some((images.upload(be, dtype), labels));
        }
    }
}

/// A batch into the recorded step's inputs.
fn load<B: Backend>(
    recorded: &mut RecordedStep<B>,
    model: &Model<B>,
    images: Images,
    labels: &[usize],
) {
    match images {
        Images::Host(images, buffers) => {
            recorded.load(model, &images, labels);
            uploaded(images, buffers);
        }
        Images::Device(mut images) => recorded.load_device(model, &mut images, labels),
    }
}

/// A training run on one rank: the model, its optimizer and everything a step needs.
///
/// Fields drop in their order: the recorded step (a CUDA graph and its buffers) goes before
/// the model, the optimizer and the backend whose kernels and memory it uses.
struct Trainer<'a, B: Backend> {
    /// The step recorded (as a CUDA graph) and replayed, when it is.
    recorded: Option<RecordedStep<B>>,
    args: &'a TrainArgs,
    collective: &'a mut dyn Collective,
    be: B,
    dtype: DType,
    layout: Layout,
    schedule: LrSchedule,
    model: Model<B>,
    sgd: Sgd<B>,
    /// The step training starts from (after a resume: the checkpoint's).
    start_step: usize,
    /// The earlier run (`--resume-from`) whose checkpoint this start went on from.
    resumed_from_run: Option<String>,
    /// Micro-batch m's own batch-norm statistics, for m ≥ 1 (see [`Trainer::new`]).
    micro_batch_statistics: Vec<B::Buf>,
    checkpointer: Option<Checkpointer>,
    /// Whether gradients are all-reduced in buckets while backward still runs.
    overlap: bool,
    started: Instant,
    /// When the first step ended, and the steps done then: throughput counts from there.
    timed_from: Option<(Instant, usize)>,
    /// When rank 0 printed its last progress line, and the steps done then: the recent rate.
    last_logged: std::cell::Cell<Option<(Instant, usize)>>,
    /// The last step's loss and accuracy over every rank.
    loss: f32,
    accuracy: f32,
}

impl<'a, B: Backend> Trainer<'a, B> {
    /// The run of `args` over `dataset` on `collective`'s ranks: its model and optimizer
    /// from the checkpoint of a run that started before, else from the seed, with rank 0's
    /// weights on every rank.
    fn new(
        args: &'a TrainArgs,
        collective: &'a mut dyn Collective,
        be: B,
        dtype: DType,
        dataset: &Dataset,
    ) -> Result<Self, TrainError> {
        let (rank, world) = (collective.rank(), collective.world_size());
        let layout = Layout::new(args, rank, world, dataset.len)?;
        let schedule = schedule(args, &layout);
        // A run that started before goes on from its checkpoint.
        let identity = Identity::of(
            args,
            dataset.classes,
            layout.global_batch,
            layout.total_steps,
        );
        let (model, sgd, start) = starting_model(
            args,
            &identity,
            &mut *collective,
            &be,
            dtype,
            dataset.classes,
        )?;
        // Micro-batch m of this rank stands for a rank of a world `micro_batches` times
        // larger (see the shards of [`Layout`]), and each rank keeps batch-norm statistics
        // of its own: so does each micro-batch. The model's own, which are saved, are
        // micro-batch 0's, as a world saves rank 0's; the others are copies taken here
        // (after a resume: of rank 0's checkpoint, as every rank takes).
        let micro_batch_statistics = (1..args.micro_batches)
            .map(|_| statistics_copy(&be, model.params()))
            .collect();
        let checkpointer = Checkpointer::new(args, &identity, rank);
        // On GPUs with NCCL, gradients are all-reduced in buckets while backward still runs;
        // otherwise all at once after it, through the host. One rank reduces nothing.
        let overlap = world > 1 && be.reduces_on_device(collective);
        // With RINGMASTER_CUDA_GRAPH=1, a step of one micro-batch whose gradients are not
        // all-reduced during backward is recorded once warm and replayed.
        let recorded = (step::recording_requested() && args.micro_batches == 1 && !overlap)
            .then(|| RecordedStep::new(&model, layout.micro, args.image_size, true));
        Ok(Self {
            args,
            collective,
            be,
            dtype,
            layout,
            schedule,
            model,
            sgd,
            start_step: start.step,
            resumed_from_run: start.from_run,
            micro_batch_statistics,
            checkpointer,
            overlap,
            recorded,
            started: Instant::now(),
            timed_from: None,
            last_logged: std::cell::Cell::new(None),
            loss: f32::NAN,
            accuracy: 0.0,
        })
    }

    /// Every step from the start step on, a thread reading and decoding the next batches
    /// of `dataset` while this one computes.
    fn train(&mut self, dataset: &Dataset, gpu: Option<GpuLoader>) -> Result<(), TrainError> {
        let (batches, prefetched) = std::sync::mpsc::sync_channel(2 * self.args.micro_batches);
        let (args, layout, start_step) = (self.args, self.layout, self.start_step);
        std::thread::scope(|scope| {
            scope.spawn(move || read_batches(dataset, args, layout, start_step, batches, gpu));
            let mut feed = Feed::new(prefetched);
            for step in start_step..layout.total_steps {
                self.step(&mut feed, step)?;
            }
            Ok(())
        })
    }

    /// One step: forward and backward over this rank's micro-batches (or the recorded
    /// step's replay), the gradients' all-reduce, the update, the loss and accuracy over
    /// every rank, rank 0's line, and the checkpoint when one is due.
    fn step(&mut self, feed: &mut Feed<B>, step: usize) -> Result<(), TrainError> {
        let (loss_sum, correct) = if self.recorded.is_some() {
            self.replayed_step(feed, step)?
        } else {
            self.micro_batches_step(feed, step)?
        };
        let all_reduce_timing = self.reduce_gradients(step)?;
        let lr = self.schedule.lr(step);
        self.sgd.step(self.model.params_mut(), lr);
        self.gather_progress(loss_sum, correct)?;
        if step == self.start_step {
            self.after_first_step(step)?;
        }
        let last_step = step + 1 == self.layout.total_steps;
        if self.layout.rank == 0 && (step.is_multiple_of(self.args.log_every.max(1)) || last_step) {
            self.log(step, lr, all_reduce_timing);
        }
        if let Some(checkpointer) = &mut self.checkpointer
            && checkpointer.due(step + 1, self.layout.total_steps)
        {
            checkpointer.write(step + 1, &self.be, &self.model, &self.sgd);
        }
        Ok(())
    }

    /// Whether `step` all-reduces its gradients in buckets during backward. The first step
    /// searches cuDNN's algorithms as its layers first run (the backward halves during
    /// backward): its gradients are reduced after it, so the searches time the GPU without
    /// all-reduces beside them.
    fn reduces_during_backward(&self, step: usize) -> bool {
        self.overlap && step > self.start_step
    }

    /// The recorded step: the batch loaded into its inputs, the step run (recorded once
    /// warm, replayed after), the next batch loaded behind it. Its loss and correct
    /// answers.
    fn replayed_step(
        &mut self,
        feed: &mut Feed<B>,
        step: usize,
    ) -> Result<(f32, usize), TrainError> {
        let recorded = self.recorded.as_mut().expect("a recorded step");
        let model = &mut self.model;
        if let Some(batch) = feed.upcoming.take() {
            let (images, labels) = batch?;
            load(recorded, model, images, &labels);
        }
        let replayed_before = recorded.recorded();
        recorded.run(model, self.args.label_smoothing);
        if self.layout.rank == 0 && !replayed_before && recorded.recorded() {
            eprintln!(
                "ringmaster-trainer: step {} recorded as a CUDA graph; replayed from here on",
                step + 1
            );
        }
        if step + 1 != self.layout.total_steps {
            // Into the step's own inputs: the device reads them in order.
            if let Some((images, labels)) = feed.next_received() {
                load(recorded, model, images, &labels);
            }
        }
        let stats = recorded.stats(model);
        Ok((stats.loss, stats.correct))
    }

    /// The step over this rank's micro-batches, their gradients accumulated: the sum of
    /// their losses and their correct answers.
    fn micro_batches_step(
        &mut self,
        feed: &mut Feed<B>,
        step: usize,
    ) -> Result<(f32, usize), TrainError> {
        self.model.zero_grads();
        let (mut loss_sum, mut correct) = (0.0f32, 0usize);
        for m in 0..self.args.micro_batches {
            let stats = self.micro_batch(feed, step, m)?;
            loss_sum += stats.loss;
            correct += stats.correct;
        }
        Ok((loss_sum, correct))
    }

    /// Micro-batch `m` of `step`: queued, the next one's upload queued behind it, then its
    /// loss waited for.
    fn micro_batch(
        &mut self,
        feed: &mut Feed<B>,
        step: usize,
        m: usize,
    ) -> Result<StepStats, TrainError> {
        let (images, labels) = feed.next_on_device(&self.be, self.dtype)?;
        let queued = self.queue_micro_batch(&images, &labels, step, m)?;
        let last_of_run = step + 1 == self.layout.total_steps && m + 1 == self.args.micro_batches;
        if !last_of_run {
            feed.upload_next(&self.be, self.dtype);
        }
        Ok(self.model.stats_of(queued))
    }

    /// Queues micro-batch `m`'s forward and backward passes with its own batch-norm
    /// statistics, and, during the last one's backward, the all-reduce of each bucket of
    /// gradients as it is final (when this step reduces during backward).
    fn queue_micro_batch(
        &mut self,
        images: &Tensor<B>,
        labels: &[usize],
        step: usize,
        m: usize,
    ) -> Result<QueuedStats<B>, TrainError> {
        let micro_batches = self.args.micro_batches;
        // Micro-batches accumulate: only the last one's backward finishes gradients.
        let mut buckets = (self.reduces_during_backward(step) && m + 1 == micro_batches)
            .then(|| GradientBuckets::new(self.model.num_parameters(), BUCKET_ELEMENTS));
        let mut failed = Ok(());
        self.swap_statistics(m);
        let collective = &mut *self.collective;
        let queued = self.model.queue_step(
            images,
            labels,
            self.args.label_smoothing,
            1.0 / micro_batches as f32,
            &mut |be, grads, final_from| {
                if let Some(range) = buckets.as_mut().and_then(|b| b.ready(final_from))
                    && failed.is_ok()
                {
                    failed = be.queue_all_reduce(grads, range, &mut *collective, ReduceOp::Average);
                }
            },
        );
        // The step's statistics updates are queued: micro-batch 0's go back.
        self.swap_statistics(m);
        failed?;
        debug_assert!(buckets.is_none_or(|b| b.done()));
        Ok(queued)
    }

    /// Swaps micro-batch `m`'s own batch-norm statistics with the model's (micro-batch
    /// 0's); again to swap them back. Nothing for micro-batch 0.
    fn swap_statistics(&mut self, m: usize) {
        if let Some(own) = m
            .checked_sub(1)
            .map(|i| &mut self.micro_batch_statistics[i])
        {
            std::mem::swap(&mut self.model.params_mut().buffers, own);
        }
    }

    /// The rest of the step's all-reduce of the gradients: with NCCL, all of them where
    /// backward reduced none, then every bucket joined (and their timing, for the log);
    /// otherwise all of them through the host.
    fn reduce_gradients(&mut self, step: usize) -> Result<Option<AllReduceTiming>, TrainError> {
        if self.overlap {
            if !self.reduces_during_backward(step) {
                self.queue_all_reduce_of_gradients()?;
            }
            self.be.join_all_reduces(self.collective)?;
            Ok(self
                .collective
                .on_device()
                .and_then(|d| overlap::timing((step + 1) as u64, &d.last_buckets())))
        } else {
            if self.layout.world > 1 {
                self.queue_all_reduce_of_gradients()?;
            }
            Ok(None)
        }
    }

    /// Queues the all-reduce (average) of every gradient at once.
    fn queue_all_reduce_of_gradients(&mut self) -> Result<(), CollectiveError> {
        let everything = 0..self.model.num_parameters();
        let grads = &mut self.model.params_mut().grads;
        self.be
            .queue_all_reduce(grads, everything, self.collective, ReduceOp::Average)
    }

    /// The step's loss (`loss_sum` over this rank's micro-batches) and accuracy (`correct`
    /// answers) over every rank, for the log.
    fn gather_progress(&mut self, loss_sum: f32, correct: usize) -> Result<(), TrainError> {
        let mut totals = [loss_sum / self.args.micro_batches as f32, correct as f32];
        self.collective.all_reduce(&mut totals, ReduceOp::Sum)?;
        self.loss = totals[0] / self.layout.world as f32;
        self.accuracy = totals[1] / self.layout.global_batch as f32;
        Ok(())
    }

    /// After the first step, which pays for allocation and warm-up: throughput counts from
    /// here. Its all-reduce connected NCCL's channels: rank 0 says which fabric they took.
    fn after_first_step(&mut self, step: usize) -> Result<(), TrainError> {
        self.timed_from = Some((Instant::now(), step + 1));
        if self.layout.world > 1 {
            report_fabric(self.collective, self.layout.rank, self.layout.world)?;
        }
        Ok(())
    }

    /// Rank 0's line for `step`, and how its all-reduce overlapped backward when measured.
    fn log(&self, step: usize, lr: f32, all_reduce_timing: Option<AllReduceTiming>) {
        let global_batch = self.layout.global_batch;
        let throughput = self
            .timed_from
            .filter(|(_, from)| step + 1 > *from)
            .map(|(t, from)| ((step + 1 - from) * global_batch) as f64 / t.elapsed().as_secs_f64());
        let now = Instant::now();
        let recent = self
            .last_logged
            .replace(Some((now, step + 1)))
            .filter(|(_, before)| step + 1 > *before)
            .map(|(at, before)| {
                ((step + 1 - before) * global_batch) as f64 / (now - at).as_secs_f64()
            });
        print_line(&Line::Step(Progress {
            step: (step + 1) as u64,
            loss: finite(self.loss),
            accuracy: finite(self.accuracy),
            learning_rate: f64::from(lr),
            images_per_second: throughput,
            recent_images_per_second: recent.filter(|r| r.is_finite()),
            total_steps: Some(self.layout.total_steps as u64),
        }));
        if let Some(timing) = all_reduce_timing {
            print_line(&Line::AllReduce(timing));
        }
    }

    /// Rank 0's summary of the finished run, after rank 0 saved the model where
    /// `--output-dir` says.
    fn finish(self) -> Result<Summary, TrainError> {
        let images_per_second = self.images_per_second();
        if self.layout.rank == 0
            && let Some(dir) = &self.args.output_dir
        {
            self.save_model(dir)?;
        }
        let Layout {
            total_steps,
            world,
            global_batch,
            ..
        } = self.layout;
        Ok(Summary {
            images_per_second,
            steps: total_steps as u64,
            final_loss: finite(self.loss),
            final_accuracy: finite(self.accuracy),
            world_size: world as u64,
            global_batch: global_batch as u64,
            parameters: self.model.num_parameters() as u64,
            seconds: self.started.elapsed().as_secs_f64(),
            resumed_from_step: (self.start_step > 0).then_some(self.start_step as u64),
            resumed_from_run: self.resumed_from_run.clone(),
        })
    }

    /// Images per second over every rank, from the end of the first step (the whole run
    /// when it had one step).
    fn images_per_second(&self) -> f64 {
        let Layout {
            total_steps,
            global_batch,
            ..
        } = self.layout;
        let images_per_second = match self.timed_from {
            Some((t, from)) if total_steps > from => {
                ((total_steps - from) * global_batch) as f64 / t.elapsed().as_secs_f64()
            }
            _ => {
                ((total_steps - self.start_step) * global_batch) as f64
                    / self.started.elapsed().as_secs_f64()
            }
        };
        // To a tenth: the job's status and `kubectl get` show it as it is, and the digits past
        // that are noise.
        (images_per_second * 10.0).round() / 10.0
    }

    /// Writes the trained model to `dir` ([`MODEL_FILE`]).
    fn save_model(&self, dir: &Path) -> Result<(), TrainError> {
        std::fs::create_dir_all(dir).map_err(|source| TrainError::OutputDir {
            path: dir.to_path_buf(),
            source,
        })?;
        let metadata = BTreeMap::from([
            ("model".to_string(), format!("{:?}", self.args.model)),
            ("steps".to_string(), self.layout.total_steps.to_string()),
            ("worldSize".to_string(), self.layout.world.to_string()),
        ]);
        let params = self.model.params().weights_to_host(&self.be);
        checkpoint::save(&dir.join(MODEL_FILE), &params, &metadata)?;
        Ok(())
    }
}

/// The model and optimizer a run starts with, and the step it starts from: the checkpoint's
/// (`identity` says which run it must be of) when a run started before, else fresh from
/// the seed; rank 0's weights on every rank.
fn starting_model<B: Backend>(
    args: &TrainArgs,
    identity: &Identity,
    collective: &mut dyn Collective,
    be: &B,
    dtype: DType,
    classes: usize,
) -> Result<(Model<B>, Sgd<B>, resume::Start), TrainError> {
    let arch = Arch::of(args.model, args.width);
    let mut model =
        Model::with_backend(arch, classes, args.seed, be.clone()).with_activations(dtype);
    let mut sgd = Sgd::on(be, model.params(), args.momentum, args.weight_decay);
    let start = resume::restore(args, identity, be, &mut model, &mut sgd, collective)?;
    // The collectives work on host memory (a device backend stages through it).
    be.with_host(&mut model.params_mut().values, |values| {
        collective.broadcast(values, 0)
    })?;
    Ok((model, sgd, start))
}

/// Prints one JSON line of the trainer's output.
fn print_line(line: &Line) {
    println!(
        "{}",
        serde_json::to_string(line).expect("a line serializes")
    );
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
        print_line(&line);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(rank: usize, world: usize, micro_batches: usize) -> Layout {
        let (micro, dataset_size) = (3, 100);
        let shards = world * micro_batches;
        let steps_per_epoch = dataset_size / shards / micro;
        Layout {
            rank,
            world,
            micro_batches,
            micro,
            shards,
            dataset_size,
            steps_per_epoch,
            total_steps: 2 * steps_per_epoch + 1,
            global_batch: micro * micro_batches * world,
        }
    }

    /// Within an epoch no image is read twice by any rank or micro-batch; each epoch is
    /// ordered anew; a run resumed at a step reads what the whole run read from that step.
    #[test]
    fn each_rank_reads_its_micro_batches_in_order_and_an_epoch_reads_no_image_twice() {
        let (world, per_rank) = (2, 2);
        let whole: Vec<Vec<(Vec<usize>, usize)>> = (0..world)
            .map(|rank| micro_batches(layout(rank, world, per_rank), 7, 0).collect())
            .collect();
        let l = layout(0, world, per_rank);
        for rank_batches in &whole {
            assert_eq!(rank_batches.len(), l.total_steps * per_rank);
            assert!(
                rank_batches
                    .iter()
                    .all(|(indices, _)| indices.len() == l.micro)
            );
        }
        let epoch_images = |epoch: usize| -> Vec<usize> {
            whole
                .iter()
                .flatten()
                .filter(|(_, e)| *e == epoch)
                .flat_map(|(indices, _)| indices.clone())
                .collect()
        };
        for epoch in 0..2 {
            let mut images = epoch_images(epoch);
            let read = images.len();
            assert_eq!(read, l.steps_per_epoch * l.global_batch);
            images.sort_unstable();
            images.dedup();
            assert_eq!(images.len(), read, "epoch {epoch} reads an image twice");
        }
        assert_ne!(whole[0][0].0, whole[0][l.steps_per_epoch * per_rank].0);
        let resumed: Vec<_> = micro_batches(layout(1, world, per_rank), 7, 5).collect();
        assert_eq!(resumed, whole[1][5 * per_rank..]);
    }
}
