// backward.c: mha_backward, the gradient of the module's forward: checks
// the gradient views and module once, then runs the reference backward
// (ref_module.c, which quotes the forward line each step differentiates) or
// the fused one (fused_bwd.c).
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fused.h"
#include "plan.h"
#include "ref.h"

mha_status mha_backward(mha_tensor *gq, mha_tensor *gk, mha_tensor *gv, mha_module *grads,
                        const mha_module *m, const mha_forward_args *args,
                        const mha_tensor *gout, bool accumulate) {
    if (!m || !args)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_backward: NULL module or args");
    mha_status st;
    mha_forward_args a = *args;
    a.need_weights = false;  // only attn_output is differentiated
    a.trace = NULL;
    fwd_plan p;
    if ((st = mha__plan_forward(&p, m, &a))) return st;
    if ((st = mha__check_backward(&p, gq, gk, gv, grads, m, &a, gout))) return st;
    if (p.fused)
        st = mha__fused_backward(&p, gq, gk, gv, grads, m, &a, gout, accumulate, NULL);
    else st = mha__ref_backward(&p, gq, gk, gv, grads, m, &a, gout, accumulate);
    if (!st) mha__set_impl(p.fused, mha_isa(), p.fused && mha__fused_backward_bf16(m, &a));
    return st;
}
