// decode.c: decoding with a sharded KV cache, mha_mpi_forward_cached
// (include/mha_mpi.h). Sharded-KV decode: partial attention per rank's
// cache, merged by log-sum-exp in rank order. Every rank projects the new
// tokens, the owner appends their keys and values to its cache, each rank
// attends them to its cache, and the partial contexts with their rows'
// max and sum are gathered and merged, then gates and W_O. It uses the
// shared helpers (mpi_common.c) and part.h, no other file of src/mpi.
#include <math.h>
#include <stdlib.h>

#include "mpi_internal.h"
#include "part.h"

// The call's arguments on this rank (the query's shape included), checked
// before anything is sized from them.
static mha_status cached_check(const mha_tensor *out, const mha_module *m,
                               const mha_forward_args *a, const mha_kv_cache *cache, int owner,
                               int P) {
    mha_status st = MHA_OK;
    if (!out || !m || !a || !a->query || !cache)
        st = mha__fail(MHA_ERR_INVALID_ARG, "mha_mpi_forward_cached: NULL argument");
    else if (owner < 0 || owner >= P)
        st = mha__fail(MHA_ERR_INVALID_ARG,
                       "mha_mpi_forward_cached: owner %d is not a rank "
                       "(0..%d)",
                       owner, P - 1);
    else if (a->opts.window_left >= 0 || a->opts.window_right >= 0 || a->opts.alibi)
        st = mha__fail(MHA_ERR_UNSUPPORTED,
                       "mha_mpi_forward_cached: windows and ALiBi need the keys' global "
                       "positions, which a sharded cache does not keep");
    else if (a->query->dtype != MHA_F32 || out->dtype != MHA_F32)
        st = mha__fail(MHA_ERR_DTYPE,
                       "mha_mpi_forward_cached: float32 query and output, got %s "
                       "and %s",
                       mha_dtype_name(a->query->dtype), mha_dtype_name(out->dtype));
    else if (a->query->ndim < 2)
        st = mha__fail(MHA_ERR_SHAPE,
                       "mha_mpi_forward_cached: query (T, N, E), (N, T, E) or "
                       "(T, E), got %d dims",
                       a->query->ndim);
    if (!st) {  // the query's shape, before anything is sized from it
        mha_forward_args aq = *a;
        aq.key = aq.value = a->query;
        st = mha__mpi_local_check(m, &aq, NULL);
    }
    return st;
}

// Step 4's merge: the ranks' partial contexts and rows' stats (all: P
// messages of nmsg floats, each a context (R, E) then (max, sum) per (b, h,
// t)) merged by log-sum-exp in rank order, in double (u: d doubles), into
// q (R, E), the merged context.
static void cached_merge(float *q, double *u, const float *all, size_t nmsg,
                         const mha_module *m, int P, int64_t N, int64_t T, int64_t R,
                         bool seq_first) {
    const mha_config *c = mha_module_config(m);
    const int64_t E = c->embed_dim, H = c->num_heads, d = E / H;
    for (int64_t b = 0; b < N; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++) {
                const int64_t row = seq_first ? t * N + b : b * T + t,
                              sk = 2 * ((b * H + h) * T + t);
                double M = -INFINITY, Ls = 0.0;
                for (int r = 0; r < P; r++) {
                    const float *sr = all + (size_t)r * nmsg + R * E + sk;
                    if (sr[1] > 0.0f && sr[0] > M) M = sr[0];
                }
                float *o = q + row * E + h * d;  // (q is spent: the merged context)
                for (int64_t e = 0; e < d; e++) o[e] = 0.0f;
                if (M == -INFINITY || mha_module_head_pruned(m, h)) continue;
                for (int64_t e = 0; e < d; e++) u[e] = 0.0;
                for (int r = 0; r < P; r++) {
                    const float *pr = all + (size_t)r * nmsg, *sr = pr + R * E + sk;
                    if (!(sr[1] > 0.0f)) continue;
                    const double w = exp((double)sr[0] - M) / (double)sr[1];  // e^(m-M) l
                    Ls += w;
                    for (int64_t e = 0; e < d; e++) u[e] += w * pr[row * E + h * d + e];
                }
                for (int64_t e = 0; e < d; e++) o[e] = (float)(u[e] / Ls);
            }
}

