// ring.c: ring attention (MHA_PAR_RING in include/mha_mpi.h), forward and
// backward, and its zigzag layout (mha_mpi_ring_chunks): the key/value
// blocks travel around the ring while each rank attends its queries to the
// block it holds, through the fused path's attention hook (part.h). Entered
// from mha_mpi.c (mha__mpi_ring_run, mha__mpi_ring_stats); uses the shared
// helpers (mpi_common.c) and part.h, no other file of src/mpi.
//
// Ring attention (Liu et al. 2023) with zigzag balancing: the sequence in
// 2P chunks, rank r holding chunks r and 2P-1-r (mha_mpi_ring_chunks), so
// that under a causal mask every rank has the same number of visible
// (query tile, key tile) pairs. One fused-path call on the rank's tokens
// does the projections (RoPE at the chunks' global positions), the gates,
// W_O and every gradient; its attention step is ring_attn below:
//   forward:  the key/value block of every rank passes around the ring
//             (MPI_Isend/Irecv of the next block posted before the current
//             block's compute, MPI_Testall between tiles); each block's
//             output is merged into the rows' running result by log-sum-exp
//             in double.
//   backward: the blocks pass around again with their dK/dV accumulators:
//             each rank adds its queries' terms (FlashAttention-2's
//             backward of the block with the whole softmax's row stats and
//             Dsum = rowsum(dO O)) and passes the accumulator on; after P
//             steps it reaches its owner. dQ sums in double over the steps.
// Error agreement: each attention callback starts with mha__mpi_agree(),
// each step ends with one after its messages complete; a rank whose
// fused-path call failed before a callback the others entered makes that
// mha__mpi_agree() up.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "part.h"
#include "schemes.h"

void mha_mpi_ring_chunks(int64_t T, int P, int rank, int64_t start[2], int64_t len[2]) {
    const int64_t c[2] = {rank, 2 * (int64_t)P - 1 - rank};
    for (int i = 0; i < 2; i++) {
        start[i] = T * c[i] / (2 * (int64_t)P);
        len[i] = T * (c[i] + 1) / (2 * (int64_t)P) - start[i];
    }
}

// Rank q's key chunks, and the floats of its block (k and v).
static int64_t ring_block(const ring *r, int q, int64_t ks[2], int64_t kl[2]) {
    mha_mpi_ring_chunks(r->Tk, r->j->P, q, ks, kl);
    return 2 * (kl[0] + kl[1]) * r->N * r->Ekv;
}

// Local tokens [off, off + len) of a row matrix laid out as the views (T
// tokens; row stride ld) <-> a chunk-long one (row stride W), W floats a
// row: into the chunk (out) or back.
static void chunk_xfer(float *loc, int64_t ld, float *chunk, const ring *r, int64_t T,
                       int64_t off, int64_t len, int64_t W, bool out) {
    for (int64_t n = 0; n < r->N; n++)
        for (int64_t t = 0; t < len; t++) {
            float *l = loc + (r->seq_first ? (off + t) * r->N + n : n * T + off + t) * ld;
            float *c = chunk + (r->seq_first ? t * r->N + n : n * len + t) * W;
            memcpy(out ? c : l, out ? l : c, sizeof(float) * (size_t)W);
        }
}

// n floats (a rank without tokens has a saved state without storage: NULL).
static void copy_f(float *dst, const float *src, int64_t n) {
    if (n > 0) memcpy(dst, src, sizeof(float) * (size_t)n);
}

static void ring_progress(void *arg) {
    ring *r = arg;
    if (!r->nreq) return;
    int done = 0;
    const double t = MPI_Wtime();
    MPI_Testall(r->nreq, r->req, &done, MPI_STATUSES_IGNORE);
    r->j->comm_s += MPI_Wtime() - t;
}

