// diag.c: per-head diagnostics (mha_diag_create, mha.h). Everything is
// recomputed here from the module's projections in double, the way the
// reference computes them (mha__project_qkv: biases, add_bias_kv,
// add_zero_attn, qk_norm, RoPE), one query row at a time: memory O(S) per row and
// head, so long sequences work with max_rows subsampling. Singular values
// come from LAPACK (dgesdd, values only), with its workspace in the one
// block allocated here (LAPACKE's own wrapper would allocate it). Built
// without LAPACKE (MHA_HAVE_LAPACKE undefined: CMake's MHA_LAPACKE=OFF, or
// lapacke not found) there are no singular values: every rank is -1 and
// mha_diag_spectrum returns NULL, as mha.h documents; the rest is
// the same.
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plan.h"
#include "ref.h"

#ifdef MHA_HAVE_LAPACKE
// after plan.h: lapacke.h brings <complex.h>, whose macro I would clash
// with the parameter names of the internal headers
#include <lapacke.h>
#undef I
#endif

struct mha_diag {
    int64_t H, nrows_total;
    mha_head_diag *heads;
    double *sim;          // (H, H)
    double *spec;         // per head: q, k, v, o spectra, d values each
                          // (NULL: built without LAPACKE)
    int64_t nspec;        // values per spectrum (min(d, features); 0
                          // without LAPACKE)
    char nonfinite[160];  // "" when every value was finite
};

void mha_diag_options_init(mha_diag_options *o) {
    if (!o) return;
    memset(o, 0, sizeof *o);
    o->max_rows = 256;
    o->dead_entropy = 0.98;
    o->dead_output = 1e-4;
    o->rank_rtol = 0.0;
}

void mha_diag_destroy(mha_diag *d) {
    if (!d) return;
    free(d->heads);
    free(d->sim);
    free(d->spec);
    free(d);
}

int64_t mha_diag_num_heads(const mha_diag *d) { return d ? d->H : 0; }
int64_t mha_diag_rows(const mha_diag *d) { return d ? d->nrows_total : 0; }

const mha_head_diag *mha_diag_head(const mha_diag *d, int64_t h) {
    return d && h >= 0 && h < d->H ? &d->heads[h] : NULL;
}

double mha_diag_similarity(const mha_diag *d, int64_t h1, int64_t h2) {
    if (!d || h1 < 0 || h2 < 0 || h1 >= d->H || h2 >= d->H) return NAN;
    return d->sim[h1 * d->H + h2];
}

const double *mha_diag_spectrum(const mha_diag *d, int64_t h, char which, int64_t *n) {
    const char *w = "qkvo", *at = d ? strchr(w, which) : NULL;
    if (n) *n = 0;
    if (!d || h < 0 || h >= d->H || !at || !which) return NULL;
    if (!d->spec) {
        mha__fail(MHA_ERR_UNSUPPORTED,
                  "mha_diag_spectrum: singular values "
                  "unavailable: mha was built without LAPACKE (ranks are -1)");
        return NULL;
    }
    if (n) *n = d->nspec;
    return d->spec + (h * 4 + (at - w)) * d->nspec;
}

const char *mha_diag_nonfinite(const mha_diag *d) {
    return d && d->nonfinite[0] ? d->nonfinite : NULL;
}

// ---- non-finite search: the first element, in a fixed order ----

