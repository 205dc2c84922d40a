//! The validate steps against YAML fixtures: every sample passes, and every invalid fixture
//! fails with an error that names its field (and says its message).

#[path = "common/mod.rs"]
mod fixtures;

use ringmaster::controller::{data_stage, training_job};
use ringmaster::validation::FieldErrors;
use ringmaster_contract::trainer::{Capabilities, Device, TrainArgs};
use serde_json::Value;

fn validate(object: &Value, old: Option<&Value>) -> Result<(), FieldErrors> {
    match object["kind"].as_str() {
        Some("TrainingJob") => training_job::validate::validate_value(object, old).map(|_| ()),
        Some("DataStage") => data_stage::validate::validate_value(object, old).map(|_| ()),
        other => panic!("unexpected kind {other:?}"),
    }
}

/// Every sample passes validate, and its trainer invocation the trainer's own check: the
/// flagship GPU sample too, since the CUDA engine is part of this release.
#[test]
fn every_sample_is_valid_and_its_trainer_settings_pass_the_trainers_check() {
    let samples = fixtures::yaml_files(&fixtures::root().join("config/samples"));
    assert!(samples.len() >= 4, "samples: {samples:?}");
    let mut kinds = Vec::new();
    let mut on_gpus = 0;
    for path in samples {
        for object in fixtures::ringmaster_objects(&path) {
            let kind = object["kind"].as_str().unwrap_or_default().to_string();
            kinds.push(kind.clone());
            if kind == "DataStage" {
                if let Err(errors) = validate(&object, None) {
                    panic!("{} is invalid: {errors}", path.display());
                }
                continue;
            }
            let job = training_job::validate::validate_value(&object, None)
                .unwrap_or_else(|e| panic!("{} is invalid: {e}", path.display()));
            if let training_job::validate::Program::Trainer(t) = &job.program {
                let parsed = TrainArgs::parse_flags(t.flags()).unwrap();
                assert_eq!(parsed.check(&Capabilities::this_release()), Ok(()));
                if parsed.device == Device::Cuda {
                    on_gpus += 1;
                }
            }
        }
    }
    assert!(kinds.contains(&"TrainingJob".to_string()) && kinds.contains(&"DataStage".to_string()));
    assert_eq!(on_gpus, 1, "the flagship sample trains on GPUs");
}