static mha_status ring_post(ring *r, bool send, const float *buf, int64_t n, int tag) {
    if (n > INT32_MAX) return mha__mpi_too_big(n);
    const int P = r->j->P, me = r->j->rank;
    const double t = MPI_Wtime();
    if (send) {
        MPI_Isend(buf, (int)n, MPI_FLOAT, (me + 1) % P, tag, r->j->comm, &r->req[r->nreq++]);
        r->j->sent += 4.0 * (double)n;
    } else {
        MPI_Irecv((float *)buf, (int)n, MPI_FLOAT, (me - 1 + P) % P, tag, r->j->comm,
                  &r->req[r->nreq++]);
    }
    r->j->comm_s += MPI_Wtime() - t;
    return MHA_OK;
}

static void ring_wait(ring *r) {
    const double t = MPI_Wtime();
    MPI_Waitall(r->nreq, r->req, MPI_STATUSES_IGNORE);
    const double w = MPI_Wtime() - t;
    r->j->comm_s += w, r->wait_s += w;
    r->nreq = 0;
}

// One block call: query chunk a against key chunk c of the block held.
typedef struct ring_call {
    mha_tensor v3[3];  // views of the right shapes (their data are not read)
    mha_forward_args ab;
    mha__part pa;
} ring_call;

// The call of query chunk a against key chunk c of the block held (its
// chunks' starts ks, lengths kl): its args and part (the block's keys and
// values in); false when the chunk sees none of those keys (empty, or all
// after its last query under a causal mask).
static bool ring_block_call(const ring *r, int a, int c, const int64_t ks_[2],
                            const int64_t kl_[2], ring_call *rc) {
    const int64_t ks = ks_[c], kl = kl_[c], at = (c ? kl_[0] : 0) * r->N * r->Ekv,
                  half = (kl_[0] + kl_[1]) * r->N * r->Ekv;
    if (!r->ql[a] || !kl || (r->a->opts.is_causal && ks > r->qs[a] + r->ql[a] - 1))
        return false;
    mha_tensor *v3 = rc->v3;
    mha_forward_args *ab = &rc->ab;
    mha__part *pa = &rc->pa;
    v3[0] = *r->a->query, v3[1] = *r->a->key, v3[2] = *r->a->value;
    v3[0].shape[r->sd] = r->ql[a], v3[1].shape[r->sd] = kl, v3[2].shape[r->sd] = kl;
    *ab = *r->a;
    ab->query = &v3[0], ab->key = &v3[1], ab->value = &v3[2];
    ab->key_padding_mask = NULL;
    ab->rope.mode = MHA_ROPE_NONE;  // (applied by the projections)
    ab->rope_start = NULL;
    ab->rope_scaling = NULL;
    *pa = (mha__part){.g0 = 0,
                      .g1 = r->Hkv,
                      .proj.q_in = r->q[a],
                      .block.q_off = r->qs[a] - ks,
                      .block.kpm_full = r->a->key_padding_mask,
                      .block.kpm_off = ks,
                      .progress.fn = ring_progress,
                      .progress.arg = (void *)r,
                      .progress.tiles = (int64_t *)&r->tiles,
                      .proj.k_in = r->blk + at,
                      .proj.v_in = r->blk + half + at};
    return true;
}

// U, M, Ls (chunk a's accumulators) <- a block's normalised output cp and
// its rows' stats: U = sum_blocks exp(m_b - M) l_b O_b, Ls = sum exp(m_b -
// M) l_b, in double.
static void ring_merge(const ring *r, int a, double *U, double *M, double *Ls, const float *cp,
                       const float *stats) {
    const int64_t N = r->N, H = r->H, d = r->d, E = r->E, ql = r->ql[a];
    for (int64_t b = 0; b < N; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < ql; i++) {
                const int64_t k = (b * H + h) * ql + i,
                              row = r->seq_first ? i * N + b : b * ql + i;
                const double mb = stats[2 * k],
                             lb = stats[2 * k + 1] > 0 ? 1.0 / stats[2 * k + 1] : 0;
                if (!(lb > 0)) continue;  // nothing visible in this block
                const double Mn = mb > M[k] ? mb : M[k], a1 = exp(M[k] - Mn),
                             a2 = exp(mb - Mn) * lb;
                Ls[k] = Ls[k] * a1 + a2;
                double *u = U + row * E + h * d;
                const float *c = cp + row * E + h * d;
                for (int64_t cc = 0; cc < d; cc++) u[cc] = u[cc] * a1 + a2 * (double)c[cc];
                M[k] = Mn;
            }
}

