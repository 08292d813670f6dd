// splitkv.c: the decode of at most MHA__DECODE_MAX_T queries per sequence
// over a row source: split-KV. The keys of each sequence are cut into
// fixed chunks (decode_chunk: by the bytes of a key row); each (b, KV head,
// chunk) item reads its K and V rows from memory once for all the queries
// of the group (query heads x new tokens: the group kernels, rows in their
// storage type converted in registers), keeping per query the chunk's max
// m, sum l and unnormalised output; the chunks are then combined in chunk
// order. The chunking depends on the lengths and the rows' layout only, so
// the bits do not depend on the number of threads.
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvattend.h"
#include "splitkv.h"

// Decode's split-KV chunk (rows per (b, KV head, chunk) item): as many
// rows as fill DECODE_CHUNK_BYTES of K (1024 float32 rows of head dim 64,
// 2048 of bf16, 8192 of int4), a power of two in [DECODE_CHUNK_MIN,
// DECODE_CHUNK_MAX]. A chunk's rows stream from memory one after the
// other; the kernels' look-ahead starts cold at each chunk, so a chunk
// of few bytes (a narrow type's 512 rows) spends much of its time on
// that start (measured on the Zen 4, 256k tokens, against 512-row
// chunks: bf16 1.2x, int4 1.5x faster).
#define DECODE_CHUNK_BYTES 262144
#define DECODE_CHUNK_MIN 512
#define DECODE_CHUNK_MAX 8192

// The chunks' partials combined in chunk order: O = sum_c e^(m_c - M) o_c /
// (sum_c e^(m_c - M) l_c [+ e^(sink - M)]) (and each row's max and 1/sum
// into stats); an attention sink joins the max M and the denominator once.
// acc: Dv doubles of scratch per thread (each chunk's weight exp(m - M)
// computed once for the row, then its output added to every column's sum,
// chunk after chunk in order).
static void attend_combine(const mha__attend_call *ac, const float *part, int64_t nch,
                           size_t per, double *acc) {
    const int64_t B = ac->B, H = ac->H, T = ac->T, Dv = ac->Dv;
    const int64_t *counts = ac->counts;
    const mha_tensor *out = ac->out;
    float *o = ac->o, *stats = ac->stats;
    const int nt = ac->nt;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, h = bh % H, Tb = counts ? counts[b] : T;
        const double sink = ac->a.opts.sinks ? (double)ac->a.opts.sinks[h] : -INFINITY;
        for (int64_t t = 0; t < Tb; t++) {
            float *orow = o + b * out->stride[0] + h * out->stride[1] + t * out->stride[2];
            double M = -INFINITY;
            for (int64_t ch = 0; ch < nch; ch++) {
                const float *pp = part + ((size_t)((bh * nch + ch) * T + t)) * per;
                if (pp[1] > 0.0f && pp[0] > M) M = pp[0];
            }
            if (sink > M) M = sink;
            for (int64_t e = 0; e < Dv; e++) orow[e] = 0.0f;
            if (M == -INFINITY) continue;  // nothing visible: 0
            double L = sink > -INFINITY ? exp(sink - M) : 0.0;
            double *a = acc + (size_t)mha__thread_id() * (size_t)Dv;
            for (int64_t e = 0; e < Dv; e++) a[e] = 0.0;
            for (int64_t ch = 0; ch < nch; ch++) {
                const float *pp = part + ((size_t)((bh * nch + ch) * T + t)) * per;
                if (!(pp[1] > 0.0f)) continue;
                const double w = exp(pp[0] - M);
                L += w * pp[1];
                for (int64_t e = 0; e < Dv; e++) a[e] += w * pp[2 + e];
            }
            for (int64_t e = 0; e < Dv; e++) orow[e] = (float)(a[e] / L);
            if (stats)
                stats[2 * (bh * T + t)] = (float)M,
                                    stats[2 * (bh * T + t) + 1] = (float)(1.0 / L);
        }
    }
}

// The int8 query xq (D bytes, D a multiple of 128) in dot_rows_i4's
// order: per 128 elements the even ones, then the odd ones.
static void split_i4(int8_t *xq, int64_t D) {
    int8_t t[128];
    for (int64_t s = 0; s < D; s += 128) {
        memcpy(t, xq + s, sizeof t);
        for (int64_t e = 0; e < 128; e++) xq[s + (e % 2) * 64 + e / 2] = t[e];
    }
}

