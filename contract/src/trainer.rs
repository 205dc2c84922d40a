//! The operator ↔ trainer contract.
//!
//! [`TrainArgs`] is the command line of `ringmaster-trainer train` (the trainer flattens it
//! into its CLI) and the value the operator builds for a TrainingJob; [`TrainArgs::to_args`]
//! turns it back into flags, and parsing those flags gives the same value (tested). Both
//! sides run [`TrainArgs::check`] against [`Capabilities::this_release`]: the operator in its
//! validate step (a setting the trainer cannot run is refused on the TrainingJob, naming the
//! field), the trainer before it starts.

use std::fmt;
use std::path::{Path, PathBuf};

use clap::{Parser, ValueEnum};
use serde::{Deserialize, Serialize};

/// Networks the trainer can build.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Model {
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

impl Model {
    /// Every network, in order.
    pub const ALL: [Model; 7] = [
        Model::Resnet18,
        Model::Resnet34,
        Model::Resnet50,
        Model::Resnet101,
        Model::Resnet152,
        Model::Cifar8,
        Model::Cifar20,
    ];

    /// The smallest input side the network takes: the ImageNet ResNets halve it five times.
    pub fn min_image_size(self) -> usize {
        match self {
            Model::Cifar8 | Model::Cifar20 => 4,
            _ => 32,
        }
    }
}

/// Where the computation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Device {
    /// The GPU when this trainer has the CUDA engine and the machine a usable GPU, else the
    /// CPU; the trainer says which, and why (a `device` line).
    Auto,
    /// The CPU engine on all cores.
    Cpu,
    /// NVIDIA GPUs (cuDNN, cuBLAS, NCCL).
    Cuda,
}

/// Arithmetic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Precision {
    /// 32-bit floats.
    Fp32,
    /// bfloat16 with fp32 master weights (GPU only).
    Bf16,
}

/// Where an image folder's JPEGs are decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Decoder {
    /// On the GPU with nvJPEG when training on a GPU and nvJPEG loads, else on the CPUs;
    /// rank 0 says which on stderr.
    Auto,
    /// On the CPUs.
    Cpu,
    /// On the GPU with nvJPEG (its hardware decoder where the GPU has one); an error when
    /// it cannot be.
    Nvjpeg,
}

/// Learning-rate schedule after warm-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Schedule {
    /// Cosine decay to zero.
    Cosine,
    /// ×0.1 every third of the run.
    Step,
    /// Constant.
    Constant,
}

/// Which collective averages the gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CollectiveKind {
    /// NCCL when the CUDA driver, a GPU and NCCL are found, else the TCP ring.
    Auto,
    /// The TCP ring (reduce-scatter + all-gather), on any machine.
    TcpRing,
    /// NCCL on the GPUs; an error when it cannot be used.
    Nccl,
}

/// The flag spelling of a value enum (`resnet50`, `tcp-ring`, …), as a command line or an
/// environment variable carries it.
pub fn flag_value<T: ValueEnum>(value: T) -> String {
    value
        .to_possible_value()
        .expect("no variant is skipped")
        .get_name()
        .to_string()
}

macro_rules! display_as_flag {
    ($($t:ty),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&flag_value(*self))
            }
        }
    )*};
}
display_as_flag!(Model, Device, Precision, Schedule, CollectiveKind, Decoder);

/// Defaults of [`TrainArgs`], shared by its flags and its `Default`.
pub mod defaults {
    use super::*;
    /// The network.
    pub const MODEL: Model = Model::Resnet50;
    /// Channels of the first stage of the CIFAR ResNets.
    pub const WIDTH: usize = 16;
    /// Where to compute.
    pub const DEVICE: Device = Device::Cpu;
    /// Arithmetic.
    pub const PRECISION: Precision = Precision::Fp32;
    /// Images per rank per step.
    pub const BATCH_SIZE: usize = 64;
    /// Micro-batches per rank.
    pub const MICRO_BATCHES: usize = 1;
    /// Input side.
    pub const IMAGE_SIZE: usize = 224;
    /// Steps when neither steps nor epochs is given.
    pub const STEPS: usize = 100;
    /// Warm-up steps (0: the default warm-up, see `--warmup-epochs`).
    pub const WARMUP_STEPS: usize = 0;
    /// Epochs of the default warm-up, for a global batch above [`WARMUP_ABOVE_BATCH`].
    pub const WARMUP_EPOCHS: f32 = 5.0;
    /// The global batch above which the default warm-up applies.
    pub const WARMUP_ABOVE_BATCH: usize = 256;
    /// The most of a run the default warm-up takes: a fifth.
    pub const WARMUP_MAX_SHARE: usize = 5;
    /// Schedule.
    pub const SCHEDULE: Schedule = Schedule::Cosine;
    /// SGD momentum.
    pub const MOMENTUM: f32 = 0.9;
    /// L2 weight decay.
    pub const WEIGHT_DECAY: f32 = 5e-5;
    /// Label smoothing.
    pub const LABEL_SMOOTHING: f32 = 0.0;
    /// Samples of the synthetic or generated dataset.
    pub const DATASET_SIZE: usize = 4096;
    /// Classes of the synthetic data.
    pub const CLASSES: usize = 1000;
    /// Seed.
    pub const SEED: u64 = 0;
    /// Progress line interval.
    pub const LOG_EVERY: usize = 10;
    /// Minutes of training between checkpoints: at most this much is trained again after a
    /// failure.
    pub const CHECKPOINT_MINUTES: f32 = 10.0;
    /// Checkpoints a run keeps: the newest, and two to fall back on should it be damaged
    /// after it was written (a share restored from a snapshot, a file removed by hand).
    pub const KEEP_CHECKPOINTS: usize = 3;
    /// Bytes per rank of the preflight's all-reduce and of each ring link's transfer: 64 MiB,
    /// large enough that bandwidth, not latency, decides the time (nccl-tests' figures
    /// level off well below it), small enough that a TCP ring on 10 Gb/s takes seconds.
    pub const PREFLIGHT_BYTES: u64 = 64 << 20;
}

/// The smallest `--preflight-bytes`: below it latency, not bandwidth, decides the time.
pub const MIN_PREFLIGHT_BYTES: u64 = 1 << 20;

/// The largest `--preflight-bytes`: 1 GiB (a GPU holds two such buffers beside the model).
pub const MAX_PREFLIGHT_BYTES: u64 = 1 << 30;

/// The learning rate for a global batch when none is given: Goyal et al.'s linear scaling
/// rule, 0.1 per 256 images (the one rule the operator and the trainer both apply).
pub fn scaled_learning_rate(global_batch: usize) -> f32 {
    (0.1 * global_batch as f64 / 256.0) as f32
}

