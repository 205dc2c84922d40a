//! Tensors that know their backend (and so their device) and their element type.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::backend::{Backend, CpuBackend};

/// Element types of activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE single precision.
    F32,
    /// bfloat16: f32's range with 8 bits of mantissa (activations and conv weights in
    /// mixed precision; master weights, gradients and statistics stay f32).
    Bf16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 => 2,
        }
    }
}

/// A dense tensor on backend `B` (a host `Vec<f32>` for the default CPU backend). The shape
/// is logical, outermost first, NCHW for images; the backend decides the memory layout.
#[derive(Debug)]
pub struct Tensor<B: Backend = CpuBackend> {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DType,
    /// The elements, in the backend's memory.
    pub data: B::Buf,
}

impl<B: Backend> Clone for Tensor<B> {
    fn clone(&self) -> Self {
        Self {
            shape: self.shape.clone(),
            dtype: self.dtype,
            data: self.data.clone(),
        }
    }
}

impl PartialEq for Tensor<CpuBackend> {
    fn eq(&self, other: &Self) -> bool {
        self.shape == other.shape && self.dtype == other.dtype && self.data == other.data
    }
}

impl<B: Backend> Tensor<B> {
    /// A tensor of `shape` and `dtype` on `be`, contents unspecified (every operation
    /// overwrites its output).
    pub fn alloc(be: &B, shape: &[usize], dtype: DType) -> Self {
        Self {
            shape: shape.to_vec(),
            dtype,
            data: be.alloc(shape.iter().product(), dtype),
        }
    }

    /// Copies a host tensor onto `be` as `dtype`.
    pub fn upload(be: &B, host: &Tensor, dtype: DType) -> Self {
        Self {
            shape: host.shape.clone(),
            dtype,
            data: be.upload(&host.data, &host.shape, dtype),
        }
    }

    /// Copies this tensor to the host as f32.
    pub fn download(&self, be: &B) -> Tensor {
        Tensor::from_vec(&self.shape, be.download(&self.data, &self.shape))
    }

    /// A view of all elements.
    pub fn view<'a>(&'a self, be: &B) -> B::View<'a> {
        be.view(&self.data, 0..self.len())
    }

    /// A writable view of all elements.
    pub fn view_mut<'a>(&'a mut self, be: &B) -> B::ViewMut<'a> {
        let len = self.len();
        be.view_mut(&mut self.data, 0..len)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The four dimensions of an NCHW tensor; panics for other ranks.
    pub fn dims4(&self) -> (usize, usize, usize, usize) {
        match self.shape[..] {
            [n, c, h, w] => (n, c, h, w),
            _ => panic!("expected an NCHW tensor, got shape {:?}", self.shape),
        }
    }

    /// The two dimensions of a matrix; panics for other ranks.
    pub fn dims2(&self) -> (usize, usize) {
        match self.shape[..] {
            [r, c] => (r, c),
            _ => panic!("expected a 2-D tensor, got shape {:?}", self.shape),
        }
    }
}

impl Tensor {
    /// A host tensor of zeros.
    pub fn zeros(shape: &[usize]) -> Self {
        Self {
            shape: shape.to_vec(),
            dtype: DType::F32,
            data: vec![0.0; shape.iter().product()],
        }
    }

    /// Wraps `data`; panics when its length does not match `shape`.
    pub fn from_vec(shape: &[usize], data: Vec<f32>) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "tensor data length does not match shape {shape:?}"
        );
        Self {
            shape: shape.to_vec(),
            dtype: DType::F32,
            data,
        }
    }

    /// A tensor of independent standard-normal samples scaled by `std`.
    pub fn randn(shape: &[usize], std: f32, rng: &mut impl Rng) -> Self {
        let mut t = Self::zeros(shape);
        fill_normal(&mut t.data, std, rng);
        t
    }

    /// Multiplies every element by `s`.
    pub fn scale(&mut self, s: f32) {
        self.data.iter_mut().for_each(|x| *x *= s);
    }

    /// Whether every element is finite.
    pub fn all_finite(&self) -> bool {
        self.data.iter().all(|x| x.is_finite())
    }
}

/// Fills `out` with normal samples of standard deviation `std`.
///
/// Box–Muller keeps the engine off an extra distributions crate; the pair it
/// produces is used whole so half the uniforms are not wasted.
pub fn fill_normal(out: &mut [f32], std: f32, rng: &mut impl Rng) {
    let mut chunks = out.chunks_exact_mut(2);
    for pair in &mut chunks {
        let (a, b) = normal_pair(rng);
        pair[0] = a * std;
        pair[1] = b * std;
    }
    if let [last] = chunks.into_remainder() {
        *last = normal_pair(rng).0 * std;
    }
}

/// Elements per independently seeded chunk in the parallel fills.
const CHUNK: usize = 1 << 14;

/// Like [`fill_normal`], but fills fixed-size chunks in parallel, each from a
/// SplitMix64 generator seeded by its own ChaCha stream of `seed`. Initialising
/// ResNet-50's 25 M weights from one ChaCha generator is the slowest part of building
/// it (worse in unoptimised test builds); the result depends only on `seed`, not on
/// the number of threads.
pub fn fill_normal_seeded(out: &mut [f32], std: f32, seed: u64) {
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(i, chunk)| {
            let mut g = SplitMix64::for_chunk(seed, i);
            for pair in chunk.chunks_mut(2) {
                // 1 - u keeps the logarithm's argument in (0, 1].
                let u1 = 1.0 - g.unit();
                let u2 = g.unit();
                let r = (-2.0 * u1.ln()).sqrt() * std;
                let theta = std::f32::consts::TAU * u2;
                pair[0] = r * theta.cos();
                if let Some(second) = pair.get_mut(1) {
                    *second = r * theta.sin();
                }
            }
        });
}

/// Uniform samples in `[-bound, bound)`, chunked and seeded like [`fill_normal_seeded`].
pub fn fill_uniform_seeded(out: &mut [f32], bound: f32, seed: u64) {
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(i, chunk)| {
            let mut g = SplitMix64::for_chunk(seed, i);
            chunk
                .iter_mut()
                .for_each(|x| *x = (g.unit() * 2.0 - 1.0) * bound);
        });
}

/// A tiny generator for bulk initialisation; quality is ample for weights.
struct SplitMix64(u64);

impl SplitMix64 {
    fn for_chunk(seed: u64, chunk: usize) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(chunk as u64);
        Self(rng.random())
    }

    /// Uniform in `[0, 1)` with 24 random bits.
    fn unit(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32
    }
}

fn normal_pair(rng: &mut impl Rng) -> (f32, f32) {
    // 1 - u keeps the logarithm's argument in (0, 1].
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random::<f64>();
    let r = (-2.0 * u1.ln()).sqrt();
    let theta = std::f64::consts::TAU * u2;
    ((r * theta.cos()) as f32, (r * theta.sin()) as f32)
}
