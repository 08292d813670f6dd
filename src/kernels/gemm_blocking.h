// gemm_blocking.h: the GEMM blocking of the AVX2 and AVX-512 tables, written
// once (BLIS's split: the loops here, the micro-kernels in the ISA files).
// A template: avx2.c and avx512.c each include it after their micro-kernels
// and get its functions compiled for their ISA, with the micro-kernels
// inlined into the loops (nothing is called per k or per tile that was not
// before). It holds the loops over column, k and row blocks, the packing
// loops, the edge handling and the slot functions; no intrinsics.
//
// What the including file defines first:
//
//   the unpacked GEMM (gemm_nn_acc, gemm_tn_acc; A and B read in place)
//     MR, NR, KC, NC   micro-tile rows and columns, k and column blocks
//     ukr_mr(kc, A, ars, aks, B, ldb, C, ldc, nr, add)
//                      C[0:MR, 0:min(nr, NR)] (+)= A B over kc, element
//                      (r, k) of A at A[r*ars + k*aks], B row-major (ldb);
//                      per element an FMA chain from 0 over k in
//                      increasing order, then added to C (add) or stored
//     ukr_row(...)     the same for one row (the edge of M)
//
//   the packed GEMM (pack_b, gemm_packed*; kernels.h's format)
//     PMR, PNR, PKC, PMC   micro-tile rows, panel width, k chunk, row block
//     pack_b_panel(P, B, sk, sn, K, nr)
//                      P (K, PNR) <- columns [0, nr) of B (element (k, n)
//                      at B[k*sk + n*sn]), zero past nr
//     pack_a_tile(Ap, A, lda, rows, kc)
//                      Ap (kc, PMR), k-major <- A (rows, kc), row-major,
//                      zero past rows
//     pack_a_t_k(Ap, A, rows)
//                      Ap[0:PMR] <- A[0:rows], zero past rows (a k's PMR
//                      elements of a transposed A, contiguous in it)
//     ukr_packed_any(kc, Ap, Bp, kind, C, ldc, mr, nr, add, bias, pf)
//                      C[0:mr, 0:min(nr, PNR)] = [C +] Ap Bp [+ bias]:
//                      Ap from pack_a_tile (PMR rows, the first mr kept),
//                      Bp a panel's kc rows of PNR elements of kind (0
//                      float32, 1 bf16, 2 f16, widened as loaded); per
//                      element the FMA chain from 0 over k, then C +, then
//                      + bias; pf: 2 * PNR * kc bytes to prefetch into L2
//                      spread over the k loop (any readable address)
//
// and gets (static): gemm_acc (inline), gemm_nn_acc, gemm_tn_acc, pack_b,
// gemm_packed, gemm_packed_tn, gemm_packed_bh.
#if !defined(MR) || !defined(NR) || !defined(KC) || !defined(NC) || !defined(PMR) || \
    !defined(PNR) || !defined(PKC) || !defined(PMC)
#error "gemm_blocking.h: define the ISA's blocking constants first"
#endif
// kernels.h: gemm_packed's overwrite + bias is gemm_nn's bits, + bias: the
// same k chunks.
_Static_assert(PKC == KC, "the packed GEMM's k chunk must be the unpacked one's");

// ---- The unpacked GEMM: A and B read in place, MR x NR micro-tiles in
// KC x NC blocks. Every C element accumulates over k in increasing order,
// in KC-sized chunks: fixed by the shape alone.

// One micro-tile row block: C[0:mr, 0:nr] (+)= A B, mr <= MR.
static inline __attribute__((always_inline)) void gemm_tile(int64_t kc, const float *A,
                                                            int64_t ars, int64_t aks,
                                                            const float *B, int64_t ldb,
                                                            float *C, int64_t ldc, int64_t mr,
                                                            int64_t nr, bool add) {
    if (mr == MR) ukr_mr(kc, A, ars, aks, B, ldb, C, ldc, nr, add);
    else
        for (int64_t r = 0; r < mr; r++)
            ukr_row(kc, A + r * ars, ars, aks, B, ldb, C + r * ldc, ldc, nr, add);
}

