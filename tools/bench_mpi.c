// bench_mpi.c: `mha bench --parallel SCHEME` under mpirun: the module's
// forward (and with --backward its backward) across the ranks (mha_mpi.h),
// timed as the slowest rank's wall time per call (after a barrier), with
// per-rank figures from the last call: time, time inside MPI (waiting and
// communication), bytes sent against the scheme's communication model, and
// the work imbalance (the slowest rank's compute time over the mean).
// Without MPI in the build it says so.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"

#ifndef MHA_HAVE_MPI

int bench_parallel(const char *scheme, int64_t B, int64_t L, int64_t E, int64_t H, int64_t Hkv,
                   bool causal, bool backward, int64_t repeat, int64_t warmup, uint64_t seed,
                   bool json, int64_t kv_len) {
    (void)scheme, (void)B, (void)L, (void)E, (void)H, (void)Hkv, (void)causal, (void)backward;
    (void)repeat, (void)warmup, (void)seed, (void)json, (void)kv_len;
    fprintf(stderr, "mha bench: --parallel needs an mha built with MPI (install libopenmpi-dev "
                    "and rebuild)\n");
    return 1;
}

#else

#include "mha_mpi.h"

static float urand(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(*s >> 11) * 0x1p-53 * 2.0 - 1.0);
}

// --parallel kv --decode: one decode step of T new tokens (mha_mpi_forward_cached)
// over a KV cache of kv_len tokens per sequence sharded evenly across the
// ranks (filled with random keys and values); the last rank appends the
// new tokens, which are truncated away after each timed step.
static int bench_kv_decode(int rank, int P, int64_t B, int64_t T, int64_t E, int64_t H,
                           int64_t Hkv, int64_t kv_len, int64_t repeat, int64_t warmup,
                           uint64_t seed, bool json) {
    const int64_t d = E / H, share = kv_len * (rank + 1) / P - kv_len * rank / P;
    mha_config c;
    mha_config_init(&c, E, H);
    c.num_kv_heads = Hkv;
    c.batch_first = true;
    mha_module *m = NULL;
    mha_kv_cache *kc = NULL;
    mha_status st = mha_module_create(&m, &c);
    mha_init_options io;
    mha_init_options_init(&io);
    io.seed = seed;
    if (!st) st = mha_module_init(m, &io);
    if (!st) st = mha_kv_cache_create(&kc, B, Hkv, d, d, share + T, MHA_KV_F32);
    const int64_t nkv = B * Hkv * share * d, nx = B * T * E;
    float *kv = malloc(sizeof(float) * (size_t)(2 * nkv + 2 * nx + 1)), *x = kv + 2 * nkv,
          *y = x + nx;
    double *times = malloc(sizeof(double) * (size_t)(repeat > 0 ? repeat : 1));
    if (!st && (!kv || !times)) st = MHA_ERR_NOMEM;
    uint64_t s = seed * 2654435761u + 7 + (uint64_t)rank;
    for (int64_t i = 0; !st && i < 2 * nkv; i++) kv[i] = urand(&s);
    for (int64_t i = 0; !st && i < nx; i++) x[i] = urand(&s);
    if (!st) {
        mha_tensor kt = mha_tensor_contiguous(kv, MHA_F32, 4, (int64_t[]){B, Hkv, share, d}),
                   vt = mha_tensor_contiguous(kv + nkv, MHA_F32, 4,
                                              (int64_t[]){B, Hkv, share, d});
        st = mha_kv_cache_append(kc, &kt, &vt, NULL);
    }
    MPI_Bcast(x, (int)nx, MPI_FLOAT, 0, MPI_COMM_WORLD);  // the same new tokens everywhere
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){B, T, E}),
               yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){B, T, E});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.opts.is_causal = true;
    mha_mpi_stats ms = {0};
    int bad = st != MHA_OK, any = 0;
    MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (any) st = st ? st : MHA_ERR_NOMEM;
    for (int64_t i = 0; !any && !st && i < warmup + repeat; i++) {
        MPI_Barrier(MPI_COMM_WORLD);
        const double t = MPI_Wtime();
        st = mha_mpi_forward_cached(MPI_COMM_WORLD, &yt, m, &a, kc, P - 1, &ms);
        double dt = MPI_Wtime() - t, mx;
        MPI_Allreduce(&dt, &mx, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (i >= warmup) times[i - warmup] = mx * 1e3;
        if (!st && mha_kv_cache_truncate(kc, -1, share)) st = MHA_ERR_INVALID_ARG;
    }
    int rc = 0;
    if (st || any) {
        if (rank == 0) cli_fail("bench", st ? st : MHA_ERR_NOMEM);
        rc = 1;
    } else {
        qsort(times, (size_t)repeat, sizeof(double), cli_cmp_double);
        const double med = repeat % 2 ? times[repeat / 2]
                                      : 0.5 * (times[repeat / 2 - 1] + times[repeat / 2]);
        double mine[3] = {ms.comm_seconds, ms.bytes_sent, ms.bytes_model};
        double *all = rank == 0 ? malloc(sizeof(double) * 3 * (size_t)P) : NULL;
        MPI_Gather(mine, 3, MPI_DOUBLE, all, 3, MPI_DOUBLE, 0, MPI_COMM_WORLD);
        if (rank == 0 && json) {
            printf("{\"what\": \"mha_parallel_kv_decode\", \"ranks\": %d, \"batch\": %lld, "
                   "\"new_tokens\": %lld, \"kv_len\": %lld, \"embed_dim\": %lld, \"num_heads\": "
                   "%lld, \"num_kv_heads\": %lld, \"median_ms\": %.4f}\n",
                   P, (long long)B, (long long)T, (long long)kv_len, (long long)E,
                   (long long)H, (long long)Hkv, med);
        } else if (rank == 0) {
            printf("mha bench --parallel kv --decode: %d ranks, batch %lld, %lld new token%s over "
                   "a cache of %lld tokens sharded evenly (%lld per rank), embed_dim %lld, heads "
                   "%lld (KV %lld)\n",
                   P, (long long)B, (long long)T, T == 1 ? "" : "s", (long long)kv_len,
                   (long long)(kv_len / P), (long long)E, (long long)H, (long long)Hkv);
            printf("  time       median %.4f ms per step (the slowest rank, %lld runs after %lld "
                   "warm-up)\n",
                   med, (long long)repeat, (long long)warmup);
            for (int q = 0; q < P && all; q++)
                printf("  rank %-3d   %.4f ms inside MPI, %.3f KB sent (model %.3f KB)\n", q,
                       all[3 * q] * 1e3, all[3 * q + 1] * 1e-3, all[3 * q + 2] * 1e-3);
        }
        free(all);
    }
    free(kv), free(times);
    mha_kv_cache_destroy(kc);
    mha_module_destroy(m);
    return rc;
}

