//! The run's checkpoint, which a run that starts again goes on from: a gang restarted after a
//! lost worker, or a preempted job readmitted, trains only what it had not.
//!
//! Rank 0 writes `checkpoint.safetensors` in the output folder every `--checkpoint-every`
//! steps and once `--checkpoint-minutes` have passed since the last: the weights, batch-norm
//! statistics, the momentum, and (as metadata) the steps done and what the run is. It takes
//! the state off the device between two steps and writes it on a thread of its own, so
//! training goes on while the file is written (a slow share would otherwise hold every rank
//! at the next all-reduce). At the start, rank 0 reads the checkpoint when it is this run's
//! ([`Identity`]) and every rank takes the step, weights, statistics and momentum from it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ringmaster_contract::trainer::{CheckpointWritten, Line, Resumed, TrainArgs};

use crate::collective::{Collective, CollectiveError};
use crate::engine::checkpoint::{self, CheckpointError};
use crate::engine::{Backend, Model, Sgd};

/// The checkpoint's file in the output folder.
pub use ringmaster_contract::trainer::CHECKPOINT_FILE as FILE;

/// The momentum's tensor in the file.
const VELOCITY: &str = "optimizer.velocity";

/// The metadata key of the steps done.
const STEP: &str = "step";

/// What a checkpoint must have been written by to be resumed from: the run (`--run-id`, the
/// TrainingJob's UID under Ringmaster) and the settings that decide the weights' path (model,
/// width, classes, image size, global batch, length, learning rate, schedule, momentum,
/// weight decay, seed). Another run's checkpoint is not resumed from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    keys: BTreeMap<String, String>,
    total_steps: usize,
}

impl Identity {
    /// This run's identity.
    pub fn of(args: &TrainArgs, classes: usize, global_batch: usize, total_steps: usize) -> Self {
        let mut keys = BTreeMap::from([
            ("model".to_string(), args.model.to_string()),
            ("width".to_string(), args.width.to_string()),
            ("classes".to_string(), classes.to_string()),
            ("globalBatch".to_string(), global_batch.to_string()),
            ("totalSteps".to_string(), total_steps.to_string()),
            ("seed".to_string(), args.seed.to_string()),
            ("imageSize".to_string(), args.image_size.to_string()),
            (
                "learningRate".to_string(),
                args.learning_rate
                    .map_or("default".to_string(), |lr| lr.to_string()),
            ),
            ("schedule".to_string(), args.schedule.to_string()),
            ("momentum".to_string(), args.momentum.to_string()),
            ("weightDecay".to_string(), args.weight_decay.to_string()),
        ]);
        if let Some(run) = &args.run_id {
            keys.insert("run".to_string(), run.clone());
        }
        Self { keys, total_steps }
    }

    /// Why a checkpoint with `metadata` is not this run's, or `None` when it is.
    pub fn differs_from(&self, metadata: &BTreeMap<String, String>) -> Option<String> {
        let none = "none".to_string();
        self.keys
            .iter()
            .find(|(key, value)| metadata.get(*key) != Some(value))
            .map(|(key, value)| {
                format!(
                    "its {key} is {}, this run's {value}",
                    metadata.get(key).unwrap_or(&none)
                )
            })
            .or_else(|| {
                // A run without an id does not take a checkpoint that has one.
                (!self.keys.contains_key("run") && metadata.contains_key("run")).then(|| {
                    format!(
                        "it belongs to run {}, and this run has no --run-id",
                        metadata["run"]
                    )
                })
            })
    }
}

