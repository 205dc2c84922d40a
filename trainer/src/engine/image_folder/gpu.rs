//! The image-folder loader with JPEGs decoded on the GPU: nvJPEG ([`super::nvjpeg`]) on the
//! GPU's hardware decoder where it takes the file (baseline JPEGs, what ImageNet mostly
//! holds), nvJPEG's CUDA decoder for other JPEGs, and the CPU path ([`ImageFolder`]'s) for
//! what nvJPEG does not read (PNGs, CMYK). The crop, flip and normalisation run in one
//! kernel (`crop.cu`) straight into the batch on the device; the random choices are the
//! CPU path's ([`ImageFolder::augmentation`]), so both give the same crops (pixels differ
//! by the decoders' rounding and the CPU's reduced-size IDCT).
//!
//! The CPU's part is reading the files ([`ImageFolder::read_files`], which can run on
//! another thread while the GPU decodes the batch before), their headers
//! ([`GpuLoader::plan`]), and the CUDA decoder's Huffman stage. That stage runs on the
//! loader's decoding threads ([`DEFAULT_DECODE_THREADS`], `RINGMASTER_NVJPEG_THREADS`),
//! each with its own nvJPEG state and CUDA stream, the images shared out by their bytes.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
    PushKernelArg,
};
use rayon::prelude::*;

use super::nvjpeg::{Image, NvJpeg, NvJpegError};
use super::{ImageFolder, ImageFolderError};
use crate::engine::backend::cuda::compile_kernels;

/// The crop kernel's source.
pub const SOURCE: &str = include_str!("crop.cu");

/// Why the GPU loader could not start or load a batch.
#[derive(Debug, thiserror::Error)]
pub enum GpuLoaderError {
    /// nvJPEG is missing or failed.
    #[error("nvJPEG: {0}")]
    NvJpeg(#[from] NvJpegError),
    /// The CUDA driver, or the crop kernel's compilation, failed.
    #[error("CUDA: {context}: {message}")]
    Cuda {
        /// What was being done.
        context: &'static str,
        /// The error.
        message: String,
    },
    /// A file could not be read or decoded on the CPU.
    #[error(transparent)]
    Folder(#[from] ImageFolderError),
    /// This program's own path, which nvJPEG's probe runs, could not be found.
    #[error("finding this program for nvJPEG's probe: {0}")]
    ThisProgram(#[source] std::io::Error),
    /// `RINGMASTER_NVJPEG_THREADS` (or `--decode-threads`) is not a number of threads.
    #[error(
        "{0:?} is not a number of nvJPEG decoding threads (RINGMASTER_NVJPEG_THREADS): give a whole number from 1 to {MAX_DECODE_THREADS}"
    )]
    DecodeThreads(String),
    /// The decoding threads could not be started.
    #[error("starting nvJPEG's decoding threads: {0}")]
    Threads(#[from] rayon::ThreadPoolBuildError),
}

/// Threads decoding with nvJPEG's CUDA decoder unless `RINGMASTER_NVJPEG_THREADS` says
/// otherwise: the budget of CPU cores for the loader (an ND96asr_v4 has 12 vCPUs
/// per GPU, and each of its 8 ranks runs a loader).
pub const DEFAULT_DECODE_THREADS: usize = 4;

/// The most decoding threads a loader takes (each holds an nvJPEG state and its buffers).
pub const MAX_DECODE_THREADS: usize = 64;

/// The decoding threads `RINGMASTER_NVJPEG_THREADS` asks for, else the default.
pub fn decode_threads_from_env() -> Result<usize, GpuLoaderError> {
    match std::env::var("RINGMASTER_NVJPEG_THREADS") {
        Err(_) => Ok(DEFAULT_DECODE_THREADS),
        Ok(value) => parse_decode_threads(&value),
    }
}

/// A number of decoding threads, from 1 to [`MAX_DECODE_THREADS`].
pub fn parse_decode_threads(value: &str) -> Result<usize, GpuLoaderError> {
    value
        .trim()
        .parse()
        .ok()
        .filter(|n| (1..=MAX_DECODE_THREADS).contains(n))
        .ok_or_else(|| GpuLoaderError::DecodeThreads(value.to_string()))
}

/// The images of `bytes` (each image's file size) shared out over `lanes` lanes so that
/// their bytes, which the Huffman stage's time follows, are as even as they can be: the
/// largest first, each to the lane with the fewest bytes so far. Each lane lists positions
/// in `bytes`, in order.
pub fn share_by_bytes(bytes: &[usize], lanes: usize) -> Vec<Vec<usize>> {
    let mut shares = vec![Vec::new(); lanes.max(1)];
    let mut loads = vec![0usize; shares.len()];
    let mut largest_first: Vec<usize> = (0..bytes.len()).collect();
    largest_first.sort_by_key(|&i| std::cmp::Reverse(bytes[i]));
    for i in largest_first {
        let lightest = (0..loads.len())
            .min_by_key(|&lane| loads[lane])
            .expect("at least one lane");
        loads[lightest] += bytes[i];
        shares[lightest].push(i);
    }
    shares.iter_mut().for_each(|share| share.sort_unstable());
    shares
}

fn cuda<T, E: std::fmt::Display>(
    context: &'static str,
    r: Result<T, E>,
) -> Result<T, GpuLoaderError> {
    r.map_err(|e| GpuLoaderError::Cuda {
        context,
        message: e.to_string(),
    })
}

/// One image's place and crop, as `crop.cu`'s `struct Crop` (the same C layout).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Crop {
    offset: u64,
    width: i32,
    height: i32,
    pitch: i32,
    flip: i32,
    x: f32,
    y: f32,
    w: f32,
    h: f32,
}

// SAFETY: plain C data (integers and floats, no padding: 8 + 8 × 4 bytes), copied as is.
unsafe impl DeviceRepr for Crop {}

/// How each image of a batch was decoded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeCounts {
    /// By the GPU's hardware JPEG decoder.
    pub hardware: usize,
    /// By nvJPEG's CUDA decoder.
    pub cuda: usize,
    /// On the CPU.
    pub cpu: usize,
}

