// gemm.c: the threaded driver of the packed-B GEMM (gemm.h). Work items are
// (row range, panel range) rectangles of C, handed out dynamically; a row
// range is a run of whole micro-tiles (pk_mr rows) so no thread pads a
// tile another also computes. Every C element is computed by one
// gemm_packed call whose sum order depends on K only (kernels.h), so the
// split, the schedule and nt never change a bit.
#include "gemm.h"
#include "internal.h"

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The packing of np panels over nt threads: items of *per panels each.
static int64_t pack_items(int64_t np, int nt, int64_t *per) {
    *per = np < 8 * (int64_t)nt ? 1 : cdiv(np, 8 * (int64_t)nt);
    return cdiv(np, *per);
}

size_t mha__gemm_packed_b_floats(const mha__kernels *kt, int64_t K, int64_t N) {
    if (K <= 0 || N <= 0) return 0;
    return (size_t)(cdiv(N, kt->pk_nr) * kt->pk_nr) * (size_t)K;
}

size_t mha__gemm_thread_scratch_floats(const mha__kernels *kt) {
    // rounded to 64 bytes so every thread's slice starts on its own line
    return ((size_t)kt->pk_apack + 15) & ~(size_t)15;
}

size_t mha__gemm_scratch_floats(const mha__kernels *kt, int nt) {
    return mha__gemm_thread_scratch_floats(kt) * (size_t)(nt > 0 ? nt : 1);
}

void mha__gemm_pack_b(const mha__kernels *kt, float *Bp, const float *B, int64_t sk,
                      int64_t sn, int64_t K, int64_t N, int nt) {
    if (K <= 0 || N <= 0) return;
    const int64_t nr = kt->pk_nr;
    int64_t per;
    const int64_t items = pack_items(cdiv(N, nr), nt, &per);
    if (nt <= 1 || items == 1) {
        kt->pack_b(Bp, B, sk, sn, K, N);
        return;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t it = 0; it < items; it++) {
        const int64_t j0 = it * per * nr, j1 = j0 + per * nr < N ? j0 + per * nr : N;
        kt->pack_b(Bp + j0 * K, B + j0 * sn, sk, sn, K, j1 - j0);
    }
}

void mha__gemm_pack_wt(const mha__kernels *kt, float *Bp, const float *W, int64_t O, int64_t I,
                       int nt) {
    mha__gemm_pack_b(kt, Bp, W, 1, I, I, O, nt);
}

size_t mha__gemm_pack_half_tmp_floats(const mha__kernels *kt, int64_t I, int nt) {
    return (size_t)kt->pk_nr * (size_t)(I > 0 ? I : 0) * (size_t)(nt > 0 ? nt : 1);
}

void mha__gemm_pack_wt_half(const mha__kernels *kt, float *Bp, const uint16_t *W, int kind,
                            int64_t O, int64_t I, int nt, float *tmp) {
    if (O <= 0 || I <= 0) return;
    const int64_t nr = kt->pk_nr, np = cdiv(O, nr);
    void (*cvt)(float *, const uint16_t *, int64_t) = kind == 1 ? kt->cvt_bf16 : kt->cvt_f16;
    // panel by panel: its nr rows of W widened into the thread's tmp (the
    // widening is exact, so Bp is the packing of the float32 W)
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt > 1 && np > 1 ? nt : 1)
    for (int64_t pi = 0; pi < np; pi++) {
        const int64_t j0 = pi * nr, n = j0 + nr < O ? nr : O - j0;
        float *t = tmp + (size_t)mha__thread_id() * (size_t)(nr * I);
        cvt(t, W + j0 * I, n * I);
        kt->pack_b(Bp + j0 * I, t, 1, I, I, n);
    }
}

void mha__gemm_pack_rows(const mha__kernels *kt, float *Bp, const float *B, int64_t ldb,
                         int64_t K, int64_t N, int nt) {
    mha__gemm_pack_b(kt, Bp, B, ldb, 1, K, N, nt);
}

