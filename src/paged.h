// paged.h: what the files of the paged KV cache share (paged.c: the block
// pool, the sequences' block tables, forks and copy on write, append;
// paged_index.c: the prefix index; paged_attend.c: the attention over the
// blocks and the tests' digest). Internal to the fast path.
#ifndef MHA_PAGED_H
#define MHA_PAGED_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "kvcache.h"

typedef struct pseq {
    bool live;
    uint32_t gen;  // bumped when the slot's sequence is freed (ids name a slot's generation)
    int64_t len;   // tokens
    int64_t nb, cap;  // blocks in the table, its room
    int32_t *blocks;
    int64_t known, tcap;  // the first `known` tokens' ids are in tok (room tcap)
    int32_t *tok;
    // released tokens [hole, kept) (whole blocks; none while kept <= hole):
    // mha_paged_cache_release frees from the start (keep 0) or after the first
    // blocks (StreamingLLM's sinks)
    int64_t hole, kept;
} pseq;

struct mha_paged_cache {
    int64_t nblocks, bs, Hkv, D, Dv;
    mha_kv_dtype dt;
    bool block_major;       // the pool's layout (mha_paged_layout)
    mha__kv_layout lk, lv;  // the K and V rows' layout
    // (Hkv, nblocks, bs) or, block-major, (nblocks, Hkv, bs) rows of lk.rb
    // and lv.rb bytes, int8 / int4 scales in the rows
    // (mha__kv_layout_in_rows: a head's block one run of memory)
    char *k, *v;
    int32_t *ref;       // per block: the sequences holding it (0: free)
    uint64_t *freemap;  // per block a bit: free (nfree of them)
    int64_t nfree;
    pseq *seq;  // nseq slots; id = generation << 32 | slot
    // the prefix index: chains per bucket through next; per block its key
    // (parent block or -1, bs token ids in btok) while indexed
    int64_t nbuck;
    int32_t *bucket, *next, *parent, *btok;
    bool *indexed;
    // per block: its generation (bumped when it returns to the pool) and,
    // indexed, its parent's generation when it was keyed (a parent freed
    // and reused for other tokens no longer leads to it)
    uint32_t *gen, *pgen;
    int64_t nseq;
    atomic_int state;  // 0 idle, n > 0: n attends, -1: a change
    // tests only (mha__paged_cache_set_hook): called by every call that
    // took the state word, while it holds it; NULL: none
    mha__paged_hook hook;
    void *hook_user;
};

// The live sequence of id, or NULL.
static inline pseq *mha__paged_seq(const mha_paged_cache *c, int64_t id) {
    if (id < 0) return NULL;
    const int64_t slot = id & 0xffffffff;
    const uint32_t gen = (uint32_t)((uint64_t)id >> 32);
    return slot < c->nseq && c->seq[slot].live && c->seq[slot].gen == gen ? &c->seq[slot]
                                                                          : NULL;
}

// Block blk's row of head h, slot i: K (isv false) or V, and its scales.
static inline char *mha__paged_row(const mha_paged_cache *c, bool isv, int64_t blk, int64_t h,
                                   int64_t i, float **scale) {
    const int64_t r = (c->block_major ? blk * c->Hkv + h : h * c->nblocks + blk) * c->bs + i;
    const mha__kv_layout l = isv ? c->lv : c->lk;
    char *row = (isv ? c->v : c->k) + (size_t)r * l.rb;
    *scale = l.so ? (float *)(row + l.so) : NULL;
    return row;
}

// MHA_ERR_INVALID_ARG: what names no sequence id (paged.c).
mha_status mha__paged_no_seq(const char *what, int64_t id);

// The prefix index (paged_index.c): a full block whose tokens' ids are all
// known, keyed by (the block before it in its sequence, its bs token ids).

// The indexed block with this key, or -1.
int32_t mha__paged_index_find(const mha_paged_cache *c, int64_t parent, const int32_t *tok);
// Block b out of the index (if it is in it).
void mha__paged_index_remove(mha_paged_cache *c, int32_t b);
// The full blocks of s from index `from` on whose tokens are known, into
// the index (each after the block before it, which must be keyed itself).
void mha__paged_index_seq(mha_paged_cache *c, const pseq *s, int64_t from);

#endif
