// flash.c: the fused attention driver for one (b, h) and a tile of query
// rows. For each tile of keys:
//   S (br, bc) = (scale q) k^T          gemm over a packed k^T tile
//   S += masks                          (-inf; causal/window by column bounds)
//   online softmax per row: m, l, and alpha = exp(m_old - m_new)
//   O = alpha O + P v                   (P after dropout, when training)
// then O /= l; m and 1/l are kept for the weights and the backward. Tiles
// entirely outside the causal/window band are skipped. Extra memory: the
// scratch below, O(BR*BC) plus the per-thread K^T (V^T) tile cache.
#include <math.h>
#include <string.h>

#include "flash.h"
#include "philox.h"
#include "internal.h"

#define BR MHA__FLASH_BR
#define BC MHA__FLASH_BC

// Scratch layout (floats), 64-byte pieces:
//   header (16 floats: the cache's identity) | qs (BR, D) | dos (BR, Dv) |
//   s (BR, BC) | dp (BR, BC) | tr (BC, BR) | m, l (BR each) | cv
//   (max(D, Dv): a half row converted) | bf16 compute: qb (BR, QBW(D)), pb
//   (BR, PBW), vb (a V tile of fewer keys, packed); the backward's db (dO
//   rows, BR x QBW(Dv)), t1, t2 (BC x TBW: dS^T and P'^T rows), qp, dp16
//   (a query tile's q and dO, packed), kb (a K tile of fewer keys, packed)
//   | flags (4 nt bytes) |
//   tile caches, nt tiles each: K^T (D, w), V rows (w, Dv), and for the
//   backward V^T (Dv, w), K rows (w, D); in bf16 compute K^T and V packed
//   by pack_bf16 (kernels.h)
// with nt = ceil(S / BC) + (nx > 0) key tiles; tile t holds keys
// [t BC, min(t BC + BC, S)) (the last one the nx appended keys), w wide.
// A cached tile is packed once per thread and head, on first use.
enum { C_KT, C_VR, C_VT, C_KR, C_KINDS };

typedef struct cache_hdr {
    const float *k, *v, *xk;
    int64_t nt;
    bool bf;
} cache_hdr;

static int64_t n_tiles(int64_t S, int64_t nx) { return (S + BC - 1) / BC + (nx > 0); }
static size_t round16(size_t n) { return (n + 15) & ~(size_t)15; }
static int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// bf16 compute: the widest summed-dimension pad of any table (AMX's 32)
// sizes the bf16 pieces, so the layout does not depend on the table.
#define KPAD_MAX 32
#define PBW round_up(BC, KPAD_MAX)  // P tile row stride (bf16 elements)
#define TBW round_up(BR, KPAD_MAX)  // transposed tiles' row stride (bf16)
static int64_t qbw(int64_t D) { return round_up(D, KPAD_MAX); }

// floats of one cached tile of `kind`: float32 or packed bf16 (K^T or V^T
// (D, w), K or V rows (w, D)), whichever is larger: the same for C_KT and
// C_KR, and for C_VR and C_VT
static size_t tile_floats(int kind, int64_t D, int64_t Dv) {
    const bool isk = kind == 0 || kind == 3;  // C_KT, C_KR
    const int64_t c = isk ? D : Dv;
    const size_t f32 = round16((size_t)(c * BC));
    const int64_t e1 = mha__bf16_packed_elems(c, BC, KPAD_MAX),
                  e2 = mha__bf16_packed_elems(BC, c, KPAD_MAX);
    const size_t bf = round16((size_t)(e1 > e2 ? e1 : e2) / 2);
    return f32 > bf ? f32 : bf;
}

// floats of qb, pb, vb, db, t1, t2, qp, dp16, kb
static size_t bf_floats(int64_t D, int64_t Dv) {
    return round16((size_t)(BR * qbw(D)) / 2) + round16((size_t)(BR * PBW) / 2) +
           round16((size_t)mha__bf16_packed_elems(BC, Dv, KPAD_MAX) / 2) +
           round16((size_t)(BR * qbw(Dv)) / 2) + 2 * round16((size_t)(BC * TBW) / 2) +
           round16((size_t)mha__bf16_packed_elems(BR, D, KPAD_MAX) / 2) +
           round16((size_t)mha__bf16_packed_elems(BR, Dv, KPAD_MAX) / 2) +
           round16((size_t)mha__bf16_packed_elems(BC, D, KPAD_MAX) / 2);
}

typedef struct scratch_map {
    cache_hdr *hdr;
    float *qs, *dos, *s, *dp, *tr, *m, *l, *cv;
    uint16_t *qb, *pb, *vb, *db, *t1, *t2, *qp, *dp16, *kb;
    float *cache[C_KINDS];
    size_t tile_floats[C_KINDS];
    unsigned char *done;  // (C_KINDS, nt)
    bool bf;              // bf16 compute (mha__flash_bf16)
} scratch_map;

static scratch_map map_scratch(float *sc, int64_t D, int64_t Dv, int64_t nt) {
    scratch_map m;
    m.hdr = (cache_hdr *)(void *)sc;
    float *p = sc + 16;
    m.qs = p, p += round16((size_t)(BR * D));
    m.dos = p, p += round16((size_t)(BR * Dv));
    m.s = p, p += BR * BC;
    m.dp = p, p += BR * BC;
    m.tr = p, p += BR * BC;
    m.m = p, p += BR;
    m.l = p, p += BR;
    m.cv = p, p += round16((size_t)(D > Dv ? D : Dv));
    m.qb = (uint16_t *)(void *)p, p += round16((size_t)(BR * qbw(D)) / 2);
    m.pb = (uint16_t *)(void *)p, p += round16((size_t)(BR * PBW) / 2);
    m.vb = (uint16_t *)(void *)p,
    p += round16((size_t)mha__bf16_packed_elems(BC, Dv, KPAD_MAX) / 2);
    m.db = (uint16_t *)(void *)p, p += round16((size_t)(BR * qbw(Dv)) / 2);
    m.t1 = (uint16_t *)(void *)p, p += round16((size_t)(BC * TBW) / 2);
    m.t2 = (uint16_t *)(void *)p, p += round16((size_t)(BC * TBW) / 2);
    m.qp = (uint16_t *)(void *)p,
    p += round16((size_t)mha__bf16_packed_elems(BR, D, KPAD_MAX) / 2);
    m.dp16 = (uint16_t *)(void *)p,
    p += round16((size_t)mha__bf16_packed_elems(BR, Dv, KPAD_MAX) / 2);
    m.kb = (uint16_t *)(void *)p,
    p += round16((size_t)mha__bf16_packed_elems(BC, D, KPAD_MAX) / 2);
    m.done = (unsigned char *)(void *)p;
    p += round16((size_t)(C_KINDS * nt + 3) / 4);
    for (int c = 0; c < C_KINDS; c++) {
        m.tile_floats[c] = tile_floats(c, D, Dv);
        m.cache[c] = p;
        p += (size_t)nt * m.tile_floats[c];
    }
    m.bf = false;
    return m;
}

