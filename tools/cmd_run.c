// cmd_run.c: `mha forward` and `mha backward` on a run that run.c parsed
// and loaded: the module's forward (--incremental: token by token through a
// KV cache) and its backward, written as one safetensors file; --parallel:
// across the MPI ranks (mha_mpi.h), each rank given its own tokens for the
// sequence-parallel schemes. Public API only.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cmd.h"
#include "run.h"

// --incremental: the query's tokens chunk by chunk through a KV cache.
// position_ids (the inputs' or a checkpoint's) go to each chunk as its
// (N, n) slice of rope_positions.
static int run_incremental(run *r, mha_tensor *ot) {
    const mha_tensor *q = r->a.query;
    if (r->a.key != q || r->a.value != q || r->a.need_weights)
        return cli_usage(r->cmd, "--incremental is causal self-attention (no key/value "
                                 "tensors, no --need-weights)");
    if (r->a.key_padding_mask || r->a.attn_mask)
        return cli_usage(r->cmd, "--incremental takes no masks (no attention_mask)");
    const int sd = q->ndim == 2 || !r->base.batch_first ? 0 : 1;  // the sequence dim
    const int64_t L = q->shape[sd], N = q->ndim == 3 ? q->shape[1 - sd] : 1;
    const mha_config *c = mha_module_config(r->m);
    const int64_t Hkv = c->num_kv_heads, d = c->head_dim;  // (resolved: E / H unless set)
    mha_kv_cache *cache = NULL;
    mha_status st = mha_kv_cache_create(&cache, N, Hkv, d, d, L > 0 ? L : 1, r->kv_dtype);
    if (st) return cli_fail(r->cmd, st);
    const int64_t step = r->chunk ? r->chunk : 1;
    int64_t *pos = r->a.rope_positions ? malloc(sizeof(int64_t) * (size_t)(N * step)) : NULL;
    if (r->a.rope_positions && !pos) {
        mha_kv_cache_destroy(cache);
        fprintf(stderr, "mha %s: out of memory\n", r->cmd);
        return 1;
    }
    for (int64_t t0 = 0; !st && t0 < L; t0 += step) {
        const int64_t n = L - t0 < step ? L - t0 : step;
        mha_tensor qc = *q, oc = *ot;  // views of tokens [t0, t0 + n)
        qc.data = (char *)q->data + t0 * q->stride[sd] * (int64_t)mha_dtype_size(q->dtype);
        oc.data = (char *)ot->data + t0 * ot->stride[sd] * (int64_t)mha_dtype_size(ot->dtype);
        qc.shape[sd] = oc.shape[sd] = n;
        mha_forward_args a = r->a;
        a.query = a.key = a.value = &qc;
        if (pos) {
            for (int64_t b = 0; b < N; b++)
                for (int64_t t = 0; t < n; t++)
                    pos[b * n + t] = r->a.rope_positions[b * L + t0 + t];
            a.rope_positions = pos;
        }
        st = mha_forward_cached(&oc, r->m, &a, cache);
    }
    free(pos);
    mha_kv_cache_destroy(cache);
    return st ? cli_fail(r->cmd, st) : 0;
}

// mha_forward, or across the MPI ranks with --parallel.
#ifdef MHA_HAVE_MPI
// Sequence parallelism in the CLI: every rank has read the whole tensors;
// it passes the library a contiguous copy of its tokens (ulysses: its block
// of the even split; ring: its two zigzag chunks) and rank 0 gathers the
// results into the whole tensors (and writes the file).

// Out of memory for the copies: the tool ends the whole job (no rank is
// left waiting) with a message.
static mha_status cli_nomem(void) {
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    fprintf(stderr, "mha: rank %d: out of memory for its tokens' copies\n", rank);
    MPI_Abort(MPI_COMM_WORLD, 1);
    return MHA_ERR_NOMEM;
}

// The tokens of T that rank `rank` holds: spans [s[i], s[i] + n[i]).
static void cli_spans(mha_parallel par, int64_t T, int rank, int P, int64_t s[2], int64_t n[2]) {
    if (par == MHA_PAR_RING) {
        mha_mpi_ring_chunks(T, P, rank, s, n);
        return;
    }
    s[0] = T * rank / P, n[0] = T * (rank + 1) / P - s[0];
    s[1] = s[0] + n[0], n[1] = 0;
}

