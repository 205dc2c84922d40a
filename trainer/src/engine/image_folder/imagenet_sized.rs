//! A folder of JPEGs shaped like ImageNet's train set, for timing loaders (`make-dataset
//! --imagenet-sizes`): the sizes follow ImageNet's mix (most 500 pixels on the long side,
//! landscape and portrait, a tenth larger photos up to 1,600), 4:2:0 baseline at quality
//! 90, with content textured enough that the files average about 100 kB (ImageNet's,
//! about 110 kB). The pictures mean nothing (a class-coloured gradient under random waves
//! and grain): they are for decoding speed, not for learning.

use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

/// `(width, height)` of image `index`, drawn from ImageNet's mix of sizes.
pub fn size_of(rng: &mut ChaCha8Rng) -> (usize, usize) {
    let roll: f64 = rng.random();
    match roll {
        r if r < 0.45 => (500, 375),
        r if r < 0.60 => (375, 500),
        r if r < 0.70 => (500, 333),
        r if r < 0.78 => (500, 500),
        r if r < 0.85 => (333, 500),
        r if r < 0.90 => (500, rng.random_range(280..=500)),
        _ => {
            let long = rng.random_range(600..=1600usize);
            let short = long * rng.random_range(2..=3) / 4 + long % 3;
            if rng.random_bool(0.7) {
                (long, short)
            } else {
                (short, long)
            }
        }
    }
}

/// Interleaved RGB of a `width × height` picture of class `label`.
fn picture(width: usize, height: usize, label: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
    let hue = label as f32 * 2.399;
    let base = [hue.sin(), (hue + 2.1).sin(), (hue + 4.2).sin()].map(|v| 128.0 + 60.0 * v);
    let waves: Vec<(f32, f32, f32, f32)> = (0..4)
        .map(|_| {
            (
                rng.random_range(0.005..0.2),
                rng.random_range(0.005..0.2),
                rng.random_range(0.0..6.3),
                rng.random_range(8.0..30.0),
            )
        })
        .collect();
    let mut grain = ChaCha8Rng::seed_from_u64(rng.random());
    let mut pixels = Vec::with_capacity(width * height * 3);
    for y in 0..height {
        for x in 0..width {
            let (fx, fy) = (x as f32, y as f32);
            let shade: f32 = waves
                .iter()
                .map(|&(a, b, phase, amp)| amp * (a * fx + b * fy + phase).sin())
                .sum();
            let ramp = 40.0 * (fx / width as f32 - fy / height as f32);
            for (c, &b) in base.iter().enumerate() {
                let noise = grain.random_range(-9.0f32..9.0);
                let tint = if c == 1 { -0.5 } else { 1.0 };
                pixels.push((b + ramp + tint * shade + noise).clamp(0.0, 255.0) as u8);
            }
        }
    }
    pixels
}

/// Writes `per_class` such JPEGs of each of `classes` classes under
/// `dir/train/class-NNN/`, in parallel; returns how many and their bytes.
pub fn write(
    dir: &Path,
    classes: usize,
    per_class: usize,
    seed: u64,
) -> std::io::Result<(usize, u64)> {
    for label in 0..classes {
        std::fs::create_dir_all(dir.join("train").join(format!("class-{label:03}")))?;
    }
    let bytes: u64 = (0..classes * per_class)
        .into_par_iter()
        .map(|i| {
            let (label, n) = (i % classes, i / classes);
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_1a6e);
            rng.set_stream(i as u64);
            let (width, height) = size_of(&mut rng);
            let pixels = picture(width, height, label, &mut rng);
            let mut jpeg = Vec::new();
            jpeg_encoder::Encoder::new(&mut jpeg, 90)
                .encode(
                    &pixels,
                    width as u16,
                    height as u16,
                    jpeg_encoder::ColorType::Rgb,
                )
                .map_err(std::io::Error::other)?;
            let path = dir
                .join("train")
                .join(format!("class-{label:03}"))
                .join(format!("img-{n:05}.jpg"));
            std::fs::write(path, &jpeg)?;
            Ok(jpeg.len() as u64)
        })
        .sum::<std::io::Result<u64>>()?;
    Ok((classes * per_class, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sizes_are_mostly_500_on_the_long_side_with_a_tail_of_larger_photos() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let sizes: Vec<_> = (0..2000).map(|_| size_of(&mut rng)).collect();
        let long_500 = sizes.iter().filter(|(w, h)| *w.max(h) == 500).count();
        let larger = sizes.iter().filter(|(w, h)| *w.max(h) > 500).count();
        assert!(
            (1700..1860).contains(&long_500),
            "{long_500} of 2000 at 500"
        );
        assert!((140..260).contains(&larger), "{larger} of 2000 larger");
        assert!(
            sizes
                .iter()
                .all(|&(w, h)| w >= 280 && h >= 280 && w <= 1600 && h <= 1600)
        );
    }

    #[test]
    fn a_folder_of_them_decodes_and_averages_about_imagenets_file_size() {
        let dir = std::env::temp_dir().join(format!("imagenet-sized-{}", std::process::id()));
        let (n, bytes) = write(&dir, 2, 12, 7).unwrap();
        assert_eq!(n, 24);
        let mean = bytes / n as u64;
        assert!((60_000..200_000).contains(&mean), "{mean} bytes a file");
        let folder = super::super::ImageFolder::open(&dir, 64, 0).unwrap();
        assert_eq!(folder.len(), 24);
        let (images, labels) = folder.batch(&(0..24).collect::<Vec<_>>(), 0).unwrap();
        assert_eq!(images.shape, vec![24, 3, 64, 64]);
        assert_eq!(labels.iter().filter(|&&l| l == 1).count(), 12);
        std::fs::remove_dir_all(&dir).ok();
    }
}