// The int8 form of the scaled query x (D floats) that dot_rows_i8 takes
// (mha.h's int8 cache): *xs = max_c |x_c| / 127 and xq_c = x_c * (127 /
// max_c |x_c|) rounded to nearest even (|xq_c| <= 127), the bytes from D
// to ldx zero; all zero (and xs 0) for a zero query; xs NaN (so its scores
// NaN) when x holds a NaN or an infinity.
static void quantize_i8(int8_t *xq, float *xs, const float *x, int64_t D, int64_t ldx) {
    float mx = 0.0f;
    bool finite = true;
    for (int64_t c = 0; c < D; c++) {
        const float a = fabsf(x[c]);
        finite = finite && a <= FLT_MAX;
        mx = a > mx ? a : mx;
    }
    memset(xq, 0, (size_t)ldx);
    if (!finite) {
        *xs = NAN;
        return;
    }
    *xs = mx / 127.0f;
    if (mx == 0.0f) return;
    const float inv = 127.0f / mx;
    for (int64_t c = 0; c < D; c++) xq[c] = (int8_t)nearbyintf(x[c] * inv);
}

// Row i of segment g: where its K and V rows (and int8 / int4 scales;
// else NULL) are.
static void seg_rows(const mha__kv_rows *c, const mha__dec_seg *g, int64_t i, const char **k,
                     const char **v, const float **ks, const float **vs) {
    *k = g->k + (size_t)i * c->lk.rb;
    *v = g->v + (size_t)i * c->lv.rb;
    *ks = g->ks ? g->ks + i * c->lk.sld : NULL;
    *vs = g->vs ? g->vs + i * c->lv.sld : NULL;
}

// The piece of rows [r, hi) that lies in one run of memory (r's segment,
// and the segments after it that follow it in memory: a paged cache's
// blocks taken in order): its end (returned) and where row r's K, V (and
// int8 / int4 scales) are.
static int64_t piece(const mha__dec_chunk *dc, int64_t r, int64_t hi, const char **k,
                     const char **v, const float **ks, const float **vs) {
    const mha__kv_rows *c = dc->c;
    const int64_t s = r / c->seg;
    const mha__dec_seg *g = &dc->seg[s - dc->s0];
    seg_rows(c, g, r - s * c->seg, k, v, ks, vs);
    int64_t end = (s + 1) * c->seg;
    const size_t kb = (size_t)c->seg * c->lk.rb, vb = (size_t)c->seg * c->lv.rb;
    for (const mha__dec_seg *e = g + 1;
         end < hi && g->k && e->k == g->k + kb && e->v == g->v + vb &&
         (!g->ks ||
          (e->ks == g->ks + c->seg * c->lk.sld && e->vs == g->vs + c->seg * c->lv.sld));
         g = e++)
        end += c->seg;
    return end < hi ? end : hi;
}

// The integer scores (dc->xi: int8 rows, or int4 ones of a head dim a
// multiple of 128) of the n rows at k (scales ks) into s, for the ng
// queries whose rows of dc->qf floats start at the scores row sr.
static void int_scores(const mha__dec_chunk *dc, float *s, const float *sr, int64_t ng,
                       int64_t n, const char *k, const float *ks, const void *pf, size_t pfb) {
    const mha__kv_rows *c = dc->c;
    const int64_t qf = (int64_t)dc->qf;
    const float *x = sr + dc->ch + dc->xi;
    const int8_t *xq = (const int8_t *)(const void *)x;
    const float *xs = x + dc->ldxi / 4;
    if (dc->kind == MHA_KV_INT4)
        dc->kt->dot_rows_i4(s, qf, (const uint8_t *)k, c->lk.lda / 2, ks, c->lk.sld, xq,
                            4 * qf, xs, qf, ng, n, c->D, pf, pfb);
    else
        dc->kt->dot_rows_i8(s, qf, (const int8_t *)k, c->lk.lda, ks, c->lk.sld, xq, 4 * qf, xs,
                            qf, ng, n, c->D, pf, pfb);
}

// The n rows from row r at k (K, with their scales ks) or vr (V, vs) for
// query v alone, in one kernel call: its scores (isk), else O += P V.
static void rows_alone(const mha__dec_chunk *dc, int64_t v, int64_t r, int64_t n,
                       const char *k, const char *vr, const float *ks, const float *vs,
                       bool isk, const void *pf, size_t pfb) {
    const mha__kv_rows *c = dc->c;
    float *s = dc->sc + (size_t)v * dc->qf, *x = s + dc->ch, *o = x + c->D;
    if (isk && dc->xi) int_scores(dc, s + (r - dc->j0), s, 1, n, k, ks, pf, pfb);
    else if (isk)
        dc->kt->dot_rows_q(s + (r - dc->j0), k, c->lk.lda, dc->kind, ks, c->lk.sld, x, n, c->D,
                           pf, pfb);
    else
        dc->kt->axpy_rows_q(o, s + (r - dc->j0), vr, c->lv.lda, dc->kind, vs, c->lv.sld, n,
                            c->Dv, pf, pfb);
}

