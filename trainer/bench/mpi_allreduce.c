/* The reference for `ringmaster-trainer bench-allreduce`: Open MPI's own MPI_Allreduce on the
 * same sizes, timed the same way (warm-up, then the mean of timed runs), printed in the same
 * columns. Built and run by allreduce-vs-mpi.sh. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    long min = argc > 1 ? atol(argv[1]) : 4096;
    long max = argc > 2 ? atol(argv[2]) : 256L << 20;
    int factor = argc > 3 ? atoi(argv[3]) : 2;
    int iterations = argc > 4 ? atoi(argv[4]) : 20;
    int warmup = argc > 5 ? atoi(argv[5]) : 5;
    int rank, size;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (rank == 0) {
        printf("# MPI_Allreduce (Open MPI): %d ranks, sum, float32\n", size);
        printf("#%12s %12s %12s %12s %12s\n", "size(B)", "count", "time(us)", "algbw(GB/s)", "busbw(GB/s)");
    }
    for (long bytes = min; bytes <= max; bytes *= factor) {
        long count = bytes / 4;
        float *data = malloc(count * sizeof(float));
        for (long i = 0; i < count; i++) data[i] = 1.0f;
        for (int i = 0; i < warmup; i++) MPI_Allreduce(MPI_IN_PLACE, data, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        MPI_Barrier(MPI_COMM_WORLD);
        double start = MPI_Wtime();
        for (int i = 0; i < iterations; i++) MPI_Allreduce(MPI_IN_PLACE, data, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double seconds = (MPI_Wtime() - start) / iterations;
        double algbw = bytes / seconds / 1e9;
        if (rank == 0)
            printf(" %12ld %12ld %12.1f %12.3f %12.3f\n", bytes, count, seconds * 1e6, algbw, algbw * 2.0 * (size - 1) / size);
        free(data);
    }
    MPI_Finalize();
    return 0;
}
