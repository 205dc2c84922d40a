// The CUDA backend's own kernels, compiled once at start by NVRTC (no toolkit headers:
// bf16 is handled as its 16 bits, so no include path is needed).
//
// Every kernel is a flat grid-stride loop over its outputs. `bf` flags say whether a
// buffer holds bf16 (1) or f32 (0); 4-D activations are NHWC, conv weights on the device
// KRSC (`[out][kh][kw][in]`), the f32 masters KCRS as PyTorch has them.

typedef unsigned short bf16_t;

__device__ __forceinline__ float bf2f(bf16_t h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

// Round to nearest even; NaN stays a (quiet) NaN.
__device__ __forceinline__ bf16_t f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float ld(const void* p, long long i, int bf) {
    return bf ? bf2f(((const bf16_t*)p)[i]) : ((const float*)p)[i];
}

__device__ __forceinline__ void st(void* p, long long i, int bf, float v) {
    if (bf) ((bf16_t*)p)[i] = f2bf(v); else ((float*)p)[i] = v;
}

#define FOR_EACH(i, n) \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); \
         i += (long long)blockDim.x * gridDim.x)

// y (any type) = x (any type), same layout.
extern "C" __global__ void convert(const void* x, int xbf, void* y, int ybf, long long n) {
    FOR_EACH(i, n) st(y, i, ybf, ld(x, i, xbf));
}

// NCHW f32 (host order) -> NHWC of y's type.
extern "C" __global__ void nchw_to_nhwc(const float* x, void* y, int ybf,
                                        int n, int c, int hw) {
    long long total = (long long)n * c * hw;
    FOR_EACH(i, total) {
        int ch = (int)(i % c);
        long long rest = i / c;
        int p = (int)(rest % hw);
        long long img = rest / hw;
        st(y, i, ybf, x[(img * c + ch) * hw + p]);
    }
}

// NHWC of x's type -> NCHW f32.
extern "C" __global__ void nhwc_to_nchw(const void* x, int xbf, float* y,
                                        int n, int c, int hw) {
    long long total = (long long)n * c * hw;
    FOR_EACH(i, total) {
        int p = (int)(i % hw);
        long long rest = i / hw;
        int ch = (int)(rest % c);
        long long img = rest / c;
        y[i] = ld(x, (img * hw + p) * c + ch, xbf);
    }
}

// f32 KCRS master -> KRSC working copy of the activations' type.
extern "C" __global__ void kcrs_to_krsc(const float* w, void* out, int obf,
                                        int k, int c, int rs) {
    long long total = (long long)k * c * rs;
    FOR_EACH(i, total) {
        int ch = (int)(i % c);
        long long rest = i / c;
        int p = (int)(rest % rs);
        long long kk = rest / rs;
        st(out, i, obf, w[(kk * c + ch) * rs + p]);
    }
}

// f32 KCRS gradient += KRSC weight gradient of the activations' type.
extern "C" __global__ void krsc_add_to_kcrs(const void* dw, int dbf, float* grad,
                                            int k, int c, int rs) {
    long long total = (long long)k * c * rs;
    FOR_EACH(i, total) {
        int p = (int)(i % rs);
        long long rest = i / rs;
        int ch = (int)(rest % c);
        long long kk = rest / c;
        grad[i] += ld(dw, (kk * rs + p) * c + ch, dbf);
    }
}

extern "C" __global__ void relu_forward(const void* x, void* y, int bf, long long n) {
    FOR_EACH(i, n) st(y, i, bf, fmaxf(ld(x, i, bf), 0.0f));
}

extern "C" __global__ void relu_backward(const void* y, const void* dy, void* dx, int bf,
                                         long long n) {
    FOR_EACH(i, n) st(dx, i, bf, ld(y, i, bf) > 0.0f ? ld(dy, i, bf) : 0.0f);
}

extern "C" __global__ void add_assign(void* a, const void* b, int bf, long long n) {
    FOR_EACH(i, n) st(a, i, bf, ld(a, i, bf) + ld(b, i, bf));
}

