//! ImageNet-style folders of images: `DIR/train/<class>/*.jpg` (or `DIR/<class>/*.jpg`; JPEG
//! or PNG, whatever the name says: [`decode`]), classes in sorted order. Training
//! augmentation as torchvision's for ResNets on ImageNet: a random resized crop (8–100 % of
//! the area, aspect 3/4–4/3), a horizontal flip, an antialiased bilinear resize to the
//! model's input, and per-channel normalization ([`resample`]). Every random choice is a
//! function of `(seed, epoch, index)` and the image's size, so runs repeat.

pub mod decode;
pub mod gpu;
pub mod hardware_probe;
pub mod imagenet_sized;
pub mod nvjpeg;
pub mod resample;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use self::decode::{DecodeError, Encoded};
use self::resample::Region;
use super::tensor::Tensor;

/// Errors reading an image folder.
#[derive(Debug, thiserror::Error)]
pub enum ImageFolderError {
    /// The folder could not be listed.
    #[error("listing {path}: {source}")]
    List {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// No class folders with images in them.
    #[error(
        "{0} has no class folders with .jpg/.jpeg/.png files (expected DIR/train/<class>/*.jpg or DIR/<class>/*.jpg)"
    )]
    Empty(String),
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A file could not be decoded.
    #[error("decoding {path}: {source}")]
    Decode {
        path: String,
        #[source]
        source: DecodeError,
    },
}

/// A folder of labelled images.
#[derive(Clone, Debug)]
pub struct ImageFolder {
    /// Class names, sorted; a label is an index into this.
    pub classes: Vec<String>,
    samples: Vec<(PathBuf, usize)>,
    image_size: usize,
    seed: u64,
    /// Shared by the folder's clones.
    buffers: BatchBuffers,
}

/// The pixel buffers of batches already used, for the next batches to write into. A new
/// batch's memory (154 MB at 256 × 224 px) comes fresh from the kernel, which faults in and
/// zeroes each of its pages at the first write: a sixth of a loader thread's time.
#[derive(Clone, Debug, Default)]
pub struct BatchBuffers(Arc<Mutex<Vec<Vec<f32>>>>);

impl BatchBuffers {
    /// Buffers kept at most: the reader's queue of batches and the one in use.
    const KEPT: usize = 4;

    /// A buffer of `len` values, reused when one was given back; what it holds is stale.
    fn take(&self, len: usize) -> Vec<f32> {
        match self.kept().pop() {
            Some(mut reused) => {
                reused.resize(len, 0.0);
                reused
            }
            None => vec![0.0; len],
        }
    }

    /// Hands a batch's images back once they are used (uploaded), for a later batch of
    /// the folder to write into.
    pub fn give_back(&self, images: Tensor) {
        let mut kept = self.kept();
        if kept.len() < Self::KEPT {
            kept.push(images.data);
        }
    }