static bool find_nonfinite_view(char *out, size_t cap, const char *name, const mha_tensor *t) {
    if (!t) return false;
    int64_t idx[MHA_MAX_DIMS] = {0}, n = mha_tensor_numel(t);
    const size_t es = mha_dtype_size(t->dtype);
    for (int64_t e = 0; e < n; e++) {
        int64_t off = 0, r = e;
        for (int dd = t->ndim - 1; dd >= 0; dd--) {
            idx[dd] = r % t->shape[dd];
            r /= t->shape[dd];
            off += idx[dd] * t->stride[dd];
        }
        const mha__mat v = mha__vmat((char *)t->data + off * (int64_t)es, t->dtype, 0, 0);
        if (!isfinite(mha__ld(v, 0, 0))) {
            int k = snprintf(out, cap, "%s[", name);
            for (int dd = 0; dd < t->ndim && k > 0 && (size_t)k < cap; dd++)
                k += snprintf(out + k, cap - (size_t)k, "%s%lld", dd ? ", " : "",
                              (long long)idx[dd]);
            if (k > 0 && (size_t)k < cap)
                snprintf(out + k, cap - (size_t)k, "] = %g", mha__ld(v, 0, 0));
            return true;
        }
    }
    return false;
}

static bool find_nonfinite_params(char *out, size_t cap, const mha_module *m) {
    for (int i = 0; i < m->nparams; i++) {
        const mha_param p = m->params[i];  // (read only: not mha_module_param_at,
                                           // which marks the packed weights stale)
        mha_tensor t = mha_tensor_contiguous(p.storage, p.dtype, p.ndim, p.shape);
        if (find_nonfinite_view(out, cap, p.name, &t)) return true;
    }
    return false;
}

// The first non-finite element of a (N, T, F) double buffer.
static bool find_nonfinite_buf(char *out, size_t cap, const char *name, const double *x,
                               int64_t N, int64_t T, int64_t F) {
    for (int64_t e = 0; e < N * T * F; e++)
        if (!isfinite(x[e])) {
            snprintf(out, cap, "projected %s (batch %lld, position %lld, feature %lld) = %g",
                     name, (long long)(e / (T * F)), (long long)(e / F % T),
                     (long long)(e % F), x[e]);
            return true;
        }
    return false;
}

// ---- singular values ----
#ifdef MHA_HAVE_LAPACKE

// dgesdd's workspace (singular values only) for a row-major (M, K) matrix:
// the optimal size LAPACK asks for (as LAPACKE_dgesdd would allocate), or
// its documented minimum if the query fails.
static size_t svd_lwork(int64_t M, int64_t K) {
    const int64_t mn = M < K ? M : K, mx = M < K ? K : M;
    double q = 0.0, dummy = 0.0;
    lapack_int iw = 0;
    lapack_int info = LAPACKE_dgesdd_work(LAPACK_COL_MAJOR, 'N', (lapack_int)K, (lapack_int)M,
                                          &dummy, (lapack_int)(K > 1 ? K : 1), &dummy, NULL, 1,
                                          NULL, 1, &q, -1, &iw);
    const double least = (double)(3 * mn + (mx > 7 * mn ? mx : 7 * mn));
    return (size_t)(info == 0 && q > least ? q : least);
}

// The SVD's scratch: a copy of the matrix (d * fmax), dgesdd's work (lwork)
// and iwork (8 d).
typedef struct svd_ws {
    double *a, *work;
    lapack_int lwork, *iwork;
} svd_ws;

