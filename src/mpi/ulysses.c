// ulysses.c: Ulysses sequence parallelism (DeepSpeed-Ulysses; MHA_PAR_ULYSSES
// in include/mha_mpi.h). Ulysses: sequence shards, all-to-all between token
// owners and head owners. Forward: each rank projects its tokens (every
// head), an all-to-all hands every rank the whole sequence of its heads, it
// attends, and an all-to-all brings the context back to the token owners
// for W_O. Backward: the inputs and the output gradient gathered, its
// heads' backward over the whole sequence, the projections' gradients back
// to the token owners by all-to-all, dX there. Entered from mha_mpi.c; uses
// the shared helpers (mpi_common.c) and part.h, no other file of src/mpi.
#include <stdlib.h>
#include <string.h>

#include "part.h"
#include "schemes.h"

static int64_t seq_rows(const seq *s, int q) { return (s->t0[q + 1] - s->t0[q]) * s->N; }

// The global row of rank q's local row lr.
static int64_t seq_grow(const seq *s, int q, int64_t lr) {
    const int64_t Tl = s->t0[q + 1] - s->t0[q];
    if (s->seq_first) return (s->t0[q] + lr / s->N) * s->N + lr % s->N;
    return (lr / Tl) * s->T + s->t0[q] + lr % Tl;
}

// dir 0 (to the head owners): src (Rl_me, W) my tokens, every column ->
// dst (R, W) every token, my columns. dir 1 (back to the token owners):
// src (R, W) my columns -> dst (Rl_me, W) every column. Rank q's columns:
// [c0 + u g0_q, c0 + u g1_q).
static mha_status alltoall(job *j, const seq *sq, int dir, const float *src, float *dst,
                           int64_t W, int64_t u, const mha_module *m) {
    const int P = j->P, me = j->rank;
    int64_t g0, g1;
    mha__mpi_kv_range(m, me, P, &g0, &g1);
    const int64_t wme = u * (g1 - g0), cme = u * g0, Rme = seq_rows(sq, me);
    // my message sizes (they differ between ranks: agreed below, with the
    // allocations, before the collective)
    int64_t ns = 0, nr = 0, big = 0;
    for (int q = 0; q < P && !big; q++) {
        int64_t a0, a1;
        mha__mpi_kv_range(m, q, P, &a0, &a1);
        const int64_t wq = u * (a1 - a0), Rq = seq_rows(sq, q);
        const int64_t s_n = dir ? Rq * wme : Rme * wq, r_n = dir ? Rme * wq : Rq * wme;
        if (s_n > INT32_MAX || r_n > INT32_MAX || ns > INT32_MAX - s_n || nr > INT32_MAX - r_n)
            big = s_n > r_n ? s_n : r_n;
        ns += s_n, nr += r_n;
    }
    int *cnt = NULL;
    float *sb = NULL, *rb = NULL;
    mha_status st = MHA_OK;
    if (big) {
        st = mha__mpi_too_big(big);
    } else {
        cnt = mha__malloc(sizeof(int) * (size_t)P * 4);
        sb = mha__malloc(sizeof(float) * (size_t)(ns + 1));
        rb = mha__malloc(sizeof(float) * (size_t)(nr + 1));
        if (!cnt || !sb || !rb)
            st = mha__fail(MHA_ERR_NOMEM, "mha_mpi: out of memory for %lld floats of messages",
                           (long long)(ns + nr));
    }
    if ((st = mha__mpi_agree(j, st))) {
        free(cnt), free(sb), free(rb);
        return st;
    }
    ns = nr = 0;
    for (int q = 0; q < P; q++) {
        int64_t a0, a1;
        mha__mpi_kv_range(m, q, P, &a0, &a1);
        const int64_t wq = u * (a1 - a0), Rq = seq_rows(sq, q);
        const int64_t s_n = dir ? Rq * wme : Rme * wq, r_n = dir ? Rme * wq : Rq * wme;
        cnt[q] = (int)s_n, cnt[P + q] = (int)ns, cnt[2 * P + q] = (int)r_n,
        cnt[3 * P + q] = (int)nr;
        ns += s_n, nr += r_n;
    }
    for (int q = 0; q < P; q++) {  // pack
        int64_t a0, a1;
        mha__mpi_kv_range(m, q, P, &a0, &a1);
        const int64_t wq = u * (a1 - a0), cq = u * a0;
        float *o = sb + cnt[P + q];
        if (!dir)
            for (int64_t r = 0; r < Rme; r++, o += wq)
                memcpy(o, src + r * W + cq, sizeof(float) * (size_t)wq);
        else
            for (int64_t r = 0; r < seq_rows(sq, q); r++, o += wme)
                memcpy(o, src + seq_grow(sq, q, r) * W + cme, sizeof(float) * (size_t)wme);
    }
    const double t = MPI_Wtime();
    MPI_Alltoallv(sb, cnt, cnt + P, MPI_FLOAT, rb, cnt + 2 * P, cnt + 3 * P, MPI_FLOAT, j->comm);
    j->comm_s += MPI_Wtime() - t;
    j->sent += 4.0 * (double)(ns - cnt[me]);
    for (int q = 0; q < P; q++) {  // unpack
        int64_t a0, a1;
        mha__mpi_kv_range(m, q, P, &a0, &a1);
        const int64_t wq = u * (a1 - a0), cq = u * a0;
        const float *i = rb + cnt[3 * P + q];
        if (!dir)
            for (int64_t r = 0; r < seq_rows(sq, q); r++, i += wme)
                memcpy(dst + seq_grow(sq, q, r) * W + cme, i, sizeof(float) * (size_t)wme);
        else
            for (int64_t r = 0; r < Rme; r++, i += wq)
                memcpy(dst + r * W + cq, i, sizeof(float) * (size_t)wq);
    }
    free(cnt), free(sb), free(rb);
    return MHA_OK;
}

