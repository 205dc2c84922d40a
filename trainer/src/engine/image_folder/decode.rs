//! Image files to RGB bytes, as ImageNet's files need: JPEGs baseline or progressive, in
//! colour, grayscale or CMYK/YCCK (ImageNet's train set has 22 CMYK JPEGs), and PNGs (it has
//! one named `.JPEG`), told apart by their first bytes, not their names.
//!
//! A JPEG is decoded at the smallest scale its DCT allows (1/8, 1/4, 1/2 or 1) that still
//! gives the crop as many pixels as it needs: a 12-megapixel photo cropped to 224 px does not
//! pay for its full-size IDCT and colour conversion, and the DCT's own averaging does part of
//! the downscaling. Two decoders, each where it is faster: `jpeg-decoder`, which has the
//! reduced-size IDCT, for a reduced scale; `zune-jpeg` (SIMD, about 1.6× faster on one core
//! at ImageNet's sizes) for the full size, which is what ImageNet-sized images mostly need,
//! with `jpeg-decoder` again for what `zune-jpeg` refuses (lossless JPEGs, for one).

/// Why an image could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The JPEG is broken or uses what the decoder does not support.
    #[error("{0}")]
    Jpeg(#[from] jpeg_decoder::Error),
    /// The PNG is broken.
    #[error("PNG: {0}")]
    Png(#[from] png::DecodingError),
    /// It decodes, but not to something that can be made RGB.
    #[error("{0}")]
    Unsupported(String),
}

/// An image's pixels as interleaved RGB bytes, `width × height × 3`.
#[derive(Clone, Debug, PartialEq)]
pub struct Rgb {
    /// Pixels across.
    pub width: usize,
    /// Pixels down.
    pub height: usize,
    /// Row by row, `[r, g, b]` per pixel.
    pub pixels: Vec<u8>,
}

/// The eight bytes every PNG starts with.
const PNG_SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";

/// An encoded image whose header has been read.
pub struct Encoded<'a> {
    format: Format<'a>,
    width: usize,
    height: usize,
}

// One lives on the stack for one image: its size does not matter.
#[allow(clippy::large_enum_variant)]
enum Format<'a> {
    Jpeg(jpeg_decoder::Decoder<&'a [u8]>, &'a [u8]),
    Png(png::Reader<std::io::Cursor<&'a [u8]>>),
}

impl<'a> Encoded<'a> {
    /// Reads the header of the image in `bytes`: a PNG when it starts as one, else a JPEG.
    pub fn new(bytes: &'a [u8]) -> Result<Self, DecodeError> {
        let (format, (width, height)) = if bytes.starts_with(PNG_SIGNATURE) {
            let mut decoder = png::Decoder::new(std::io::Cursor::new(bytes));
            decoder.set_transformations(png::Transformations::normalize_to_color8());
            let reader = decoder.read_info()?;
            let (width, height) = reader.info().size();
            (Format::Png(reader), (width as usize, height as usize))
        } else {
            let mut decoder = jpeg_decoder::Decoder::new(bytes);
            decoder.read_info()?;
            let info = decoder.info().expect("read_info succeeded");
            (
                Format::Jpeg(decoder, bytes),
                (usize::from(info.width), usize::from(info.height)),
            )
        };
        if width == 0 || height == 0 {
            return Err(DecodeError::Unsupported(format!(
                "the image is {width}×{height} pixels"
            )));
        }
        Ok(Self {
            format,
            width,
            height,
        })
    }

    /// Full-size width and height.
    pub fn dimensions(&self) -> (usize, usize) {
        (self.width, self.height)
    }

    /// Decodes to RGB, at least `min_scale` times the full size in both directions, and
    /// says at what scale: a JPEG may come out at 1/2, 1/4 or 1/8 of it (each 8×8 block
    /// becoming 4×4, 2×2 or 1×1 pixels; a partial block at the right or bottom edge still
    /// gives a whole pixel), anything else at full size (1).
    pub fn decode(self, min_scale: f64) -> Result<(Rgb, f64), DecodeError> {
        match self.format {
            Format::Jpeg(decoder, bytes) => {
                decode_jpeg(decoder, bytes, self.width, self.height, min_scale)
            }
            Format::Png(reader) => Ok((decode_png(reader)?, 1.0)),
        }
    }
}

