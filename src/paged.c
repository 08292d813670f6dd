// paged.c: the paged KV cache (mha.h: mha_paged_cache): a pool of blocks of
// bs tokens (K rows (Hkv, nblocks, bs, D) and V rows (Hkv, nblocks, bs, Dv),
// head-major: a KV head's blocks side by side, blocks taken in order one
// stream per head; or (nblocks, Hkv, bs, .), block-major: a block's KV
// heads side by side, a block's K (or V) one run of memory wherever it
// lies, read heads together by decode; mha.h: mha_paged_layout) in the
// storage type, int8 / int4 scales in each row after its elements,
// per-sequence block tables, blocks
// counted by the sequences that hold them. A fork shares its source's
// blocks; a write into a shared block copies it first (copy on write).
// Here: create, sequences (add, fork, a prompt sharing indexed blocks),
// free, truncate, release, append. The prefix index is paged_index.c's;
// the attention over the blocks (kvcache.c's drivers, the blocks as the
// row source's segments) and the tests' digest are paged_attend.c's.
//
// Every call checks everything and allocates everything it needs before
// it changes anything: a failed call leaves the cache as it was.
// Concurrency: attends may run together; a call that changes the cache
// while another call is using it is refused (the state word below; the
// attends' side of it in paged_attend.c).
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kvcache.h"
#include "paged.h"

// ---------------------------------------------------------------------------
// The state word: one change at a time, alone (attends together:
// paged_attend.c).

static mha_status enter_change(mha_paged_cache *c, const char *what) {
    int idle = 0;
    if (!atomic_compare_exchange_strong(&c->state, &idle, -1))
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "%s: the paged cache is in use by another call (a call that "
                         "changes it runs alone)",
                         what);
    if (c->hook) c->hook(c->hook_user, what);
    return MHA_OK;
}

static void leave_change(mha_paged_cache *c) { atomic_store(&c->state, 0); }

// ---------------------------------------------------------------------------
// Create, destroy, sequences

static const char *const layout_names[] = {"head-major", "block-major"};

const char *mha_paged_layout_name(mha_paged_layout layout) {
    return (unsigned)layout < 2 ? layout_names[layout] : NULL;
}

mha_status mha_paged_layout_from_name(mha_paged_layout *layout, const char *name) {
    if (!layout || !name)
        return mha__fail(MHA_ERR_INVALID_ARG, "paged layout: NULL layout or name");
    for (int i = 0; i < 2; i++)
        if (strcmp(name, layout_names[i]) == 0) {
            *layout = (mha_paged_layout)i;
            return MHA_OK;
        }
    return mha__fail(MHA_ERR_INVALID_ARG,
                     "paged layout '%s': expected head-major or block-major", name);
}

