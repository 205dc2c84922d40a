// The GPU loader's one kernel: each decoded image's crop, resized to the model's input with
// PIL's antialiased bilinear filter (as resample.rs on the CPU: the triangle's support is
// one source pixel, widened by the scale when shrinking; weights normalised per axis),
// mirrored when asked, normalised with ImageNet's mean and deviation into planar floats.

struct Crop {
    unsigned long long offset;  // byte offset of the image's first pixel in `decoded`
    int width;                  // decoded pixels across (0: not decoded here, skip)
    int height;                 // decoded pixels down
    int pitch;                  // bytes per row (interleaved RGB)
    int flip;                   // 1: mirror left to right
    float x, y, w, h;           // the crop, in decoded pixels
};

__device__ __forceinline__ void span(float from, float length, int source, int size, int i,
                                     int* first, int* end, float* centre, float* widen) {
    float scale = length / size;
    *widen = fmaxf(scale, 1.0f);
    *centre = from + (i + 0.5f) * scale;
    int f = (int)floorf(*centre - *widen + 0.5f);
    f = min(max(f, 0), source - 1);
    int e = (int)floorf(*centre + *widen + 0.5f);
    *first = f;
    *end = min(max(e, f + 1), source);
}

extern "C" __global__ void crop_resize_normalize(const unsigned char* decoded, const Crop* crops,
                                                 float* out, int images, int size) {
    long long per = (long long)size * size;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= images * per) return;
    int image = (int)(i / per);
    int p = (int)(i % per);
    int oy = p / size, ox = p % size;
    Crop c = crops[image];
    if (c.width == 0) return;
    int x0, x1, y0, y1;
    float cx, cy, wx, wy;
    span(c.x, c.w, c.width, size, ox, &x0, &x1, &cx, &wx);
    span(c.y, c.h, c.height, size, oy, &y0, &y1, &cy, &wy);
    const unsigned char* base = decoded + c.offset;
    float r = 0.f, g = 0.f, b = 0.f, across = 0.f, down = 0.f;
    for (int x = x0; x < x1; x++) across += fmaxf(1.f - fabsf((x + 0.5f - cx) / wx), 0.f);
    for (int y = y0; y < y1; y++) {
        float wyv = fmaxf(1.f - fabsf((y + 0.5f - cy) / wy), 0.f);
        down += wyv;
        if (wyv == 0.f) continue;
        const unsigned char* row = base + (long long)y * c.pitch;
        for (int x = x0; x < x1; x++) {
            float w = wyv * fmaxf(1.f - fabsf((x + 0.5f - cx) / wx), 0.f);
            r += w * row[3 * x];
            g += w * row[3 * x + 1];
            b += w * row[3 * x + 2];
        }
    }
    float norm = (across > 0.f && down > 0.f) ? 1.f / (across * down) : 0.f;
    int at = oy * size + (c.flip ? size - 1 - ox : ox);
    float* o = out + (long long)image * 3 * per;
    o[at] = (r * norm / 255.f - 0.485f) / 0.229f;
    o[per + at] = (g * norm / 255.f - 0.456f) / 0.224f;
    o[2 * per + at] = (b * norm / 255.f - 0.406f) / 0.225f;
}
