// optim.c: the optimizers of mha.h, with PyTorch 1.13's semantics:
// torch.optim.SGD, torch.optim.AdamW (amsgrad=False, maximize=False) and
// torch.nn.utils.clip_grad_norm_ (norm_type 2).
//
// The caller owns parameters and gradients (float32, contiguous); the
// optimizer owns, per registered tensor, its state:
//   SGD with momentum != 0: momentum_buffer (n)
//   AdamW:                  exp_avg (n), exp_avg_sq (n)  (one allocation)
// State is float32, as torch keeps it for float32 parameters.
//
// Float32 arithmetic, element by element, in the order torch's CPU kernels
// use, so the results match torch's (its AVX2/AVX-512 kernels) to the last
// bit in most elements: every `x.add_(y, alpha=a)` and the last step of
// `x.addcmul_(y, z, value=a)` are fused multiply-adds (fmaf), scalars are
// rounded to float before use (torch's opmath for float32 is float), and
// Python-side scalars (bias corrections, step size) are computed in double
// as Python does. Results do not depend on the number of threads.
//
// Not done: amsgrad, maximize, sparse gradients, parameter groups (one lr
// for every registered tensor), checks for non-finite gradients.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "module.h"

// Elementwise loops of at least this many elements run on OpenMP threads.
#define MHA__OPTIM_PAR_MIN 65536

typedef struct optim_entry {
    float *param;  // (n), caller memory
    float *grad;   // (n), caller memory
    int64_t n;
    float *state;   // SGD: momentum_buffer (n), NULL when momentum == 0;
                    // AdamW: exp_avg (n) then exp_avg_sq (n)
    int64_t steps;  // updates done on this tensor (torch's state["step"]);
                    // SGD: 0 means the momentum buffer is not yet set
    // mha_optim_add_module: the modules param and grad belong to (their
    // packed weights go stale when the optimizer writes them), else NULL
    const mha_module *pmod, *gmod;
} optim_entry;

struct mha_optim {
    mha_optim_config cfg;
    optim_entry *entries;
    int64_t count, cap;
};

void mha_optim_config_init(mha_optim_config *c, mha_optim_kind kind) {
    if (!c) return;
    memset(c, 0, sizeof *c);
    c->kind = kind;
    c->beta1 = 0.9;
    c->beta2 = 0.999;
    c->eps = 1e-8;
    if (kind == MHA_OPTIM_ADAMW) {
        c->lr = 1e-3;
        c->weight_decay = 1e-2;
    } else {
        c->lr = 0.01;
        c->weight_decay = 0.0;
    }
}

static const char *kind_name(mha_optim_kind k) {
    return k == MHA_OPTIM_SGD ? "SGD" : k == MHA_OPTIM_ADAMW ? "AdamW" : "?";
}

static mha_status check_lr(const char *who, double lr) {
    if (!(isfinite(lr) && lr >= 0.0))
        return mha__fail(MHA_ERR_INVALID_ARG, "%s: lr must be finite and >= 0, got %.17g", who,
                         lr);
    return MHA_OK;
}

// The fields that matter for c->kind, with torch's rules plus finiteness:
// SGD: lr >= 0, weight_decay >= 0, momentum >= 0, dampening any finite
// value (torch does not restrict it), nesterov needs momentum > 0 and
// dampening == 0. AdamW: lr >= 0, weight_decay >= 0, beta1 and beta2 in
// [0, 1), eps >= 0. The other kind's fields are ignored.
static mha_status check_config(const mha_optim_config *c) {
    const char *who = "mha_optim_create";
    if (c->kind != MHA_OPTIM_SGD && c->kind != MHA_OPTIM_ADAMW)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "%s: unknown optimizer kind %d (MHA_OPTIM_SGD = 0, "
                         "MHA_OPTIM_ADAMW = 1)",
                         who, (int)c->kind);
    const char *k = kind_name(c->kind);
    if (!(isfinite(c->lr) && c->lr >= 0.0))
        return mha__fail(MHA_ERR_INVALID_ARG, "%s: %s lr must be finite and >= 0, got %.17g",
                         who, k, c->lr);
    if (!(isfinite(c->weight_decay) && c->weight_decay >= 0.0))
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "%s: %s weight_decay must be finite and >= 0, got "
                         "%.17g",
                         who, k, c->weight_decay);
    if (c->kind == MHA_OPTIM_SGD) {
        if (!(isfinite(c->momentum) && c->momentum >= 0.0))
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "%s: SGD momentum must be finite and >= 0, got "
                             "%.17g",
                             who, c->momentum);
        if (!isfinite(c->dampening))
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "%s: SGD dampening must be finite, got %.17g", who, c->dampening);
        if (c->nesterov && !(c->momentum > 0.0 && c->dampening == 0.0))
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "%s: SGD nesterov needs momentum > 0 and "
                             "dampening == 0, got momentum %.17g, dampening "
                             "%.17g",
                             who, c->momentum, c->dampening);
    } else {
        if (!(c->beta1 >= 0.0 && c->beta1 < 1.0))
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "%s: AdamW beta1 must be in [0, 1), got %.17g", who, c->beta1);
        if (!(c->beta2 >= 0.0 && c->beta2 < 1.0))
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "%s: AdamW beta2 must be in [0, 1), got %.17g", who, c->beta2);
        if (!(isfinite(c->eps) && c->eps >= 0.0))
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "%s: AdamW eps must be finite and >= 0, got "
                             "%.17g",
                             who, c->eps);
    }
    return MHA_OK;
}

