// part.c: the distributed layer's entry points (part.h): the plan of a
// part (the fused path, float32 weights, no weights output or trace, a
// checked head range, a block's mask columns), its forward and backward
// through the fused drivers' hooks, and the pieces the schemes combine:
// the output projection from a whole context, the input gradients from
// whole projection gradients, a key block's attention backward.
#include <stdlib.h>
#include <string.h>

#include "linear.h"
#include "part.h"

// The plan of a part: the fused path, float32 weights, no weights output,
// no saved state, no trace; the range checked.
mha_status mha__part_plan(fwd_plan *p, mha_forward_args *a2, const mha_module *m,
                          const mha_forward_args *a, const mha__part *part) {
    if (!m || !a || !part)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha parallel: NULL module, args or part");
    *a2 = *a;
    a2->impl = MHA_IMPL_FUSED;
    a2->need_weights = false;
    if (!part->attn.fn) a2->save = NULL;  // (ring attention keeps one)
    a2->trace = NULL;
    mha_status st = mha__plan_forward(p, m, a2);
    if (st) return st;
    if (!p->fused)
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "mha parallel: float32, bfloat16 or float16 inputs only (the fused "
                         "path)");
    if (part->g0 < 0 || part->g0 > part->g1 || part->g1 > p->Hkv)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha parallel: KV heads [%lld, %lld) not within [0, %lld)",
                         (long long)part->g0, (long long)part->g1, (long long)p->Hkv);
    p->g0 = part->g0;
    p->g1 = part->g1;
    p->mask.q_off = part->block.q_off;
    if (part->block.kpm_full) {  // the block's columns of the whole mask
        const mha_tensor *t = part->block.kpm_full;
        p->mask.kpm = (const char *)t->data + part->block.kpm_off * t->stride[t->ndim - 1] *
                                                  (int64_t)mha_dtype_size(t->dtype);
        p->mask.kpm_dtype = t->dtype;
        p->mask.kpm_s[0] = p->unbatched ? 0 : t->stride[0];
        p->mask.kpm_s[1] = t->stride[t->ndim - 1];
    }
    return MHA_OK;
}

mha_status mha__part_forward(mha_tensor *out, const mha_module *m, const mha_forward_args *a,
                             const mha__part *part) {
    fwd_plan p;
    mha_forward_args a2;
    mha_status st = mha__part_plan(&p, &a2, m, a, part);
    if (st) return st;
    if (!part->out.ctx && !part->proj.q_out &&
        (st = mha__check_forward_outputs(&p, out, NULL, &a2)))
        return st;
    if (a2.save && (st = mha__saved_prepare(a2.save, &p, m, &a2))) return st;
    void *ws = mha__malloc(p.ws_bytes);
    if (!ws)
        return mha__fail(MHA_ERR_NOMEM, "mha parallel: out of memory for %zu bytes of scratch",
                         p.ws_bytes);
    st = mha__fused_forward(&p, out, NULL, m, &a2,
                            (char *)(((uintptr_t)ws + 63) & ~(uintptr_t)63), part);
    free(ws);
    return st;
}

mha_status mha__part_out_project(mha_tensor *out, const mha_module *m,
                                 const mha_forward_args *a, const float *ctx) {
    const mha__part all = {.g0 = 0, .g1 = m ? m->cfg.num_kv_heads : 0, .bias = true};
    fwd_plan p;
    mha_forward_args a2;
    mha_status st = mha__part_plan(&p, &a2, m, a, &all);
    if (st) return st;
    if ((st = mha__check_forward_outputs(&p, out, NULL, &a2))) return st;
    const int64_t n = p.N * p.L * p.Eq;  // ctx (Rq, Eq)
    void *ws = mha__malloc(p.ws_bytes);
    float *c = mha__malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (!ws || !c) {
        free(ws);
        free(c);
        return mha__fail(MHA_ERR_NOMEM, "mha parallel: out of memory for %zu bytes of scratch",
                         p.ws_bytes + sizeof(float) * (size_t)n);
    }
    memcpy(c, ctx, sizeof(float) * (size_t)n);  // (gated in place)
    mha__fused_out_project(&p, out, m, &a2, c, (char *)(((uintptr_t)ws + 63) & ~(uintptr_t)63));
    free(c);
    free(ws);
    return MHA_OK;
}


