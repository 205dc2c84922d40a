//! `ringmaster-trainer train` end to end: learning, and the proof that all-reduce and
//! sharding are right — four ranks under mpirun end with the same weights as one rank that
//! accumulates the same four micro-batches.

mod common;
use common::{json_lines, summary, trainer};

use std::path::Path;

use ringmaster_trainer::engine::checkpoint;
use ringmaster_trainer::engine::data::{LearnableData, shard};
use ringmaster_trainer::engine::{Arch, CpuBackend, LrKind, LrSchedule, Model, Sgd};

const SMALL: &[&str] = &[
    "train",
    "--model",
    "cifar8",
    "--width",
    "8",
    "--learnable-classes",
    "4",
    "--image-size",
    "16",
    "--learning-rate",
    "0.05",
    "--log-every",
    "1",
];

#[test]
fn training_on_learnable_data_drives_the_loss_down() {
    let out = trainer(
        &[
            SMALL,
            &[
                "--batch-size",
                "32",
                "--steps",
                "60",
                "--dataset-size",
                "1024",
            ],
        ]
        .concat(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let steps = common::steps(&out.stdout);
    let first_loss = steps[0]["loss"].as_f64().unwrap();
    let summary = summary(&out.stdout);
    let final_loss = summary["finalLoss"].as_f64().unwrap();
    let accuracy = summary["finalAccuracy"].as_f64().unwrap();
    assert!(
        final_loss < 0.5 * first_loss,
        "loss {first_loss} → {final_loss}"
    );
    assert!(accuracy > 0.7, "accuracy {accuracy} (chance is 0.25)");
    assert_eq!(summary["steps"], 60);
    let images_per_second = summary["imagesPerSecond"].as_f64().unwrap();
    assert!(images_per_second > 0.0);
    assert_eq!(
        (images_per_second * 10.0).round() / 10.0,
        images_per_second,
        "to a tenth, as the job's status shows it"
    );
    assert!(steps.iter().all(|l| l["learningRate"].is_number()));
    assert_eq!(
        json_lines(&out.stdout)[0]["event"],
        "device",
        "the first line says where it computes"
    );
}

fn weights(path: &Path) -> Vec<f32> {
    weights_and_statistics(path).0
}

/// The weights and the batch-norm statistics of a saved model.
fn weights_and_statistics(path: &Path) -> (Vec<f32>, Vec<f32>) {
    let mut model = Model::new(Arch::CifarResNet { depth: 8, width: 8 }, 4, 99);
    checkpoint::load(path, model.params_mut()).expect("checkpoint loads");
    (
        model.params().values.clone(),
        model.params().buffers.clone(),
    )
}

#[test]
fn four_ranks_end_with_the_weights_of_one_rank_with_the_whole_batch() {
    let dir = std::env::temp_dir().join(format!("equivalence-{}", std::process::id()));
    let (one, four) = (dir.join("one"), dir.join("four"));
    let common = [SMALL, &["--steps", "6", "--dataset-size", "512"]].concat();
    let out = trainer(
        &[
            common.as_slice(),
            &[
                "--batch-size",
                "32",
                "--micro-batches",
                "4",
                "--output-dir",
                one.to_str().unwrap(),
            ],
        ]
        .concat(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let single = summary(&out.stdout);
    let out = common::mpirun(
        4,
        &[
            common.as_slice(),
            &["--batch-size", "8", "--output-dir", four.to_str().unwrap()],
        ]
        .concat(),
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ranks = summary(&out.stdout);
    assert_eq!(ranks["worldSize"], 4);
    assert_eq!(ranks["globalBatch"], single["globalBatch"]);

    let ((a, a_statistics), (b, b_statistics)) = (
        weights_and_statistics(&one.join("model.safetensors")),
        weights_and_statistics(&four.join("model.safetensors")),
    );
    assert_eq!(a.len(), b.len());
    // Only the order of float additions differs (ring vs. sequential accumulation, and the
    // engine's parallel reductions), which moves weights by float rounding, amplified a
    // little by training. Tolerance: the difference is below 1e-4 of the weights' norm.
    let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let difference: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x - y).collect();
    let relative = norm(&difference) / norm(&a);
    eprintln!("relative difference of the weights: {relative:.3e}");
    assert!(
        relative < 1e-4,
        "weights differ by {relative:.3e} of their norm"
    );
    // Each micro-batch keeps statistics of its own, as each rank does, and both save the
    // first's (rank 0's): the same, to rounding.
    let difference: Vec<f32> = a_statistics
        .iter()
        .zip(&b_statistics)
        .map(|(x, y)| x - y)
        .collect();
    let relative = norm(&difference) / norm(&a_statistics);
    eprintln!("relative difference of the batch-norm statistics: {relative:.3e}");
    assert!(
        relative < 1e-5,
        "statistics differ by {relative:.3e} of their norm"
    );
    let initial = Model::new(Arch::CifarResNet { depth: 8, width: 8 }, 4, 0)
        .params()
        .values
        .clone();
    assert!(
        a.iter().zip(&initial).any(|(x, y)| x != y),
        "the weights moved"
    );
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn settings_that_cannot_work_say_why() {
    use ringmaster_contract::trainer::exit;
    for (args, expected, code) in [
        (
            vec!["--device", "cpu", "--precision", "bf16"],
            "--precision: bf16 computes on the CUDA engine only",
            exit::INVALID_SETTINGS,
        ),
        (
            vec!["--data-dir", "/nonexistent-images"],
            "listing /nonexistent-images",
            exit::FAILED,
        ),
        (
            vec!["--batch-size", "30", "--micro-batches", "4"],
            "--micro-batches: 4 must divide the batch size 30",
            exit::INVALID_SETTINGS,
        ),
        (
            vec!["--learning-rate=-1"],
            "--learning-rate: -1 is not a learning rate",
            exit::INVALID_SETTINGS,
        ),
        (
            vec!["--warmup-epochs=-1"],
            "-1 is not a number of epochs",
            exit::INVALID_SETTINGS,
        ),
    ] {
        let out = trainer(
            &[
                "train",
                "--model",
                "cifar8",
                "--image-size",
                "16",
                "--steps",
                "1",
            ]
            .iter()
            .copied()
            .chain(args)
            .collect::<Vec<_>>(),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(i32::from(code)), "{stderr}");
        assert!(stderr.contains(expected), "{stderr}");
    }
}

/// `--warmup-epochs` ramps the rate linearly over that many passes over the dataset (64
/// images in global batches of 16: 4 steps an epoch), then holds it.
#[test]
fn warm_up_in_epochs_ramps_the_rate_over_that_many_passes() {
    let out = trainer(&[
        "train",
        "--model",
        "cifar8",
        "--image-size",
        "16",
        "--classes",
        "4",
        "--dataset-size",
        "64",
        "--batch-size",
        "16",
        "--steps",
        "8",
        "--learning-rate",
        "0.4",
        "--warmup-epochs",
        "1",
        "--schedule",
        "constant",
        "--log-every",
        "1",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rates: Vec<f64> = common::steps(&out.stdout)
        .iter()
        .map(|l| l["learningRate"].as_f64().unwrap())
        .collect();
    let expected = [0.1, 0.2, 0.3, 0.4, 0.4, 0.4, 0.4, 0.4];
    assert_eq!(rates.len(), expected.len(), "{rates:?}");
    for (rate, want) in rates.iter().zip(expected) {
        assert!((rate - want).abs() < 1e-6, "{rates:?}");
    }
}

/// Without a warm-up flag, a global batch above 256 warms up over Goyal et al.'s 5 epochs,
/// at most a fifth of the run; the flags win when given.
#[test]
fn the_default_warm_up_follows_the_global_batch_and_leaves_the_run_room_to_decay() {
    use ringmaster_contract::trainer::TrainArgs;
    use ringmaster_trainer::train::warmup_steps;
    let plain = TrainArgs::default();
    // ImageNet (1,281,167 images) at 16 × 256: 312 steps an epoch.
    assert_eq!(warmup_steps(&plain, 312, 90 * 312, 4096), 5 * 312);
    assert_eq!(
        warmup_steps(&plain, 312, 1000, 4096),
        200,
        "a fifth of a short run"
    );
    assert_eq!(
        warmup_steps(&plain, 312, 1000, 256),
        0,
        "no scaled rate, no warm-up"
    );
    let epochs = |e: f32| TrainArgs {
        warmup_epochs: Some(e),
        ..TrainArgs::default()
    };
    assert_eq!(
        warmup_steps(&epochs(0.0), 312, 1000, 4096),
        0,
        "0 turns it off"
    );
    assert_eq!(warmup_steps(&epochs(2.0), 312, 1000, 256), 624);
    assert_eq!(
        warmup_steps(&epochs(0.001), 312, 1000, 256),
        1,
        "at least a step"
    );
    assert_eq!(
        warmup_steps(&epochs(10.0), 312, 1000, 256),
        1000,
        "never past the end"
    );
    let steps = TrainArgs {
        warmup_steps: 40,
        ..TrainArgs::default()
    };
    assert_eq!(warmup_steps(&steps, 312, 1000, 4096), 40);
}

/// What the GPU tests train with: the operator's flags for the flagship sample, with local
/// folders and a step count, are what this release accepts (and a trainer without the CUDA
/// engine refuses, naming the device and the precision).
#[test]
fn the_flagship_flags_the_gpu_tests_use_parse_and_pass_the_check_with_the_cuda_engine() {
    use ringmaster_contract::trainer::{Capabilities, Device, Precision, TrainArgs};
    let flags = common::flagship_flags(Path::new("/tmp/data"), Path::new("/tmp/out"), 300);
    let args = TrainArgs::parse_flags(&flags).expect("the flags parse");
    assert_eq!(
        (args.device, args.precision, args.batch_size, args.steps),
        (Device::Cuda, Precision::Bf16, 256, Some(300))
    );
    assert_eq!(args.data_dir.as_deref(), Some(Path::new("/tmp/data")));
    assert_eq!(args.check(&Capabilities::this_release()), Ok(()));
    let cpu_only = Capabilities {
        devices: vec![Device::Cpu],
        precisions: vec![Precision::Fp32],
        ..Capabilities::this_release()
    };
    assert_eq!(args.check(&cpu_only).unwrap_err().len(), 2);
}

/// `RINGMASTER_CUDA_GRAPH=1` takes the recorded-step path of `train` (one micro-batch, one
/// rank), which on the CPU runs every step as it comes: it must log the same losses and
/// leave the same weights as the plain path.
#[test]
fn the_recorded_step_path_of_train_trains_as_the_plain_one() {
    let dir = std::env::temp_dir().join(format!("recorded-{}", std::process::id()));
    let run = |name: &str, graph: &str| {
        let out_dir = dir.join(name);
        let args = [
            SMALL,
            &[
                "--batch-size",
                "16",
                "--steps",
                "5",
                "--dataset-size",
                "256",
            ],
            &["--output-dir", out_dir.to_str().unwrap()],
        ]
        .concat();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ringmaster-trainer"))
            .args(&args)
            .env("RINGMASTER_CUDA_GRAPH", graph)
            .output()
            .expect("trainer runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let losses: Vec<f64> = common::steps(&out.stdout)
            .iter()
            .map(|l| l["loss"].as_f64().unwrap())
            .collect();
        (losses, weights(&out_dir.join("model.safetensors")))
    };
    let (plain_losses, plain_weights) = run("plain", "0");
    let (recorded_losses, recorded_weights) = run("recorded", "1");
    assert_eq!(plain_losses.len(), 5);
    assert_eq!(recorded_losses, plain_losses);
    assert_eq!(recorded_weights, plain_weights);
    std::fs::remove_dir_all(&dir).ok();
}

/// `train` uploads each micro-batch while the one before it still computes: it must still
/// give every step the micro-batches its shards name, in order and across an epoch's end.
/// It logs the losses, and leaves the weights, of the same steps written out by hand.
#[test]
fn train_gives_each_step_the_batches_its_shards_name() {
    use ringmaster_contract::trainer::defaults;
    let dir = std::env::temp_dir().join(format!("batch-order-{}", std::process::id()));
    let (steps, micro_batches, micro, dataset, seed) = (6, 2, 8, 64, 7);
    let out = trainer(
        &[
            SMALL,
            &[
                "--batch-size",
                &(micro * micro_batches).to_string(),
                "--micro-batches",
                &micro_batches.to_string(),
                "--steps",
                &steps.to_string(),
                "--dataset-size",
                &dataset.to_string(),
                "--schedule",
                "constant",
                "--seed",
                &seed.to_string(),
                "--output-dir",
                dir.to_str().unwrap(),
            ],
        ]
        .concat(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // As f32, what the trainer computed (serde_json's parse may miss the f64 by an ulp).
    let logged: Vec<f32> = common::steps(&out.stdout)
        .iter()
        .map(|l| l["loss"].as_f64().unwrap() as f32)
        .collect();

    let data = LearnableData::new(4, 16, seed).with_len(dataset);
    let mut model = Model::new(Arch::CifarResNet { depth: 8, width: 8 }, 4, seed);
    let mut sgd = Sgd::on(
        &CpuBackend,
        model.params(),
        defaults::MOMENTUM,
        defaults::WEIGHT_DECAY,
    );
    let schedule = LrSchedule {
        base_lr: 0.05,
        warmup_steps: defaults::WARMUP_STEPS,
        total_steps: steps,
        kind: LrKind::Constant,
    };
    let steps_per_epoch = dataset / micro_batches / micro;
    assert!(steps > steps_per_epoch, "the run crosses an epoch");
    let mut by_hand = Vec::new();
    for step in 0..steps {
        let (epoch, at) = (step / steps_per_epoch, step % steps_per_epoch);
        model.zero_grads();
        let mut loss = 0.0f32;
        for m in 0..micro_batches {
            let indices = shard(dataset, m, micro_batches, epoch, seed);
            let (images, labels) = data.batch(&indices[at * micro..(at + 1) * micro]);
            let scale = 1.0 / micro_batches as f32;
            loss += model
                .forward_backward(&images, &labels, defaults::LABEL_SMOOTHING, scale)
                .loss;
        }
        by_hand.push(loss / micro_batches as f32);
        sgd.step(model.params_mut(), schedule.lr(step));
    }
    assert_eq!(logged, by_hand);
    assert_eq!(
        weights(&dir.join("model.safetensors")),
        model.params().values
    );
    std::fs::remove_dir_all(&dir).ok();
}