/// The step the ranks start from: rank 0 reads `args.output_dir`'s checkpoint when it is
/// this run's and hands its step, weights, batch-norm statistics and momentum to every rank;
/// else 0, with every rank's model as it is. Another run's checkpoint is said on stderr and
/// left to be overwritten; one of this run's that cannot be read is an error.
pub fn restore<B: Backend>(
    args: &TrainArgs,
    identity: &Identity,
    be: &B,
    model: &mut Model<B>,
    sgd: &mut Sgd<B>,
    collective: &mut dyn Collective,
) -> Result<usize, ResumeError> {
    let found = match (&args.output_dir, collective.rank()) {
        (Some(dir), 0) => read(&dir.join(FILE), identity, be, model),
        _ => Ok(None),
    };
    // Every rank learns the outcome, a failure on rank 0 too: the others stop with it rather
    // than wait out the collective's timeout.
    let shared = match &found {
        Ok(found) => found.as_ref().map_or(0, |f| f.step),
        Err(_) => UNREADABLE,
    };
    let step = share_step(shared, collective)?;
    let found = found?;
    if step == UNREADABLE {
        return Err(ResumeError::OnRankZero);
    }
    if step == 0 {
        return Ok(0);
    }
    // Rank 0 puts the checkpoint's values in, and every rank takes rank 0's: one trip through
    // the host each. The weights are broadcast by the caller, as at every start.
    let take = |v: &mut [f32], from: Option<&Vec<f32>>| {
        if let Some(from) = from {
            v.copy_from_slice(from);
        }
    };
    let params = model.params_mut();
    if let Some(found) = &found {
        be.with_host(&mut params.values, |v| v.copy_from_slice(&found.values));
    }
    be.with_host(&mut params.buffers, |v| {
        take(v, found.as_ref().map(|f| &f.buffers));
        collective.broadcast(v, 0)
    })?;
    be.with_host(sgd.velocity_mut(), |v| {
        take(v, found.as_ref().map(|f| &f.velocity));
        collective.broadcast(v, 0)
    })?;
    if let Some(found) = found {
        print_line(&Line::Resumed(Resumed {
            step: step as u64,
            path: found.path.display().to_string(),
        }));
    }
    Ok(step)
}

/// A checkpoint of this run, read on rank 0.
struct Found {
    path: PathBuf,
    step: usize,
    values: Vec<f32>,
    buffers: Vec<f32>,
    velocity: Vec<f32>,
}