// add_assign eight bytes a thread (four bf16 or two f32: one load of each and one store),
// for buffers whose starts and length are multiples of 8 bytes: a residual's gradient is
// hundreds of megabytes, and two-byte accesses reach a third of the memory's bandwidth.
// The same arithmetic element by element (f32 sums, bf16 rounded to nearest even).
extern "C" __global__ void add_assign_8(unsigned long long* a, const unsigned long long* b,
                                        int bf, long long chunks) {
    FOR_EACH(i, chunks) {
        unsigned long long x = a[i], y = b[i], out = 0;
        if (bf) {
            for (int j = 0; j < 4; ++j) {
                float sum = bf2f((bf16_t)(x >> (16 * j))) + bf2f((bf16_t)(y >> (16 * j)));
                out |= (unsigned long long)f2bf(sum) << (16 * j);
            }
        } else {
            for (int j = 0; j < 2; ++j) {
                float sum = __uint_as_float((unsigned int)(x >> (32 * j))) +
                            __uint_as_float((unsigned int)(y >> (32 * j)));
                out |= (unsigned long long)__float_as_uint(sum) << (32 * j);
            }
        }
        a[i] = out;
    }
}

// The (image, y, x, channel) of element i of an NHWC tensor of `total` elements. In 32-bit
// unsigned arithmetic where the tensor allows (64-bit division and remainder cost several
// times more, and the pools do little else per element).
__device__ __forceinline__ void nhwc_at(long long i, long long total, int c, int w, int h,
                                        long long* img, int* y, int* x, int* ch) {
    if (total <= 0x7fffffffLL) {
        unsigned int j = (unsigned int)i;
        *ch = (int)(j % (unsigned int)c); j /= (unsigned int)c;
        *x = (int)(j % (unsigned int)w); j /= (unsigned int)w;
        *y = (int)(j % (unsigned int)h);
        *img = (long long)(j / (unsigned int)h);
    } else {
        *ch = (int)(i % c);
        long long rest = i / c;
        *x = (int)(rest % w); rest /= w;
        *y = (int)(rest % h);
        *img = rest / h;
    }
}

// Max pool over NHWC; `argmax` gets the winner's index within its (h, w) plane.
extern "C" __global__ void max_pool_forward(const void* x, void* y, int* argmax, int bf,
                                            int n, int c, int h, int w, int oh, int ow,
                                            int k, int stride, int pad) {
    long long total = (long long)n * oh * ow * c;
    FOR_EACH(i, total) {
        long long img;
        int oy, ox, ch;
        nhwc_at(i, total, c, ow, oh, &img, &oy, &ox, &ch);
        float best = -__int_as_float(0x7f800000);
        int best_i = 0;
        for (int ky = 0; ky < k; ++ky) {
            int iy = oy * stride + ky - pad;
            if (iy < 0 || iy >= h) continue;
            for (int kx = 0; kx < k; ++kx) {
                int ix = ox * stride + kx - pad;
                if (ix < 0 || ix >= w) continue;
                float v = ld(x, ((img * h + iy) * w + ix) * c + ch, bf);
                if (v > best) { best = v; best_i = iy * w + ix; }
            }
        }
        st(y, i, bf, best);
        argmax[i] = best_i;
    }
}

