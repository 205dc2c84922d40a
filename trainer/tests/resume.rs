//! A run that stops (a peer lost) and starts again goes on from its checkpoint, and ends
//! with the weights of a run that never stopped, on one rank and on two under `mpirun`;
//! another run's checkpoint is not taken. (Where checkpoints are kept, and going on from an
//! earlier run: checkpoints.rs.)

mod common;

use common::PeerLostAt;

use std::path::{Path, PathBuf};

use ringmaster_contract::trainer::{MODEL_FILE, TrainArgs, exit};
use ringmaster_trainer::collective::SingleRank;
use ringmaster_trainer::engine::checkpoint;
use ringmaster_trainer::engine::{Arch, Model};
use ringmaster_trainer::resume::{self, ResumeError};
use ringmaster_trainer::train::{TrainError, run};

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

/// A saved model's weights and batch-norm statistics.
fn weights(path: &Path) -> (Vec<f32>, Vec<f32>) {
    let mut model = Model::new(Arch::CifarResNet { depth: 8, width: 8 }, 4, 99);
    checkpoint::load(path, model.params_mut()).expect("the model loads");
    (
        model.params().values.clone(),
        model.params().buffers.clone(),
    )
}

/// The metadata of `run`'s newest checkpoint in `dir`.
fn checkpoint_metadata(dir: &Path, run: &str) -> std::collections::BTreeMap<String, String> {
    let run_dir = resume::run_dir(dir, Some(run));
    let (_, newest) = resume::checkpoints_in(&run_dir)
        .expect("the run's folder lists")
        .into_iter()
        .next()
        .expect("a checkpoint was written");
    checkpoint::metadata(&newest).expect("the checkpoint reads")
}

#[test]
fn a_run_that_lost_a_peer_goes_on_from_its_checkpoint_and_ends_as_if_it_had_not() {
    let (whole, stopped) = (fresh_dir("whole"), fresh_dir("stopped"));
    let uninterrupted = run(&args(&whole, "run-a"), &mut SingleRank, 0).expect("the run trains");
    assert_eq!(uninterrupted.resumed_from_step, None);

    // One all-reduce a step (the loss for the log): the 6th is step 6's, after the
    // checkpoint of step 4 and before the one of step 8.
    let mut lost = PeerLostAt {
        fails_at: 6,
        calls: 0,
    };
    let failed =
        run(&args(&stopped, "run-a"), &mut lost, 0).expect_err("the peer is lost at step 6");
    assert!(matches!(failed, TrainError::Collective(_)), "{failed}");
    assert_eq!(failed.exit_code(), exit::PEER_LOST);
    assert_eq!(checkpoint_metadata(&stopped, "run-a")["step"], "4");
    assert_eq!(checkpoint_metadata(&stopped, "run-a")["run"], "run-a");
    assert!(!stopped.join(MODEL_FILE).exists());

    let resumed = run(&args(&stopped, "run-a"), &mut SingleRank, 0).expect("the run goes on");
    assert_eq!(resumed.resumed_from_step, Some(4));
    assert_eq!(resumed.steps, 12);
    // Weights, batch-norm statistics, momentum, the data's place and the learning rate all
    // came back: the run ends where the uninterrupted one did, statistics included.
    assert_eq!(resumed.final_loss, uninterrupted.final_loss);
    assert_eq!(
        weights(&stopped.join(MODEL_FILE)),
        weights(&whole.join(MODEL_FILE))
    );
    // Its last checkpoint is step 8's: the last step writes the model instead.
    assert_eq!(checkpoint_metadata(&stopped, "run-a")["step"], "8");
}

#[test]
fn another_runs_checkpoint_is_not_resumed_from() {
    let dir = fresh_dir("other-run");
    let mut lost = PeerLostAt {
        fails_at: 6,
        calls: 0,
    };
    run(&args(&dir, "run-a"), &mut lost, 0).expect_err("the peer is lost");
    assert_eq!(checkpoint_metadata(&dir, "run-a")["run"], "run-a");

    // The same name made anew (another UID) starts from the beginning, in a folder of its
    // own (checkpoints.rs: it leaves run-a's as they are).
    let other = run(&args(&dir, "run-b"), &mut SingleRank, 0).expect("it trains");
    assert_eq!(other.resumed_from_step, None);
    assert_eq!(checkpoint_metadata(&dir, "run-a")["step"], "4");
    assert_eq!(checkpoint_metadata(&dir, "run-b")["step"], "8");

    // So does a run with other settings under the same id.
    let mut longer = args(&dir, "run-b");
    longer.steps = Some(16);
    let longer = run(&longer, &mut SingleRank, 0).expect("it trains");
    assert_eq!(longer.resumed_from_step, None);
    assert_eq!(checkpoint_metadata(&dir, "run-b")["totalSteps"], "16");
}