    fn kept(&self) -> std::sync::MutexGuard<'_, Vec<Vec<f32>>> {
        // A panic while holding the lock leaves a list of whole buffers: still usable.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

fn list(dir: &Path) -> Result<Vec<PathBuf>, ImageFolderError> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|source| ImageFolderError::List {
            path: dir.display().to_string(),
            source,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    Ok(entries)
}

fn is_image(path: &Path) -> bool {
    path.extension().and_then(|e| e.to_str()).is_some_and(|e| {
        ["jpg", "jpeg", "png"]
            .iter()
            .any(|x| e.eq_ignore_ascii_case(x))
    })
}

impl ImageFolder {
    /// Indexes `dir` (its `train/` subfolder when there is one).
    pub fn open(dir: &Path, image_size: usize, seed: u64) -> Result<Self, ImageFolderError> {
        let root = if dir.join("train").is_dir() {
            dir.join("train")
        } else {
            dir.to_path_buf()
        };
        let mut classes = Vec::new();
        let mut samples = Vec::new();
        for class_dir in list(&root)?.into_iter().filter(|p| p.is_dir()) {
            let files: Vec<PathBuf> = list(&class_dir)?
                .into_iter()
                .filter(|p| is_image(p))
                .collect();
            if files.is_empty() {
                continue;
            }
            let label = classes.len();
            classes.push(
                class_dir
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .to_string(),
            );
            samples.extend(files.into_iter().map(|f| (f, label)));
        }
        if samples.is_empty() {
            return Err(ImageFolderError::Empty(root.display().to_string()));
        }
        Ok(Self {
            classes,
            samples,
            image_size,
            seed,
            buffers: BatchBuffers::default(),
        })
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether there are no images (never true for an opened folder).
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// Decoded, augmented and normalized images `[n, 3, size, size]` and their labels,
    /// decoded in parallel. Give the images back once used ([`ImageFolder::buffers`]).
    pub fn batch(
        &self,
        indices: &[usize],
        epoch: usize,
    ) -> Result<(Tensor, Vec<usize>), ImageFolderError> {
        let s = self.image_size;
        let per = 3 * s * s;
        let shape = [indices.len(), 3, s, s];
        // Every value is written below (each image whole), so a stale buffer will do.
        let mut images = Tensor::from_vec(&shape, self.buffers.take(indices.len() * per));
        images
            .data
            .par_chunks_mut(per)
            .zip(indices.par_iter())
            .try_for_each(|(out, &index)| self.sample(index, epoch, out))?;
        Ok((images, indices.iter().map(|&i| self.samples[i].1).collect()))
    }

    /// Where a batch's images go back once used ([`BatchBuffers::give_back`]), for a later
    /// batch to write into.
    pub fn buffers(&self) -> BatchBuffers {
        self.buffers.clone()
    }

    /// Image `index` as the model sees it in `epoch`: the crop is chosen on the full-size
    /// image, which is decoded only as large as the crop needs ([`Encoded::decode`]).
    fn sample(&self, index: usize, epoch: usize, out: &mut [f32]) -> Result<(), ImageFolderError> {
        let bytes = self.read(index)?;
        self.sample_from(index, epoch, &bytes, out)
    }

    /// The bytes of image `index`'s file.
    pub fn read(&self, index: usize) -> Result<Vec<u8>, ImageFolderError> {
        let path = &self.samples[index].0;
        std::fs::read(path).map_err(|source| ImageFolderError::Read {
            path: path.display().to_string(),
            source,
        })
    }

    /// The size of image `index`'s file in bytes, from its metadata (none when it cannot
    /// be read).
    pub fn file_bytes(&self, index: usize) -> Option<u64> {
        std::fs::metadata(&self.samples[index].0)
            .ok()
            .map(|m| m.len())
    }

    /// The bytes of the files of `indices`, read in parallel.
    pub fn read_files(&self, indices: &[usize]) -> Result<Vec<Vec<u8>>, ImageFolderError> {
        indices.par_iter().map(|&i| self.read(i)).collect()
    }

    /// Image `index`'s label.
    pub fn label(&self, index: usize) -> usize {
        self.samples[index].1
    }

    /// Side of the square crops.
    pub fn image_size(&self) -> usize {
        self.image_size
    }

    /// Image `index` (its file's `bytes`) as the model sees it in `epoch`, decoded on the
    /// CPU into planar `out` (`[3][size][size]`).
    pub fn sample_from(
        &self,
        index: usize,
        epoch: usize,
        bytes: &[u8],
        out: &mut [f32],
    ) -> Result<(), ImageFolderError> {
        let image = Encoded::new(bytes).map_err(|source| self.decode_error(index, source))?;
        let (width, height) = image.dimensions();
        let choice = self.augmentation(index, epoch, width, height);
        resized_crop(image, choice.crop, choice.flip, self.image_size, out)
            .map_err(|source| self.decode_error(index, source))
    }

    /// A decoding failure of image `index`, naming its file.
    pub fn decode_error(&self, index: usize, source: DecodeError) -> ImageFolderError {
        ImageFolderError::Decode {
            path: self.samples[index].0.display().to_string(),
            source,
        }
    }

    /// The random choices for image `index` (full size `width × height`) in `epoch`: the
    /// same wherever it is decoded (CPU or GPU), as they depend on nothing else.
    pub fn augmentation(
        &self,
        index: usize,
        epoch: usize,
        width: usize,
        height: usize,
    ) -> Augmentation {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ 0x1a6e_f01d);
        rng.set_stream(epoch as u64);
        rng.set_word_pos(index as u128 * 64);
        let crop = random_resized_crop(width, height, &mut rng);
        let flip = rng.random_bool(0.5);
        Augmentation { crop, flip }
    }
}

/// What augmentation does to one image in one epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Augmentation {
    /// `(x, y, width, height)` in the full-size image's pixels.
    pub crop: (usize, usize, usize, usize),
    /// Mirrored left to right.
    pub flip: bool,
}

