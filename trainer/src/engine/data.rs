//! Data sources: random tensors for benchmarks, a learnable synthetic task for tests
//! and examples, and per-rank sharding.
//!
//! Every sample is a pure function of `(seed, index)`, so any rank can materialise
//! any sample without sharing state.

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::tensor::{Tensor, fill_normal};

/// Image channels (RGB).
const CHANNELS: usize = 3;

/// An RNG for one sample, independent of every other sample's.
fn sample_rng(seed: u64, index: usize, stream: u64) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(stream);
    rng.set_word_pos(index as u128 * 1024);
    rng
}

/// Standard-normal images with uniform random labels: for throughput, not learning.
#[derive(Debug, Clone)]
pub struct SyntheticData {
    /// Number of classes.
    pub classes: usize,
    /// Images are `image_size` x `image_size`.
    pub image_size: usize,
    /// Nominal dataset length.
    pub len: usize,
    /// Seed.
    pub seed: u64,
}

impl SyntheticData {
    /// A source of `len` samples.
    pub fn new(classes: usize, image_size: usize, len: usize, seed: u64) -> Self {
        Self {
            classes,
            image_size,
            len,
            seed,
        }
    }

    /// Images `[indices.len(), 3, size, size]` and their labels.
    pub fn batch(&self, indices: &[usize]) -> (Tensor, Vec<usize>) {
        let per = CHANNELS * self.image_size * self.image_size;
        let mut images =
            Tensor::zeros(&[indices.len(), CHANNELS, self.image_size, self.image_size]);
        // Samples in parallel (each its own RNG): a GPU takes thousands a second.
        let labels = images
            .data
            .par_chunks_mut(per)
            .zip(indices)
            .map(|(img, &i)| {
                let mut rng = sample_rng(self.seed, i, 1);
                let label = rng.random_range(0..self.classes);
                fill_normal(img, 1.0, &mut rng);
                label
            })
            .collect();
        (images, labels)
    }
}

/// A task a small ResNet learns in a few dozen steps: each class has a fixed random
/// template (a colour plus a coarse spatial pattern); a sample is its class's template,
/// randomly shifted, plus Gaussian noise.
#[derive(Debug, Clone)]
pub struct LearnableData {
    /// Number of classes.
    pub classes: usize,
    /// Images are `image_size` x `image_size`.
    pub image_size: usize,
    /// Dataset length (1024 unless changed with [`LearnableData::with_len`]).
    pub len: usize,
    /// Standard deviation of the per-pixel noise.
    pub noise: f32,
    seed: u64,
    templates: Vec<Vec<f32>>,
}

impl LearnableData {
    /// A dataset of 1024 samples over `classes` classes.
    pub fn new(classes: usize, image_size: usize, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let s = image_size;
        // Coarse 4x4 cells give patterns that survive small shifts.
        let cell = s.div_ceil(4).max(1);
        let templates = (0..classes)
            .map(|_| {
                let mut colour = [0.0f32; CHANNELS];
                fill_normal(&mut colour, 0.6, &mut rng);
                let mut pattern = vec![0.0f32; CHANNELS * 16];
                fill_normal(&mut pattern, 0.8, &mut rng);
                let mut t = vec![0.0f32; CHANNELS * s * s];
                for c in 0..CHANNELS {
                    for y in 0..s {
                        for x in 0..s {
                            let p = pattern[c * 16 + (y / cell).min(3) * 4 + (x / cell).min(3)];
                            t[(c * s + y) * s + x] = colour[c] + p;
                        }
                    }
                }
                t
            })
            .collect();
        Self {
            classes,
            image_size,
            len: 1024,
            noise: 0.8,
            seed,
            templates,
        }
    }

    /// The same task with `len` samples.
    pub fn with_len(mut self, len: usize) -> Self {
        self.len = len;
        self
    }

    /// The label of sample `index`.
    pub fn label(&self, index: usize) -> usize {
        sample_rng(self.seed, index, 2).random_range(0..self.classes)
    }

    /// Images `[indices.len(), 3, size, size]` and their labels.
    pub fn batch(&self, indices: &[usize]) -> (Tensor, Vec<usize>) {
        let s = self.image_size;
        let per = CHANNELS * s * s;
        let mut images = Tensor::zeros(&[indices.len(), CHANNELS, s, s]);
        let labels = images
            .data
            .par_chunks_mut(per)
            .zip(indices)
            .map(|(img, &i)| self.sample(i, img))
            .collect();
        (images, labels)
    }

    /// Writes sample `i` into `img` (`[3, size, size]`); returns its label.
    fn sample(&self, i: usize, img: &mut [f32]) -> usize {
        let s = self.image_size;
        let label = self.label(i);
        let mut rng = sample_rng(self.seed, i, 3);
        fill_normal(img, self.noise, &mut rng);
        let shift = (s / 8) as i64;
        let dy = rng.random_range(-shift..=shift) as isize;
        let dx = rng.random_range(-shift..=shift) as isize;
        let t = &self.templates[label];
        for c in 0..CHANNELS {
            for y in 0..s {
                let sy = (y as isize + dy).clamp(0, s as isize - 1) as usize;
                for x in 0..s {
                    let sx = (x as isize + dx).clamp(0, s as isize - 1) as usize;
                    img[(c * s + y) * s + x] += t[(c * s + sy) * s + sx];
                }
            }
        }
        label
    }
}

/// The indices `rank` visits in `epoch`: its slice of a permutation of `0..len` seeded
/// by `(seed, epoch)`. Every rank computes the same permutation, so the slices are
/// disjoint; each gets `len / world` indices (the remainder is dropped so that all
/// ranks take the same number of steps and none waits in all-reduce).
pub fn shard(len: usize, rank: usize, world: usize, epoch: usize, seed: u64) -> Vec<usize> {
    assert!(
        world > 0 && rank < world,
        "rank {rank} outside world of {world}"
    );
    let mut perm: Vec<usize> = (0..len).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(epoch as u64);
    perm.shuffle(&mut rng);
    let per = len / world;
    perm[rank * per..(rank + 1) * per].to_vec()
}