// Gathers, per input element, the gradients of the outputs it won (no atomics).
extern "C" __global__ void max_pool_backward(const int* argmax, const void* dy, void* dx,
                                             int bf, int n, int c, int h, int w, int oh,
                                             int ow, int k, int stride, int pad) {
    long long total = (long long)n * h * w * c;
    FOR_EACH(i, total) {
        long long img;
        int iy, ix, ch;
        nhwc_at(i, total, c, w, h, &img, &iy, &ix, &ch);
        int me = iy * w + ix;
        float sum = 0.0f;
        // Outputs whose window holds (iy, ix): oy*stride - pad <= iy < oy*stride - pad + k.
        // (Plain comparisons: NVRTC compiles without headers.)
        int oy_lo = (iy + pad - k + stride) / stride; if (oy_lo < 0) oy_lo = 0;
        int oy_hi = (iy + pad) / stride; if (oy_hi > oh - 1) oy_hi = oh - 1;
        int ox_lo = (ix + pad - k + stride) / stride; if (ox_lo < 0) ox_lo = 0;
        int ox_hi = (ix + pad) / stride; if (ox_hi > ow - 1) ox_hi = ow - 1;
        for (int oy = oy_lo; oy <= oy_hi; ++oy) {
            for (int ox = ox_lo; ox <= ox_hi; ++ox) {
                long long o = ((img * oh + oy) * ow + ox) * c + ch;
                if (argmax[o] == me) sum += ld(dy, o, bf);
            }
        }
        st(dx, i, bf, sum);
    }
}

// y[n, c] (f32) = mean over the plane of NHWC x.
extern "C" __global__ void global_avg_pool_forward(const void* x, int bf, float* y,
                                                   int n, int c, int hw) {
    long long total = (long long)n * c;
    FOR_EACH(i, total) {
        int ch = (int)(i % c);
        long long img = i / c;
        float sum = 0.0f;
        for (int p = 0; p < hw; ++p) sum += ld(x, (img * hw + p) * c + ch, bf);
        y[i] = sum / (float)hw;
    }
}

extern "C" __global__ void global_avg_pool_backward(const float* dy, void* dx, int bf,
                                                    int n, int c, int hw) {
    long long total = (long long)n * hw * c;
    FOR_EACH(i, total) {
        int ch = (int)(i % c);
        long long img = i / ((long long)hw * c);
        st(dx, i, bf, dy[img * c + ch] / (float)hw);
    }
}

extern "C" __global__ void broadcast_rows(const float* bias, float* y, int cols,
                                          long long n) {
    FOR_EACH(i, n) y[i] = bias[i % cols];
}

// sums[j] += sum over rows of x[r, j]; one thread per column.
extern "C" __global__ void sum_rows(const float* x, float* sums, int rows, int cols) {
    FOR_EACH(j, cols) {
        float s = 0.0f;
        for (int r = 0; r < rows; ++r) s += x[(long long)r * cols + j];
        sums[j] += s;
    }
}

// PyTorch's SGD: v = momentum v + (g + wd w); w -= lr v.
extern "C" __global__ void sgd_update(float* w, const float* g, float* v, float lr,
                                      float momentum, float wd, long long n) {
    FOR_EACH(i, n) {
        float vi = momentum * v[i] + g[i] + wd * w[i];
        v[i] = vi;
        w[i] -= lr * vi;
    }
}

// sgd_update over every parameter at once, one launch instead of one a tensor: weight decay
// wd except on elements in the ranges [bounds[2j], bounds[2j + 1]) (sorted and disjoint:
// batch-norm scales and shifts, biases). An element's range comes from the number of bounds
// at or below it (odd: inside an undecayed range), found by bisection of the small table.
extern "C" __global__ void sgd_update_all(float* w, const float* g, float* v, float lr,
                                          float momentum, float wd, const int* bounds,
                                          int nbounds, long long n) {
    FOR_EACH(i, n) {
        int lo = 0, hi = nbounds;
        while (lo < hi) {
            int mid = (lo + hi) / 2;
            if (bounds[mid] <= i) lo = mid + 1; else hi = mid;
        }
        float decay = (lo & 1) ? 0.0f : wd;
        float vi = momentum * v[i] + g[i] + decay * w[i];
        v[i] = vi;
        w[i] -= lr * vi;
    }
}