mha_status mha__part_backward(mha_tensor *gq, mha_tensor *gk, mha_tensor *gv, mha_module *grads,
                              const mha_module *m, const mha_forward_args *args,
                              const mha_tensor *gout, const mha__part *part) {
    if (!m || !args || !part)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha parallel backward: NULL module, args or part");
    mha_status st = mha__require_f32_weights(m, "mha parallel backward");
    if (!st && grads) st = mha__require_f32_weights(grads, "mha parallel backward (grads)");
    if (st) return st;
    fwd_plan p;
    mha_forward_args a;  // (the part's plan: the fused path, its range checked)
    if ((st = mha__part_plan(&p, &a, m, args, part))) return st;
    if ((st = mha__check_backward(&p, gq, gk, gv, grads, m, &a, gout))) return st;
    return mha__fused_backward(&p, gq, gk, gv, grads, m, &a, gout, false, part);
}

mha_status mha__part_input_grads(mha_tensor *gq, mha_tensor *gk, mha_tensor *gv,
                                 const mha_module *m, const mha_forward_args *a,
                                 const float *dq, const float *dk, const float *dv,
                                 const float *dz, bool acc) {
    mha_forward_args a2 = *a;
    a2.need_weights = false, a2.save = NULL, a2.trace = NULL, a2.impl = MHA_IMPL_FUSED;
    fwd_plan p;
    mha_status st = mha__plan_forward(&p, m, &a2);
    if (st) return st;
    const mha__kernels *kt = mha__kernels_get();
    const int64_t E = p.E, Eq = p.Eq, H = p.H, Ekv = p.Ekv, kd = p.kdim, vd = p.vdim;
    const int64_t Rq = mha__rows_of(a->query), Rk = mha__rows_of(a->key),
                  Rmax = Rq > Rk ? Rq : Rk;
    const int64_t Fmax = E > kd ? (E > vd ? E : vd) : (kd > vd ? kd : vd);
    const int64_t Omax = E > Eq ? (E > Ekv ? E : Ekv) : (Eq > Ekv ? Eq : Ekv);
    const size_t n_bp = mha__gemm_packed_b_floats(kt, Omax, Fmax),
                 n_gs = mha__gemm_scratch_floats(kt, p.nthreads), n_tmp = (size_t)(Rmax * Fmax);
    float *blk = mha__alloc(sizeof(float) * (n_bp + n_gs + n_tmp));
    if (!blk)
        return mha__fail(MHA_ERR_NOMEM, "mha parallel: out of memory for %zu bytes of scratch",
                         sizeof(float) * (n_bp + n_gs + n_tmp));
    float *bp = blk, *gs = bp + n_bp, *tmp = gs + n_gs;
    const int nt = p.nthreads;
    if (gq)
        mha__grad_input_rows(kt, gq, acc, dq, Eq, mha__wmat_f32(m->q_weight, NULL), Rq, Eq, E,
                             tmp, bp, gs, nt);
    if (gq && m->cfg.head_gate == MHA_GATE_DYNAMIC)
        mha__grad_input_rows(kt, gq, true, dz, H, mha__wmat_f32(m->gate_weight, NULL), Rq, H,
                             E, tmp, bp, gs, nt);
    if (gk)
        mha__grad_input_rows(kt, gk, acc, dk, Ekv, mha__wmat_f32(m->k_weight, NULL), Rk, Ekv,
                             kd, tmp, bp, gs, nt);
    if (gv)
        mha__grad_input_rows(kt, gv, acc, dv, Ekv, mha__wmat_f32(m->v_weight, NULL), Rk, Ekv,
                             vd, tmp, bp, gs, nt);
    mha__free(blk);
    return MHA_OK;
}