// Every token's rows of a local view, gathered: full (R, F) in the global
// row order, float32.
static mha_status allgather_rows(job *j, const seq *sq, const mha_tensor *t, float *full) {
    const int P = j->P;
    const int64_t F = t->shape[t->ndim - 1], Rme = seq_rows(sq, j->rank);
    int64_t n = 0;
    for (int q = 0; q < P; q++) {  // (the same sizes on every rank)
        const int64_t c = seq_rows(sq, q) * F;
        if (c > INT32_MAX || n > INT32_MAX - c) return mha__mpi_too_big(c);
        n += c;
    }
    int *cnt = mha__malloc(sizeof(int) * (size_t)P * 2);
    float *loc = mha__malloc(sizeof(float) * (size_t)(Rme * F + 1)),
          *rb = mha__malloc(sizeof(float) * (size_t)(sq->T * sq->N * F + 1));
    mha_status st = MHA_OK;
    if (!cnt || !loc || !rb)
        st = mha__fail(MHA_ERR_NOMEM, "mha_mpi: out of memory for %lld floats", (long long)n);
    if ((st = mha__mpi_agree(j, st))) {  // (before the collective)
        free(cnt), free(loc), free(rb);
        return st;
    }
    n = 0;
    for (int q = 0; q < P; q++) {
        const int64_t c = seq_rows(sq, q) * F;
        cnt[q] = (int)c, cnt[P + q] = (int)n;
        n += c;
    }
    mha__mpi_view_xfer(t, loc, false, false);  // the local view's rows, in row order
    const double tm = MPI_Wtime();
    MPI_Allgatherv(loc, cnt[j->rank], MPI_FLOAT, rb, cnt, cnt + P, MPI_FLOAT, j->comm);
    j->comm_s += MPI_Wtime() - tm;
    j->sent += 4.0 * cnt[j->rank] * (P - 1);
    for (int q = 0; q < P; q++)
        for (int64_t r = 0; r < seq_rows(sq, q); r++)
            memcpy(full + seq_grow(sq, q, r) * F, rb + cnt[P + q] + r * F,
                   sizeof(float) * (size_t)F);
    free(cnt), free(loc), free(rb);
    return MHA_OK;
}

// A contiguous float32 view of the whole sequence in the layout of the
// local view t (data may be a stand-in that is never read).
static mha_tensor whole_view(const mha_tensor *t, const seq *sq, bool batch_first, void *data) {
    int64_t sh[3];
    for (int i = 0; i < t->ndim; i++) sh[i] = t->shape[i];
    sh[t->ndim == 2 || !batch_first ? 0 : 1] = sq->T;
    return mha_tensor_contiguous(data, MHA_F32, t->ndim, sh);
}

// The local arguments: no masks (they are whole), RoPE at the shard's
// global positions (starts: N entries).
static void local_args(mha_forward_args *al, const mha_forward_args *a, const seq *sq,
                       int rank, int64_t *starts) {
    *al = *a;
    al->key_padding_mask = NULL;
    al->attn_mask = NULL;
    al->opts.is_causal = false;
    al->opts.window_left = al->opts.window_right = -1;
    al->opts.alibi = false;
    for (int64_t n = 0; n < sq->N; n++)
        starts[n] = (a->rope_start ? a->rope_start[n] : 0) + sq->t0[rank];
    al->rope_start = starts;
}