mha_status mha_optim_create(mha_optim **out, const mha_optim_config *c) {
    if (!out || !c)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_optim_create: NULL argument (out %s, "
                         "config %s)",
                         out ? "set" : "NULL", c ? "set" : "NULL");
    *out = NULL;
    mha_status st = check_config(c);
    if (st != MHA_OK) return st;
    mha_optim *o = mha__calloc(1, sizeof *o);
    if (!o)
        return mha__fail(MHA_ERR_NOMEM, "mha_optim_create: out of memory (%zu bytes)",
                         sizeof *o);
    o->cfg = *c;
    *out = o;
    return MHA_OK;
}

static void entry_free(optim_entry *e) {
    mha__free(e->state);
    e->state = NULL;
}

void mha_optim_destroy(mha_optim *o) {
    if (!o) return;
    for (int64_t i = 0; i < o->count; i++) entry_free(&o->entries[i]);
    free(o->entries);
    free(o);
}

// Whether [a, a + na) and [b, b + nb) (floats) share memory.
static int ranges_overlap(const float *a, int64_t na, const float *b, int64_t nb) {
    if (na <= 0 || nb <= 0) return 0;
    uintptr_t a0 = (uintptr_t)a, b0 = (uintptr_t)b;
    uintptr_t a1 = a0 + (uintptr_t)na * sizeof(float);
    uintptr_t b1 = b0 + (uintptr_t)nb * sizeof(float);
    return a0 < b1 && b0 < a1;
}

// Checks and registers one tensor; `what` names it in messages ("" or the
// parameter's name).
static mha_status add_entry(mha_optim *o, float *param, float *grad, int64_t n,
                            const char *what, const mha_module *pmod, const mha_module *gmod) {
    char nm[96];
    const char *label = what[0] ? mha_escape(nm, sizeof nm, what) : "tensor";
    if (!param || !grad)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_optim_add: %s: NULL %s", label,
                         !param ? "param" : "grad");
    if (n < 0)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_optim_add: %s: n must be >= 0, got %lld",
                         label, (long long)n);
    size_t per = o->cfg.kind == MHA_OPTIM_ADAMW ? 2 : o->cfg.momentum != 0.0 ? 1 : 0;
    size_t bytes = 0;
    if (mha__mul_overflow_size((size_t)n, per * sizeof(float), &bytes) ||
        (uint64_t)n > (uint64_t)(SIZE_MAX / sizeof(float)))
        return mha__fail(MHA_ERR_OVERFLOW,
                         "mha_optim_add: %s: %lld elements overflow the "
                         "address space",
                         label, (long long)n);
    if (ranges_overlap(param, n, grad, n))
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_optim_add: %s: param and grad overlap "
                         "(%lld elements at %p and %p)",
                         label, (long long)n, (void *)param, (void *)grad);
    for (int64_t i = 0; i < o->count; i++) {
        const optim_entry *e = &o->entries[i];
        if (ranges_overlap(param, n, e->param, e->n) ||
            ranges_overlap(param, n, e->grad, e->n) ||
            ranges_overlap(grad, n, e->param, e->n) || ranges_overlap(grad, n, e->grad, e->n))
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "mha_optim_add: %s overlaps the memory of "
                             "registered tensor %lld (a tensor may be "
                             "registered once)",
                             label, (long long)i);
    }
    if (o->count == o->cap) {
        int64_t cap = o->cap ? 2 * o->cap : 8;
        optim_entry *grown = mha__realloc(o->entries, (size_t)cap * sizeof *grown);
        if (!grown)
            return mha__fail(MHA_ERR_NOMEM,
                             "mha_optim_add: out of memory growing the "
                             "tensor list to %lld",
                             (long long)cap);
        o->entries = grown;
        o->cap = cap;
    }
    float *state = NULL;
    if (bytes > 0) {
        state = mha__alloc(bytes);
        if (!state)
            return mha__fail(MHA_ERR_NOMEM,
                             "mha_optim_add: %s: out of memory for the "
                             "optimizer state (%zu bytes)",
                             label, bytes);
        memset(state, 0, bytes);  // torch: zeros_like
    }
    o->entries[o->count++] = (optim_entry){param, grad, n, state, 0, pmod, gmod};
    return MHA_OK;
}