size_t mha__flash_scratch_floats(int64_t D, int64_t Dv, int64_t S, int64_t nx, bool backward) {
    const int64_t nt = n_tiles(S, nx);
    return 16 + round16((size_t)(BR * D)) + round16((size_t)(BR * Dv)) + 3 * BR * BC + 2 * BR +
           round16((size_t)(D > Dv ? D : Dv)) + bf_floats(D, Dv) +
           round16((size_t)(C_KINDS * nt + 3) / 4) +
           (size_t)nt * (tile_floats(C_KT, D, Dv) + tile_floats(C_VR, D, Dv)) *
               (backward ? 2 : 1);
}

static _Atomic int g_force_bf16;

void mha__flash_force_bf16(bool on) { g_force_bf16 = on; }

bool mha__flash_bf16_table(const mha__kernels *kt) { return kt->bf_fast || g_force_bf16; }

bool mha__flash_bf16(const mha__kernels *kt, const mha__flash_head *a) {
    return !a->f32_compute && a->q_half == 1 && a->k_half == 1 && a->v_half == 1 &&
           a->nx == 0 && mha__flash_bf16_table(kt);
}

void mha__flash_scratch_reset(float *scratch) {
    cache_hdr *h = (cache_hdr *)(void *)scratch;
    h->k = h->v = h->xk = NULL;
    h->nt = 0;
}

// The scratch of head a, its cache emptied when it held another head (or
// the same in the other compute). fwd: for the forward (the backward
// computes in float32, bf16 rows converted as they load).
static scratch_map head_scratch(const mha__kernels *kt, const mha__flash_head *a, float *sc,
                                bool fwd) {
    const int64_t nt = n_tiles(a->S, a->nx);
    scratch_map m = map_scratch(sc, a->D, a->Dv, nt);
    m.bf = fwd && mha__flash_bf16(kt, a);
    if (m.hdr->k != a->k || m.hdr->v != a->v || m.hdr->xk != a->xk || m.hdr->nt != nt ||
        m.hdr->bf != m.bf) {
        m.hdr->k = a->k;
        m.hdr->v = a->v;
        m.hdr->xk = a->xk;
        m.hdr->nt = nt;
        m.hdr->bf = m.bf;
        memset(m.done, 0, (size_t)(C_KINDS * nt));
    }
    return m;
}

// Key tile t: first key and width.
static void tile_keys(const mha__flash_head *a, int64_t t, int64_t *j0, int64_t *w) {
    *j0 = t * BC;
    if (*j0 >= a->S) {
        *j0 = a->S;
        *w = a->nx;
    } else {
        *w = a->S - *j0 < BC ? a->S - *j0 : BC;
    }
}

// Row i of a view of float32 (half 0) or uint16_t (half 1, 2) elements,
// row stride rs.
static const void *row_at(const void *p, uint8_t half, int64_t i, int64_t rs) {
    return half ? (const void *)((const uint16_t *)p + i * rs)
                : (const void *)((const float *)p + i * rs);
}

// dst (n) = the row src of float32 or half elements, as float32 (exact).
static void load_row(const mha__kernels *kt, float *dst, const void *src, uint8_t half,
                     int64_t n) {
    if (half == 1) kt->cvt_bf16(dst, src, n);
    else if (half == 2) kt->cvt_f16(dst, src, n);
    else memcpy(dst, src, (size_t)n * sizeof(float));
}

// The tile holding key j0 (a multiple of BC, or S) in cache `kind`
// (transposed (D, w) for C_KT/C_VT, contiguous rows (w, D) for C_VR/C_KR),
// packed on first use.
static const float *packed_tile(const mha__kernels *kt, const mha__flash_head *a,
                                scratch_map *sm, int64_t j0, int kind) {
    const int64_t nt = n_tiles(a->S, a->nx), t = j0 >= a->S ? nt - 1 : j0 / BC;
    float *dst = sm->cache[kind] + (size_t)t * sm->tile_floats[kind];
    unsigned char *done = sm->done + kind * nt;
    if (!done[t]) {
        const bool isk = kind == C_KT || kind == C_KR, trans = kind == C_KT || kind == C_VT;
        const int64_t D = isk ? a->D : a->Dv;
        int64_t k0, w;
        tile_keys(a, t, &k0, &w);
        // a tile is either keys of the head (row stride rs) or the
        // appended ones (contiguous), never both
        const bool extra = k0 >= a->S;
        const uint8_t half = extra ? 0 : isk ? a->k_half : a->v_half;
        const int64_t rs = extra ? D : isk ? a->k_rs : a->v_rs;
        const void *rows = extra ? (const void *)((isk ? a->xk : a->xv) + (k0 - a->S) * D)
                                 : row_at(isk ? a->k : a->v, half, k0, rs);
        if (sm->bf && trans) {  // C_KT, C_VT (D, w): B(d, j) = k_j[d] (v_j[d])
            kt->pack_bf16((uint16_t *)dst, rows, 1, rs, D, w);
        } else if (sm->bf) {  // C_VR, C_KR (w, D)
            kt->pack_bf16((uint16_t *)dst, rows, rs, 1, w, D);
        } else if (half && trans) {  // each row converted, then into its column
            for (int64_t j = 0; j < w; j++) {
                load_row(kt, sm->cv, row_at(rows, half, j, rs), half, D);
                kt->transpose(dst + j, w, sm->cv, D, 1, D);
            }
        } else if (trans) {
            kt->transpose(dst, w, rows, rs, w, D);
        } else {
            for (int64_t j = 0; j < w; j++)
                load_row(kt, dst + j * D, row_at(rows, half, j, rs), half, D);
        }
        done[t] = 1;
    }
    return dst;
}