/// Settings of `ringmaster-trainer train` (they mirror a TrainingJob's `trainer:` section).
#[derive(clap::Args, Clone, Debug, PartialEq)]
pub struct TrainArgs {
    /// The network.
    #[arg(long, value_enum, default_value_t = defaults::MODEL)]
    pub model: Model,
    /// Channels of the first stage of the CIFAR ResNets.
    #[arg(long, default_value_t = defaults::WIDTH)]
    pub width: usize,
    /// How gradients are averaged over ranks.
    #[arg(long, value_enum, default_value_t = CollectiveKind::Auto, env = "RINGMASTER_COLLECTIVE")]
    pub collective: CollectiveKind,
    /// Where to compute.
    #[arg(long, value_enum, default_value_t = defaults::DEVICE)]
    pub device: Device,
    /// Arithmetic.
    #[arg(long, value_enum, default_value_t = defaults::PRECISION)]
    pub precision: Precision,
    /// Images per rank per step.
    #[arg(long, default_value_t = defaults::BATCH_SIZE)]
    pub batch_size: usize,
    /// Split each rank's batch into this many micro-batches whose gradients are accumulated
    /// (batch norm sees each micro-batch alone, as separate ranks would).
    #[arg(long, default_value_t = defaults::MICRO_BATCHES)]
    pub micro_batches: usize,
    /// Side of the square images.
    #[arg(long, default_value_t = defaults::IMAGE_SIZE)]
    pub image_size: usize,
    /// Steps to train (exclusive with --epochs; default 100 when neither is given).
    #[arg(long, conflicts_with = "epochs")]
    pub steps: Option<usize>,
    /// Passes over the dataset.
    #[arg(long)]
    pub epochs: Option<usize>,
    /// Peak learning rate (default: 0.1 × global batch / 256).
    #[arg(long)]
    pub learning_rate: Option<f32>,
    /// Warm-up steps of the learning rate.
    #[arg(long, default_value_t = defaults::WARMUP_STEPS)]
    pub warmup_steps: usize,
    /// Warm-up of the learning rate in passes over the dataset (instead of --warmup-steps).
    /// Default, when neither is given: Goyal et al.'s 5 epochs, at most a fifth of the run,
    /// when the global batch is larger than 256 (where the linear scaling rule raises the
    /// rate), else none.
    #[arg(long, conflicts_with = "warmup_steps")]
    pub warmup_epochs: Option<f32>,
    /// Schedule after warm-up.
    #[arg(long, value_enum, default_value_t = defaults::SCHEDULE)]
    pub schedule: Schedule,
    /// SGD momentum.
    #[arg(long, default_value_t = defaults::MOMENTUM)]
    pub momentum: f32,
    /// L2 weight decay.
    #[arg(long, default_value_t = defaults::WEIGHT_DECAY)]
    pub weight_decay: f32,
    /// Label smoothing of the cross-entropy.
    #[arg(long, default_value_t = defaults::LABEL_SMOOTHING)]
    pub label_smoothing: f32,
    /// Random images (the reference architecture's benchmark mode). The default.
    #[arg(long, conflicts_with_all = ["data_dir", "learnable_classes"])]
    pub synthetic: bool,
    /// An ImageNet-style folder of class folders of JPEG and PNG images.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Where --data-dir's JPEGs are decoded.
    #[arg(long, value_enum, default_value_t = Decoder::Auto)]
    pub decoder: Decoder,
    /// A generated dataset of this many classes that a small network can learn (tests, demos).
    #[arg(long)]
    pub learnable_classes: Option<usize>,
    /// Samples in the synthetic or generated dataset.
    #[arg(long, default_value_t = defaults::DATASET_SIZE)]
    pub dataset_size: usize,
    /// Classes of the synthetic data and the classifier (ImageNet: 1000).
    #[arg(long, default_value_t = defaults::CLASSES)]
    pub classes: usize,
    /// Seed of weights, data and shuffling.
    #[arg(long, default_value_t = defaults::SEED)]
    pub seed: u64,
    /// Folder for the final model (`model.safetensors`) and, in `runs/<run id>/`, the run's
    /// checkpoints (`checkpoint-<step>.safetensors`: weights, batch-norm statistics, momentum
    /// and the step), which training resumes from. A run without --run-id keeps them in the
    /// folder itself.
    #[arg(long)]
    pub output_dir: Option<PathBuf>,
    /// Print a progress line every this many steps.
    #[arg(long, default_value_t = defaults::LOG_EVERY)]
    pub log_every: usize,
    /// Write the checkpoint after every this many steps (besides --checkpoint-minutes).
    #[arg(long)]
    pub checkpoint_every: Option<usize>,
    /// Write the checkpoint once this many minutes have passed since the last one (0: not by
    /// time; at most 10080, a week). Rank 0 writes it in the background while training goes on.
    #[arg(long, default_value_t = defaults::CHECKPOINT_MINUTES)]
    pub checkpoint_minutes: f32,
    /// Checkpoints of this run to keep: an older one is deleted once a newer one is wholly
    /// written.
    #[arg(long, default_value_t = defaults::KEEP_CHECKPOINTS)]
    pub keep_checkpoints: usize,
    /// Whose checkpoint this run resumes from: one written under the same id, with the same
    /// model, image size, global batch, length, optimizer settings and seed. Ringmaster sets it
    /// to the TrainingJob's UID, so a gang restarted after a failure goes on from the last
    /// checkpoint, and a job made anew under the same name starts from the beginning.
    #[arg(long, env = RUN_ID_ENV)]
    pub run_id: Option<String>,
    /// An earlier run (its --run-id) whose newest checkpoint, in `runs/<id>/` of the output
    /// folder, this run starts from when it has none of its own. Its model, width, classes,
    /// image size, global batch, learning rate, momentum, weight decay and seed must be this
    /// run's; its length and schedule may differ (to train on longer, or decay otherwise).
    /// A checkpoint that is missing or differs stops the run, saying what differs.
    #[arg(long)]
    pub resume_from: Option<String>,
    /// Before the first step, time the job's own all-reduce (and each ring link: rank r to
    /// rank r+1) and stop every rank, naming the slowest link, when the all-reduce's bus
    /// bandwidth (nccl-tests' busbw: algbw × 2(n−1)/n) is below this many GB/s. Whatever
    /// fabric the collective uses is measured: NCCL's (InfiniBand, or sockets), or the TCP
    /// ring's. Unset: no preflight. A single rank has nothing to measure and skips it.
    #[arg(long)]
    pub preflight_min_bus_gbps: Option<f64>,
    /// Bytes per rank of the preflight's all-reduce and link transfers.
    #[arg(long, default_value_t = defaults::PREFLIGHT_BYTES)]
    pub preflight_bytes: u64,
}

/// The longest `--checkpoint-minutes`: a week.
pub const MAX_CHECKPOINT_MINUTES: f32 = 10080.0;

/// The one checkpoint of a run, in `--output-dir`, as trainers before per-run checkpoints
/// wrote it: still resumed from by the run that wrote it (a job upgraded mid-run), or named
/// by `--resume-from`, never written.
pub const CHECKPOINT_FILE: &str = "checkpoint.safetensors";

/// The folder of `--output-dir` that holds a folder of checkpoints per run.
pub const RUNS_DIR: &str = "runs";

/// Where the run `run_id` keeps its checkpoints in `output_dir`: `runs/<run id>/`, so a job
/// made again under the same name (another UID) never writes over the earlier run's; a run
/// without an id, the folder itself.
pub fn run_dir(output_dir: &Path, run_id: Option<&str>) -> PathBuf {
    match run_id {
        Some(id) => output_dir.join(RUNS_DIR).join(id),
        None => output_dir.to_path_buf(),
    }
}

/// The checkpoint of `step` in a run's folder.
pub fn checkpoint_file(step: u64) -> String {
    format!("checkpoint-{step}.safetensors")
}