// Softmax cross-entropy with label smoothing, one thread per row of `k` f32 logits (the
// CPU's order and f64 sums): dlogits = scale * (softmax - smoothed target) / n; the row's
// loss (f64, as the CPU sums it) and whether its first arg-max is the label go to
// row_stats[2 * row ..].
extern "C" __global__ void softmax_cross_entropy(const float* logits, const float* labels,
                                                 float* dlogits, double* row_stats, int n,
                                                 int k, float smoothing, float scale) {
    FOR_EACH(row, n) {
        const float* x = logits + row * (long long)k;
        float* g = dlogits + row * (long long)k;
        int label = (int)labels[row];
        float max = x[0];
        int argmax = 0;
        for (int j = 1; j < k; ++j) {
            if (x[j] > max) { max = x[j]; argmax = j; }
        }
        double sum = 0.0;
        for (int j = 0; j < k; ++j) sum += exp((double)(x[j] - max));
        double log_sum = log(sum);
        float off = smoothing / k;
        float on = 1.0f - smoothing + off;
        double loss = 0.0;
        for (int j = 0; j < k; ++j) {
            double log_p = (double)(x[j] - max) - log_sum;
            float q = j == label ? on : off;
            loss -= q * log_p;
            g[j] = (float)((exp(log_p) - q) / n) * scale;
        }
        row_stats[2 * row] = loss;
        row_stats[2 * row + 1] = argmax == label ? 1.0 : 0.0;
    }
}

// totals[0] += mean of the rows' losses, totals[1] += their correct count: one thread, in
// row order, so the sums are the same every run (and the CPU's).
extern "C" __global__ void sum_row_stats(const double* row_stats, float* totals, int n) {
    FOR_EACH(i, 1) {
        double loss = 0.0, correct = 0.0;
        for (int row = 0; row < n; ++row) {
            loss += row_stats[2 * row];
            correct += row_stats[2 * row + 1];
        }
        if (n > 0) totals[0] += (float)(loss / n);
        totals[1] += (float)correct;
    }
}

// Batch norm over NHWC, `rows` = n·h·w rows of `c` channels, with its epilogue, as the CPU
// backend computes it (our alternative to cuDNN's calls; RINGMASTER_CUDA_BATCH_NORM=own).
// The per-channel sums need no shared memory or atomics: partial sums per (chunk of
// `chunk` rows, channel), threads of neighbouring channels reading neighbouring addresses;
// then folded `fan` groups at a time until one group is left; then per channel.

// Statistics' partial sums of d = x - x[row 0] (the shift keeps the variance's subtraction
// small): partial[2 (chunk c + ch) ..] = (Σd, Σd²).
extern "C" __global__ void bn_stats_partial(const void* x, int bf, long long rows, int c,
                                            int chunk, double* partial) {
    long long chunks = (rows + chunk - 1) / chunk;
    FOR_EACH(i, chunks * c) {
        int ch = (int)(i % c);
        long long first = (i / c) * chunk;
        long long last = first + chunk < rows ? first + chunk : rows;
        float shift = ld(x, ch, bf);
        float s = 0.0f, s2 = 0.0f;
        for (long long r = first; r < last; ++r) {
            float d = ld(x, r * c + ch, bf) - shift;
            s += d;
            s2 += d * d;
        }
        partial[2 * i] = s;
        partial[2 * i + 1] = s2;
    }
}

// Backward's partial sums: g = dy where the forward output y is positive (y null: no ReLU),
// partial[2 (chunk c + ch) ..] = (Σg, Σg·x̂).
extern "C" __global__ void bn_grad_partial(const void* x, const void* dy, const void* y, int bf,
                                           long long rows, int c, int chunk, const float* mean,
                                           const float* inv_std, double* partial) {
    long long chunks = (rows + chunk - 1) / chunk;
    FOR_EACH(i, chunks * c) {
        int ch = (int)(i % c);
        long long first = (i / c) * chunk;
        long long last = first + chunk < rows ? first + chunk : rows;
        float m = mean[ch], s = inv_std[ch];
        float sg = 0.0f, sgx = 0.0f;
        for (long long r = first; r < last; ++r) {
            long long at = r * c + ch;
            float g = y && !(ld(y, at, bf) > 0.0f) ? 0.0f : ld(dy, at, bf);
            sg += g;
            sgx += g * ((ld(x, at, bf) - m) * s);
        }
        partial[2 * i] = sg;
        partial[2 * i + 1] = sgx;
    }
}