mha_status mha__mpi_ulysses_forward(job *j, mha_tensor *out, const mha_module *m,
                                    const mha_forward_args *a, double *model) {
    const mha_config *c = mha_module_config(m);
    const int64_t E = c->embed_dim, H = c->num_heads, G = H / c->num_kv_heads, d = E / H,
                  Ekv = c->num_kv_heads * d;
    const bool self = a->key == a->query && a->value == a->query;
    seq sq = {0}, sk = {0};
    mha_status st = mha__mpi_shards_of(j, &sq, &sk, m, a, false);
    if (st) return st;
    const int64_t Rl = seq_rows(&sq, j->rank), Rkl = seq_rows(&sk, j->rank), R = sq.T * sq.N,
                  Rk = sk.T * sk.N;
    const size_t nf = (size_t)(Rl * E + 2 * Rkl * Ekv + R * E + 2 * Rk * Ekv + R * E + Rl * E);
    float *buf = mha__malloc(sizeof(float) * (nf + 1));
    int64_t *starts = mha__malloc(sizeof(int64_t) * (size_t)(sq.N + 1));
    if (!buf || !starts)
        st = mha__fail(MHA_ERR_NOMEM, "mha_mpi ulysses: out of memory for %zu floats", nf);
    float *ql = buf, *kl = ql + Rl * E, *vl = kl + Rkl * Ekv, *qf = vl + Rkl * Ekv,
          *kf = qf + R * E, *vf = kf + Rk * Ekv, *cf = vf + Rk * Ekv, *cl = cf + R * E;
    mha_forward_args al;
    if (!st) {  // 1. my tokens' projections, every head
        local_args(&al, a, &sq, j->rank, starts);
        mha__part pj = {
            .g0 = 0, .g1 = c->num_kv_heads, .proj.q_out = ql, .proj.k_out = kl, .proj.v_out = vl};
        st = mha__part_forward(NULL, m, &al, &pj);
    }
    // 2. to the head owners
    if (!(st = mha__mpi_agree(j, st))) st = alltoall(j, &sq, 0, ql, qf, E, G * d, m);
    if (!st) st = alltoall(j, &sk, 0, kl, kf, Ekv, d, m);
    if (!st) st = alltoall(j, &sk, 0, vl, vf, Ekv, d, m);
    int64_t g0, g1;
    mha__mpi_kv_range(m, j->rank, j->P, &g0, &g1);
    // (each all-to-all keeps 1/P of its data on the rank: q, k, v out, the
    // context of my heads back)
    *model = 4.0 * ((double)(Rl * E + 2 * Rkl * Ekv) + (double)(R * E) / j->P) * (j->P - 1) /
             j->P;
    if (!(st = mha__mpi_agree(j, st))) {  // 3. my heads, the whole sequence
        memset(cf, 0, sizeof(float) * (size_t)(R * E));
        mha_tensor qv = whole_view(a->query, &sq, c->batch_first, qf),
                   kv = whole_view(a->key, &sk, c->batch_first, kf),
                   vv = whole_view(a->value, &sk, c->batch_first, vf);
        mha_forward_args af = *a;
        af.query = &qv;
        af.key = self ? &qv : &kv;
        af.value = self ? &qv : &vv;
        mha__part pa = {
            .g0 = g0, .g1 = g1, .out.ctx = cf, .proj.q_in = qf, .proj.k_in = kf, .proj.v_in = vf};
        st = mha__part_forward(NULL, m, &af, &pa);
    }
    // 4. back to the token owners, 5. W_O on my tokens
    if (!(st = mha__mpi_agree(j, st))) st = alltoall(j, &sq, 1, cf, cl, E, G * d, m);
    if (!(st = mha__mpi_agree(j, st))) st = mha__part_out_project(out, m, &al, cl);
    free(buf), free(starts), free(sq.t0), free(sk.t0);
    return st;
}