// Between a contiguous tensor t and buf, its spans' tokens in order (the
// same layout): into buf (out) or back.
static void span_xfer(const mha_tensor *t, bool bf, const int64_t s[2], const int64_t n[2],
                      char *buf, bool out) {
    const int sd = t->ndim == 2 || !bf ? 0 : 1;
    const int64_t row = t->stride[sd] * (int64_t)mha_dtype_size(t->dtype), T = t->shape[sd],
                  outer = sd ? t->shape[0] : 1, Tl = n[0] + n[1];
    for (int64_t o = 0; o < outer; o++)
        for (int c = 0; c < 2; c++) {
            char *w = (char *)t->data + (o * T + s[c]) * row,
                 *l = buf + (o * Tl + (c ? n[0] : 0)) * row;
            memcpy(out ? l : w, out ? w : l, (size_t)(n[c] * row));
        }
}

// This rank's tokens of t: a contiguous copy (free its data; out of memory
// ends the job). With copy false only the room.
static mha_tensor span_local(const mha_tensor *t, bool bf, mha_parallel par, bool copy) {
    int rank, P;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &P);
    const int sd = t->ndim == 2 || !bf ? 0 : 1;
    int64_t s[2], n[2], sh[3];
    cli_spans(par, t->shape[sd], rank, P, s, n);
    for (int i = 0; i < t->ndim; i++) sh[i] = t->shape[i];
    sh[sd] = n[0] + n[1];
    mha_tensor l = mha_tensor_contiguous(NULL, t->dtype, t->ndim, sh);
    l.data = malloc((size_t)mha_tensor_numel(&l) * mha_dtype_size(t->dtype) + 1);
    if (!l.data) (void)cli_nomem();
    if (copy) span_xfer(t, bf, s, n, l.data, true);
    return l;
}

// This rank's query, key and value (in[0..2]; self-attention: one copy)
// and the args that use them.
static void span_args(const run *r, bool bf, mha_tensor in[3], mha_forward_args *a) {
    const bool self = r->a.key == r->a.query && r->a.value == r->a.query;
    in[0] = span_local(r->a.query, bf, r->par, true);
    in[1] = self ? in[0] : span_local(r->a.key, bf, r->par, true);
    in[2] = self ? in[0] : span_local(r->a.value, bf, r->par, true);
    *a = r->a;
    a->query = &in[0];
    a->key = self ? &in[0] : &in[1];
    a->value = self ? &in[0] : &in[2];
}

static void span_args_free(mha_tensor in[3]) {
    free(in[0].data);
    if (in[1].data != in[0].data) free(in[1].data), free(in[2].data);
}

// Rank 0 receives every rank's tokens (loc, from span_local) into t.
static mha_status gather_spans(const mha_tensor *t, const mha_tensor *loc, bool bf,
                               mha_parallel par) {
    int rank, P;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &P);
    const int sd = t->ndim == 2 || !bf ? 0 : 1;
    const int64_t T = t->shape[sd], per = mha_tensor_numel(t) / (T ? T : 1) *
                                          (int64_t)mha_dtype_size(t->dtype);  // bytes a token
    int *cnt = malloc(sizeof(int) * (size_t)P * 2);
    char *all = rank == 0 ? malloc((size_t)(T * per) + 1) : NULL;
    int bad = !cnt || (rank == 0 && !all), any = 0;
    for (int q = 0, off = 0; cnt && q < P; q++) {
        int64_t s[2], n[2];
        cli_spans(par, T, q, P, s, n);
        if ((n[0] + n[1]) * per > INT32_MAX) bad = 1;
        cnt[q] = (int)((n[0] + n[1]) * per), cnt[P + q] = off, off += cnt[q];
    }
    MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (!any) {
        MPI_Gatherv(loc->data, cnt[rank], MPI_BYTE, all, cnt, cnt + P, MPI_BYTE, 0,
                    MPI_COMM_WORLD);
        for (int q = 0; rank == 0 && q < P; q++) {
            int64_t s[2], n[2];
            cli_spans(par, T, q, P, s, n);
            span_xfer(t, bf, s, n, all + cnt[P + q], false);
        }
    }
    free(cnt), free(all);
    return any ? cli_nomem() : MHA_OK;
}
#endif