void mha__gemm_pack_rows_half(const mha__kernels *kt, float *Bp, const uint16_t *B, int kind,
                              int64_t ldb, int64_t K, int64_t N, int nt, float *tmp) {
    if (K <= 0 || N <= 0) return;
    const int64_t nr = kt->pk_nr, np = cdiv(N, nr);
    void (*cvt)(float *, const uint16_t *, int64_t) = kind == 1 ? kt->cvt_bf16 : kt->cvt_f16;
    // panel by panel: its nr columns of every row widened into the
    // thread's tmp (K, nr) (exact), then packed as the float32 B's panel
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt > 1 && np > 1 ? nt : 1)
    for (int64_t pi = 0; pi < np; pi++) {
        const int64_t j0 = pi * nr, n = j0 + nr < N ? nr : N - j0;
        float *t = tmp + (size_t)mha__thread_id() * (size_t)(nr * K);
        for (int64_t k = 0; k < K; k++) cvt(t + k * nr, B + k * ldb + j0, n);
        kt->pack_b(Bp + j0 * K, t, nr, 1, K, n);
    }
}

// Work items of a (R, N) product: rchunks row ranges x cchunks column
// groups. Row ranges: up to 4 per thread (dynamic balance on a shared
// machine), balanced to within one tile. Few rows: split the panels too,
// into column groups of at least 4 panels (the A copy is made per item).
static void split(int64_t tiles, int64_t panels, int nt, int64_t *rchunks, int64_t *cchunks) {
    *rchunks = tiles < 4 * (int64_t)nt ? tiles : 4 * (int64_t)nt;
    *cchunks = 1;
    if (*rchunks < 2 * (int64_t)nt) {
        *cchunks = cdiv(2 * (int64_t)nt, *rchunks);
        const int64_t cmax = panels / 4 > 1 ? panels / 4 : 1;
        if (*cchunks > cmax) *cchunks = cmax;
    }
}

// Item `it` of a split of R rows (mr-row tiles) and N columns (nr-wide
// panels): rows [b->r0, b->r1), columns [b->j0, b->j1); false when empty.
typedef struct gemm_block {
    int64_t r0, r1, j0, j1;
} gemm_block;

static bool item_block(gemm_block *b, int64_t it, int64_t rchunks, int64_t cchunks, int64_t R,
                       int64_t N, int64_t mr, int64_t nr) {
    const int64_t tiles = cdiv(R, mr), panels = cdiv(N, nr);
    const int64_t ri = it / cchunks, ci = it % cchunks;
    const int64_t t0 = ri * tiles / rchunks, t1 = (ri + 1) * tiles / rchunks;
    const int64_t p0 = ci * panels / cchunks, p1 = (ci + 1) * panels / cchunks;
    b->r0 = t0 * mr, b->r1 = t1 * mr < R ? t1 * mr : R;
    b->j0 = p0 * nr, b->j1 = p1 * nr < N ? p1 * nr : N;
    return b->r1 > b->r0 && b->j1 > b->j0;
}

// The driver of both: X row-major (at false: rows r0.. at X + r0*ldx) or
// stored transposed (at true: X (K, R), rows r0.. at X + r0).
// One gemm_packed (at: _tn; kind 1, 2: gemm_packed_bh of Bp's bf16 / f16
// elements) on a block.
static void gemm_kind(const mha__kernels *kt, bool at, int kind, float *C, int64_t ldc,
                      const float *X, int64_t ldx, const void *Bp, const float *bias,
                      int64_t M, int64_t N, int64_t K, bool accumulate, float *apack) {
    if (kind) kt->gemm_packed_bh(C, ldc, X, ldx, Bp, kind, bias, M, N, K, accumulate, apack);
    else if (at) kt->gemm_packed_tn(C, ldc, X, ldx, Bp, bias, M, N, K, accumulate, apack);
    else kt->gemm_packed(C, ldc, X, ldx, Bp, bias, M, N, K, accumulate, apack);
}

