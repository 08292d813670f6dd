// mha_mpi.c: the MPI layer's public entry points (include/mha_mpi.h): the
// schemes' names, and mha_mpi_forward / mha_mpi_backward, which check a
// call's arguments and run its scheme: head parallelism (exact and fast,
// below) here, on the fused path's parts (plan.h: mha__part), Ulysses in
// ulysses.c, ring attention in ring.c. Sharded-KV decode is decode.c's,
// the helpers they share, and the agreement on errors, mpi_common.c's.
//
// Rank r of P owns the KV heads [Hkv r / P, Hkv (r+1) / P) and their query
// heads.
//   forward, exact:  its context columns (mha__part_forward) -> allgather ->
//                    every rank runs gates + W_O on the whole context
//                    (mha__part_out_project): the single-process bits
//   forward, fast:   its share ctx_r W_O[:, r]^T (+ bias on rank 0) ->
//                    MPI_Allreduce(SUM)
//   backward:        its heads' gradients (mha__part_backward; every
//                    parameter gradient is its rows/columns, the rest 0) ->
//                    MPI_Allreduce(SUM) of the parameter gradients (exact:
//                    one non-zero term per element); the input gradients:
//                    exact: the projections' gradients allgathered, then
//                    dX = dq W_Q ... on every rank (mha__part_input_grads);
//                    fast: the shares dq_r W_Q[r] ... summed by Allreduce.
#include <stdlib.h>
#include <string.h>

#include "mha_mpi.h"
#include "part.h"
#include "schemes.h"

const char *mha_parallel_name(mha_parallel p) {
    switch (p) {
    case MHA_PAR_HEADS: return "heads";
    case MHA_PAR_HEADS_FAST: return "heads-fast";
    case MHA_PAR_ULYSSES: return "ulysses";
    case MHA_PAR_RING: return "ring";
    }
    return "unknown";
}

mha_status mha_parallel_from_name(mha_parallel *out, const char *name) {
    if (!out || !name)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_parallel_from_name: NULL argument");
    if (!strcmp(name, "heads")) *out = MHA_PAR_HEADS;
    else if (!strcmp(name, "heads-fast")) *out = MHA_PAR_HEADS_FAST;
    else if (!strcmp(name, "ulysses")) *out = MHA_PAR_ULYSSES;
    else if (!strcmp(name, "ring")) *out = MHA_PAR_RING;
    else
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "unknown parallel scheme \"%.64s\" (available: heads, heads-fast, "
                         "ulysses, ring)",
                         name);
    return MHA_OK;
}

// full (R, W), row-major: rank q's columns [c0 + u g0_q, c0 + u g1_q) come
// from rank q, for every rank (allgather); u columns per KV head.
static mha_status allgather_cols(job *j, float *full, int64_t R, int64_t W, int64_t c0,
                                 int64_t u, const mha_module *m) {
    const int P = j->P;
    int64_t total = 0, g0, g1;
    for (int q = 0; q < P; q++) {  // (the same sizes on every rank)
        mha__mpi_kv_range(m, q, P, &g0, &g1);
        const int64_t n = R * u * (g1 - g0);
        if (n > INT32_MAX || total > INT32_MAX - n) return mha__mpi_too_big(n);
        total += n;
    }
    mha__mpi_kv_range(m, j->rank, P, &g0, &g1);
    int *counts = mha__malloc(sizeof(int) * (size_t)P * 2);
    float *send = mha__malloc(sizeof(float) * (size_t)(R * u * (g1 - g0) + 1));
    float *recv = mha__malloc(sizeof(float) * (size_t)(total + 1));
    mha_status st = MHA_OK;
    if (!counts || !send || !recv)
        st = mha__fail(MHA_ERR_NOMEM, "mha_mpi: out of memory for %lld floats of messages",
                       (long long)(2 * total));
    if ((st = mha__mpi_agree(j, st))) {  // (before the collective: any rank's failure is every rank's)
        free(counts), free(send), free(recv);
        return st;
    }
    for (int q = 0, at = 0; q < P; q++) {
        int64_t a0, a1;
        mha__mpi_kv_range(m, q, P, &a0, &a1);
        counts[q] = (int)(R * u * (a1 - a0));
        counts[P + q] = at;  // displacements
        at += counts[q];
    }
    const int64_t w = u * (g1 - g0), cm = c0 + u * g0;
    for (int64_t r = 0; r < R; r++)
        memcpy(send + r * w, full + r * W + cm, sizeof(float) * (size_t)w);
    const double t = MPI_Wtime();
    MPI_Allgatherv(send, counts[j->rank], MPI_FLOAT, recv, counts, counts + P, MPI_FLOAT,
                   j->comm);
    j->comm_s += MPI_Wtime() - t;
    j->sent += 4.0 * counts[j->rank] * (P - 1);
    for (int q = 0; q < P; q++) {
        mha__mpi_kv_range(m, q, P, &g0, &g1);
        const int64_t wq = u * (g1 - g0), cq = c0 + u * g0;
        const float *src = recv + counts[P + q];
        for (int64_t r = 0; r < R; r++)
            memcpy(full + r * W + cq, src + r * wq, sizeof(float) * (size_t)wq);
    }
    free(counts), free(send), free(recv);
    return MHA_OK;
}

