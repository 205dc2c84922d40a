//! A region of an RGB image resized to the model's input, flipped when asked, and
//! normalized into planar floats: the tail of torchvision's `RandomResizedCrop`,
//! `RandomHorizontalFlip` and `Normalize`, with PIL's bilinear filter (antialiased: when
//! shrinking, the triangle widens with the scale, so every source pixel counts and a fine
//! pattern averages out instead of aliasing). The resize is `fast_image_resize`'s
//! convolution (PIL's filters and crop box, in SIMD, 8 bits between its two passes and
//! out, as PIL): like torchvision on PIL images, the taps may read up to the filter's reach
//! past the region (PIL's `resize(box=…)`, where torchvision crops first).

use std::cell::RefCell;

use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};

use super::decode::Rgb;

/// ImageNet's per-channel mean and standard deviation (of values in 0..1).
const MEAN: [f32; 3] = [0.485, 0.456, 0.406];
const STD: [f32; 3] = [0.229, 0.224, 0.225];

/// A rectangle of an image in its pixel coordinates; fractions are allowed (a crop chosen on
/// the full-size image, seen on one decoded smaller).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Region {
    /// Left edge.
    pub x: f64,
    /// Top edge.
    pub y: f64,
    /// Width.
    pub width: f64,
    /// Height.
    pub height: f64,
}

thread_local! {
    /// Each decoding thread's resizer (it keeps its buffers from one image to the next).
    static RESIZER: RefCell<Resizer> = RefCell::new(Resizer::new());
}