mha_status mha_optim_add(mha_optim *o, float *param, float *grad, int64_t n) {
    if (!o) return mha__fail(MHA_ERR_INVALID_ARG, "mha_optim_add: NULL optimizer");
    return add_entry(o, param, grad, n, "", NULL, NULL);
}

// Pairs m's parameters with grads' by name; all or nothing (on failure the
// tensors added by this call are removed again).
mha_status mha_optim_add_module(mha_optim *o, mha_module *m, mha_module *grads) {
    if (!o || !m || !grads)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_optim_add_module: NULL argument "
                         "(optimizer %s, module %s, grads %s)",
                         o ? "set" : "NULL", m ? "set" : "NULL", grads ? "set" : "NULL");
    if (m == grads)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_optim_add_module: the module is its own "
                                              "gradient module");
    mha_status st0 = mha__require_f32_weights(m, "mha_optim_add_module");
    if (!st0) st0 = mha__require_f32_weights(grads, "mha_optim_add_module (grads)");
    if (st0) return st0;
    int np = mha_module_num_params(m), ng = mha_module_num_params(grads);
    if (np != ng)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_optim_add_module: the module has %d "
                         "parameters, grads has %d (create grads with the "
                         "module's config)",
                         np, ng);
    mha_param pm[MHA__MAX_PARAMS], pg[MHA__MAX_PARAMS];
    if (np > MHA__MAX_PARAMS)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_optim_add_module: %d parameters (at most "
                         "%d)",
                         np, MHA__MAX_PARAMS);
    // Check every pair first.
    for (int i = 0; i < np; i++) {
        mha_status st = mha_module_param_at(&pm[i], m, i);
        if (st != MHA_OK) return st;
        int found = 0;
        for (int j = 0; j < ng && !found; j++) {
            st = mha_module_param_at(&pg[i], grads, j);
            if (st != MHA_OK) return st;
            found = strcmp(pg[i].name, pm[i].name) == 0;
        }
        char nm[96];
        if (!found)
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "mha_optim_add_module: grads has no "
                             "parameter %s (create grads with the module's "
                             "config)",
                             mha_escape(nm, sizeof nm, pm[i].name));
        if (pg[i].numel != pm[i].numel)
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "mha_optim_add_module: %s has %lld elements "
                             "in the module, %lld in grads",
                             mha_escape(nm, sizeof nm, pm[i].name), (long long)pm[i].numel,
                             (long long)pg[i].numel);
    }
    int64_t before = o->count;
    for (int i = 0; i < np; i++) {
        mha_status st = add_entry(o, pm[i].data, pg[i].data, pm[i].numel, pm[i].name, m, grads);
        if (st != MHA_OK) {
            while (o->count > before) entry_free(&o->entries[--o->count]);
            return st;
        }
    }
    return MHA_OK;
}

mha_status mha_optim_set_lr(mha_optim *o, double lr) {
    if (!o) return mha__fail(MHA_ERR_INVALID_ARG, "mha_optim_set_lr: NULL optimizer");
    mha_status st = check_lr("mha_optim_set_lr", lr);
    if (st != MHA_OK) return st;
    o->cfg.lr = lr;
    return MHA_OK;
}

// torch.optim.SGD, _single_tensor_sgd, one tensor (float32 throughout):
//   d = g
//   if wd != 0:        d = d + wd * p                   (d_p.add(p, alpha=wd))
//   if momentum != 0:
//     first step:      buf = d                          (clone)
//     later:           buf = buf * momentum             (mul_)
//                      buf = buf + (1 - dampening) * d  (add_, alpha)
//     nesterov:        d = d + momentum * buf
//     else:            d = buf
//   p = p + (-lr) * d                                   (add_, alpha=-lr)
static void sgd_step(const mha_optim_config *c, optim_entry *e) {
    const float wd = (float)c->weight_decay, mom = (float)c->momentum;
    const float damp1 = (float)(1.0 - c->dampening), neg_lr = (float)(-c->lr);
    const int has_wd = c->weight_decay != 0.0;
    const int has_mom = c->momentum != 0.0, first = e->steps == 0;
    const int nesterov = c->nesterov;
    float *p = e->param, *buf = e->state;
    const float *g = e->grad;
    const int64_t n = e->n;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (n >= MHA__OPTIM_PAR_MIN)
#endif
    for (int64_t i = 0; i < n; i++) {
        float d = g[i];
        if (has_wd) d = fmaf(wd, p[i], d);
        if (has_mom) {
            float b = first ? d : fmaf(damp1, d, buf[i] * mom);
            buf[i] = b;
            d = nesterov ? fmaf(mom, b, d) : b;
        }
        p[i] = fmaf(neg_lr, d, p[i]);
    }
    e->steps++;
}