static mha_status check_args(const mha_module *m, const mha_forward_args *a, mha_parallel s,
                             const mha_tensor *gout) {
    if (!m || !a || !a->query || !a->key || !a->value)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_mpi: NULL module, args or input");
    if (s != MHA_PAR_HEADS && s != MHA_PAR_HEADS_FAST && s != MHA_PAR_ULYSSES &&
        s != MHA_PAR_RING)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_mpi: unknown scheme %d", (int)s);
    if (a->need_weights)
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "mha_mpi: need_weights is not available across ranks (run the "
                         "single-process forward for the weights)");
    if (a->trace) return mha__fail(MHA_ERR_UNSUPPORTED, "mha_mpi: no trace across ranks");
    if (a->save && s != MHA_PAR_RING)
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "mha_mpi: a saved forward state (args.save) is kept by ring attention "
                         "only (%s recomputes its forward in the backward)",
                         mha_parallel_name(s));
    return mha__mpi_local_check(m, a, gout);  // (the shapes, before anything is sized from them)
}

mha_status mha_mpi_forward(MPI_Comm comm, mha_parallel scheme, mha_tensor *out,
                           const mha_module *m, const mha_forward_args *a,
                           mha_mpi_stats *stats) {
    job j;
    mha_status st = mha__mpi_job_init(&j, comm);
    if (st) return st;
    st = check_args(m, a, scheme, NULL);
    if (!st && !out) st = mha__fail(MHA_ERR_INVALID_ARG, "mha_mpi_forward: NULL output");
    if ((st = mha__mpi_agree(&j, st))) return st;
    const mha_config *c = mha_module_config(m);
    const int64_t E = c->embed_dim, Rq = mha__rows_of(a->query), n = Rq * E;
    mha__part pt = {.bias = j.rank == 0};
    mha__mpi_kv_range(m, j.rank, j.P, &pt.g0, &pt.g1);
    float *buf = mha__malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (!buf)
        st = mha__fail(MHA_ERR_NOMEM, "mha_mpi_forward: out of memory for %lld floats",
                       (long long)n);
    double model = 0;
    ring rg = {0};
    if (scheme == MHA_PAR_RING) {
        if (!(st = mha__mpi_agree(&j, st)))
            st = mha__mpi_ring_run(&j, out, NULL, NULL, NULL, NULL, m, a, NULL, &model, &rg);
    } else if (scheme == MHA_PAR_ULYSSES) {
        if (!(st = mha__mpi_agree(&j, st)))
            st = mha__mpi_ulysses_forward(&j, out, m, a, &model);
    } else if (scheme == MHA_PAR_HEADS) {
        if (!st) {
            memset(buf, 0, sizeof(float) * (size_t)(n > 0 ? n : 1));
            pt.out.ctx = buf;
            st = mha__part_forward(NULL, m, a, &pt);
        }
        if (!(st = mha__mpi_agree(&j, st))) {
            const int64_t G = c->num_heads / c->num_kv_heads, d = E / c->num_heads;
            st = allgather_cols(&j, buf, Rq, E, 0, G * d, m);
            model = 4.0 * (double)(Rq * G * d * (pt.g1 - pt.g0)) * (j.P - 1);
        }
        if (!(st = mha__mpi_agree(&j, st))) st = mha__part_out_project(out, m, a, buf);
    } else {
        mha_tensor t = mha_tensor_contiguous(buf, MHA_F32, out->ndim, out->shape);
        if (!st) st = mha__part_forward(&t, m, a, &pt);
        if (!(st = mha__mpi_agree(&j, st))) st = mha__mpi_allreduce(&j, buf, n);
        model = 4.0 * (double)n * 2.0 * (j.P - 1) / j.P;
        if (!(st = mha__mpi_agree(&j, st))) mha__mpi_view_xfer(out, buf, true, false);
    }
    st = mha__mpi_agree(&j, st);
    free(buf);
    mha__mpi_finish(&j, stats, m, model);
    if (scheme == MHA_PAR_RING) mha__mpi_ring_stats(stats, m, &rg);
    return st;
}