static int64_t width_of(const mha__flash_head *a, int64_t j0) {
    return j0 >= a->S ? a->nx : (a->S - j0 < BC ? a->S - j0 : BC);
}

// The band of keys row i may see by causal and window masks: [lo, hi).
static void row_band(const mha__flash_head *a, int64_t i, int64_t *lo, int64_t *hi) {
    mha__mask_band(a->mask, i, a->S, lo, hi);
}

static bool has_band(const mha__mask *mk) {
    return mk->causal || mk->win_left >= 0 || mk->win_right >= 0;
}

void mha__flash_key_range(const mha__flash_head *a, int64_t i0, int64_t i1, int64_t *lo,
                          int64_t *hi) {
    int64_t l0, h0, l1, h1;
    row_band(a, i0, &l0, &h0);
    row_band(a, i1 - 1, &l1, &h1);  // bands move right with i
    *lo = l0;
    *hi = h1 > *lo ? h1 : *lo;
}

// S (br, n) = qs kt + masks for rows [i0, i0 + br) and keys [j0, j0 + n)
// (n at most the tile's width).
// With a soft cap: s <- cap tanh(s / cap) first, and deriv (when not NULL)
// gets 1 - tanh^2, the cap's derivative, for the backward.
// bf16 compute with unscaled: S = q k^T, left for softmax_rows_bf16 to
// scale (the same products; only causal and window masks, whose -inf stay
// -inf, may apply: see unscaled_ok).
static void scores(const mha__kernels *kt, const mha__flash_head *a, scratch_map *sm, float *s,
                   int64_t i0, int64_t br, int64_t j0, int64_t n, float *deriv, bool unscaled) {
    const float *ktile = packed_tile(kt, a, sm, j0, C_KT);
    if (sm->bf)  // S = scale (q k^T): the bf16 rows, float32 sums
        kt->gemm_bf16(s, n, sm->qb, qbw(a->D), (const uint16_t *)ktile, width_of(a, j0), br, n,
                      a->D, unscaled ? 1.0f : a->scale, false);
    else kt->gemm_nn(s, n, sm->qs, a->D, ktile, width_of(a, j0), br, n, a->D);
    const mha__mask *mk = a->mask;
    if (mk->softcap > 0.0f) {
        const float cap = mk->softcap;
        for (int64_t e = 0; e < br * n; e++) {
            const float t = mha__softcap_tanh(s[e], cap);
            s[e] = cap * t;
            if (deriv) deriv[e] = 1.0f - t * t;
        }
    }
    if (j0 >= a->S) {  // appended keys are never masked; ALiBi still applies
        if (mk->alibi)
            for (int64_t r = 0; r < br; r++)
                for (int64_t j = 0; j < n; j++)
                    s[r * n + j] += (float)mha__mask_value(mk, a->b, a->h, i0 + r, j0 + j);
        return;
    }
    if (mk->attn || mk->kpm || mk->alibi) {
        for (int64_t r = 0; r < br; r++)
            for (int64_t j = 0; j < n; j++)
                s[r * n + j] += (float)mha__mask_value(mk, a->b, a->h, i0 + r, j0 + j);
    } else if (has_band(mk)) {
        for (int64_t r = 0; r < br; r++) {
            int64_t lo, hi;
            row_band(a, i0 + r, &lo, &hi);
            for (int64_t j = 0; j < n && j0 + j < lo; j++) s[r * n + j] = -INFINITY;
            for (int64_t j = hi - j0 > 0 ? hi - j0 : 0; j < n; j++) s[r * n + j] = -INFINITY;
        }
    }
}

static void drop_row(const mha__flash_head *a, float *row, int64_t i, int64_t j0, int64_t n) {
    const mha__dropout *d = a->drop;
    const float f = 1.0f / (1.0f - d->p);
    uint64_t base = (uint64_t)(((a->b * d->H + a->h) * d->L + i) * d->S + j0);
    for (int64_t j = 0; j < n; j++)
        row[j] *= mha__dropout_keep(d->seed, d->offset, MHA__DROPOUT_STREAM_ATTN_LO,
                                    MHA__DROPOUT_STREAM_ATTN_HI, base + (uint64_t)j, d->p)
                      ? f
                      : 0.0f;
}

// The key tiles rows [i0, i1) visit: aligned tiles of [lo, hi), then the
// appended keys. Iterate: for (j0 = first; next(&j0, &n); ) ...
typedef struct key_iter {
    int64_t j0, hi, S, nx;
    bool extra_done;
} key_iter;

static key_iter keys_of(const mha__flash_head *a, int64_t i0, int64_t i1) {
    int64_t lo, hi;
    mha__flash_key_range(a, i0, i1, &lo, &hi);
    key_iter it = {(lo / BC) * BC, hi, a->S, a->nx, a->nx == 0};
    if (lo >= hi) it.j0 = a->S;  // nothing in the band
    return it;
}

static bool next_tile(key_iter *it, int64_t *j0, int64_t *n) {
    if (it->j0 < it->hi && it->j0 < it->S) {
        *j0 = it->j0;
        *n = it->hi - it->j0 < BC ? it->hi - it->j0 : BC;
        it->j0 += BC;
        return true;
    }
    if (!it->extra_done) {
        it->extra_done = true;
        *j0 = it->S;
        *n = it->nx;
        return true;
    }
    return false;
}