/// The step of a checkpoint named by [`checkpoint_file`], or `None` for another name (a
/// `.partial` file being written, the model, anything else).
pub fn checkpoint_step(file_name: &str) -> Option<u64> {
    let digits = file_name
        .strip_prefix("checkpoint-")?
        .strip_suffix(".safetensors")?;
    // Digits only: `u64`'s parser takes a leading `+`.
    digits
        .bytes()
        .all(|b| b.is_ascii_digit())
        .then(|| digits.parse().ok())
        .flatten()
}

/// The longest run id (`--run-id`, `--resume-from`): a Kubernetes UID has 36 characters.
pub const MAX_RUN_ID_CHARS: usize = 128;

/// Why `id` cannot name a run's folder, or `None` when it can: one path component of
/// letters, digits, `.`, `_` and `-`, not `.` or `..`.
pub fn run_id_problem(id: &str) -> Option<String> {
    if id.is_empty() || id.len() > MAX_RUN_ID_CHARS {
        return Some(format!(
            "{id:?} is not a run id (1 to {MAX_RUN_ID_CHARS} characters)"
        ));
    }
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if !id.chars().all(allowed) || id == "." || id == ".." {
        return Some(format!(
            "{id:?} is not a run id: it names a folder of the output, so letters, digits, '.', '_' and '-' only (a TrainingJob's UID)"
        ));
    }
    None
}

/// The final model, in `--output-dir`.
pub const MODEL_FILE: &str = "model.safetensors";

/// The variable that gives the trainer its `--run-id`: the operator sets it to the
/// TrainingJob's UID in every rank's environment.
pub const RUN_ID_ENV: &str = "RINGMASTER_JOB_UID";

/// The variable with `host:port` of rank 0's rendezvous: the operator sets it to worker 0's
/// DNS name and port in every rank's environment.
pub const RENDEZVOUS_ENV: &str = "RINGMASTER_RENDEZVOUS";

/// The variable with the path of the job's rendezvous key: a file whose bytes every rank
/// proves it holds (an HMAC-SHA256 key) before rank 0, or its neighbour in the ring, admits
/// it. The operator sets it to [`RENDEZVOUS_KEY`] in the job's mounted SSH Secret. Unset,
/// the ring admits whoever speaks its protocol (local runs, tests, jobs of an older
/// operator).
pub const RENDEZVOUS_KEY_FILE_ENV: &str = "RINGMASTER_RENDEZVOUS_KEY_FILE";

/// The rendezvous key's name in the job's SSH Secret, and so the file's name where the
/// Secret is mounted.
pub const RENDEZVOUS_KEY: &str = "rendezvous-key";

/// The bytes of the rendezvous key the operator draws per job.
pub const RENDEZVOUS_KEY_BYTES: usize = 32;

/// The fewest bytes of a rendezvous key the trainer takes (a shorter one is refused as
/// guessable).
pub const RENDEZVOUS_KEY_MIN_BYTES: usize = 16;

impl Default for TrainArgs {
    /// The settings of `ringmaster-trainer train` with no flags (and no environment).
    fn default() -> Self {
        Self {
            model: defaults::MODEL,
            width: defaults::WIDTH,
            collective: CollectiveKind::Auto,
            device: defaults::DEVICE,
            precision: defaults::PRECISION,
            batch_size: defaults::BATCH_SIZE,
            micro_batches: defaults::MICRO_BATCHES,
            image_size: defaults::IMAGE_SIZE,
            steps: None,
            epochs: None,
            learning_rate: None,
            warmup_steps: defaults::WARMUP_STEPS,
            warmup_epochs: None,
            schedule: defaults::SCHEDULE,
            momentum: defaults::MOMENTUM,
            weight_decay: defaults::WEIGHT_DECAY,
            label_smoothing: defaults::LABEL_SMOOTHING,
            synthetic: false,
            data_dir: None,
            decoder: Decoder::Auto,
            learnable_classes: None,
            dataset_size: defaults::DATASET_SIZE,
            classes: defaults::CLASSES,
            seed: defaults::SEED,
            output_dir: None,
            log_every: defaults::LOG_EVERY,
            checkpoint_every: None,
            checkpoint_minutes: defaults::CHECKPOINT_MINUTES,
            keep_checkpoints: defaults::KEEP_CHECKPOINTS,
            run_id: None,
            resume_from: None,
            preflight_min_bus_gbps: None,
            preflight_bytes: defaults::PREFLIGHT_BYTES,
        }
    }
}

/// `ringmaster-trainer train` as a parser of its own: what the operator's check and tests
/// parse a built command line with.
#[derive(Parser, Debug)]
#[command(name = "train", no_binary_name = true)]
pub struct TrainCommand {
    /// The settings.
    #[command(flatten)]
    pub args: TrainArgs,
}

impl TrainArgs {
    /// Parses the flags that follow `ringmaster-trainer train`.
    pub fn parse_flags<I, T>(flags: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        TrainCommand::try_parse_from(flags).map(|c| c.args)
    }

    /// The flags that give these settings: the main ones (model, device, precision, batch,
    /// image size) always, so a launcher command reads plainly, the rest when they differ
    /// from the default. `TrainArgs::parse_flags(a.to_args()) == a` (tested).
    pub fn to_args(&self) -> Vec<String> {
        let d = TrainArgs::default();
        let mut out = vec![
            format!("--model={}", self.model),
            format!("--device={}", self.device),
            format!("--precision={}", self.precision),
            format!("--batch-size={}", self.batch_size),
            format!("--image-size={}", self.image_size),
        ];
        let mut flag = |name: &str, value: String| out.push(format!("--{name}={value}"));
        if self.width != d.width {
            flag("width", self.width.to_string());
        }
        if self.collective != d.collective {
            flag("collective", self.collective.to_string());
        }
        if self.micro_batches != d.micro_batches {
            flag("micro-batches", self.micro_batches.to_string());
        }
        if let Some(steps) = self.steps {
            flag("steps", steps.to_string());
        }
        if let Some(epochs) = self.epochs {
            flag("epochs", epochs.to_string());
        }
        if let Some(lr) = self.learning_rate {
            flag("learning-rate", lr.to_string());
        }
        if self.warmup_steps != d.warmup_steps {
            flag("warmup-steps", self.warmup_steps.to_string());
        }
        if let Some(epochs) = self.warmup_epochs {
            flag("warmup-epochs", epochs.to_string());
        }
        if self.schedule != d.schedule {
            flag("schedule", self.schedule.to_string());
        }
        if self.momentum != d.momentum {
            flag("momentum", self.momentum.to_string());
        }
        if self.weight_decay != d.weight_decay {
            flag("weight-decay", self.weight_decay.to_string());
        }
        if self.label_smoothing != d.label_smoothing {
            flag("label-smoothing", self.label_smoothing.to_string());
        }
        if let Some(dir) = &self.data_dir {
            flag("data-dir", dir.display().to_string());
        }
        if let Some(classes) = self.learnable_classes {
            flag("learnable-classes", classes.to_string());
        }
        if self.dataset_size != d.dataset_size {
            flag("dataset-size", self.dataset_size.to_string());
        }
        if self.classes != d.classes {
            flag("classes", self.classes.to_string());
        }
        if self.seed != d.seed {
            flag("seed", self.seed.to_string());
        }
        if let Some(dir) = &self.output_dir {
            flag("output-dir", dir.display().to_string());
        }
        if self.log_every != d.log_every {
            flag("log-every", self.log_every.to_string());
        }
        if let Some(steps) = self.checkpoint_every {
            flag("checkpoint-every", steps.to_string());
        }
        if self.checkpoint_minutes != d.checkpoint_minutes {
            flag("checkpoint-minutes", self.checkpoint_minutes.to_string());
        }
        if self.keep_checkpoints != d.keep_checkpoints {
            flag("keep-checkpoints", self.keep_checkpoints.to_string());
        }
        if let Some(id) = &self.run_id {
            flag("run-id", id.clone());
        }
        if let Some(id) = &self.resume_from {
            flag("resume-from", id.clone());
        }
        if let Some(gbps) = self.preflight_min_bus_gbps {
            flag("preflight-min-bus-gbps", gbps.to_string());
        }
        if self.decoder != d.decoder {
            flag("decoder", self.decoder.to_string());
        }
        if self.preflight_bytes != d.preflight_bytes {
            flag("preflight-bytes", self.preflight_bytes.to_string());
        }
        if self.synthetic {
            out.push("--synthetic".into());
        }
        out
    }

