//! 2-D convolution without bias, as im2col followed by one GEMM per image.

use std::ops::Range;

use rand::Rng;
use rayon::prelude::*;

use crate::engine::params::ParamStore;
use crate::engine::tensor::{Tensor, fill_normal_seeded};

/// A bias-free 2-D convolution (ResNets follow every conv with batch norm, which
/// makes a bias redundant). Weight layout is `[out, in, k, k]`.
#[derive(Debug, Clone)]
pub struct Conv2d {
    /// The weight's range in the parameter store.
    pub weight: Range<usize>,
    /// Input channels.
    pub in_channels: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Square kernel size.
    pub kernel: usize,
    /// Stride in both directions.
    pub stride: usize,
    /// Zero padding on every side.
    pub padding: usize,
    input: Option<Tensor>,
}

impl Conv2d {
    /// Registers `{name}.weight`, Kaiming-normal initialised (fan-out, ReLU gain) as
    /// torchvision's ResNets do.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        store: &mut ParamStore,
        name: &str,
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        rng: &mut impl Rng,
    ) -> Self {
        let shape = [out_channels, in_channels, kernel, kernel];
        let mut init = vec![0.0; shape.iter().product()];
        let fan_out = (out_channels * kernel * kernel) as f32;
        fill_normal_seeded(&mut init, (2.0 / fan_out).sqrt(), rng.random());
        let weight = store.add(&format!("{name}.weight"), &shape, init);
        Self {
            weight,
            in_channels,
            out_channels,
            kernel,
            stride,
            padding,
            input: None,
        }
    }

    /// Output height and width for an input of `h` x `w`.
    pub fn output_size(&self, h: usize, w: usize) -> (usize, usize) {
        let o = |x: usize| (x + 2 * self.padding - self.kernel) / self.stride + 1;
        (o(h), o(w))
    }

    /// A 1x1 stride-1 unpadded conv needs no im2col: the image already is the matrix.
    fn pointwise(&self) -> bool {
        self.kernel == 1 && self.stride == 1 && self.padding == 0
    }

    /// Convolves an NCHW batch.
    pub fn forward(&mut self, params: &mut ParamStore, input: &Tensor, train: bool) -> Tensor {
        let (n, c, h, w) = input.dims4();
        assert_eq!(c, self.in_channels, "conv input channels");
        let (oh, ow) = self.output_size(h, w);
        let (ohw, ckk, oc) = (oh * ow, c * self.kernel * self.kernel, self.out_channels);
        let weight = &params.values[self.weight.clone()];
        let mut out = Tensor::zeros(&[n, oc, oh, ow]);
        let geo = Geometry::new(self, c, h, w, oh, ow);
        let pointwise = self.pointwise();
        out.data
            .par_chunks_mut(oc * ohw)
            .zip(input.data.par_chunks(c * h * w))
            .for_each(|(o, x)| {
                let mut buf = Vec::new();
                let cols = geo.columns(pointwise, x, &mut buf);
                // out[oc, ohw] = W[oc, ckk] * cols[ckk, ohw]
                gemm(oc, ckk, ohw, weight, (ckk, 1), cols, (ohw, 1), 0.0, o, ohw);
            });
        self.input = train.then(|| input.clone());
        out
    }

    /// Back-propagates through the last training forward pass.
    pub fn backward(&mut self, params: &mut ParamStore, grad_output: &Tensor) -> Tensor {
        let input = self
            .input
            .take()
            .expect("conv backward without a training forward");
        let (n, c, h, w) = input.dims4();
        let (oh, ow) = self.output_size(h, w);
        assert_eq!(grad_output.shape, [n, self.out_channels, oh, ow]);
        let (ohw, ckk, oc) = (oh * ow, c * self.kernel * self.kernel, self.out_channels);
        let weight = &params.values[self.weight.clone()];
        let geo = Geometry::new(self, c, h, w, oh, ow);
        let pointwise = self.pointwise();
        let mut grad_input = Tensor::zeros(&input.shape);
        // Each rayon job owns one partial weight gradient; they are summed at the end
        // so images can be processed in parallel without locking.
        let grad_weight = grad_input
            .data
            .par_chunks_mut(c * h * w)
            .zip(input.data.par_chunks(c * h * w))
            .zip(grad_output.data.par_chunks(oc * ohw))
            .fold(
                || vec![0.0f32; oc * ckk],
                |mut gw, ((dx, x), dy)| {
                    let mut buf = Vec::new();
                    let cols = geo.columns(pointwise, x, &mut buf);
                    // dW[oc, ckk] += dy[oc, ohw] * cols^T[ohw, ckk]
                    gemm(
                        oc,
                        ohw,
                        ckk,
                        dy,
                        (ohw, 1),
                        cols,
                        (1, ohw),
                        1.0,
                        &mut gw,
                        ckk,
                    );
                    if pointwise {
                        // dx[c, hw] = W^T[c, oc] * dy[oc, hw]
                        gemm(ckk, oc, ohw, weight, (1, ckk), dy, (ohw, 1), 0.0, dx, ohw);
                    } else {
                        let mut dcols = vec![0.0f32; ckk * ohw];
                        gemm(
                            ckk,
                            oc,
                            ohw,
                            weight,
                            (1, ckk),
                            dy,
                            (ohw, 1),
                            0.0,
                            &mut dcols,
                            ohw,
                        );
                        geo.col2im(&dcols, dx);
                    }
                    gw
                },
            )
            .reduce(
                || vec![0.0f32; oc * ckk],
                |mut a, b| {
                    a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
                    a
                },
            );
        params.grads[self.weight.clone()]
            .iter_mut()
            .zip(&grad_weight)
            .for_each(|(g, d)| *g += d);
        grad_input
    }
}

