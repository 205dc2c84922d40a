//! The image-folder loader with JPEGs decoded on the GPU: nvJPEG ([`super::nvjpeg`]) on the
//! GPU's hardware decoder where it takes the file (baseline JPEGs, what ImageNet mostly
//! holds), nvJPEG's CUDA decoder for other JPEGs, and the CPU path ([`ImageFolder`]'s) for
//! what nvJPEG does not read (PNGs, CMYK). The crop, flip and normalisation run in one
//! kernel (`crop.cu`) straight into the batch on the device; the random choices are the
//! CPU path's ([`ImageFolder::augmentation`]), so both give the same crops (pixels differ
//! by the decoders' rounding and the CPU's reduced-size IDCT).
//!
//! The CPU's part is reading the files ([`ImageFolder::read_files`], which can run on
//! another thread while the GPU decodes the batch before) and their headers
//! ([`GpuLoader::plan`]).

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
    folder: ImageFolder,
    nvjpeg: NvJpeg,
    stream: Arc<CudaStream>,
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
    /// decoder only when `hardware` (see [`super::hardware_probe`]).
    pub fn new(
        folder: ImageFolder,
        ordinal: usize,
        hardware: bool,
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
        let nvjpeg = NvJpeg::open(hardware)?;
        let decoded = cuda("allocating", stream.alloc_zeros::<u8>(ALIGN))?;
        Ok(Self {
            folder,
            nvjpeg,
            stream,
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
    ) -> Result<Self, GpuLoaderError> {
        let left_out = super::hardware_probe::hardware_works(program, ordinal).err();
        let mut loader = Self::new(folder, ordinal, left_out.is_none())?;
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
            "nvJPEG {}, hardware decoder {hardware}",
            self.nvjpeg.version()
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
        for i in self.decode_jpegs(&batch) {
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

    /// The hardware decoder's JPEGs as one batch, then the others one by one; returns the
    /// images nvJPEG refused. A batch the hardware fails is decoded again one by one.
    fn decode_jpegs(&mut self, batch: &ReadBatch) -> Vec<usize> {
        let (base, _sync) = self.decoded.device_ptr(&self.stream);
        let image = |c: &Crop| Image {
            channel: [
                (base + c.offset) as *mut u8,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            ],
            pitch: [c.pitch as u32, 0, 0, 0],
        };
        let stream = self.stream.cu_stream();
        let mut refused = Vec::new();
        let mut one_by_one = |i: usize, counts: &mut DecodeCounts| {
            // SAFETY: `decoded` holds `pitch × height` bytes at the image's offset (sized
            // by `decode`) and lives until the stream is synchronised.
            match unsafe {
                self.nvjpeg
                    .decode_one(&batch.files[i], &mut image(&batch.crops[i]), stream)
            } {
                Ok(()) => counts.cuda += 1,
                Err(_) => refused.push(i),
            }
        };
        let mut counts = DecodeCounts::default();
        let mut on_hardware = Vec::new();
        for (i, route) in batch.routes.iter().enumerate() {
            match route {
                Route::Hardware => on_hardware.push(i),
                Route::Cuda => one_by_one(i, &mut counts),
                Route::Cpu => {}
            }
        }
        let jpegs: Vec<&[u8]> = on_hardware
            .iter()
            .map(|&i| batch.files[i].as_slice())
            .collect();
        let mut outs: Vec<Image> = on_hardware
            .iter()
            .map(|&i| image(&batch.crops[i]))
            .collect();
        // SAFETY: as above, for each image of the hardware's batch.
        match unsafe { self.nvjpeg.decode_on_hardware(&jpegs, &mut outs, stream) } {
            Ok(()) => counts.hardware += jpegs.len(),
            Err(e) => {
                if !self.hardware_failed {
                    eprintln!(
                        "ringmaster-trainer: nvJPEG's hardware decoder failed a batch ({e}); its CUDA decoder takes the JPEGs from here on"
                    );
                }
                self.hardware_failed = true;
                on_hardware.iter().for_each(|&i| one_by_one(i, &mut counts));
            }
        }
        self.counts.hardware += counts.hardware;
        self.counts.cuda += counts.cuda;
        refused
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
