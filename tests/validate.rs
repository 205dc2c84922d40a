//! The validate steps against YAML fixtures: every sample passes, and every invalid fixture
//! fails with an error that names its field (and says its message).

#[path = "common/mod.rs"]
mod fixtures;

use ringmaster::controller::{data_stage, training_job};
use ringmaster::validation::FieldErrors;
use ringmaster_contract::trainer::{Capabilities, TrainArgs};
use serde_json::Value;

fn validate(object: &Value, old: Option<&Value>) -> Result<(), FieldErrors> {
    match object["kind"].as_str() {
        Some("TrainingJob") => training_job::validate::validate_value(object, old).map(|_| ()),
        Some("DataStage") => data_stage::validate::validate_value(object, old).map(|_| ()),
        other => panic!("unexpected kind {other:?}"),
    }
}

/// Every sample is a well-formed spec; on the trainer of this release each either passes
/// validate, whose trainer invocation then passes the trainer's own check, or is refused by
/// validate for exactly what the trainer cannot run, naming the field.
#[test]
fn every_sample_is_valid_or_refused_for_what_this_trainer_cannot_run() {
    let samples = fixtures::yaml_files(&fixtures::root().join("config/samples"));
    assert!(samples.len() >= 4, "samples: {samples:?}");
    let mut kinds = Vec::new();
    let mut refused = Vec::new();
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
            training_job::validate::validate_value_for(&object, None, &fixtures::with_cuda())
                .unwrap_or_else(|e| panic!("{} is invalid: {e}", path.display()));
            match training_job::validate::validate_value(&object, None) {
                Ok(job) => {
                    if let training_job::validate::Program::Trainer(t) = &job.program {
                        let parsed = TrainArgs::parse_flags(t.flags()).unwrap();
                        assert_eq!(parsed.check(&Capabilities::this_release()), Ok(()));
                    }
                }
                Err(errors) => {
                    for e in &errors.0 {
                        assert!(
                            ["spec.gpusPerWorker", "spec.trainer.precision"]
                                .contains(&e.field.as_str())
                                && e.message.contains("CUDA engine"),
                            "{}: {e}",
                            path.display()
                        );
                    }
                    refused.push((
                        path.file_name().unwrap().to_string_lossy().to_string(),
                        errors.fields().join(","),
                    ));
                }
            }
        }
    }
    assert!(kinds.contains(&"TrainingJob".to_string()) && kinds.contains(&"DataStage".to_string()));
    assert_eq!(
        refused,
        vec![(
            "trainingjob-resnet50-nd96asr-v4.yaml".to_string(),
            "spec.gpusPerWorker,spec.trainer.precision".to_string()
        )],
        "the flagship GPU sample waits for the CUDA engine; the CPU sample runs"
    );
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

#[test]
fn defaults_are_filled_in() {
    let path = fixtures::root().join("config/samples/trainingjob-resnet50-nd96asr-v4.yaml");
    // A GPU job: its defaults as a trainer with the CUDA engine would take them.
    let job = training_job::validate::validate_value_for(
        &fixtures::ringmaster_objects(&path).remove(0),
        None,
        &fixtures::with_cuda(),
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
    assert!(name.starts_with("resnet50"), "{name}");
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
