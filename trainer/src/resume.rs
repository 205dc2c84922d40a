//! The run's checkpoints, which a run that starts again goes on from: a gang restarted after
//! a lost worker, or a preempted job readmitted, trains only what it had not.
//!
//! Rank 0 writes `checkpoint-<step>.safetensors` into the run's own folder,
//! `<output dir>/runs/<run id>/` ([`run_dir`]), every `--checkpoint-every` steps and once
//! `--checkpoint-minutes` have passed since the last: the weights, batch-norm statistics, the
//! momentum, and (as metadata) the steps done and what the run is. A folder per run: a job
//! made again under the same name (another UID, the only way to change what a TrainingJob
//! cannot) never writes over, or prunes, the earlier run's files. Each file is written under
//! a `.partial` name, synced and renamed, so a name always holds a whole checkpoint; once
//! one is, the run's older ones past the newest `--keep-checkpoints` are deleted.
//!
//! Rank 0 takes the state off the device between two steps and writes it on a thread of its
//! own, so training goes on while the file is written (a slow share would otherwise hold
//! every rank at the next all-reduce). At the start, rank 0 reads the newest checkpoint that
//! is this run's ([`Identity`]) — in its folder, or the one file an older trainer wrote in the
//! output folder ([`LEGACY_FILE`], so a job upgraded mid-run keeps its progress) — else, with
//! `--resume-from`, the earlier run's newest, which must be compatible
//! ([`MAY_DIFFER_FROM_EARLIER_RUN`]); every rank takes the step, weights, statistics and
//! momentum from it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ringmaster_contract::trainer::{
    CheckpointWritten, Line, Resumed, TrainArgs, checkpoint_file, checkpoint_step,
};

use crate::collective::{Collective, CollectiveError};
use crate::engine::checkpoint::{self, CheckpointError};
use crate::engine::{Backend, Model, Sgd};

/// The one checkpoint file in the output folder that trainers before per-run folders wrote:
/// read, never written.
pub use ringmaster_contract::trainer::CHECKPOINT_FILE as LEGACY_FILE;
pub use ringmaster_contract::trainer::{RUNS_DIR, run_dir};

/// The momentum's tensor in the file.
const VELOCITY: &str = "optimizer.velocity";

/// The metadata key of the steps done.
const STEP: &str = "step";

/// The metadata key of the run's id.
const RUN: &str = "run";

/// What an earlier run's checkpoint (`--resume-from`) may have that this run does not: its
/// id, its length and its schedule, so a job made again can train on for longer or decay
/// otherwise. The rest of the [`Identity`] (model, width, classes, image size, global batch,
/// learning rate, momentum, weight decay, seed) must be the same: weights of another shape,
/// or momentum of another batch or rate, are not a run to go on with.
pub const MAY_DIFFER_FROM_EARLIER_RUN: [&str; 3] = [RUN, "totalSteps", "schedule"];

/// What a checkpoint must have been written by to be resumed from: the run (`--run-id`, the
/// TrainingJob's UID under Ringmaster) and the settings that decide the weights' path (model,
/// width, classes, image size, global batch, length, learning rate, schedule, momentum,
/// weight decay, seed). Another run's checkpoint is only resumed from when named by
/// `--resume-from`, and then by [`MAY_DIFFER_FROM_EARLIER_RUN`]'s rules.
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
            keys.insert(RUN.to_string(), run.clone());
        }
        Self { keys, total_steps }
    }

    /// Why a checkpoint with `metadata` is not this run's, or `None` when it is.
    pub fn differs_from(&self, metadata: &BTreeMap<String, String>) -> Option<String> {
        self.differences(metadata, &[])
            .into_iter()
            .next()
            .or_else(|| {
                // A run without an id does not take a checkpoint that has one.
                (!self.keys.contains_key(RUN) && metadata.contains_key(RUN)).then(|| {
                    format!(
                        "it belongs to run {}, and this run has no --run-id",
                        metadata[RUN]
                    )
                })
            })
    }

    /// Every setting of this run that a checkpoint with `metadata` has otherwise, but those
    /// named in `ignoring`, in words (`its model is resnet18, this run's resnet50`).
    pub fn differences(
        &self,
        metadata: &BTreeMap<String, String>,
        ignoring: &[&str],
    ) -> Vec<String> {
        let none = "none".to_string();
        self.keys
            .iter()
            .filter(|(key, value)| {
                !ignoring.contains(&key.as_str()) && metadata.get(*key) != Some(value)
            })
            .map(|(key, value)| {
                format!(
                    "its {key} is {}, this run's {value}",
                    metadata.get(key).unwrap_or(&none)
                )
            })
            .collect()
    }
}