#[test]
fn every_invalid_fixture_fails_naming_its_field() {
    let fixtures = fixtures::invalid_fixtures();
    assert!(
        fixtures.len() >= 30,
        "only {} invalid fixtures",
        fixtures.len()
    );
    let mut failures = Vec::new();
    for fixture in &fixtures {
        match validate(&fixture.object, fixture.old.as_ref()) {
            Ok(()) => failures.push(format!("{}: accepted", fixture.path.display())),
            Err(errors) => {
                let text = errors.to_string();
                // A rule on the whole object names its field in the message instead.
                let names_field = errors.0.iter().any(|e| e.field == fixture.field)
                    || errors
                        .0
                        .iter()
                        .any(|e| e.field.is_empty() && e.message.contains(&fixture.field));
                let says_message = fixture
                    .message
                    .as_ref()
                    .is_none_or(|m| text.contains(m.as_str()));
                if !names_field || !says_message {
                    failures.push(format!(
                        "{}: wanted field {} and message {:?}, got: {text}",
                        fixture.path.display(),
                        fixture.field,
                        fixture.message
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn an_update_that_keeps_immutable_fields_passes() {
    let path = fixtures::root().join("config/samples/trainingjob-cpu-small.yaml");
    let old = fixtures::ringmaster_objects(&path).remove(0);
    let mut new = old.clone();
    new["spec"]["runPolicy"]["suspend"] = Value::Bool(true);
    training_job::validate::validate_value(&new, Some(&old)).expect("suspend may change");
}

/// Synthetic data in a world whose global batch passes the trainer's default dataset (4,096
/// images: here 4 × 8 GPUs × 256) gets an epoch of one global batch, which the trainer's
/// own parser reads back; a smaller world keeps the default and passes no flag.
#[test]
fn synthetic_data_has_an_epoch_of_at_least_one_global_batch() {
    let path = fixtures::root().join("config/samples/trainingjob-resnet50-nd96asr-v4.yaml");
    let synthetic = |workers: u32| {
        let mut object = fixtures::ringmaster_objects(&path).remove(0);
        object["spec"]["workers"] = workers.into();
        object["spec"]["trainer"]["data"] = "synthetic".into();
        object["spec"]["trainer"]
            .as_object_mut()
            .unwrap()
            .remove("dataPath");
        match training_job::validate::validate_value(&object, None)
            .unwrap()
            .program
        {
            training_job::validate::Program::Trainer(t) => t,
            other => panic!("expected the trainer, got {other:?}"),
        }
    };
    let large = synthetic(4);
    assert_eq!(large.args.dataset_size, 8192);
    let parsed = TrainArgs::parse_flags(large.flags()).unwrap();
    assert_eq!(parsed.dataset_size, 8192, "{:?}", large.flags());
    let small = synthetic(2);
    assert_eq!(small.args.dataset_size, TrainArgs::default().dataset_size);
    assert!(
        !small
            .flags()
            .iter()
            .any(|f| f.starts_with("--dataset-size")),
        "{:?}",
        small.flags()
    );
}

#[test]
fn defaults_are_filled_in() {
    let path = fixtures::root().join("config/samples/trainingjob-resnet50-nd96asr-v4.yaml");
    let job = training_job::validate::validate_value(
        &fixtures::ringmaster_objects(&path).remove(0),
        None,
    )
    .unwrap();
    assert_eq!(
        (
            job.workers,
            job.gpus_per_worker,
            job.slots_per_worker,
            job.world_size()
        ),
        (2, 8, 8, 16)
    );
    let ib = job.infiniband.expect("infiniband on");
    assert_eq!(ib.rdma_resource, "rdma/shared_ib");
    assert_eq!(job.mpi.ssh_port, 2222);
    let pool = job.node_pool.expect("node pool");
    let name = pool.pool_name.expect("derived pool name");
    // 4 letters of the job's name and 8 base-36 characters of a hash of its UID.
    assert!(name.starts_with("resn") && name.len() == 12, "{name}");
    match job.program {
        training_job::validate::Program::Trainer(t) => {
            // 0.1 per 256 images over 16 ranks × 256.
            let lr = t.args.learning_rate.unwrap();
            assert!((lr - 1.6).abs() < 1e-6, "{lr}");
            assert_eq!((t.args.epochs, t.args.steps), (Some(90), None));
            assert_eq!(t.args.data_dir.unwrap().to_str(), Some("/data/imagenet"));
            assert_eq!(
                t.args.output_dir.unwrap().to_str(),
                Some("/output/resnet50-imagenet")
            );
        }
        other => panic!("expected the trainer, got {other:?}"),
    }

    let path = fixtures::root().join("config/samples/datastage-azurite.yaml");
    let stage =
        data_stage::validate::validate_value(&fixtures::ringmaster_objects(&path).remove(0), None)
            .unwrap();
    assert_eq!(
        stage.warnings,
        vec![data_stage::validate::ACCOUNT_KEY_WARNING.to_string()]
    );
    let path = fixtures::root().join("config/samples/datastage-imagenet-azure-sas.yaml");
    let stage =
        data_stage::validate::validate_value(&fixtures::ringmaster_objects(&path).remove(0), None)
            .unwrap();
    assert_eq!(stage.endpoint, "https://mydatasets.blob.core.windows.net");
    assert!(stage.warnings.is_empty());
}

/// The flags that set hosts or counts are refused (the invalid fixtures); everyday mpirun
/// flags, some of whose values look like them, pass.
#[test]
fn everyday_mpirun_flags_pass() {
    let path = fixtures::root().join("config/samples/trainingjob-cpu-small.yaml");
    let mut object = fixtures::ringmaster_objects(&path).remove(0);
    object["spec"]["mpi"]["extraArgs"] = serde_json::json!([
        "--bind-to",
        "none",
        "--map-by",
        "slot",
        "--mca",
        "btl_tcp_if_include",
        "eth0",
        "-x",
        "NCCL_DEBUG=INFO",
        "--report-bindings",
        "--tag-output",
        "-genv",
        "I_MPI_DEBUG=5",
        "--display-map",
        "-nolocal"
    ]);
    training_job::validate::validate_value(&object, None).expect("everyday mpirun flags");
}

/// The samples of your own program (PyTorch DDP, Horovod): each TrainingJob is valid and
/// runs a script its Dockerfile puts where the job looks for it, and the script is Python
/// that compiles. (The DDP sample also trains on the real node: e2e's `real_node`.)
#[test]
fn the_framework_samples_run_the_script_their_image_holds() {
    for sample in ["pytorch-ddp", "horovod"] {
        let dir = fixtures::root().join("config/samples").join(sample);
        let objects = fixtures::ringmaster_objects(&dir.join("trainingjob.yaml"));
        let job = training_job::validate::validate_value(&objects[0], None)
            .unwrap_or_else(|e| panic!("{sample} is invalid: {e}"));
        let training_job::validate::Program::Command(command) = &job.program else {
            panic!("{sample} runs its own program");
        };
        let script = format!("/opt/ringmaster/samples/{sample}/train.py");
        assert_eq!(
            command[..2],
            ["python3".to_string(), script.clone()],
            "{sample}"
        );
        let dockerfile = std::fs::read_to_string(dir.join("Dockerfile")).unwrap();
        assert!(
            dockerfile.contains(&format!("COPY train.py {script}")),
            "{sample}'s Dockerfile puts train.py at {script}"
        );
        let compiled = std::process::Command::new("python3")
            .args(["-m", "py_compile"])
            .arg(dir.join("train.py"))
            .env(
                "PYTHONPYCACHEPREFIX",
                std::env::temp_dir().join("ringmaster-pycache"),
            )
            .output()
            .expect("python3 runs");
        assert!(
            compiled.status.success(),
            "{sample}: {}",
            String::from_utf8_lossy(&compiled.stderr)
        );
    }
}
