// Enough of CUDA's kernel language, on the CPU, to run cuda_kernels.cu unchanged: a kernel
// is a plain function, and `ringmaster_launch` (below the kernels) calls it once for every
// (block, thread) of the grid the CUDA backend would launch, one after another, with
// blockIdx, threadIdx, blockDim and gridDim set. tests/kernels_on_cpu.rs compiles this with
// the host's C++ compiler to check the kernels' arithmetic and indexing, and the arguments
// the backend passes, on machines without a GPU.
//
// What it does not model: threads running at once. The kernels need none of it (no shared
// memory, barriers or atomics; each thread writes only its own outputs), and a kernel that
// came to need it could not be checked here. Nor CUDA's own maths library (exp, log and
// sqrt are the C library's), nor NVRTC's fused multiply-adds (it contracts a*b+c by
// default; this is built with -ffp-contract=off): results agree with a GPU's to rounding,
// not bit for bit.
#include <cmath>
#include <cstddef>
#include <cstring>
#include <utility>

struct ringmaster_dim3 {
    unsigned int x, y, z;
};

// Per host thread: the Rust test harness runs tests on several threads at once.
static thread_local ringmaster_dim3 blockIdx, threadIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline

static inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

static inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

static inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, sizeof f);
    return f;
}