// One --parallel run of the module on this rank: the options, the module
// (and its gradients), the tensors as this rank sees them, the timings and
// the last call's statistics.
typedef struct par_run {
    const char *scheme;
    int64_t B, L, E, H, Hkv, repeat, warmup;
    bool causal, backward, json;
    int rank, P;
    mha_parallel par;
    mha_module *m, *g;
    float *x, *y, *gy, *gx;  // (B, L, E) each, one allocation at x
    float *xl;               // ring: this rank's chunks of x, y, gy, gx
    mha_tensor xt, yt, gyt, gxt;
    mha_forward_args a;
    mha_saved *saved;
    double *times;  // (repeat) ms, the slowest rank's
    mha_mpi_stats fs, bs;
} par_run;

// The scheme, the module (initialised from seed), its gradients with
// --backward, the buffers.
static mha_status par_setup(par_run *pr, uint64_t seed) {
    mha_status st = mha_parallel_from_name(&pr->par, pr->scheme);
    mha_config c;
    mha_config_init(&c, pr->E, pr->H);
    c.num_kv_heads = pr->Hkv;
    c.batch_first = true;
    if (!st) st = mha_module_create(&pr->m, &c);
    mha_init_options io;
    mha_init_options_init(&io);
    io.seed = seed;
    if (!st) st = mha_module_init(pr->m, &io);
    if (!st && pr->backward) st = mha_module_create(&pr->g, &c);
    const int64_t n = pr->B * pr->L * pr->E;
    pr->x = malloc(sizeof(float) * (size_t)n * 4);
    pr->y = pr->x + n, pr->gy = pr->y + n, pr->gx = pr->gy + n;
    if (!pr->x) st = MHA_ERR_NOMEM;
    return st;
}