mha_status mha_paged_cache_create(mha_paged_cache **out, int64_t num_blocks, int64_t block_size,
                                  int64_t num_kv_heads, int64_t head_dim, int64_t v_head_dim,
                                  mha_kv_dtype dtype, mha_paged_layout layout) {
    if (!out) return mha__fail(MHA_ERR_INVALID_ARG, "mha_paged_cache_create: NULL out");
    *out = NULL;
    if ((unsigned)layout > MHA_PAGED_BLOCK_MAJOR)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "paged cache: layout %d (expected MHA_PAGED_HEAD_MAJOR 0 or "
                         "MHA_PAGED_BLOCK_MAJOR 1)",
                         (int)layout);
    if (num_blocks < 1 || num_blocks > INT32_MAX || block_size < 1 || num_kv_heads < 1 ||
        head_dim < 1 || v_head_dim < 1)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "paged cache: num_blocks %lld (1..%ld), block_size %lld, "
                         "num_kv_heads %lld, head_dim %lld, v_head_dim %lld must all be >= 1",
                         (long long)num_blocks, (long)INT32_MAX, (long long)block_size,
                         (long long)num_kv_heads, (long long)head_dim, (long long)v_head_dim);
    size_t bk, bv, bks, bvs;
    mha_status st = mha__kv_storage("paged cache", num_blocks, num_kv_heads, block_size,
                                    head_dim, v_head_dim, dtype, &bk, &bv, &bks, &bvs);
    if (st) return st;
    // (mha__kv_storage checked the rows' count; here their bytes with
    // their scales in them)
    (void)bk, (void)bv, (void)bks, (void)bvs;
    const size_t rows = (size_t)(num_blocks * num_kv_heads * block_size);
    const mha__kv_layout lk = mha__kv_layout_in_rows(dtype, head_dim),
                         lv = mha__kv_layout_in_rows(dtype, v_head_dim);
    size_t nk, nv;
    if (mha__mul_overflow_size(rows, lk.rb, &nk) || mha__mul_overflow_size(rows, lv.rb, &nv))
        return mha__fail(MHA_ERR_OVERFLOW, "paged cache: size overflows");
    mha_paged_cache *c = mha__calloc(1, sizeof *c);
    if (!c) return mha__fail(MHA_ERR_NOMEM, "paged cache: out of memory");
    c->nblocks = num_blocks, c->bs = block_size, c->Hkv = num_kv_heads;
    c->D = head_dim, c->Dv = v_head_dim, c->dt = dtype;
    c->lk = lk, c->lv = lv;
    c->block_major = layout == MHA_PAGED_BLOCK_MAJOR;
    atomic_init(&c->state, 0);
    c->k = mha__alloc(nk);
    c->v = mha__alloc(nv);
    c->ref = mha__calloc((size_t)num_blocks, sizeof *c->ref);
    c->freemap = mha__calloc((size_t)(num_blocks + 63) / 64, sizeof *c->freemap);
    size_t nbt;
    c->nbuck = num_blocks;
    c->bucket = mha__malloc(sizeof *c->bucket * (size_t)num_blocks);
    c->next = mha__malloc(sizeof *c->next * (size_t)num_blocks);
    c->parent = mha__malloc(sizeof *c->parent * (size_t)num_blocks);
    c->indexed = mha__calloc((size_t)num_blocks, sizeof *c->indexed);
    c->gen = mha__calloc((size_t)num_blocks, sizeof *c->gen);
    c->pgen = mha__calloc((size_t)num_blocks, sizeof *c->pgen);
    c->btok = mha__mul_overflow_size((size_t)num_blocks, (size_t)block_size * sizeof(int32_t),
                                     &nbt)
                  ? NULL
                  : mha__malloc(nbt);
    if (!c->k || !c->v || !c->ref || !c->freemap || !c->bucket || !c->next || !c->parent ||
        !c->indexed || !c->btok || !c->gen || !c->pgen) {
        mha_paged_cache_destroy(c);
        return mha__fail(MHA_ERR_NOMEM, "paged cache: out of memory for %zu bytes", nk + nv);
    }
    for (int64_t i = 0; i < num_blocks; i++) {
        c->freemap[i / 64] |= 1ull << (i % 64);
        c->bucket[i] = -1;
    }
    c->nfree = num_blocks;
    *out = c;
    return MHA_OK;
}

void mha_paged_cache_destroy(mha_paged_cache *c) {
    if (!c) return;
    for (int64_t i = 0; i < c->nseq; i++) free(c->seq[i].blocks), free(c->seq[i].tok);
    free(c->seq);
    free(c->bucket);
    free(c->next);
    free(c->parent);
    free(c->indexed);
    free(c->btok);
    free(c->gen);
    free(c->pgen);
    mha__free(c->k);
    mha__free(c->v);
    free(c->ref);
    free(c->freemap);
    free(c);
}

// A sequence's id: its slot and the slot's generation (a freed id stays
// unknown when its slot is reused).
static int64_t seq_id(const mha_paged_cache *c, int64_t slot) {
    return (int64_t)((uint64_t)c->seq[slot].gen << 32 | (uint64_t)slot);
}

mha_status mha__paged_no_seq(const char *what, int64_t id) {
    return mha__fail(MHA_ERR_INVALID_ARG, "%s: no sequence %lld (never added, or freed)", what,
                     (long long)id);
}

