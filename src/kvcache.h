// kvcache.h: the KV cache's internals for the layers above it (kvcache.c;
// fast layer): the attention over a cache with shifted queries and row
// stats (a shard of a sharded cache) and the cache's dims.
#ifndef MHA_KVCACHE_H
#define MHA_KVCACHE_H

#include "internal.h"

// T: every cached key visible; the check that each sequence holds its
// queries skipped when q_shift > 0) and, when stats is non-NULL, each
// row's max and 1/sum into stats (B, H, T, 2) ((-inf, 0): nothing
// visible): a shard's part of a sharded cache (mha_mpi.h).
mha_status mha__kv_cache_attend_ex(mha_tensor *out, const mha_tensor *q, const mha_kv_cache *c,
                                   const mha_cache_attend_args *args, const int64_t *counts,
                                   int64_t q_shift, float *stats);
// A cache's batch, KV heads and head dims.
void mha__kv_cache_dims(const mha_kv_cache *c, int64_t *B, int64_t *Hkv, int64_t *D,
                        int64_t *Dv);


#endif