/// The next batch's files, or why one could not be read.
pub type NextFiles = Result<Vec<Vec<u8>>, ImageFolderError>;

/// Image `i` of a batch, and where its decoded pixels go.
type Job = (usize, Image);

/// Where image `i` of a batch is decoded.
enum Route {
    Hardware,
    Cuda,
    Cpu,
}

/// A batch's files, with the decoder and crop of each.
pub struct ReadBatch {
    epoch: usize,
    indices: Vec<usize>,
    files: Vec<Vec<u8>>,
    routes: Vec<Route>,
    crops: Vec<Crop>,
}

/// A batch on the GPU: its images and their labels.
pub struct GpuBatch {
    /// The images, normalised.
    pub images: DeviceImages,
    /// Their labels.
    pub labels: Vec<usize>,
}

/// Images in device memory, `[n, 3, size, size]` planar f32 as the CPU loader's, complete
/// (the loader waited for them). A backend that converts them from another stream sets
/// [`DeviceImages::consumed`]: dropping them waits for that point, so their memory is not
/// freed (on the loader's stream) while the conversion may still read it.
pub struct DeviceImages {
    /// The values.
    pub values: CudaSlice<f32>,
    /// `[n, 3, size, size]`.
    pub shape: [usize; 4],
    /// Recorded after the last read of `values` queued on another stream.
    pub consumed: Option<cudarc::driver::CudaEvent>,
}

impl DeviceImages {
    /// The device address of the first value.
    pub fn address(&self) -> u64 {
        let (ptr, _sync) = self.values.device_ptr(self.values.stream());
        ptr
    }
}

impl Drop for DeviceImages {
    fn drop(&mut self) {
        if let Some(consumed) = self.consumed.take() {
            // The trainer waits for the step this batch fed anyway; this returns then.
            consumed
                .synchronize()
                .unwrap_or_else(|e| panic!("waiting for a device batch to be read: {e}"));
        }
    }
}