static void rows_packed(const mha__kernels *kt, float *C, int64_t ldc, const float *X,
                        int64_t ldx, bool at, const void *Bp, int kind, const float *bias,
                        int64_t R, int64_t K, int64_t N, bool accumulate, int nt,
                        float *thread_scratch) {
    if (R <= 0 || N <= 0) return;
    if (nt < 1) nt = 1;
    const int64_t mr = kt->pk_mr, nr = kt->pk_nr, es = kind ? 2 : 4;
    const size_t per = mha__gemm_thread_scratch_floats(kt);
    int64_t rchunks, cchunks;
    split(cdiv(R, mr), cdiv(N, nr), nt, &rchunks, &cchunks);
    const int64_t items = rchunks * cchunks;
    if (nt == 1 || items == 1) {
        gemm_kind(kt, at, kind, C, ldc, X, ldx, Bp, bias, R, N, K, accumulate, thread_scratch);
        return;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t it = 0; it < items; it++) {
        gemm_block b;
        if (!item_block(&b, it, rchunks, cchunks, R, N, mr, nr)) continue;
        gemm_kind(kt, at, kind, C + b.r0 * ldc + b.j0, ldc, at ? X + b.r0 : X + b.r0 * ldx,
                  ldx, (const char *)Bp + (K ? b.j0 * K * es : 0), bias ? bias + b.j0 : NULL,
                  b.r1 - b.r0, b.j1 - b.j0, K, accumulate,
                  thread_scratch + per * (size_t)mha__thread_id());
    }
}

void mha__gemm_rows_packed_bh(const mha__kernels *kt, float *C, int64_t ldc, const float *X,
                              int64_t ldx, const uint16_t *Bp, int kind, const float *bias,
                              int64_t R, int64_t K, int64_t N, bool accumulate, int nt,
                              float *thread_scratch) {
    rows_packed(kt, C, ldc, X, ldx, false, Bp, kind, bias, R, K, N, accumulate, nt,
                thread_scratch);
}

void mha__gemm_pack_wt_bh(const mha__kernels *kt, uint16_t *Bp, const uint16_t *W, int64_t O,
                          int64_t I, int nt) {
    if (O <= 0 || I <= 0) return;
    const int64_t nr = kt->pk_nr, np = cdiv(O, nr);
    // kernels.h's pack_b layout, Bp[(p K + k) nr + j] = W[(p nr + j) I + k]
    // (0 past O), in blocks of 64 k: a (nr, 64) piece of W read row by row
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt > 1 && np > 1 ? nt : 1)
    for (int64_t pi = 0; pi < np; pi++) {
        const int64_t j0 = pi * nr, n = j0 + nr < O ? nr : O - j0;
        uint16_t *P = Bp + j0 * I;
        for (int64_t k0 = 0; k0 < I; k0 += 64) {
            const int64_t kn = I - k0 < 64 ? I - k0 : 64;
            for (int64_t j = 0; j < nr; j++) {
                const uint16_t *w = W + (j0 + j) * I + k0;
                for (int64_t k = 0; k < kn; k++) P[(k0 + k) * nr + j] = j < n ? w[k] : 0;
            }
        }
    }
}

void mha__gemm_rows_packed(const mha__kernels *kt, float *C, int64_t ldc, const float *X,
                           int64_t ldx, const float *Bp, const float *bias, int64_t R,
                           int64_t K, int64_t N, bool accumulate, int nt,
                           float *thread_scratch) {
    rows_packed(kt, C, ldc, X, ldx, false, Bp, 0, bias, R, K, N, accumulate, nt, thread_scratch);
}

void mha__gemm_rows_packed_tn(const mha__kernels *kt, float *C, int64_t ldc, const float *XT,
                              int64_t ldx, const float *Bp, const float *bias, int64_t R,
                              int64_t K, int64_t N, bool accumulate, int nt,
                              float *thread_scratch) {
    rows_packed(kt, C, ldc, XT, ldx, true, Bp, 0, bias, R, K, N, accumulate, nt, thread_scratch);
}