// This rank's key/value block from the fused path's rows.
static void ring_pack_own(ring *r, const mha__attn_io *io) {
    int64_t ks[2], kl[2];
    ring_block(r, r->j->rank, ks, kl);
    const int64_t S = kl[0] + kl[1], Ekv = r->Ekv, half = S * r->N * Ekv;
    for (int c = 0; c < 2; c++) {
        const int64_t off = c ? kl[0] : 0, at = off * r->N * Ekv;
        chunk_xfer((float *)io->k, io->ldk, r->blk + at, r, S, off, kl[c], Ekv, true);
        chunk_xfer((float *)io->v, io->ldk, r->blk + half + at, r, S, off, kl[c], Ekv, true);
    }
}

static mha_status ring_fwd(ring *r, const mha__attn_io *io) {
    job *j = r->j;
    const int P = j->P, me = j->rank;
    const int64_t N = r->N, E = r->E, H = r->H, L = r->ql[0] + r->ql[1];
    const int64_t qmax = r->ql[0] > r->ql[1] ? r->ql[0] : r->ql[1];
    for (int a = 0; a < 2; a++)
        chunk_xfer((float *)io->q, io->ldq, r->q[a], r, L, a ? r->ql[0] : 0, r->ql[a], E, true);
    ring_pack_own(r, io);
    const size_t nacc = (size_t)(L * N * E + 2 * N * H * L);
    double *acc = mha__malloc(sizeof(double) * (nacc + 1));
    float *cp = mha__malloc(sizeof(float) * (size_t)(qmax * N * (E + 2 * H) + 1)),
          *stats = cp + qmax * N * E;
    mha_status st = MHA_OK;
    if (!acc || !cp)
        st = mha__fail(MHA_ERR_NOMEM, "mha_mpi ring: out of memory for %zu doubles", nacc);
    double *U[2], *M[2], *Ls[2];
    for (int a = 0; !st && a < 2; a++) {
        U[a] = acc + (a ? r->ql[0] * N * (E + 2 * H) : 0);
        M[a] = U[a] + r->ql[a] * N * E, Ls[a] = M[a] + N * H * r->ql[a];
        for (int64_t i = 0; i < r->ql[a] * N * E; i++) U[a][i] = 0.0;
        for (int64_t i = 0; i < N * H * r->ql[a]; i++) M[a][i] = -INFINITY, Ls[a][i] = 0.0;
    }
    for (int s = 0; s < P; s++) {
        if ((st = mha__mpi_agree(j, st))) break;
        const int src = (me - s + P) % P, nsrc = (me - s - 1 + P) % P;
        int64_t ks[2], kl[2], ks2[2], kl2[2];
        const int64_t nb = ring_block(r, src, ks, kl), nn = ring_block(r, nsrc, ks2, kl2);
        if (s < P - 1) {  // the next block, while this one is computed
            st = ring_post(r, true, r->blk, nb, 1);
            if (!st) st = ring_post(r, false, r->nblk, nn, 1);
        }
        for (int a = 0; a < 2; a++)
            for (int c = 0; c < 2 && !st; c++) {
                ring_call rc;
                if (!ring_block_call(r, a, c, ks, kl, &rc)) continue;
                rc.pa.out.ctx = cp, rc.pa.block.stats = stats;
                for (int64_t i = 0; i < N * H * r->ql[a]; i++)  // (pruned heads: nothing visible)
                    stats[2 * i] = -INFINITY, stats[2 * i + 1] = 0.0f;
                st = mha__part_forward(NULL, r->m, &rc.ab, &rc.pa);
                if (!st) ring_merge(r, a, U[a], M[a], Ls[a], cp, stats);
            }
        ring_wait(r);
        float *t = r->blk;
        r->blk = r->nblk, r->nblk = t;
    }
    if (!(st = mha__mpi_agree(j, st)))
        for (int a = 0; a < 2; a++) {  // the context and the rows' stats
            for (int64_t b = 0; b < N; b++)
                for (int64_t h = 0; h < H; h++)
                    for (int64_t i = 0; i < r->ql[a]; i++) {
                        const int64_t k = (b * H + h) * r->ql[a] + i,
                                      row = r->seq_first ? i * N + b : b * r->ql[a] + i;
                        float *o = r->o[a] + row * E + h * r->d;
                        const double *u = U[a] + row * E + h * r->d;
                        for (int64_t cc = 0; cc < r->d; cc++)
                            o[cc] = Ls[a][k] > 0 ? (float)(u[cc] / Ls[a][k]) : 0.0f;
                        r->st[a][2 * k] = Ls[a][k] > 0 ? (float)M[a][k] : -INFINITY;
                        r->st[a][2 * k + 1] = Ls[a][k] > 0 ? (float)(1.0 / Ls[a][k]) : 0.0f;
                    }
            chunk_xfer(io->ctx, E, r->o[a], r, L, a ? r->ql[0] : 0, r->ql[a], E, false);
        }
    if (!st && io->stats) {  // a saved state keeps the rows' stats (chunk 0's, then 1's)
        copy_f(io->stats, r->st[0], 2 * N * H * r->ql[0]);
        copy_f(io->stats + 2 * N * H * r->ql[0], r->st[1], 2 * N * H * r->ql[1]);
    }
    r->fwd_done = !st;
    free(acc), free(cp);
    return st;
}