// Rows [r, r1) for query v alone: its scores (isk), else O += P V.
static void alone(const mha__dec_chunk *dc, int64_t v, int64_t r, int64_t r1, bool isk,
                  mha__dec_ahead *ah) {
    for (int64_t p1, r0 = r; r < r1; r = p1) {
        const char *k, *vr;
        const float *ks, *vs;
        const void *pf;
        size_t pfb;
        p1 = piece(dc, r, r1, &k, &vr, &ks, &vs);
        mha__dec_look_ahead(dc, r0, r, p1, r1, isk, ah, &pf, &pfb);
        rows_alone(dc, v, r, p1 - r, k, vr, ks, vs, isk, pf, pfb);
    }
}

// Rows [r, r1) for all nv queries (their keys in common): the scores (isk),
// else O += P V.
static void shared_rows(const mha__dec_chunk *dc, int64_t nv, int64_t r, int64_t r1, bool isk,
                        mha__dec_ahead *ah) {
    const int64_t D = dc->c->D, Dv = dc->c->Dv, qf = (int64_t)dc->qf;
    float *sc = dc->sc;
    for (int64_t p1, r0 = r; r < r1; r = p1) {
        const char *k, *vr;
        const float *ks, *vs;
        const void *pf;
        size_t pfb;
        p1 = piece(dc, r, r1, &k, &vr, &ks, &vs);
        mha__dec_look_ahead(dc, r0, r, p1, r1, isk, ah, &pf, &pfb);
        if (isk && dc->xi) int_scores(dc, sc + (r - dc->j0), sc, nv, p1 - r, k, ks, pf, pfb);
        else if (isk)
            dc->kt->dot_rows_qg(sc + (r - dc->j0), qf, k, dc->c->lk.lda, dc->kind, ks,
                                dc->c->lk.sld, sc + dc->ch, qf, nv, p1 - r, D, pf, pfb);
        else
            dc->kt->axpy_rows_qg(sc + dc->ch + D, qf, sc + (r - dc->j0), qf, vr, dc->c->lv.lda,
                                 dc->kind, vs, dc->c->lv.sld, nv, p1 - r, Dv, pf, pfb);
    }
}

// One sequence's rows from js on, those in [r, r1), for its un queries uq
// (their scores and outputs at dc): the keys all of them see for all of
// them (the group kernels), each query's others alone. Taken range by
// range in order, every query's rows stay in order (the bits of one range).
static void unit_rows(const mha__dec_chunk *dc, const mha__dec_query *uq, int64_t un,
                      int64_t js, int64_t r, int64_t r1, bool isk, mha__dec_ahead *ah) {
    int64_t clo = js, chi = INT64_MAX;
    for (int64_t v = 0; v < un; v++) {
        const int64_t lo = uq[v].lo > js ? uq[v].lo : js;
        clo = lo > clo ? lo : clo;
        chi = uq[v].hi < chi ? uq[v].hi : chi;
    }
    // (one query, or none shared: each query alone)
    const bool shared = un > 1 && chi > clo;
    for (int64_t v = 0; v < un; v++) {
        const int64_t lo = uq[v].lo > js ? uq[v].lo : js, hi = shared ? clo : uq[v].hi;
        alone(dc, v, lo > r ? lo : r, hi < r1 ? hi : r1, isk, ah);
    }
    if (shared) shared_rows(dc, un, clo > r ? clo : r, chi < r1 ? chi : r1, isk, ah);
    for (int64_t v = 0; shared && v < un; v++)
        alone(dc, v, chi > r ? chi : r, uq[v].hi < r1 ? uq[v].hi : r1, isk, ah);
}

