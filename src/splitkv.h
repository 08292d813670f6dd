// splitkv.h: the pieces of the split-KV decode (splitkv.c) that its
// prefetch scheduling (splitkv_prefetch.c) reads. Internal to the fast
// path.
#ifndef MHA_SPLITKV_H
#define MHA_SPLITKV_H

#include <stdbool.h>

#include "kvcache.h"

// One query (head h, at position p) of a group against a chunk: its visible
// keys [lo, hi) and its partial (m, l, O).
typedef struct mha__dec_query {
    int64_t h, p, lo, hi;
    float *pp;
} mha__dec_query;

// Where a segment's rows are (mha__kv_rows.at): its first K and V rows and
// their int8 / int4 scales (all NULL: released).
typedef struct mha__dec_seg {
    const char *k, *v;
    const float *ks, *vs;
} mha__dec_seg;

// A chunk's rows (those of sequence b, KV head hk, from the chunk's first
// key j0, in the source's segments: those from segment s0 on, looked up
// once, in seg) and the thread's per-query floats: qf per query, scores
// (indexed from j0), scaled query, unnormalised output.
typedef struct mha__dec_chunk {
    const mha__kernels *kt;
    const mha__kv_rows *c;
    int64_t b, hk, j0, s0, ch;
    int kind;
    float *sc;
    size_t qf;
    const mha__dec_seg *seg;
    // int8 rows scored against the queries' int8 forms (dot_rows_i8): each
    // query's bytes xi floats on from its scaled query, its scale ldxi / 4
    // floats after them (0: the float32 scores, dot_rows_q)
    int64_t xi, ldxi;
} mha__dec_chunk;

// The look-ahead of a heads-together read (attend_decode): the rows for
// the next kernel call to fetch while it runs (the first call takes them;
// NULL: none).
typedef struct mha__dec_ahead {
    const void *pf;
    size_t pfb;
} mha__dec_ahead;

// The look-ahead's distances (splitkv_prefetch.c): the segment DEC_NEAR
// bytes ahead fetched by the kernel while it runs, the first
// DEC_FAR_LINES lines of the one DEC_FAR bytes ahead touched into L2.
#define MHA__DEC_NEAR 12288
#define MHA__DEC_FAR 65536
#define MHA__DEC_FAR_LINES 2

// Rows of segment s in [.., hi): where its K (isk) or V rows start and
// their bytes (0: none, or released).
static inline size_t mha__dec_seg_bytes(const mha__dec_chunk *dc, int64_t s, int64_t hi,
                                        bool isk, const char **p) {
    const mha__kv_rows *c = dc->c;
    const int64_t r = s * c->seg, e = (s + 1) * c->seg < hi ? (s + 1) * c->seg : hi;
    if (r >= hi) return 0;
    const mha__dec_seg *g = &dc->seg[s - dc->s0];
    *p = isk ? g->k : g->v;
    return *p ? (size_t)(e - r) * (isk ? c->lk.rb : c->lv.rb) : 0;
}

// Prefetches bytes at p: all of them (lines < 0, into L1) or their first
// lines (into L2).
static inline void mha__dec_touch(const char *p, size_t bytes, int lines) {
#if defined(__GNUC__) || defined(__clang__)
    for (size_t b = 0; b < bytes && (lines < 0 || b < (size_t)lines * 64); b += 64) {
        if (lines < 0) __builtin_prefetch(p + b, 0, 3);
        else __builtin_prefetch(p + b, 0, 1);
    }
#else
    (void)p, (void)bytes, (void)lines;
#endif
}

// The look-ahead for the piece [r, p1) of the range [r0, r1): the caller's
// (ah non-NULL: its rows for the first call, then none), else the piece's
// own: the segments ahead touched, and *pf, *pfb the one for the kernel to
// fetch while it runs (splitkv_prefetch.c).
void mha__dec_look_ahead(const mha__dec_chunk *dc, int64_t r0, int64_t r, int64_t p1,
                         int64_t r1, bool isk, mha__dec_ahead *ah, const void **pf,
                         size_t *pfb);

#endif