// C (M, N) += A B (overwrite: C = A B, C never read) in KC x NC blocks of
// MR x NR micro-tiles.
static inline __attribute__((always_inline)) void gemm_acc(float *C, int64_t ldc,
                                                           const float *A, int64_t ars,
                                                           int64_t aks, const float *B,
                                                           int64_t ldb, int64_t M, int64_t N,
                                                           int64_t K, bool overwrite) {
    for (int64_t j0 = 0; j0 < N; j0 += NC) {
        int64_t nc = N - j0 < NC ? N - j0 : NC;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            int64_t kc = K - k0 < KC ? K - k0 : KC;
            const bool add = !overwrite || k0 > 0;
            for (int64_t i0 = 0; i0 < M; i0 += MR) {
                int64_t mr = M - i0 < MR ? M - i0 : MR;
                for (int64_t j1 = 0; j1 < nc; j1 += NR)
                    gemm_tile(kc, A + i0 * ars + k0 * aks, ars, aks, B + k0 * ldb + j0 + j1,
                              ldb, C + i0 * ldc + j0 + j1, ldc, mr, nc - j1, add);
            }
        }
    }
}

static void gemm_nn_acc(float *C, int64_t ldc, const float *A, int64_t lda, const float *B,
                        int64_t ldb, int64_t M, int64_t N, int64_t K) {
    gemm_acc(C, ldc, A, lda, 1, B, ldb, M, N, K, false);
}

// gemm_tn_acc (kernels.h): C += A^T B with A stored (K, M), row stride lda:
// the same blocking, micro-tiles and per-element sum order as gemm_nn_acc,
// so it is bit-identical to transposing A and calling gemm_nn_acc.
static void gemm_tn_acc(float *C, int64_t ldc, const float *A, int64_t lda, const float *B,
                        int64_t ldb, int64_t M, int64_t N, int64_t K) {
    gemm_acc(C, ldc, A, 1, lda, B, ldb, M, N, K, false);
}

// ---- The packed GEMM (kernels.h: pack_b, gemm_packed). B in PNR-wide
// panels, contiguous along k; A copied per (PMC rows, PKC k) block into
// PMR-row micro-panels (k-major, PMR floats per k). Loops: rows by PMC, k
// by PKC (the A block packed once, in L2), column panels (a PNR x PKC B
// micro-panel stays in L1 across the row tiles), row tiles. Edge rows: the
// A copy is zero-padded to PMR rows, the tile computed whole and only the
// real rows stored; edge columns: B is zero-padded, stores masked. Each C
// element's sum is the same FMA chain whatever the tile it falls in, in
// PKC chunks: the same order as the unpacked GEMM's KC (= PKC).

static void pack_b(float *Bp, const float *B, int64_t sk, int64_t sn, int64_t K, int64_t N) {
    for (int64_t j0 = 0; j0 < N; j0 += PNR)  // panel j0 / PNR at Bp + j0 * K
        pack_b_panel(Bp + j0 * K, B + j0 * sn, sk, sn, K, N - j0 < PNR ? N - j0 : PNR);
}

// Ap (tiles of PMR rows, k-major) <- A (mc, kc), rows past mc zero.
static void pack_a(float *Ap, const float *A, int64_t lda, int64_t mc, int64_t kc) {
    for (int64_t i0 = 0; i0 < mc; i0 += PMR)
        pack_a_tile(Ap + i0 * kc, A + i0 * lda, lda, mc - i0 < PMR ? mc - i0 : PMR, kc);
}

// Ap (tiles of PMR rows, k-major) <- the (mc, kc) block of a transposed A
// (element (i, k) at A[k*lda + i]): PMR contiguous floats per tile and k,
// rows past mc zero; each row of A read once, left to right. The same Ap
// as pack_a of the transposed copy.
static void pack_a_t(float *Ap, const float *A, int64_t lda, int64_t mc, int64_t kc) {
    for (int64_t k = 0; k < kc; k++)
        for (int64_t i0 = 0; i0 < mc; i0 += PMR)
            pack_a_t_k(Ap + i0 * kc + k * PMR, A + k * lda + i0, mc - i0);
}

// The micro-kernel for each kind of B (a constant in each after inlining),
// called through a pointer: one call per tile.
typedef void ukr_packed_fn(int64_t kc, const float *Ap, const void *Bp, float *C, int64_t ldc,
                           int64_t mr, int64_t nr, bool add, const float *bias, const char *pf);