// The rows from js on of an item's nu units: KV heads of one sequence (the
// same chunk, their pieces of a segment side by side in memory), segment
// by segment and, in each, head by head: one run of memory a segment, where
// a head's piece alone is a few KiB at a random place (units with no query
// here skipped). The pieces in the order read, each kernel call fetches
// the piece kn on (MHA__DEC_NEAR bytes ahead) while it runs and touches the
// first lines of the one kf on (MHA__DEC_FAR; into L2: the hardware's streamer
// brings the rest of its page); the first kn are fetched at once. A head
// with one query calls its kernel on the segment's rows directly (no
// division on the way: a step over 16-token blocks makes hundreds of
// thousands of calls).
static void heads_rows(const mha__dec_chunk *dcs, const mha__dec_query *qs, const int64_t *v0s,
                       int64_t nu, int64_t js, bool isk) {
    const mha__dec_chunk *d0 = &dcs[0];
    const mha__kv_rows *c = d0->c;
    const int64_t seg = c->seg, n = c->len[d0->b];
    const int64_t j1 = d0->j0 + d0->ch < n ? d0->j0 + d0->ch : n, s1 = (j1 - 1) / seg;
    const size_t sb = (size_t)seg * (isk ? c->lk.rb : c->lv.rb);
    const int64_t kn = (int64_t)((MHA__DEC_NEAR + sb - 1) / sb),
                  kf = (int64_t)((MHA__DEC_FAR + sb - 1) / sb);
    const char *p;
    // (a piece: unit u of segment g; (gn, unx) and (gf, uf) the look-ahead's)
    int64_t g = js / seg, gn = g + kn / nu, unx = kn % nu, gf = g + kf / nu, uf = kf % nu;
#define PIECE(g, u) (v0s[(u) + 1] > v0s[u] ? mha__dec_seg_bytes(&dcs[u], g, j1, isk, &p) : 0)
    for (int64_t i = 0, gi = g, ui = 0; i < kf && gi <= s1; i++) {
        const size_t nb = PIECE(gi, ui);
        if (nb && i < kn) mha__dec_touch(p, nb, -1);
        else if (nb) mha__dec_touch(p, nb, MHA__DEC_FAR_LINES);
        if (++ui == nu) ui = 0, gi++;
    }
    for (; g <= s1; g++) {
        const int64_t r = g * seg > js ? g * seg : js,
                      r1 = (g + 1) * seg < j1 ? (g + 1) * seg : j1;
        for (int64_t u = 0; u < nu; u++) {
            const int64_t nq = v0s[u + 1] - v0s[u];
            mha__dec_ahead ah = {NULL, 0};
            if (nq && gn <= s1 && (ah.pfb = PIECE(gn, unx))) ah.pf = p;
            if (ah.pfb > MHA__DEC_NEAR) ah.pfb = MHA__DEC_NEAR;  // (as prefetch_ahead's)
            size_t nf;
            if (nq && gf <= s1 && (nf = PIECE(gf, uf)))
                mha__dec_touch(p, nf, MHA__DEC_FAR_LINES);
            if (++unx == nu) unx = 0, gn++;
            if (++uf == nu) uf = 0, gf++;
            if (!nq) continue;
            const mha__dec_chunk *dc = &dcs[u];
            const mha__dec_query *q = qs + v0s[u];
            if (nq > 1) {
                unit_rows(dc, q, nq, js, r, r1, isk, &ah);
                continue;
            }
            const int64_t lo = q->lo > r ? q->lo : r, hi = q->hi < r1 ? q->hi : r1;
            if (lo >= hi) continue;
            const char *k, *vr;
            const float *ks, *vs;
            seg_rows(c, &dc->seg[g - dc->s0], lo - g * seg, &k, &vr, &ks, &vs);
            rows_alone(dc, 0, lo, hi - lo, k, vr, ks, vs, isk, ah.pf, ah.pfb);
        }
    }
#undef PIECE
}

// The rows of a decode chunk (DECODE_CHUNK_BYTES).
static int64_t decode_chunk(const mha__kv_rows *c) {
    int64_t ch = DECODE_CHUNK_MIN;
    while (ch < DECODE_CHUNK_MAX && (size_t)(2 * ch) * c->lk.rb <= DECODE_CHUNK_BYTES) ch *= 2;
    return ch;
}

// Sequences decoded together whose chunk starts with the same rows in
// memory (a paged cache's forks of one prompt: the same blocks) form one
// item: those rows are read once for all their queries (the group
// kernels), each sequence's other rows for its own. At most DEC_GROUP_Q
// queries an item, and DEC_GROUP_FLOATS of their scores (a thread's
// scratch: a larger set is cut into items).
#define DEC_GROUP_Q 64
#define DEC_GROUP_FLOATS 65536

// An item's chunk: chunk ch of the m sequences memb[0 .. m) (in increasing
// order), whose rows [j0, js) are the same in memory and seen by all their
// queries (js = j0: nothing shared; m = 1 then).
typedef struct dec_group {
    int64_t ch, m, js;
    const int64_t *memb;
} dec_group;

// An item of a decode call: group g's chunk for its KV heads [hk, hk + nh)
// (nh > 1: a sequence alone, its heads read together).
typedef struct dec_item {
    int64_t g, hk, nh;
} dec_item;

// A sequence's chunk and the first row of its segment s (KV head 0): the
// key the sequences sharing rows are found by.
typedef struct dec_key {
    const char *k;
    int64_t b;
} dec_key;

static int dec_key_cmp(const void *x, const void *y) {
    const dec_key *a = x, *b = y;
    const uintptr_t pa = (uintptr_t)a->k, pb = (uintptr_t)b->k;
    if (pa != pb) return pa < pb ? -1 : 1;
    return a->b < b->b ? -1 : a->b > b->b;
}