/// Where training starts: the step, and the earlier run it goes on from when that is not
/// this run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Start {
    /// Steps already done (0: from the seed).
    pub step: usize,
    /// The `--resume-from` run whose checkpoint was taken; `None` for this run's own (or none).
    pub from_run: Option<String>,
}

/// Where the ranks start: rank 0 finds the checkpoint to go on from ([`choose`]) and hands
/// its step, weights, batch-norm statistics and momentum to every rank; else step 0, with
/// every rank's model as it is. Another run's checkpoint not named by `--resume-from` is said
/// on stderr and left as it is; one that cannot be read, or an earlier run's that is missing
/// or does not fit, is an error.
pub fn restore<B: Backend>(
    args: &TrainArgs,
    identity: &Identity,
    be: &B,
    model: &mut Model<B>,
    sgd: &mut Sgd<B>,
    collective: &mut dyn Collective,
) -> Result<Start, ResumeError> {
    let found = match (&args.output_dir, collective.rank()) {
        (Some(dir), 0) => choose(dir, args, identity)
            .and_then(|chosen| chosen.map(|c| read(c, be, model)).transpose()),
        _ => Ok(None),
    };
    // Every rank learns the outcome, a failure on rank 0 too: the others stop with it rather
    // than wait out the collective's timeout.
    let shared = match &found {
        Ok(found) => found.as_ref().map_or(0, |f| f.chosen.step),
        Err(_) => UNREADABLE,
    };
    let step = share_step(shared, collective)?;
    let found = found?;
    if step == UNREADABLE {
        return Err(ResumeError::OnRankZero);
    }
    if step == 0 {
        return Ok(Start::default());
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
    let from_run = found.and_then(|found| {
        print_line(&Line::Resumed(Resumed {
            step: step as u64,
            path: found.chosen.path.display().to_string(),
            run: found.chosen.from_run.clone(),
        }));
        found.chosen.from_run
    });
    Ok(Start { step, from_run })
}

/// The checkpoint rank 0 goes on from.
#[derive(Debug)]
struct Chosen {
    path: PathBuf,
    step: usize,
    /// The earlier run it belongs to, when not this one.
    from_run: Option<String>,
}

/// A checkpoint's values, read on rank 0.
struct Found {
    chosen: Chosen,
    values: Vec<f32>,
    buffers: Vec<f32>,
    velocity: Vec<f32>,
}

/// The checkpoint to go on from in `output_dir`: this run's newest (a restart, a
/// readmission); else, with `--resume-from`, that earlier run's newest, checked to fit this
/// run; else none.
fn choose(
    output_dir: &Path,
    args: &TrainArgs,
    identity: &Identity,
) -> Result<Option<Chosen>, ResumeError> {
    if let Some(own) = newest_of_this_run(output_dir, args.run_id.as_deref(), identity)? {
        return Ok(Some(own));
    }
    match &args.resume_from {
        Some(from) if args.run_id.as_ref() != Some(from) => {
            newest_of_earlier_run(output_dir, from, identity).map(Some)
        }
        _ => Ok(None),
    }
}

/// This run's newest checkpoint: in its folder, or the file an older trainer wrote in the
/// output folder when it is this run's (a job upgraded mid-run). Others are said on stderr
/// and left as they are.
fn newest_of_this_run(
    output_dir: &Path,
    run_id: Option<&str>,
    identity: &Identity,
) -> Result<Option<Chosen>, ResumeError> {
    let mut newest: Option<Chosen> = None;
    for (path, metadata) in candidates(output_dir, run_id)? {
        if let Some(why) = identity.differs_from(&metadata) {
            eprintln!(
                "ringmaster-trainer: not resuming from {}: {why}; it is left as it is",
                path.display()
            );
            continue;
        }
        let step = step_of(&metadata)
            .filter(|step| (1..identity.total_steps).contains(step))
            .ok_or_else(|| ResumeError::Step {
                path: path.clone(),
                found: metadata.get(STEP).cloned(),
                total_steps: identity.total_steps,
            })?;
        if newest.as_ref().is_none_or(|n| step > n.step) {
            newest = Some(Chosen {
                path,
                step,
                from_run: None,
            });
        }
    }
    Ok(newest)
}

/// The newest checkpoint of the earlier run `from`, which this run must be able to go on
/// with: the same identity but for [`MAY_DIFFER_FROM_EARLIER_RUN`], and steps left to train.
fn newest_of_earlier_run(
    output_dir: &Path,
    from: &str,
    identity: &Identity,
) -> Result<Chosen, ResumeError> {
    let newest = candidates(output_dir, Some(from))?
        .into_iter()
        .filter(|(_, metadata)| metadata.get(RUN).map(String::as_str) == Some(from))
        .filter_map(|(path, metadata)| Some((step_of(&metadata)?, path, metadata)))
        .max_by_key(|(step, _, _)| *step);
    let Some((step, path, metadata)) = newest else {
        return Err(ResumeError::NoCheckpoint {
            run: from.to_string(),
            dir: run_dir(output_dir, Some(from)),
        });
    };
    let differences = identity.differences(&metadata, &MAY_DIFFER_FROM_EARLIER_RUN);
    if !differences.is_empty() {
        return Err(ResumeError::Incompatible {
            run: from.to_string(),
            path,
            differences: differences.join("; "),
        });
    }
    if !(1..identity.total_steps).contains(&step) {
        return Err(ResumeError::NothingLeft {
            run: from.to_string(),
            path,
            step,
            total_steps: identity.total_steps,
        });
    }
    Ok(Chosen {
        path,
        step,
        from_run: Some(from.to_string()),
    })
}

/// A checkpoint file and its metadata.
type WithMetadata = (PathBuf, BTreeMap<String, String>);

/// The checkpoints that may be `run_id`'s, with their metadata (read from their headers
/// alone): those in its folder, and the file an older trainer wrote in the output folder.
fn candidates(output_dir: &Path, run_id: Option<&str>) -> Result<Vec<WithMetadata>, ResumeError> {
    let mut paths = checkpoints_in(&run_dir(output_dir, run_id))?
        .into_iter()
        .map(|(_, path)| path)
        .collect::<Vec<_>>();
    let legacy = output_dir.join(LEGACY_FILE);
    if legacy.exists() {
        paths.push(legacy);
    }
    paths
        .into_iter()
        .map(|path| {
            checkpoint::metadata(&path)
                .map(|metadata| (path.clone(), metadata))
                .map_err(|source| ResumeError::Read { path, source })
        })
        .collect()
}

/// The checkpoints in a run's folder by step, newest first; none when there is no folder.
pub fn checkpoints_in(dir: &Path) -> Result<Vec<(u64, PathBuf)>, ResumeError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(ResumeError::List {
                dir: dir.to_path_buf(),
                source,
            });
        }
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| ResumeError::List {
            dir: dir.to_path_buf(),
            source,
        })?;
        if let Some(step) = entry.file_name().to_str().and_then(checkpoint_step) {
            found.push((step, entry.path()));
        }
    }
    found.sort_by_key(|(step, _)| std::cmp::Reverse(*step));
    Ok(found)
}

