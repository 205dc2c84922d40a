//! Batch normalisation over the channels of an NCHW tensor.

use std::ops::Range;

use rayon::prelude::*;

use crate::engine::params::ParamStore;
use crate::engine::tensor::Tensor;

/// PyTorch's default running-statistics momentum.
const MOMENTUM: f32 = 0.1;
/// PyTorch's default epsilon.
const EPS: f32 = 1e-5;

/// `BatchNorm2d` with learnable scale (`weight`, gamma) and shift (`bias`, beta).
///
/// Training uses the batch's statistics and updates the running mean and (unbiased)
/// variance buffers, which evaluation then uses, as PyTorch does.
#[derive(Debug, Clone)]
pub struct BatchNorm2d {
    /// Gamma's range in the parameter values.
    pub gamma: Range<usize>,
    /// Beta's range in the parameter values.
    pub beta: Range<usize>,
    /// Running mean's range in the store's buffers.
    pub running_mean: Range<usize>,
    /// Running variance's range in the store's buffers.
    pub running_var: Range<usize>,
    /// Number of channels.
    pub channels: usize,
    cache: Option<Cache>,
}

#[derive(Debug, Clone)]
struct Cache {
    xhat: Vec<f32>,
    inv_std: Vec<f32>,
    shape: Vec<usize>,
}

impl BatchNorm2d {
    /// Registers `{name}.weight` = 1, `{name}.bias` = 0 and the running buffers
    /// `{name}.running_mean` = 0, `{name}.running_var` = 1.
    pub fn new(store: &mut ParamStore, name: &str, channels: usize) -> Self {
        let gamma = store.add(&format!("{name}.weight"), &[channels], vec![1.0; channels]);
        let beta = store.add(&format!("{name}.bias"), &[channels], vec![0.0; channels]);
        let running_mean = store.add_buffer(
            &format!("{name}.running_mean"),
            &[channels],
            vec![0.0; channels],
        );
        let running_var = store.add_buffer(
            &format!("{name}.running_var"),
            &[channels],
            vec![1.0; channels],
        );
        Self {
            gamma,
            beta,
            running_mean,
            running_var,
            channels,
            cache: None,
        }
    }