// The groups of one call (ng of them into g, their members into memb,
// key: B records of scratch): per chunk, every sequence, those whose
// chunk begins in the same segment of memory together (at
// most mmax of them an item) with the rows they share: the segments that
// are the same for every one of them, up to the first row any of their
// queries sits at (rows before it are seen by all of their queries: no
// window). share false: each sequence alone.
static int64_t decode_groups(const mha__kv_rows *c, const int64_t *counts, int64_t T,
                             int64_t CH, int64_t nch, bool share, int64_t mmax, dec_group *g,
                             int64_t *memb, dec_key *key) {
    int64_t ng = 0, nm = 0;
    const float *fs;
    const char *kk, *vv;
    const float *ks;
    for (int64_t ch = 0; ch < nch; ch++) {
        const int64_t j0 = ch * CH;
        const int64_t nk = c->B;
        // (every sequence: an item also marks its queries' partials empty
        // where the chunk holds none of its rows)
        for (int64_t b = 0; b < nk; b++) {
            key[b].b = b, key[b].k = NULL;
            if (share && c->len[b] > j0)
                c->at(c->ctx, b, 0, j0 / c->seg, &key[b].k, &vv, &ks, &fs);
        }
        if (share) qsort(key, (size_t)nk, sizeof *key, dec_key_cmp);
        for (int64_t i = 0; i < nk;) {
            int64_t e = i + 1;  // [i, e): the same first segment
            while (share && key[i].k && e < nk && key[e].k == key[i].k) e++;
            for (int64_t f = i; f < e;) {
                const int64_t m = e - f < mmax ? e - f : mmax;
                int64_t js = j0;
                if (m > 1) {
                    // rows seen by every query (those before each member's
                    // first query), and within the chunk
                    int64_t lim = j0 + CH;
                    for (int64_t u = f; u < f + m; u++) {
                        const int64_t bu = key[u].b;
                        const int64_t first = c->len[bu] - (counts ? counts[bu] : T);
                        lim = first < lim ? first : lim;
                    }
                    lim = lim > j0 ? lim : j0;  // (a query before the chunk: none shared)
                    // whole segments the same for all of them
                    while (js < lim) {
                        const int64_t s = js / c->seg;
                        const char *k0 = NULL;
                        bool same = true;
                        for (int64_t u = f; u < f + m && same; u++) {
                            c->at(c->ctx, key[u].b, 0, s, &kk, &vv, &ks, &fs);
                            if (u == f) k0 = kk;
                            same = kk && kk == k0;
                        }
                        if (!same) break;
                        js = (s + 1) * c->seg;
                    }
                    if (js > lim) js = lim;
                }
                // nothing shared: the first alone, the others after it
                const int64_t take = js > j0 ? m : 1;
                g[ng++] = (dec_group){ch, take, js, memb + nm};
                for (int64_t u = f; u < f + take; u++) memb[nm++] = key[u].b;
                f += take;
            }
            i = e;
        }
    }
    return ng;
}

// Decode (at most MHA__DECODE_MAX_T queries): split-KV over fixed chunks
// of the keys, per (b, KV head, chunk): each chunk's partial (m, l, O) per
// query, then combined in chunk order (attend_combine). The G T queries of
// a KV head's group read the chunk's rows in place (the _q kernels: no
// float32 copy of a reduced-precision cache), through the group kernels
// where their bands overlap (each row from memory once for all of them),
// query by query at the edges of the bands. Sequences that share their
// chunk's first rows in memory (decode_groups) read those once for all
// their queries. The bits are those of each sequence alone: a score
// depends on its row and query only, and each output sums its rows in
// order, however the rows are cut into calls.
// The layout of a decode call: the chunking, how an item's queries are
// formed and where its scratch lies (one block, carved by decode_plan).
typedef struct dec_plan {
    int64_t CH, nch;  // rows per chunk, chunks of the longest sequence
    bool share;       // sequences whose chunks share rows read them once
    int64_t mmax;     // sequences an item may take (share), else 1
    int64_t HI;       // KV heads an item of a sequence alone takes
    int64_t um, qn;   // units (KV head, sequence) and queries an item
    size_t per;       // floats of a (b, h, chunk, t) partial: m, l, O (Dv)
    // int8 rows with an int8 query (i8; int4 rows of a head dim a multiple
    // of 128 too, i4q: the query split per 128 into its even and odd
    // elements, as dot_rows_i4 takes it): its bytes xi floats on from the
    // scaled query, padded to ldxi bytes, then its scale
    bool i8, i4q;
    int64_t ldxi, xi;
    size_t qf, tfl;  // floats per query (scores, query, output); per thread
    size_t ns;       // segments a unit's chunk lies in, at most
    size_t ngmax, itmax;
    // bytes from the block's start: the partials (B H nch T of them), the
    // threads' scores, their queries' records, their segments, their
    // combine sums, the groups, their members, the sort's keys, the items
    size_t part, sc, q, seg, acc, grp, memb, keys, items, total;
} dec_plan;