// Singular values (descending) of the (M, K) matrix W(r, c) = src(r0 + r,
// c0 + c) of a row-major (., ld) matrix of dtype dt, into sv (min(M, K));
// returns the rank: sigma > rtol * sigma_max (rtol <= 0: max(M, K) times
// the storage's epsilon, as numpy.linalg.matrix_rank).
static int64_t spectrum(double *sv, const void *src, mha_dtype dt, int64_t ld, int64_t r0,
                        int64_t c0, int64_t M, int64_t K, double rtol, const svd_ws *ws) {
    const mha__mat w = mha__vmat((void *)src, dt, ld, 1);
    double *a = ws->a;
    bool nan = false;
    for (int64_t r = 0; r < M; r++)
        for (int64_t c = 0; c < K; c++) {
            a[r * K + c] = mha__ld(w, r0 + r, c0 + c);
            nan |= isnan(a[r * K + c]);
        }
    const int64_t mn = M < K ? M : K;
    // a row-major (M, K) is the column-major (K, M) W^T: the same singular
    // values, and no transposition inside LAPACKE (NaN: refused, as
    // LAPACKE_dgesdd's check refuses it)
    lapack_int info = nan ? -5
                          : LAPACKE_dgesdd_work(LAPACK_COL_MAJOR, 'N', (lapack_int)K,
                                                (lapack_int)M, a, (lapack_int)K, sv, NULL, 1,
                                                NULL, 1, ws->work, ws->lwork, ws->iwork);
    if (info != 0)
        for (int64_t i = 0; i < mn; i++) sv[i] = NAN;
    const double eps = dt == MHA_BF16 ? 0x1p-7 : dt == MHA_F16 ? 0x1p-10 : (double)FLT_EPSILON;
    const double tol = (rtol > 0 ? rtol : (double)(M > K ? M : K) * eps) * sv[0];
    int64_t rank = 0;
    for (int64_t i = 0; i < mn; i++) rank += sv[i] > tol;
    return rank;
}
#endif  // MHA_HAVE_LAPACKE

// ---- the attention statistics ----

// What the row loop accumulates for one head.
typedef struct head_acc {
    double ent_sum, ent_min, ent_norm_sum, dist_sum;
    int64_t rows, rows_norm;  // rows with visible keys; of them, with > 1
    double lmax, lsum, lsq;
    int64_t lcount;
    double *c_sum, *c_sq;  // (d) context sums over rows
} head_acc;

// What the phases of mha_diag_create share: the call (its plan, sizes and
// arguments) and the buffers allocated once for it.
typedef struct diag_run {
    const fwd_plan *p;
    const mha_module *m;
    const mha_forward_args *a;  // the call's arguments, as planned
    const mha_diag_options *o;
    int64_t N, L, Sp, E, Eq, H, d, Ekv, G;
    int64_t R;  // query rows per batch element
    double scale;
#ifdef MHA_HAVE_LAPACKE
    int64_t kd, vd, fmax;
    size_t lwork;
#endif
    int64_t nspec;
    size_t nbuf, nwork;
    double *q, *k, *v;  // q (N, L, Eq), k and v (N, Sp, Ekv): one block
    double *work;       // P (H, Sp), a context row (d), the SVD's scratch
    head_acc *acc;      // (H)
    double *cbuf;       // (2 H d): every head's c_sum and c_sq
    double *vvar;       // (Hkv)
    bool *has;          // (H): the head's row has visible keys
    int64_t *simcount;  // (H, H)
} diag_run;