// rows (br of them, row stride rs) of bf16 src into dst (row stride w):
// subnormals flushed, zero-padded to the table's bf_kpad columns (of n) and
// bf_mpad rows (the A operand rows gemm_bf16 reads: q, dO)
static void bf_rows(const mha__kernels *kt, uint16_t *dst, int64_t w, const uint16_t *src,
                    int64_t rs, int64_t br, int64_t n) {
    const int64_t kp = round_up(n, kt->bf_kpad);
    for (int64_t r = 0; r < round_up(br, kt->bf_mpad); r++) {
        uint16_t *d = dst + r * w;
        int64_t c = 0;
        if (r < br)
            for (const uint16_t *q = src + r * rs; c < n; c++)
                d[c] = (q[c] & 0x7f80) ? q[c] : (uint16_t)(q[c] & 0x8000);
        for (; c < kp; c++) d[c] = 0;
    }
}

// float32 rows (br, n) of src (row stride ls) rounded into bf16 rows of dst
// (row stride w), zero-padded as bf_rows; src NULL: dst's rows hold their
// n values already, only the padding is written
static void round_rows(const mha__kernels *kt, uint16_t *dst, int64_t w, const float *src,
                       int64_t ls, int64_t br, int64_t n) {
    const int64_t kp = round_up(n, kt->bf_kpad);
    for (int64_t r = 0; r < round_up(br, kt->bf_mpad); r++) {
        uint16_t *d = dst + r * w;
        int64_t c = 0;
        if (r < br) {
            if (src) kt->round_bf16(d, src + r * ls, n);
            c = n;
        }
        for (; c < kp; c++) d[c] = 0;
    }
}

// qs (br, D) = scale * q rows [i0, i0 + br) (half rows converted first:
// cv, max(D, Dv) floats of scratch); in bf16 compute qb (br, D) = the q
// rows, unscaled, subnormals flushed, zero-padded to the table's bf_kpad
// columns and bf_mpad rows.
static void load_q(const mha__kernels *kt, const mha__flash_head *a, scratch_map *sm,
                   int64_t i0, int64_t br) {
    float *qs = sm->qs, *cv = sm->cv;
    if (sm->bf) {
        bf_rows(kt, sm->qb, qbw(a->D), (const uint16_t *)(const void *)a->q + i0 * a->q_rs,
                a->q_rs, br, a->D);
        return;
    }
    for (int64_t r = 0; r < br; r++) {
        const float *q = cv;
        if (a->q_half)
            load_row(kt, cv, row_at(a->q, a->q_half, i0 + r, a->q_rs), a->q_half, a->D);
        else q = a->q + (i0 + r) * a->q_rs;
        for (int64_t c = 0; c < a->D; c++) qs[r * a->D + c] = a->scale * q[c];
    }
}

// bf16 compute: ob (br, Dv) += P v for keys [j0, j0 + n), P (the s tile,
// after dropout) rounded to bf16 (round_bf16) into pb, zero-padded to the
// table's bf_kpad columns and bf_mpad rows. A band cuts the tile (n less
// than its width): V's n rows packed on their own, so the keys past the
// band are never read.
// (P_ready: pb's rows [0, br) already hold P, from softmax_rows_bf16.)
static void pv_bf16(const mha__kernels *kt, const mha__flash_head *a, scratch_map *sm,
                    float *ob, int64_t ob_rs, int64_t br, int64_t j0, int64_t n, bool p_ready) {
    round_rows(kt, sm->pb, PBW, p_ready ? NULL : sm->s, n, br, n);
    const uint16_t *vt;
    int64_t nb = a->Dv;
    if (n == width_of(a, j0)) {
        vt = (const uint16_t *)packed_tile(kt, a, sm, j0, C_VR);
    } else {
        kt->pack_bf16(sm->vb, (const uint16_t *)a->v + j0 * a->v_rs, a->v_rs, 1, n, a->Dv);
        vt = sm->vb;
    }
    kt->gemm_bf16(ob, ob_rs, sm->pb, PBW, vt, nb, br, a->Dv, n, 1.0f, true);
}

void mha__flash_rows(const mha__kernels *kt, const mha__flash_head *a, int64_t i0, int64_t i1,
                     float *scratch) {
    const int64_t br = i1 - i0, Dv = a->Dv;
    scratch_map sm = head_scratch(kt, a, scratch, true);
    float *s = sm.s, *m = sm.m, *l = sm.l;
    load_q(kt, a, &sm, i0, br);
    // the output rows: o's own, or float32 scratch (dos) for a half o,
    // rounded into it at the end
    float *ob = a->o_half ? sm.dos : a->o + i0 * a->o_rs;
    const int64_t ob_rs = a->o_half ? Dv : a->o_rs;
    // an attention sink (mask->sinks) is a first key of logit sink and
    // value 0: the online softmax starts from (m, l) = (sink, 1)
    const float sink = a->mask && a->mask->sinks ? a->mask->sinks[a->h] : -INFINITY;
    for (int64_t r = 0; r < br; r++) {
        for (int64_t c = 0; c < Dv; c++) ob[r * ob_rs + c] = 0.0f;
        m[r] = sink;
        l[r] = sink > -INFINITY ? 1.0f : 0.0f;
    }
    key_iter it = keys_of(a, i0, i1);
    int64_t j0, n;
    // bf16 compute without dropout: one sweep for the softmax and P, the
    // scale too where no mask value needs the scaled scores
    const mha__mask *mk = a->mask;
    const bool fuse = sm.bf && !a->drop, unscaled = fuse && !(mk->softcap > 0.0f) &&
                                                    !mk->attn && !mk->kpm && !mk->alibi &&
                                                    a->scale > 0.0f;
    while (next_tile(&it, &j0, &n)) {
        float *alpha = sm.tr;  // (BR)
        if (fuse) {
            scores(kt, a, &sm, sm.s, i0, br, j0, n, NULL, unscaled);
            kt->softmax_rows_bf16(s, n, br, n, unscaled ? a->scale : 1.0f, m, l, alpha, sm.pb,
                                  PBW);
            for (int64_t r = 0; r < br; r++)
                if (alpha[r] != 1.0f) kt->scale_row(ob + r * ob_rs, Dv, alpha[r]);
            pv_bf16(kt, a, &sm, ob, ob_rs, br, j0, n, true);
            continue;
        }
        scores(kt, a, &sm, sm.s, i0, br, j0, n, NULL, false);
        kt->softmax_rows(s, n, br, n, m, l, alpha);
        for (int64_t r = 0; r < br; r++) {
            if (alpha[r] != 1.0f) kt->scale_row(ob + r * ob_rs, Dv, alpha[r]);
            if (a->drop) drop_row(a, s + r * n, i0 + r, j0, n);
        }
        if (sm.bf) pv_bf16(kt, a, &sm, ob, ob_rs, br, j0, n, false);
        else
            kt->gemm_nn_acc(ob, ob_rs, s, n, packed_tile(kt, a, &sm, j0, C_VR), Dv, br, Dv, n);
    }
    for (int64_t r = 0; r < br; r++) {
        float *o = ob + r * ob_rs;
        if (l[r] > 0.0f) {
            kt->scale_row(o, Dv, 1.0f / l[r]);
        } else if (!(l[r] == 0.0f)) {  // NaN: keep it
        } else {                       // every key masked: the fully-masked-row rule
            for (int64_t c = 0; c < Dv; c++) o[c] = 0.0f;
        }
        if (a->stats) {
            a->stats[2 * (i0 + r)] = m[r];
            a->stats[2 * (i0 + r) + 1] = l[r] == 0.0f ? 0.0f : 1.0f / l[r];
        }
        if (a->o_half) {  // rounded once, nearest even (mha__st of a float32 value)
            const mha__mat oh = {(uint16_t *)a->o + (i0 + r) * a->o_rs, false, 0, 1, a->o_half};
            mha__st_row(oh, o, Dv);
        }
    }
}