/// An image folder whose JPEGs are decoded on GPU `ordinal`.
pub struct GpuLoader {
    /// Shared with the thread that reads the next batch's files.
    folder: Arc<ImageFolder>,
    nvjpeg: NvJpeg,
    stream: Arc<CudaStream>,
    /// One stream per decoding thread, for its images' GPU stages.
    lane_streams: Vec<Arc<CudaStream>>,
    /// The decoding threads.
    threads: rayon::ThreadPool,
    kernel: CudaFunction,
    /// The decoded images of the batch, one after another (grown to the largest batch).
    decoded: CudaSlice<u8>,
    /// How the images so far were decoded.
    pub counts: DecodeCounts,
    /// The hardware decoder failed a batch: the CUDA decoder takes its JPEGs from then on.
    hardware_failed: bool,
    /// Why the hardware decoder is not used, when it was left out.
    hardware_left_out: Option<String>,
}

/// Decoded images start on this many bytes (nvJPEG's rows are then aligned as it likes).
const ALIGN: usize = 256;

impl GpuLoader {
    /// Opens nvJPEG and compiles the crop kernel for GPU `ordinal`; with its hardware
    /// decoder only when `hardware` (see [`super::hardware_probe`]), and `decode_threads`
    /// threads for its CUDA decoder.
    pub fn new(
        folder: ImageFolder,
        ordinal: usize,
        hardware: bool,
        decode_threads: usize,
    ) -> Result<Self, GpuLoaderError> {
        // SAFETY: a dlopen probe; cudarc panics on a library it cannot load.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(GpuLoaderError::Cuda {
                context: "loading libcuda.so.1",
                message: "no NVIDIA driver here".into(),
            });
        }
        let ctx = cuda("opening the GPU", CudaContext::new(ordinal))?;
        let stream = cuda("creating a stream", ctx.new_stream())?;
        let (major, minor) = cuda("compute capability", ctx.compute_capability())?;
        let cubin = cuda("compiling crop.cu", compile_kernels(SOURCE, major, minor))?;
        let module = cuda(
            "loading crop.cu",
            ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)),
        )?;
        let kernel = cuda(
            "crop_resize_normalize",
            module.load_function("crop_resize_normalize"),
        )?;
        let decode_threads = decode_threads.clamp(1, MAX_DECODE_THREADS);
        let nvjpeg = NvJpeg::open(hardware, decode_threads)?;
        let lane_streams = (0..decode_threads)
            .map(|_| cuda("creating a decoding stream", ctx.new_stream()))
            .collect::<Result<_, _>>()?;
        let threads = rayon::ThreadPoolBuilder::new()
            .num_threads(decode_threads)
            .thread_name(|i| format!("nvjpeg-{i}"))
            .build()?;
        let decoded = cuda("allocating", stream.alloc_zeros::<u8>(ALIGN))?;
        Ok(Self {
            folder: Arc::new(folder),
            nvjpeg,
            stream,
            lane_streams,
            threads,
            kernel,
            decoded,
            counts: DecodeCounts::default(),
            hardware_failed: false,
            hardware_left_out: None,
        })
    }

    /// [`GpuLoader::new`], with the hardware decoder when `program probe-nvjpeg` (a
    /// `ringmaster-trainer`) finds that it works here.
    pub fn probed(
        folder: ImageFolder,
        ordinal: usize,
        program: &std::path::Path,
        decode_threads: usize,
    ) -> Result<Self, GpuLoaderError> {
        let left_out = super::hardware_probe::hardware_works(program, ordinal).err();
        let mut loader = Self::new(folder, ordinal, left_out.is_none(), decode_threads)?;
        loader.hardware_left_out = left_out;
        Ok(loader)
    }

    /// Whether the GPU's hardware decoder is used, and nvJPEG's version.
    pub fn describe(&self) -> String {
        let hardware = match (&self.hardware_left_out, self.nvjpeg.hardware()) {
            (_, true) => "in use".to_string(),
            (Some(why), false) => format!("not used: {why}"),
            (None, false) => "absent".to_string(),
        };
        format!(
            "nvJPEG {}, hardware decoder {hardware}, CUDA decoder on {} threads",
            self.nvjpeg.version(),
            self.lane_streams.len()
        )
    }

    /// Reads each file's header (`files` of `indices`, from [`ImageFolder::read_files`])
    /// and chooses its decoder and its crop for `epoch`: the CPU's part of a batch beside
    /// reading the files.
    pub fn plan(
        &self,
        indices: &[usize],
        epoch: usize,
        files: Vec<Vec<u8>>,
    ) -> Result<ReadBatch, GpuLoaderError> {
        assert_eq!(indices.len(), files.len(), "one file per index");
        let mut routes = Vec::with_capacity(files.len());
        let mut crops = Vec::with_capacity(files.len());
        let mut offset = 0usize;
        for (&index, bytes) in indices.iter().zip(&files) {
            let info = (!bytes.starts_with(b"\x89PNG"))
                .then(|| self.nvjpeg.info(bytes).ok())
                .flatten()
                .filter(|i| matches!(i.components, 1 | 3) && i.width > 0 && i.height > 0);
            let Some(info) = info else {
                routes.push(Route::Cpu);
                crops.push(Crop::default());
                continue;
            };
            let hardware = !self.hardware_failed && self.nvjpeg.hardware_takes(bytes);
            routes.push(if hardware {
                Route::Hardware
            } else {
                Route::Cuda
            });
            let choice = self
                .folder
                .augmentation(index, epoch, info.width, info.height);
            let (x, y, w, h) = choice.crop;
            crops.push(Crop {
                offset: offset as u64,
                width: info.width as i32,
                height: info.height as i32,
                pitch: (info.width * 3) as i32,
                flip: i32::from(choice.flip),
                x: x as f32,
                y: y as f32,
                w: w as f32,
                h: h as f32,
            });
            offset += (info.width * info.height * 3).next_multiple_of(ALIGN);
        }
        Ok(ReadBatch {
            epoch,
            indices: indices.to_vec(),
            files,
            routes,
            crops,
        })
    }

    /// The batch of `indices` in `epoch` from its `files`, planned and decoded, while the
    /// files of `next` (the batch after it) are read on another thread: reading is the CPU's
    /// part that the decoding threads do not do. Returns the batch and the next files.
    pub fn decode_reading_next(
        &mut self,
        indices: &[usize],
        epoch: usize,
        files: Vec<Vec<u8>>,
        next: Option<&[usize]>,
    ) -> (Result<GpuBatch, GpuLoaderError>, Option<NextFiles>) {
        let folder = Arc::clone(&self.folder);
        std::thread::scope(|scope| {
            let reading = next.map(|indices| scope.spawn(|| folder.read_files(indices)));
            let batch = self
                .plan(indices, epoch, files)
                .and_then(|planned| self.decode(planned));
            let next_files =
                reading.map(|r| r.join().expect("reading a batch's files does not panic"));
            (batch, next_files)
        })
    }

    /// Decodes a planned batch on the GPU and crops it into a new device batch; returns when
    /// the batch is complete on the device.
    pub fn decode(&mut self, mut batch: ReadBatch) -> Result<GpuBatch, GpuLoaderError> {
        let needed = batch
            .crops
            .iter()
            .map(|c| {
                c.offset as usize + (c.pitch as usize * c.height as usize).next_multiple_of(ALIGN)
            })
            .max()
            .unwrap_or(0);
        if needed > self.decoded.len() {
            // SAFETY: every byte read by the kernel is written by a decode first.
            self.decoded = cuda("allocating decoded images", unsafe {
                self.stream.alloc::<u8>(needed)
            })?;
        }
        // What nvJPEG refused goes to the CPU, which reads it or names the broken file.
        for i in self.decode_jpegs(&batch)? {
            batch.routes[i] = Route::Cpu;
            batch.crops[i].width = 0;
        }
        let size = self.folder.image_size();
        let per = 3 * size * size;
        let n = batch.indices.len();
        let mut images = cuda(
            "allocating the batch",
            self.stream.alloc_zeros::<f32>(n * per),
        )?;
        let crops = cuda("uploading crops", self.stream.clone_htod(&batch.crops))?;
        let (images_i32, size_i32) = (n as i32, size as i32);
        let mut launch = self.stream.launch_builder(&self.kernel);
        launch
            .arg(&self.decoded)
            .arg(&crops)
            .arg(&mut images)
            .arg(&images_i32)
            .arg(&size_i32);
        // SAFETY: the kernel's arguments are crop.cu's, and it reads only inside each
        // image's `offset..offset + pitch × height` of `decoded`, written above.
        cuda("launching crop_resize_normalize", unsafe {
            launch.launch(LaunchConfig::for_num_elems((n * size * size) as u32))
        })?;
        self.decode_on_cpu(&batch, &mut images)?;
        cuda("waiting for the batch", self.stream.synchronize())?;
        let labels = batch
            .indices
            .iter()
            .map(|&i| self.folder.label(i))
            .collect();
        Ok(GpuBatch {
            images: DeviceImages {
                values: images,
                shape: [n, 3, size, size],
                consumed: None,
            },
            labels,
        })
    }

    /// The hardware decoder's JPEGs as one batch, then the others on the decoding threads;
    /// returns, once every decode is complete, the images nvJPEG refused. A batch the
    /// hardware fails goes to the CUDA decoder.
    fn decode_jpegs(&mut self, batch: &ReadBatch) -> Result<Vec<usize>, GpuLoaderError> {
        // The decoders write through raw addresses; `decode` orders every stream by hand.
        let base = {
            let (ptr, _sync) = self.decoded.device_ptr(&self.stream);
            ptr
        };
        let image = |c: &Crop| Image {
            channel: [
                (base + c.offset) as *mut u8,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            ],
            pitch: [c.pitch as u32, 0, 0, 0],
        };
        let on_route = |wanted: fn(&Route) -> bool| {
            (0..batch.routes.len())
                .filter(|&i| wanted(&batch.routes[i]))
                .collect::<Vec<_>>()
        };
        let on_hardware = on_route(|r| matches!(r, Route::Hardware));
        let mut on_cuda = on_route(|r| matches!(r, Route::Cuda));
        let jpegs: Vec<&[u8]> = on_hardware
            .iter()
            .map(|&i| batch.files[i].as_slice())
            .collect();
        let mut outs: Vec<Image> = on_hardware
            .iter()
            .map(|&i| image(&batch.crops[i]))
            .collect();
        // SAFETY: `decoded` holds `pitch × height` bytes at each image's offset (sized by
        // `decode`) and lives until the stream is synchronised, after the crop kernel.
        match unsafe {
            self.nvjpeg
                .decode_on_hardware(&jpegs, &mut outs, self.stream.cu_stream())
        } {
            Ok(()) => self.counts.hardware += jpegs.len(),
            Err(e) => {
                if !self.hardware_failed {
                    eprintln!(
                        "ringmaster-trainer: nvJPEG's hardware decoder failed a batch ({e}); its CUDA decoder takes the JPEGs from here on"
                    );
                }
                self.hardware_failed = true;
                on_cuda.extend(on_hardware);
            }
        }
        let jobs: Vec<Job> = on_cuda
            .iter()
            .map(|&i| (i, image(&batch.crops[i])))
            .collect();
        let refused = self.decode_on_lanes(&batch.files, jobs)?;
        self.counts.cuda += on_cuda.len() - refused.len();
        Ok(refused)
    }

    /// Decodes each `(image, into)` of `jobs` with the CUDA decoder, the images shared out
    /// over the decoding threads by their bytes; returns, once every lane's stream is done,
    /// the images nvJPEG refused.
    fn decode_on_lanes(
        &mut self,
        files: &[Vec<u8>],
        jobs: Vec<Job>,
    ) -> Result<Vec<usize>, GpuLoaderError> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let bytes: Vec<usize> = jobs.iter().map(|&(i, _)| files[i].len()).collect();
        let shares: Vec<Vec<Job>> = share_by_bytes(&bytes, self.lane_streams.len())
            .into_iter()
            .map(|share| share.into_iter().map(|j| jobs[j]).collect())
            .collect();
        let context = self.stream.context().clone();
        let lanes: Vec<_> = self
            .nvjpeg
            .lanes()
            .into_iter()
            .zip(&self.lane_streams)
            .zip(shares)
            .collect();
        let refused = self.threads.install(|| {
            lanes
                .into_par_iter()
                .map(|((mut lane, stream), share)| {
                    cuda("making the GPU current", context.bind_to_thread())?;
                    let refused: Vec<usize> = share
                        .into_iter()
                        .filter_map(|(i, mut into)| {
                            // SAFETY: `into` points inside `decoded` (see `decode_jpegs`),
                            // which outlives this call; the context is current (above).
                            unsafe { lane.decode(&files[i], &mut into, stream.cu_stream()) }
                                .err()
                                .map(|_| i)
                        })
                        .collect();
                    cuda("waiting for a decoding stream", stream.synchronize())?;
                    Ok(refused)
                })
                .collect::<Result<Vec<Vec<usize>>, GpuLoaderError>>()
        })?;
        Ok(refused.concat())
    }

    /// The images nvJPEG does not read, decoded on the CPU into their place in `images`.
    fn decode_on_cpu(
        &mut self,
        batch: &ReadBatch,
        images: &mut CudaSlice<f32>,
    ) -> Result<(), GpuLoaderError> {
        let size = self.folder.image_size();
        let per = 3 * size * size;
        let on_cpu: Vec<usize> = (0..batch.indices.len())
            .filter(|&i| matches!(batch.routes[i], Route::Cpu))
            .collect();
        let folder = &self.folder;
        let decoded = on_cpu
            .par_iter()
            .map(|&i| {
                let mut out = vec![0f32; per];
                folder
                    .sample_from(batch.indices[i], batch.epoch, &batch.files[i], &mut out)
                    .map(|()| out)
            })
            .collect::<Result<Vec<_>, _>>()?;
        for (&i, pixels) in on_cpu.iter().zip(&decoded) {
            let mut slot = images.slice_mut(i * per..(i + 1) * per);
            cuda(
                "uploading a CPU-decoded image",
                self.stream.memcpy_htod(pixels, &mut slot),
            )?;
        }
        self.counts.cpu += on_cpu.len();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every image goes to exactly one lane, each lane lists its images in order, and no
    /// lane carries more bytes than the lightest one plus the largest image (what a greedy
    /// share guarantees).
    #[test]
    fn images_are_shared_out_over_the_lanes_by_their_bytes() {
        let bytes = [
            90_000, 12_000, 400_000, 88_000, 91_000, 35_000, 150_000, 89_000, 7_000,
        ];
        for lanes in 1..=5 {
            let shares = share_by_bytes(&bytes, lanes);
            assert_eq!(shares.len(), lanes);
            let mut all: Vec<usize> = shares.concat();
            all.sort_unstable();
            assert_eq!(all, (0..bytes.len()).collect::<Vec<_>>(), "{lanes} lanes");
            for share in &shares {
                assert!(share.is_sorted(), "{share:?}");
            }
            let loads: Vec<usize> = shares
                .iter()
                .map(|share| share.iter().map(|&i| bytes[i]).sum())
                .collect();
            let (heaviest, lightest) = (loads.iter().max().unwrap(), loads.iter().min().unwrap());
            assert!(heaviest - lightest <= 400_000, "{lanes} lanes: {loads:?}");
        }
        // An image that outweighs the rest together has a lane to itself.
        assert_eq!(
            share_by_bytes(&[50_000, 400_000, 60_000, 70_000], 2),
            vec![vec![1], vec![0, 2, 3]]
        );
        assert_eq!(share_by_bytes(&[], 3), vec![Vec::<usize>::new(); 3]);
        assert_eq!(
            share_by_bytes(&[5, 5], 0),
            vec![vec![0, 1]],
            "at least one lane"
        );
    }

    #[test]
    fn the_number_of_decoding_threads_is_checked() {
        assert_eq!(parse_decode_threads("4").unwrap(), 4);
        assert_eq!(parse_decode_threads(" 64 ").unwrap(), 64);
        for wrong in ["0", "65", "-1", "four", ""] {
            let e = parse_decode_threads(wrong).unwrap_err().to_string();
            assert!(
                e.contains(&format!("{wrong:?}")) && e.contains("from 1 to 64"),
                "{e}"
            );
        }
    }
}