// The sizes of the call and every buffer (and the diagnostics *out, with
// its heads, similarity and spectra), allocated together.
static mha_status diag_alloc(diag_run *r, mha_diag **out) {
    const fwd_plan *p = r->p;
    const int64_t N = p->N, L = p->L, Sp = p->Sp, E = p->E, H = p->H, d = p->d, Ekv = p->Ekv,
                  G = H / p->Hkv, Eq = p->Eq;
    r->N = N, r->L = L, r->Sp = Sp, r->E = E, r->Eq = Eq, r->H = H, r->d = d, r->Ekv = Ekv,
    r->G = G;
    r->scale = p->scale;  // 1 / sqrt(d), or the custom one
    r->R = r->o->max_rows > 0 && r->o->max_rows < L ? r->o->max_rows : L;
    const int64_t R = r->R;
    // q (N, L, Eq), k and v (N, Sp, Ekv); work: one row of every head P (H,
    // Sp), a context row (d), then (nsvd) the SVD's copy of a slice (d *
    // fmax), its work (lwork) and iwork (8 d lapack_ints, as doubles)
    const size_t nbuf = (size_t)(N * L * Eq + 2 * N * Sp * Ekv);
#ifdef MHA_HAVE_LAPACKE
    const mha_module *m = r->m;
    const int64_t kd = m->cfg.kdim, vd = m->cfg.vdim;
    const int64_t fmax = mha__module_max_in(m);
    const int64_t nspec = d < fmax ? d : fmax;
    size_t lwork = svd_lwork(d, E), lw;
    if ((lw = svd_lwork(d, kd)) > lwork) lwork = lw;
    if ((lw = svd_lwork(d, vd)) > lwork) lwork = lw;
    if ((lw = svd_lwork(E, d)) > lwork) lwork = lw;
    const size_t niw = (size_t)(8 * d) * sizeof(lapack_int) / sizeof(double) + 1;
    const size_t nsvd = (size_t)(d * fmax) + lwork + niw;
    r->kd = kd, r->vd = vd, r->fmax = fmax, r->lwork = lwork;
#else
    const int64_t nspec = 0;  // no spectra (mha.h)
    const size_t nsvd = 0;
#endif
    const size_t nwork = (size_t)(H * Sp + d) + nsvd;
    r->nspec = nspec, r->nbuf = nbuf, r->nwork = nwork;
    mha_diag *dg = mha__calloc(1, sizeof *dg);
    r->q = mha__malloc(sizeof(double) * nbuf);
    r->work = mha__malloc(sizeof(double) * nwork);
    r->acc = mha__calloc((size_t)H, sizeof *r->acc);
    r->cbuf = mha__calloc((size_t)(2 * H * d), sizeof(double));
    r->vvar = mha__malloc(sizeof(double) * (size_t)p->Hkv);
    r->has = mha__calloc((size_t)H, sizeof(bool));
    r->simcount = mha__calloc((size_t)(H * H), sizeof(int64_t));
    if (dg) {
        dg->H = H;
        dg->nspec = nspec;
        dg->nrows_total = N * R;
        dg->heads = mha__calloc((size_t)H, sizeof *dg->heads);
        dg->sim = mha__calloc((size_t)(H * H), sizeof(double));
        dg->spec = nspec ? mha__calloc((size_t)(H * 4 * nspec), sizeof(double)) : NULL;
    }
    if (!dg || !dg->heads || !dg->sim || (nspec && !dg->spec) || !r->q || !r->work ||
        !r->acc || !r->cbuf || !r->vvar || !r->has || !r->simcount) {
        mha_diag_destroy(dg);
        return mha__fail(MHA_ERR_NOMEM, "mha_diag_create: out of memory for %zu + %zu doubles",
                         nbuf, nwork);
    }
    r->k = r->q + N * L * Eq, r->v = r->k + N * Sp * Ekv;
    *out = dg;
    return MHA_OK;
}

// 1. Non-finite values: parameters, inputs, then the projections (computed
//    here into q, k, v).
static void diag_project(diag_run *r, mha_diag *dg) {
    const int64_t N = r->N, L = r->L, Sp = r->Sp, Eq = r->Eq, Ekv = r->Ekv;
    double *q = r->q, *k = r->k, *v = r->v;
    char *nf = dg->nonfinite;
    const size_t nfc = sizeof dg->nonfinite;
    if (!find_nonfinite_params(nf, nfc, r->m) &&
        !find_nonfinite_view(nf, nfc, "query", r->a->query) &&
        !find_nonfinite_view(nf, nfc, "key", r->a->key) &&
        !find_nonfinite_view(nf, nfc, "value", r->a->value))
        nf[0] = '\0';
    mha__project_qkv(r->p, r->m, r->a, q, k, v);
    if (!nf[0] && !find_nonfinite_buf(nf, nfc, "q", q, N, L, Eq) &&
        !find_nonfinite_buf(nf, nfc, "k", k, N, Sp, Ekv))
        find_nonfinite_buf(nf, nfc, "v", v, N, Sp, Ekv);
}