    /// Every reason these settings cannot run on a trainer with `capabilities`, or `Ok`.
    /// What depends on the world size (a dataset smaller than one global batch) is checked
    /// by the trainer once the ranks are known.
    pub fn check(&self, capabilities: &Capabilities) -> Result<(), Vec<SettingsError>> {
        let mut errors = Vec::new();
        let mut refuse =
            |setting: Setting, message: String| errors.push(SettingsError { setting, message });
        // `auto` is decided on the machine, where the trainer runs.
        if self.device != Device::Auto && !capabilities.devices.contains(&self.device) {
            refuse(
                Setting::Device,
                match self.device {
                    Device::Cuda => format!(
                        "this ringmaster-trainer has no CUDA engine: it computes on {} only (use gpusPerWorker: 0, or your own command)",
                        list(&capabilities.devices)
                    ),
                    other => format!(
                        "this ringmaster-trainer cannot compute on {other} (it can on: {})",
                        list(&capabilities.devices)
                    ),
                },
            );
        }
        if !capabilities.precisions.contains(&self.precision) {
            refuse(
                Setting::Precision,
                format!(
                    "this ringmaster-trainer cannot compute in {} (it can in: {})",
                    self.precision,
                    list(&capabilities.precisions)
                ),
            );
        } else if self.precision == Precision::Bf16 && self.device == Device::Cpu {
            // The CPU engine is the fp32 reference; `auto` is decided on the machine, and the
            // trainer refuses bf16 there when it picks the CPU.
            refuse(
                Setting::Precision,
                "bf16 computes on the CUDA engine only, and this job computes on CPUs (set precision: fp32, or give the workers GPUs with gpusPerWorker)".to_string(),
            );
        }
        if !capabilities.models.contains(&self.model) {
            refuse(
                Setting::Model,
                format!(
                    "this release of ringmaster-trainer cannot build {} (it can: {})",
                    self.model,
                    list(&capabilities.models)
                ),
            );
        }
        if self.batch_size == 0 {
            refuse(Setting::BatchSize, "must be at least 1".into());
        }
        if self.micro_batches == 0 || !self.batch_size.is_multiple_of(self.micro_batches) {
            refuse(
                Setting::MicroBatches,
                format!(
                    "{} must divide the batch size {} (and be at least 1)",
                    self.micro_batches, self.batch_size
                ),
            );
        }
        if self.image_size < self.model.min_image_size() {
            refuse(
                Setting::ImageSize,
                format!(
                    "{} is smaller than the {} pixels {} needs",
                    self.image_size,
                    self.model.min_image_size(),
                    self.model
                ),
            );
        }
        if self.steps == Some(0) || self.epochs == Some(0) {
            refuse(Setting::Length, "must be at least 1".into());
        }
        if let Some(lr) = self.learning_rate
            && !(lr.is_finite() && lr >= 0.0)
        {
            refuse(
                Setting::LearningRate,
                format!("{lr} is not a learning rate (a finite number ≥ 0)"),
            );
        }
        if let Some(epochs) = self.warmup_epochs
            && !(epochs.is_finite() && epochs >= 0.0)
        {
            refuse(
                Setting::Warmup,
                format!("{epochs} is not a number of epochs (a finite number ≥ 0)"),
            );
        }
        if self.classes == 0 || self.learnable_classes == Some(0) {
            refuse(Setting::Classes, "must be at least 1".into());
        }
        if self.data_dir.is_none() && self.dataset_size == 0 {
            refuse(Setting::DatasetSize, "must be at least 1".into());
        }
        if self.width == 0 {
            refuse(Setting::Width, "must be at least 1".into());
        }
        if self.checkpoint_every == Some(0) {
            refuse(Setting::Checkpoint, "must be at least 1 step".into());
        }
        if !(0.0..=MAX_CHECKPOINT_MINUTES).contains(&self.checkpoint_minutes) {
            refuse(
                Setting::Checkpoint,
                format!(
                    "{} is not a number of minutes from 0 to {MAX_CHECKPOINT_MINUTES} (a week)",
                    self.checkpoint_minutes
                ),
            );
        }
        if self.keep_checkpoints == 0 {
            refuse(
                Setting::KeepCheckpoints,
                "must be at least 1: the newest checkpoint is what a restart goes on from".into(),
            );
        }
        for id in [&self.run_id, &self.resume_from].into_iter().flatten() {
            if let Some(problem) = run_id_problem(id) {
                refuse(Setting::Run, problem);
            }
        }
        if self.resume_from.is_some() && self.output_dir.is_none() {
            refuse(
                Setting::Run,
                "--resume-from needs --output-dir: the earlier run's checkpoints are there".into(),
            );
        }
        if let Some(gbps) = self.preflight_min_bus_gbps
            && !(gbps.is_finite() && gbps > 0.0)
        {
            refuse(
                Setting::Preflight,
                format!("{gbps} is not a bus bandwidth in GB/s (a finite number > 0)"),
            );
        }
        if !(MIN_PREFLIGHT_BYTES..=MAX_PREFLIGHT_BYTES).contains(&self.preflight_bytes)
            || !self.preflight_bytes.is_multiple_of(4)
        {
            refuse(
                Setting::Preflight,
                format!(
                    "{} bytes is not a preflight message: a multiple of 4 (f32 values) from {MIN_PREFLIGHT_BYTES} (1 MiB) to {MAX_PREFLIGHT_BYTES} (1 GiB)",
                    self.preflight_bytes
                ),
            );
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }
}

fn list<T: fmt::Display>(items: &[T]) -> String {
    if items.is_empty() {
        return "nothing".into();
    }
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// A setting of [`TrainArgs`] that a check refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Setting {
    /// `--device`.
    Device,
    /// `--precision`.
    Precision,
    /// `--model`.
    Model,
    /// `--batch-size`.
    BatchSize,
    /// `--micro-batches`.
    MicroBatches,
    /// `--image-size`.
    ImageSize,
    /// `--steps` / `--epochs`.
    Length,
    /// `--learning-rate`.
    LearningRate,
    /// `--warmup-steps` / `--warmup-epochs`.
    Warmup,
    /// `--classes` / `--learnable-classes`.
    Classes,
    /// `--dataset-size`.
    DatasetSize,
    /// `--width`.
    Width,
    /// `--checkpoint-every` / `--checkpoint-minutes`.
    Checkpoint,
    /// `--keep-checkpoints`.
    KeepCheckpoints,
    /// `--run-id` / `--resume-from`.
    Run,
    /// `--preflight-min-bus-gbps` / `--preflight-bytes`.
    Preflight,
}

impl Setting {
    /// The flags that carry the setting.
    pub fn flags(self) -> &'static [&'static str] {
        match self {
            Setting::Device => &["--device"],
            Setting::Precision => &["--precision"],
            Setting::Model => &["--model"],
            Setting::BatchSize => &["--batch-size"],
            Setting::MicroBatches => &["--micro-batches"],
            Setting::ImageSize => &["--image-size"],
            Setting::Length => &["--steps", "--epochs"],
            Setting::LearningRate => &["--learning-rate"],
            Setting::Warmup => &["--warmup-steps", "--warmup-epochs"],
            Setting::Classes => &["--classes", "--learnable-classes"],
            Setting::DatasetSize => &["--dataset-size"],
            Setting::Width => &["--width"],
            Setting::Checkpoint => &["--checkpoint-every", "--checkpoint-minutes"],
            Setting::KeepCheckpoints => &["--keep-checkpoints"],
            Setting::Run => &["--run-id", "--resume-from"],
            Setting::Preflight => &["--preflight-min-bus-gbps", "--preflight-bytes"],
        }
    }
}