// A free slot for a new sequence (the slots grown if none).
static mha_status new_slot(mha_paged_cache *c, int64_t *slot, const char *what) {
    for (int64_t i = 0; i < c->nseq; i++)
        if (!c->seq[i].live) {
            *slot = i;
            return MHA_OK;
        }
    if (c->nseq >= INT32_MAX)
        return mha__fail(MHA_ERR_INVALID_ARG, "%s: %lld sequences at once is the most", what,
                         (long long)INT32_MAX);
    pseq *s = mha__realloc(c->seq, sizeof *s * (size_t)(c->nseq + 1));
    if (!s) return mha__fail(MHA_ERR_NOMEM, "%s: out of memory for a sequence", what);
    c->seq = s;
    memset(&s[c->nseq], 0, sizeof *s);
    *slot = c->nseq++;
    return MHA_OK;
}

mha_status mha_paged_cache_add(mha_paged_cache *c, int64_t *id) {
    if (!c || !id) return mha__fail(MHA_ERR_INVALID_ARG, "mha_paged_cache_add: NULL argument");
    mha_status st = enter_change(c, "mha_paged_cache_add");
    if (st) return st;
    int64_t slot = 0;
    if (!(st = new_slot(c, &slot, "mha_paged_cache_add"))) {
        c->seq[slot].live = true;
        *id = seq_id(c, slot);
    }
    leave_change(c);
    return st;
}

mha_status mha_paged_cache_fork(mha_paged_cache *c, int64_t src, int64_t *id) {
    if (!c || !id)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_paged_cache_fork: NULL argument");
    mha_status st = enter_change(c, "mha_paged_cache_fork");
    if (st) return st;
    int64_t slot = 0;
    if (!mha__paged_seq(c, src)) {
        st = mha__paged_no_seq("mha_paged_cache_fork", src);
    } else if (!(st = new_slot(c, &slot, "mha_paged_cache_fork"))) {
        pseq *s = mha__paged_seq(c, src), *d = &c->seq[slot];  // (after new_slot: seq may move)
        int32_t *t = s->nb ? mha__malloc(sizeof *t * (size_t)s->nb) : NULL;
        int32_t *tk = s->known ? mha__malloc(sizeof *tk * (size_t)s->known) : NULL;
        if ((s->nb && !t) || (s->known && !tk)) {
            free(t), free(tk);
            st = mha__fail(MHA_ERR_NOMEM,
                           "mha_paged_cache_fork: out of memory for a table "
                           "of %lld blocks",
                           (long long)s->nb);
        } else {
            if (s->nb) memcpy(t, s->blocks, sizeof *t * (size_t)s->nb);
            if (s->known) memcpy(tk, s->tok, sizeof *tk * (size_t)s->known);
            for (int64_t i = 0; i < s->nb; i++)
                if (t[i] >= 0) c->ref[t[i]]++;
            *d = (pseq){true,     d->gen,   s->len, s->nb,   s->nb,  t,
                        s->known, s->known, tk,     s->hole, s->kept};
            *id = seq_id(c, slot);
        }
    }
    leave_change(c);
    return st;
}

mha_status mha_paged_cache_add_prompt(mha_paged_cache *c, const int32_t *tokens, int64_t n,
                                      int64_t *id, int64_t *cached) {
    if (!c || !id || !cached || (n > 0 && !tokens) || n < 0)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_paged_cache_add_prompt: NULL argument or n %lld < 0",
                         (long long)n);
    mha_status st = enter_change(c, "mha_paged_cache_add_prompt");
    if (st) return st;
    // the longest run of keyed blocks holding the prompt's first tokens; at
    // most n - 1 tokens cached, so that the last is left to compute (a last
    // block that holds it is shared too: appending its token with its id
    // keeps the row there, mha_paged_cache_append)
    int64_t nb = 0;
    for (int64_t parent = -1; (nb + 1) * c->bs <= n && nb * c->bs < n - 1; nb++) {
        const int32_t b = mha__paged_index_find(c, parent, tokens + nb * c->bs);
        if (b < 0) break;
        parent = b;
    }
    int64_t slot = 0;
    int32_t *t = nb ? mha__malloc(sizeof *t * (size_t)nb) : NULL;
    int32_t *tk = nb ? mha__malloc(sizeof *tk * (size_t)(nb * c->bs)) : NULL;
    if (nb && (!t || !tk)) {
        st = mha__fail(MHA_ERR_NOMEM, "mha_paged_cache_add_prompt: out of memory");
    } else if (!(st = new_slot(c, &slot, "mha_paged_cache_add_prompt"))) {
        for (int64_t i = 0, parent = -1; i < nb; i++) {  // (the same walk: found above)
            t[i] = mha__paged_index_find(c, parent, tokens + i * c->bs);
            parent = t[i];
            c->ref[t[i]]++;
        }
        if (nb) memcpy(tk, tokens, sizeof *tk * (size_t)(nb * c->bs));
        pseq *d = &c->seq[slot];
        const int64_t len = nb * c->bs < n ? nb * c->bs : n - 1;
        *d = (pseq){true, d->gen, len, nb, nb, t, len, nb * c->bs, tk, 0, 0};
        *id = seq_id(c, slot);
        *cached = len;
        t = tk = NULL;
    }
    free(t), free(tk);
    leave_change(c);
    return st;
}