/// `C = A * B + beta * C` on row-major `c` with explicit strides for A and B,
/// so transposes cost nothing.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    (rsa, csa): (usize, usize),
    b: &[f32],
    (rsb, csb): (usize, usize),
    beta: f32,
    c: &mut [f32],
    rsc: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(a.len() > (m - 1) * rsa + k.saturating_sub(1) * csa || k == 0);
    assert!(b.len() > k.saturating_sub(1) * rsb + (n - 1) * csb || k == 0);
    assert!(c.len() >= (m - 1) * rsc + n);
    // SAFETY: the asserts above bound every index sgemm touches within the slices,
    // and `c` is exclusively borrowed.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa as isize,
            csa as isize,
            b.as_ptr(),
            rsb as isize,
            csb as isize,
            beta,
            c.as_mut_ptr(),
            rsc as isize,
            1,
        );
    }
}

/// The index arithmetic shared by im2col and its adjoint.
#[derive(Clone, Copy)]
struct Geometry {
    c: usize,
    h: usize,
    w: usize,
    oh: usize,
    ow: usize,
    k: usize,
    stride: usize,
    pad: usize,
}

impl Geometry {
    fn new(conv: &Conv2d, c: usize, h: usize, w: usize, oh: usize, ow: usize) -> Self {
        Self {
            c,
            h,
            w,
            oh,
            ow,
            k: conv.kernel,
            stride: conv.stride,
            pad: conv.padding,
        }
    }

    /// Calls `f(row, column, input_index)` for every in-bounds (patch element, output
    /// position) pair; out-of-bounds ones are the zero padding.
    #[inline]
    fn for_each(&self, mut f: impl FnMut(usize, usize)) {
        let ohw = self.oh * self.ow;
        for ch in 0..self.c {
            for ky in 0..self.k {
                for kx in 0..self.k {
                    let row = (ch * self.k + ky) * self.k + kx;
                    for oy in 0..self.oh {
                        let iy = (oy * self.stride + ky) as isize - self.pad as isize;
                        if iy < 0 || iy >= self.h as isize {
                            continue;
                        }
                        let base_in = (ch * self.h + iy as usize) * self.w;
                        let base_col = row * ohw + oy * self.ow;
                        for ox in 0..self.ow {
                            let ix = (ox * self.stride + kx) as isize - self.pad as isize;
                            if ix >= 0 && ix < self.w as isize {
                                f(base_col + ox, base_in + ix as usize);
                            }
                        }
                    }
                }
            }
        }
    }

    /// One image as the `[c·k·k, oh·ow]` matrix the GEMM multiplies: the image itself for a
    /// pointwise conv, else its im2col written into `buf`.
    fn columns<'a>(&self, pointwise: bool, x: &'a [f32], buf: &'a mut Vec<f32>) -> &'a [f32] {
        if pointwise {
            return x;
        }
        buf.clear();
        buf.resize(self.c * self.k * self.k * self.oh * self.ow, 0.0);
        self.im2col(x, buf);
        buf
    }

    /// `cols` must be zeroed (the padding entries are never written).
    fn im2col(&self, x: &[f32], cols: &mut [f32]) {
        self.for_each(|col, idx| cols[col] = x[idx]);
    }

    /// Adds each column entry back onto the pixel it was copied from.
    fn col2im(&self, cols: &[f32], dx: &mut [f32]) {
        self.for_each(|col, idx| dx[idx] += cols[col]);
    }
}
