//! A region of an RGB image resized to the model's input, flipped when asked, and
//! normalized into planar floats: the tail of torchvision's `RandomResizedCrop`,
//! `RandomHorizontalFlip` and `Normalize`, with PIL's bilinear filter (antialiased: when
//! shrinking, the triangle widens with the scale, so every source pixel counts and a fine
//! pattern averages out instead of aliasing). Close to torchvision on PIL images, not equal:
//! the taps may read up to the filter's reach past the region (PIL's `resize(box=…)`, where
//! torchvision crops first), and the sums stay in f32 where PIL rounds to 8 bits between
//! its passes. Separable: a horizontal pass over the rows the region needs, then a
//! vertical one.

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

/// The filter taps of each output pixel along one axis: output `i` is the weighted sum of
/// source pixels `start[i]..start[i] + taps`, with `weights[i * taps..][..taps]` (zero past
/// the image's edge).
struct Taps {
    start: Vec<usize>,
    taps: usize,
    weights: Vec<f32>,
}

/// PIL's `precompute_coeffs` for the bilinear filter: output pixel `i`'s centre sits at
/// `from + (i + ½)·scale` in the source; the triangle's support is one source pixel, widened
/// by `scale` when shrinking; weights sum to one. Taps past the image's edge are dropped (and
/// may reach a little outside the region, as PIL's `resize(box=…)` does).
fn taps(from: f64, length: f64, source: usize, out: usize) -> Taps {
    let scale = length / out as f64;
    let widen = scale.max(1.0);
    let support = widen;
    let taps = support.ceil() as usize * 2 + 1;
    let mut start = Vec::with_capacity(out);
    let mut weights = vec![0f32; out * taps];
    for (i, row) in weights.chunks_exact_mut(taps).enumerate() {
        let centre = from + (i as f64 + 0.5) * scale;
        let first = ((centre - support + 0.5).floor().max(0.0) as usize).min(source - 1);
        let end = ((centre + support + 0.5).floor() as usize).clamp(first + 1, source);
        let count = (end - first).min(taps);
        let mut sum = 0.0;
        for (k, w) in row.iter_mut().take(count).enumerate() {
            let distance = ((first + k) as f64 + 0.5 - centre) / widen;
            let weight = (1.0 - distance.abs()).max(0.0);
            *w = weight as f32;
            sum += weight;
        }
        if sum > 0.0 {
            let norm = (1.0 / sum) as f32;
            row.iter_mut().take(count).for_each(|w| *w *= norm);
        }
        start.push(first);
    }
    Taps {
        start,
        taps,
        weights,
    }
}

/// Resizes `region` of `image` to `size × size`, mirrored left to right when `flip`, and
/// writes it normalized with ImageNet's mean and deviation into planar `out`
/// (`[3][size][size]`).
pub fn resize_normalize(image: &Rgb, region: Region, flip: bool, size: usize, out: &mut [f32]) {
    assert_eq!(out.len(), 3 * size * size, "out holds one planar image");
    let across = taps(region.x, region.width, image.width, size);
    let down = taps(region.y, region.height, image.height, size);
    // The source rows the vertical taps reach.
    let first_row = down.start[0];
    let end_row = (down.start[size - 1] + down.taps).min(image.height);
    // Horizontal pass: each needed row, `size` pixels wide, interleaved RGB, in 0..255.
    let mut rows = vec![0f32; (end_row - first_row) * size * 3];
    for (y, row) in (first_row..end_row).zip(rows.chunks_exact_mut(size * 3)) {
        let source = &image.pixels[y * image.width * 3..(y + 1) * image.width * 3];
        for ((pixel, &start), weights) in row
            .chunks_exact_mut(3)
            .zip(&across.start)
            .zip(across.weights.chunks_exact(across.taps))
        {
            let reach = (image.width - start).min(across.taps);
            let mut sum = [0f32; 3];
            for (s, &w) in source[start * 3..(start + reach) * 3]
                .chunks_exact(3)
                .zip(weights)
            {
                sum[0] += w * f32::from(s[0]);
                sum[1] += w * f32::from(s[1]);
                sum[2] += w * f32::from(s[2]);
            }
            pixel.copy_from_slice(&sum);
        }
    }
    // Vertical pass, then `(v / 255 − mean) / std` as one multiply-add, into the planes.
    let gain: [f32; 3] = std::array::from_fn(|c| 1.0 / (255.0 * STD[c]));
    let offset: [f32; 3] = std::array::from_fn(|c| -MEAN[c] / STD[c]);
    let mut line = vec![0f32; size * 3];
    let (red, rest) = out.split_at_mut(size * size);
    let (green, blue) = rest.split_at_mut(size * size);
    for (oy, weights) in down.weights.chunks_exact(down.taps).enumerate() {
        let start = down.start[oy];
        let reach = (image.height - start).min(down.taps);
        line.fill(0.0);
        for (k, &w) in weights[..reach].iter().enumerate() {
            let row = &rows[(start + k - first_row) * size * 3..][..size * 3];
            for (l, &v) in line.iter_mut().zip(row) {
                *l += w * v;
            }
        }
        let at = oy * size;
        for (ox, pixel) in line.chunks_exact(3).enumerate() {
            let x = at + if flip { size - 1 - ox } else { ox };
            red[x] = pixel[0] * gain[0] + offset[0];
            green[x] = pixel[1] * gain[1] + offset[1];
            blue[x] = pixel[2] * gain[2] + offset[2];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_outputs_taps_sum_to_one_and_stay_inside_the_image() {
        for (from, length, source, out) in [
            (0.0, 10.0, 10, 10),
            (0.0, 500.0, 500, 224),
            (37.25, 90.5, 200, 224),
            (0.0, 3.0, 3, 224),
            (1000.0, 3000.0, 4000, 7),
        ] {
            let t = taps(from, length, source, out);
            for (i, weights) in t.weights.chunks_exact(t.taps).enumerate() {
                let reach = (source - t.start[i]).min(t.taps);
                let sum: f32 = weights[..reach].iter().sum();
                assert!((sum - 1.0).abs() < 1e-5, "output {i}: {sum}");
                assert!(weights[reach..].iter().all(|&w| w == 0.0));
                assert!(t.start[i] < source);
            }
        }
    }

    #[test]
    fn the_same_size_copies_and_half_size_averages_one_three_three_one() {
        let same = taps(0.0, 6.0, 6, 6);
        for (i, weights) in same.weights.chunks_exact(same.taps).enumerate() {
            assert_eq!(same.start[i], i);
            assert_eq!(weights[0], 1.0, "pixel {i} is itself: {weights:?}");
        }
        // Halving: the triangle widened to two source pixels puts 1, 3, 3, 1 (eighths)
        // on the four pixels around each output's centre, as PIL does.
        let half = taps(0.0, 12.0, 12, 6);
        let i = 2;
        assert_eq!(half.start[i], 3);
        assert_eq!(
            &half.weights[i * half.taps..][..4],
            &[0.125, 0.375, 0.375, 0.125]
        );
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
        let region = Region {
            x: 0.0,
            y: 0.0,
            width: 896.0,
            height: 64.0,
        };
        resize_normalize(&source, region, false, 224, &mut out);
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
