// forward.c: the public module forward entry points (mha_forward,
// mha_forward_shapes, mha_forward_workspace_size): the plan
// (plan.c) checks every argument once and lays out the scratch memory; then
// the output views are checked and the chosen implementation runs: the
// reference (ref_module.c) or the fused path (fused_fwd.c). The scratch is
// one block (the caller's workspace, or the thread's kept block when it
// fits, internal.h); nothing else is allocated.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "fused.h"
#include "plan.h"
#include "ref.h"

void mha_forward_args_init(mha_forward_args *a) {
    if (!a) return;
    memset(a, 0, sizeof *a);
    a->average_attn_weights = true;
    a->impl = MHA_IMPL_AUTO;
    a->opts.window_left = -1;
    a->opts.window_right = -1;
    a->weights_head_end = -1;
    a->weights_row_end = -1;
    mha_rope_init(&a->rope, MHA_ROPE_NONE);
}

mha_status mha_forward_shapes(mha_shape *out_shape, mha_shape *weights_shape,
                              const mha_module *m, const mha_forward_args *a) {
    fwd_plan p;
    mha_status st = mha__plan_forward(&p, m, a);
    if (st) return st;
    if (out_shape) *out_shape = p.out_shape;
    if (weights_shape) *weights_shape = p.w_shape;
    return MHA_OK;
}

mha_status mha_forward_workspace_size(size_t *bytes, const mha_module *m,
                                      const mha_forward_args *a) {
    if (!bytes)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_forward_workspace_size: NULL argument");
    fwd_plan p;
    mha_status st = mha__plan_forward(&p, m, a);
    if (st) return st;
    *bytes = p.ws_bytes;
    return MHA_OK;
}

mha_status mha_forward(mha_tensor *out, mha_tensor *weights, const mha_module *m,
                       const mha_forward_args *a) {
    fwd_plan p;
    mha_status st = mha__plan_forward(&p, m, a);
    if (st) return st;
    if ((st = mha__check_forward_outputs(&p, out, weights, a))) return st;
    if (a->workspace && a->workspace_bytes < p.ws_bytes)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_forward: workspace of %zu bytes is too small: %zu needed",
                         a->workspace_bytes, p.ws_bytes);
    if (a->save && (st = mha__saved_prepare(a->save, &p, m, a))) return st;
    void *ws = a->workspace ? a->workspace : mha__scratch_alloc(p.ws_bytes);
    if (!ws)
        return mha__fail(MHA_ERR_NOMEM, "mha_forward: out of memory for %zu bytes of scratch",
                         p.ws_bytes);
    char *al = (char *)(((uintptr_t)ws + 63) & ~(uintptr_t)63);
    if (p.fused) st = mha__fused_forward(&p, out, weights, m, a, al, NULL);
    else mha__ref_forward(&p, out, weights, m, a, al);
    if (!a->workspace) mha__scratch_free(ws, p.ws_bytes);
    if (!st) mha__set_impl(p.fused, mha_isa(), p.fused && mha__fused_forward_bf16(m, a));
    return st;
}

// ---------------------------------------------------------------------------
// Scaled dot-product attention on projected (B, H, T, D) views