fn read<B: Backend>(
    path: &Path,
    identity: &Identity,
    be: &B,
    model: &Model<B>,
) -> Result<Option<Found>, ResumeError> {
    let total_steps = identity.total_steps;
    if !path.exists() {
        return Ok(None);
    }
    let metadata = checkpoint::metadata(path).map_err(|source| ResumeError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    if let Some(why) = identity.differs_from(&metadata) {
        eprintln!(
            "ringmaster-trainer: starting from step 0, not from {}: {why}; it will be overwritten",
            path.display()
        );
        return Ok(None);
    }
    let step = metadata
        .get(STEP)
        .and_then(|s| s.parse::<usize>().ok())
        .filter(|step| (1..total_steps).contains(step))
        .ok_or_else(|| ResumeError::Step {
            path: path.to_path_buf(),
            found: metadata.get(STEP).cloned(),
            total_steps,
        })?;
    let mut host = model.params().weights_to_host(be);
    let mut velocity = vec![0.0; host.values.len()];
    checkpoint::load_with(path, &mut host, &mut [(VELOCITY, &mut velocity)]).map_err(|source| {
        ResumeError::Read {
            path: path.to_path_buf(),
            source,
        }
    })?;
    Ok(Some(Found {
        path: path.to_path_buf(),
        step,
        values: host.values,
        buffers: host.buffers,
        velocity,
    }))
}

/// What rank 0 shares for a checkpoint of this run it could not read.
const UNREADABLE: usize = u32::MAX as usize;

/// Rank 0's `step` on every rank, exactly (an f32 holds integers up to 2^24 exactly: the
/// step goes as two 16-bit halves).
fn share_step(step: usize, collective: &mut dyn Collective) -> Result<usize, CollectiveError> {
    let step = u32::try_from(step).unwrap_or(u32::MAX - 1);
    let mut halves = [(step >> 16) as f32, (step & 0xffff) as f32];
    collective.broadcast(&mut halves, 0)?;
    Ok(((halves[0] as usize) << 16) | halves[1] as usize)
}

/// Writes rank 0's checkpoints while training goes on.
pub struct Checkpointer {
    path: PathBuf,
    every: Option<usize>,
    interval: Option<Duration>,
    last: Instant,
    metadata: BTreeMap<String, String>,
    /// The checkpoint being written; its failure names its step.
    writing: Option<JoinHandle<Result<(), (usize, CheckpointError)>>>,
}

impl Checkpointer {
    /// Rank 0's writer into `args.output_dir`, when there is one and anything asks for
    /// checkpoints; `None` on the other ranks.
    pub fn new(args: &TrainArgs, identity: &Identity, rank: usize) -> Option<Self> {
        let dir = args.output_dir.as_ref().filter(|_| rank == 0)?;
        let interval = (args.checkpoint_minutes > 0.0)
            .then(|| Duration::from_secs_f32(args.checkpoint_minutes * 60.0));
        if args.checkpoint_every.is_none() && interval.is_none() {
            return None;
        }
        Some(Self {
            path: dir.join(FILE),
            every: args.checkpoint_every,
            interval,
            last: Instant::now(),
            metadata: identity.keys.clone(),
            writing: None,
        })
    }

    /// Whether a checkpoint is due once `steps_done` steps of `total_steps` are done. Never
    /// after the last: the final model is written then.
    pub fn due(&self, steps_done: usize, total_steps: usize) -> bool {
        steps_done < total_steps
            && (self
                .every
                .is_some_and(|every| steps_done.is_multiple_of(every))
                || self
                    .interval
                    .is_some_and(|interval| self.last.elapsed() >= interval))
    }

    /// Takes the state after `steps_done` steps off the device and writes it on a thread of
    /// its own, once the previous checkpoint is written.
    pub fn write<B: Backend>(&mut self, steps_done: usize, be: &B, model: &Model<B>, sgd: &Sgd<B>) {
        self.finish_writing();
        self.last = Instant::now();
        let store = model.params().weights_to_host(be);
        let velocity = be.download(sgd.velocity(), &[store.values.len()]);
        let mut metadata = self.metadata.clone();
        metadata.insert(STEP.to_string(), steps_done.to_string());
        let path = self.path.clone();
        self.writing = Some(std::thread::spawn(move || {
            let started = Instant::now();
            let failed = |e| (steps_done, e);
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(|source| {
                    failed(CheckpointError::Write {
                        path: dir.display().to_string(),
                        source,
                    })
                })?;
            }
            checkpoint::save_with(&path, &store, &[(VELOCITY, &velocity)], &metadata)
                .map_err(failed)?;
            print_line(&Line::Checkpoint(CheckpointWritten {
                step: steps_done as u64,
                path: path.display().to_string(),
                seconds: started.elapsed().as_secs_f64(),
            }));
            Ok(())
        }));
    }

    /// Waits for the checkpoint being written. One that could not be written (a full or
    /// unreachable share) is said on stderr and training goes on: a restart would go on from
    /// the one before, and the run may well finish and write its model.
    pub fn finish_writing(&mut self) {
        let Some(writing) = self.writing.take() else {
            return;
        };
        let written = writing
            .join()
            .expect("the checkpoint writer does not panic");
        if let Err((step, e)) = written {
            eprintln!(
                "ringmaster-trainer: warning: the checkpoint of step {step} was not written ({e}); training goes on"
            );
        }
    }
}

fn print_line(line: &Line) {
    println!(
        "{}",
        serde_json::to_string(line).expect("a line serializes")
    );
}