// The plan of a checked call (MHA_ERR_OVERFLOW when its scratch does not
// fit a size_t).
static mha_status decode_plan(dec_plan *p, const mha__attend_call *ac) {
    const mha__kv_rows *c = ac->c;
    const int64_t B = ac->B, H = ac->H, T = ac->T, D = ac->D, Dv = ac->Dv, nt = ac->nt;
    const mha_attn_opts *o = &ac->a.opts;
    memset(p, 0, sizeof *p);
    p->CH = decode_chunk(c);
    p->nch = (ac->maxlen + p->CH - 1) / p->CH;
    // sharing: several sequences, rows in memory that may coincide, every
    // query seeing every row before its own (no window, not a shard)
    const int64_t nq = ac->G * T;
    const int64_t qcap = DEC_GROUP_FLOATS / p->CH < DEC_GROUP_Q ? DEC_GROUP_FLOATS / p->CH
                                                                : DEC_GROUP_Q;
    p->share = c->shares && B > 1 && o->window_left < 0 && o->window_right < 0 &&
               ac->q_shift == 0 && qcap / nq >= 2;
    p->mmax = p->share ? qcap / nq : 1;
    // heads-together rows (mha__kv_rows.heads_together): an item of a
    // sequence alone takes up to HI of its KV heads (as many as a group's
    // queries), each segment's heads one after the other
    p->HI = !c->heads_together   ? 1
            : c->Hkv < qcap / nq ? c->Hkv
            : qcap / nq > 1      ? qcap / nq
                                 : 1;
    p->um = p->mmax > p->HI ? p->mmax : p->HI;
    p->qn = p->um * nq;
    p->per = (size_t)(Dv + 2);
    p->i4q = c->dt == MHA_KV_INT4 && D % 128 == 0;
    p->i8 = (c->dt == MHA_KV_INT8 || p->i4q) && D <= MHA__I8_DMAX;
    p->ldxi = p->i8 ? (D + 63) / 64 * 64 : 0;
    p->xi = p->i8 ? D + Dv : 0;
    p->qf = (size_t)(p->CH + D + Dv + (p->i8 ? p->ldxi / 4 + 1 : 0));
    p->tfl = (size_t)p->qn * p->qf;
    p->ns = (size_t)((p->CH + c->seg - 1) / c->seg + 1);
    p->ngmax = (size_t)(B * p->nch);
    p->itmax = p->ngmax * (size_t)c->Hkv;
    size_t total = 0;
    if (mha__carve(&total, &p->part, B * H * p->nch * T, p->per * sizeof(float)) ||
        mha__carve(&total, &p->sc, nt, p->tfl * sizeof(float)) ||
        mha__carve(&total, &p->q, p->qn * nt, sizeof(mha__dec_query)) ||
        mha__carve(&total, &p->seg, p->um * nt, p->ns * sizeof(mha__dec_seg)) ||
        mha__carve(&total, &p->acc, Dv * nt, sizeof(double)) ||
        mha__carve(&total, &p->grp, (int64_t)p->ngmax, sizeof(dec_group)) ||
        mha__carve(&total, &p->memb, (int64_t)p->ngmax, sizeof(int64_t)) ||
        mha__carve(&total, &p->keys, B, sizeof(dec_key)) ||
        mha__carve(&total, &p->items, (int64_t)p->itmax, sizeof(dec_item)))
        return mha__fail(MHA_ERR_OVERFLOW, "kv cache attend: scratch overflows");
    p->total = total;
    return MHA_OK;
}

// A decode call's state the items share.
typedef struct dec_call {
    const mha__attend_call *ac;
    const dec_plan *p;
    char *blk;  // the scratch block (dec_plan's offsets)
    const dec_group *grp;
    const dec_item *items;
} dec_call;