// Random inputs (from seed) and this rank's views of them: the whole
// tensors (heads), this rank's block of tokens (ulysses) or its zigzag
// chunks (ring: copies); the forward's arguments.
static void par_inputs(par_run *pr, uint64_t seed) {
    const int64_t B = pr->B, L = pr->L, E = pr->E, n = B * L * E;
    const int rank = pr->rank, P = pr->P;
    float *x = pr->x, *gy = pr->gy;
    uint64_t s = seed * 2654435761u + 1;
    for (int64_t i = 0; i < n; i++) x[i] = urand(&s), gy[i] = urand(&s);
    const bool shard = pr->par == MHA_PAR_ULYSSES;
    const int64_t t0 = shard ? L * rank / P : 0, t1 = shard ? L * (rank + 1) / P : L;
    const int64_t sh[3] = {B, t1 - t0, E}, str[3] = {L * E, E, 1};
    pr->xt = (mha_tensor){
        x + t0 * E, MHA_F32, 3, {sh[0], sh[1], sh[2]}, {str[0], str[1], str[2]}};
    pr->yt = pr->xt, pr->gyt = pr->xt, pr->gxt = pr->xt;
    pr->yt.data = pr->y + t0 * E, pr->gyt.data = gy + t0 * E, pr->gxt.data = pr->gx + t0 * E;
    if (pr->par == MHA_PAR_RING) {
        int64_t cs[2], cl[2];
        mha_mpi_ring_chunks(L, P, rank, cs, cl);
        const int64_t Lr = cl[0] + cl[1];
        float *xl = pr->xl = malloc(sizeof(float) * (size_t)(4 * B * Lr * E + 1));
        for (int64_t b = 0; xl && b < B; b++)
            for (int c2 = 0; c2 < 2; c2++) {
                const int64_t lt = c2 ? cl[0] : 0;
                memcpy(xl + (b * Lr + lt) * E, x + (b * L + cs[c2]) * E,
                       sizeof(float) * (size_t)(cl[c2] * E));
                memcpy(xl + 2 * B * Lr * E + (b * Lr + lt) * E, gy + (b * L + cs[c2]) * E,
                       sizeof(float) * (size_t)(cl[c2] * E));
            }
        pr->xt = mha_tensor_contiguous(xl ? xl : x, MHA_F32, 3, (int64_t[]){B, Lr, E});
        pr->yt = pr->gyt = pr->gxt = pr->xt;
        if (xl)
            pr->yt.data = xl + B * Lr * E, pr->gyt.data = xl + 2 * B * Lr * E,
            pr->gxt.data = xl + 3 * B * Lr * E;
    }
    mha_forward_args_init(&pr->a);
    pr->a.query = pr->a.key = pr->a.value = &pr->xt;
    pr->a.opts.is_causal = pr->causal;
    // ring keeps its forward for the backward (as the single-process bench
    // does); the other schemes recompute it
    if (pr->backward && pr->par == MHA_PAR_RING && !mha_saved_create(&pr->saved))
        pr->a.save = pr->saved;
}

