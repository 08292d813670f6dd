// packs.c: the module's packed projection weights (module.h): every
// float32 weight matrix W (O, I) of the projections (in_proj_weight, or
// q/k/v_proj_weight; out_proj.weight; gate_proj.weight) kept as
// mha__gemm_pack_wt lays it out for the process's kernel table (gemm.h), so
// that a call multiplies by it without packing W first. bf16 weights on a
// table that computes bf16 (bf_fast: amx, avx512bf16) keep the matrices the
// bf16 compute multiplies by (in_proj_weight, or q/k/v_proj_weight, and
// out_proj.weight) as pack_bf16 lays them out (kernels.h: the same
// size as the matrix, bf16). Half weights (bf16, f16) keep as well the
// float32 kernels' packing of those matrices in their own type
// (mha__gemm_pack_wt_bh: the same size as the matrix), which the float32
// compute multiplies by, widening as it loads (gemm_packed_bh: no float32
// copy, half the bytes). The packed
// copy is allocated with the module and filled by the
// first call that wants it after the parameters changed; it does not
// change a bit of any result (the same layout the call would have packed).
//
// The rules (a call that reads the module may run on several threads at
// once: mha.h's concurrency promise), one atomic word, no lock:
//   state = VALID | BUILD | DIRTY bits, and the number of readers above them
//   reader:   VALID set -> readers + 1 (one CAS), reads, readers - 1
//   builder:  VALID, BUILD clear and no reader -> BUILD set, DIRTY clear
//             (one CAS); fills the copy from the parameters; then VALID
//             set and BUILD clear (or, DIRTY set meanwhile, only BUILD
//             clear: the copy is not trusted)
//   stale:    VALID clear, DIRTY set (any time, from any thread)
// A call that finds the copy neither valid nor buildable (another thread
// builds it, or still reads the old one) packs into its scratch as before:
// nobody waits, the copy is never written while a reader holds it, and the
// result is the same either way.
#include <stdatomic.h>
#include <string.h>

#include "gemm.h"
#include "module.h"

enum { VALID = 1, BUILD = 2, DIRTY = 4, READER = 8 };
enum { MAX_MATS = 9 };  // q, k, v, out (twice: bf16 compute, half), gate

typedef struct packed_mat {
    const void *src;  // W (O, I), row-major, in the parameter block
    int64_t O, I;
    bool bf16;   // W is bf16, packed by pack_bf16; else (bh 0) float32 by mha__gemm_pack_wt
    int bh;      // W is bf16 (1) or f16 (2), packed by mha__gemm_pack_wt_bh
    float *dst;  // its packed form (mat_floats floats)
} packed_mat;

struct mha__packs {
    _Atomic uint64_t state;
    const mha__kernels *kt;  // the table the copy is laid out for
    int n;
    packed_mat mat[MAX_MATS];
    size_t bytes;  // of the allocation (this header included)
};

static size_t round16(size_t f) { return (f + 15) & ~(size_t)15; }

static size_t mat_floats(const mha__kernels *kt, const packed_mat *q) {
    if (q->bf16) return (size_t)(mha__bf16_packed_elems(q->I, q->O, kt->bf_kpad) + 1) / 2;
    const size_t f = mha__gemm_packed_b_floats(kt, q->I, q->O);
    return q->bh ? (f + 1) / 2 : f;
}

mha_status mha__packs_create(mha_module *m) {
    m->packs = NULL;
    const mha__kernels *kt = mha__kernels_get();
    packed_mat mats[MAX_MATS];
    int n = 0;
    const int64_t E = m->cfg.embed_dim, Eq = m->q_dim, Ekv = m->kv_dim, H = m->cfg.num_heads;
    // float32 weights, or bf16 ones that the bf16 compute multiplies by
    // (fused_fwd.c): the projections' matrices in their storage
    // and half weights in their type for the float32 compute
    const bool bf = m->wdt == MHA_BF16 && kt->bf_fast;
    const int bh = m->wdt == MHA_BF16 ? 1 : m->wdt == MHA_F16 ? 2 : 0;
    for (int form = 0; form < 2; form++) {
        // form 0: float32 weights, or the bf16 compute's; 1: the half ones
        const bool want = form == 0 ? m->wdt == MHA_F32 || bf : bh != 0;
        const bool fb = form == 0 && bf;
        const int fh = form == 1 ? bh : 0;
        if (!want) continue;
        if (m->packed) {
            mats[n++] = (packed_mat){m->w_in, Eq + 2 * Ekv, E, fb, fh, NULL};
        } else {
            mats[n++] = (packed_mat){m->w_q, Eq, E, fb, fh, NULL};
            mats[n++] = (packed_mat){m->w_k, Ekv, m->cfg.kdim, fb, fh, NULL};
            mats[n++] = (packed_mat){m->w_v, Ekv, m->cfg.vdim, fb, fh, NULL};
        }
        mats[n++] = (packed_mat){m->w_out, E, Eq, fb, fh, NULL};
    }
    if (m->gate_weight) mats[n++] = (packed_mat){m->gate_weight, H, E, false, 0, NULL};
    if (n == 0) return MHA_OK;
    // one block: the header (64-byte rounded), then each packed matrix
    // (64-byte aligned)
    size_t floats = 0;
    for (int i = 0; i < n; i++) {
        const size_t f = round16(mat_floats(kt, &mats[i]));
        if (mha__add_overflow_size(floats, f, &floats))
            return mha__fail(MHA_ERR_OVERFLOW, "mha_module_create: packed weights overflow");
    }
    const size_t head = (sizeof(mha__packs) + 63) & ~(size_t)63;
    size_t bytes;
    if (mha__mul_overflow_size(floats, sizeof(float), &bytes) ||
        mha__add_overflow_size(bytes, head, &bytes))
        return mha__fail(MHA_ERR_OVERFLOW, "mha_module_create: packed weights overflow");
    char *blk = mha__alloc(bytes);
    if (!blk)
        return mha__fail(MHA_ERR_NOMEM,
                         "mha_module_create: out of memory for %zu bytes of packed weights",
                         bytes);
    mha__packs *pk = (mha__packs *)blk;
    memset(pk, 0, sizeof *pk);
    atomic_init(&pk->state, 0);  // stale: the first call fills it
    pk->kt = kt;
    pk->n = n;
    pk->bytes = bytes;
    float *f = (float *)(blk + head);
    for (int i = 0; i < n; i++) {
        pk->mat[i] = mats[i];
        pk->mat[i].dst = f;
        f += round16(mat_floats(kt, &mats[i]));
    }
    m->packs = pk;
    return MHA_OK;
}

