// paged_index.c: the paged cache's prefix index. A full block whose
// tokens' ids are all known is keyed by (the block before it in its
// sequence, its bs token ids); a new prompt walks the index from the first
// block and shares every block that matches (the key of a block names its
// whole prefix). Chains per bucket (FNV-1a of the key) through next. A
// block leaves the index when it returns to the pool or is about to be
// rewritten (paged.c decides when; this file only keeps the index).
#include <string.h>

#include "paged.h"


static uint64_t key_hash(int64_t parent, const int32_t *tok, int64_t bs) {
    uint64_t h = 1469598103934665603ull ^ (uint64_t)(parent + 1);  // FNV-1a over the key
    for (int64_t i = 0; i < bs; i++) {
        h ^= (uint32_t)tok[i];
        h *= 1099511628211ull;
    }
    return h;
}

static int64_t bucket_of(const mha_paged_cache *c, int64_t parent, const int32_t *tok) {
    return (int64_t)(key_hash(parent, tok, c->bs) % (uint64_t)c->nbuck);
}

// The indexed block with this key, or -1.
int32_t mha__paged_index_find(const mha_paged_cache *c, int64_t parent, const int32_t *tok) {
    for (int32_t b = c->bucket[bucket_of(c, parent, tok)]; b >= 0; b = c->next[b])
        if (c->parent[b] == parent && (parent < 0 || c->pgen[b] == c->gen[parent]) &&
            memcmp(c->btok + (size_t)b * (size_t)c->bs, tok,
                   sizeof(int32_t) * (size_t)c->bs) == 0)
            return b;
    return -1;
}

// Block b (full, its tokens tok, after block parent) into the index, unless
// an equal key is there already.
static void index_add(mha_paged_cache *c, int32_t b, int64_t parent, const int32_t *tok) {
    if (c->indexed[b] || mha__paged_index_find(c, parent, tok) >= 0) return;
    const int64_t bk = bucket_of(c, parent, tok);
    memcpy(c->btok + (size_t)b * (size_t)c->bs, tok, sizeof(int32_t) * (size_t)c->bs);
    c->parent[b] = (int32_t)parent;
    c->pgen[b] = parent >= 0 ? c->gen[parent] : 0;
    c->next[b] = c->bucket[bk];
    c->bucket[bk] = b;
    c->indexed[b] = true;
}

void mha__paged_index_remove(mha_paged_cache *c, int32_t b) {
    if (!c->indexed[b]) return;
    int32_t *p = &c->bucket[bucket_of(c, c->parent[b], c->btok + (size_t)b * (size_t)c->bs)];
    while (*p != b) p = &c->next[*p];
    *p = c->next[b];
    c->indexed[b] = false;
}

// The full blocks of s from index `from` on whose tokens are known, into
// the index (each after the block before it, which must be keyed itself).
void mha__paged_index_seq(mha_paged_cache *c, const pseq *s, int64_t from) {
    for (int64_t i = from; i < s->nb && (i + 1) * c->bs <= s->known; i++) {
        if (s->blocks[i] < 0 ||
            (i > 0 && (s->blocks[i - 1] < 0 || !c->indexed[s->blocks[i - 1]])))
            return;  // (released, or its prefix is not keyed)
        index_add(c, s->blocks[i], i > 0 ? s->blocks[i - 1] : -1, s->tok + i * c->bs);
    }
}