    /// Normalises with batch statistics when `train`, running statistics otherwise.
    pub fn forward(&mut self, params: &mut ParamStore, input: &Tensor, train: bool) -> Tensor {
        let (n, c, h, w) = input.dims4();
        assert_eq!(c, self.channels, "batch-norm channels");
        let hw = h * w;
        let count = n * hw;
        let (mean, inv_std) = if train {
            // f64 sums: a channel can hold hundreds of thousands of values.
            let stats: Vec<(f64, f64)> = (0..c)
                .into_par_iter()
                .map(|ch| {
                    let plane = |i: usize| &input.data[(i * c + ch) * hw..][..hw];
                    let sum: f64 = (0..n).flat_map(plane).map(|&x| x as f64).sum();
                    let mean = sum / count as f64;
                    let sq: f64 = (0..n)
                        .flat_map(plane)
                        .map(|&x| (x as f64 - mean).powi(2))
                        .sum();
                    (mean, sq / count as f64)
                })
                .collect();
            let unbias = if count > 1 {
                count as f64 / (count - 1) as f64
            } else {
                1.0
            };
            let rm = self.running_mean.clone();
            let rv = self.running_var.clone();
            for (ch, &(m, v)) in stats.iter().enumerate() {
                let bm = &mut params.buffers[rm.start + ch];
                *bm = (1.0 - MOMENTUM) * *bm + MOMENTUM * m as f32;
                let bv = &mut params.buffers[rv.start + ch];
                *bv = (1.0 - MOMENTUM) * *bv + MOMENTUM * (v * unbias) as f32;
            }
            stats
                .iter()
                .map(|&(m, v)| (m as f32, (1.0 / (v + EPS as f64).sqrt()) as f32))
                .unzip::<_, _, Vec<f32>, Vec<f32>>()
        } else {
            let mean = params.buffers[self.running_mean.clone()].to_vec();
            let inv_std = params.buffers[self.running_var.clone()]
                .iter()
                .map(|v| 1.0 / (v + EPS).sqrt())
                .collect();
            (mean, inv_std)
        };
        let gamma = &params.values[self.gamma.clone()];
        let beta = &params.values[self.beta.clone()];
        let mut out = Tensor::zeros(&input.shape);
        let mut xhat = if train {
            vec![0.0; input.len()]
        } else {
            Vec::new()
        };
        let normalise = |p: usize, x: &[f32], y: &mut [f32], xh: Option<&mut [f32]>| {
            let ch = p % c;
            let (m, s, g, b) = (mean[ch], inv_std[ch], gamma[ch], beta[ch]);
            match xh {
                Some(xh) => {
                    for ((y, xh), &x) in y.iter_mut().zip(xh).zip(x) {
                        *xh = (x - m) * s;
                        *y = g * *xh + b;
                    }
                }
                None => {
                    for (y, &x) in y.iter_mut().zip(x) {
                        *y = g * (x - m) * s + b;
                    }
                }
            }
        };
        if train {
            out.data
                .par_chunks_mut(hw)
                .zip(xhat.par_chunks_mut(hw))
                .zip(input.data.par_chunks(hw))
                .enumerate()
                .for_each(|(p, ((y, xh), x))| normalise(p, x, y, Some(xh)));
            self.cache = Some(Cache {
                xhat,
                inv_std,
                shape: input.shape.clone(),
            });
        } else {
            out.data
                .par_chunks_mut(hw)
                .zip(input.data.par_chunks(hw))
                .enumerate()
                .for_each(|(p, (y, x))| normalise(p, x, y, None));
            self.cache = None;
        }
        out
    }

    /// Back-propagates through the last training forward pass, including the
    /// dependence of the batch statistics on every input.
    pub fn backward(&mut self, params: &mut ParamStore, grad_output: &Tensor) -> Tensor {
        let cache = self
            .cache
            .take()
            .expect("batch-norm backward without a training forward");
        assert_eq!(grad_output.shape, cache.shape);
        let (n, c, h, w) = grad_output.dims4();
        let hw = h * w;
        let count = (n * hw) as f64;
        let dy = &grad_output.data;
        let xhat = &cache.xhat;
        // Per channel: sum(dy) and sum(dy * xhat), i.e. dbeta and dgamma.
        let sums: Vec<(f64, f64)> = (0..c)
            .into_par_iter()
            .map(|ch| {
                let mut s = (0.0f64, 0.0f64);
                for i in 0..n {
                    let r = (i * c + ch) * hw..(i * c + ch + 1) * hw;
                    for (&g, &xh) in dy[r.clone()].iter().zip(&xhat[r]) {
                        s.0 += g as f64;
                        s.1 += (g * xh) as f64;
                    }
                }
                s
            })
            .collect();
        for (ch, &(db, dg)) in sums.iter().enumerate() {
            params.grads[self.gamma.start + ch] += dg as f32;
            params.grads[self.beta.start + ch] += db as f32;
        }
        let gamma = &params.values[self.gamma.clone()];
        let mut grad_input = Tensor::zeros(&grad_output.shape);
        grad_input
            .data
            .par_chunks_mut(hw)
            .zip(dy.par_chunks(hw))
            .zip(xhat.par_chunks(hw))
            .enumerate()
            .for_each(|(p, ((dx, dy), xh))| {
                let ch = p % c;
                let k = gamma[ch] * cache.inv_std[ch];
                let mean_dy = (sums[ch].0 / count) as f32;
                let mean_dyxh = (sums[ch].1 / count) as f32;
                for ((dx, &g), &x) in dx.iter_mut().zip(dy).zip(xh) {
                    *dx = k * (g - mean_dy - x * mean_dyxh);
                }
            });
        grad_input
    }
}