// mha_forward, or across the MPI ranks with --parallel.
static mha_status cli_forward(run *r, mha_tensor *out, mha_tensor *weights) {
#ifdef MHA_HAVE_MPI
    if (r->parallel && (r->par == MHA_PAR_ULYSSES || r->par == MHA_PAR_RING)) {
        const bool bf = mha_module_config(r->m)->batch_first;
        mha_tensor in[3], o = span_local(out, bf, r->par, false);
        mha_forward_args a;
        span_args(r, bf, in, &a);
        mha_status st = mha_mpi_forward(MPI_COMM_WORLD, r->par, &o, r->m, &a, NULL);
        if (!st) st = gather_spans(out, &o, bf, r->par);
        span_args_free(in);
        free(o.data);
        return st;
    }
    if (r->parallel) return mha_mpi_forward(MPI_COMM_WORLD, r->par, out, r->m, &r->a, NULL);
#endif
    return mha_forward(out, weights, r->m, &r->a);
}

// Runs the forward; writes attn_output (and the weights) into r->wr.
static int run_forward_into(run *r) {
    mha_shape os, wsh;
    mha_status st = mha_forward_shapes(&os, &wsh, r->m, &r->a);
    if (st) return cli_fail(r->cmd, st);
    float *yo = run_alloc(r, shape_numel(&os));
    float *yw = r->a.need_weights ? run_alloc(r, shape_numel(&wsh)) : NULL;
    if (!yo || (r->a.need_weights && !yw)) return 1;
    // (r->dtype BF16/F16: 2-byte elements in the float-sized buffers)
    mha_tensor ot = mha_tensor_contiguous(yo, r->dtype, os.ndim, os.dims);
    mha_tensor wt = mha_tensor_contiguous(yw, r->dtype, wsh.ndim, wsh.dims);
    if (r->incremental) {
        int rc = run_incremental(r, &ot);
        if (rc) return rc;
        if ((st = mha_st_writer_add(r->wr, "attn_output", r->dtype, os.ndim, os.dims, yo)))
            return cli_fail(r->cmd, st);
        return 0;
    }
    if ((st = cli_forward(r, &ot, r->a.need_weights ? &wt : NULL)) ||
        (st = mha_st_writer_add(r->wr, "attn_output", r->dtype, os.ndim, os.dims, yo)) ||
        (r->a.need_weights && (st = mha_st_writer_add(r->wr, "attn_output_weights", r->dtype,
                                                      wsh.ndim, wsh.dims, yw))))
        return cli_fail(r->cmd, st);
    return 0;
}