// torch.optim.AdamW, _single_tensor_adamw, one tensor; step t counts from 1:
//   p = p * (1 - lr * wd)                              (mul_)
//   m = m * b1;  m = m + (1 - b1) * g                  (mul_, add_ alpha)
//   v = v * b2;  v = v + ((1 - b2) * g) * g            (mul_, addcmul_)
//   bc1 = 1 - b1^t, bc2 = 1 - b2^t                     (double, Python)
//   denom = sqrt(v) / sqrt(bc2) + eps                  (sqrt, div, add_)
//   p = p + ((-lr / bc1) * m) / denom                  (addcdiv_)
static void adamw_step(const mha_optim_config *c, optim_entry *e) {
    e->steps++;
    const double t = (double)e->steps;
    const double bc1 = 1.0 - pow(c->beta1, t), bc2 = 1.0 - pow(c->beta2, t);
    const float decay = (float)(1.0 - c->lr * c->weight_decay);
    const float b1 = (float)c->beta1, b2 = (float)c->beta2;
    const float one_b1 = (float)(1.0 - c->beta1);
    const float one_b2 = (float)(1.0 - c->beta2);
    const float bc2_sqrt = (float)sqrt(bc2), eps = (float)c->eps;
    const float neg_step = (float)(-(c->lr / bc1));
    const int64_t n = e->n;
    if (n == 0) return;
    float *p = e->param, *m = e->state, *v = e->state + n;
    const float *g = e->grad;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (n >= MHA__OPTIM_PAR_MIN)
#endif
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i];
        float pi = p[i] * decay;
        float mi = fmaf(one_b1, gi, m[i] * b1);
        float vi = fmaf(one_b2 * gi, gi, v[i] * b2);
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        p[i] = pi + (neg_step * mi) / denom;
        m[i] = mi;
        v[i] = vi;
    }
}

mha_status mha_optim_step(mha_optim *o) {
    if (!o) return mha__fail(MHA_ERR_INVALID_ARG, "mha_optim_step: NULL optimizer");
    for (int64_t i = 0; i < o->count; i++) {
        if (o->cfg.kind == MHA_OPTIM_ADAMW) adamw_step(&o->cfg, &o->entries[i]);
        else sgd_step(&o->cfg, &o->entries[i]);
        mha__packs_stale(o->entries[i].pmod);  // (NULL: a tensor of mha_optim_add)
    }
    return MHA_OK;
}

void mha_optim_zero_grad(mha_optim *o) {
    if (!o) return;
    for (int64_t i = 0; i < o->count; i++) {
        if (o->entries[i].n > 0)
            memset(o->entries[i].grad, 0, (size_t)o->entries[i].n * sizeof(float));
        mha__packs_stale(o->entries[i].gmod);
    }
}

// torch.nn.utils.clip_grad_norm_(params, max_norm), norm_type 2:
//   total = sqrt(sum over every registered gradient element of g^2)
//   coef = max_norm / (total + 1e-6); if coef < 1: g = g * coef
// The sum is in double, in registration order, on one thread (torch sums
// in float32 per tensor; the two differ by float32 rounding only).
// Non-finite total (a NaN or infinite gradient): the gradients are left
// as they are and the call succeeds, *total_norm telling the caller (torch
// would multiply every gradient by 0 or NaN). max_norm must be >= 0; +inf
// is allowed (never clips).
mha_status mha_optim_clip_grad_norm(mha_optim *o, double max_norm, double *total_norm) {
    if (!o) return mha__fail(MHA_ERR_INVALID_ARG, "mha_optim_clip_grad_norm: NULL optimizer");
    if (!(max_norm >= 0.0))
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_optim_clip_grad_norm: max_norm must be >= "
                         "0, got %.17g",
                         max_norm);
    double sum = 0.0;
    for (int64_t i = 0; i < o->count; i++) {
        const float *g = o->entries[i].grad;
        for (int64_t j = 0; j < o->entries[i].n; j++) sum += (double)g[j] * (double)g[j];
    }
    double total = sqrt(sum);
    if (total_norm) *total_norm = total;
    if (!isfinite(total)) return MHA_OK;
    double coef = max_norm / (total + 1e-6);
    if (coef < 1.0) {
        const float cf = (float)coef;
        for (int64_t i = 0; i < o->count; i++) {
            float *g = o->entries[i].grad;
            const int64_t n = o->entries[i].n;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (n >= MHA__OPTIM_PAR_MIN)
#endif
            for (int64_t j = 0; j < n; j++) g[j] *= cf;
            mha__packs_stale(o->entries[i].gmod);
        }
    }
    return MHA_OK;
}
