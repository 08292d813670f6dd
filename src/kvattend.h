// kvattend.h: what the phases of a cache attention share (kvattend.c:
// the checks, prefill, StreamingLLM's sinks; splitkv.c: the split-KV
// decode). Internal to the fast path.
#ifndef MHA_KVATTEND_H
#define MHA_KVATTEND_H

#include "flash.h"
#include "kvcache.h"
#include "rope.h"

// A call of at most this many queries per sequence decodes (split-KV,
// splitkv.c); a longer one is a prefill (flash tiles).
#define MHA__DECODE_MAX_T 16

// What the phases of a cache attention share (attend_check fills it).
typedef struct mha__attend_call {
    const mha__kv_rows *c;
    const mha__kernels *kt;
    mha_cache_attend_args a;
    const mha_tensor *q, *out;
    const float *qd;
    float *o, *stats;
    const int64_t *counts;
    int64_t B, H, T, G, D, Dv, maxlen, q_shift;
    double scale;
    int nt;
    float slopes[MHA__ALIBI_MAX_DEFAULT];  // the paper's ALiBi slopes when asked for
} mha__attend_call;

// The split-KV decode of a checked call (splitkv.c).
mha_status mha__kv_decode(const mha__attend_call *ac);

#endif
