//! ImageNet-style folders of JPEGs: `DIR/train/<class>/*.jpg` (or `DIR/<class>/*.jpg`),
//! classes in sorted order. Training augmentation as for ResNets on ImageNet: a random
//! resized crop (8–100 % of the area, aspect 3/4–4/3), a horizontal flip, bilinear resize to
//! the model's input, and per-channel normalization. Every random choice is a function of
//! `(seed, epoch, index)`, so runs repeat.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::tensor::Tensor;

/// ImageNet's per-channel mean and standard deviation (of values in 0..1).
const MEAN: [f32; 3] = [0.485, 0.456, 0.406];
const STD: [f32; 3] = [0.229, 0.224, 0.225];

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
    /// No class folders with JPEGs in them.
    #[error(
        "{0} has no class folders with .jpg/.jpeg files (expected DIR/train/<class>/*.jpg or DIR/<class>/*.jpg)"
    )]
    Empty(String),
    /// A file could not be opened or decoded.
    #[error("decoding {path}: {message}")]
    Decode { path: String, message: String },
}

/// A folder of labelled JPEGs.
#[derive(Clone, Debug)]
pub struct ImageFolder {
    /// Class names, sorted; a label is an index into this.
    pub classes: Vec<String>,
    samples: Vec<(PathBuf, usize)>,
    image_size: usize,
    seed: u64,
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

fn is_jpeg(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("jpg") || e.eq_ignore_ascii_case("jpeg"))
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
                .filter(|p| is_jpeg(p))
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
    /// decoded in parallel.
    pub fn batch(
        &self,
        indices: &[usize],
        epoch: usize,
    ) -> Result<(Tensor, Vec<usize>), ImageFolderError> {
        let s = self.image_size;
        let per = 3 * s * s;
        let mut images = Tensor::zeros(&[indices.len(), 3, s, s]);
        images
            .data
            .par_chunks_mut(per)
            .zip(indices.par_iter())
            .try_for_each(|(out, &index)| self.sample(index, epoch, out))?;
        Ok((images, indices.iter().map(|&i| self.samples[i].1).collect()))
    }

    fn sample(&self, index: usize, epoch: usize, out: &mut [f32]) -> Result<(), ImageFolderError> {
        let (path, _) = &self.samples[index];
        let (width, height, rgb) = decode(path)?;
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ 0x1a6e_f01d);
        rng.set_stream(epoch as u64);
        rng.set_word_pos(index as u128 * 64);
        let (x0, y0, cw, ch) = random_resized_crop(width, height, &mut rng);
        let flip = rng.random_bool(0.5);
        resize_normalize(&rgb, width, (x0, y0, cw, ch), flip, self.image_size, out);
        Ok(())
    }
}

/// Decodes a JPEG to RGB bytes.
pub fn decode(path: &Path) -> Result<(usize, usize, Vec<u8>), ImageFolderError> {
    let error = |message: String| ImageFolderError::Decode {
        path: path.display().to_string(),
        message,
    };
    let file = File::open(path).map_err(|e| error(e.to_string()))?;
    let mut decoder = jpeg_decoder::Decoder::new(BufReader::new(file));
    let pixels = decoder.decode().map_err(|e| error(e.to_string()))?;
    let info = decoder
        .info()
        .ok_or_else(|| error("no image header".into()))?;
    let (w, h) = (usize::from(info.width), usize::from(info.height));
    let rgb = match info.pixel_format {
        jpeg_decoder::PixelFormat::RGB24 => pixels,
        jpeg_decoder::PixelFormat::L8 => pixels.iter().flat_map(|&g| [g, g, g]).collect(),
        other => {
            return Err(error(format!(
                "pixel format {other:?} is not supported (use RGB or grayscale JPEGs)"
            )));
        }
    };
    Ok((w, h, rgb))
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

/// Bilinear resize of `crop` from `rgb` (interleaved, `width` wide) to `size`², flipped when
/// asked, normalized into planar `out`.
fn resize_normalize(
    rgb: &[u8],
    width: usize,
    crop: (usize, usize, usize, usize),
    flip: bool,
    size: usize,
    out: &mut [f32],
) {
    let (x0, y0, cw, ch) = crop;
    let scale_x = cw as f32 / size as f32;
    let scale_y = ch as f32 / size as f32;
    for oy in 0..size {
        let fy = ((oy as f32 + 0.5) * scale_y - 0.5).clamp(0.0, (ch - 1) as f32);
        let (y_lo, wy) = (fy.floor() as usize, fy - fy.floor());
        let y_hi = (y_lo + 1).min(ch - 1);
        for ox in 0..size {
            let sx = if flip { size - 1 - ox } else { ox };
            let fx = ((sx as f32 + 0.5) * scale_x - 0.5).clamp(0.0, (cw - 1) as f32);
            let (x_lo, wx) = (fx.floor() as usize, fx - fx.floor());
            let x_hi = (x_lo + 1).min(cw - 1);
            for c in 0..3 {
                let at = |x: usize, y: usize| f32::from(rgb[((y0 + y) * width + x0 + x) * 3 + c]);
                let top = at(x_lo, y_lo) * (1.0 - wx) + at(x_hi, y_lo) * wx;
                let bottom = at(x_lo, y_hi) * (1.0 - wx) + at(x_hi, y_hi) * wx;
                let value = (top * (1.0 - wy) + bottom * wy) / 255.0;
                out[(c * size + oy) * size + ox] = (value - MEAN[c]) / STD[c];
            }
        }
    }
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