// Runs the backward; writes grad_query/key/value (self-attention:
// grad_query, the input's whole gradient) and grad_<param>.
static int run_backward_into(run *r) {
    const char *cmd = r->cmd;
    mha_status st;
    if ((st = mha_st_open(&r->gf, r->gpath))) return cli_fail(cmd, st);
    mha_st_tensor gt;
    if ((st = mha_st_find(&gt, r->gf, "grad_attn_output"))) return cli_fail(cmd, st);
    if (gt.dtype != MHA_F32 && gt.dtype != MHA_F16 && gt.dtype != MHA_BF16 &&
        gt.dtype != MHA_F64) {
        fprintf(stderr,
                "mha %s: %s: grad_attn_output has dtype %s (expected a float "
                "type)\n",
                cmd, r->gpath, mha_dtype_name(gt.dtype));
        return 1;
    }
    float *g = run_alloc(r, gt.numel);
    if (!g) return 1;
    if ((st = mha_st_read(g, (size_t)gt.numel * sizeof(float), MHA_F32, &gt)))
        return cli_fail(cmd, st);
    mha_tensor gv = mha_tensor_contiguous(g, MHA_F32, gt.ndim, gt.shape);
    const mha_tensor *ins[3] = {r->a.query, r->a.key, r->a.value};
    static const char *gnames[3] = {"grad_query", "grad_key", "grad_value"};
    mha_tensor gin[3];
    for (int i = 0; i < 3; i++) {
        float *b = run_alloc(r, mha_tensor_numel(ins[i]));
        if (!b) return 1;
        gin[i] = mha_tensor_contiguous(b, MHA_F32, ins[i]->ndim, ins[i]->shape);
    }
    mha_module *grads = NULL;
    if ((st = mha_module_create(&grads, mha_module_config(r->m)))) return cli_fail(cmd, st);
#ifdef MHA_HAVE_MPI
    if (r->parallel && (r->par == MHA_PAR_ULYSSES || r->par == MHA_PAR_RING)) {
        const bool bf = mha_module_config(r->m)->batch_first;
        mha_tensor in[3], gb = span_local(&gv, bf, r->par, true), lg[3];
        for (int i = 0; i < 3; i++) lg[i] = span_local(&gin[i], bf, r->par, false);
        mha_forward_args a;
        span_args(r, bf, in, &a);
        st = mha_mpi_backward(MPI_COMM_WORLD, r->par, &lg[0], &lg[1], &lg[2], grads, r->m, &a,
                              &gb, false, NULL);
        for (int i = 0; i < 3 && !st; i++) st = gather_spans(&gin[i], &lg[i], bf, r->par);
        span_args_free(in);
        free(gb.data);
        for (int i = 0; i < 3; i++) free(lg[i].data);
    } else if (r->parallel)
        st = mha_mpi_backward(MPI_COMM_WORLD, r->par, &gin[0], &gin[1], &gin[2], grads, r->m,
                              &r->a, &gv, false, NULL);
    else
#endif
        st = mha_backward(&gin[0], &gin[1], &gin[2], grads, r->m, &r->a, &gv, false);
    // self-attention (no key or value in the inputs): grad_query is the
    // input's whole gradient, the sum of the three paths' parts in this
    // order, as Python's MultiheadAttention.backward gives it
    const bool self = r->a.key == r->a.query && r->a.value == r->a.query;
    if (!st && self) {
        float *dq = gin[0].data;
        const float *dk = gin[1].data, *dv = gin[2].data;
        for (int64_t i = 0; i < mha_tensor_numel(&gin[0]); i++) {
            dq[i] += dk[i];
            dq[i] += dv[i];
        }
    }
    for (int i = 0; i < (self ? 1 : 3) && !st; i++)
        st = mha_st_writer_add(r->wr, gnames[i], MHA_F32, gin[i].ndim, gin[i].shape,
                               gin[i].data);
    for (int i = 0; i < mha_module_num_params(grads) && !st; i++) {
        mha_param p;
        char name[128];
        if ((st = mha_module_param_at(&p, grads, i))) break;
        snprintf(name, sizeof name, "grad_%s", p.name);
        st = mha_st_writer_add(r->wr, name, MHA_F32, p.ndim, p.shape, p.data);
    }
    mha_module_destroy(grads);
    return st ? cli_fail(cmd, st) : 0;
}

static int cmd_run(const char *cmd, bool backward, int argc, char **argv) {
    run r;
    memset(&r, 0, sizeof r);
    r.cmd = cmd;
    int rc = run_parse(&r, backward, argc, argv);
    if (rc >= 0) return rc;
    mha_status st;
    int rank = 0;
#ifdef MHA_HAVE_MPI
    // --parallel: every rank loads the files; if one cannot, all stop (the
    // one that failed has said why); afterwards only rank 0 speaks (every
    // rank receives the same error from the collective calls) and writes
    if (r.parallel) {
        int provided = 0;  // (OpenMP threads; only the main one calls MPI)
        MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    }
#endif
    rc = run_load(&r);
#ifdef MHA_HAVE_MPI
    if (r.parallel) {
        int any = 0;
        MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        if (any && !rc) rc = any;
        if (rank != 0 && !freopen("/dev/null", "w", stderr)) rc = rc ? rc : 1;
    }
#endif
    if (!rc && (st = mha_st_writer_create(&r.wr))) rc = cli_fail(cmd, st);
    if (!rc) rc = run_forward_into(&r);
    if (!rc && backward) rc = run_backward_into(&r);
    if (!rc && rank == 0 && (st = mha_st_writer_save(r.wr, r.ypath))) rc = cli_fail(cmd, st);
    run_free(&r);
#ifdef MHA_HAVE_MPI
    if (r.parallel) {
        int any = 0;  // a rank 0 that could not write fails every rank
        MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        MPI_Finalize();
        return any;
    }
#endif
    return rc;
}

int cmd_forward(int argc, char **argv) { return cmd_run("forward", false, argc, argv); }
int cmd_backward(int argc, char **argv) { return cmd_run("backward", true, argc, argv); }