/// The JPEG's pixels at the smallest DCT scale (in eighths) that keeps `min_scale`, and
/// that scale.
fn decode_jpeg(
    mut decoder: jpeg_decoder::Decoder<&[u8]>,
    bytes: &[u8],
    width: usize,
    height: usize,
    min_scale: f64,
) -> Result<(Rgb, f64), DecodeError> {
    // An image under one block a side keeps its size (its one block's pixels).
    let eighths = if width.min(height) < 8 {
        8
    } else {
        [1, 2, 4, 8]
            .into_iter()
            .find(|&e| e as f64 / 8.0 >= min_scale)
            .unwrap_or(8)
    };
    if eighths == 8 {
        // What zune-jpeg refuses, jpeg-decoder may still read (below, at full size).
        if let Some(rgb) = decode_jpeg_full(bytes) {
            return Ok((rgb, 1.0));
        }
    }
    // The decoder picks the smallest scale reaching the requested size in *either*
    // direction, and rounds up: ask for this scale's own size, and check what it gave.
    let scaled = |len: usize| ((len * eighths).div_ceil(8)).min(usize::from(u16::MAX)) as u16;
    let (mut w, mut h) = decoder.scale(scaled(width), scaled(height))?;
    let mut scale = eighths as f64 / 8.0;
    if (w, h) != (scaled(width), scaled(height)) {
        (w, h) = decoder.scale(width as u16, height as u16)?;
        scale = 1.0;
    }
    let pixels = decoder.decode()?;
    let (w, h) = (usize::from(w), usize::from(h));
    let format = decoder.info().expect("decoded").pixel_format;
    let pixels = match format {
        jpeg_decoder::PixelFormat::RGB24 => pixels,
        jpeg_decoder::PixelFormat::L8 => gray_to_rgb(&pixels),
        jpeg_decoder::PixelFormat::CMYK32 => cmyk_to_rgb(&pixels),
        other => {
            return Err(DecodeError::Unsupported(format!(
                "pixel format {other:?} is not supported (use RGB, grayscale or CMYK JPEGs)"
            )));
        }
    };
    if pixels.len() != w * h * 3 {
        return Err(DecodeError::Unsupported(format!(
            "{} bytes decoded for {w}×{h} pixels",
            pixels.len()
        )));
    }
    Ok((
        Rgb {
            width: w,
            height: h,
            pixels,
        },
        scale,
    ))
}

/// The JPEG's pixels at full size by `zune-jpeg`, converted to RGB by it (from grayscale,
/// YCbCr, CMYK or YCCK); none when it refuses the file.
fn decode_jpeg_full(bytes: &[u8]) -> Option<Rgb> {
    use zune_jpeg::zune_core::{
        bytestream::ZCursor, colorspace::ColorSpace, options::DecoderOptions,
    };
    // Its default limit is 16,384 pixels a side; a JPEG's is 65,535.
    let options = DecoderOptions::default()
        .jpeg_set_out_colorspace(ColorSpace::RGB)
        .set_max_width(usize::from(u16::MAX))
        .set_max_height(usize::from(u16::MAX));
    let mut decoder = zune_jpeg::JpegDecoder::new_with_options(ZCursor::new(bytes), options);
    let pixels = decoder.decode().ok()?;
    let (width, height) = decoder.dimensions()?;
    (pixels.len() == width * height * 3).then_some(Rgb {
        width,
        height,
        pixels,
    })
}

/// The PNG's first frame as RGB (alpha dropped, as PIL's `convert("RGB")` does).
fn decode_png(mut reader: png::Reader<std::io::Cursor<&[u8]>>) -> Result<Rgb, DecodeError> {
    let size = reader.output_buffer_size().ok_or_else(|| {
        DecodeError::Unsupported("the PNG is too large to decode in memory".into())
    })?;
    let mut buffer = vec![0; size];
    let frame = reader.next_frame(&mut buffer)?;
    let (w, h) = (frame.width as usize, frame.height as usize);
    let rows = buffer
        .chunks(frame.line_size)
        .take(h)
        .map(|row| &row[..w * frame.color_type.samples()]);
    let mut pixels = Vec::with_capacity(w * h * 3);
    for row in rows {
        match frame.color_type {
            png::ColorType::Rgb => pixels.extend_from_slice(row),
            png::ColorType::Rgba => row
                .chunks_exact(4)
                .for_each(|p| pixels.extend_from_slice(&p[..3])),
            png::ColorType::Grayscale => row.iter().for_each(|&g| pixels.extend([g, g, g])),
            png::ColorType::GrayscaleAlpha => {
                row.chunks_exact(2).for_each(|p| pixels.extend([p[0]; 3]))
            }
            png::ColorType::Indexed => {
                return Err(DecodeError::Unsupported(
                    "an indexed PNG was not expanded".into(),
                ));
            }
        }
    }
    Ok(Rgb {
        width: w,
        height: h,
        pixels,
    })
}