/// A setting the trainer cannot run, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", .setting.flags().join("/"))]
pub struct SettingsError {
    /// Which setting.
    pub setting: Setting,
    /// Why, in words a user can act on.
    pub message: String,
}

/// What a build of the trainer can run. Printed by `ringmaster-trainer info --json`;
/// the operator refuses TrainingJobs that ask for more.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Capabilities {
    /// Where it computes.
    pub devices: Vec<Device>,
    /// In what arithmetic.
    pub precisions: Vec<Precision>,
    /// Which networks.
    pub models: Vec<Model>,
    /// Which collectives.
    pub collectives: Vec<CollectiveKind>,
}

impl Capabilities {
    /// The trainer of this release: the CPU engine in fp32 and the CUDA engine in fp32 and
    /// bf16, every network, the TCP ring and NCCL (CUDA's libraries and NCCL are loaded at
    /// run time, where a GPU is).
    pub fn this_release() -> Self {
        Self {
            devices: vec![Device::Cpu, Device::Cuda],
            precisions: vec![Precision::Fp32, Precision::Bf16],
            models: Model::ALL.to_vec(),
            collectives: vec![
                CollectiveKind::Auto,
                CollectiveKind::TcpRing,
                CollectiveKind::Nccl,
            ],
        }
    }
}

/// One JSON line of the trainer's stdout, tagged by `event`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "camelCase")]
pub enum Line {
    /// Where rank 0 computes (first line), and why `auto` did not pick the GPU.
    Device(DeviceChoice),
    /// Progress of a step (rank 0, every `--log-every` steps).
    Step(Progress),
    /// The run's result (rank 0, last line).
    Summary(Summary),
    /// Why a rank stopped (its last line, on any rank that fails).
    Failed(Failure),
    /// Training goes on from a checkpoint of this run, or of the `--resume-from` run (rank 0,
    /// before the first step).
    Resumed(Resumed),
    /// A checkpoint was written (rank 0).
    Checkpoint(CheckpointWritten),
    /// How a step's gradients were all-reduced beside its backward pass (rank 0, every
    /// `--log-every` steps, on GPUs with NCCL).
    AllReduce(AllReduceTiming),
    /// Which fabric carries the gradients between ranks (rank 0, after the first step of a
    /// run of several ranks).
    Fabric(Fabric),
    /// What the preflight measured, and whether the fabric passed (rank 0, before the first
    /// step, with `--preflight-min-bus-gbps`).
    Preflight(Preflight),
}

/// The preflight's figures: the job's own all-reduce, timed as nccl-tests times it, and each
/// link of the ring, timed by a point-to-point transfer from every rank to the next.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Preflight {
    /// The collective measured: `nccl` or `tcp-ring`.
    pub collective: String,
    /// Ranks in all.
    pub world_size: u64,
    /// Bytes per rank of the all-reduce and of each link's transfer.
    pub bytes: u64,
    /// The all-reduce's bus bandwidth in GB/s (algbw × 2(n−1)/n), as the slowest rank
    /// timed it.
    pub bus_bandwidth_gbps: f64,
    /// The least bus bandwidth the job accepts (`--preflight-min-bus-gbps`).
    pub min_bus_bandwidth_gbps: f64,
    /// Every link of the ring (rank r to rank r+1 mod n), in GB/s, timed all at once as the
    /// ring all-reduce loads them.
    pub links: Vec<LinkBandwidth>,
    /// The link with the least bandwidth, with its ranks' host names.
    pub slowest: LinkBandwidth,
    /// Whether the bus bandwidth reached the minimum; when not, every rank stops with
    /// [`exit::FABRIC_TOO_SLOW`].
    pub passed: bool,
}

/// One link of the ring: what rank `from` sends rank `to` arrives at this bandwidth.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LinkBandwidth {
    /// The sending rank.
    pub from: u64,
    /// The receiving rank (`from` + 1 mod the world size).
    pub to: u64,
    /// Bytes per second over the link, in GB/s (10⁹ bytes).
    pub gbps: f64,
    /// The sending rank's host name, where gathered (the slowest link's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_host: Option<String>,
    /// The receiving rank's host name, where gathered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_host: Option<String>,
}

impl fmt::Display for LinkBandwidth {
    /// `rank 3 → rank 4 (worker-1 → worker-2)`, the hosts when known.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} → rank {}", self.from, self.to)?;
        if let (Some(from), Some(to)) = (&self.from_host, &self.to_host) {
            write!(f, " ({from} → {to})")?;
        }
        Ok(())
    }
}

/// The fabric the gradients cross, as NCCL itself reports it (its INIT and NET account).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Fabric {
    /// The collective: `nccl` or `tcp-ring` (kernel TCP, whatever the network).
    pub collective: String,
    /// The network NCCL uses between hosts on rank 0 (`IB`, `Socket`, a plugin's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<String>,
    /// The transports of rank 0's connected channels (`NET/IB`, `NET/Socket`, `P2P`, `SHM`).
    #[serde(default)]
    pub transports: Vec<String>,
    /// Whether rank 0's network channels read and write GPU memory directly (GPUDirect
    /// RDMA).
    #[serde(default)]
    pub gpu_direct_rdma: bool,
    /// Ranks whose traffic between hosts goes over InfiniBand (NCCL's network `IB`, no
    /// socket channel).
    pub ranks_on_infiniband: u64,
    /// Ranks in all.
    pub world_size: u64,
}