mha_status mha__mpi_ulysses_backward(job *j, mha_tensor *gq, mha_tensor *gk, mha_tensor *gv,
                                     mha_module *gr, const mha_module *m,
                                     const mha_forward_args *a, const mha_tensor *gout,
                                     bool accumulate, double *model) {
    const mha_config *c = mha_module_config(m);
    const int64_t E = c->embed_dim, H = c->num_heads, G = H / c->num_kv_heads, d = E / H,
                  Ekv = c->num_kv_heads * d, kd = c->kdim, vd = c->vdim;
    const bool self = a->key == a->query && a->value == a->query;
    seq sq = {0}, sk = {0};
    mha_status st = mha__mpi_shards_of(j, &sq, &sk, m, a, false);
    if (st) return st;
    const int64_t Rl = seq_rows(&sq, j->rank), Rkl = seq_rows(&sk, j->rank), R = sq.T * sq.N,
                  Rk = sk.T * sk.N;
    const size_t nf = (size_t)(2 * R * E + (self ? 0 : Rk * (kd + vd)) + R * E + 2 * Rk * Ekv +
                               R * H + Rl * E + 2 * Rkl * Ekv + Rl * H);
    float *buf = mha__malloc(sizeof(float) * (nf + 1));
    int64_t *starts = mha__malloc(sizeof(int64_t) * (size_t)(sq.N + 1));
    if (!buf || !starts)
        st = mha__fail(MHA_ERR_NOMEM, "mha_mpi ulysses: out of memory for %zu floats", nf);
    float *xq = buf, *gy = xq + R * E, *xk = gy + R * E, *xv = self ? xk : xk + Rk * kd,
          *dqf = self ? xk : xv + Rk * vd, *dkf = dqf + R * E, *dvf = dkf + Rk * Ekv,
          *dzf = dvf + Rk * Ekv, *dql = dzf + R * H, *dkl = dql + Rl * E,
          *dvl = dkl + Rkl * Ekv, *dzl = dvl + Rkl * Ekv;
    // 1. the whole inputs and output gradient (the weight gradients sum over
    //    every token in one order)
    if (!(st = mha__mpi_agree(j, st))) st = allgather_rows(j, &sq, a->query, xq);
    if (!st) st = allgather_rows(j, &sq, gout, gy);
    if (!st && !self) st = allgather_rows(j, &sk, a->key, xk);
    if (!st && !self) st = allgather_rows(j, &sk, a->value, xv);
    *model = 4.0 * (double)((Rl * 2 * E + (self ? 0 : Rkl * (kd + vd))) * (j->P - 1));
    int64_t g0, g1;
    mha__mpi_kv_range(m, j->rank, j->P, &g0, &g1);
    if (!(st = mha__mpi_agree(j, st))) {  // 2. my heads' backward over the whole sequence
        memset(dqf, 0, sizeof(float) * (size_t)(R * E + 2 * Rk * Ekv + R * H));
        mha_tensor qv = whole_view(a->query, &sq, c->batch_first, xq),
                   kv = whole_view(a->key, &sk, c->batch_first, xk),
                   vv = whole_view(a->value, &sk, c->batch_first, xv),
                   gyv = whole_view(gout, &sq, c->batch_first, gy);
        mha_forward_args af = *a;
        af.query = &qv;
        af.key = self ? &qv : &kv;
        af.value = self ? &qv : &vv;
        mha__part pb = {.g0 = g0,
                        .g1 = g1,
                        .bias = j->rank == 0,
                        .out.dq = dqf,
                        .out.dk = dkf,
                        .out.dv = dvf,
                        .out.dz = dzf};
        st = mha__part_backward(NULL, NULL, NULL, gr, m, &af, &gyv, &pb);
    }
    // 3. the projections' gradients back to the token owners, 4. dX there
    if (!(st = mha__mpi_agree(j, st)) && (gq || gk || gv)) {
        st = alltoall(j, &sq, 1, dqf, dql, E, G * d, m);
        if (!st) st = alltoall(j, &sk, 1, dkf, dkl, Ekv, d, m);
        if (!st) st = alltoall(j, &sk, 1, dvf, dvl, Ekv, d, m);
        if (!st && c->head_gate == MHA_GATE_DYNAMIC)
            st = alltoall(j, &sq, 1, dzf, dzl, H, G, m);
        *model += 4.0 * (double)(R * E + 2 * Rk * Ekv) / j->P * (j->P - 1) / j->P;
        if (!(st = mha__mpi_agree(j, st))) {
            mha_forward_args al;
            local_args(&al, a, &sq, j->rank, starts);
            st = mha__part_input_grads(gq, gk, gv, m, &al, dql, dkl, dvl, dzl, accumulate);
        }
    }
    free(buf), free(starts), free(sq.t0), free(sk.t0);
    return st;
}
