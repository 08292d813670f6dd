// kvcache.h: the KV cache's internals for the layers above it (fast
// layer): the cache object (kvcache.c: storage types, the cache as a row
// source, its dims), the attention over a cache or any row source with
// shifted queries and row stats (kvattend.c: a shard of a sharded cache),
// the paged cache's hooks (paged.c).
#ifndef MHA_KVCACHE_H
#define MHA_KVCACHE_H

#include "internal.h"
#include "kernels/kernels.h"

// How rows of n elements of a storage type lie: bytes from a row to the
// next (rb), scales (floats) per row (int8: 1; int4: ceil(n / 32); else
// 0), the row stride the decode kernels take (kernels.h: elements; int4:
// twice the bytes, so a row is lda / 2 bytes) and the floats from a row's
// scales to the next's (sld: ns when they are an array of their own). so:
// 0, the scales in an array of their own; else each row's scales are in
// the row, so bytes after its start (after its elements, rounded up to 4
// bytes: a head's block of rows and their scales one run of memory, as the
// paged cache keeps them).
typedef struct mha__kv_layout {
    size_t rb, so;
    int64_t ns, lda, sld;
} mha__kv_layout;

// The layout of rows of n elements in dt (a valid type, n >= 1), with
// their scales apart (mha__kv_layout_of) or in the rows (_in_rows; the
// same as _of for the types without scales).
mha__kv_layout mha__kv_layout_of(mha_kv_dtype dt, int64_t n);
mha__kv_layout mha__kv_layout_in_rows(mha_kv_dtype dt, int64_t n);

// T: every cached key visible; the check that each sequence holds its
// queries skipped when q_shift > 0) and, when stats is non-NULL, each
// row's max and 1/sum into stats (B, H, T, 2) ((-inf, 0): nothing
// visible): a shard's part of a sharded cache (mha_mpi.h).
mha_status mha__kv_cache_attend_ex(mha_tensor *out, const mha_tensor *q, const mha_kv_cache *c,
                                   const mha_cache_attend_args *args, const int64_t *counts,
                                   int64_t q_shift, float *stats);
// Where a cache's rows lie (the contiguous cache, kvcache.c; the paged one,
// paged.c): sequence b's rows of KV head hk in segments of seg tokens, at()
// giving segment s's first K and V rows (and, int8 / int4, their scales;
// else NULL; all NULL: a released segment, which no query may see); len[b]
// rows in use. Row r of a segment starts r * kb (K) or r * vb (V) bytes
// after its first, its scales r * kns (r * vns) floats after the first's.
typedef struct mha__kv_rows {
    int64_t B, Hkv, D, Dv, seg;
    mha_kv_dtype dt;
    mha__kv_layout lk, lv;  // the K and V rows' layout (mha__kv_layout_of)
    const int64_t *len;
    const void *ctx;
    void (*at)(const void *ctx, int64_t b, int64_t hk, int64_t s, const char **k,
               const char **v, const float **ks, const float **vs);
    // sequences' segments may be the same memory (a paged cache's shared
    // blocks: decode reads such rows once for all their queries); a
    // segment that is the same for KV head 0 is the same for every head
    bool shares;
    // a segment's KV heads lie side by side (a paged cache's block-major
    // block: head hk's segment, rows and scales, seg rows after head hk -
    // 1's): decode reads a segment's heads one after the other, one run of
    // memory, where a head's piece alone is a few KiB at a random place
    bool heads_together;
} mha__kv_rows;

// mha__kv_cache_attend_ex over any row source. Bit-identical for the same
// rows whatever their segments (the decode kernels sum each score over its
// row alone and each output over the rows in order; prefill converts the
// rows into float32 tiles first).
mha_status mha__kv_attend_rows(mha_tensor *out, const mha_tensor *q, const mha__kv_rows *rows,
                               const mha_cache_attend_args *args, const int64_t *counts,
                               int64_t q_shift, float *stats);
// One row x (n floats, element stride xs, of a float32 or float64 view)
// stored at dst in storage type dt (int8: its scale into scale[0]; int4:
// its ceil(n / 32) group scales into scale[0 ..]); row: n floats of
// scratch.
void mha__kv_store_row(mha_kv_dtype dt, void *dst, float *scale, const void *x, mha_dtype xdt,
                       int64_t xs, int64_t n, float *row);
// Checks storage type dt and sizes n0 n1 n2 rows of K (D elements) and V
// (Dv) in it: bytes of K, V and of the K and V rows' scales (int8, int4;
// else 0) (MHA_ERR_INVALID_ARG / MHA_ERR_OVERFLOW naming `what`).
mha_status mha__kv_storage(const char *what, int64_t n0, int64_t n1, int64_t n2, int64_t D,
                           int64_t Dv, mha_kv_dtype dt, size_t *bk, size_t *bv, size_t *bks,
                           size_t *bvs);
// The contiguous cache as a row source: one segment of cap rows per
// (sequence, KV head).
mha__kv_rows mha__kv_cache_rows(const mha_kv_cache *c);
// n rows of w elements at src (storage type dt, layout l, int8 / int4
// scales sc) as float32 into dst.
void mha__kv_rows_to_f32(const mha__kernels *kt, mha_kv_dtype dt, mha__kv_layout l,
                         const char *src, const float *sc, int64_t n, int64_t w, float *dst);
// counts: NULL, or B counts in [0, T] (MHA_ERR_INVALID_ARG naming `what`).
mha_status mha__kv_check_counts(const int64_t *counts, int64_t B, int64_t T, const char *what);
// A paged cache's KV heads and head dims (paged.c).
void mha__paged_cache_dims(const mha_paged_cache *c, int64_t *Hkv, int64_t *D, int64_t *Dv);
// Block i of sequence id's table (-1: released, or no such block or
// sequence) (paged.c; the tests' view of where blocks go).
int64_t mha__paged_cache_block(const mha_paged_cache *c, int64_t id, int64_t i);
// Tests only (paged.c): hook(user, what) is called by every call on c
// that took the cache (a change alone, or an attend among attends: the
// state word) right after taking it, while it holds it; `what` names the
// call ("mha_paged_cache_append", ...); NULL: no hook (the default). A
// hook that waits holds the call open: a test runs another call against
// it (refused, or an attend beside an attend) whatever the timing. Set it
// while no other thread uses c.
typedef void (*mha__paged_hook)(void *user, const char *what);
void mha__paged_cache_set_hook(mha_paged_cache *c, mha__paged_hook hook, void *user);
// Tests only (paged.c): a digest (FNV-1a) of c's whole state, one per part
// into d, and the digest of them all returned: the K and V bytes (scales
// with them) of every held block; the sequences (slots used, generations,
// lengths, block tables, token ids, released tokens; not the tables'
// room); the blocks' reference counts and generations; the prefix index
// (buckets, chains, keys); the pool (free map, free count, state word). A
// call that fails leaves every part as it was (test_paged). Call it while
// no other call uses c.
enum {
    MHA__PAGED_DIGEST_KV,
    MHA__PAGED_DIGEST_TABLES,
    MHA__PAGED_DIGEST_REFS,
    MHA__PAGED_DIGEST_INDEX,
    MHA__PAGED_DIGEST_POOL,
    MHA__PAGED_DIGEST_PARTS
};
uint64_t mha__paged_cache_digest(const mha_paged_cache *c, uint64_t d[MHA__PAGED_DIGEST_PARTS]);
// A cache's batch, KV heads and head dims.
void mha__kv_cache_dims(const mha_kv_cache *c, int64_t *B, int64_t *Hkv, int64_t *D,
                        int64_t *Dv);


#endif