/// How one step's all-reduce of its gradients, in buckets queued while backward still ran,
/// overlapped that backward pass (CUDA events on both streams).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AllReduceTiming {
    /// The step (steps done, as in its progress line).
    pub step: u64,
    /// Buckets of gradients all-reduced.
    pub buckets: u64,
    /// The most buckets queued and not yet reduced at once.
    pub max_in_flight: u64,
    /// Time the all-reduces ran, in milliseconds.
    pub all_reduce_ms: f64,
    /// Of that, time before the backward pass ended: hidden behind it.
    pub hidden_ms: f64,
    /// `hidden_ms` as a share of `all_reduce_ms`, in percent.
    pub hidden_percent: f64,
    /// Time from the backward pass's end to the last all-reduce's end: what the step
    /// waited for.
    pub waited_ms: f64,
}

/// Where a run that started again goes on from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Resumed {
    /// Steps done before, which are not trained again.
    pub step: u64,
    /// The checkpoint read.
    pub path: String,
    /// The earlier run it was written by (`--resume-from`), when not this run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
}

/// A checkpoint on disk.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointWritten {
    /// Steps done when it was taken.
    pub step: u64,
    /// The file.
    pub path: String,
    /// Time spent writing it, beside training.
    pub seconds: f64,
}

/// Where the trainer computes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceChoice {
    /// What `--device` asked for.
    pub requested: Device,
    /// What it computes on.
    pub device: Device,
    /// Why `auto` chose the CPU, when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// A progress line.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Progress {
    /// Steps done.
    pub step: u64,
    /// Mean loss over the ranks at this step.
    pub loss: Option<f64>,
    /// Accuracy over the global batch.
    pub accuracy: Option<f64>,
    /// Learning rate of the step.
    pub learning_rate: f64,
    /// Images per second since the first step (none before the second).
    pub images_per_second: Option<f64>,
    /// Images per second since the previous progress line (the recent rate: what the time
    /// left is estimated from).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recent_images_per_second: Option<f64>,
    /// The steps the run trains in all, when known: the job's percent done and time left
    /// come from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_steps: Option<u64>,
}

/// The trainer's summary: the last line of rank 0's stdout, which `ringmaster-trainer launch`
/// writes to the launcher pod's termination message and the operator reads into
/// `status.result`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Summary {
    /// Training throughput over every rank, after the first step.
    pub images_per_second: f64,
    /// Steps trained.
    pub steps: u64,
    /// Mean loss over the ranks at the last step (none when it was not a number).
    pub final_loss: Option<f64>,
    /// Accuracy over the last global batch.
    pub final_accuracy: Option<f64>,
    /// Ranks.
    pub world_size: u64,
    /// Images per step over every rank.
    pub global_batch: u64,
    /// Parameters of the network.
    pub parameters: u64,
    /// Wall time of the run.
    pub seconds: f64,
    /// Steps restored from a checkpoint at the start (the run had started before and
    /// stopped): `steps` less this many were trained by this start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from_step: Option<u64>,
    /// The earlier run (`--resume-from`) whose checkpoint this start went on from, when it
    /// was not this run's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from_run: Option<String>,
}

impl Summary {
    /// The JSON line the trainer prints.
    pub fn to_line(&self) -> String {
        serde_json::to_string(&Line::Summary(self.clone())).expect("a summary serializes")
    }

    /// The summary in a text: the last line that parses as one (a termination message may
    /// hold other lines, or the log's tail).
    pub fn find_in(text: &str) -> Option<Summary> {
        text.lines()
            .rev()
            .find_map(|line| match serde_json::from_str::<Line>(line.trim()) {
                Ok(Line::Summary(summary)) => Some(summary),
                _ => None,
            })
    }
}

/// Why a rank of the trainer stopped: the last line a failing rank prints on stdout.
/// `ringmaster-trainer launch` writes the failure that caused the others (the first that is
/// not a lost peer) to the launcher's termination message when no summary came, so the
/// TrainingJob shows the trainer's error rather than the tail of `mpirun`'s log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Failure {
    /// The rank that failed; none when it failed before it knew its rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<u64>,
    /// The error, as the trainer printed it (never a credential: the trainer holds none).
    pub error: String,
    /// The code the rank exits with ([`exit`]).
    pub exit_code: u8,
}

impl Failure {
    /// The most a failure line takes, escapes included: the termination message it goes to
    /// holds 4096 bytes.
    pub const MAX_LINE_BYTES: usize = 4000;

    /// The JSON line the trainer prints, its error shortened ([`crate::shorten`]) until the
    /// line fits [`Failure::MAX_LINE_BYTES`] (JSON escapes can make a byte six).
    pub fn to_line(&self) -> String {
        let mut keep = Self::MAX_LINE_BYTES;
        loop {
            let failure = Failure {
                error: crate::shorten(&self.error, keep),
                ..self.clone()
            };
            let line = serde_json::to_string(&Line::Failed(failure)).expect("a failure serializes");
            if line.len() <= Self::MAX_LINE_BYTES || keep == 0 {
                return line;
            }
            // In proportion to how far over it is (escapes grow the error evenly), and by at
            // least a byte, so it ends.
            keep = (keep * Self::MAX_LINE_BYTES / line.len()).min(keep - 1);
        }
    }

    /// The failure that caused the others among a text's lines: the first that is not a
    /// lost peer. None when every rank that spoke only lost a peer: the cause is elsewhere
    /// (a rank killed by a signal, which `mpirun`'s own report names).
    pub fn find_in(text: &str) -> Option<Failure> {
        text.lines()
            .filter_map(|line| match serde_json::from_str::<Line>(line.trim()) {
                Ok(Line::Failed(failure)) => Some(failure),
                _ => None,
            })
            .find(|failure| failure.exit_code != exit::PEER_LOST)
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.rank {
            Some(rank) => write!(f, "rank {rank}: {}", self.error),
            None => f.write_str(&self.error),
        }
    }
}

/// The trainer's exit codes. `ringmaster-trainer launch` keeps them through `mpirun`.
pub mod exit {
    /// Trained to the end.
    pub const SUCCESS: u8 = 0;
    /// Failed in a way a restart would repeat (unreadable data, a checkpoint not written).
    pub const FAILED: u8 = 1;
    /// The command line did not parse (clap's code).
    pub const USAGE: u8 = 2;
    /// The settings cannot run on this trainer (`TrainArgs::check`); sysexits' EX_USAGE.
    pub const INVALID_SETTINGS: u8 = 64;
    /// The preflight measured the fabric below `--preflight-min-bus-gbps`: a verdict on the
    /// nodes, which a restart on the same nodes would repeat; sysexits' EX_UNAVAILABLE.
    pub const FABRIC_TOO_SLOW: u8 = 69;
    /// A peer rank was lost (it died, was killed, or stopped answering): the gang is
    /// incomplete and a restart of the whole gang can succeed; sysexits' EX_TEMPFAIL.
    pub const PEER_LOST: u8 = 75;
    /// The trainer panicked (Rust's code for it): a bug, or a GPU error it does not
    /// recover from; its message is in the rank's [`super::Failure`] line.
    pub const PANICKED: u8 = 101;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn everything_set() -> TrainArgs {
        TrainArgs {
            model: Model::Cifar20,
            width: 8,
            collective: CollectiveKind::TcpRing,
            device: Device::Cuda,
            precision: Precision::Bf16,
            batch_size: 96,
            micro_batches: 3,
            image_size: 48,
            steps: None,
            epochs: Some(7),
            learning_rate: Some(0.0375),
            warmup_steps: 5,
            warmup_epochs: None,
            schedule: Schedule::Step,
            momentum: 0.8,
            weight_decay: 1e-4,
            label_smoothing: 0.1,
            synthetic: false,
            data_dir: Some("/data/imagenet".into()),
            decoder: Decoder::Nvjpeg,
            learnable_classes: None,
            dataset_size: 512,
            classes: 10,
            seed: 42,
            output_dir: Some("/output/job".into()),
            log_every: 1,
            checkpoint_every: Some(250),
            checkpoint_minutes: 2.5,
            keep_checkpoints: 5,
            run_id: Some("0b7f0d6e-3c1a-4f9e-9a51-6f0c2d1e4b7a".into()),
            resume_from: Some("5d1c7a2e-8b4f-4e0a-9c3d-2f6e1b7a9c40".into()),
            preflight_min_bus_gbps: Some(12.5),
            preflight_bytes: 8 << 20,
        }
    }