/// `crop` (in the full-size image's pixels) of `image`, decoded only as large as the crop
/// needs to keep `size` pixels a side, resized to `size²` ([`resample::resize_normalize`]).
fn resized_crop(
    image: Encoded,
    crop: (usize, usize, usize, usize),
    flip: bool,
    size: usize,
    out: &mut [f32],
) -> Result<(), DecodeError> {
    let (x, y, width, height) = crop;
    let (rgb, scale) = image.decode(size as f64 / width.min(height) as f64)?;
    let region = Region {
        x: x as f64 * scale,
        y: y as f64 * scale,
        width: width as f64 * scale,
        height: height as f64 * scale,
    };
    resample::resize_normalize(&rgb, region, flip, size, out);
    Ok(())
}

/// A crop `(x, y, width, height)` covering 8–100 % of the image with aspect 3/4–4/3;
/// the whole image's centre square when ten tries do not fit.
fn random_resized_crop(
    width: usize,
    height: usize,
    rng: &mut ChaCha8Rng,
) -> (usize, usize, usize, usize) {
    let area = (width * height) as f64;
    for _ in 0..10 {
        let target = area * rng.random_range(0.08..=1.0);
        let ratio = rng
            .random_range((3.0f64 / 4.0).ln()..=(4.0f64 / 3.0).ln())
            .exp();
        let w = (target * ratio).sqrt().round() as usize;
        let h = (target / ratio).sqrt().round() as usize;
        if w >= 1 && h >= 1 && w <= width && h <= height {
            return (
                rng.random_range(0..=width - w),
                rng.random_range(0..=height - h),
                w,
                h,
            );
        }
    }
    let side = width.min(height);
    ((width - side) / 2, (height - side) / 2, side, side)
}

