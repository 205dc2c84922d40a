//! Max pooling (the ImageNet stem) and global average pooling (before the classifier).

use rayon::prelude::*;

use crate::engine::params::ParamStore;
use crate::engine::tensor::Tensor;

/// Square max pooling; padding never wins (it counts as negative infinity).
#[derive(Debug, Clone)]
pub struct MaxPool2d {
    /// Window size.
    pub kernel: usize,
    /// Stride.
    pub stride: usize,
    /// Implicit padding on every side.
    pub padding: usize,
    /// Input shape and, per output element, the index of the winning input in its plane.
    cache: Option<(Vec<usize>, Vec<u32>)>,
}

impl MaxPool2d {
    /// A `kernel` x `kernel` max pool.
    pub fn new(kernel: usize, stride: usize, padding: usize) -> Self {
        Self {
            kernel,
            stride,
            padding,
            cache: None,
        }
    }

    /// Output height and width for an input of `h` x `w`.
    pub fn output_size(&self, h: usize, w: usize) -> (usize, usize) {
        let o = |x: usize| (x + 2 * self.padding - self.kernel) / self.stride + 1;
        (o(h), o(w))
    }

    /// Pools every plane.
    pub fn forward(&mut self, _params: &mut ParamStore, input: &Tensor, train: bool) -> Tensor {
        let (n, c, h, w) = input.dims4();
        let (oh, ow) = self.output_size(h, w);
        let mut out = Tensor::zeros(&[n, c, oh, ow]);
        let mut argmax = vec![0u32; out.len()];
        let (k, s, p) = (self.kernel, self.stride, self.padding as isize);
        out.data
            .par_chunks_mut(oh * ow)
            .zip(argmax.par_chunks_mut(oh * ow))
            .zip(input.data.par_chunks(h * w))
            .for_each(|((y, am), x)| {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let mut best = f32::NEG_INFINITY;
                        let mut best_i = 0;
                        for ky in 0..k {
                            let iy = (oy * s + ky) as isize - p;
                            if iy < 0 || iy >= h as isize {
                                continue;
                            }
                            for kx in 0..k {
                                let ix = (ox * s + kx) as isize - p;
                                if ix < 0 || ix >= w as isize {
                                    continue;
                                }
                                let i = iy as usize * w + ix as usize;
                                if x[i] > best {
                                    best = x[i];
                                    best_i = i;
                                }
                            }
                        }
                        y[oy * ow + ox] = best;
                        am[oy * ow + ox] = best_i as u32;
                    }
                }
            });
        self.cache = train.then(|| (input.shape.clone(), argmax));
        out
    }

    /// Routes each output gradient to the input that won the max.
    pub fn backward(&mut self, _params: &mut ParamStore, grad_output: &Tensor) -> Tensor {
        let (shape, argmax) = self
            .cache
            .take()
            .expect("max-pool backward without a training forward");
        let (_, _, h, w) = (shape[0], shape[1], shape[2], shape[3]);
        let (_, _, oh, ow) = grad_output.dims4();
        let mut grad_input = Tensor::zeros(&shape);
        grad_input
            .data
            .par_chunks_mut(h * w)
            .zip(grad_output.data.par_chunks(oh * ow))
            .zip(argmax.par_chunks(oh * ow))
            .for_each(|((dx, dy), am)| {
                for (&g, &i) in dy.iter().zip(am) {
                    dx[i as usize] += g;
                }
            });
        grad_input
    }
}

/// Averages each channel over all positions: `[N, C, H, W]` to `[N, C]`, for any input
/// size (torchvision's adaptive average pool to 1x1).
#[derive(Debug, Clone, Default)]
pub struct GlobalAvgPool {
    input_shape: Option<Vec<usize>>,
}

impl GlobalAvgPool {
    /// A pool with no cached state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Averages every plane.
    pub fn forward(&mut self, _params: &mut ParamStore, input: &Tensor, train: bool) -> Tensor {
        let (n, c, h, w) = input.dims4();
        let hw = h * w;
        let data = input
            .data
            .chunks(hw)
            .map(|p| p.iter().sum::<f32>() / hw as f32)
            .collect();
        self.input_shape = train.then(|| input.shape.clone());
        Tensor::from_vec(&[n, c], data)
    }

    /// Spreads each gradient evenly over its plane.
    pub fn backward(&mut self, _params: &mut ParamStore, grad_output: &Tensor) -> Tensor {
        let shape = self
            .input_shape
            .take()
            .expect("average-pool backward without a training forward");
        let hw = shape[2] * shape[3];
        let mut grad_input = Tensor::zeros(&shape);
        grad_input
            .data
            .chunks_mut(hw)
            .zip(&grad_output.data)
            .for_each(|(dx, &g)| dx.fill(g / hw as f32));
        grad_input
    }
}
