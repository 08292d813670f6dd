// splitkv_prefetch.c: the prefetch scheduling of the split-KV decode over
// a row source in segments (a paged cache's blocks), beside the kernels'
// own look-ahead (kernels/x86_prefetch.h): which segments to touch ahead
// of the piece being read, and the one the kernel fetches while it runs.
#include "splitkv.h"

// Decode over a cache in segments (a paged cache's blocks): the rows after
// a piece lie apart, so neither the kernels' look-ahead (within a call) nor
// the hardware's (within a page) reaches them. While the piece in segment s
// is read, the kernel fetches segment s + near (the one MHA__DEC_NEAR bytes
// ahead: the pf argument, spread over the call) and the driver touches the
// first lines of segment s + far (MHA__DEC_FAR bytes ahead, into L2: the
// hardware's streamer then brings the rest of its page); the first piece
// of a range fetches those in between at once. Measured on the Xeon, a
// 256k-token decode over 16-token blocks scattered over the pool: 1.6x
// faster than a window of plain prefetches ahead of each piece.

// Before the piece [p0, p1) of the range [.., hi) is read: the segments
// ahead (above), counted from the piece's last, as many new ones near and
// far as the piece has segments (a piece of several segments moves the
// look-ahead on by as many); *pf, *pfb: the one for the kernel to fetch
// while it runs (NULL, 0: the range's last piece).
static void prefetch_ahead(const mha__dec_chunk *dc, int64_t p0, int64_t p1, int64_t hi,
                           bool isk, bool first, const void **pf, size_t *pfb) {
    const mha__kv_rows *c = dc->c;
    *pf = NULL, *pfb = 0;
    if (p1 >= hi) return;  // the range's last piece
    const size_t sb = (size_t)c->seg * (isk ? c->lk.rb : c->lv.rb);
    const int64_t kn = (int64_t)((MHA__DEC_NEAR + sb - 1) / sb),
                  kf = (int64_t)((MHA__DEC_FAR + sb - 1) / sb);
    // (p1 starts a segment: the piece ends at one; m: its segments before
    // its last)
    const int64_t s = p1 / c->seg - 1, m = s - p0 / c->seg;
    const char *p = NULL;
    // (the first piece: all of them; then the new far ones, and the new
    // near ones before the kernel's, the pieces' kernels having fetched one
    // each)
    for (int64_t i = first ? 1 : kf - m > kn ? kf - m : kn; i <= kf; i++) {
        const size_t n = mha__dec_seg_bytes(dc, s + i, hi, isk, &p);
        if (!n) break;
        if (i < kn) mha__dec_touch(p, n, -1);
        else if (i > kn || kn == kf) mha__dec_touch(p, n, MHA__DEC_FAR_LINES);
    }
    for (int64_t i = kn - m > 1 ? kn - m : 1; !first && i < kn; i++) {
        const size_t n = mha__dec_seg_bytes(dc, s + i, hi, isk, &p);
        if (!n) break;
        mha__dec_touch(p, n, -1);
    }
    // (at most MHA__DEC_NEAR bytes of it: a segment larger than that is left to
    // the kernel's own look-ahead after its first MHA__DEC_NEAR bytes, as a
    // contiguous cache's rows are; a whole 48 KiB block fetched into L1
    // while the kernel reads one was 13% slower at 192 tokens a block)
    if ((*pfb = mha__dec_seg_bytes(dc, s + kn, hi, isk, &p))) *pf = p;
    if (*pfb > MHA__DEC_NEAR) *pfb = MHA__DEC_NEAR;
    // (int8 / int4: the scales of the segments up to the kernel's, which
    // fetches rows only: the first piece those from the next on, then each
    // piece the new ones; none when they lie in the rows)
    const int64_t ns = (isk ? c->lk.so : c->lv.so) ? 0 : isk ? c->lk.ns : c->lv.ns;
    for (int64_t i = first ? 1 : kn - m; ns && i <= kn; i++) {
        const int64_t e = (s + i + 1) * c->seg < hi ? (s + i + 1) * c->seg : hi;
        if (!mha__dec_seg_bytes(dc, s + i, hi, isk, &p)) break;
        const mha__dec_seg *g = &dc->seg[s + i - dc->s0];
        mha__dec_touch((const char *)(isk ? g->ks : g->vs),
                       (size_t)((e - (s + i) * c->seg) * ns) * 4, -1);
    }
}

// The look-ahead for the piece [r, p1) of the range [r0, r1): the caller's
// (ah non-NULL: its rows for the first call, then none), else the piece's
// own (prefetch_ahead).
void mha__dec_look_ahead(const mha__dec_chunk *dc, int64_t r0, int64_t r, int64_t p1,
                         int64_t r1, bool isk, mha__dec_ahead *ah, const void **pf,
                         size_t *pfb) {
    if (!ah) {
        prefetch_ahead(dc, r, p1, r1, isk, r == r0, pf, pfb);
        return;
    }
    *pf = ah->pf, *pfb = ah->pfb;
    ah->pf = NULL, ah->pfb = 0;
}
