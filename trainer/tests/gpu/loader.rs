//! The GPU loader (nvJPEG, issue 39 D) against the CPU loader on the same folder: the same
//! crops and flips, pixels within the decoders' rounding, every route taken (the hardware
//! decoder for baseline JPEGs, nvJPEG's CUDA decoder for a progressive one, the CPU for a
//! PNG).

use ringmaster_trainer::engine::image_folder::gpu::GpuLoader;
use ringmaster_trainer::engine::image_folder::{ImageFolder, imagenet_sized};

/// A progressive JPEG and a PNG beside ImageNet-sized baseline JPEGs.
fn folder(size: usize) -> (std::path::PathBuf, ImageFolder) {
    let dir = std::env::temp_dir().join(format!("gpu-loader-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    imagenet_sized::write(&dir, 2, 12, 3).unwrap();
    let (w, h) = (420usize, 300usize);
    let pixels: Vec<u8> = (0..w * h * 3)
        .map(|i| ((i / 3 % w) * 255 / w + (i % 3) * 20) as u8)
        .collect();
    let class = dir.join("train/class-000");
    let mut jpeg = Vec::new();
    let mut encoder = jpeg_encoder::Encoder::new(&mut jpeg, 90);
    encoder.set_progressive(true);
    encoder
        .encode(&pixels, w as u16, h as u16, jpeg_encoder::ColorType::Rgb)
        .unwrap();
    std::fs::write(class.join("progressive.jpg"), jpeg).unwrap();
    let mut png = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut png, w as u32, h as u32);
        encoder.set_color(png::ColorType::Rgb);
        encoder
            .write_header()
            .unwrap()
            .write_image_data(&pixels)
            .unwrap();
    }
    std::fs::write(class.join("drawing.png"), png).unwrap();
    let folder = ImageFolder::open(&dir, size, 11).unwrap();
    (dir, folder)
}

#[test]
fn the_gpu_loader_decodes_with_nvjpeg_and_crops_as_the_cpu_loader_does() {
    let size = 96;
    let (dir, folder) = folder(size);
    let indices: Vec<usize> = (0..folder.len()).collect();
    // The probe runs the trainer (run.sh sets RINGMASTER_TRAINER_BIN).
    let trainer = std::env::var("RINGMASTER_TRAINER_BIN").expect("RINGMASTER_TRAINER_BIN");
    // Three decoding threads: the JPEGs the CUDA decoder takes are shared out over them.
    let mut loader =
        GpuLoader::probed(folder.clone(), 0, trainer.as_ref(), 3).expect("the GPU loader starts");
    eprintln!("{}", loader.describe());
    let files = folder.read_files(&indices).unwrap();
    let planned = loader.plan(&indices, 1, files).unwrap();
    let batch = loader.decode(planned).expect("the batch decodes");
    let stream = cudarc::driver::CudaContext::new(0)
        .unwrap()
        .default_stream();
    let on_gpu: Vec<f32> = stream.clone_dtoh(&batch.images.values).unwrap();
    let (on_cpu, labels) = folder.batch(&indices, 1).unwrap();
    assert_eq!(batch.labels, labels);
    eprintln!("decoded: {:?}", loader.counts);
    assert_eq!(loader.counts.cpu, 1, "the PNG on the CPU");
    assert!(
        loader.counts.cuda >= 1,
        "the progressive JPEG by nvJPEG's CUDA decoder"
    );
    if loader.describe().contains("in use") {
        assert!(
            loader.counts.hardware >= 20,
            "the baseline JPEGs on the hardware decoder"
        );
    } else {
        assert!(
            loader.counts.cuda >= 20,
            "the baseline JPEGs on the CUDA decoder"
        );
    }
    let per = 3 * size * size;
    let mut worst = 0f32;
    let mut total = 0f32;
    for (i, (g, c)) in on_gpu.chunks(per).zip(on_cpu.data.chunks(per)).enumerate() {
        let mean = g.iter().zip(c).map(|(a, b)| (a - b).abs()).sum::<f32>() / per as f32;
        eprintln!("image {i}: mean |GPU − CPU| {mean:.4}");
        worst = worst.max(mean);
        total += mean;
    }
    let mean = total / folder.len() as f32;
    eprintln!(
        "mean |GPU − CPU| over the batch {mean:.4}, worst image {worst:.4} (one level of 255 is 0.0175)"
    );
    // A wrong crop, flip or channel would be off by a good part of the values' spread (about 1).
    assert!(
        worst < 0.12 && mean < 0.05,
        "GPU and CPU crops differ: mean {mean}, worst {worst}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