mha_status mha_mpi_forward_cached(MPI_Comm comm, mha_tensor *out, const mha_module *m,
                                  const mha_forward_args *a, mha_kv_cache *cache, int owner,
                                  mha_mpi_stats *stats) {
    job j;
    mha_status st = mha__mpi_job_init(&j, comm);
    if (st) return st;
    const int P = j.P, me = j.rank;
    st = cached_check(out, m, a, cache, owner, P);
    if ((st = mha__mpi_agree(&j, st))) return st;
    const mha_config *c = mha_module_config(m);
    const int64_t E = c->embed_dim, H = c->num_heads, d = E / H, Hkv = c->num_kv_heads,
                  Ekv = Hkv * d, R = mha__rows_of(a->query);
    const bool seq_first = a->query->ndim == 2 || !c->batch_first;
    const int64_t N = a->query->ndim == 3 ? a->query->shape[seq_first ? 1 : 0] : 1,
                  T = a->query->shape[seq_first ? 0 : 1];
    int64_t cB, cH, cD, cDv;
    mha__kv_cache_dims(cache, &cB, &cH, &cD, &cDv);
    if (cB != N || cH != Hkv || cD != d || cDv != d)
        st = mha__fail(MHA_ERR_SHAPE,
                       "mha_mpi_forward_cached: the cache holds batch %lld, %lld KV heads of "
                       "dims %lld/%lld; this module and query need batch %lld, %lld KV heads "
                       "of dim %lld",
                       (long long)cB, (long long)cH, (long long)cD, (long long)cDv,
                       (long long)N, (long long)Hkv, (long long)d);
    const size_t nmsg = (size_t)(R * E + 2 * N * H * T);  // a rank's context and row stats
    float *buf = mha__malloc(sizeof(float) *
                             ((size_t)(R * E + 2 * R * Ekv) + nmsg * (size_t)(P + 1) + 1));
    int64_t *len = mha__malloc(sizeof(int64_t) * (size_t)(2 * N + 1) +
                               sizeof(double) * (size_t)d),
            *glen = len + N;
    if (!st && (!buf || !len))
        st = mha__fail(MHA_ERR_NOMEM, "mha_mpi_forward_cached: out of memory for %zu floats",
                       nmsg * (size_t)(P + 1));
    if (!st && nmsg * (size_t)P > INT32_MAX)
        st = mha__mpi_too_big((int64_t)(nmsg * (size_t)P));
    if ((st = mha__mpi_agree(&j, st))) {
        free(buf), free(len);
        return st;
    }
    float *q = buf, *k = q + R * E, *v = k + R * Ekv, *mine = v + R * Ekv, *all = mine + nmsg;
    double *u = (double *)(len + 2 * N);  // (d doubles: a row's merged context)
    // 1. the sequences' global lengths; every rank projects the new tokens
    //    (RoPE at those positions)
    for (int64_t n = 0; n < N; n++) len[n] = mha_kv_cache_length(cache, n);
    double t0 = MPI_Wtime();
    MPI_Allreduce(len, glen, (int)N, MPI_INT64_T, MPI_SUM, comm);
    j.comm_s += MPI_Wtime() - t0;
    mha_forward_args al = *a;
    al.key = al.value = a->query;
    al.opts.is_causal = false;
    al.rope_start = glen;
    mha__part pj = {.g0 = 0, .g1 = Hkv, .proj.q_out = q, .proj.k_out = k, .proj.v_out = v};
    st = mha__part_forward(NULL, m, &al, &pj);
    // 2. the owner appends the keys and values
    const int64_t ns = seq_first ? 1 : T, ts = seq_first ? N : 1;
    mha_tensor kv = {k, MHA_F32, 4, {N, Hkv, T, d}, {ns * Ekv, d, ts * Ekv, 1}}, vv = kv;
    vv.data = v;
    bool appended = false;
    if (!st && me == owner) appended = !(st = mha_kv_cache_append(cache, &kv, &vv, NULL));
    // 3. every rank's part: its cache (the owner's causal within the chunk)
    if (!(st = mha__mpi_agree(&j, st))) {
        mha_tensor qv = {q, MHA_F32, 4, {N, H, T, d}, {ns * E, d, ts * E, 1}},
                   cv = {mine, MHA_F32, 4, {N, H, T, d}, {ns * E, d, ts * E, 1}};
        mha_cache_attend_args ca;
        mha_cache_attend_args_init(&ca);
        ca.opts.softcap = a->opts.softcap;
        ca.opts.scale = a->opts.scale;
        st = mha__kv_cache_attend_ex(&cv, &qv, cache, &ca, NULL, me == owner ? 0 : T,
                                     mine + R * E);
    }
    // 4. gathered, merged in rank order, W_O
    if (!(st = mha__mpi_agree(&j, st))) {
        t0 = MPI_Wtime();
        MPI_Allgather(mine, (int)nmsg, MPI_FLOAT, all, (int)nmsg, MPI_FLOAT, comm);
        j.comm_s += MPI_Wtime() - t0;
        j.sent += 4.0 * (double)nmsg * (P - 1);
        cached_merge(q, u, all, nmsg, m, P, N, T, R, seq_first);
        st = mha__part_out_project(out, m, a, q);
    }
    st = mha__mpi_agree(&j, st);
    if (st && appended)  // the owner's cache as it was
        for (int64_t n = 0; n < N; n++)
            if (mha_kv_cache_truncate(cache, n, len[n])) break;  // (cannot fail)
    free(buf), free(len);
    mha__mpi_finish(&j, stats, m, 4.0 * (double)nmsg * (P - 1));
    if (stats) {
        stats->heads = H;
        stats->kv_head_begin = 0, stats->kv_head_end = Hkv;
    }
    return st;
}
