//! A run that stops (a peer lost) and starts again goes on from its checkpoint, and ends
//! with the weights of a run that never stopped; another run's checkpoint is not taken.

use std::path::{Path, PathBuf};

use ringmaster_contract::trainer::{Capabilities, TrainArgs, exit};
use ringmaster_trainer::collective::{Collective, CollectiveError, ReduceOp, SingleRank};
use ringmaster_trainer::engine::checkpoint;
use ringmaster_trainer::engine::{Arch, Model};
use ringmaster_trainer::resume::{self, ResumeError};
use ringmaster_trainer::train::{TrainError, run_with};

/// One rank whose peer is lost at its `fails_at`-th all-reduce (counted from 1), as a
/// worker's death reaches the ranks left.
struct PeerLostAt {
    fails_at: usize,
    calls: usize,
}

impl Collective for PeerLostAt {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn name(&self) -> &'static str {
        "peer-lost-at"
    }
    fn all_reduce(&mut self, _data: &mut [f32], _op: ReduceOp) -> Result<(), CollectiveError> {
        self.calls += 1;
        if self.calls == self.fails_at {
            return Err(CollectiveError::PeerLost {
                peer: 1,
                direction: "from",
                source: std::io::ErrorKind::ConnectionReset.into(),
            });
        }
        Ok(())
    }
    fn broadcast(&mut self, _data: &mut [f32], _root: usize) -> Result<(), CollectiveError> {
        Ok(())
    }
}

fn args(output_dir: &Path, run_id: &str) -> TrainArgs {
    let dir = output_dir.to_str().unwrap();
    TrainArgs::parse_flags([
        "--model=cifar8",
        "--width=8",
        "--learnable-classes=4",
        "--image-size=16",
        "--batch-size=16",
        "--dataset-size=256",
        "--learning-rate=0.05",
        "--steps=12",
        "--checkpoint-every=4",
        &format!("--run-id={run_id}"),
        &format!("--output-dir={dir}"),
    ])
    .expect("flags parse")
}

fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("resume-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn weights(path: &Path) -> Vec<f32> {
    let mut model = Model::new(Arch::CifarResNet { depth: 8, width: 8 }, 4, 99);
    checkpoint::load(path, model.params_mut()).expect("the model loads");
    model.params().values.clone()
}

fn checkpoint_metadata(dir: &Path) -> std::collections::BTreeMap<String, String> {
    checkpoint::metadata(&dir.join(resume::FILE)).expect("a checkpoint was written")
}

#[test]
fn a_run_that_lost_a_peer_goes_on_from_its_checkpoint_and_ends_as_if_it_had_not() {
    let caps = Capabilities::this_release();
    let (whole, stopped) = (fresh_dir("whole"), fresh_dir("stopped"));
    let uninterrupted =
        run_with(&args(&whole, "run-a"), &mut SingleRank, &caps, 0).expect("the run trains");
    assert_eq!(uninterrupted.resumed_from_step, None);

    // One all-reduce a step (the loss for the log): the 6th is step 6's, after the
    // checkpoint of step 4 and before the one of step 8.
    let mut lost = PeerLostAt {
        fails_at: 6,
        calls: 0,
    };
    let failed = run_with(&args(&stopped, "run-a"), &mut lost, &caps, 0)
        .expect_err("the peer is lost at step 6");
    assert!(matches!(failed, TrainError::Collective(_)), "{failed}");
    assert_eq!(failed.exit_code(), exit::PEER_LOST);
    assert_eq!(checkpoint_metadata(&stopped)["step"], "4");
    assert_eq!(checkpoint_metadata(&stopped)["run"], "run-a");
    assert!(!stopped.join("model.safetensors").exists());

    let resumed =
        run_with(&args(&stopped, "run-a"), &mut SingleRank, &caps, 0).expect("the run goes on");
    assert_eq!(resumed.resumed_from_step, Some(4));
    assert_eq!(resumed.steps, 12);
    // Weights, batch-norm statistics, momentum, the data's place and the learning rate all
    // came back: the run ends where the uninterrupted one did.
    assert_eq!(resumed.final_loss, uninterrupted.final_loss);
    assert_eq!(
        weights(&stopped.join("model.safetensors")),
        weights(&whole.join("model.safetensors"))
    );
    // Its last checkpoint is step 8's: the last step writes the model instead.
    assert_eq!(checkpoint_metadata(&stopped)["step"], "8");
}

#[test]
fn another_runs_checkpoint_is_not_resumed_from_and_is_overwritten() {
    let caps = Capabilities::this_release();
    let dir = fresh_dir("other-run");
    let mut lost = PeerLostAt {
        fails_at: 6,
        calls: 0,
    };
    run_with(&args(&dir, "run-a"), &mut lost, &caps, 0).expect_err("the peer is lost");
    assert_eq!(checkpoint_metadata(&dir)["run"], "run-a");

    // The same name made anew (another UID) starts from the beginning.
    let other = run_with(&args(&dir, "run-b"), &mut SingleRank, &caps, 0).expect("it trains");
    assert_eq!(other.resumed_from_step, None);
    assert_eq!(checkpoint_metadata(&dir)["run"], "run-b");
    assert_eq!(checkpoint_metadata(&dir)["step"], "8");

    // So does a run with other settings under the same id.
    let mut longer = args(&dir, "run-b");
    longer.steps = Some(16);
    let longer = run_with(&longer, &mut SingleRank, &caps, 0).expect("it trains");
    assert_eq!(longer.resumed_from_step, None);
    assert_eq!(checkpoint_metadata(&dir)["totalSteps"], "16");
}

#[test]
fn a_checkpoint_that_cannot_be_read_stops_the_run_and_says_what_to_do() {
    let caps = Capabilities::this_release();
    let dir = fresh_dir("unreadable");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(resume::FILE), b"not a safetensors file").unwrap();
    let failed =
        run_with(&args(&dir, "run-a"), &mut SingleRank, &caps, 0).expect_err("it is refused");
    assert!(
        matches!(failed, TrainError::Resume(ResumeError::Read { .. })),
        "{failed}"
    );
    let message = failed.to_string();
    assert!(message.contains("checkpoint.safetensors"), "{message}");
    assert!(message.contains("move it away"), "{message}");
    assert_eq!(failed.exit_code(), exit::FAILED);
}
