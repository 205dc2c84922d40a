//! `bench-loader`: the image-folder loader alone, timed: images/s, and how many CPU cores
//! it kept busy (the process's CPU time over the wall time), so a figure can be set beside
//! what a GPU trains and what a VM has per GPU (an ND96asr_v4: 12 vCPUs). With
//! `--decoder nvjpeg` the JPEGs are decoded on the GPU ([`GpuLoader`]); reading the next
//! batch's files overlaps the GPU's decoding of this one, as a training run would.

use std::path::PathBuf;
use std::time::Instant;

use crate::engine::image_folder::ImageFolder;
use crate::engine::image_folder::gpu::{DEFAULT_DECODE_THREADS, GpuLoader, parse_decode_threads};

/// Where the loader decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Decoder {
    /// On the CPUs (rayon's threads; RAYON_NUM_THREADS caps them).
    Cpu,
    /// On the GPU with nvJPEG: its hardware decoder where the GPU has one.
    Nvjpeg,
}

/// `bench-loader`'s arguments.
#[derive(clap::Args, Debug)]
pub struct LoaderBenchArgs {
    /// The image folder (`train/<class>/*.jpg`, as `make-dataset` writes).
    #[arg(long)]
    pub data_dir: PathBuf,
    /// Images per batch.
    #[arg(long, default_value_t = 256)]
    pub batch_size: usize,
    /// Side of the square crops.
    #[arg(long, default_value_t = 224)]
    pub image_size: usize,
    /// Batches to time (after one untimed).
    #[arg(long, default_value_t = 10)]
    pub batches: usize,
    /// Where to decode.
    #[arg(long, value_enum, default_value_t = Decoder::Cpu)]
    pub decoder: Decoder,
    /// The GPU, for `--decoder nvjpeg`.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Threads running nvJPEG's CUDA decoder (its Huffman stage is on the CPU), for
    /// `--decoder nvjpeg`; training reads RINGMASTER_NVJPEG_THREADS the same way.
    #[arg(long, env = "RINGMASTER_NVJPEG_THREADS", default_value_t = DEFAULT_DECODE_THREADS,
          value_parser = decode_threads)]
    pub decode_threads: usize,
}

/// `--decode-threads`, checked as `RINGMASTER_NVJPEG_THREADS` is for training.
fn decode_threads(value: &str) -> Result<usize, String> {
    parse_decode_threads(value).map_err(|e| e.to_string())
}

/// The process's CPU time so far (user and system, all threads), in seconds.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// Batch `b`'s indices, walking the folder in order.
fn indices(b: usize, batch_size: usize, len: usize) -> Vec<usize> {
    (0..batch_size)
        .map(|i| (b * batch_size + i) % len)
        .collect()
}

/// Runs the benchmark; its result as one JSON object.
pub fn run(args: &LoaderBenchArgs) -> Result<serde_json::Value, String> {
    let folder =
        ImageFolder::open(&args.data_dir, args.image_size, 0).map_err(|e| e.to_string())?;
    let len = folder.len();
    let bytes: u64 = (0..len).filter_map(|i| folder.file_bytes(i)).sum();
    let mut line = serde_json::json!({
        "loader": "imageFolder",
        "decoder": format!("{:?}", args.decoder).to_lowercase(),
        "threads": rayon::current_num_threads(),
        "imageSize": args.image_size,
        "images": args.batches * args.batch_size,
        "meanFileBytes": bytes / len.max(1) as u64,
    });
    let (seconds, cpu) = match args.decoder {
        Decoder::Cpu => time_cpu(&folder, args)?,
        Decoder::Nvjpeg => {
            let program = std::env::current_exe().map_err(|e| e.to_string())?;
            let mut loader =
                GpuLoader::probed(folder.clone(), args.gpu, &program, args.decode_threads)
                    .map_err(|e| e.to_string())?;
            line["decodeThreads"] = args.decode_threads.into();
            let timed = time_gpu(&folder, &mut loader, args)?;
            line["nvjpeg"] = loader.describe().into();
            let c = loader.counts;
            line["decoded"] =
                serde_json::json!({"hardware": c.hardware, "cuda": c.cuda, "cpu": c.cpu});
            timed
        }
    };
    let images = (args.batches * args.batch_size) as f64;
    line["imagesPerSecond"] = (images / seconds).into();
    line["cpuCoresBusy"] = (cpu / seconds).into();
    line["imagesPerSecondPerBusyCore"] = (images / cpu.max(1e-9)).into();
    Ok(line)
}

/// Wall and CPU seconds of the CPU loader's timed batches.
fn time_cpu(folder: &ImageFolder, args: &LoaderBenchArgs) -> Result<(f64, f64), String> {
    let batch = |b| {
        // Handed back as training does once a batch is uploaded.
        folder
            .batch(&indices(b, args.batch_size, folder.len()), b)
            .map(|(images, _)| folder.buffers().give_back(images))
    };
    batch(0).map_err(|e| e.to_string())?;
    let (started, cpu) = (Instant::now(), cpu_seconds());
    for b in 1..=args.batches {
        batch(b).map_err(|e| e.to_string())?;
    }
    Ok((started.elapsed().as_secs_f64(), cpu_seconds() - cpu))
}

/// Wall and CPU seconds of the GPU loader's timed batches, each batch's files read while
/// the one before decodes.
fn time_gpu(
    folder: &ImageFolder,
    loader: &mut GpuLoader,
    args: &LoaderBenchArgs,
) -> Result<(f64, f64), String> {
    let mut files = folder
        .read_files(&indices(0, args.batch_size, folder.len()))
        .map_err(|e| e.to_string())?;
    let mut timing = None;
    for b in 0..=args.batches {
        if b == 1 {
            timing = Some((Instant::now(), cpu_seconds()));
        }
        let next = indices(b + 1, args.batch_size, folder.len());
        let (decoded, next_files) = loader.decode_reading_next(
            &indices(b, args.batch_size, folder.len()),
            b,
            files,
            Some(&next),
        );
        decoded.map_err(|e| e.to_string())?;
        files = next_files
            .expect("the next files were asked for")
            .map_err(|e| e.to_string())?;
    }
    let (started, cpu) = timing.expect("at least one timed batch");
    Ok((started.elapsed().as_secs_f64(), cpu_seconds() - cpu))
}