// Query row i of batch element b, head h: its logits and weights into ph
// (Sp), then its entropy, distance and context into the head's sums; the
// first non-finite logit into nf (when nothing was found before).
static void diag_head_row(diag_run *r, char *nf, size_t nfc, int64_t b, int64_t i, int64_t h) {
    const int64_t L = r->L, Sp = r->Sp, Eq = r->Eq, d = r->d, Ekv = r->Ekv, G = r->G;
    const double scale = r->scale;
    const double *q = r->q, *k = r->k, *v = r->v;
    double *P = r->work, *ctx = r->work + r->H * Sp;
    bool *has = r->has;
    const fwd_plan *p = r->p;
    const int64_t g = h / G;
    const double *qi = q + (b * L + i) * Eq + h * d;
    double *ph = P + h * Sp;
    head_acc *A = &r->acc[h];
    int64_t visible = 0;
    for (int64_t j = 0; j < Sp; j++) {
        const double *kj = k + (b * Sp + j) * Ekv + g * d;
        double s = 0;
        for (int64_t c = 0; c < d; c++) s += qi[c] * kj[c];
        s *= scale;
        if (isfinite(s)) {
            if (s > A->lmax) A->lmax = s;
            A->lsum += s, A->lsq += s * s, A->lcount++;
        } else if (!nf[0]) {
            snprintf(nf, nfc,
                     "scaled logit (batch %lld, head %lld, row %lld, key "
                     "%lld) = %g",
                     (long long)b, (long long)h, (long long)i, (long long)j, s);
        }
        ph[j] = mha__ref_logit(&p->mask, s, b, h, i, j);
        visible += ph[j] > -INFINITY;
    }
    mha__ref_softmax_row(ph, Sp, p->mask.sinks ? (double)p->mask.sinks[h] : -INFINITY);
    has[h] = visible > 0;  // else the row is all 0 (fully masked)
    if (!has[h]) return;
    double ent = 0, dist = 0;
    for (int64_t c = 0; c < d; c++) ctx[c] = 0;
    for (int64_t j = 0; j < Sp; j++) {
        const double pj = ph[j];
        if (pj > 0) ent -= pj * log(pj);
        dist += pj * fabs((double)(i - j));
        const double *vj = v + (b * Sp + j) * Ekv + g * d;
        for (int64_t c = 0; c < d; c++) ctx[c] += pj * vj[c];
    }
    A->ent_sum += ent;
    if (ent < A->ent_min) A->ent_min = ent;
    A->dist_sum += dist;
    A->rows++;
    if (visible > 1) A->ent_norm_sum += ent / log((double)visible), A->rows_norm++;
    for (int64_t c = 0; c < d; c++) {
        A->c_sum[c] += ctx[c];
        A->c_sq[c] += ctx[c] * ctx[c];
    }
}

// 2. Row by row: logits and weights (mha__ref_logit and
//    mha__ref_softmax_row: the reference's own steps), entropy,
//    distance, context; pairwise JS similarity.
static void diag_rows(diag_run *r, mha_diag *dg) {
    const int64_t N = r->N, L = r->L, Sp = r->Sp, H = r->H, d = r->d, R = r->R;
    head_acc *acc = r->acc;
    const bool *has = r->has;
    int64_t *simcount = r->simcount;
    char *nf = dg->nonfinite;
    const size_t nfc = sizeof dg->nonfinite;
    for (int64_t h = 0; h < H; h++) {
        acc[h].ent_min = INFINITY;
        acc[h].lmax = -INFINITY;
        acc[h].c_sum = r->cbuf + 2 * h * d;
        acc[h].c_sq = acc[h].c_sum + d;
    }
    double *P = r->work, *simacc = dg->sim;
    for (int64_t b = 0; b < N; b++)
        for (int64_t rr = 0; rr < R; rr++) {
            const int64_t i = R == L ? rr : rr * L / R;  // evenly spread rows
            for (int64_t h = 0; h < H; h++) diag_head_row(r, nf, nfc, b, i, h);
            // Jensen-Shannon between every pair of heads' rows
            for (int64_t h1 = 0; h1 < H; h1++)
                for (int64_t h2 = h1 + 1; h2 < H; h2++) {
                    if (!has[h1] || !has[h2]) continue;
                    const double *x = P + h1 * Sp, *y = P + h2 * Sp;
                    double js = 0;
                    for (int64_t j = 0; j < Sp; j++) {
                        const double mj = 0.5 * (x[j] + y[j]);
                        if (x[j] > 0) js += 0.5 * x[j] * log(x[j] / mj);
                        if (y[j] > 0) js += 0.5 * y[j] * log(y[j] / mj);
                    }
                    simacc[h1 * H + h2] += 1.0 - js / log(2.0);
                    simcount[h1 * H + h2]++;
                }
        }
    for (int64_t h1 = 0; h1 < H; h1++) {
        dg->sim[h1 * H + h1] = 1.0;
        for (int64_t h2 = h1 + 1; h2 < H; h2++) {
            const int64_t c = simcount[h1 * H + h2];
            const double s = c ? simacc[h1 * H + h2] / (double)c : NAN;
            dg->sim[h1 * H + h2] = dg->sim[h2 * H + h1] = s > 1.0 ? 1.0 : s;
        }
    }
}