fn gray_to_rgb(gray: &[u8]) -> Vec<u8> {
    gray.iter().flat_map(|&g| [g, g, g]).collect()
}

/// CMYK (0 = no ink; `jpeg-decoder` undoes Adobe's inverted storage) to RGB as PIL converts
/// it: each of R, G, B is `(255 − C/M/Y) · (255 − K) / 255`.
fn cmyk_to_rgb(cmyk: &[u8]) -> Vec<u8> {
    cmyk.chunks_exact(4)
        .flat_map(|p| {
            let white = 255 - u32::from(p[3]);
            let channel = |ink: u8| ((255 - u32::from(ink)) * white + 127) / 255;
            [
                channel(p[0]) as u8,
                channel(p[1]) as u8,
                channel(p[2]) as u8,
            ]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jpeg(pixels: &[u8], width: u16, height: u16, color: jpeg_encoder::ColorType) -> Vec<u8> {
        let mut bytes = Vec::new();
        jpeg_encoder::Encoder::new(&mut bytes, 95)
            .encode(pixels, width, height, color)
            .unwrap();
        bytes
    }

    fn png(
        pixels: &[u8],
        width: u32,
        height: u32,
        color: png::ColorType,
        depth: png::BitDepth,
    ) -> Vec<u8> {
        let mut bytes = Vec::new();
        let mut encoder = png::Encoder::new(&mut bytes, width, height);
        encoder.set_color(color);
        encoder.set_depth(depth);
        encoder
            .write_header()
            .unwrap()
            .write_image_data(pixels)
            .unwrap();
        bytes
    }

    fn pixel(image: &Rgb, x: usize, y: usize) -> [u8; 3] {
        let at = (y * image.width + x) * 3;
        image.pixels[at..at + 3].try_into().unwrap()
    }

    fn near(got: [u8; 3], want: [u8; 3], within: u8) -> bool {
        got.iter().zip(want).all(|(&g, w)| g.abs_diff(w) <= within)
    }

    /// Left half cyan ink, right half 50 % black ink, in the given CMYK encoding.
    fn cmyk_jpeg(color: jpeg_encoder::ColorType) -> Vec<u8> {
        let (w, h) = (64usize, 32usize);
        let cmyk: Vec<u8> = (0..w * h)
            .flat_map(|i| {
                if i % w < w / 2 {
                    [255, 0, 0, 0]
                } else {
                    [0, 0, 0, 128]
                }
            })
            .collect();
        jpeg(&cmyk, w as u16, h as u16, color)
    }

    #[test]
    fn cmyk_and_ycck_jpegs_come_out_in_their_rgb_colours_at_every_scale() {
        for color in [
            jpeg_encoder::ColorType::Cmyk,
            jpeg_encoder::ColorType::CmykAsYcck,
        ] {
            let bytes = cmyk_jpeg(color);
            for min_scale in [1.0, 0.25] {
                let image = Encoded::new(&bytes).unwrap().decode(min_scale).unwrap().0;
                let (w, h) = (image.width, image.height);
                assert_eq!(w, (64.0 * min_scale) as usize, "{color:?} at {min_scale}");
                let cyan = pixel(&image, w / 4, h / 2);
                let gray = pixel(&image, 3 * w / 4, h / 2);
                assert!(
                    near(cyan, [0, 255, 255], 6),
                    "{color:?} at {min_scale}: cyan is {cyan:?}"
                );
                assert!(
                    near(gray, [127, 127, 127], 6),
                    "{color:?} at {min_scale}: gray is {gray:?}"
                );
            }
        }
    }

    #[test]
    fn a_jpeg_is_decoded_at_the_smallest_scale_that_keeps_what_is_asked() {
        // Sides that are not whole blocks: the last block's part still gives a pixel.
        let (w, h) = (1030usize, 771usize);
        // A smooth picture: each 8×8 block's average survives the reduced-size IDCT.
        let rgb: Vec<u8> = (0..w * h)
            .flat_map(|i| {
                let (x, y) = (i % w, i / w);
                [(x / 5) as u8, (y / 4) as u8, ((x + y) / 8) as u8]
            })
            .collect();
        let bytes = jpeg(&rgb, w as u16, h as u16, jpeg_encoder::ColorType::Rgb);
        let (full, scale) = Encoded::new(&bytes).unwrap().decode(1.0).unwrap();
        assert_eq!((full.width, full.height, scale), (w, h, 1.0));
        for (min_scale, eighths) in [(0.6, 8), (0.5, 4), (0.3, 4), (0.25, 2), (0.2, 2), (0.1, 1)] {
            let (image, scale) = Encoded::new(&bytes).unwrap().decode(min_scale).unwrap();
            assert_eq!(scale, eighths as f64 / 8.0, "asked for {min_scale}");
            assert_eq!(
                (image.width, image.height),
                ((w * eighths).div_ceil(8), (h * eighths).div_ceil(8)),
                "asked for {min_scale}"
            );
            // Each reduced pixel is about the mean of the full-size pixels it stands for,
            // at `scale` (not at the rounded-up size's ratio), up to the last whole block.
            let block = 8 / eighths;
            let mut worst = 0f64;
            let (last_x, last_y) = (w / block - 1, h / block - 1);
            for (y, x) in [(10, 10), (last_y / 2, last_x / 3), (last_y, last_x)] {
                for c in 0..3 {
                    let mean = (0..block * block)
                        .map(|k| {
                            f64::from(pixel(&full, x * block + k % block, y * block + k / block)[c])
                        })
                        .sum::<f64>()
                        / (block * block) as f64;
                    worst = worst.max((f64::from(pixel(&image, x, y)[c]) - mean).abs());
                }
            }
            assert!(worst <= 3.0, "asked for {min_scale}: off by {worst}");
        }
    }

    #[test]
    fn an_image_under_a_block_a_side_keeps_its_size() {
        let rgb: Vec<u8> = (0..5 * 20).flat_map(|i| [i as u8 * 2, 100, 50]).collect();
        let bytes = jpeg(&rgb, 5, 20, jpeg_encoder::ColorType::Rgb);
        let (image, scale) = Encoded::new(&bytes).unwrap().decode(0.1).unwrap();
        assert_eq!((image.width, image.height, scale), (5, 20, 1.0));
    }

    #[test]
    fn grayscale_and_progressive_jpegs_decode_to_rgb() {
        let (w, h) = (40u16, 24u16);
        let gray: Vec<u8> = (0..w as usize * h as usize)
            .map(|i| (i % 200) as u8)
            .collect();
        let bytes = jpeg(&gray, w, h, jpeg_encoder::ColorType::Luma);
        for min_scale in [1.0, 0.5] {
            let image = Encoded::new(&bytes).unwrap().decode(min_scale).unwrap().0;
            assert!(
                image
                    .pixels
                    .chunks_exact(3)
                    .all(|p| p[0] == p[1] && p[1] == p[2])
            );
        }
        let rgb: Vec<u8> = (0..w as usize * h as usize)
            .flat_map(|_| [200, 30, 60])
            .collect();
        let mut bytes = Vec::new();
        let mut encoder = jpeg_encoder::Encoder::new(&mut bytes, 90);
        encoder.set_progressive(true);
        encoder
            .encode(&rgb, w, h, jpeg_encoder::ColorType::Rgb)
            .unwrap();
        for min_scale in [1.0, 0.5] {
            let image = Encoded::new(&bytes).unwrap().decode(min_scale).unwrap().0;
            assert!(
                near(pixel(&image, 3, 3), [200, 30, 60], 4),
                "{:?}",
                pixel(&image, 3, 3)
            );
        }
    }

    #[test]
    fn pngs_are_told_by_their_bytes_and_come_out_as_rgb() {
        let rgba = [10, 20, 30, 0, 40, 50, 60, 255, 70, 80, 90, 128];
        let bytes = png(&rgba, 3, 1, png::ColorType::Rgba, png::BitDepth::Eight);
        let image = Encoded::new(&bytes).unwrap().decode(0.1).unwrap().0;
        assert_eq!(
            (image.width, image.height),
            (3, 1),
            "a PNG is decoded at full size"
        );
        assert_eq!(
            image.pixels,
            [10, 20, 30, 40, 50, 60, 70, 80, 90],
            "alpha is dropped"
        );
        let gray16 = [0x12, 0x34, 0xff, 0x00];
        let bytes = png(
            &gray16,
            1,
            2,
            png::ColorType::Grayscale,
            png::BitDepth::Sixteen,
        );
        let image = Encoded::new(&bytes).unwrap().decode(1.0).unwrap().0;
        assert_eq!(image.pixels, [0x12, 0x12, 0x12, 0xff, 0xff, 0xff]);
    }

    #[test]
    fn what_is_neither_is_an_error_that_says_so() {
        let error = Encoded::new(b"this is not an image")
            .err()
            .unwrap()
            .to_string();
        assert!(error.contains("JPEG"), "{error}");
        let mut truncated = png(&[1, 2, 3], 1, 1, png::ColorType::Rgb, png::BitDepth::Eight);
        truncated.truncate(20);
        let error = Encoded::new(&truncated).err().unwrap().to_string();
        assert!(error.starts_with("PNG: "), "{error}");
    }
}