// Drops sequence s's blocks from index b on (a block no sequence holds any
// more goes back to the pool).
// One holder less for block blk (-1: a released one, nothing); held by no
// one, it leaves the index and returns to the pool.
static void drop_block(mha_paged_cache *c, int32_t blk) {
    if (blk >= 0 && --c->ref[blk] == 0) {
        mha__paged_index_remove(c, blk);
        c->gen[blk]++;
        c->freemap[blk / 64] |= 1ull << (blk % 64);
        c->nfree++;
    }
}

static bool block_free(const mha_paged_cache *c, int64_t b) {
    return c->freemap[b / 64] >> (b % 64) & 1;
}

// The longest run of free blocks (the first of the longest): its start and
// length. One pass over the map, from one change between free and held
// to the next (count-trailing-zeros within a word, whole words where
// nothing changes): its time grows with the pool's words and its runs.
static int64_t longest_free_run(const mha_paged_cache *c, int64_t *len) {
    int64_t best = -1, blen = 0, start = -1;
    for (int64_t i = 0; i < c->nblocks;) {
        const int64_t avail = c->nblocks - i < 64 - i % 64 ? c->nblocks - i : 64 - i % 64;
        uint64_t w = c->freemap[i / 64] >> (i % 64);  // (free bits from i on)
        if (start >= 0) w = ~w;                       // (in a run: the held ones)
        if (avail < 64) w &= (1ull << avail) - 1;
        if (w == 0) {  // nothing changes in this word
            i += avail;
            continue;
        }
        i += __builtin_ctzll(w);
        if (start < 0) {
            start = i;
        } else {
            if (i - start > blen) blen = i - start, best = start;
            start = -1;
        }
    }
    if (start >= 0 && c->nblocks - start > blen) blen = c->nblocks - start, best = start;
    *len = blen;
    return best;
}

// A block from the pool for a sequence whose block before it is prev (-1:
// none, or released), held once (the caller counted that one is free): the
// block right after prev when it is free, so that a sequence's blocks
// follow each other in memory (decode reads such blocks in one pass, as
// a contiguous cache's rows); else a new run: the first block of the pool
// when it is free and starts the longest run, otherwise the middle of the
// longest run (room to grow on both sides: for the sequence ending before
// the run and for this one). Deterministic: the same calls, the same
// blocks.
static int32_t take_block(mha_paged_cache *c, int64_t prev) {
    int64_t b = prev + 1;
    if (prev < 0 || b >= c->nblocks || !block_free(c, b)) {
        int64_t len;
        b = longest_free_run(c, &len);
        if (b > 0) b += len / 2;
    }
    c->freemap[b / 64] &= ~(1ull << (b % 64));
    c->nfree--;
    c->ref[b] = 1;
    return (int32_t)b;
}

// Whether sequence s's next token goes into a last block others hold too
// (so that it is copied first).
static bool last_shared(const mha_paged_cache *c, const pseq *s) {
    return s->len % c->bs != 0 && c->ref[s->blocks[s->nb - 1]] > 1;
}