#[test]
fn a_checkpoint_that_cannot_be_read_stops_the_run_and_says_what_to_do() {
    let dir = fresh_dir("unreadable");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(resume::LEGACY_FILE), b"not a safetensors file").unwrap();
    let failed = run(&args(&dir, "run-a"), &mut SingleRank, 0).expect_err("it is refused");
    assert!(
        matches!(failed, TrainError::Resume(ResumeError::Read { .. })),
        "{failed}"
    );
    let message = failed.to_string();
    assert!(message.contains("checkpoint.safetensors"), "{message}");
    assert!(message.contains("move it away"), "{message}");
    assert_eq!(failed.exit_code(), exit::FAILED);
}

/// The flags of a small run on `ranks` ranks (a global batch of 16) into `output_dir`.
fn flags(output_dir: &Path, ranks: usize) -> Vec<String> {
    [
        "train",
        "--model=cifar8",
        "--width=8",
        "--learnable-classes=4",
        "--image-size=16",
        "--dataset-size=256",
        "--learning-rate=0.05",
        "--steps=6",
        "--checkpoint-every=2",
        "--run-id=run-m",
        "--log-every=1",
    ]
    .map(String::from)
    .into_iter()
    .chain([
        format!("--batch-size={}", 16 / ranks),
        format!("--output-dir={}", output_dir.display()),
    ])
    .collect()
}

fn succeeded(out: &std::process::Output) -> &[u8] {
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    &out.stdout
}

#[test]
fn two_ranks_go_on_from_rank_0s_checkpoint_with_its_momentum_and_statistics_on_both() {
    let dir = fresh_dir("two-ranks");
    let args = flags(&dir, 2);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let first = common::mpirun(2, &args, &[]);
    let first_summary = common::summary(succeeded(&first));
    assert!(first_summary.get("resumedFromStep").is_none());
    let finished = weights(&dir.join(MODEL_FILE));

    // The finished run's last checkpoint is step 4's: the same run started again goes on from
    // there on both ranks. Rank 1 takes rank 0's momentum: without it, its updates (and so
    // the gradients it adds to rank 0's) would differ, and so would the model.
    let again = common::mpirun(2, &args, &[]);
    let stdout = succeeded(&again);
    let resumed = common::json_lines(stdout)
        .into_iter()
        .find(|l| l["event"] == "resumed")
        .expect("a resumed line");
    assert_eq!(resumed["step"], 4);
    assert_eq!(common::summary(stdout)["resumedFromStep"], 4);
    assert_eq!(common::steps(stdout)[0]["step"], 5, "step 5 comes next");
    assert_eq!(weights(&dir.join(MODEL_FILE)), finished);

    // Rank 0 cannot read it: both ranks stop at once with rank 0's reason, not 60 s later
    // as lost peers.
    let run_dir = resume::run_dir(&dir, Some("run-m"));
    std::fs::write(
        run_dir.join("checkpoint-4.safetensors"),
        b"not a safetensors file",
    )
    .unwrap();
    let broken = common::mpirun(2, &args, &[]);
    assert!(!broken.status.success());
    let failures: Vec<_> = common::json_lines(&broken.stdout)
        .into_iter()
        .filter(|l| l["event"] == "failed")
        .collect();
    let of = |rank: u64| {
        failures
            .iter()
            .find(|l| l["rank"] == rank)
            .unwrap_or_else(|| panic!("rank {rank} said why it stopped: {failures:?}"))
    };
    assert!(
        of(0)["error"].as_str().unwrap().contains("move it away"),
        "{failures:?}"
    );
    assert_eq!(
        of(1)["error"],
        "rank 0 could not go on from a checkpoint (its error says why)"
    );
    assert_eq!(
        of(1)["exitCode"],
        u64::from(exit::FAILED),
        "not a lost peer"
    );
}

#[test]
fn a_checkpoint_that_cannot_be_written_is_said_and_training_goes_on_to_its_model() {
    let dir = fresh_dir("unwritable");
    // The names the files are written under before they are renamed are taken by folders.
    let run_dir = resume::run_dir(&dir, Some("run-m"));
    for step in [2, 4] {
        std::fs::create_dir_all(run_dir.join(format!("checkpoint-{step}.safetensors.partial")))
            .unwrap();
    }
    let args = flags(&dir, 1);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = common::trainer(&args);
    let stdout = succeeded(&out);
    assert_eq!(common::summary(stdout)["steps"], 6);
    let stderr = String::from_utf8_lossy(&out.stderr);
    for step in [2, 4] {
        assert!(
            stderr.contains(&format!(
                "warning: the checkpoint of step {step} was not written"
            )),
            "{stderr}"
        );
    }
    assert_eq!(resume::checkpoints_in(&run_dir).unwrap(), vec![]);
    assert!(dir.join(MODEL_FILE).exists(), "the model is written");
}