// Variance of the values (over keys and features of each KV head),
// the scale the heads' output variance is compared with.
static void diag_value_var(diag_run *r) {
    const int64_t N = r->N, Sp = r->Sp, d = r->d, Ekv = r->Ekv;
    const double *v = r->v;
    double *vvar = r->vvar;
    for (int64_t g = 0; g < r->p->Hkv; g++) {
        double tv = 0;
        for (int64_t c = 0; c < d; c++) {
            double s = 0, s2 = 0;
            for (int64_t b = 0; b < N; b++)
                for (int64_t j = 0; j < Sp; j++) {
                    const double x = v[(b * Sp + j) * Ekv + g * d + c];
                    s += x, s2 += x * x;
                }
            const double n = (double)(N * Sp);
            tv += s2 / n - (s / n) * (s / n);
        }
        vvar[g] = tv / (double)d;
    }
}

// 3. Per head: the statistics, spectra, the dead flag, pruning and the
//    gates over every query row (in q's buffer, free now: H <= Eq).
static void diag_heads(diag_run *r, mha_diag *dg) {
    const mha_module *m = r->m;
    const mha_diag_options o = *r->o;
    const int64_t N = r->N, L = r->L, H = r->H, d = r->d, G = r->G;
    double *q = r->q;
    const head_acc *acc = r->acc;
    const double *vvar = r->vvar;
#ifdef MHA_HAVE_LAPACKE
    const int64_t E = r->E, kd = r->kd, vd = r->vd, fmax = r->fmax, nspec = r->nspec;
    const size_t lwork = r->lwork;
    double *ctx = r->work + H * r->Sp;
    const svd_ws ws = {ctx + d, ctx + d + d * fmax, (lapack_int)lwork,
                       (lapack_int *)(ctx + d + d * fmax + lwork)};
#endif
    const bool gated = mha__module_gated(m);
    if (gated) mha__gates_d(r->p, m, r->a, q);
    for (int64_t h = 0; h < H; h++) {
        mha_head_diag *hd = &dg->heads[h];
        const head_acc *A = &acc[h];
        const int64_t g = h / G;
        hd->head = h;
        hd->pruned = !mha__head_live(m, h);
        double gs = 0;
        for (int64_t rr = 0; gated && rr < N * L; rr++) gs += q[rr * H + h];
        hd->gate_mean = !gated ? 1.0 : N * L > 0 ? gs / (double)(N * L) : NAN;
        hd->rows = A->rows;
        hd->entropy_mean = A->rows ? A->ent_sum / (double)A->rows : NAN;
        hd->entropy_min = A->rows ? A->ent_min : NAN;
        hd->entropy_norm = A->rows_norm ? A->ent_norm_sum / (double)A->rows_norm : NAN;
        hd->mean_distance = A->rows ? A->dist_sum / (double)A->rows : NAN;
        hd->logit_max = A->lcount ? A->lmax : NAN;
        if (A->lcount) {
            const double mu = A->lsum / (double)A->lcount;
            const double var = A->lsq / (double)A->lcount - mu * mu;
            hd->logit_std = sqrt(var > 0 ? var : 0);
        } else {
            hd->logit_std = NAN;
        }
        double ov = 0;
        for (int64_t c = 0; c < d && A->rows; c++) {
            const double mu = A->c_sum[c] / (double)A->rows;
            ov += A->c_sq[c] / (double)A->rows - mu * mu;
        }
        ov /= (double)d;
        hd->output_var_ratio = vvar[g] > 0 ? (ov > 0 ? ov : 0) / vvar[g] : NAN;
        hd->dead = (hd->entropy_norm >= o.dead_entropy) ||
                   (A->rows > 1 && hd->output_var_ratio <= o.dead_output);
#ifdef MHA_HAVE_LAPACKE
        double *sp = dg->spec + h * 4 * nspec;
        hd->rank_q = spectrum(sp, m->w_q, m->wdt, E, h * d, 0, d, E, o.rank_rtol, &ws);
        hd->rank_k = spectrum(sp + nspec, m->w_k, m->wdt, kd, g * d, 0, d, kd, o.rank_rtol, &ws);
        hd->rank_v = spectrum(sp + 2 * nspec, m->w_v, m->wdt, vd, g * d, 0, d, vd, o.rank_rtol,
                              &ws);
        // W_O (E, Eq): the head's columns [h d, (h + 1) d)
        hd->rank_o = spectrum(sp + 3 * nspec, m->w_out, m->wdt, r->Eq, 0, h * d, E, d,
                              o.rank_rtol, &ws);
#else
        hd->rank_q = hd->rank_k = hd->rank_v = hd->rank_o = -1;  // no SVD (mha.h)
#endif
    }
}