// Unit u of an item (its KV head hk, sequence b): its queries' records
// from qs[nv] on (their partials in the block, the scaled queries in the
// thread's rows sc), the segments of its chunk's rows looked up once, and
// its chunk *dc. Returns the item's queries so far.
static int64_t unit_setup(const dec_call *dc, const dec_item *item, const dec_group *gr,
                          int64_t u, float *sc, mha__dec_query *qs, int64_t nv,
                          mha__dec_seg *sg, mha__dec_chunk *out) {
    const mha__attend_call *ac = dc->ac;
    const dec_plan *p = dc->p;
    const mha__kv_rows *c = ac->c;
    const int64_t G = ac->G, T = ac->T, H = ac->H, D = ac->D, Dv = ac->Dv, CH = p->CH;
    const int64_t j0 = gr->ch * CH, nh = item->nh;
    const int64_t hk = item->hk + u / gr->m, b = gr->memb[u % gr->m], n = c->len[b],
                  Tb = ac->counts ? ac->counts[b] : T;
    const int64_t j1 = j0 + CH < n ? j0 + CH : n;
    const int64_t v0 = nv;
    float *part = (float *)(void *)(dc->blk + p->part);
    for (int64_t h = hk * G; h < (hk + 1) * G; h++)
        for (int64_t t = 0; t < Tb; t++) {
            float *pp = part + ((size_t)(((b * H + h) * p->nch + gr->ch) * T + t)) * p->per;
            int64_t lo, hi;  // query t sits at position n - Tb + t
            const mha__mask band = {.causal = true,
                                    .win_left = ac->a.opts.window_left,
                                    .win_right = ac->a.opts.window_right,
                                    .q_off = n - Tb + ac->q_shift};
            mha__mask_band(&band, t, n, &lo, &hi);
            if (lo < j0) lo = j0;
            if (hi > j1) hi = j1;
            pp[0] = -INFINITY;
            pp[1] = 0.0f;
            for (int64_t e = 0; e < Dv; e++) pp[2 + e] = 0.0f;
            if (lo >= hi) continue;
            qs[nv] = (mha__dec_query){h, n - Tb + t + ac->q_shift, lo, hi, pp};
            float *x = sc + (size_t)nv * p->qf + CH, *o = x + D;
            const float *qr = ac->qd + b * ac->q->stride[0] + h * ac->q->stride[1] +
                              t * ac->q->stride[2];
            for (int64_t e = 0; e < D; e++) x[e] = (float)ac->scale * qr[e];
            for (int64_t e = 0; e < Dv; e++) o[e] = 0.0f;
            if (p->i8)
                quantize_i8((int8_t *)(x + p->xi), x + p->xi + p->ldxi / 4, x, D, p->ldxi);
            if (p->i8 && p->i4q) split_i4((int8_t *)(x + p->xi), D);
            nv++;
        }
    // the segments of its chunk's rows, looked up once (heads read
    // together: head u's those of the item's first head moved on by u
    // heads, as such a source lays them out)
    const int64_t s0 = j0 / c->seg, s1 = (j1 - 1) / c->seg;
    const mha__dec_seg *sf = nh > 1 && u > 0 ? sg - (size_t)u * p->ns : NULL;
    const size_t kb = (size_t)(u * c->seg) * c->lk.rb, vb = (size_t)(u * c->seg) * c->lv.rb;
    for (int64_t g = s0; nv > v0 && g <= s1; g++) {
        mha__dec_seg *e = &sg[g - s0];
        const mha__dec_seg *f = sf ? &sf[g - s0] : NULL;
        if (!f) c->at(c->ctx, b, hk, g, &e->k, &e->v, &e->ks, &e->vs);
        else if (!f->k) *e = *f;  // (released)
        else
            *e = (mha__dec_seg){
                f->k + kb, f->v + vb,
                f->ks ? (const float *)(const void *)((const char *)f->ks + kb) : NULL,
                f->vs ? (const float *)(const void *)((const char *)f->vs + vb) : NULL};
    }
    *out = (mha__dec_chunk){
        ac->kt, c,  b,     hk,     j0, s0, CH, (int)c->dt, sc + (size_t)v0 * p->qf,
        p->qf,  sg, p->xi, p->ldxi};
    return nv;
}

// The scores' soft cap, ALiBi and softmax of an item's nv queries (their
// rows of the thread's sc), their (m, l) into their partials.
static void item_softmax(const dec_call *dc, float *sc, const mha__dec_query *qs, int64_t nv,
                         int64_t j0) {
    const mha__attend_call *ac = dc->ac;
    const mha_attn_opts *o = &ac->a.opts;
    for (int64_t v = 0; v < nv; v++) {
        const mha__dec_query *dq = &qs[v];
        float *s = sc + (size_t)v * dc->p->qf + (dq->lo - j0);
        const int64_t w = dq->hi - dq->lo;
        const float cap = o->softcap;
        if (cap > 0.0f)
            for (int64_t j = 0; j < w; j++) s[j] = cap * mha__softcap_tanh(s[j], cap);
        if (o->alibi_slopes)  // (the bias rounded once to float32)
            for (int64_t j = dq->lo; j < dq->hi; j++)
                s[j - dq->lo] += (float)mha__alibi_bias(o->alibi_slopes[dq->h], dq->p, j);
        float m = -INFINITY, l = 0.0f;
        (void)ac->kt->softmax_update(s, w, &m, &l);  // s <- exp(s - m)
        dq->pp[0] = m;
        dq->pp[1] = l;
    }
}