    #[test]
    fn flags_parse_back_to_the_same_settings() {
        let mut synthetic = TrainArgs {
            synthetic: true,
            steps: Some(3),
            ..TrainArgs::default()
        };
        synthetic.learnable_classes = None;
        let learnable = TrainArgs {
            learnable_classes: Some(4),
            learning_rate: Some(1.6),
            ..TrainArgs::default()
        };
        let warmed_by_epochs = TrainArgs {
            warmup_epochs: Some(2.5),
            ..TrainArgs::default()
        };
        for args in [
            TrainArgs::default(),
            everything_set(),
            synthetic,
            learnable,
            warmed_by_epochs,
        ] {
            let flags = args.to_args();
            let parsed =
                TrainArgs::parse_flags(&flags).unwrap_or_else(|e| panic!("{flags:?}: {e}"));
            assert_eq!(parsed, args, "{flags:?}");
        }
    }

    #[test]
    fn this_release_computes_in_bf16_on_the_gpu_only() {
        let caps = Capabilities::this_release();
        assert_eq!(everything_set().check(&caps), Ok(()));
        let fp32_on_cpu = TrainArgs {
            device: Device::Cpu,
            precision: Precision::Fp32,
            ..everything_set()
        };
        assert_eq!(fp32_on_cpu.check(&caps), Ok(()));
        let auto = TrainArgs {
            device: Device::Auto,
            ..everything_set()
        };
        assert_eq!(auto.check(&caps), Ok(()), "auto is decided on the machine");
        let bf16_on_cpu = TrainArgs {
            device: Device::Cpu,
            ..everything_set()
        };
        let errors = bf16_on_cpu.check(&caps).unwrap_err();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].setting, Setting::Precision);
        assert!(
            errors[0]
                .to_string()
                .starts_with("--precision: bf16 computes on the CUDA engine only"),
            "{}",
            errors[0]
        );
    }

    #[test]
    fn a_trainer_without_the_cuda_engine_refuses_the_gpu_with_the_reason() {
        let cpu_only = Capabilities {
            devices: vec![Device::Cpu],
            precisions: vec![Precision::Fp32],
            ..Capabilities::this_release()
        };
        let errors = everything_set().check(&cpu_only).unwrap_err();
        let settings: Vec<Setting> = errors.iter().map(|e| e.setting).collect();
        assert_eq!(settings, vec![Setting::Device, Setting::Precision]);
        assert!(
            errors[0].to_string().starts_with("--device: "),
            "{}",
            errors[0]
        );
        assert!(
            errors[0].message.contains("no CUDA engine"),
            "{}",
            errors[0]
        );
        assert!(
            errors[1].message.contains("cannot compute in bf16"),
            "{}",
            errors[1]
        );
    }

    #[test]
    fn impossible_numbers_are_refused() {
        let caps = Capabilities::this_release();
        let bad = TrainArgs {
            batch_size: 10,
            micro_batches: 3,
            image_size: 16,
            steps: Some(0),
            learning_rate: Some(f32::NAN),
            classes: 0,
            checkpoint_every: Some(0),
            ..TrainArgs::default()
        };
        let settings: Vec<Setting> = bad
            .check(&caps)
            .unwrap_err()
            .iter()
            .map(|e| e.setting)
            .collect();
        assert_eq!(
            settings,
            vec![
                Setting::MicroBatches,
                Setting::ImageSize,
                Setting::Length,
                Setting::LearningRate,
                Setting::Classes,
                Setting::Checkpoint
            ]
        );
        let negative = TrainArgs {
            checkpoint_minutes: -1.0,
            ..TrainArgs::default()
        };
        let errors = negative.check(&caps).unwrap_err();
        assert_eq!(errors[0].setting, Setting::Checkpoint);
        assert!(errors[0].message.contains("-1 is not a number of minutes"));
        let beyond = TrainArgs {
            checkpoint_minutes: 1e30,
            ..TrainArgs::default()
        };
        assert_eq!(
            beyond.check(&caps).unwrap_err()[0].setting,
            Setting::Checkpoint
        );
    }

    #[test]
    fn a_preflight_needs_a_positive_threshold_and_a_message_of_bandwidth_size() {
        let caps = Capabilities::this_release();
        let refused = |args: TrainArgs| -> Vec<String> {
            match args.check(&caps) {
                Ok(()) => Vec::new(),
                Err(errors) => errors.iter().map(ToString::to_string).collect(),
            }
        };
        for gbps in [0.0, -3.0, f64::NAN, f64::INFINITY] {
            let errors = refused(TrainArgs {
                preflight_min_bus_gbps: Some(gbps),
                ..TrainArgs::default()
            });
            assert_eq!(errors.len(), 1, "{gbps}: {errors:?}");
            assert!(
                errors[0].starts_with("--preflight-min-bus-gbps/--preflight-bytes: ")
                    && errors[0].contains("not a bus bandwidth"),
                "{errors:?}"
            );
        }
        for bytes in [
            0,
            MIN_PREFLIGHT_BYTES - 4,
            MAX_PREFLIGHT_BYTES + 4,
            (4 << 20) + 2,
        ] {
            let errors = refused(TrainArgs {
                preflight_min_bus_gbps: Some(1.0),
                preflight_bytes: bytes,
                ..TrainArgs::default()
            });
            assert_eq!(errors.len(), 1, "{bytes}: {errors:?}");
            assert!(errors[0].contains("not a preflight message"), "{errors:?}");
        }
        let fine = TrainArgs {
            preflight_min_bus_gbps: Some(0.5),
            preflight_bytes: MIN_PREFLIGHT_BYTES,
            ..TrainArgs::default()
        };
        assert_eq!(refused(fine.clone()), Vec::<String>::new());
        // The trainer's own parser reads back what the operator writes.
        let flags = fine.to_args();
        assert!(
            flags.contains(&"--preflight-min-bus-gbps=0.5".to_string())
                && flags.contains(&format!("--preflight-bytes={MIN_PREFLIGHT_BYTES}")),
            "{flags:?}"
        );
        assert_eq!(TrainArgs::parse_flags(&flags).unwrap(), fine);
        // No preflight asked for: no flag, so an older trainer runs the same command.
        assert!(
            !TrainArgs::default()
                .to_args()
                .iter()
                .any(|f| f.starts_with("--preflight")),
        );
    }

    #[test]
    fn the_preflight_line_names_the_slowest_link_with_its_hosts() {
        let link = |from, to, gbps| LinkBandwidth {
            from,
            to,
            gbps,
            from_host: None,
            to_host: None,
        };
        let slowest = LinkBandwidth {
            from_host: Some("job-worker-1".into()),
            to_host: Some("job-worker-2".into()),
            ..link(1, 2, 0.75)
        };
        assert_eq!(
            slowest.to_string(),
            "rank 1 → rank 2 (job-worker-1 → job-worker-2)"
        );
        assert_eq!(link(2, 0, 3.0).to_string(), "rank 2 → rank 0");
        let preflight = Preflight {
            collective: "tcp-ring".into(),
            world_size: 3,
            bytes: 64 << 20,
            bus_bandwidth_gbps: 1.25,
            min_bus_bandwidth_gbps: 2.0,
            links: vec![link(2, 0, 3.0), link(0, 1, 2.5), link(1, 2, 0.75)],
            slowest,
            passed: false,
        };
        let line = serde_json::to_string(&Line::Preflight(preflight.clone())).unwrap();
        assert!(line.starts_with(r#"{"event":"preflight","#), "{line}");
        assert!(line.contains(r#""busBandwidthGbps":1.25"#), "{line}");
        assert!(line.contains(r#""fromHost":"job-worker-1""#), "{line}");
        assert_eq!(
            serde_json::from_str::<Line>(&line).unwrap(),
            Line::Preflight(preflight)
        );
    }

    #[test]
    fn a_run_id_names_one_folder_and_a_run_keeps_a_checkpoint_at_least() {
        let caps = Capabilities::this_release();
        let refused = |args: TrainArgs| -> Vec<String> {
            args.check(&caps)
                .unwrap_err()
                .iter()
                .map(ToString::to_string)
                .collect()
        };
        for id in ["../other", "a/b", "..", "", "x y"] {
            let errors = refused(TrainArgs {
                output_dir: Some("/output/job".into()),
                resume_from: Some(id.into()),
                ..TrainArgs::default()
            });
            assert_eq!(errors.len(), 1, "{id:?}: {errors:?}");
            assert!(
                errors[0].starts_with("--run-id/--resume-from: "),
                "{errors:?}"
            );
        }
        let nowhere = refused(TrainArgs {
            resume_from: Some("uid-1".into()),
            ..TrainArgs::default()
        });
        assert!(nowhere[0].contains("needs --output-dir"), "{nowhere:?}");
        let none_kept = refused(TrainArgs {
            keep_checkpoints: 0,
            ..TrainArgs::default()
        });
        assert!(
            none_kept[0].starts_with("--keep-checkpoints: must be at least 1"),
            "{none_kept:?}"
        );
    }

    #[test]
    fn a_runs_checkpoints_are_in_its_own_folder_and_named_by_their_step() {
        let out = Path::new("/output/job");
        assert_eq!(
            run_dir(out, Some("uid-1")),
            Path::new("/output/job/runs/uid-1")
        );
        assert_eq!(run_dir(out, None), out);
        assert_eq!(checkpoint_file(40), "checkpoint-40.safetensors");
        assert_eq!(checkpoint_step("checkpoint-40.safetensors"), Some(40));
        for other in [
            "checkpoint-40.safetensors.partial",
            "checkpoint-+4.safetensors",
            "checkpoint.safetensors",
            "model.safetensors",
            "checkpoint-.safetensors",
        ] {
            assert_eq!(checkpoint_step(other), None, "{other}");
        }
    }

    #[test]
    fn the_summary_is_found_after_other_lines() {
        let summary = Summary {
            images_per_second: 812.5,
            steps: 20,
            final_loss: Some(2.5),
            final_accuracy: Some(0.25),
            world_size: 4,
            global_batch: 64,
            parameters: 11_689_512,
            seconds: 3.5,
            resumed_from_step: Some(12),
            resumed_from_run: None,
        };
        let step = serde_json::to_string(&Line::Step(Progress {
            step: 1,
            loss: Some(7.0),
            accuracy: Some(0.0),
            learning_rate: 0.1,
            images_per_second: None,
            recent_images_per_second: None,
            total_steps: Some(10),
        }))
        .unwrap();
        assert!(step.contains(r#""event":"step""#), "{step}");
        let text = format!("{step}\n{}\nmpirun: done\n", summary.to_line());
        assert_eq!(Summary::find_in(&text), Some(summary));
        assert_eq!(Summary::find_in(&step), None);
        assert_eq!(Summary::find_in("not json"), None);
    }

    #[test]
    fn the_failure_that_caused_the_others_is_found_among_mpiruns_lines() {
        let failed = |rank, error: &str, exit_code| Failure {
            rank,
            error: error.into(),
            exit_code,
        };
        let lost = failed(Some(1), "the ring lost rank 0", exit::PEER_LOST);
        let cause = failed(Some(0), "decoding /data/train/a/x.jpg: invalid JPEG", 1);
        let line = cause.to_line();
        assert!(line.starts_with(r#"{"event":"failed","rank":0,"#), "{line}");
        let text = format!(
            "{}\n{}\n{}\n------\nmpirun detected that one or more processes exited\n",
            lost.to_line(),
            line,
            failed(Some(2), "also", 1).to_line()
        );
        assert_eq!(Failure::find_in(&text), Some(cause.clone()));
        assert_eq!(
            cause.to_string(),
            "rank 0: decoding /data/train/a/x.jpg: invalid JPEG"
        );
        // Only lost peers: none is the cause.
        assert_eq!(Failure::find_in(&lost.to_line()), None);
        assert_eq!(Failure::find_in("mpirun: done\nnot json"), None);
        // Before the rank is known, none is printed or shown.
        let early = failed(None, "settings: --batch-size must be positive", 64);
        assert!(!early.to_line().contains("rank"), "{}", early.to_line());
        assert_eq!(early.to_string(), "settings: --batch-size must be positive");
    }

    #[test]
    fn a_long_failure_is_cut_to_fit_the_termination_message_escapes_included() {
        for error in ["é".repeat(4000), "\"\u{1}".repeat(3000)] {
            let long = Failure {
                rank: Some(3),
                error: error.clone(),
                exit_code: exit::PANICKED,
            };
            let line = long.to_line();
            assert!(
                line.len() <= Failure::MAX_LINE_BYTES,
                "{} bytes",
                line.len()
            );
            let back = Failure::find_in(&line).expect("the cut line parses");
            assert!(back.error.ends_with("..."), "{}", back.error);
            let kept = back.error.trim_end_matches("...");
            assert!(
                error.starts_with(kept) && kept.len() > 500,
                "{} bytes kept",
                kept.len()
            );
            assert_eq!((back.rank, back.exit_code), (Some(3), 101));
        }
    }

    #[test]
    fn capabilities_print_as_flag_values() {
        let json = serde_json::to_value(Capabilities::this_release()).unwrap();
        assert_eq!(json["devices"], serde_json::json!(["cpu", "cuda"]));
        assert_eq!(json["precisions"], serde_json::json!(["fp32", "bf16"]));
        assert_eq!(json["collectives"][1], "tcp-ring");
        assert_eq!(json["models"][2], "resnet50");
    }
}