static mha_status ring_bwd(ring *r, const mha__attn_io *io) {
    job *j = r->j;
    const int P = j->P, me = j->rank;
    const int64_t N = r->N, E = r->E, H = r->H, d = r->d, Ekv = r->Ekv,
                  L = r->ql[0] + r->ql[1], nmax = r->nmax;
    const int64_t qmax = r->ql[0] > r->ql[1] ? r->ql[0] : r->ql[1];
    int64_t mks[2], mkl[2];
    ring_block(r, me, mks, mkl);
    const int64_t kmax = nmax / (2 * N * Ekv > 0 ? 2 * N * Ekv : 1);
    // per query chunk: dO and Dsum (floats), dQ (doubles); temporaries: a
    // block's dq, dk, dv; the dK/dV accumulators: incoming, mine, previous
    const size_t nf = (size_t)(L * N * (E + H) + qmax * N * E + 2 * kmax * N * Ekv + 3 * nmax);
    float *fb = mha__malloc(sizeof(float) * (nf + 1));
    double *dqa = mha__malloc(sizeof(double) * (size_t)(L * N * E + 1));
    mha_status st = MHA_OK;
    if (!fb || !dqa)
        st = mha__fail(MHA_ERR_NOMEM, "mha_mpi ring: out of memory for %zu floats", nf);
    float *dO[2], *ds[2];
    double *dq[2];
    float *p = fb;
    for (int a = 0; a < 2; a++) dO[a] = p, p += r->ql[a] * N * E;
    for (int a = 0; a < 2; a++) ds[a] = p, p += r->ql[a] * N * H;
    float *tdq = p, *tdk = tdq + qmax * N * E, *tdv = tdk + kmax * N * Ekv,
          *gin = tdv + kmax * N * Ekv, *gcur = gin + nmax, *gprev = gcur + nmax;
    dq[0] = dqa, dq[1] = dqa + r->ql[0] * N * E;
    if (!st && !r->fwd_done) {  // a saved forward: its projections, context and stats
        for (int a = 0; a < 2; a++) {
            chunk_xfer((float *)io->q, io->ldq, r->q[a], r, L, a ? r->ql[0] : 0, r->ql[a], E,
                       true);
            chunk_xfer(io->ctx, E, r->o[a], r, L, a ? r->ql[0] : 0, r->ql[a], E, true);
        }
        copy_f(r->st[0], io->stats, 2 * N * H * r->ql[0]);
        copy_f(r->st[1], io->stats + 2 * N * H * r->ql[0], 2 * N * H * r->ql[1]);
    }
    if (!st) {
        ring_pack_own(r, io);
        for (int a = 0; a < 2; a++) {
            chunk_xfer((float *)io->dctx, E, dO[a], r, L, a ? r->ql[0] : 0, r->ql[a], E, true);
            for (int64_t b = 0; b < N; b++)  // Dsum = rowsum(dO O) per head
                for (int64_t h = 0; h < H; h++)
                    for (int64_t i = 0; i < r->ql[a]; i++) {
                        const int64_t row = r->seq_first ? i * N + b : b * r->ql[a] + i;
                        const float *x = dO[a] + row * E + h * d,
                                    *y = r->o[a] + row * E + h * d;
                        double sum = 0.0;
                        for (int64_t c = 0; c < d; c++) sum += (double)x[c] * y[c];
                        ds[a][(b * H + h) * r->ql[a] + i] = (float)sum;
                    }
        }
        for (int64_t i = 0; i < L * N * E; i++) dqa[i] = 0.0;
    }
    int64_t nprev = 0;
    for (int s = 0; s < P; s++) {
        if ((st = mha__mpi_agree(j, st))) break;
        const int src = (me - s + P) % P, nsrc = (me - s - 1 + P) % P;
        int64_t ks[2], kl[2], ks2[2], kl2[2];
        const int64_t nb = ring_block(r, src, ks, kl), nn = ring_block(r, nsrc, ks2, kl2);
        if (s < P - 1) {  // the next block
            st = ring_post(r, true, r->blk, nb, 1);
            if (!st) st = ring_post(r, false, r->nblk, nn, 1);
        }
        if (s > 0 && !st) {  // the previous block's accumulator on, this one's in
            st = ring_post(r, true, gprev, nprev, 2);
            if (!st) st = ring_post(r, false, gin, nb, 2);
        }
        const int64_t half = (kl[0] + kl[1]) * N * Ekv;
        for (int64_t i = 0; i < nb; i++) gcur[i] = 0.0f;
        for (int c = 0; c < 2; c++)
            for (int a = 0; a < 2 && !st; a++) {
                ring_call rc;
                if (!ring_block_call(r, a, c, ks, kl, &rc)) continue;
                const int64_t at = (c ? kl[0] : 0) * N * Ekv, nk = kl[c] * N * Ekv;
                mha__part *pa = &rc.pa;
                pa->block.o_in = r->o[a], pa->block.do_in = dO[a], pa->block.stats = r->st[a],
                pa->block.dsum_in = ds[a];
                pa->out.dq = tdq, pa->out.dk = tdk, pa->out.dv = tdv;
                st = mha__part_attn_backward(r->m, &rc.ab, pa);
                for (int64_t i = 0; !st && i < r->ql[a] * N * E; i++) dq[a][i] += tdq[i];
                for (int64_t i = 0; !st && i < nk; i++)
                    gcur[at + i] += tdk[i], gcur[half + at + i] += tdv[i];
            }
        ring_wait(r);
        if (s > 0)  // what the ranks before added, then this rank's terms
            for (int64_t i = 0; i < nb; i++) gcur[i] = gin[i] + gcur[i];
        float *t = r->blk;
        r->blk = r->nblk, r->nblk = t;
        t = gprev, gprev = gcur, gcur = t;
        nprev = nb;
    }
    if (!(st = mha__mpi_agree(j, st)) && P > 1) {  // the accumulators home: from the previous rank
        st = ring_post(r, true, gprev, nprev, 3);
        if (!st) st = ring_post(r, false, gin, 2 * (mkl[0] + mkl[1]) * N * Ekv, 3);
        ring_wait(r);
        float *t = gprev;
        gprev = gin, gin = t;
    }
    if (!(st = mha__mpi_agree(j, st))) {
        const int64_t S = mkl[0] + mkl[1], half = S * N * Ekv;
        for (int c = 0; c < 2; c++) {
            const int64_t off = c ? mkl[0] : 0, at = off * N * Ekv;
            chunk_xfer(io->dk, io->ldk, gprev + at, r, S, off, mkl[c], Ekv, false);
            chunk_xfer(io->dv, io->ldk, gprev + half + at, r, S, off, mkl[c], Ekv, false);
        }
        for (int a = 0; a < 2; a++) {
            for (int64_t i = 0; i < r->ql[a] * N * E; i++) tdq[i] = (float)dq[a][i];
            chunk_xfer(io->dq, io->ldq, tdq, r, L, a ? r->ql[0] : 0, r->ql[a], E, false);
        }
    }
    free(fb), free(dqa);
    return st;
}

