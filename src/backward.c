// backward.c: mha_backward, the gradient of the module's forward: checks
// the gradient views and module once, then runs the reference backward
// (ref_module.c, which quotes the forward line each step differentiates) or
// the fused one (fused_bwd.c).
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "plan.h"
#include "ref.h"

static mha_status check_grad_view(const mha_tensor *g, const char *name,
                                  const mha_tensor *like) {
    if (!g) return MHA_OK;
    mha_shape want = {like->ndim, {0}};
    for (int i = 0; i < like->ndim; i++) want.dims[i] = like->shape[i];
    return mha__check_output(g, name, &want);
}

static mha_status check_grads_module(const mha_module *g, const mha_module *m) {
    if (!g) return MHA_OK;
    if (g == m)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "backward: the gradient module is the module itself");
    const mha_config *a = &g->cfg, *b = &m->cfg;
    if (a->embed_dim != b->embed_dim || a->num_heads != b->num_heads ||
        a->num_kv_heads != b->num_kv_heads ||
        a->kdim != b->kdim || a->vdim != b->vdim || a->bias != b->bias ||
        a->add_bias_kv != b->add_bias_kv || a->head_gate != b->head_gate)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "backward: the gradient module's configuration "
                         "(embed_dim %lld, num_heads %lld, num_kv_heads %lld, kdim %lld, "
                         "vdim %lld, bias %d, add_bias_kv %d, head_gate %s) differs from the "
                         "module's (%lld, %lld, %lld, %lld, %lld, %d, %d, %s)",
                         (long long)a->embed_dim, (long long)a->num_heads,
                         (long long)a->num_kv_heads,
                         (long long)a->kdim, (long long)a->vdim, a->bias,
                         a->add_bias_kv, mha_head_gate_name(a->head_gate),
                         (long long)b->embed_dim,
                         (long long)b->num_heads, (long long)b->num_kv_heads,
                         (long long)b->kdim,
                         (long long)b->vdim, b->bias, b->add_bias_kv,
                         mha_head_gate_name(b->head_gate));
    return MHA_OK;
}

static mha_status check_backward(const fwd_plan *p, mha_tensor *gq,
                                 mha_tensor *gk, mha_tensor *gv,
                                 const mha_module *grads, const mha_module *m,
                                 const mha_forward_args *a,
                                 const mha_tensor *gout) {
    mha_status st;
    if (!gout)
        return mha__fail(MHA_ERR_INVALID_ARG, "backward: grad_output is NULL");
    if ((st = mha__check_output(gout, "grad_output", &p->out_shape)) ||
        (st = check_grad_view(gq, "grad_query", a->query)) ||
        (st = check_grad_view(gk, "grad_key", a->key)) ||
        (st = check_grad_view(gv, "grad_value", a->value)) ||
        (st = check_grads_module(grads, m)))
        return st;
    const mha_tensor *outs[3] = {gq, gk, gv};
    const char *onames[3] = {"grad_query", "grad_key", "grad_value"};
    const mha_tensor *ins[6] = {a->query, a->key, a->value, a->key_padding_mask,
                                a->attn_mask, gout};
    const char *inames[6] = {"query", "key", "value", "key_padding_mask",
                             "attn_mask", "grad_output"};
    for (int o = 0; o < 3; o++) {
        for (int i = 0; i < 6; i++)
            if ((st = mha__check_no_overlap(outs[o], onames[o], ins[i], inames[i])))
                return st;
        for (int o2 = o + 1; o2 < 3; o2++)
            if ((st = mha__check_no_overlap(outs[o], onames[o], outs[o2], onames[o2])))
                return st;
    }
    return MHA_OK;
}

mha_status mha_backward(mha_tensor *gq, mha_tensor *gk, mha_tensor *gv,
                        mha_module *grads, const mha_module *m,
                        const mha_forward_args *args, const mha_tensor *gout,
                        bool accumulate) {
    if (!m || !args)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_backward: NULL module or args");
    mha_status st = mha__require_f32_weights(m, "mha_backward");
    if (!st && grads) st = mha__require_f32_weights(grads, "mha_backward (grads)");
    if (st) return st;
    mha_forward_args a = *args;
    a.need_weights = false;  // only attn_output is differentiated
    a.trace = NULL;
    fwd_plan p;
    if ((st = mha__plan_forward(&p, m, &a))) return st;
    if ((st = check_backward(&p, gq, gk, gv, grads, m, &a, gout))) return st;
    if (p.fused) return mha__fused_backward(&p, gq, gk, gv, grads, m, &a, gout, accumulate);

    return mha__ref_backward(&p, gq, gk, gv, grads, m, &a, gout, accumulate);
}

mha_status mha__part_backward(mha_tensor *gq, mha_tensor *gk, mha_tensor *gv, mha_module *grads,
                              const mha_module *m, const mha_forward_args *args,
                              const mha_tensor *gout, const mha__part *part) {
    if (!m || !args || !part)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha parallel backward: NULL module, args or part");
    mha_status st = mha__require_f32_weights(m, "mha parallel backward");
    if (!st && grads) st = mha__require_f32_weights(grads, "mha parallel backward (grads)");
    if (st) return st;
    fwd_plan p;
    mha_forward_args a;  // (the part's plan: the fused path, its range checked)
    if ((st = mha__part_plan(&p, &a, m, args, part))) return st;
    if ((st = check_backward(&p, gq, gk, gv, grads, m, &a, gout))) return st;
    return mha__fused_backward(&p, gq, gk, gv, grads, m, &a, gout, false);
}
