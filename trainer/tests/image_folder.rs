//! ImageNet-style folders of JPEGs: indexing, decoding, augmentation, errors, and training
//! from them end to end.

use std::process::Command;

mod common;

use ringmaster_trainer::engine::image_folder::{ImageFolder, ImageFolderError, write_learnable};

fn temp(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("image-folder-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    dir
}

#[test]
fn a_generated_folder_is_indexed_decoded_and_augmented() {
    let dir = temp("index");
    assert_eq!(write_learnable(&dir, 3, 5, 20, 1).unwrap(), 15);
    let folder = ImageFolder::open(&dir, 16, 7).unwrap();
    assert_eq!(folder.classes, vec!["class-000", "class-001", "class-002"]);
    assert_eq!(folder.len(), 15);
    let (images, labels) = folder.batch(&[0, 5, 14], 0).unwrap();
    assert_eq!(images.shape, vec![3, 3, 16, 16]);
    assert_eq!(
        labels,
        vec![0, 1, 2],
        "files are labelled by their sorted class folder"
    );
    assert!(
        images.data.iter().all(|v| v.is_finite() && v.abs() < 5.0),
        "normalized values"
    );
    let (again, _) = folder.batch(&[0, 5, 14], 0).unwrap();
    assert_eq!(images.data, again.data, "the same epoch crops the same way");
    let (next_epoch, _) = folder.batch(&[0, 5, 14], 1).unwrap();
    assert_ne!(
        images.data, next_epoch.data,
        "another epoch crops differently"
    );
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn broken_and_empty_folders_are_clear_errors() {
    let dir = temp("broken");
    std::fs::create_dir_all(dir.join("cat")).unwrap();
    match ImageFolder::open(&dir, 16, 0) {
        Err(ImageFolderError::Empty(path)) => assert!(path.contains("image-folder-broken")),
        other => panic!("expected Empty, got {other:?}"),
    }
    std::fs::write(dir.join("cat/not-really.jpg"), b"this is not a JPEG").unwrap();
    let folder = ImageFolder::open(&dir, 16, 0).unwrap();
    let error = folder.batch(&[0], 0).unwrap_err().to_string();
    assert!(error.contains("not-really.jpg"), "{error}");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn training_from_a_jpeg_folder_learns() {
    let dir = temp("train");
    write_learnable(&dir, 4, 48, 32, 0).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ringmaster-trainer"))
        .args([
            "train",
            "--model",
            "cifar8",
            "--width",
            "8",
            "--image-size",
            "24",
            "--batch-size",
            "32",
        ])
        .args([
            "--epochs",
            "8",
            "--learning-rate",
            "0.05",
            "--log-every",
            "1",
            "--data-dir",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let first = common::steps(&out.stdout)[0]["loss"].as_f64().unwrap();
    let summary = &common::summary(&out.stdout);
    assert_eq!(summary["steps"], 8 * (192 / 32));
    assert!(
        summary["finalLoss"].as_f64().unwrap() < 0.5 * first,
        "{first} → {}",
        summary["finalLoss"]
    );
    assert!(
        summary["finalAccuracy"].as_f64().unwrap() > 0.6,
        "{summary}"
    );
    std::fs::remove_dir_all(dir).ok();
}

/// A JPEG that does not decode stops `train` with its name once its batch's turn comes,
/// after the steps before it finished and were logged, however far ahead it was read
/// (the reader thread and the next-batch upload both run ahead of the step).
#[test]
fn a_broken_jpeg_in_the_folder_stops_training_with_its_name() {
    let dir = temp("broken-train");
    write_learnable(&dir, 2, 16, 32, 0).unwrap();
    std::fs::write(
        dir.join("train/class-001/zz-broken.jpg"),
        b"this is not a JPEG",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ringmaster-trainer"))
        .args(["train", "--model", "cifar8", "--width", "8"])
        .args([
            "--image-size",
            "24",
            "--batch-size",
            "4",
            "--micro-batches",
            "2",
        ])
        .args(["--epochs", "3", "--log-every", "1", "--data-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "it trained past the broken file");
    assert!(stderr.contains("zz-broken.jpg"), "{stderr}");
    // 33 images, 2 micro-batches of 2 on one rank: 8 steps an epoch.
    let logged = common::steps(&out.stdout);
    assert!(logged.len() < 3 * 8, "{} steps logged", logged.len());
    for (i, line) in logged.iter().enumerate() {
        assert_eq!(
            line["step"],
            i as u64 + 1,
            "steps logged in order, none lost"
        );
        assert!(line["loss"].is_number(), "{line}");
    }
    std::fs::remove_dir_all(dir).ok();
}