void mha__packs_destroy(mha__packs *pk) { mha__free(pk); }

size_t mha__packs_bytes(const mha_module *m) { return m->packs ? m->packs->bytes : 0; }

void mha__packs_stale(const mha_module *m) {
    mha__packs *pk = m ? m->packs : NULL;
    if (!pk) return;
    uint64_t s = atomic_load_explicit(&pk->state, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(&pk->state, &s, (s & ~(uint64_t)VALID) | DIRTY,
                                                  memory_order_acq_rel, memory_order_relaxed)) {
    }
}

void mha_module_params_changed(mha_module *m) { mha__packs_stale(m); }

const mha__packs *mha__packs_acquire(const mha_module *m, const mha__kernels *kt, int nt) {
    mha__packs *pk = m->packs;
    if (!pk || pk->kt != kt) return NULL;
    uint64_t s = atomic_load_explicit(&pk->state, memory_order_acquire);
    for (;;) {
        if (s & VALID) {  // a reader
            if (atomic_compare_exchange_weak_explicit(&pk->state, &s, s + READER,
                                                      memory_order_acquire,
                                                      memory_order_acquire))
                return pk;
            continue;
        }
        if ((s & BUILD) || s >= READER) return NULL;  // being built, or still read
        if (atomic_compare_exchange_weak_explicit(&pk->state, &s, (s | BUILD) & ~(uint64_t)DIRTY,
                                                  memory_order_acquire, memory_order_acquire))
            break;
    }
    // the builder: fill the copy from the parameters as they are now
    for (int i = 0; i < pk->n; i++) {
        const packed_mat *q = &pk->mat[i];
        if (q->bf16)  // B (I, O) = W^T
            kt->pack_bf16((uint16_t *)(void *)q->dst, q->src, 1, q->I, q->I, q->O);
        else if (q->bh)
            mha__gemm_pack_wt_bh(kt, (uint16_t *)(void *)q->dst, q->src, q->O, q->I, nt);
        else mha__gemm_pack_wt(kt, q->dst, q->src, q->O, q->I, nt);
    }
    // publish it (and read it: the builder is its first reader), unless the
    // parameters were declared changed meanwhile
    s = atomic_load_explicit(&pk->state, memory_order_relaxed);
    uint64_t next;
    do {
        next = (s & DIRTY) ? s & ~(uint64_t)BUILD : ((s & ~(uint64_t)BUILD) | VALID) + READER;
    } while (!atomic_compare_exchange_weak_explicit(&pk->state, &s, next, memory_order_release,
                                                    memory_order_relaxed));
    return (next & VALID) ? pk : NULL;
}

void mha__packs_release(const mha__packs *pk) {
    if (!pk) return;
    atomic_fetch_sub_explicit(&((mha__packs *)pk)->state, (uint64_t)READER,
                              memory_order_release);
}

// The packed form of rows [r0, r0 + O) of a matrix kept in the float32
// kernels' layout (half: in its bf16 / f16 type, else float32), w pointing at
// row r0 (I columns): a panel-aligned slice (kernels.h: columns [p nr,
// ...) are Bp + p nr K), or NULL.
static const void *find_slice(const mha__packs *pk, const void *w, int64_t O, int64_t I,
                              bool half) {
    if (!pk || !w) return NULL;
    const char *p = (const char *)w;
    const size_t es = half ? sizeof(uint16_t) : sizeof(float);
    for (int i = 0; i < pk->n; i++) {
        const packed_mat *q = &pk->mat[i];
        const char *s = (const char *)q->src;
        const size_t row = (size_t)q->I * es;
        if (q->bf16 || (q->bh != 0) != half || q->I != I || p < s || p >= s + (size_t)q->O * row)
            continue;
        const size_t off = (size_t)(p - s);
        const int64_t r0 = (int64_t)(off / row);
        if (off % row != 0 || r0 % pk->kt->pk_nr != 0 || r0 + O > q->O) return NULL;
        return (const char *)q->dst + (size_t)(r0 * I) * es;
    }
    return NULL;
}

const float *mha__packs_find(const mha__packs *pk, const void *w, int64_t O, int64_t I) {
    return find_slice(pk, w, O, I, false);
}

const uint16_t *mha__packs_find_bh(const mha__packs *pk, const void *w, int64_t O, int64_t I) {
    return find_slice(pk, w, O, I, true);
}

const uint16_t *mha__packs_find_bf16(const mha__packs *pk, const void *w, int64_t O, int64_t I) {
    for (int i = 0; pk && w && i < pk->n; i++) {
        const packed_mat *q = &pk->mat[i];
        if (q->bf16 && q->src == w && q->O == O && q->I == I)
            return (const uint16_t *)(const void *)q->dst;
    }
    return NULL;
}
