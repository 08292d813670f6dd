// paged_attend.c: the attention over a paged cache
// (mha_paged_cache_attend): the blocks as the row source's segments of
// kvcache.c's drivers (a sequence's results are the bits of a contiguous
// cache holding the same tokens), its checks that no query reaches
// released tokens, the state word's shared side (attends run together);
// and the tests' view, a digest of the whole state.
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache.h"
#include "paged.h"

// ---------------------------------------------------------------------------
// The state word's shared side (paged.c: a change runs alone).

static mha_status paged_enter_read(mha_paged_cache *c, const char *what) {
    int s = atomic_load(&c->state);
    do {
        if (s < 0)
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "%s: the paged cache is being changed by another call", what);
    } while (!atomic_compare_exchange_weak(&c->state, &s, s + 1));
    if (c->hook) c->hook(c->hook_user, what);
    return MHA_OK;
}

static void paged_leave_read(mha_paged_cache *c) { atomic_fetch_sub(&c->state, 1); }

// ---------------------------------------------------------------------------
// Attend

// The row source of one call: entry b is sequence ids[b].
typedef struct paged_call {
    const mha_paged_cache *c;
    const int64_t *ids;
} paged_call;

static void paged_at(const void *ctx, int64_t b, int64_t hk, int64_t s, const char **k,
                     const char **v, const float **ks, const float **vs) {
    const paged_call *pc = ctx;
    const mha_paged_cache *c = pc->c;
    const int64_t blk = mha__paged_seq(c, pc->ids[b])->blocks[s];
    float *sc;
    if (blk < 0) {  // released: nothing to read (the attend checked no query reaches it)
        *k = *v = NULL;
        *ks = *vs = NULL;
        return;
    }
    *k = mha__paged_row(c, false, blk, hk, 0, &sc);
    *ks = sc;
    *v = mha__paged_row(c, true, blk, hk, 0, &sc);
    *vs = sc;
}

mha_status mha_paged_cache_attend(mha_tensor *out, const mha_tensor *q, mha_paged_cache *c,
                                  int64_t n, const int64_t *ids, const int64_t *counts,
                                  const mha_cache_attend_args *args) {
    if (!c || !ids || n < 1)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_paged_cache_attend: NULL cache or ids, or "
                         "n %lld < 1",
                         (long long)n);
    mha_status st = paged_enter_read(c, "mha_paged_cache_attend");
    if (st) return st;
    int64_t *len = mha__malloc(sizeof *len * (size_t)n);
    if (!len) {
        paged_leave_read(c);
        return mha__fail(MHA_ERR_NOMEM, "mha_paged_cache_attend: out of memory");
    }
    const int64_t T = q && q->ndim == 4 ? q->shape[2] : 0;
    const int64_t wl = args ? args->opts.window_left : -1;
    for (int64_t i = 0; i < n && !st; i++) {
        const pseq *s = mha__paged_seq(c, ids[i]);
        if (!s) {
            st = mha__paged_no_seq("mha_paged_cache_attend", ids[i]);
            break;
        }
        len[i] = s->len;
        // released tokens: no query may reach back to them (its window, and
        // StreamingLLM's sinks before the window, must miss them)
        const int64_t cnt = counts && counts[i] >= 0 && counts[i] <= T ? counts[i] : T;
        const int64_t reach = wl < 0 ? 0 : s->len - cnt - wl;
        const int64_t sinks = wl >= 0 && args ? args->opts.sink_tokens : 0;
        // (the sinks its last query sees: [0, see))
        const int64_t last = s->len - 1 - wl, see = sinks < last ? sinks : last;
        if (s->kept > s->hole && cnt > 0 && (reach < s->kept || see > s->hole))
            st = mha__fail(MHA_ERR_INVALID_ARG,
                           "mha_paged_cache_attend: sequence %lld released its tokens %lld to "
                           "%lld, but its first query (position %lld) sees %s %lld (window "
                           "left %lld, sink tokens %lld)",
                           (long long)ids[i], (long long)s->hole, (long long)(s->kept - 1),
                           (long long)(s->len - cnt),
                           reach < s->kept ? "back to" : "the sinks to",
                           (long long)(reach < s->kept ? (reach > 0 ? reach : 0) : see - 1),
                           (long long)wl, (long long)sinks);
    }
    if (!st) {
        const paged_call pc = {c, ids};
        const mha__kv_rows rows = {n,     c->Hkv, c->D, c->Dv,    c->bs, c->dt,         c->lk,
                                   c->lv, len,    &pc,  paged_at, true,  c->block_major};
        st = mha__kv_attend_rows(out, q, &rows, args, counts, 0, NULL);
    }
    free(len);
    paged_leave_read(c);
    if (!st) mha__set_impl(true, mha_isa(), false);
    return st;
}