void mha__flash_weights(const mha__kernels *kt, const mha__flash_head *a, int64_t i0,
                        int64_t i1, mha__mat w, float *scratch) {
    const int64_t br = i1 - i0, total = a->S + a->nx;
    scratch_map sm = head_scratch(kt, a, scratch, true);
    load_q(kt, a, &sm, i0, br);
    for (int64_t r = 0; r < br; r++)  // zeros outside the band
        for (int64_t j = 0; j < total; j++) mha__st(w, r, j, 0.0);
    key_iter it = keys_of(a, i0, i1);
    int64_t j0, n;
    while (next_tile(&it, &j0, &n)) {
        scores(kt, a, &sm, sm.s, i0, br, j0, n, NULL, false);
        kt->exp_scale_rows(sm.s, n, br, n, a->stats + 2 * i0);  // P = exp(S - m) / l
        for (int64_t r = 0; r < br; r++) {
            float *row = sm.s + r * n;
            if (a->drop) drop_row(a, row, i0 + r, j0, n);
            for (int64_t j = 0; j < n; j++) mha__st(w, r, j0 + j, row[j]);
        }
    }
}

// ---------------------------------------------------------------------------
// Backward

// For query rows [i0, i0 + br) (qs loaded; dOt their dO rows) and keys
// [j0, j0 + n): s <- P and
// dp <- dP = (dO v^T) * drop, recomputed from q, k, v and the stats. The
// same tile always gives the same bits (same kernels, same shapes), which
// the softmax backward below relies on.
static void bwd_tile(const mha__kernels *kt, const mha__flash_head *a, scratch_map *sm,
                     const float *dOt, int64_t do_rs, int64_t i0, int64_t br, int64_t j0,
                     int64_t n, float *s, float *dp, float *deriv) {
    scores(kt, a, sm, s, i0, br, j0, n, deriv, false);      // S = cap(scale q k^T) + mask
    kt->exp_scale_rows(s, n, br, n, a->stats + 2 * i0);     // P = exp(S - m) / l
    const float *vtile = packed_tile(kt, a, sm, j0, C_VT);  // dP' = dO v^T
    kt->gemm_nn(dp, n, dOt, do_rs, vtile, width_of(a, j0), br, n, a->Dv);
    if (a->drop)  // dP = dP' * drop (the factor is 0 or 1/(1-p))
        for (int64_t r = 0; r < br; r++) drop_row(a, dp + r * n, i0 + r, j0, n);
}

// dp <- dS = P (dP - Dsum) row by row (times the soft cap's derivative,
// when there is one: the gradient of the raw scaled scores); then
// s <- P' = P * drop.
static void softmax_bwd(const mha__kernels *kt, const mha__flash_head *a, const float *Dsum,
                        int64_t i0, int64_t br, int64_t j0, int64_t n, float *s, float *dp,
                        const float *deriv) {
    kt->dsoftmax_rows(dp, s, n, br, n, Dsum + i0);
    if (a->mask->softcap > 0.0f)
        for (int64_t e = 0; e < br * n; e++) dp[e] *= deriv[e];
    if (a->drop)
        for (int64_t r = 0; r < br; r++) drop_row(a, s + r * n, i0 + r, j0, n);
}

// The query rows that can see keys [j0, j0 + n) through the band: tiles
// from a multiple of BR up to *hi.
static void rows_of_keys(const mha__flash_head *a, int64_t j0, int64_t n, int64_t *lo,
                         int64_t *hi) {
    const mha__mask *mk = a->mask;
    int64_t l = 0, h = a->L;
    if (j0 < a->S) {  // positions i + q_off
        const int64_t o = mk->q_off;
        if (mk->causal && j0 - o > l) l = j0 - o;
        if (mk->win_right >= 0 && j0 - mk->win_right - o > l) l = j0 - mk->win_right - o;
        if (mk->win_left >= 0 && j0 + n + mk->win_left - o < h) h = j0 + n + mk->win_left - o;
    }
    *lo = (l / BR) * BR;
    *hi = h;
}