static void release_from(mha_paged_cache *c, pseq *s, int64_t b) {
    for (int64_t i = s->nb - 1; i >= b; i--) drop_block(c, s->blocks[i]);
    if (s->nb > b) s->nb = b;
}

mha_status mha_paged_cache_free(mha_paged_cache *c, int64_t id) {
    if (!c) return mha__fail(MHA_ERR_INVALID_ARG, "mha_paged_cache_free: NULL cache");
    mha_status st = enter_change(c, "mha_paged_cache_free");
    if (st) return st;
    pseq *s = mha__paged_seq(c, id);
    if (!s) {
        st = mha__paged_no_seq("mha_paged_cache_free", id);
    } else {
        release_from(c, s, 0);
        free(s->blocks);
        free(s->tok);
        *s = (pseq){.gen = s->gen + 1};
    }
    leave_change(c);
    return st;
}

mha_status mha_paged_cache_truncate(mha_paged_cache *c, int64_t id, int64_t length) {
    if (!c) return mha__fail(MHA_ERR_INVALID_ARG, "mha_paged_cache_truncate: NULL cache");
    mha_status st = enter_change(c, "mha_paged_cache_truncate");
    if (st) return st;
    pseq *s = mha__paged_seq(c, id);
    if (!s) {
        st = mha__paged_no_seq("mha_paged_cache_truncate", id);
    } else if (length < 0 || length > s->len) {
        st = mha__fail(MHA_ERR_INVALID_ARG,
                       "mha_paged_cache_truncate: length %lld, sequence %lld holds %lld",
                       (long long)length, (long long)id, (long long)s->len);
    } else if (length > s->hole && length < s->kept) {
        st = mha__fail(MHA_ERR_INVALID_ARG,
                       "mha_paged_cache_truncate: sequence %lld released its tokens %lld to "
                       "%lld: truncate it to at most %lld or to at least %lld, not %lld",
                       (long long)id, (long long)s->hole, (long long)(s->kept - 1),
                       (long long)s->hole, (long long)s->kept, (long long)length);
    } else {
        release_from(c, s, (length + c->bs - 1) / c->bs);
        s->len = length;
        if (length <= s->hole) s->hole = s->kept = 0;  // (the released tokens gone too)
        s->known = s->known < length ? s->known : length;
        // a partial last block of its own will be rewritten: out of the index
        if (length % c->bs && c->ref[s->blocks[s->nb - 1]] == 1)
            mha__paged_index_remove(c, s->blocks[s->nb - 1]);
    }
    leave_change(c);
    return st;
}

mha_status mha_paged_cache_release(mha_paged_cache *c, int64_t id, int64_t keep, int64_t pos) {
    if (!c) return mha__fail(MHA_ERR_INVALID_ARG, "mha_paged_cache_release: NULL cache");
    mha_status st = enter_change(c, "mha_paged_cache_release");
    if (st) return st;
    pseq *s = mha__paged_seq(c, id);
    // the hole starts after the blocks holding the first keep tokens
    const int64_t from = keep >= 0 ? (keep + c->bs - 1) / c->bs * c->bs : 0;
    if (!s) {
        st = mha__paged_no_seq("mha_paged_cache_release", id);
    } else if (pos < 0 || pos > s->len || keep < 0) {
        st = mha__fail(MHA_ERR_INVALID_ARG,
                       "mha_paged_cache_release: keep %lld, token %lld: expected keep >= 0, "
                       "0 <= token <= %lld (sequence %lld's length)",
                       (long long)keep, (long long)pos, (long long)s->len, (long long)id);
    } else if (s->kept > s->hole && from != s->hole && pos / c->bs * c->bs > from) {
        st = mha__fail(MHA_ERR_INVALID_ARG,
                       "mha_paged_cache_release: sequence %lld released its tokens from %lld; "
                       "keeping %lld would start at %lld (the kept tokens must stay the same)",
                       (long long)id, (long long)s->hole, (long long)keep, (long long)from);
    } else {
        const int64_t b0 = (s->kept > from ? s->kept : from) / c->bs;
        for (int64_t b = b0; b < pos / c->bs; b++) {  // whole blocks only
            drop_block(c, s->blocks[b]);
            s->blocks[b] = -1;
        }
        if (pos / c->bs * c->bs > from) {
            s->hole = from;
            if (pos / c->bs * c->bs > s->kept) s->kept = pos / c->bs * c->bs;
        }
    }
    leave_change(c);
    return st;
}

