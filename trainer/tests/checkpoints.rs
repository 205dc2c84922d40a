//! Where a run keeps its checkpoints (issue 38, item 5): in a folder of its own under the
//! output, `runs/<run id>/checkpoint-<step>.safetensors`, the newest `--keep-checkpoints`
//! of them; a job made again under the same name (another run id) never writes over the
//! earlier run's files, and goes on from them only when told to (`--resume-from`), and only
//! when they fit. A checkpoint an older trainer wrote (`checkpoint.safetensors` in the
//! output folder) is still resumed from by its own run.
//!
//! These tests name files by their paths and read the trainer's output, not its new types,
//! so the same file builds against a trainer from before per-run folders (and fails there).

mod common;

use common::PeerLostAt;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ringmaster_contract::trainer::{MODEL_FILE, TrainArgs, exit};
use ringmaster_trainer::collective::SingleRank;
use ringmaster_trainer::engine::checkpoint;
use ringmaster_trainer::train::run;

fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("checkpoints-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The flags of a small run of 12 steps, a checkpoint every 2, into `dir` as `run`; `more`
/// add to them or replace them (a flag may not repeat).
fn flags(dir: &Path, run: &str, more: &[&str]) -> Vec<String> {
    let name = |flag: &str| flag.split('=').next().unwrap_or_default().to_string();
    let replaced = |flag: &&str| more.iter().any(|m| name(m) == name(flag));
    [
        "--model=cifar8",
        "--width=8",
        "--learnable-classes=4",
        "--image-size=16",
        "--batch-size=16",
        "--dataset-size=256",
        "--learning-rate=0.05",
        "--steps=12",
        "--checkpoint-every=2",
        "--checkpoint-minutes=0",
        "--log-every=1",
    ]
    .iter()
    .filter(|flag| !replaced(flag))
    .map(|s| s.to_string())
    .chain([
        format!("--run-id={run}"),
        format!("--output-dir={}", dir.display()),
    ])
    .chain(more.iter().map(|s| s.to_string()))
    .collect()
}

fn args(dir: &Path, run: &str, more: &[&str]) -> TrainArgs {
    TrainArgs::parse_flags(flags(dir, run, more)).expect("flags parse")
}

/// `ringmaster-trainer train` with [`flags`], to its end.
fn train(dir: &Path, run: &str, more: &[&str]) -> std::process::Output {
    let mut all = vec!["train".to_string()];
    all.extend(flags(dir, run, more));
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    common::trainer(&all)
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

/// The error of the `failed` line of a run that failed, and its exit code.
fn failure(out: &std::process::Output) -> (String, i32) {
    assert!(
        !out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let failed = common::json_lines(&out.stdout)
        .into_iter()
        .find(|l| l["event"] == "failed")
        .unwrap_or_else(|| {
            panic!(
                "a failed line: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        });
    (
        failed["error"].as_str().unwrap().to_string(),
        out.status.code().unwrap(),
    )
}

/// `run`'s folder of checkpoints in `dir`.
fn run_dir(dir: &Path, run: &str) -> PathBuf {
    dir.join("runs").join(run)
}

/// The steps of the checkpoints in `run`'s folder, in order.
fn steps_kept(dir: &Path, run: &str) -> Vec<u64> {
    let mut steps: Vec<u64> = std::fs::read_dir(run_dir(dir, run))
        .map(|entries| {
            entries
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter_map(|name| {
                    name.strip_prefix("checkpoint-")?
                        .strip_suffix(".safetensors")?
                        .parse()
                        .ok()
                })
                .collect()
        })
        .unwrap_or_default();
    steps.sort_unstable();
    steps
}

/// Every file under `dir`, with its bytes.
fn files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut found = BTreeMap::new();
    let mut folders = vec![dir.to_path_buf()];
    while let Some(folder) = folders.pop() {
        for entry in std::fs::read_dir(&folder).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                folders.push(path);
            } else {
                found.insert(path.clone(), std::fs::read(&path).unwrap());
            }
        }
    }
    found
}

fn resumed_line(stdout: &[u8]) -> serde_json::Value {
    common::json_lines(stdout)
        .into_iter()
        .find(|l| l["event"] == "resumed")
        .expect("a resumed line")
}

#[test]
fn a_job_made_again_under_the_same_name_leaves_the_earlier_runs_files_as_they_are() {
    let dir = fresh_dir("two-runs");
    let mut lost = PeerLostAt {
        fails_at: 7,
        calls: 0,
    };
    run(&args(&dir, "run-a", &[]), &mut lost, 0).expect_err("the peer is lost at step 7");
    let earlier = files(&dir);
    assert!(!earlier.is_empty());

    // Another UID under the same name: from step 0, into a folder of its own, and run-a's
    // files are all there, byte for byte, however many checkpoints run-b writes and prunes.
    let other = run(&args(&dir, "run-b", &[]), &mut SingleRank, 0).expect("it trains");
    assert_eq!(other.resumed_from_step, None);
    let after = files(&dir);
    for (path, bytes) in &earlier {
        assert!(
            after.get(path) == Some(bytes),
            "{} was changed or removed by another run",
            path.display()
        );
    }
    assert_eq!(steps_kept(&dir, "run-a"), vec![2, 4, 6]);
    assert_eq!(steps_kept(&dir, "run-b"), vec![6, 8, 10]);
}

#[test]
fn a_run_keeps_its_newest_checkpoints_and_deletes_only_older_ones_of_its_own() {
    let dir = fresh_dir("keep");
    // Another run's folder, with more checkpoints than this run keeps.
    let other = run_dir(&dir, "run-other");
    std::fs::create_dir_all(&other).unwrap();
    for step in [2, 4, 6, 8] {
        std::fs::write(other.join(format!("checkpoint-{step}.safetensors")), b"x").unwrap();
    }
    // Three by default: 2, 4, 6, 8, 10 written; 2 and 4 deleted, each once a newer was whole.
    let out = train(&dir, "run-k", &[]);
    let stdout = succeeded(&out);
    let written: Vec<u64> = common::json_lines(stdout)
        .into_iter()
        .filter(|l| l["event"] == "checkpoint")
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(written, vec![2, 4, 6, 8, 10]);
    assert_eq!(steps_kept(&dir, "run-k"), vec![6, 8, 10]);
    assert_eq!(steps_kept(&dir, "run-other"), vec![2, 4, 6, 8]);
    assert!(dir.join(MODEL_FILE).exists());

    let one = fresh_dir("keep-one");
    succeeded(&train(&one, "run-k", &["--keep-checkpoints=1"]));
    assert_eq!(steps_kept(&one, "run-k"), vec![10]);
}

#[test]
fn a_checkpoint_not_written_deletes_none_of_the_older_ones() {
    let dir = fresh_dir("keep-on-failure");
    // Step 8's checkpoint cannot take its `.partial` name; the run ends at step 9.
    let folder = run_dir(&dir, "run-f");
    std::fs::create_dir_all(folder.join("checkpoint-8.safetensors.partial")).unwrap();
    let out = train(&dir, "run-f", &["--steps=9", "--keep-checkpoints=2"]);
    succeeded(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("the checkpoint of step 8 was not written"),
        "{stderr}"
    );
    // 2 went when 6 was written; 4 and 6 stay, as 8 never was.
    assert_eq!(steps_kept(&dir, "run-f"), vec![4, 6]);
}

#[test]
fn a_new_run_goes_on_from_an_earlier_runs_checkpoint_when_told_to() {
    let dir = fresh_dir("resume-from");
    let whole = fresh_dir("resume-from-whole");
    let uninterrupted = run(&args(&whole, "run-a", &[]), &mut SingleRank, 0).expect("it trains");
    let mut lost = PeerLostAt {
        fails_at: 7,
        calls: 0,
    };
    run(&args(&dir, "run-a", &[]), &mut lost, 0).expect_err("the peer is lost at step 7");
    let earlier = files(&dir);

    // run-b, told to, starts at run-a's step 6 and ends where run-a would have.
    let out = train(&dir, "run-b", &["--resume-from=run-a"]);
    let stdout = succeeded(&out);
    let resumed = resumed_line(stdout);
    assert_eq!(resumed["step"], 6);
    assert_eq!(resumed["run"], "run-a");
    let summary = common::summary(stdout);
    assert_eq!(summary["resumedFromStep"], 6);
    assert_eq!(summary["resumedFromRun"], "run-a");
    assert_eq!(common::steps(stdout)[0]["step"], 7, "step 7 comes next");
    assert_eq!(
        summary["finalLoss"].as_f64(),
        uninterrupted.final_loss,
        "run-a's weights, statistics, momentum and data order came back"
    );
    for (path, bytes) in &earlier {
        assert!(after_is(path, bytes), "{} was changed", path.display());
    }
    assert_eq!(steps_kept(&dir, "run-b"), vec![8, 10]);

    // run-b started again (a gang restart) goes on from its own newest, not from run-a.
    let again = train(&dir, "run-b", &["--resume-from=run-a"]);
    let stdout = succeeded(&again);
    assert_eq!(resumed_line(stdout)["step"], 10);
    let summary = common::summary(stdout);
    assert_eq!(summary["resumedFromStep"], 10);
    assert!(summary.get("resumedFromRun").is_none(), "{summary}");

    // Longer than run-a, and with another schedule: it may.
    let longer = train(
        &dir,
        "run-c",
        &["--resume-from=run-a", "--steps=20", "--schedule=step"],
    );
    let stdout = succeeded(&longer);
    assert_eq!(common::summary(stdout)["resumedFromStep"], 6);
    assert_eq!(common::summary(stdout)["steps"], 20);
}

fn after_is(path: &Path, bytes: &[u8]) -> bool {
    std::fs::read(path).is_ok_and(|now| now == bytes)
}

#[test]
fn an_earlier_run_that_does_not_fit_or_is_not_there_is_refused_saying_why() {
    let dir = fresh_dir("resume-from-refused");
    let mut lost = PeerLostAt {
        fails_at: 7,
        calls: 0,
    };
    run(&args(&dir, "run-a", &[]), &mut lost, 0).expect_err("the peer is lost at step 7");

    // Another network and global batch: every difference is named, and nothing is written.
    let out = train(
        &dir,
        "run-b",
        &["--resume-from=run-a", "--width=4", "--batch-size=8"],
    );
    let (error, code) = failure(&out);
    assert_eq!(code, i32::from(exit::FAILED), "not worth a restart");
    assert!(
        error.starts_with("resumeFrom: run run-a's checkpoint "),
        "{error}"
    );
    assert!(
        error.contains("checkpoint-6.safetensors does not fit this run"),
        "{error}"
    );
    assert!(error.contains("its width is 8, this run's 4"), "{error}");
    assert!(
        error.contains("its globalBatch is 16, this run's 8"),
        "{error}"
    );
    assert!(
        !error.contains("totalSteps"),
        "the length may differ: {error}"
    );
    assert!(!run_dir(&dir, "run-b").exists());

    // Another model altogether.
    let (error, _) = failure(&train(
        &dir,
        "run-b",
        &["--resume-from=run-a", "--model=cifar20"],
    ));
    assert!(
        error.contains("its model is cifar8, this run's cifar20"),
        "{error}"
    );

    // A run with no checkpoint here.
    let (error, code) = failure(&train(&dir, "run-b", &["--resume-from=run-z"]));
    assert_eq!(code, i32::from(exit::FAILED));
    assert!(
        error.starts_with("resumeFrom: run run-z has no checkpoint in "),
        "{error}"
    );
    assert!(error.contains("runs/run-z"), "{error}");

    // Nothing left to train.
    let (error, _) = failure(&train(&dir, "run-b", &["--resume-from=run-a", "--steps=6"]));
    assert!(
        error.contains("is at step 6, and this run has 6 steps"),
        "{error}"
    );

    // A path is not a run id.
    let (error, code) = failure(&train(&dir, "run-b", &["--resume-from=../run-a"]));
    assert_eq!(code, i32::from(exit::INVALID_SETTINGS));
    assert!(error.contains("is not a run id"), "{error}");
}

/// An older trainer wrote one `checkpoint.safetensors` in the output folder: the same
/// checkpoint, at the place it had.
fn as_an_older_trainer_left_it(dir: &Path) {
    let newest = files(dir)
        .into_keys()
        .filter(|p| p.to_string_lossy().ends_with(".safetensors"))
        .filter(|p| p.file_name().unwrap() != MODEL_FILE)
        .max_by_key(|p| {
            checkpoint::metadata(p).unwrap()["step"]
                .parse::<u64>()
                .unwrap()
        })
        .expect("a checkpoint");
    let legacy = dir.join("checkpoint.safetensors");
    if newest != legacy {
        std::fs::rename(&newest, &legacy).unwrap();
        let _ = std::fs::remove_dir_all(dir.join("runs"));
    }
}

#[test]
fn a_checkpoint_an_older_trainer_wrote_is_resumed_by_its_own_run_only() {
    let dir = fresh_dir("legacy");
    let whole = fresh_dir("legacy-whole");
    let uninterrupted = run(&args(&whole, "run-l", &[]), &mut SingleRank, 0).expect("it trains");
    let mut lost = PeerLostAt {
        fails_at: 7,
        calls: 0,
    };
    run(&args(&dir, "run-l", &[]), &mut lost, 0).expect_err("the peer is lost at step 7");
    as_an_older_trainer_left_it(&dir);
    let legacy = dir.join("checkpoint.safetensors");
    let legacy_bytes = std::fs::read(&legacy).unwrap();

    // Another run (the job made again under the same name) does not take it, nor touch it.
    let other = run(&args(&dir, "run-x", &[]), &mut SingleRank, 0).expect("it trains");
    assert_eq!(other.resumed_from_step, None);
    assert!(after_is(&legacy, &legacy_bytes));

    // Its own run, upgraded mid-run, goes on from it and ends as if it had not stopped.
    let resumed = run(&args(&dir, "run-l", &[]), &mut SingleRank, 0).expect("it goes on");
    assert_eq!(resumed.resumed_from_step, Some(6));
    assert_eq!(resumed.final_loss, uninterrupted.final_loss);
    assert!(after_is(&legacy, &legacy_bytes), "left as it was");
}

#[test]
fn a_job_made_again_goes_on_from_an_older_trainers_checkpoint_when_told_to() {
    let dir = fresh_dir("legacy-resume-from");
    let mut lost = PeerLostAt {
        fails_at: 7,
        calls: 0,
    };
    run(&args(&dir, "run-l", &[]), &mut lost, 0).expect_err("the peer is lost at step 7");
    as_an_older_trainer_left_it(&dir);
    let out = train(&dir, "run-n", &["--resume-from=run-l"]);
    let stdout = succeeded(&out);
    assert_eq!(common::summary(stdout)["resumedFromStep"], 6);
    assert_eq!(common::summary(stdout)["resumedFromRun"], "run-l");
}