void mha__flash_bwd_kv(const mha__kernels *kt, const mha__flash_head *a, const float *dO,
                       int64_t do_rs, const float *Dsum, int64_t j0, int64_t n, float *dk,
                       int64_t dk_rs, float *dv, int64_t dv_rs, bool acc, float *scratch) {
    const int64_t D = a->D, Dv = a->Dv;
    scratch_map sm = head_scratch(kt, a, scratch, false);
    float *s = sm.s, *dp = sm.dp;
    for (int64_t j = 0; j < n && !acc; j++) {
        for (int64_t c = 0; c < D; c++) dk[j * dk_rs + c] = 0.0f;
        for (int64_t c = 0; c < Dv; c++) dv[j * dv_rs + c] = 0.0f;
    }
    int64_t rlo, rhi;
    rows_of_keys(a, j0, n, &rlo, &rhi);
    for (int64_t i0 = rlo; i0 < rhi; i0 += BR) {
        int64_t br = a->L - i0 < BR ? a->L - i0 : BR;
        load_q(kt, a, &sm, i0, br);
        bwd_tile(kt, a, &sm, dO + i0 * do_rs, do_rs, i0, br, j0, n, s, dp, sm.tr);
        softmax_bwd(kt, a, Dsum, i0, br, j0, n, s, dp, sm.tr);
        // dv (n, Dv) += P'^T (n, br) dO (br, Dv)
        kt->gemm_tn_acc(dv, dv_rs, s, n, dO + i0 * do_rs, do_rs, n, Dv, br);
        // dk (n, D) += dS^T (n, br) (scale q) (br, D)
        kt->gemm_tn_acc(dk, dk_rs, dp, n, sm.qs, D, n, D, br);
    }
}

// Dsum[i0, i1) = rowsum(dO * O) (FlashAttention-2's D, from the
// forward's context O = a->o), each row through the very kernel dP = dO
// v^T uses (gemm_nn, one (1, Dv) x (Dv, 1) product: the same per-element
// sum order), so that a one-hot row (O = v_j exactly) gets Dsum = dP_j. A
// fully masked row (O = 0) gets 0.
static void dsum_rows(const mha__kernels *kt, const mha__flash_head *a, const float *dO,
                      int64_t do_rs, float *Dsum, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++)
        kt->gemm_nn(Dsum + i, 1, dO + i * do_rs, a->Dv, a->o + i * a->o_rs, 1, 1, 1, a->Dv);
}

// Whether a row of [i0, i1) is near one-hot: its largest weight P = 1/l
// (exp(0) / l) above 1 - MHA__FLASH_SAT (flash.h).
static bool block_saturated(const mha__flash_head *a, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++)
        if (a->stats[2 * i + 1] > 1.0f - MHA__FLASH_SAT) return true;
    return false;
}

// Dsum[i0, i1) of one query tile (at most BR rows): rowsum(dO * O), or
// for a near one-hot tile (flash.h) sum_j P dP over the tiles the dS use
// (a sweep more; q_loaded: sm->qs holds the tile's scaled q already).
static void block_dsum(const mha__kernels *kt, const mha__flash_head *a, scratch_map *sm,
                       const float *dO, int64_t do_rs, float *Dsum, int64_t i0, int64_t i1,
                       bool q_loaded) {
    const int64_t br = i1 - i0;
    if (!block_saturated(a, i0, i1)) {
        dsum_rows(kt, a, dO, do_rs, Dsum, i0, i1);
        return;
    }
    if (!q_loaded) load_q(kt, a, sm, i0, br);
    for (int64_t r = 0; r < br; r++) Dsum[i0 + r] = 0.0f;
    key_iter it = keys_of(a, i0, i1);
    int64_t j0, n;
    while (next_tile(&it, &j0, &n)) {
        bwd_tile(kt, a, sm, dO + i0 * do_rs, do_rs, i0, br, j0, n, sm->s, sm->dp, sm->tr);
        kt->dot_acc_rows(Dsum + i0, sm->s, sm->dp, n, br, n);  // 16 partial sums per row
    }
}

// Pass B for rows [i0, i1) (see flash.h); with dk != NULL also the rows'
// share of dk, dv, dxk, dxv (accumulated: the caller zeroes them). One
// sweep over the key tiles: each tile's P, dP, dS recomputed into the
// (BR, BC) tiles of the scratch and used at once.
static void bwd_rows(const mha__kernels *kt, const mha__flash_head *a, const float *dO,
                     int64_t do_rs, float *Dsum, int64_t i0, int64_t i1, float *dq,
                     int64_t dq_rs, float *dk, int64_t dk_rs, float *dv, int64_t dv_rs,
                     float *dxk, float *dxv, float *scratch) {
    const int64_t D = a->D, Dv = a->Dv, br = i1 - i0;
    scratch_map sm = head_scratch(kt, a, scratch, false);
    load_q(kt, a, &sm, i0, br);
    // the rows' dO, contiguous (the GEMMs below read it as rows of Dv)
    for (int64_t r = 0; r < br; r++)
        memcpy(sm.dos + r * Dv, dO + (i0 + r) * do_rs, sizeof(float) * (size_t)Dv);
    const float *dOt = sm.dos;  // the tile's dO rows, row stride Dv
    if (!a->dsum_fixed) block_dsum(kt, a, &sm, dO, do_rs, Dsum, i0, i1, true);
    float *s = sm.s, *dp = sm.dp, *deriv = sm.tr;
    int64_t j0, n;
    for (int64_t r = 0; r < br; r++)
        for (int64_t c = 0; c < D; c++) dq[r * dq_rs + c] = 0.0f;
    key_iter it = keys_of(a, i0, i1);
    while (next_tile(&it, &j0, &n)) {
        bwd_tile(kt, a, &sm, dOt, Dv, i0, br, j0, n, s, dp, deriv);  // s <- P, dp <- dP
        softmax_bwd(kt, a, Dsum, i0, br, j0, n, s, dp, deriv);       // dp <- dS, s <- P'
        // dq (br, D) += dS (br, n) k (n, D), then * scale below
        kt->gemm_nn_acc(dq, dq_rs, dp, n, packed_tile(kt, a, &sm, j0, C_KR), D, br, D, n);
        if (dk) {
            const bool x = j0 >= a->S;
            kt->gemm_tn_acc(x ? dxv : dv + j0 * dv_rs, x ? Dv : dv_rs, s, n, dOt, Dv, n, Dv, br);
            kt->gemm_tn_acc(x ? dxk : dk + j0 * dk_rs, x ? D : dk_rs, dp, n, sm.qs, D, n, D, br);
        }
    }
    for (int64_t r = 0; r < br; r++) kt->scale_row(dq + r * dq_rs, D, a->scale);
}