// warmup + repeat calls (forward, and backward with --backward), each
// after a barrier, timed as the slowest rank's wall time.
static mha_status par_time(par_run *pr) {
    mha_status st = MHA_OK;
    pr->times = malloc(sizeof(double) * (size_t)pr->repeat);
    for (int64_t i = 0; !st && i < pr->warmup + pr->repeat; i++) {
        MPI_Barrier(MPI_COMM_WORLD);
        const double t = MPI_Wtime();
        st = mha_mpi_forward(MPI_COMM_WORLD, pr->par, &pr->yt, pr->m, &pr->a, &pr->fs);
        if (!st && pr->backward)
            st = mha_mpi_backward(MPI_COMM_WORLD, pr->par, &pr->gxt, NULL, NULL, pr->g, pr->m,
                                  &pr->a, &pr->gyt, false, &pr->bs);
        double dt = MPI_Wtime() - t, mx;
        MPI_Allreduce(&dt, &mx, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (i >= pr->warmup && pr->times) pr->times[i - pr->warmup] = mx * 1e3;
    }
    return st;
}

// per rank in all (NS doubles each): seconds, MPI seconds, bytes, model
// bytes, heads, score tiles, seconds waiting for the ring's messages
// (forward + backward)
enum { NS = 7 };

// Rank 0's report: the median time med, the imbalance imb and the ranks'
// figures all, as JSON or as text.
static void par_print(const par_run *pr, const double *all, double med, double imb) {
    const int P = pr->P;
    const char *scheme = pr->scheme;
    const int64_t B = pr->B, L = pr->L, E = pr->E, H = pr->H, Hkv = pr->Hkv;
    const bool causal = pr->causal, backward = pr->backward;
    if (pr->json) {
        printf("{\"what\": \"mha_parallel\", \"scheme\": \"%s\", \"ranks\": %d, \"batch\": "
               "%lld, \"seq\": %lld, \"embed_dim\": %lld, \"num_heads\": %lld, "
               "\"num_kv_heads\": %lld, \"causal\": %s, \"backward\": %s, \"median_ms\": "
               "%.4f, \"imbalance\": %.4f, \"ranks_detail\": [",
               scheme, P, (long long)B, (long long)L, (long long)E, (long long)H,
               (long long)Hkv, causal ? "true" : "false", backward ? "true" : "false", med,
               imb);
        for (int q = 0; q < P; q++)
            printf("%s{\"rank\": %d, \"ms\": %.4f, \"mpi_ms\": %.4f, \"bytes_sent\": %.0f, "
                   "\"bytes_model\": %.0f, \"heads\": %.0f, \"tiles\": %.0f, \"wait_ms\": %.4f}",
                   q ? ", " : "", q, all[NS * q] * 1e3, all[NS * q + 1] * 1e3, all[NS * q + 2],
                   all[NS * q + 3], all[NS * q + 4], all[NS * q + 5], all[NS * q + 6] * 1e3);
        printf("]}\n");
    } else {
        printf("mha bench --parallel %s: %d ranks, batch %lld, seq %lld, embed_dim %lld, "
               "heads %lld (KV %lld)%s, %s\n",
               scheme, P, (long long)B, (long long)L, (long long)E, (long long)H,
               (long long)Hkv, causal ? ", causal" : "",
               backward ? "forward + backward" : "forward");
        printf("  time       median %.3f ms (the slowest rank per call, %lld runs after "
               "%lld warm-up)\n",
               med, (long long)pr->repeat, (long long)pr->warmup);
        printf("  imbalance  %.3f (the slowest rank's compute time over the mean)\n", imb);
        for (int q = 0; q < P; q++)
            printf("  rank %-3d   %.3f ms, %.3f ms inside MPI (%.3f ms waiting for ring "
                   "messages), %.3f MB sent (model %.3f MB), %.0f heads, %.0f score "
                   "tiles\n",
                   q, all[NS * q] * 1e3, all[NS * q + 1] * 1e3, all[NS * q + 6] * 1e3,
                   all[NS * q + 2] * 1e-6, all[NS * q + 3] * 1e-6, all[NS * q + 4],
                   all[NS * q + 5]);
    }
}

// The median of the timings, every rank's figures gathered on rank 0, the
// work imbalance; rank 0 prints them.
static void par_report(par_run *pr) {
    const int64_t repeat = pr->repeat;
    const int rank = pr->rank, P = pr->P;
    double *times = pr->times;
    const mha_mpi_stats fs = pr->fs, bs = pr->bs;
    for (int64_t i = 1; i < repeat; i++)  // insertion sort: the median
        for (int64_t k = i; k > 0 && times[k] < times[k - 1]; k--) {
            const double t = times[k];
            times[k] = times[k - 1], times[k - 1] = t;
        }
    const double med = repeat % 2 ? times[repeat / 2]
                                  : 0.5 * (times[repeat / 2 - 1] + times[repeat / 2]);
    double mine[NS] = {fs.seconds + bs.seconds,
                       fs.comm_seconds + bs.comm_seconds,
                       fs.bytes_sent + bs.bytes_sent,
                       fs.bytes_model + bs.bytes_model,
                       (double)fs.heads,
                       (double)(fs.tiles + bs.tiles),
                       fs.wait_seconds + bs.wait_seconds};
    double *all = rank == 0 ? malloc(sizeof(double) * NS * (size_t)P) : NULL;
    MPI_Gather(mine, NS, MPI_DOUBLE, all, NS, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    if (rank == 0 && all) {
        double cmax = 0, csum = 0;
        for (int q = 0; q < P; q++) {
            const double comp = all[NS * q] - all[NS * q + 1];
            cmax = comp > cmax ? comp : cmax;
            csum += comp;
        }
        const double imb = csum > 0 ? cmax / (csum / P) : 1.0;
        par_print(pr, all, med, imb);
    }
    free(all);
}

int bench_parallel(const char *scheme, int64_t B, int64_t L, int64_t E, int64_t H, int64_t Hkv,
                   bool causal, bool backward, int64_t repeat, int64_t warmup, uint64_t seed,
                   bool json, int64_t kv_len) {
    int provided = 0;  // (OpenMP threads; only the main one calls MPI)
    MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided);
    int rank, P;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &P);
    int rc = 0;
    if (kv_len > 0) {  // --parallel kv --decode
        rc = bench_kv_decode(rank, P, B, L, E, H, Hkv, kv_len, repeat, warmup, seed, json);
        MPI_Finalize();
        return rc;
    }
    par_run pr = {.scheme = scheme,
                  .B = B,
                  .L = L,
                  .E = E,
                  .H = H,
                  .Hkv = Hkv,
                  .repeat = repeat,
                  .warmup = warmup,
                  .causal = causal,
                  .backward = backward,
                  .json = json,
                  .rank = rank,
                  .P = P};
    mha_status st = par_setup(&pr, seed);
    if (st) {
        if (rank == 0) cli_fail("bench", st);
        mha_module_destroy(pr.m);
        free(pr.x);
        MPI_Finalize();
        return 1;
    }
    par_inputs(&pr, seed);
    if ((st = par_time(&pr))) {
        if (rank == 0) cli_fail("bench", st);
        rc = 1;
    } else if (pr.times) {
        par_report(&pr);
    }
    free(pr.times);
    free(pr.x);
    free(pr.xl);
    mha_saved_destroy(pr.saved);
    mha_module_destroy(pr.g);
    mha_module_destroy(pr.m);
    MPI_Finalize();
    return rc;
}

#endif