// Folds `groups` groups of per-channel pairs `fan` at a time: out group j = the sum of in
// groups j·fan .. j·fan + fan - 1.
extern "C" __global__ void bn_fold(const double* in, long long groups, int c, int fan,
                                   double* out) {
    long long folded = (groups + fan - 1) / fan;
    FOR_EACH(i, folded * c) {
        int ch = (int)(i % c);
        long long first = (i / c) * fan;
        long long last = first + fan < groups ? first + fan : groups;
        double a = 0.0, b = 0.0;
        for (long long g = first; g < last; ++g) {
            a += in[2 * (g * c + ch)];
            b += in[2 * (g * c + ch) + 1];
        }
        out[2 * i] = a;
        out[2 * i + 1] = b;
    }
}

// Per channel, from the folded sums: the batch mean and 1/sqrt(var + eps) (biased variance),
// and the running statistics with the unbiased variance, as PyTorch.
extern "C" __global__ void bn_stats_finish(const double* sums, const void* x, int bf,
                                           long long rows, int c, float momentum, float eps,
                                           float* running_mean, float* running_var,
                                           float* mean, float* inv_std) {
    FOR_EACH(ch, c) {
        double shift = ld(x, ch, bf);
        double d = sums[2 * ch] / rows;
        double var = sums[2 * ch + 1] / rows - d * d;
        if (var < 0.0) var = 0.0;
        double unbias = rows > 1 ? (double)rows / (double)(rows - 1) : 1.0;
        float m = (float)(shift + d);
        running_mean[ch] = (1.0f - momentum) * running_mean[ch] + momentum * m;
        running_var[ch] = (1.0f - momentum) * running_var[ch] + momentum * (float)(var * unbias);
        mean[ch] = m;
        inv_std[ch] = (float)(1.0 / sqrt(var + (double)eps));
    }
}

// y = γ x̂ + β (+ z) (then max(·, 0) when relu), rounded once; z null: no residual.
extern "C" __global__ void bn_forward_apply(const void* x, const void* z, void* y, int bf,
                                            long long rows, int c, const float* mean,
                                            const float* inv_std, const float* gamma,
                                            const float* beta, int relu) {
    FOR_EACH(i, rows * c) {
        int ch = (int)(i % c);
        float xh = (ld(x, i, bf) - mean[ch]) * inv_std[ch];
        float v = gamma[ch] * xh + beta[ch] + (z ? ld(z, i, bf) : 0.0f);
        st(y, i, bf, relu ? fmaxf(v, 0.0f) : v);
    }
}

// dx = γ σ⁻¹ (g - mean(g) - x̂ mean(g x̂)) with g = dy through the ReLU (y null: none), which
// is also the residual's gradient dz (null: none); `sums` are backward's folded sums.
extern "C" __global__ void bn_backward_apply(const void* x, const void* dy, const void* y,
                                             void* dz, void* dx, int bf, long long rows, int c,
                                             const float* mean, const float* inv_std,
                                             const float* gamma, const double* sums) {
    FOR_EACH(i, rows * c) {
        int ch = (int)(i % c);
        float g = y && !(ld(y, i, bf) > 0.0f) ? 0.0f : ld(dy, i, bf);
        if (dz) st(dz, i, bf, g);
        float xh = (ld(x, i, bf) - mean[ch]) * inv_std[ch];
        float mean_g = (float)(sums[2 * ch] / rows);
        float mean_gx = (float)(sums[2 * ch + 1] / rows);
        st(dx, i, bf, gamma[ch] * inv_std[ch] * (g - mean_g - xh * mean_gx));
    }
}

// dγ += Σg x̂, dβ += Σg, from backward's folded sums.
extern "C" __global__ void bn_grad_finish(const double* sums, int c, float* dgamma,
                                          float* dbeta) {
    FOR_EACH(ch, c) {
        dgamma[ch] += (float)sums[2 * ch + 1];
        dbeta[ch] += (float)sums[2 * ch];
    }
}