int64_t mha_paged_cache_length(const mha_paged_cache *c, int64_t id) {
    const pseq *s = c ? mha__paged_seq(c, id) : NULL;
    return s ? s->len : -1;
}

void mha__paged_cache_dims(const mha_paged_cache *c, int64_t *Hkv, int64_t *D, int64_t *Dv) {
    *Hkv = c->Hkv, *D = c->D, *Dv = c->Dv;
}

int64_t mha__paged_cache_block(const mha_paged_cache *c, int64_t id, int64_t i) {
    const pseq *s = c ? mha__paged_seq(c, id) : NULL;
    return s && i >= 0 && i < s->nb ? s->blocks[i] : -1;
}

void mha__paged_cache_set_hook(mha_paged_cache *c, mha__paged_hook hook, void *user) {
    c->hook = hook, c->hook_user = user;
}

int64_t mha_paged_cache_blocks_in_use(const mha_paged_cache *c) {
    return c ? c->nblocks - c->nfree : -1;
}

int64_t mha_paged_cache_blocks_free(const mha_paged_cache *c) { return c ? c->nfree : -1; }

mha_paged_layout mha_paged_cache_layout(const mha_paged_cache *c) {
    return c && c->block_major ? MHA_PAGED_BLOCK_MAJOR : MHA_PAGED_HEAD_MAJOR;
}

size_t mha_paged_cache_block_bytes(const mha_paged_cache *c) {
    if (!c) return 0;
    const size_t rows = (size_t)(c->Hkv * c->bs);
    return rows * (c->lk.rb + c->lv.rb);
}

// ---------------------------------------------------------------------------
// Append

static void copy_block(mha_paged_cache *c, int64_t dst, int64_t src) {
    // (the scales with the rows; block-major: every head at once)
    const int64_t nh = c->block_major ? c->Hkv : 1;
    for (int64_t h = 0; h < c->Hkv; h += nh)
        for (int isv = 0; isv < 2; isv++) {
            float *sd, *ss;
            char *d = mha__paged_row(c, isv, dst, h, 0, &sd);
            const char *sr = mha__paged_row(c, isv, src, h, 0, &ss);
            const mha__kv_layout l = isv ? c->lv : c->lk;
            memcpy(d, sr, (size_t)(nh * c->bs) * l.rb);
        }
}

// How many of the `add` tokens (ids tok, NULL: unknown) that sequence s
// appends the rows of its partial last block hold already (0 or all those
// that fall in that block): when the block is an
// indexed block (full, keyed by its whole prefix) after s's own block
// before it, whose first tokens are s's and whose next ones are tok. Their
// K and V rows are then those rows (the same tokens after the same
// prefix, at the same positions): nothing is written or copied. This is
// the block mha_paged_cache_add_prompt shares when the whole prompt is
// indexed (its last token left to compute).
static int64_t last_held(const mha_paged_cache *c, const pseq *s, const int32_t *tok,
                         int64_t add) {
    const int64_t at = s->len % c->bs;
    if (!tok || at == 0 || s->known != s->len || s->kept > s->hole) return 0;
    const int32_t b = s->blocks[s->nb - 1];
    const int64_t parent = s->nb > 1 ? s->blocks[s->nb - 2] : -1;
    if (b < 0 || !c->indexed[b] || c->parent[b] != parent ||
        (parent >= 0 && c->pgen[b] != c->gen[parent]))
        return 0;
    const int32_t *bt = c->btok + (size_t)b * (size_t)c->bs;
    const int64_t m = add < c->bs - at ? add : c->bs - at;
    if (memcmp(bt, s->tok + (s->nb - 1) * c->bs, sizeof(int32_t) * (size_t)at) != 0 ||
        memcmp(bt + at, tok, sizeof(int32_t) * (size_t)m) != 0)
        return 0;
    return m;
}