static void ukr_packed_f32(int64_t kc, const float *Ap, const void *Bp, float *C, int64_t ldc,
                           int64_t mr, int64_t nr, bool add, const float *bias, const char *pf) {
    ukr_packed_any(kc, Ap, Bp, 0, C, ldc, mr, nr, add, bias, pf);
}
static void ukr_packed_bf(int64_t kc, const float *Ap, const void *Bp, float *C, int64_t ldc,
                          int64_t mr, int64_t nr, bool add, const float *bias, const char *pf) {
    ukr_packed_any(kc, Ap, Bp, 1, C, ldc, mr, nr, add, bias, pf);
}
static void ukr_packed_hf(int64_t kc, const float *Ap, const void *Bp, float *C, int64_t ldc,
                          int64_t mr, int64_t nr, bool add, const float *bias, const char *pf) {
    ukr_packed_any(kc, Ap, Bp, 2, C, ldc, mr, nr, add, bias, pf);
}

// K = 0: C = [C +] 0 [+ bias] (as the chunks' sum order has it).
static void gemm_packed_k0(float *C, int64_t ldc, const float *bias, int64_t M, int64_t N,
                           bool accumulate) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            float v = accumulate ? C[i * ldc + j] : 0.0f;
            if (bias) v = v + bias[j];
            C[i * ldc + j] = v;
        }
}

// gemm_packed and gemm_packed_tn: A row-major (at false) or stored
// transposed (at true); only the A copy differs.
static inline __attribute__((always_inline)) void gemm_packed_any(
    float *C, int64_t ldc, const float *A, int64_t lda, bool at, const void *Bp, int kind,
    const float *bias, int64_t M, int64_t N, int64_t K, bool accumulate, float *apack) {
    ukr_packed_fn *ukr = kind == 0   ? ukr_packed_f32
                         : kind == 1 ? ukr_packed_bf
                                     : ukr_packed_hf;
    const int64_t es = kind == 0 ? 4 : 2;  // bytes of B's elements
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        gemm_packed_k0(C, ldc, bias, M, N, accumulate);
        return;
    }
    // row blocks of at most PMC rows, as even as whole tiles allow (each
    // block streams all of B once: no small last block)
    const int64_t tiles = (M + PMR - 1) / PMR, nblk = (tiles + PMC / PMR - 1) / (PMC / PMR);
    for (int64_t ib = 0; ib < nblk; ib++) {
        const int64_t i0 = ib * tiles / nblk * PMR, i1 = (ib + 1) * tiles / nblk * PMR;
        const int64_t mc = (i1 < M ? i1 : M) - i0;
        for (int64_t k0 = 0; k0 < K; k0 += PKC) {
            const int64_t kc = K - k0 < PKC ? K - k0 : PKC;
            const bool add = accumulate || k0 > 0, last = k0 + kc == K;
            if (at) pack_a_t(apack, A + k0 * lda + i0, lda, mc, kc);
            else pack_a(apack, A + i0 * lda + k0, lda, mc, kc);
            for (int64_t j0 = 0; j0 < N; j0 += PNR) {
                const char *Bb = (const char *)Bp + (j0 * K + k0 * PNR) * es;
                const float *bj = last && bias ? bias + j0 : NULL;
                // the next panel's micro-panel (kc rows of PNR elements,
                // PNR * kc * es bytes), prefetched by the first es / 2
                // tiles, 2 * PNR * kc bytes each; the others re-touch
                // their own A
                const char *nb = j0 + PNR < N ? Bb + PNR * K * es : Bb;
                for (int64_t t = 0, ti = 0; t < mc; t += PMR, ti++)
                    ukr(kc, apack + t * kc, Bb, C + (i0 + t) * ldc + j0, ldc, mc - t, N - j0,
                        add, bj,
                        ti < es / 2 ? nb + ti * 2 * PNR * kc : (const char *)(apack + t * kc));
            }
        }
    }
}

static void gemm_packed(float *C, int64_t ldc, const float *A, int64_t lda, const float *Bp,
                        const float *bias, int64_t M, int64_t N, int64_t K, bool accumulate,
                        float *apack) {
    gemm_packed_any(C, ldc, A, lda, false, Bp, 0, bias, M, N, K, accumulate, apack);
}

static void gemm_packed_bh(float *C, int64_t ldc, const float *A, int64_t lda,
                           const uint16_t *Bp, int kind, const float *bias, int64_t M,
                           int64_t N, int64_t K, bool accumulate, float *apack) {
    gemm_packed_any(C, ldc, A, lda, false, Bp, kind, bias, M, N, K, accumulate, apack);
}

static void gemm_packed_tn(float *C, int64_t ldc, const float *A, int64_t lda, const float *Bp,
                           const float *bias, int64_t M, int64_t N, int64_t K, bool accumulate,
                           float *apack) {
    gemm_packed_any(C, ldc, A, lda, true, Bp, 0, bias, M, N, K, accumulate, apack);
}