/// Resizes `region` of `image` to `size × size`, mirrored left to right when `flip`, and
/// writes it normalized with ImageNet's mean and deviation into planar `out`
/// (`[3][size][size]`).
pub fn resize_normalize(image: &Rgb, region: Region, flip: bool, size: usize, out: &mut [f32]) {
    assert_eq!(out.len(), 3 * size * size, "out holds one planar image");
    let source = ImageRef::new(
        image.width as u32,
        image.height as u32,
        &image.pixels,
        PixelType::U8x3,
    )
    .expect("an Rgb holds width × height × 3 bytes");
    let mut resized = Image::new(size as u32, size as u32, PixelType::U8x3);
    let options = ResizeOptions::new()
        .resize_alg(ResizeAlg::Convolution(FilterType::Bilinear))
        .crop(region.x, region.y, region.width, region.height);
    RESIZER
        .with(|resizer| resizer.borrow_mut().resize(&source, &mut resized, &options))
        .unwrap_or_else(|e| {
            panic!(
                "resizing {region:?} of {}×{}: {e}",
                image.width, image.height
            )
        });
    // `(v / 255 − mean) / std` as one multiply-add, into the planes.
    let gain: [f32; 3] = std::array::from_fn(|c| 1.0 / (255.0 * STD[c]));
    let offset: [f32; 3] = std::array::from_fn(|c| -MEAN[c] / STD[c]);
    let (red, rest) = out.split_at_mut(size * size);
    let (green, blue) = rest.split_at_mut(size * size);
    for (oy, row) in resized.buffer().chunks_exact(size * 3).enumerate() {
        let at = oy * size;
        for (ox, pixel) in row.chunks_exact(3).enumerate() {
            let x = at + if flip { size - 1 - ox } else { ox };
            red[x] = f32::from(pixel[0]) * gain[0] + offset[0];
            green[x] = f32::from(pixel[1]) * gain[1] + offset[1];
            blue[x] = f32::from(pixel[2]) * gain[2] + offset[2];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Halving: PIL's triangle, widened to two source pixels, weighs the four pixels around
    /// each output's centre 1, 3, 3, 1 (eighths); two-tap bilinear would weigh the middle two
    /// alone. On x² · 2 around output 2 (centre 5.0): 18, 32, 50, 72 give 42, not 41.
    #[test]
    fn halving_weighs_four_pixels_one_three_three_one() {
        let source = image(12, 1, |x, _| [(x * x * 2) as u8; 3]);
        let mut out = vec![0.0; 3 * 6 * 6];
        resize_normalize(&source, whole(&source), false, 6, &mut out);
        let red = levels(&out, 0, 6);
        assert!((red[2] - 42.0).abs() < 1e-3, "{:?}", &red[..6]);
    }

    fn image(width: usize, height: usize, at: impl Fn(usize, usize) -> [u8; 3]) -> Rgb {
        Rgb {
            width,
            height,
            pixels: (0..width * height)
                .flat_map(|i| at(i % width, i / width))
                .collect(),
        }
    }

    fn whole(image: &Rgb) -> Region {
        Region {
            x: 0.0,
            y: 0.0,
            width: image.width as f64,
            height: image.height as f64,
        }
    }

    /// Plane `c` of `out` back in 0..255.
    fn levels(out: &[f32], c: usize, size: usize) -> Vec<f32> {
        out[c * size * size..(c + 1) * size * size]
            .iter()
            .map(|v| (v * STD[c] + MEAN[c]) * 255.0)
            .collect()
    }

    #[test]
    fn the_whole_image_at_its_own_size_is_itself_normalized() {
        let source = image(5, 5, |x, y| [(x * 50) as u8, (y * 40) as u8, (x * y) as u8]);
        let mut out = vec![f32::NAN; 75];
        resize_normalize(&source, whole(&source), false, 5, &mut out);
        for (i, p) in source.pixels.chunks_exact(3).enumerate() {
            for c in 0..3 {
                let want = (f32::from(p[c]) / 255.0 - MEAN[c]) / STD[c];
                assert!(
                    (out[c * 25 + i] - want).abs() < 1e-5,
                    "pixel {i} channel {c}"
                );
            }
        }
    }

    #[test]
    fn a_flip_mirrors_each_row() {
        let source = image(37, 23, |x, y| {
            [(x * 7) as u8, (y * 11) as u8, ((x + y) * 3) as u8]
        });
        let region = Region {
            x: 3.5,
            y: 2.0,
            width: 30.0,
            height: 17.25,
        };
        let (mut plain, mut flipped) = (vec![0.0; 3 * 16 * 16], vec![0.0; 3 * 16 * 16]);
        resize_normalize(&source, region, false, 16, &mut plain);
        resize_normalize(&source, region, true, 16, &mut flipped);
        for row in 0..3 * 16 {
            let (a, b) = (&plain[row * 16..][..16], &flipped[row * 16..][..16]);
            assert!(a.iter().eq(b.iter().rev()), "row {row}");
        }
    }

    #[test]
    fn a_constant_image_stays_constant_at_any_scale() {
        let source = image(300, 200, |_, _| [90, 160, 230]);
        for (region, size) in [
            (whole(&source), 224),
            (whole(&source), 7),
            (
                Region {
                    x: 10.5,
                    y: 20.25,
                    width: 3.0,
                    height: 2.0,
                },
                64,
            ),
        ] {
            let mut out = vec![0.0; 3 * size * size];
            resize_normalize(&source, region, false, size, &mut out);
            for (c, want) in [90.0, 160.0, 230.0].into_iter().enumerate() {
                assert!(
                    levels(&out, c, size)
                        .iter()
                        .all(|v| (v - want).abs() < 1e-3),
                    "{region:?} to {size}: channel {c}"
                );
            }
        }
    }

    /// A one-pixel line every fourth column, shrunk four times: point-sampling bilinear
    /// (two taps) would miss every line and return black; the widened filter keeps the
    /// image's mean.
    #[test]
    fn shrinking_averages_fine_detail_instead_of_aliasing() {
        let source = image(896, 64, |x, _| if x % 4 == 0 { [255; 3] } else { [0; 3] });
        let mut out = vec![0.0; 3 * 224 * 224];
        resize_normalize(&source, whole(&source), false, 224, &mut out);
        let red = levels(&out, 0, 224);
        let mean = red.iter().sum::<f32>() / red.len() as f32;
        assert!((mean - 63.75).abs() < 1.0, "mean {mean}");
        // Away from the edges every output sees the same mix.
        let row = &red[100 * 224..101 * 224];
        assert!(
            row[2..222].iter().all(|v| (v - 63.75).abs() < 1.0),
            "{:?}",
            &row[..8]
        );
    }
}