/// Why a run could not go on from its checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum ResumeError {
    /// The checkpoint is there but cannot be read.
    #[error("{}: the checkpoint cannot be read ({source}); move it away to start from step 0", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        #[source]
        source: CheckpointError,
    },
    /// This run's checkpoint names no step inside the run.
    #[error("{}: this run's checkpoint is at step {}, not inside the run's {total_steps} steps; move it away to start from step 0", path.display(), found.as_deref().unwrap_or("none"))]
    Step {
        /// The file.
        path: PathBuf,
        /// The step it names.
        found: Option<String>,
        /// The run's length.
        total_steps: usize,
    },
    /// Rank 0 could not read the run's checkpoint (its own error says why).
    #[error("rank 0 could not read the run's checkpoint")]
    OnRankZero,
    /// Handing the checkpoint to the other ranks failed.
    #[error(transparent)]
    Collective(#[from] CollectiveError),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(flags: &[&str]) -> TrainArgs {
        TrainArgs::parse_flags(flags).expect("flags parse")
    }

    #[test]
    fn a_checkpoint_is_this_runs_only_with_its_id_and_what_decides_its_weights() {
        let run = args(&["--run-id=uid-1", "--model=resnet18"]);
        let identity = Identity::of(&run, 1000, 256, 90);
        let mut metadata = identity.keys.clone();
        metadata.insert(STEP.into(), "40".into());
        assert_eq!(identity.differs_from(&metadata), None);

        let other_model = Identity::of(
            &args(&["--run-id=uid-1", "--model=resnet50"]),
            1000,
            256,
            90,
        );
        assert_eq!(
            other_model.differs_from(&metadata).as_deref(),
            Some("its model is resnet18, this run's resnet50")
        );
        let other_uid = Identity::of(
            &args(&["--run-id=uid-2", "--model=resnet18"]),
            1000,
            256,
            90,
        );
        assert_eq!(
            other_uid.differs_from(&metadata).as_deref(),
            Some("its run is uid-1, this run's uid-2")
        );
        let longer = Identity::of(&run, 1000, 256, 180);
        assert_eq!(
            longer.differs_from(&metadata).as_deref(),
            Some("its totalSteps is 90, this run's 180")
        );
        let no_id = Identity::of(&args(&["--model=resnet18"]), 1000, 256, 90);
        assert_eq!(
            no_id.differs_from(&metadata).as_deref(),
            Some("it belongs to run uid-1, and this run has no --run-id")
        );
        metadata.remove("run");
        assert_eq!(no_id.differs_from(&metadata), None);
        assert_eq!(
            identity.differs_from(&metadata).as_deref(),
            Some("its run is none, this run's uid-1")
        );
    }

    #[test]
    fn checkpoints_are_due_every_so_many_steps_or_minutes_but_never_at_the_end() {
        let dir = std::env::temp_dir();
        let by_steps = args(&[
            "--checkpoint-every=4",
            "--checkpoint-minutes=0",
            "--output-dir=/tmp",
        ]);
        let identity = Identity::of(&by_steps, 10, 32, 12);
        let checkpointer = Checkpointer::new(&by_steps, &identity, 0).expect("rank 0 writes");
        let due: Vec<usize> = (1..=12).filter(|s| checkpointer.due(*s, 12)).collect();
        assert_eq!(due, vec![4, 8]);
        assert!(
            Checkpointer::new(&by_steps, &identity, 1).is_none(),
            "only rank 0 writes"
        );

        let by_time = args(&["--output-dir", dir.to_str().unwrap()]);
        let mut checkpointer =
            Checkpointer::new(&by_time, &identity, 0).expect("10 minutes by default");
        assert!(!checkpointer.due(3, 12));
        checkpointer.last = Instant::now() - Duration::from_secs(601);
        assert!(checkpointer.due(3, 12));
        assert!(!checkpointer.due(12, 12));

        let never = args(&["--checkpoint-minutes=0", "--output-dir=/tmp"]);
        assert!(Checkpointer::new(&never, &identity, 0).is_none());
        let nowhere = args(&["--checkpoint-every=4"]);
        assert!(Checkpointer::new(&nowhere, &identity, 0).is_none());
    }
}
