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

/// What ImageNet's train set holds besides plain colour JPEGs (grayscale and CMYK JPEGs, a
/// PNG named `.JPEG`), a `.png`, and a photo large enough to be decoded at a reduced scale:
/// every one becomes a normalized crop.
#[test]
fn imagenets_odd_files_and_large_photos_are_read() {
    let dir = temp("odd");
    let class = dir.join("train/n01440764");
    std::fs::create_dir_all(&class).unwrap();
    let jpeg = |name: &str, pixels: &[u8], (w, h): (usize, usize), color| {
        jpeg_encoder::Encoder::new_file(class.join(name), 90)
            .unwrap()
            .encode(pixels, w as u16, h as u16, color)
            .unwrap();
    };
    use jpeg_encoder::ColorType::{CmykAsYcck, Luma, Rgb};
    let (w, h) = (320usize, 240usize);
    let gray: Vec<u8> = (0..w * h).map(|i| (i % 251) as u8).collect();
    jpeg("a-gray.JPEG", &gray, (w, h), Luma);
    let cmyk: Vec<u8> = (0..w * h)
        .flat_map(|i| [(i % 256) as u8, 40, 200, 30])
        .collect();
    jpeg("b-cmyk.JPEG", &cmyk, (w, h), CmykAsYcck);
    let (big_w, big_h) = (2400usize, 1800usize);
    let big: Vec<u8> = (0..big_w * big_h)
        .flat_map(|i| [(i % big_w / 10) as u8, (i / big_w / 8) as u8, 128])
        .collect();
    jpeg("c-large.JPEG", &big, (big_w, big_h), Rgb);
    let rgb: Vec<u8> = (0..w * h)
        .flat_map(|i| [(i % 256) as u8, 100, 50])
        .collect();
    for name in ["d-png-named.JPEG", "e-real.png"] {
        let file = std::fs::File::create(class.join(name)).unwrap();
        let mut encoder = png::Encoder::new(file, w as u32, h as u32);
        encoder.set_color(png::ColorType::Rgb);
        encoder
            .write_header()
            .unwrap()
            .write_image_data(&rgb)
            .unwrap();
    }
    std::fs::write(class.join("notes.txt"), b"not an image, not indexed").unwrap();
    let folder = ImageFolder::open(&dir, 64, 3).unwrap();
    assert_eq!(folder.len(), 5, "four .JPEG and one .png");
    for epoch in 0..4 {
        let (images, labels) = folder.batch(&[0, 1, 2, 3, 4], epoch).unwrap();
        assert_eq!(labels, vec![0; 5]);
        for (i, image) in images.data.chunks(3 * 64 * 64).enumerate() {
            assert!(
                image.iter().all(|v| v.is_finite() && v.abs() < 3.0),
                "image {i}, epoch {epoch}"
            );
            let spread = image.iter().fold(f32::INFINITY, |m, &v| m.min(v))
                ..image.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            assert!(spread.end > spread.start, "image {i} has content");
        }
        let gray = &images.data[..3 * 64 * 64];
        let planes: Vec<&[f32]> = gray.chunks(64 * 64).collect();
        // Each plane is normalized with its own mean and deviation: back to 0..1 they agree.
        let level = |c: usize, v: f32| v * [0.229, 0.224, 0.225][c] + [0.485, 0.456, 0.406][c];
        assert!(
            (0..64 * 64).all(|p| (level(0, planes[0][p]) - level(1, planes[1][p])).abs() < 1e-5),
            "a grayscale JPEG is gray in RGB"
        );
    }
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