mha_status mha__part_attn_backward(const mha_module *m, const mha_forward_args *a,
                                   const mha__part *part) {
    fwd_plan p;
    mha_forward_args a2;
    mha_status st = mha__part_plan(&p, &a2, m, a, part);
    if (st) return st;
    if (!part->proj.q_in || !part->proj.k_in || !part->proj.v_in || !part->block.o_in ||
        !part->block.do_in || !part->block.stats || !part->block.dsum_in || !part->out.dq ||
        !part->out.dk || !part->out.dv)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha parallel: a block's attention backward needs q, k, v, the "
                         "context, its gradient, the row stats and Dsum, and dq, dk, dv");
    if (p.Sp != p.S)
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "mha parallel: a block's attention backward has no appended keys "
                         "(add_bias_kv, add_zero_attn)");
    const mha__kernels *kt = mha__kernels_get();
    const int64_t N = p.N, L = p.L, S = p.S, E = p.Eq, H = p.H, d = p.d, Hkv = p.Hkv,
                  G = H / Hkv, Ekv = p.Ekv;  // (E: the queries' width Eq)
    const int nt = p.nthreads;
    const bool seq_first = p.unbatched || !m->cfg.batch_first;
    const size_t sf = mha__flash_scratch_floats(d, d, S, 0, true);
    float *scratch = mha__alloc(sizeof(float) * sf * (size_t)nt);
    if (!scratch)
        return mha__fail(MHA_ERR_NOMEM, "mha parallel: out of memory for %zu bytes of scratch",
                         sizeof(float) * sf * (size_t)nt);
    for (int t = 0; t < nt; t++) mha__flash_scratch_reset(scratch + (size_t)t * sf);
    const mha__rowmap qm = {(float *)part->proj.q_in, E, seq_first, N, L},
                      km = {(float *)part->proj.k_in, Ekv, seq_first, N, S},
                      vm = {(float *)part->proj.v_in, Ekv, seq_first, N, S},
                      om = {(float *)part->block.o_in, E, seq_first, N, L},
                      dom = {(float *)part->block.do_in, E, seq_first, N, L},
                      dqm = {part->out.dq, E, seq_first, N, L},
                      dkm = {part->out.dk, Ekv, seq_first, N, S},
                      dvm = {part->out.dv, Ekv, seq_first, N, S};
    int64_t ntiles = 0;
    // one thread per KV head (b, g): its query heads in increasing order add
    // to dk_g, dv_g (the fused backward's order), no atomics
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) reduction(+ : ntiles)
    for (int64_t bg = 0; bg < N * Hkv; bg++) {
        const int64_t b = bg / Hkv, g = bg % Hkv, h0 = mha__plan_group_first_live(&p, m, g, G);
        const int tid = mha__thread_id();
        if (h0 < 0) {  // the whole group pruned: no gradient
            mha__zero_head_rows(mha__head_row0(&dkm, b, g * d), mha__head_rs(&dkm), 0, S, d);
            mha__zero_head_rows(mha__head_row0(&dvm, b, g * d), mha__head_rs(&dvm), 0, S, d);
        }
        for (int64_t h = g * G; h < (g + 1) * G; h++) {
            if (!mha__plan_head_live(&p, m, h)) {
                mha__zero_head_rows(mha__head_row0(&dqm, b, h * d), mha__head_rs(&dqm), 0, L, d);
                continue;
            }
            mha__flash_head fh = mha__plan_head(&p, &qm, &km, &vm, &om, NULL,
                                                (float *)part->block.stats, b, h);
            fh.dsum_fixed = true;
            fh.progress = tid == 0 ? part->progress.fn : NULL;
            fh.progress_arg = part->progress.arg;
            mha__flash_bwd_head(kt, &fh, mha__head_row0(&dom, b, h * d), mha__head_rs(&dom),
                                (float *)part->block.dsum_in + (b * H + h) * L,
                                mha__head_row0(&dqm, b, h * d), mha__head_rs(&dqm),
                                mha__head_row0(&dkm, b, g * d), mha__head_rs(&dkm),
                                mha__head_row0(&dvm, b, g * d), mha__head_rs(&dvm), NULL, NULL,
                                h != h0, scratch + (size_t)tid * sf);
            for (int64_t i0 = 0; part->progress.tiles && i0 < L; i0 += MHA__FLASH_BR)
                ntiles += mha__key_tiles(&fh, i0, mha__tile_end(i0, MHA__FLASH_BR, L));
        }
    }
    if (part->progress.tiles) *part->progress.tiles += ntiles;
    mha__free(scratch);
    return MHA_OK;
}
