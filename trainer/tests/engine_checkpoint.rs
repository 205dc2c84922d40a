//! Checkpoint round-trips through safetensors.

use std::collections::BTreeMap;

use ringmaster_trainer::engine::checkpoint::{self, CheckpointError};
use ringmaster_trainer::engine::data::LearnableData;
use ringmaster_trainer::engine::{Arch, Model};

fn temp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!(
        "ringmaster-engine-{}-{name}.safetensors",
        std::process::id()
    ))
}

#[test]
fn round_trip_restores_parameters_buffers_and_metadata() {
    let arch = Arch::CifarResNet { depth: 8, width: 2 };
    let mut trained = Model::new(arch, 3, 1);
    let (images, labels) = LearnableData::new(3, 8, 0).batch(&[0, 1, 2, 3]);
    // One step moves the running statistics off their initial values.
    trained.train_step(&images, &labels, 0.0);
    trained.params_mut().values[0] = 42.0;
    let path = temp_path("round-trip");
    let meta = BTreeMap::from([("step".to_string(), "17".to_string())]);
    checkpoint::save(&path, trained.params(), &meta).unwrap();

    let mut restored = Model::new(arch, 3, 2);
    assert_ne!(restored.params().values, trained.params().values);
    let got = checkpoint::load(&path, restored.params_mut()).unwrap();
    assert_eq!(got, meta);
    assert_eq!(restored.params().values, trained.params().values);
    assert_eq!(restored.params().buffers, trained.params().buffers);
    assert_eq!(
        restored.evaluate(&images, &labels),
        trained.evaluate(&images, &labels)
    );
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn load_rejects_another_architecture_and_leaves_model_intact() {
    let path = temp_path("mismatch");
    let small = Model::new(Arch::CifarResNet { depth: 8, width: 2 }, 3, 1);
    checkpoint::save(&path, small.params(), &BTreeMap::new()).unwrap();
    let mut wider = Model::new(Arch::CifarResNet { depth: 8, width: 4 }, 3, 1);
    let before = wider.params().values.clone();
    let err = checkpoint::load(&path, wider.params_mut()).unwrap_err();
    assert!(matches!(err, CheckpointError::Mismatch { .. }), "{err}");
    assert_eq!(wider.params().values, before);
    let mut deeper = Model::new(
        Arch::CifarResNet {
            depth: 14,
            width: 2,
        },
        3,
        1,
    );
    let err = checkpoint::load(&path, deeper.params_mut()).unwrap_err();
    assert!(matches!(err, CheckpointError::Missing(_)), "{err}");
    std::fs::remove_file(&path).unwrap();
    let err = checkpoint::load(&path, deeper.params_mut()).unwrap_err();
    assert!(matches!(err, CheckpointError::Io { .. }), "{err}");
}