mha_status mha_diag_create(mha_diag **out, const mha_module *m, const mha_forward_args *args,
                           const mha_diag_options *opt) {
    if (!out || !m || !args)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_diag_create: NULL argument");
    *out = NULL;
    mha_diag_options o;
    mha_diag_options_init(&o);
    if (opt) o = *opt;
    if (o.max_rows < 0 || !(o.dead_entropy >= 0 && o.dead_entropy <= 1) ||
        !(o.dead_output >= 0) || !(o.rank_rtol >= 0))
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_diag_create: options out of range (max_rows %lld >= 0, "
                         "dead_entropy %g in [0, 1], dead_output %g >= 0, rank_rtol %g >= 0)",
                         (long long)o.max_rows, o.dead_entropy, o.dead_output, o.rank_rtol);
    mha_forward_args a = *args;
    a.need_weights = false;
    a.trace = NULL;
    a.save = NULL;
    a.training = false;
    a.impl = MHA_IMPL_REFERENCE;
    fwd_plan *p = mha__malloc(sizeof *p);
    if (!p)
        return mha__fail(MHA_ERR_NOMEM, "mha_diag_create: out of memory (%zu bytes)", sizeof *p);
    mha_status st = mha__plan_forward(p, m, &a);
    if (st) {
        free(p);
        return st;
    }
    diag_run r = {.p = p, .m = m, .a = &a, .o = &o};
    mha_diag *dg = NULL;
    st = diag_alloc(&r, &dg);
    if (!st) {
        diag_project(&r, dg);
        diag_rows(&r, dg);
        diag_value_var(&r);
        diag_heads(&r, dg);
    }
    free(r.q), free(r.work), free(r.acc), free(r.cbuf), free(r.vvar), free(r.has),
        free(r.simcount), free(p);
    *out = dg;
    return st;
}