static mha_status ring_attn(void *arg, const mha__attn_io *io) {
    ring *r = arg;
    r->entered++;
    mha_status st = mha__mpi_agree(r->j, MHA_OK);
    if (st) return st;
    return io->dctx ? ring_bwd(r, io) : ring_fwd(r, io);
}

// The zigzag shards checked: every rank's tokens are its two chunks.
static mha_status ring_check(const job *j, const seq *s, const char *what) {
    for (int q = 0; q < j->P; q++) {
        int64_t cs[2], cl[2];
        mha_mpi_ring_chunks(s->T, j->P, q, cs, cl);
        if (s->t0[q + 1] - s->t0[q] != cl[0] + cl[1])
            return mha__fail(MHA_ERR_SHAPE,
                             "mha_mpi ring: rank %d holds %lld tokens of the %s; the zigzag "
                             "split of %lld tokens over %d ranks gives it %lld (chunks %d and "
                             "%d: mha_mpi_ring_chunks)",
                             q, (long long)(s->t0[q + 1] - s->t0[q]), what, (long long)s->T,
                             j->P, (long long)(cl[0] + cl[1]), q, 2 * j->P - 1 - q);
    }
    return MHA_OK;
}

static mha_status stale_state(void) {
    return mha__fail(MHA_ERR_INVALID_ARG,
                     "mha_mpi ring: args.save holds the state of another forward (module, "
                     "inputs, masks or RoPE differ, or not a ring forward); run "
                     "mha_mpi_forward with these args first, or pass save = NULL");
}