void mha__flash_bwd_q(const mha__kernels *kt, const mha__flash_head *a, const float *dO,
                      int64_t do_rs, float *Dsum, int64_t i0, int64_t i1, float *dq,
                      int64_t dq_rs, float *scratch) {
    bwd_rows(kt, a, dO, do_rs, Dsum, i0, i1, dq, dq_rs, NULL, 0, NULL, 0, NULL, NULL, scratch);
}

// The width of key tile j0 (a multiple of BC, or S: the appended keys)
// that query tile [i0, i1) visits, as keys_of gives it; 0: not visited.
static int64_t pair_width(const mha__flash_head *a, int64_t i0, int64_t i1, int64_t j0) {
    if (j0 >= a->S) return a->nx;
    int64_t lo, hi;
    mha__flash_key_range(a, i0, i1, &lo, &hi);
    if (lo >= hi || j0 < (lo / BC) * BC || j0 >= hi) return 0;
    return hi - j0 < BC ? hi - j0 : BC;
}

// Key tile outer, query tile inner (FlashAttention-2's loop order): while
// a key tile's dk, dv rows and its K^T, V^T, K tiles stay in cache, the
// query tiles' q, dO and dq rows stream by. Every (query tile, key tile)
// pair of pass B, with the same widths: each dq element receives the same
// terms in the same (key tile) order as in pass B, each dk, dv element the
// same (query tile) order as in pass A.
void mha__flash_bwd_head(const mha__kernels *kt, const mha__flash_head *a, const float *dO,
                         int64_t do_rs, float *Dsum, float *dq, int64_t dq_rs, float *dk,
                         int64_t dk_rs, float *dv, int64_t dv_rs, float *dxk, float *dxv,
                         bool acc, float *scratch) {
    const int64_t D = a->D, Dv = a->Dv, L = a->L;
    for (int64_t j = 0; j < a->S + a->nx && !acc; j++) {
        float *kr = j < a->S ? dk + j * dk_rs : dxk + (j - a->S) * D;
        float *vr = j < a->S ? dv + j * dv_rs : dxv + (j - a->S) * Dv;
        for (int64_t c = 0; c < D; c++) kr[c] = 0.0f;
        for (int64_t c = 0; c < Dv; c++) vr[c] = 0.0f;
    }
    scratch_map sm = head_scratch(kt, a, scratch, false);
    for (int64_t i0 = 0; i0 < L; i0 += BR) {
        const int64_t i1 = mha__tile_end(i0, BR, L);
        if (!a->dsum_fixed) block_dsum(kt, a, &sm, dO, do_rs, Dsum, i0, i1, false);
        for (int64_t i = i0; i < i1; i++)
            for (int64_t c = 0; c < D; c++) dq[i * dq_rs + c] = 0.0f;
    }
    float *s = sm.s, *dp = sm.dp, *deriv = sm.tr;
    for (int64_t t = 0; t < n_tiles(a->S, a->nx); t++) {
        int64_t j0, w;
        tile_keys(a, t, &j0, &w);
        const bool x = j0 >= a->S;
        float *dvt = x ? dxv : dv + j0 * dv_rs, *dkt = x ? dxk : dk + j0 * dk_rs;
        const int64_t dvs = x ? Dv : dv_rs, dks = x ? D : dk_rs;
        for (int64_t i0 = 0; i0 < L; i0 += BR) {
            const int64_t i1 = mha__tile_end(i0, BR, L), br = i1 - i0;
            const int64_t n = pair_width(a, i0, i1, j0);
            if (n <= 0) continue;
            const float *dOt = dO + i0 * do_rs;
            load_q(kt, a, &sm, i0, br);
            bwd_tile(kt, a, &sm, dOt, do_rs, i0, br, j0, n, s, dp, deriv);  // P, dP
            softmax_bwd(kt, a, Dsum, i0, br, j0, n, s, dp, deriv);          // dS, P'
            // dq (br, D) += dS (br, n) k (n, D), then * scale below
            kt->gemm_nn_acc(dq + i0 * dq_rs, dq_rs, dp, n, packed_tile(kt, a, &sm, j0, C_KR),
                            D, br, D, n);
            kt->gemm_tn_acc(dvt, dvs, s, n, dOt, do_rs, n, Dv, br);  // dv += P'^T dO
            kt->gemm_tn_acc(dkt, dks, dp, n, sm.qs, D, n, D, br);    // dk += dS^T (scale q)
        }
        if (a->progress) a->progress(a->progress_arg);
    }
    for (int64_t i = 0; i < L; i++) kt->scale_row(dq + i * dq_rs, D, a->scale);
}

// ---------------------------------------------------------------------------
// The backward in bf16 (mha__flash_bwd_head_bf16): the tiles' products on
// bf16 operands with float32 sums (gemm_bf16), the softmax's backward in
// float32.

// s <- P and dp <- dP = (dO v^T) * drop for rows [i0, i0 + br) (qb and db
// loaded) and keys [j0, j0 + n): the bf16 scores and dO v^T
static void bwd_tile_bf16(const mha__kernels *kt, const mha__flash_head *a, scratch_map *sm,
                          int64_t i0, int64_t br, int64_t j0, int64_t n, float *s, float *dp,
                          float *deriv) {
    scores(kt, a, sm, s, i0, br, j0, n, deriv, false);   // S = cap(scale q k^T) + mask
    kt->exp_scale_rows(s, n, br, n, a->stats + 2 * i0);  // P = exp(S - m) / l
    const uint16_t *vt = (const uint16_t *)packed_tile(kt, a, sm, j0, C_VT);
    kt->gemm_bf16(dp, n, sm->db, qbw(a->Dv), vt, width_of(a, j0), br, n, a->Dv, 1.0f, false);
    if (a->drop)
        for (int64_t r = 0; r < br; r++) drop_row(a, dp + r * n, i0 + r, j0, n);
}

