//! The CPU backend: im2col + SGEMM from `matrixmultiply`, data parallelism with rayon.

use rayon::prelude::*;

use std::ops::Range;

use super::{
    Backend, BatchNormConfig, BatchNormSaved, BnEpilogue, BnEpilogueGrad, ConvShape, Matrix,
    PoolShape,
};
use crate::engine::layers::softmax_cross_entropy;
use crate::engine::tensor::{DType, Tensor};

/// A row-major operand on the host.
type HostMatrix<'a> = Matrix<&'a [f32]>;

/// The reference backend; runs on all cores of the rayon pool.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl CpuBackend {
    fn f32_only(dtype: DType) {
        assert_eq!(dtype, DType::F32, "the CPU backend computes in f32 only");
    }
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type View<'a> = &'a [f32];
    type ViewMut<'a> = &'a mut [f32];
    type ConvSaved = ();
    type BnSaved = BatchNormSaved;
    /// Per output, the index of the winner within its plane.
    type PoolSaved = Vec<u32>;
    /// The CPU records nothing ([`Backend::record`] runs the work as it goes).
    type Recording = std::convert::Infallible;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn supports(&self, dtype: DType) -> bool {
        dtype == DType::F32
    }

    fn alloc(&self, len: usize, dtype: DType) -> Vec<f32> {
        self.zeros(len, dtype)
    }

    fn zeros(&self, len: usize, dtype: DType) -> Vec<f32> {
        Self::f32_only(dtype);
        vec![0.0; len]
    }

    fn upload(&self, host: &[f32], _shape: &[usize], dtype: DType) -> Vec<f32> {
        Self::f32_only(dtype);
        host.to_vec()
    }

    fn upload_into(&self, host: &[f32], _shape: &[usize], buf: &mut Vec<f32>) {
        buf.copy_from_slice(host);
    }

    fn replay(&self, recording: &Self::Recording) {
        match *recording {}
    }

    fn download(&self, buf: &Vec<f32>, _shape: &[usize]) -> Vec<f32> {
        buf.clone()
    }

    fn with_host<R>(&self, buf: &mut Vec<f32>, f: impl FnOnce(&mut [f32]) -> R) -> R {
        f(buf)
    }

    fn view<'a>(&self, buf: &'a Vec<f32>, range: Range<usize>) -> &'a [f32] {
        &buf[range]
    }

    fn view_mut<'a>(&self, buf: &'a mut Vec<f32>, range: Range<usize>) -> &'a mut [f32] {
        &mut buf[range]
    }

    fn view_mut_pair<'a>(
        &self,
        buf: &'a mut Vec<f32>,
        a: Range<usize>,
        b: Range<usize>,
    ) -> (&'a mut [f32], &'a mut [f32]) {
        assert!(a.end <= b.start, "view_mut_pair needs a before b, disjoint");
        let (head, tail) = buf.split_at_mut(b.start);
        (&mut head[a], &mut tail[..b.len()])
    }

    fn fill_zero(&self, x: &mut [f32]) {
        x.fill(0.0);
    }

    fn gemm(
        &self,
        m: usize,
        k: usize,
        n: usize,
        a: HostMatrix,
        b: HostMatrix,
        beta: f32,
        c: &mut [f32],
    ) {
        sgemm(m, k, n, a, b, beta, c, n);
    }

    fn conv2d_forward(&self, s: &ConvShape, x: &[f32], weight: &[f32], y: &mut [f32]) {
        let (oh, ow) = s.output_size();
        let (ohw, ckk, oc) = (oh * ow, s.c * s.kernel * s.kernel, s.out_channels);
        let geo = Geometry::new(s);
        y.par_chunks_mut(oc * ohw)
            .zip(x.par_chunks(s.c * s.h * s.w))
            .for_each(|(o, x)| {
                let mut buf = Vec::new();
                let cols = geo.columns(x, &mut buf);
                // out[oc, ohw] = W[oc, ckk] * cols[ckk, ohw]
                let (w, c) = (Matrix::rows(weight, ckk), Matrix::rows(cols, ohw));
                sgemm(oc, ckk, ohw, w, c, 0.0, o, ohw);
            });
    }

    fn conv2d_backward(
        &self,
        s: &ConvShape,
        _saved: &(),
        x: &[f32],
        weight: &[f32],
        dy: &[f32],
        dx: Option<&mut [f32]>,
        dweight: &mut [f32],
    ) {
        let (oh, ow) = s.output_size();
        let (ohw, ckk, oc) = (oh * ow, s.c * s.kernel * s.kernel, s.out_channels);
        let chw = s.c * s.h * s.w;
        let geo = Geometry::new(s);
        // Each rayon job owns one partial weight gradient; they are summed at the end so
        // images can be processed in parallel without locking.
        let image = |mut gw: Vec<f32>, (dx, (x, dy)): ImageGrads<'_>| {
            let mut buf = Vec::new();
            let cols = geo.columns(x, &mut buf);
            let dy_m = Matrix::rows(dy, ohw);
            // dW[oc, ckk] += dy[oc, ohw] * cols^T[ohw, ckk]
            sgemm(
                oc,
                ohw,
                ckk,
                dy_m,
                Matrix::transposed(cols, ohw),
                1.0,
                &mut gw,
                ckk,
            );
            let Some(dx) = dx else {
                return gw;
            };
            let w_t = Matrix::transposed(weight, ckk);
            if geo.pointwise() {
                // dx[c, hw] = W^T[c, oc] * dy[oc, hw]
                sgemm(ckk, oc, ohw, w_t, dy_m, 0.0, dx, ohw);
            } else {
                let mut dcols = vec![0.0f32; ckk * ohw];
                sgemm(ckk, oc, ohw, w_t, dy_m, 0.0, &mut dcols, ohw);
                dx.fill(0.0);
                geo.col2im(&dcols, dx);
            }
            gw
        };
        let images = x.par_chunks(chw).zip(dy.par_chunks(oc * ohw));
        let fresh = || vec![0.0f32; oc * ckk];
        let partial = match dx {
            Some(dx) => dx
                .par_chunks_mut(chw)
                .map(Some)
                .zip(images)
                .fold(fresh, image)
                .reduce(fresh, sum_into),
            None => images
                .map(|pair| (None, pair))
                .fold(fresh, image)
                .reduce(fresh, sum_into),
        };
        self.add_assign(dweight, &partial);
    }

    fn batch_norm_forward_training(
        &self,
        (n, c, hw): (usize, usize, usize),
        config: BatchNormConfig,
        x: &[f32],
        gamma: &[f32],
        beta: &[f32],
        running_mean: &mut [f32],
        running_var: &mut [f32],
        epilogue: BnEpilogue<&[f32]>,
        y: &mut [f32],
    ) -> BatchNormSaved {
        let count = n * hw;
        // f64 sums: a channel can hold hundreds of thousands of values.
        let stats: Vec<(f64, f64)> = (0..c)
            .into_par_iter()
            .map(|ch| {
                let plane = |i: usize| &x[(i * c + ch) * hw..][..hw];
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
        let momentum = config.momentum;
        for (ch, &(m, v)) in stats.iter().enumerate() {
            let bm = &mut running_mean[ch];
            *bm = (1.0 - momentum) * *bm + momentum * m as f32;
            let bv = &mut running_var[ch];
            *bv = (1.0 - momentum) * *bv + momentum * (v * unbias) as f32;
        }
        let (mean, inv_std): (Vec<f32>, Vec<f32>) = stats
            .iter()
            .map(|&(m, v)| (m as f32, (1.0 / (v + config.eps as f64).sqrt()) as f32))
            .unzip();
        let mut xhat = vec![0.0; x.len()];
        let relu = epilogue.has_relu();
        let residual = match epilogue {
            BnEpilogue::AddRelu(z) => {
                assert_eq!(z.len(), x.len(), "batch-norm residual shape");
                Some(z)
            }
            BnEpilogue::Identity | BnEpilogue::Relu => None,
        };
        y.par_chunks_mut(hw)
            .zip(xhat.par_chunks_mut(hw))
            .zip(x.par_chunks(hw))
            .enumerate()
            .for_each(|(p, ((y, xh), x))| {
                let ch = p % c;
                let (m, s, g, b) = (mean[ch], inv_std[ch], gamma[ch], beta[ch]);
                let z = residual.map(|z| &z[p * hw..][..hw]);
                for (i, ((y, xh), &x)) in y.iter_mut().zip(xh).zip(x).enumerate() {
                    *xh = (x - m) * s;
                    let v = g * *xh + b + z.map_or(0.0, |z| z[i]);
                    *y = if relu { v.max(0.0) } else { v };
                }
            });
        BatchNormSaved { xhat, inv_std }
    }

    fn batch_norm_forward_inference(
        &self,
        (_, c, hw): (usize, usize, usize),
        config: BatchNormConfig,
        x: &[f32],
        gamma: &[f32],
        beta: &[f32],
        running_mean: &[f32],
        running_var: &[f32],
        y: &mut [f32],
    ) {
        y.par_chunks_mut(hw)
            .zip(x.par_chunks(hw))
            .enumerate()
            .for_each(|(p, (y, x))| {
                let ch = p % c;
                let s = 1.0 / (running_var[ch] + config.eps).sqrt();
                let (m, g, b) = (running_mean[ch], gamma[ch], beta[ch]);
                for (y, &x) in y.iter_mut().zip(x) {
                    *y = g * (x - m) * s + b;
                }
            });
    }

    fn batch_norm_backward(
        &self,
        (n, c, hw): (usize, usize, usize),
        _config: BatchNormConfig,
        saved: &BatchNormSaved,
        gamma: &[f32],
        _beta: &[f32],
        epilogue: BnEpilogueGrad<&[f32], &mut [f32]>,
        dy: &[f32],
        dx: &mut [f32],
        dgamma: &mut [f32],
        dbeta: &mut [f32],
    ) {
        // Through the ReLU first: the gradient of its input is also the residual's.
        let masked;
        let dy = match epilogue {
            BnEpilogueGrad::Identity => dy,
            BnEpilogueGrad::Relu { y } => {
                masked = {
                    let mut m = vec![0.0; dy.len()];
                    relu_grad(y, dy, &mut m);
                    m
                };
                &masked
            }
            BnEpilogueGrad::AddRelu { y, dz } => {
                relu_grad(y, dy, dz);
                let dz: &[f32] = dz;
                dz
            }
        };
        let count = (n * hw) as f64;
        let xhat = &saved.xhat;
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
            dgamma[ch] += dg as f32;
            dbeta[ch] += db as f32;
        }
        dx.par_chunks_mut(hw)
            .zip(dy.par_chunks(hw))
            .zip(xhat.par_chunks(hw))
            .enumerate()
            .for_each(|(p, ((dx, dy), xh))| {
                let ch = p % c;
                let k = gamma[ch] * saved.inv_std[ch];
                let mean_dy = (sums[ch].0 / count) as f32;
                let mean_dyxh = (sums[ch].1 / count) as f32;
                for ((dx, &g), &x) in dx.iter_mut().zip(dy).zip(xh) {
                    *dx = k * (g - mean_dy - x * mean_dyxh);
                }
            });
    }

    fn relu_forward(&self, x: &[f32], y: &mut [f32]) {
        y.iter_mut().zip(x).for_each(|(y, &x)| *y = x.max(0.0));
    }

    fn relu_backward(&self, y: &[f32], dy: &[f32], dx: &mut [f32]) {
        relu_grad(y, dy, dx);
    }

    fn max_pool_forward(&self, s: &PoolShape, x: &[f32], y: &mut [f32]) -> Vec<u32> {
        let mut argmax = vec![0u32; y.len()];
        let (h, w) = (s.h, s.w);
        let (oh, ow) = s.output_size();
        let (k, stride, p) = (s.kernel, s.stride, s.padding as isize);
        y.par_chunks_mut(oh * ow)
            .zip(argmax.par_chunks_mut(oh * ow))
            .zip(x.par_chunks(h * w))
            .for_each(|((y, am), x)| {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let mut best = f32::NEG_INFINITY;
                        let mut best_i = 0;
                        for ky in 0..k {
                            let iy = (oy * stride + ky) as isize - p;
                            if iy < 0 || iy >= h as isize {
                                continue;
                            }
                            for kx in 0..k {
                                let ix = (ox * stride + kx) as isize - p;
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
        argmax
    }

    fn max_pool_backward(&self, s: &PoolShape, argmax: &Vec<u32>, dy: &[f32], dx: &mut [f32]) {
        let (oh, ow) = s.output_size();
        dx.par_chunks_mut(s.h * s.w)
            .zip(dy.par_chunks(oh * ow))
            .zip(argmax.par_chunks(oh * ow))
            .for_each(|((dx, dy), am)| {
                dx.fill(0.0);
                for (&g, &i) in dy.iter().zip(am) {
                    dx[i as usize] += g;
                }
            });
    }

    fn global_avg_pool_forward(
        &self,
        (_, _, plane_len): (usize, usize, usize),
        x: &[f32],
        y: &mut [f32],
    ) {
        for (y, p) in y.iter_mut().zip(x.chunks(plane_len)) {
            *y = p.iter().sum::<f32>() / plane_len as f32;
        }
    }

    fn global_avg_pool_backward(
        &self,
        (_, _, plane_len): (usize, usize, usize),
        dy: &[f32],
        dx: &mut [f32],
    ) {
        dx.chunks_mut(plane_len)
            .zip(dy)
            .for_each(|(dx, &g)| dx.fill(g / plane_len as f32));
    }

    fn broadcast_rows(&self, bias: &[f32], y: &mut [f32]) {
        for row in y.chunks_mut(bias.len()) {
            row.copy_from_slice(bias);
        }
    }

    fn sum_rows(&self, x: &[f32], sums: &mut [f32]) {
        for row in x.chunks(sums.len()) {
            sums.iter_mut().zip(row).for_each(|(s, v)| *s += v);
        }
    }

    fn softmax_cross_entropy(
        &self,
        classes: usize,
        logits: &[f32],
        labels: &[f32],
        label_smoothing: f32,
        grad_scale: f32,
        dlogits: &mut [f32],
        totals: &mut [f32],
    ) {
        let n = labels.len();
        let logits = Tensor::from_vec(&[n, classes], logits.to_vec());
        let labels: Vec<usize> = labels.iter().map(|&l| l as usize).collect();
        let out = softmax_cross_entropy(&logits, &labels, label_smoothing);
        for (d, g) in dlogits.iter_mut().zip(&out.grad_logits.data) {
            *d = g * grad_scale;
        }
        totals[0] += out.loss;
        totals[1] += out.correct as f32;
    }

    fn add_assign(&self, a: &mut [f32], b: &[f32]) {
        assert_eq!(a.len(), b.len(), "add_assign lengths differ");
        a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
    }

    fn sgd_update(
        &self,
        w: &mut [f32],
        g: &[f32],
        v: &mut [f32],
        lr: f32,
        momentum: f32,
        weight_decay: f32,
    ) {
        for ((w, &g), v) in w.iter_mut().zip(g).zip(v.iter_mut()) {
            *v = momentum * *v + g + weight_decay * *w;
            *w -= lr * *v;
        }
    }
}

/// Sums two partial weight gradients (rayon's reduce).
fn sum_into(mut a: Vec<f32>, b: Vec<f32>) -> Vec<f32> {
    a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
    a
}

/// One image's part of a convolution's backward: its input gradient, if asked for, then
/// its input and output gradient.
type ImageGrads<'a> = (Option<&'a mut [f32]>, (&'a [f32], &'a [f32]));

/// `c = a · b + beta · c` on row-major `c` with row stride `rsc`.
#[allow(clippy::too_many_arguments)]
fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    a: HostMatrix,
    b: HostMatrix,
    beta: f32,
    c: &mut [f32],
    rsc: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    let (rsa, csa, rsb, csb) = (a.row_stride, a.col_stride, b.row_stride, b.col_stride);
    assert!(a.data.len() > (m - 1) * rsa + k.saturating_sub(1) * csa || k == 0);
    assert!(b.data.len() > k.saturating_sub(1) * rsb + (n - 1) * csb || k == 0);
    assert!(c.len() >= (m - 1) * rsc + n);
    // SAFETY: the asserts above bound every index sgemm touches within the slices, and `c`
    // is exclusively borrowed.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.data.as_ptr(),
            rsa as isize,
            csa as isize,
            b.data.as_ptr(),
            rsb as isize,
            csb as isize,
            beta,
            c.as_mut_ptr(),
            rsc as isize,
            1,
        );
    }
}

