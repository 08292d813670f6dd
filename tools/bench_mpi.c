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
    mha_init_options_default(&io);
    io.seed = seed;
    if (!st) st = mha_module_init(m, &io);
    if (!st) st = mha_kv_cache_create(&kc, B, Hkv, d, d, share + T);
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
                   vt = mha_tensor_contiguous(kv + nkv, MHA_F32, 4, (int64_t[]){B, Hkv, share, d});
        st = mha_kv_cache_append(kc, &kt, &vt, NULL);
    }
    MPI_Bcast(x, (int)nx, MPI_FLOAT, 0, MPI_COMM_WORLD);  // the same new tokens everywhere
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){B, T, E}),
               yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){B, T, E});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.is_causal = true;
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
                   "%lld, \"num_kv_heads\": %lld, \"median_ms\": %.4f}\n", P, (long long)B,
                   (long long)T, (long long)kv_len, (long long)E, (long long)H, (long long)Hkv, med);
        } else if (rank == 0) {
            printf("mha bench --parallel kv --decode: %d ranks, batch %lld, %lld new token%s over "
                   "a cache of %lld tokens sharded evenly (%lld per rank), embed_dim %lld, heads "
                   "%lld (KV %lld)\n", P, (long long)B, (long long)T, T == 1 ? "" : "s",
                   (long long)kv_len, (long long)(kv_len / P), (long long)E, (long long)H,
                   (long long)Hkv);
            printf("  time       median %.4f ms per step (the slowest rank, %lld runs after %lld "
                   "warm-up)\n", med, (long long)repeat, (long long)warmup);
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
    mha_parallel par;
    mha_status st = mha_parallel_from_name(&par, scheme);
    mha_config c;
    mha_config_init(&c, E, H);
    c.num_kv_heads = Hkv;
    c.batch_first = true;
    mha_module *m = NULL, *g = NULL;
    if (!st) st = mha_module_create(&m, &c);
    mha_init_options io;
    mha_init_options_default(&io);
    io.seed = seed;
    if (!st) st = mha_module_init(m, &io);
    if (!st && backward) st = mha_module_create(&g, &c);
    const int64_t n = B * L * E;
    float *x = malloc(sizeof(float) * (size_t)n * 4), *y = x + n, *gy = y + n, *gx = gy + n;
    if (!x) st = MHA_ERR_NOMEM;
    if (st) {
        if (rank == 0) cli_fail("bench", st);
        mha_module_destroy(m);
        free(x);
        MPI_Finalize();
        return 1;
    }
    uint64_t s = seed * 2654435761u + 1;
    for (int64_t i = 0; i < n; i++) x[i] = urand(&s), gy[i] = urand(&s);
    // the whole tensors (heads), this rank's block of tokens (ulysses) or
    // its zigzag chunks (ring: copies)
    const bool shard = par == MHA_PAR_ULYSSES;
    const int64_t t0 = shard ? L * rank / P : 0,
                  t1 = shard ? L * (rank + 1) / P : L;
    const int64_t sh[3] = {B, t1 - t0, E}, str[3] = {L * E, E, 1};
    mha_tensor xt = {x + t0 * E, MHA_F32, 3, {sh[0], sh[1], sh[2]}, {str[0], str[1], str[2]}};
    mha_tensor yt = xt, gyt = xt, gxt = xt;
    yt.data = y + t0 * E, gyt.data = gy + t0 * E, gxt.data = gx + t0 * E;
    float *xl = NULL;
    if (par == MHA_PAR_RING) {
        int64_t cs[2], cl[2];
        mha_mpi_ring_chunks(L, P, rank, cs, cl);
        const int64_t Lr = cl[0] + cl[1];
        xl = malloc(sizeof(float) * (size_t)(4 * B * Lr * E + 1));
        for (int64_t b = 0; xl && b < B; b++)
            for (int c2 = 0; c2 < 2; c2++) {
                const int64_t lt = c2 ? cl[0] : 0;
                memcpy(xl + (b * Lr + lt) * E, x + (b * L + cs[c2]) * E,
                       sizeof(float) * (size_t)(cl[c2] * E));
                memcpy(xl + 2 * B * Lr * E + (b * Lr + lt) * E, gy + (b * L + cs[c2]) * E,
                       sizeof(float) * (size_t)(cl[c2] * E));
            }
        xt = mha_tensor_contiguous(xl ? xl : x, MHA_F32, 3, (int64_t[]){B, Lr, E});
        yt = gyt = gxt = xt;
        if (xl) yt.data = xl + B * Lr * E, gyt.data = xl + 2 * B * Lr * E, gxt.data = xl + 3 * B * Lr * E;
    }
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.is_causal = causal;
    // ring keeps its forward for the backward (as the single-process bench
    // does); the other schemes recompute it
    mha_saved *saved = NULL;
    if (backward && par == MHA_PAR_RING && !mha_saved_create(&saved)) a.save = saved;
    double *times = malloc(sizeof(double) * (size_t)repeat);
    mha_mpi_stats fs = {0}, bs = {0};
    for (int64_t i = 0; !st && i < warmup + repeat; i++) {
        MPI_Barrier(MPI_COMM_WORLD);
        const double t = MPI_Wtime();
        st = mha_mpi_forward(MPI_COMM_WORLD, par, &yt, m, &a, &fs);
        if (!st && backward)
            st = mha_mpi_backward(MPI_COMM_WORLD, par, &gxt, NULL, NULL, g, m, &a, &gyt, false,
                                  &bs);
        double dt = MPI_Wtime() - t, mx;
        MPI_Allreduce(&dt, &mx, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (i >= warmup && times) times[i - warmup] = mx * 1e3;
    }
    if (st) {
        if (rank == 0) cli_fail("bench", st);
        rc = 1;
    } else if (times) {
        for (int64_t i = 1; i < repeat; i++)  // insertion sort: the median
            for (int64_t k = i; k > 0 && times[k] < times[k - 1]; k--) {
                const double t = times[k];
                times[k] = times[k - 1], times[k - 1] = t;
            }
        const double med = repeat % 2 ? times[repeat / 2]
                                      : 0.5 * (times[repeat / 2 - 1] + times[repeat / 2]);
        // per rank: seconds, MPI seconds, bytes, model bytes, heads, score
        // tiles, seconds waiting for the ring's messages (forward + backward)
        enum { NS = 7 };
        double mine[NS] = {fs.seconds + bs.seconds, fs.comm_seconds + bs.comm_seconds,
                           fs.bytes_sent + bs.bytes_sent, fs.bytes_model + bs.bytes_model,
                           (double)fs.heads, (double)(fs.tiles + bs.tiles),
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
            if (json) {
                printf("{\"what\": \"mha_parallel\", \"scheme\": \"%s\", \"ranks\": %d, \"batch\": "
                       "%lld, \"seq\": %lld, \"embed_dim\": %lld, \"num_heads\": %lld, "
                       "\"num_kv_heads\": %lld, \"causal\": %s, \"backward\": %s, \"median_ms\": "
                       "%.4f, \"imbalance\": %.4f, \"ranks_detail\": [", scheme, P, (long long)B,
                       (long long)L, (long long)E, (long long)H, (long long)Hkv,
                       causal ? "true" : "false", backward ? "true" : "false", med, imb);
                for (int q = 0; q < P; q++)
                    printf("%s{\"rank\": %d, \"ms\": %.4f, \"mpi_ms\": %.4f, \"bytes_sent\": %.0f, "
                           "\"bytes_model\": %.0f, \"heads\": %.0f, \"tiles\": %.0f, \"wait_ms\": %.4f}",
                           q ? ", " : "", q, all[NS * q] * 1e3, all[NS * q + 1] * 1e3,
                           all[NS * q + 2], all[NS * q + 3], all[NS * q + 4], all[NS * q + 5],
                           all[NS * q + 6] * 1e3);
                printf("]}\n");
            } else {
                printf("mha bench --parallel %s: %d ranks, batch %lld, seq %lld, embed_dim %lld, "
                       "heads %lld (KV %lld)%s, %s\n", scheme, P, (long long)B, (long long)L,
                       (long long)E, (long long)H, (long long)Hkv, causal ? ", causal" : "",
                       backward ? "forward + backward" : "forward");
                printf("  time       median %.3f ms (the slowest rank per call, %lld runs after "
                       "%lld warm-up)\n", med, (long long)repeat, (long long)warmup);
                printf("  imbalance  %.3f (the slowest rank's compute time over the mean)\n", imb);
                for (int q = 0; q < P; q++)
                    printf("  rank %-3d   %.3f ms, %.3f ms inside MPI (%.3f ms waiting for ring "
                           "messages), %.3f MB sent (model %.3f MB), %.0f heads, %.0f score "
                           "tiles\n", q, all[NS * q] * 1e3, all[NS * q + 1] * 1e3,
                           all[NS * q + 6] * 1e3, all[NS * q + 2] * 1e-6, all[NS * q + 3] * 1e-6,
                           all[NS * q + 4], all[NS * q + 5]);
            }
        }
        free(all);
    }
    free(times);
    free(x);
    free(xl);
    mha_saved_destroy(saved);
    mha_module_destroy(g);
    mha_module_destroy(m);
    MPI_Finalize();
    return rc;
}

#endif