// ---------------------------------------------------------------------------
// The tests' view: a digest of the whole state (kvcache.h)

// FNV-1a, n bytes of p into h.
static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

#define FNV(h, x) ((h) = fnv((h), &(x), sizeof(x)))

uint64_t mha__paged_cache_digest(const mha_paged_cache *c, uint64_t d[MHA__PAGED_DIGEST_PARTS]) {
    for (int p = 0; p < MHA__PAGED_DIGEST_PARTS; p++) d[p] = 1469598103934665603ull;
    // the K and V rows (their scales in them) of every held block, every head
    uint64_t *h = &d[MHA__PAGED_DIGEST_KV];
    for (int64_t b = 0; b < c->nblocks; b++) {
        if (c->ref[b] == 0) continue;
        FNV(*h, b);
        for (int64_t hk = 0; hk < c->Hkv; hk++)
            for (int isv = 0; isv < 2; isv++) {
                float *sc;
                const char *r = mha__paged_row(c, isv, b, hk, 0, &sc);
                *h = fnv(*h, r, (size_t)c->bs * (isv ? c->lv.rb : c->lk.rb));
            }
    }
    // the sequences: each slot that is or was used (a slot never used and
    // one not there yet give the same ids), its generation, length, block
    // table, token ids and released tokens (not the tables' room)
    h = &d[MHA__PAGED_DIGEST_TABLES];
    for (int64_t i = 0; i < c->nseq; i++) {
        const pseq *s = &c->seq[i];
        if (!s->live && s->gen == 0) continue;
        FNV(*h, i), FNV(*h, s->live), FNV(*h, s->gen);
        if (!s->live) continue;
        FNV(*h, s->len), FNV(*h, s->nb), FNV(*h, s->known), FNV(*h, s->hole), FNV(*h, s->kept);
        *h = fnv(*h, s->blocks, sizeof *s->blocks * (size_t)s->nb);
        *h = fnv(*h, s->tok, sizeof *s->tok * (size_t)s->known);
    }
    // per block: its holders and its generation
    h = &d[MHA__PAGED_DIGEST_REFS];
    *h = fnv(*h, c->ref, sizeof *c->ref * (size_t)c->nblocks);
    *h = fnv(*h, c->gen, sizeof *c->gen * (size_t)c->nblocks);
    // the prefix index: the buckets' chains and each indexed block's key
    h = &d[MHA__PAGED_DIGEST_INDEX];
    *h = fnv(*h, c->bucket, sizeof *c->bucket * (size_t)c->nbuck);
    for (int64_t b = 0; b < c->nblocks; b++) {
        FNV(*h, c->indexed[b]);
        if (!c->indexed[b]) continue;
        FNV(*h, c->next[b]), FNV(*h, c->parent[b]), FNV(*h, c->pgen[b]);
        *h = fnv(*h, c->btok + (size_t)b * (size_t)c->bs, sizeof *c->btok * (size_t)c->bs);
    }
    // the pool: the free map (where the next blocks go), its count, the
    // state word
    h = &d[MHA__PAGED_DIGEST_POOL];
    *h = fnv(*h, c->freemap, sizeof *c->freemap * (size_t)((c->nblocks + 63) / 64));
    FNV(*h, c->nfree);
    const int state = atomic_load(&c->state);
    FNV(*h, state);
    uint64_t all = 1469598103934665603ull;
    return fnv(all, d, sizeof *d * MHA__PAGED_DIGEST_PARTS);
}

#undef FNV