// Ring attention's forward (out) or backward (gq, gk, gv: contiguous float32
// of the local shapes, or NULL; gr the parameter gradients, this rank's
// tokens' terms).
mha_status mha__mpi_ring_run(job *j, mha_tensor *out, mha_tensor *gq, mha_tensor *gk,
                             mha_tensor *gv, mha_module *gr, const mha_module *m,
                             const mha_forward_args *a, const mha_tensor *gout, double *model,
                             ring *r) {
    const mha_config *c = mha_module_config(m);
    seq sq = {0}, sk = {0};
    mha_status st = mha__mpi_shards_of(j, &sq, &sk, m, a, true);
    if (st) return st;
    if (!(st = ring_check(j, &sq, "query"))) st = ring_check(j, &sk, "key and value");
    if ((st = mha__mpi_agree(j, st))) {
        free(sq.t0), free(sk.t0);
        return st;
    }
    const int me = j->rank;
    *r = (ring){.j = j,
                .m = m,
                .a = a,
                .N = sq.N,
                .E = c->embed_dim,
                .H = c->num_heads,
                .Hkv = c->num_kv_heads,
                .Tq = sq.T,
                .Tk = sk.T,
                .seq_first = sq.seq_first};
    r->d = r->E / r->H, r->Ekv = r->Hkv * r->d;
    r->sd = a->query->ndim == 2 || !c->batch_first ? 0 : 1;
    mha_mpi_ring_chunks(sq.T, j->P, me, r->qs, r->ql);
    for (int q = 0; q < j->P; q++) {
        int64_t ks[2], kl[2];
        const int64_t n = ring_block(r, q, ks, kl);
        r->nmax = n > r->nmax ? n : r->nmax;
    }
    const int64_t N = r->N, E = r->E, L = r->ql[0] + r->ql[1];
    const size_t nf = (size_t)(2 * L * N * E + 2 * N * r->H * L + 2 * r->nmax);
    float *buf = mha__malloc(sizeof(float) * (nf + 1));
    int64_t *pos = mha__malloc(sizeof(int64_t) * (size_t)(L + 1));
    if (!buf || !pos)
        st = mha__fail(MHA_ERR_NOMEM, "mha_mpi ring: out of memory for %zu floats", nf);
    if (!(st = mha__mpi_agree(j, st))) {  // (the backward's first step is a collective)
        float *p = buf;
        for (int a2 = 0; a2 < 2; a2++) r->q[a2] = p, p += r->ql[a2] * N * E;
        for (int a2 = 0; a2 < 2; a2++) r->o[a2] = p, p += r->ql[a2] * N * E;
        for (int a2 = 0; a2 < 2; a2++) r->st[a2] = p, p += 2 * N * r->H * r->ql[a2];
        r->blk = p, r->nblk = p + r->nmax;
        for (int64_t t = 0; t < L; t++)  // the tokens' global positions
            pos[t] = t < r->ql[0] ? r->qs[0] + t : r->qs[1] + t - r->ql[0];
        mha_forward_args al = *a;
        al.key_padding_mask = NULL;  // (the masks apply in the blocks)
        al.attn_mask = NULL;
        al.opts.is_causal = false;
        al.opts.window_left = al.opts.window_right = -1;
        al.opts.alibi = false;
        mha__part pr = {.g0 = 0,
                        .g1 = r->Hkv,
                        .bias = true,
                        .attn.fn = ring_attn,
                        .attn.arg = r,
                        .attn.rope_pos = pos};
        mha_saved *sv = a->save;
        const bool saved = !out && sv && sv->valid;  // the backward of a saved forward
        if (!out) {                                  // every rank's saved state, or none
            int f[2] = {saved, -(int)saved}, g[2];
            const double t = MPI_Wtime();
            MPI_Allreduce(f, g, 2, MPI_INT, MPI_MAX, j->comm);
            j->comm_s += MPI_Wtime() - t;
            if (g[0] != -g[1])
                st = mha__fail(MHA_ERR_INVALID_ARG,
                               "mha_mpi ring: args.save holds a forward's "
                               "state on some ranks only: run mha_mpi_forward with it on "
                               "every rank");
        }
        if (saved && !st && !sv->outer_valid) st = stale_state();
        if (saved && !st) {
            mha__saved_key key;
            mha__saved_key_of(&key, m, a);
            if (memcmp(&key, &sv->outer, sizeof key)) st = stale_state();
        }
        if (st) {
        } else if (out) {
            st = mha__part_forward(out, m, &al, &pr);
            if (!st && sv) {  // the whole call's key: the masks included
                mha__saved_key_of(&sv->outer, m, a);
                sv->outer_valid = true;
            }
        } else {
            st = mha__part_backward(gq, gk, gv, gr, m, &al, gout, &pr);
        }
        if (!out && saved) r->entered++;  // (no forward callback)
    }
    if (r->entered < (out ? 1 : 2))
        (void)mha__mpi_agree(j, st);  // the callback the others entered
    st = mha__mpi_agree(j, st);
    // the model: rank me passes on the key/value blocks of ranks me, me-1,
    // ..., me-P+2; the backward passes them again (after its forward's
    // pass unless the forward was saved), with the dK/dV accumulators of
    // the same blocks and, last, block me+1's home (each as big as its block)
    const int P = j->P;
    double kv = 0, home = 0;
    for (int s = 0; s < P - 1; s++) {
        int64_t ks[2], kl[2];
        kv += 4.0 * (double)ring_block(r, (me - s + P) % P, ks, kl);
    }
    if (P > 1) {
        int64_t ks[2], kl[2];
        home = 4.0 * (double)ring_block(r, (me + 1) % P, ks, kl);
    }
    *model = out ? kv : (r->fwd_done ? 3 * kv : 2 * kv) + home;
    free(buf), free(pos), free(sq.t0), free(sk.t0);
    return st;
}

void mha__mpi_ring_stats(mha_mpi_stats *stats, const mha_module *m, const ring *r) {
    if (!stats) return;
    stats->heads = mha_module_config(m)->num_heads;  // every head, its tokens
    stats->kv_head_begin = 0, stats->kv_head_end = mha_module_config(m)->num_kv_heads;
    stats->tiles = r->tiles;
    stats->wait_seconds = r->wait_s;
}