// The blocks sequence s needs for `add` more tokens (ids tok or NULL): new
// ones, and one copy of a shared last block it would write into.
static int64_t blocks_needed(const mha_paged_cache *c, const pseq *s, int64_t add,
                             const int32_t *tok) {
    if (add == 0) return 0;
    const int64_t nb = (s->len + add + c->bs - 1) / c->bs;
    return nb - s->nb + (last_shared(c, s) && !last_held(c, s, tok, add) ? 1 : 0);
}

static mha_status append_check(const mha_paged_cache *c, int64_t n, const int64_t *ids,
                               const int64_t *counts, const mha_tensor *k, const mha_tensor *v) {
    const char *w = "mha_paged_cache_append";
    if (n < 1 || !ids)
        return mha__fail(MHA_ERR_INVALID_ARG, "%s: n %lld, ids %s", w, (long long)n,
                         ids ? "given" : "NULL");
    mha_status st;
    if ((st = mha__check_float(k, "k")) || (st = mha__check_float(v, "v"))) return st;
    if (k->ndim != 4 || k->shape[0] != n || k->shape[1] != c->Hkv || k->shape[3] != c->D ||
        v->ndim != 4 || v->shape[0] != n || v->shape[1] != c->Hkv || v->shape[3] != c->Dv ||
        v->shape[2] != k->shape[2]) {
        char a[160], b[160];
        return mha__fail(MHA_ERR_SHAPE,
                         "%s: k %s, v %s; expected (%lld, %lld, T, %lld) and (%lld, %lld, T, "
                         "%lld)",
                         w, mha__shape_str(a, sizeof a, k->ndim, k->shape),
                         mha__shape_str(b, sizeof b, v->ndim, v->shape), (long long)n,
                         (long long)c->Hkv, (long long)c->D, (long long)n, (long long)c->Hkv,
                         (long long)c->Dv);
    }
    const int64_t T = k->shape[2];
    for (int64_t i = 0; i < n; i++) {
        if (!mha__paged_seq(c, ids[i])) return mha__paged_no_seq(w, ids[i]);
        for (int64_t j = 0; j < i; j++)
            if (ids[j] == ids[i])
                return mha__fail(MHA_ERR_INVALID_ARG,
                                 "%s: sequence %lld appears twice (entries %lld and %lld)", w,
                                 (long long)ids[i], (long long)j, (long long)i);
        const int64_t a = counts ? counts[i] : T;
        if (a < 0 || a > T)
            return mha__fail(MHA_ERR_INVALID_ARG, "%s: counts[%lld] = %lld, expected 0..%lld",
                             w, (long long)i, (long long)a, (long long)T);
        if (mha__paged_seq(c, ids[i])->len > INT64_MAX - a)
            return mha__fail(MHA_ERR_OVERFLOW, "%s: sequence %lld's length overflows", w,
                             (long long)ids[i]);
    }
    return MHA_OK;
}

