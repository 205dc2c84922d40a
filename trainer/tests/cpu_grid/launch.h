// Included after the kernels: the launcher tests/kernels_on_cpu.rs calls, and the kernels
// it knows by name (RINGMASTER_KERNELS, a list of RINGMASTER_KERNEL(name) written by the
// test from the Rust side's declarations).

// Calls `kernel` with its arguments read from `args` as cuLaunchKernel reads its
// `kernelParams`: args[i] points at a value of the i-th parameter's type.
template <typename... Params, std::size_t... I>
static void ringmaster_call(void (*kernel)(Params...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<Params*>(args[I])...);
}

template <typename... Params>
static void ringmaster_grid(void (*kernel)(Params...), unsigned int blocks, unsigned int threads,
                            void** args) {
    gridDim = {blocks, 1, 1};
    blockDim = {threads, 1, 1};
    for (unsigned int b = 0; b < blocks; ++b) {
        for (unsigned int t = 0; t < threads; ++t) {
            blockIdx = {b, 0, 0};
            threadIdx = {t, 0, 0};
            ringmaster_call(kernel, args, std::index_sequence_for<Params...>{});
        }
    }
}

// Runs kernel `name` over `blocks` blocks of `threads` threads; 0, or -1 for a name that
// is not a kernel.
extern "C" int ringmaster_launch(const char* name, unsigned int blocks, unsigned int threads,
                                 void** args) {
#define RINGMASTER_KERNEL(k)                            \
    if (std::strcmp(name, #k) == 0) {                   \
        ringmaster_grid(k, blocks, threads, args);      \
        return 0;                                       \
    }
    RINGMASTER_KERNELS
#undef RINGMASTER_KERNEL
    return -1;
}