/// Writes a learnable dataset as an image folder: `per_class` JPEGs of each of `classes`
/// classes under `dir/train/class-NNN/` (the generator behind `make-dataset`).
pub fn write_learnable(
    dir: &Path,
    classes: usize,
    per_class: usize,
    image_size: usize,
    seed: u64,
) -> std::io::Result<usize> {
    let data = super::data::LearnableData::new(classes, image_size, seed).with_len(usize::MAX);
    let mut counts = vec![0usize; classes];
    let mut written = 0;
    let mut index = 0;
    while counts.iter().any(|&c| c < per_class) {
        let (image, labels) = data.batch(&[index]);
        index += 1;
        let label = labels[0];
        if counts[label] >= per_class {
            continue;
        }
        let s = image_size;
        // Planar floats around 0 to interleaved bytes.
        let bytes: Vec<u8> = (0..s * s)
            .flat_map(|p| (0..3).map(move |c| (c, p)))
            .map(|(c, p)| (image.data[c * s * s + p] * 40.0 + 128.0).clamp(0.0, 255.0) as u8)
            .collect();
        let folder = dir.join("train").join(format!("class-{label:03}"));
        std::fs::create_dir_all(&folder)?;
        let path = folder.join(format!("img-{:05}.jpg", counts[label]));
        jpeg_encoder::Encoder::new_file(&path, 95)
            .and_then(|e| e.encode(&bytes, s as u16, s as u16, jpeg_encoder::ColorType::Rgb))
            .map_err(std::io::Error::other)?;
        counts[label] += 1;
        written += 1;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch written into a used buffer is the batch a fresh folder makes: nothing of the
    /// batch before shows through. Buffers are reused, and only so many are kept.
    #[test]
    fn a_batch_in_a_used_buffer_is_the_same_batch_and_few_buffers_are_kept() {
        let dir = std::env::temp_dir().join(format!("batch-buffers-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        imagenet_sized::write(&dir, 2, 4, 5).unwrap();
        let folder = ImageFolder::open(&dir, 32, 3).unwrap();
        let (first, _) = folder.batch(&[0, 1, 2, 3], 0).unwrap();
        let used = first.data.as_ptr();
        folder.buffers().give_back(first);
        let (second, labels) = folder.batch(&[7, 6, 5, 4], 1).unwrap();
        assert_eq!(second.data.as_ptr(), used, "the used buffer was taken");
        let fresh = ImageFolder::open(&dir, 32, 3).unwrap();
        let (expected, expected_labels) = fresh.batch(&[7, 6, 5, 4], 1).unwrap();
        assert_eq!(second.data, expected.data);
        assert_eq!(labels, expected_labels);
        let (smaller, _) = folder.batch(&[1, 2], 0).unwrap();
        assert_eq!(smaller.data.len(), 2 * 3 * 32 * 32);
        folder.buffers().give_back(second);
        folder.buffers().give_back(smaller);
        for _ in 0..BatchBuffers::KEPT + 2 {
            folder.buffers().give_back(Tensor::zeros(&[1, 3, 32, 32]));
        }
        assert_eq!(folder.buffers.kept().len(), BatchBuffers::KEPT);
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Where the red plane of row `y` (of `size`) crosses half way from black to white,
    /// in output pixels, interpolated.
    fn edge(out: &[f32], size: usize, y: usize) -> f64 {
        let level = |x: usize| f64::from(out[y * size + x] * 0.229 + 0.485);
        let x = (1..size).find(|&x| level(x) >= 0.5).expect("an edge");
        let (a, b) = (level(x - 1), level(x));
        (x - 1) as f64 + (0.5 - a) / (b - a) + 0.5
    }

    /// A crop decoded at 1/8 lands where it does at full size, on an image whose sides are
    /// not whole blocks (its reduced size rounds up, its scale stays 1/8).
    #[test]
    fn a_crop_lands_in_the_same_place_at_a_reduced_scale() {
        let (w, h) = (1201usize, 1201usize);
        let gray: Vec<u8> = (0..w * h)
            .map(|i| if i % w < 1190 { 0 } else { 255 })
            .collect();
        let mut bytes = Vec::new();
        jpeg_encoder::Encoder::new(&mut bytes, 95)
            .encode(&gray, w as u16, h as u16, jpeg_encoder::ColorType::Luma)
            .unwrap();
        let (size, crop) = (64, (600, 300, 600, 600));
        let mut reduced = vec![0.0; 3 * size * size];
        resized_crop(
            Encoded::new(&bytes).unwrap(),
            crop,
            false,
            size,
            &mut reduced,
        )
        .unwrap();
        let (full, scale) = Encoded::new(&bytes).unwrap().decode(1.0).unwrap();
        assert_eq!(scale, 1.0);
        let region = Region {
            x: 600.0,
            y: 300.0,
            width: 600.0,
            height: 600.0,
        };
        let mut reference = vec![0.0; 3 * size * size];
        resample::resize_normalize(&full, region, false, size, &mut reference);
        // The edge at x = 1190 is (1190 − 600) / 600 of the way across.
        let want = 590.0 / 600.0 * size as f64;
        for y in [5, 32, 60] {
            let (at, at_full) = (edge(&reduced, size, y), edge(&reference, size, y));
            assert!(
                (at_full - want).abs() < 0.1,
                "full size: {at_full} for {want}"
            );
            assert!((at - want).abs() < 0.25, "at 1/8: {at} for {want}");
        }
    }
}
