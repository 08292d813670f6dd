// part.h: the distributed layer's one interface into the library (part.c;
// entry layer): forward, backward and their pieces on a part of the heads
// or of the work (the hooks of fused.h), every piece the fused path's own
// code, so a distributed call gives what the single-process one gives.
#ifndef MHA_PART_H
#define MHA_PART_H

#include "fused.h"
#include "kvcache.h"

// The distributed layer's entry points (fused path, float32).
mha_status mha__part_forward(mha_tensor *out, const mha_module *m, const mha_forward_args *a,
                             const mha__part *part);
mha_status mha__part_backward(mha_tensor *gq, mha_tensor *gk, mha_tensor *gv,
                              mha_module *grads, const mha_module *m, const mha_forward_args *a,
                              const mha_tensor *gout, const mha__part *part);
// The input gradients from the full projection gradients (what the
// single-process fused backward computes from them, bit for bit):
// grad_query = dq W_Q (+ dz W_g with dynamic gates), grad_key = dk W_K,
// grad_value = dv W_V; each output may be NULL; accumulate: added to them
// (in the backward's order).
mha_status mha__part_input_grads(mha_tensor *gq, mha_tensor *gk, mha_tensor *gv,
                                 const mha_module *m, const mha_forward_args *a,
                                 const float *dq, const float *dk, const float *dv,
                                 const float *dz, bool accumulate);
// The rest of the forward from a full context ctx (Rq, Eq, ungated): the
// gates, W_O and the output dropout, into out (what the single-process
// fused forward computes from its context, bit for bit).
mha_status mha__part_out_project(mha_tensor *out, const mha_module *m,
                                 const mha_forward_args *a, const float *ctx);

// The backward of one block's attention (ring attention; the part's
// o_in, do_in, stats, dsum_in, q_in, k_in, v_in; dq, dk, dv written).
mha_status mha__part_attn_backward(const mha_module *m, const mha_forward_args *a,
                                   const mha__part *part);
// The plan of a part (fused path, no weights, saved state or trace; a2 the
// args it runs with; the range, q_off and the block's mask columns set).
mha_status mha__part_plan(fwd_plan *p, mha_forward_args *a2, const mha_module *m,
                          const mha_forward_args *a, const mha__part *part);

// The state a training forward keeps (mha_forward_args.save). Layout of
// buf (floats): the projections as the fused backward lays them out
// (self_packed: (Rq, Eq + 2 Ekv); else q (Rq, Eq), k (Rk, Ekv), v (Rk, Ekv)),

#endif