// Item it of a decode call, on thread id: its units' queries formed, the
// K pass (scores), the softmax, the V pass (outputs), its partials written.
static void decode_item(const dec_call *dc, int64_t it, int id) {
    const dec_plan *p = dc->p;
    const dec_item *item = &dc->items[it];
    const dec_group *gr = &dc->grp[item->g];
    const int64_t j0 = gr->ch * p->CH, js = gr->js, nh = item->nh;
    float *sc = (float *)(void *)(dc->blk + p->sc) + (size_t)id * p->tfl;
    mha__dec_query *qs = (mha__dec_query *)(void *)(dc->blk + p->q) + (size_t)id * p->qn;
    mha__dec_seg *tseg = (mha__dec_seg *)(void *)(dc->blk + p->seg);
    int64_t nv = 0;  // the item's queries so far
    // units: (KV head, member), one of the two alone
    const int64_t nu = gr->m * nh;
    mha__dec_chunk dcs[DEC_GROUP_Q];
    int64_t v0s[DEC_GROUP_Q + 1];
    for (int64_t u = 0; u < nu; u++) {
        v0s[u] = nv;
        mha__dec_seg *sg = tseg + ((size_t)id * (size_t)p->um + (size_t)u) * p->ns;
        nv = unit_setup(dc, item, gr, u, sc, qs, nv, sg, &dcs[u]);
    }
    v0s[nu] = nv;
    if (nv == 0) return;
    // the shared rows [j0, js) for all (every query sees them): through
    // the first sequence's segments, the scores and outputs indexed from
    // the item's first query
    mha__dec_chunk all = dcs[0];
    all.sc = sc;
    for (int pass = 0; pass < 2; pass++) {
        const bool isk = pass == 0;
        if (js > j0) shared_rows(&all, nv, j0, js, isk, NULL);
        // each sequence's other rows [js, ..): the keys its queries all see
        // for all of them, each query's others alone, in order
        if (nh == 1)
            for (int64_t u = 0; u < nu; u++)
                unit_rows(&dcs[u], qs + v0s[u], v0s[u + 1] - v0s[u], js, js, INT64_MAX, isk,
                          NULL);
        else heads_rows(dcs, qs, v0s, nu, js, isk);
        if (isk) item_softmax(dc, sc, qs, nv, j0);
    }
    for (int64_t v = 0; v < nv; v++)
        memcpy(qs[v].pp + 2, sc + (size_t)v * p->qf + p->CH + dc->ac->D,
               sizeof(float) * (size_t)dc->ac->Dv);
}

mha_status mha__kv_decode(const mha__attend_call *ac) {
    const mha__kv_rows *c = ac->c;
    dec_plan p;
    mha_status st = decode_plan(&p, ac);
    if (st) return st;
    if (p.nch == 0) return MHA_OK;  // nothing cached, so no queries either
    char *blk = mha__alloc(p.total);
    if (!blk)
        return mha__fail(MHA_ERR_NOMEM, "kv cache attend: out of memory for %zu bytes", p.total);
    dec_group *grp = (dec_group *)(void *)(blk + p.grp);
    dec_item *items = (dec_item *)(void *)(blk + p.items);
    const int64_t ngr = decode_groups(c, ac->counts, ac->T, p.CH, p.nch, p.share, p.mmax, grp,
                                      (int64_t *)(void *)(blk + p.memb),
                                      (dec_key *)(void *)(blk + p.keys));
    // items: (KV heads, group), a sequence's chunks after each other; a
    // sequence alone takes HI heads an item
    int64_t nit = 0;
    for (int64_t hk = 0; hk < c->Hkv; hk += p.HI) {
        const int64_t nh = c->Hkv - hk < p.HI ? c->Hkv - hk : p.HI;  // (this block of heads)
        for (int64_t g = 0; g < ngr; g++)
            if (grp[g].m == 1) items[nit++] = (dec_item){g, hk, nh};
            else
                for (int64_t h = hk; h < hk + nh; h++) items[nit++] = (dec_item){g, h, 1};
    }
    const dec_call dc = {ac, &p, blk, grp, items};
#pragma omp parallel for schedule(dynamic, 1) num_threads(ac->nt)
    for (int64_t it = 0; it < nit; it++) decode_item(&dc, it, mha__thread_id());
    attend_combine(ac, (const float *)(void *)(blk + p.part), p.nch, p.per,
                   (double *)(void *)(blk + p.acc));
    mha__free(blk);
    return MHA_OK;
}