mha_status mha_mpi_backward(MPI_Comm comm, mha_parallel scheme, mha_tensor *gq, mha_tensor *gk,
                            mha_tensor *gv, mha_module *grads, const mha_module *m,
                            const mha_forward_args *a, const mha_tensor *gout, bool accumulate,
                            mha_mpi_stats *stats) {
    job j;
    mha_status st = mha__mpi_job_init(&j, comm);
    if (st) return st;
    st = check_args(m, a, scheme, gout);
    if ((st = mha__mpi_agree(&j, st))) return st;
    const mha_config *c = mha_module_config(m);
    const int64_t E = c->embed_dim, H = c->num_heads, G = H / c->num_kv_heads, d = E / H,
                  Ekv = c->num_kv_heads * d, Rq = mha__rows_of(a->query),
                  Rk = mha__rows_of(a->key);
    const mha_tensor *in[3] = {a->query, a->key, a->value};
    mha_tensor *go[3] = {gq, gk, gv};
    int64_t ng[3];
    for (int i = 0; i < 3; i++) ng[i] = go[i] ? mha_tensor_numel(in[i]) : 0;
    // per rank: its share of the input gradients (t[i]), the projections'
    // gradients (dq, dk, dv, dz) and the parameter gradients (gr)
    const int64_t nd = Rq * E + 2 * Rk * Ekv + Rq * H;
    float *t[3] = {NULL, NULL, NULL}, *dbuf = mha__malloc(sizeof(float) * (size_t)(nd + 1));
    for (int i = 0; i < 3; i++) t[i] = mha__malloc(sizeof(float) * (size_t)(ng[i] + 1));
    mha_module *gr = NULL;
    if (!dbuf || !t[0] || !t[1] || !t[2])
        st = mha__fail(MHA_ERR_NOMEM, "mha_mpi_backward: out of memory for %lld floats",
                       (long long)(nd + ng[0] + ng[1] + ng[2]));
    if (!st && grads) st = mha_module_create(&gr, c);
    double model = 0;
    mha__part pt = {.bias = j.rank == 0};
    mha__mpi_kv_range(m, j.rank, j.P, &pt.g0, &pt.g1);
    const bool ul = scheme == MHA_PAR_ULYSSES, rn = scheme == MHA_PAR_RING;
    ring rg = {0};
    mha_tensor tv[3];
    for (int i = 0; i < 3; i++)
        tv[i] = mha_tensor_contiguous(t[i], MHA_F32, in[i]->ndim, in[i]->shape);
    if (ul) {  // (the input gradients are done inside)
        if (!(st = mha__mpi_agree(&j, st)))
            st = mha__mpi_ulysses_backward(&j, gq, gk, gv, gr, m, a, gout, accumulate, &model);
    } else if (rn) {  // this rank's tokens' gradients (into t), every parameter's terms
        if (!(st = mha__mpi_agree(&j, st)))
            st = mha__mpi_ring_run(&j, NULL, gq ? &tv[0] : NULL, gk ? &tv[1] : NULL,
                                   gv ? &tv[2] : NULL, gr, m, a, gout, &model, &rg);
    } else if (!st) {
        memset(dbuf, 0, sizeof(float) * (size_t)(nd + 1));
        pt.out.dq = dbuf, pt.out.dk = dbuf + Rq * E, pt.out.dv = pt.out.dk + Rk * Ekv,
        pt.out.dz = pt.out.dv + Rk * Ekv;
        st = mha__part_backward(gq ? &tv[0] : NULL, gk ? &tv[1] : NULL, gv ? &tv[2] : NULL, gr,
                                m, a, gout, &pt);
    }
    // parameter gradients: one non-zero term per element, summed
    for (int i = 0; grads && i < mha_module_num_params(grads); i++) {
        mha_param p, q;
        if ((st = mha__mpi_agree(&j, st))) break;
        if ((st = mha_module_param_at(&q, gr, i)) || (st = mha_module_param_at(&p, grads, i)))
            continue;
        if ((st = mha__mpi_allreduce(&j, q.data, q.numel))) continue;
        model += 4.0 * (double)q.numel * 2.0 * (j.P - 1) / j.P;
        for (int64_t e = 0; e < p.numel; e++)
            p.data[e] = accumulate ? p.data[e] + q.data[e] : q.data[e];
    }
    if (!(st = mha__mpi_agree(&j, st)) && !ul && (gq || gk || gv)) {
        if (rn) {  // each rank's own tokens
            for (int i = 0; i < 3; i++)
                if (go[i]) mha__mpi_view_xfer(go[i], t[i], true, accumulate);
        } else if (scheme == MHA_PAR_HEADS) {
            // the projections' gradients, whole, then dX as one process does
            st = allgather_cols(&j, pt.out.dq, Rq, E, 0, G * d, m);
            if (!st) st = allgather_cols(&j, pt.out.dk, Rk, Ekv, 0, d, m);
            if (!st) st = allgather_cols(&j, pt.out.dv, Rk, Ekv, 0, d, m);
            if (!st && c->head_gate == MHA_GATE_DYNAMIC)
                st = allgather_cols(&j, pt.out.dz, Rq, H, 0, G, m);
            model += 4.0 * (double)((Rq * G * d + 2 * Rk * d) * (pt.g1 - pt.g0)) * (j.P - 1);
            // straight into the caller's views, in the backward's order
            if (!(st = mha__mpi_agree(&j, st)))
                st = mha__part_input_grads(gq, gk, gv, m, a, pt.out.dq, pt.out.dk, pt.out.dv,
                                           pt.out.dz, accumulate);
        } else {
            for (int i = 0; i < 3 && !st; i++)
                if (go[i])
                    st = mha__mpi_allreduce(&j, t[i], ng[i]),
                    model += 4.0 * (double)ng[i] * 2.0 * (j.P - 1) / j.P;
            if (!(st = mha__mpi_agree(&j, st)))
                for (int i = 0; i < 3; i++)
                    if (go[i]) mha__mpi_view_xfer(go[i], t[i], true, accumulate);
        }
    }
    st = mha__mpi_agree(&j, st);
    mha_module_destroy(gr);
    free(dbuf);
    for (int i = 0; i < 3; i++) free(t[i]);
    mha__mpi_finish(&j, stats, m, model);
    if (rn) mha__mpi_ring_stats(stats, m, &rg);
    return st;
}