/// The index arithmetic shared by im2col and its adjoint, for one image.
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
    fn new(s: &ConvShape) -> Self {
        let (oh, ow) = s.output_size();
        Self {
            c: s.c,
            h: s.h,
            w: s.w,
            oh,
            ow,
            k: s.kernel,
            stride: s.stride,
            pad: s.padding,
        }
    }

    /// A 1x1 stride-1 unpadded conv needs no im2col: the image already is the matrix.
    fn pointwise(&self) -> bool {
        self.k == 1 && self.stride == 1 && self.pad == 0
    }

    /// Calls `f(column_index, input_index)` for every in-bounds (patch element, output
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
    fn columns<'a>(&self, x: &'a [f32], buf: &'a mut Vec<f32>) -> &'a [f32] {
        if self.pointwise() {
            return x;
        }
        buf.clear();
        buf.resize(self.c * self.k * self.k * self.oh * self.ow, 0.0);
        // The padding entries stay zero: `for_each` never visits them.
        self.for_each(|col, idx| buf[col] = x[idx]);
        buf
    }

    /// Adds each column entry back onto the pixel it was copied from.
    fn col2im(&self, cols: &[f32], dx: &mut [f32]) {
        self.for_each(|col, idx| dx[idx] += cols[col]);
    }
}

/// `dx = dy` where the ReLU's output `y` was positive, else 0.
fn relu_grad(y: &[f32], dy: &[f32], dx: &mut [f32]) {
    assert!(
        y.len() == dy.len() && dy.len() == dx.len(),
        "relu gradient shapes"
    );
    dx.par_iter_mut()
        .zip(dy.par_iter().zip(y))
        .for_each(|(dx, (&g, &y))| *dx = if y > 0.0 { g } else { 0.0 });
}