/// The steps a checkpoint says it holds.
fn step_of(metadata: &BTreeMap<String, String>) -> Option<usize> {
    metadata.get(STEP).and_then(|s| s.parse::<usize>().ok())
}

fn read<B: Backend>(chosen: Chosen, be: &B, model: &Model<B>) -> Result<Found, ResumeError> {
    let mut host = model.params().weights_to_host(be);
    let mut velocity = vec![0.0; host.values.len()];
    checkpoint::load_with(&chosen.path, &mut host, &mut [(VELOCITY, &mut velocity)]).map_err(
        |source| ResumeError::Read {
            path: chosen.path.clone(),
            source,
        },
    )?;
    Ok(Found {
        chosen,
        values: host.values,
        buffers: host.buffers,
        velocity,
    })
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
    /// The run's folder.
    dir: PathBuf,
    every: Option<usize>,
    interval: Option<Duration>,
    /// Checkpoints to keep.
    keep: usize,
    last: Instant,
    metadata: BTreeMap<String, String>,
    /// The checkpoint being written; its failure names its step.
    writing: Option<JoinHandle<Result<(), (usize, CheckpointError)>>>,
}

impl Checkpointer {
    /// Rank 0's writer into the run's folder of `args.output_dir`, when there is one and
    /// anything asks for checkpoints; `None` on the other ranks.
    pub fn new(args: &TrainArgs, identity: &Identity, rank: usize) -> Option<Self> {
        let dir = args.output_dir.as_ref().filter(|_| rank == 0)?;
        let interval = (args.checkpoint_minutes > 0.0)
            .then(|| Duration::from_secs_f32(args.checkpoint_minutes * 60.0));
        if args.checkpoint_every.is_none() && interval.is_none() {
            return None;
        }
        Some(Self {
            dir: run_dir(dir, args.run_id.as_deref()),
            every: args.checkpoint_every,
            interval,
            keep: args.keep_checkpoints.max(1),
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
    /// its own, once the previous checkpoint is written; then deletes the run's checkpoints
    /// older than the newest `--keep-checkpoints`.
    pub fn write<B: Backend>(&mut self, steps_done: usize, be: &B, model: &Model<B>, sgd: &Sgd<B>) {
        self.finish_writing();
        self.last = Instant::now();
        let store = model.params().weights_to_host(be);
        let velocity = be.download(sgd.velocity(), &[store.values.len()]);
        let mut metadata = self.metadata.clone();
        metadata.insert(STEP.to_string(), steps_done.to_string());
        let (dir, keep) = (self.dir.clone(), self.keep);
        self.writing = Some(std::thread::spawn(move || {
            let started = Instant::now();
            let failed = |e| (steps_done, e);
            std::fs::create_dir_all(&dir).map_err(|source| {
                failed(CheckpointError::Write {
                    path: dir.display().to_string(),
                    source,
                })
            })?;
            let path = dir.join(checkpoint_file(steps_done as u64));
            checkpoint::save_with(&path, &store, &[(VELOCITY, &velocity)], &metadata)
                .map_err(failed)?;
            print_line(&Line::Checkpoint(CheckpointWritten {
                step: steps_done as u64,
                path: path.display().to_string(),
                seconds: started.elapsed().as_secs_f64(),
            }));
            prune(&dir, steps_done as u64, keep);
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

/// Deletes the checkpoints in a run's folder `dir` older than `written` (the one just
/// written whole) but the `keep - 1` newest of them. Ones of later steps (left by an attempt
/// with other settings under the same id) are not older and stay. A file that cannot be
/// deleted is said on stderr: it costs room, not progress.
fn prune(dir: &Path, written: u64, keep: usize) {
    let older = match checkpoints_in(dir) {
        Ok(found) => found.into_iter().filter(|(step, _)| *step < written),
        Err(e) => {
            eprintln!("ringmaster-trainer: warning: old checkpoints were not deleted ({e})");
            return;
        }
    };
    for (_, path) in older.skip(keep.saturating_sub(1)) {
        if let Err(e) = std::fs::remove_file(&path) {
            eprintln!(
                "ringmaster-trainer: warning: {} was not deleted ({e})",
                path.display()
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
    /// The run's folder cannot be listed.
    #[error("{}: the checkpoints cannot be listed ({source})", dir.display())]
    List {
        /// The folder.
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `--resume-from` names a run with no checkpoint here.
    #[error("resumeFrom: run {run} has no checkpoint in {} (a run's checkpoints are in runs/<its UID>/ of its job's output folder: move or copy that folder under this job's {}/ to go on from a job of another name, or remove resumeFrom to start from step 0)", dir.display(), crate::resume::RUNS_DIR)]
    NoCheckpoint {
        /// The earlier run.
        run: String,
        /// Where its checkpoints were looked for.
        dir: PathBuf,
    },
    /// `--resume-from` names a run this one cannot go on with.
    #[error("resumeFrom: run {run}'s checkpoint {} does not fit this run: {differences} (only the length and the schedule may differ: set the others as run {run} had them, or remove resumeFrom to start from step 0)", path.display())]
    Incompatible {
        /// The earlier run.
        run: String,
        /// Its newest checkpoint.
        path: PathBuf,
        /// Every setting that differs, in words.
        differences: String,
    },
    /// `--resume-from` names a run that trained as far as this one would.
    #[error("resumeFrom: run {run}'s checkpoint {} is at step {step}, and this run has {total_steps} steps: nothing is left to train (set more steps, or remove resumeFrom)", path.display())]
    NothingLeft {
        /// The earlier run.
        run: String,
        /// Its newest checkpoint.
        path: PathBuf,
        /// Its steps.
        step: usize,
        /// This run's length.
        total_steps: usize,
    },
    /// Rank 0 could not go on from a checkpoint (its own error says why).
    #[error("rank 0 could not go on from a checkpoint (its error says why)")]
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
