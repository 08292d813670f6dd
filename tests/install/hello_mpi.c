// hello_mpi.c: the MPI consumer of tests/install/test_install.sh, built
// against the installed package (pkg-config mha_mpi, and CMake's
// find_package(mha COMPONENTS mpi) -> mha::mha_mpi) and run with
// mpiexec -n 2: a module's causal self-attention across the ranks (head
// parallelism), which must equal the single-process fused forward bit for
// bit on every rank. Prints one line from rank 0; exit status 0 only then.
#include <mpi.h>
#include <stdio.h>
#include <string.h>

#include <mha.h>
#include <mha_mpi.h>

int main(int argc, char **argv) {
    int provided, rank = 0, P = 1;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &P);
    mha_config cfg;
    mha_config_init(&cfg, 8, 4);  // nn.MultiheadAttention(8, 4)
    mha_module *m = NULL;
    mha_init_options init;
    mha_init_options_init(&init);  // seed 0: the same parameters on every rank
    mha_status st = mha_module_create(&m, &cfg);
    if (!st) st = mha_module_init(m, &init);
    enum { L = 5, N = 1, E = 8 };
    float x[L * N * E], y1[L * N * E], y2[L * N * E];
    for (int i = 0; i < L * N * E; i++) x[i] = (float)((i * 37) % 17) / 8.0f - 1.0f;
    const int64_t shape[3] = {L, N, E};
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, shape);
    mha_tensor y1t = mha_tensor_contiguous(y1, MHA_F32, 3, shape);
    mha_tensor y2t = mha_tensor_contiguous(y2, MHA_F32, 3, shape);
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.opts.is_causal = true;
    a.impl = MHA_IMPL_FUSED;
    if (!st) st = mha_forward(&y1t, NULL, m, &a);
    if (!st) st = mha_mpi_forward(MPI_COMM_WORLD, MHA_PAR_HEADS, &y2t, m, &a, NULL);
    if (st) fprintf(stderr, "hello_mpi rank %d: %s\n", rank, mha_last_error());
    int same = !st && memcmp(y1, y2, sizeof y1) == 0, all = 0;
    MPI_Allreduce(&same, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (rank == 0)
        printf("mha_mpi_forward (heads, %d ranks): %s the single-process forward\n", P,
               all ? "bit-identical to" : "DIFFERENT from");
    mha_module_destroy(m);
    MPI_Finalize();
    return all ? 0 : 1;
}