// Dsum of rows [i0, i1) (qb loaded by the caller's load_q below): from O,
// or for a near one-hot tile sum_j P dP over the bf16 tiles the dS use
static void block_dsum_bf16(const mha__kernels *kt, const mha__flash_head *a, scratch_map *sm,
                            const float *dO, int64_t do_rs, const uint16_t *dO16,
                            int64_t d16_rs, float *Dsum, int64_t i0, int64_t i1) {
    const int64_t br = i1 - i0;
    if (!block_saturated(a, i0, i1)) {
        dsum_rows(kt, a, dO, do_rs, Dsum, i0, i1);
        return;
    }
    load_q(kt, a, sm, i0, br);
    bf_rows(kt, sm->db, qbw(a->Dv), dO16 + i0 * d16_rs, d16_rs, br, a->Dv);
    for (int64_t r = 0; r < br; r++) Dsum[i0 + r] = 0.0f;
    key_iter it = keys_of(a, i0, i1);
    int64_t j0, n;
    while (next_tile(&it, &j0, &n)) {
        bwd_tile_bf16(kt, a, sm, i0, br, j0, n, sm->s, sm->dp, sm->tr);
        kt->dot_acc_rows(Dsum + i0, sm->s, sm->dp, n, br, n);
    }
}

void mha__flash_bwd_head_bf16(const mha__kernels *kt, const mha__flash_head *a, const float *dO,
                              int64_t do_rs, const uint16_t *dO16, int64_t d16_rs, float *Dsum,
                              float *dq, int64_t dq_rs, float *dk, int64_t dk_rs, float *dv,
                              int64_t dv_rs, bool acc, float *scratch) {
    const int64_t D = a->D, Dv = a->Dv, L = a->L;
    for (int64_t j = 0; j < a->S && !acc; j++) {
        for (int64_t c = 0; c < D; c++) dk[j * dk_rs + c] = 0.0f;
        for (int64_t c = 0; c < Dv; c++) dv[j * dv_rs + c] = 0.0f;
    }
    scratch_map sm = head_scratch(kt, a, scratch, true);
    for (int64_t i0 = 0; i0 < L; i0 += BR) {
        const int64_t i1 = mha__tile_end(i0, BR, L);
        if (!a->dsum_fixed) block_dsum_bf16(kt, a, &sm, dO, do_rs, dO16, d16_rs, Dsum, i0, i1);
        for (int64_t i = i0; i < i1; i++)
            for (int64_t c = 0; c < D; c++) dq[i * dq_rs + c] = 0.0f;
    }
    float *s = sm.s, *dp = sm.dp, *deriv = sm.tr;
    const uint16_t *q16 = (const uint16_t *)(const void *)a->q;
    // query tiles outer: each tile's q and dO rows staged and packed once
    // (the key tiles' packed K and V come from the head's cache); every dq,
    // dk, dv element still receives its terms in mha__flash_bwd_head's
    // order (dq over key tiles, dk and dv over query tiles, increasing)
    for (int64_t i0 = 0; i0 < L; i0 += BR) {
        const int64_t i1 = mha__tile_end(i0, BR, L), br = i1 - i0;
        load_q(kt, a, &sm, i0, br);
        bf_rows(kt, sm.db, qbw(Dv), dO16 + i0 * d16_rs, d16_rs, br, Dv);
        kt->pack_bf16(sm.qp, q16 + i0 * a->q_rs, a->q_rs, 1, br, D);
        kt->pack_bf16(sm.dp16, dO16 + i0 * d16_rs, d16_rs, 1, br, Dv);
        for (int64_t t = 0; t < n_tiles(a->S, 0); t++) {
            int64_t j0, w;
            tile_keys(a, t, &j0, &w);
            const int64_t n = pair_width(a, i0, i1, j0);
            if (n <= 0) continue;
            bwd_tile_bf16(kt, a, &sm, i0, br, j0, n, s, dp, deriv);  // P, dP
            softmax_bwd(kt, a, Dsum, i0, br, j0, n, s, dp, deriv);   // dS, P'
            // scale dS, rounded once to bf16: dq += (scale dS) k and
            // dk += (scale dS)^T q
            for (int64_t r = 0; r < br; r++) kt->scale_row(dp + r * n, n, a->scale);
            round_rows(kt, sm.pb, PBW, dp, n, br, n);
            const uint16_t *kr;
            if (n == w) {
                kr = (const uint16_t *)packed_tile(kt, a, &sm, j0, C_KR);
            } else {  // the band cuts the tile: its n keys only (the rest never read)
                kt->pack_bf16(sm.kb, (const uint16_t *)(const void *)a->k + j0 * a->k_rs,
                              a->k_rs, 1, n, D);
                kr = sm.kb;
            }
            kt->gemm_bf16(dq + i0 * dq_rs, dq_rs, sm.pb, PBW, kr, D, br, D, n, 1.0f, true);
            // the transposed tiles (n, br): (scale dS)^T into t1, P'^T into t2
            kt->transpose(sm.tr, br, dp, n, br, n);
            round_rows(kt, sm.t1, TBW, sm.tr, br, n, br);
            kt->transpose(sm.tr, br, s, n, br, n);
            round_rows(kt, sm.t2, TBW, sm.tr, br, n, br);
            kt->gemm_bf16(dv + j0 * dv_rs, dv_rs, sm.t2, TBW, sm.dp16, Dv, n, Dv, br, 1.0f,
                          true);  // dv += P'^T dO
            kt->gemm_bf16(dk + j0 * dk_rs, dk_rs, sm.t1, TBW, sm.qp, D, n, D, br, 1.0f,
                          true);  // dk += (scale dS)^T q
        }
        if (a->progress) a->progress(a->progress_arg);
    }
}