mha_status mha_paged_cache_append(mha_paged_cache *c, int64_t n, const int64_t *ids,
                                  const int64_t *counts, const mha_tensor *k,
                                  const mha_tensor *v, const int32_t *tokens) {
    if (!c || !k || !v)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_paged_cache_append: NULL argument");
    mha_status st = enter_change(c, "mha_paged_cache_append");
    if (st) return st;
    if ((st = append_check(c, n, ids, counts, k, v))) goto out;
    const int64_t T = k->shape[2];
    // every block the call takes, counted before anything changes
    int64_t need = 0;
    for (int64_t i = 0; i < n; i++)
        need += blocks_needed(c, mha__paged_seq(c, ids[i]), counts ? counts[i] : T,
                              tokens ? tokens + i * T : NULL);
    if (need > c->nfree) {
        st = mha__fail(MHA_ERR_NOMEM,
                       "mha_paged_cache_append: the pool is exhausted: the call needs %lld "
                       "blocks, %lld of %lld are free (nothing was appended)",
                       (long long)need, (long long)c->nfree, (long long)c->nblocks);
        goto out;
    }
    // the tables' room and a row's scratch, before anything changes
    const int64_t wmax = c->D > c->Dv ? c->D : c->Dv;
    float *row = mha__malloc(sizeof(float) * (size_t)wmax);
    if (!row) {
        st = mha__fail(MHA_ERR_NOMEM, "mha_paged_cache_append: out of memory");
        goto out;
    }
    for (int64_t i = 0; i < n; i++) {
        pseq *s = mha__paged_seq(c, ids[i]);
        const int64_t a = counts ? counts[i] : T, nb = (s->len + a + c->bs - 1) / c->bs;
        if (nb > s->cap) {
            int32_t *t = mha__realloc(s->blocks, sizeof *t * (size_t)nb);
            if (!t) {  // (the tables grown so far hold the same blocks: no change)
                free(row);
                st = mha__fail(MHA_ERR_NOMEM,
                               "mha_paged_cache_append: out of memory for a table of %lld "
                               "blocks",
                               (long long)nb);
                goto out;
            }
            s->blocks = t, s->cap = nb;
        }
        if (tokens && s->known == s->len && s->len + a > s->tcap) {  // the ids' room
            int32_t *t = mha__realloc(s->tok, sizeof *t * (size_t)(s->len + a));
            if (!t) {
                free(row);
                st = mha__fail(MHA_ERR_NOMEM,
                               "mha_paged_cache_append: out of memory for %lld token ids",
                               (long long)(s->len + a));
                goto out;
            }
            s->tok = t, s->tcap = s->len + a;
        }
    }
    // nothing fails from here on
    for (int64_t i = 0; i < n; i++) {
        pseq *s = mha__paged_seq(c, ids[i]);
        const int64_t a = counts ? counts[i] : T;
        if (a == 0) continue;
        const int32_t *tk = tokens ? tokens + i * T : NULL;
        // rows the shared last block holds already: kept, not written
        const int64_t held = last_held(c, s, tk, a);
        if (!held && last_shared(c, s)) {  // copy on write (the old block stays with the others)
            const int32_t old = s->blocks[s->nb - 1],
                          nw = take_block(c, s->nb > 1 ? s->blocks[s->nb - 2] : -1);
            copy_block(c, nw, old);
            c->ref[old]--;
            s->blocks[s->nb - 1] = nw;
        } else if (!held && s->len % c->bs) {  // rewritten in place: its key is no more
            mha__paged_index_remove(c, s->blocks[s->nb - 1]);
        }
        for (int64_t t = held; t < a; t++) {
            const int64_t pos = s->len + t, bi = pos / c->bs, slot = pos % c->bs;
            if (bi == s->nb) {
                s->blocks[s->nb] = take_block(c, s->nb ? s->blocks[s->nb - 1] : -1);
                s->nb++;
            }
            for (int64_t h = 0; h < c->Hkv; h++) {
                const int64_t ko = i * k->stride[0] + h * k->stride[1] + t * k->stride[2];
                const int64_t vo = i * v->stride[0] + h * v->stride[1] + t * v->stride[2];
                float *sc;
                char *dst = mha__paged_row(c, false, s->blocks[bi], h, slot, &sc);
                mha__kv_store_row(c->dt, dst, sc,
                                  (const char *)k->data + ko * (int64_t)mha_dtype_size(k->dtype),
                                  k->dtype, k->stride[3], c->D, row);
                dst = mha__paged_row(c, true, s->blocks[bi], h, slot, &sc);
                mha__kv_store_row(c->dt, dst, sc,
                                  (const char *)v->data + vo * (int64_t)mha_dtype_size(v->dtype),
                                  v->dtype, v->stride[3], c->Dv, row);
            }
        }
        if (tokens && s->known == s->len) {  // the ids, and the blocks they fill keyed
            memcpy(s->tok + s->len, tokens + i * T, sizeof(int32_t) * (size_t)a);
            s->known += a;
        }
        const int64_t first = s->len / c->bs;  // (the first block this append can fill)
        s->len += a;
        if (tokens) mha__paged_index_seq(c, s, first);
    }
    free(row);
out:
    leave_change(c);
    return st;
}
