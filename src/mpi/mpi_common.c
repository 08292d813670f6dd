// mpi_common.c: the MPI layer's shared infrastructure (mpi_internal.h),
// below the schemes and the entry points and calling none of them: a
// call's state on a rank and the agreement on errors, the head split, the
// sum of floats over the ranks, transfers between views and float32
// buffers, the local argument checks, a call's stats, and the sequence
// shards of Ulysses and ring attention (their sizes gathered, checked).
//
// Errors: every step that can fail on one rank is followed by
// mha__mpi_agree(): all ranks learn the first failing rank's status and
// message before the next collective, so none waits forever. That includes
// every allocation (all through the library's mha__malloc, so tests/alloc
// sweeps them): a helper that allocates and then communicates agrees in
// between.
#include <stdio.h>
#include <stdlib.h>

#include "mpi_internal.h"
#include "view.h"

mha_status mha__mpi_job_init(job *j, MPI_Comm comm) {
    int init = 0;
    MPI_Initialized(&init);
    if (!init)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_mpi: MPI is not initialised (MPI_Init)");
    j->comm = comm;
    MPI_Comm_rank(comm, &j->rank);
    MPI_Comm_size(comm, &j->P);
    j->t0 = MPI_Wtime();
    j->comm_s = 0, j->sent = 0;
    j->failed = MHA_OK;
    return MHA_OK;
}

// Every rank's status -> the first failing rank's status and message on
// every rank ("rank r: ..."), or MHA_OK everywhere.
mha_status mha__mpi_agree(job *j, mha_status st) {
    // once the ranks have agreed on a failure, every rank knows it: the
    // later checks on the way out need no messages (and keep the message)
    if (j->failed) return j->failed;
    const double t = MPI_Wtime();
    int mine = st ? j->rank : j->P, first = j->P;
    MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, j->comm);
    if (first == j->P) {
        j->comm_s += MPI_Wtime() - t;
        return MHA_OK;
    }
    int code = (int)st;
    char msg[512] = {0};
    if (j->rank == first) snprintf(msg, sizeof msg, "%s", mha_last_error());
    MPI_Bcast(&code, 1, MPI_INT, first, j->comm);
    MPI_Bcast(msg, (int)sizeof msg, MPI_CHAR, first, j->comm);
    j->comm_s += MPI_Wtime() - t;
    j->failed = (mha_status)code;
    if (j->rank == first) return (mha_status)code;  // its own message stands
    return mha__fail((mha_status)code, "rank %d: %s", first, msg);
}

mha_status mha__mpi_too_big(int64_t n) {
    return mha__fail(MHA_ERR_OVERFLOW,
                     "mha_mpi: %lld elements in one message exceed MPI's int counts",
                     (long long)n);
}

// The KV heads of rank r.
void mha__mpi_kv_range(const mha_module *m, int r, int P, int64_t *g0, int64_t *g1) {
    const int64_t Hkv = mha_module_config(m)->num_kv_heads;
    *g0 = Hkv * r / P;
    *g1 = Hkv * (r + 1) / P;
}

// MPI_Allreduce(SUM) of n floats in place.
mha_status mha__mpi_allreduce(job *j, float *x, int64_t n) {
    if (n > INT32_MAX) return mha__mpi_too_big(n);
    const double t = MPI_Wtime();
    MPI_Allreduce(MPI_IN_PLACE, x, (int)n, MPI_FLOAT, MPI_SUM, j->comm);
    j->comm_s += MPI_Wtime() - t;
    j->sent += 4.0 * (double)n * 2.0 * (j->P - 1) / j->P;  // a ring allreduce's volume
    return MHA_OK;
}

// dst (a view of up to 3 dims, any float dtype and strides) (+)= src, the
// same shape contiguous.
// Between a view of up to 3 dims (any float dtype and strides) and the same
// shape contiguous in float32: into the view (+= with add) or out of it.
void mha__mpi_view_xfer(const mha_tensor *t, float *buf, bool into_view, bool add) {
    int64_t sh[3] = {1, 1, 1}, st[3] = {0, 0, 0};
    const int o = 3 - t->ndim;
    for (int i = 0; i < t->ndim; i++) sh[o + i] = t->shape[i], st[o + i] = t->stride[i];
    const mha__mat v = mha__vmat(t->data, t->dtype, 0, 1);
    int64_t k = 0;
    for (int64_t a = 0; a < sh[0]; a++)
        for (int64_t b = 0; b < sh[1]; b++)
            for (int64_t c = 0; c < sh[2]; c++, k++) {
                const int64_t off = a * st[0] + b * st[1] + c * st[2];
                if (!into_view) buf[k] = (float)mha__ld(v, 0, off);
                else mha__st(v, 0, off, add ? mha__ld(v, 0, off) + buf[k] : buf[k]);
            }
}

// A rank's local views (masks aside, which are whole) and output gradient
// checked as the fused path would, before the first collective that
// depends on their shapes.
mha_status mha__mpi_local_check(const mha_module *m, const mha_forward_args *a,
                                const mha_tensor *gout) {
    const mha_config *c = mha_module_config(m);
    if (c && c->head_dim * c->num_heads != c->embed_dim)  // (head_dim: resolved)
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "mha_mpi: head_dim %lld != embed_dim %lld / num_heads %lld is not "
                         "supported across ranks (run the single-process calls)",
                         (long long)c->head_dim, (long long)c->embed_dim,
                         (long long)c->num_heads);
    if (c && c->qk_norm != MHA_QK_NORM_NONE)
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "mha_mpi: qk_norm (mha_config.qk_norm) is not supported across ranks "
                         "(run the single-process calls)");
    if (c && c->sinks)
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "mha_mpi: attention sinks (mha_config.sinks) are not supported "
                         "across ranks (run the single-process calls)");
    mha_forward_args al = *a;
    al.key_padding_mask = NULL;
    al.attn_mask = NULL;
    mha_shape os, ws;
    mha_status st = mha_forward_shapes(&os, &ws, m, &al);
    if (st || !gout) return st;
    bool same = gout->ndim == os.ndim;
    for (int i = 0; same && i < os.ndim; i++) same = gout->shape[i] == os.dims[i];
    if (!same)
        return mha__fail(MHA_ERR_SHAPE,
                         "mha_mpi: grad_output has %d dims (first %lld), "
                         "expected the output's shape (%d dims, first %lld)",
                         gout->ndim, (long long)(gout->ndim ? gout->shape[0] : 0), os.ndim,
                         (long long)os.dims[0]);
    return MHA_OK;
}

void mha__mpi_finish(job *j, mha_mpi_stats *stats, const mha_module *m, double model) {
    if (!stats) return;
    int64_t g0, g1;
    mha__mpi_kv_range(m, j->rank, j->P, &g0, &g1);
    const mha_config *c = mha_module_config(m);
    stats->seconds = MPI_Wtime() - j->t0;
    stats->comm_seconds = j->comm_s;
    stats->bytes_sent = j->sent;
    stats->bytes_model = model;
    stats->kv_head_begin = g0, stats->kv_head_end = g1;
    stats->heads = (g1 - g0) * (c->num_heads / c->num_kv_heads);
    stats->tiles = 0;
    stats->wait_seconds = 0;
}

// The shards of a local view (its sequence dim per the module's layout),
// into s->t0 (P + 1 entries, allocated by the caller).
static void seq_of(job *j, seq *s, const mha_tensor *t, bool batch_first) {
    const int sd = t->ndim == 2 || !batch_first ? 0 : 1;
    int64_t Tl = t->shape[sd];
    s->N = t->ndim == 3 ? t->shape[1 - sd] : 1;
    s->seq_first = sd == 0;
    const double tm = MPI_Wtime();
    MPI_Allgather(&Tl, 1, MPI_INT64_T, s->t0 + 1, 1, MPI_INT64_T, j->comm);
    j->comm_s += MPI_Wtime() - tm;
    s->t0[0] = 0;
    for (int q = 0; q < j->P; q++) s->t0[q + 1] += s->t0[q];
    s->T = s->t0[j->P];
}

// What the sequence-parallel schemes (Ulysses, ring) cannot do, refused.
static mha_status seq_check(const mha_module *m, const mha_forward_args *a, const seq *sq,
                            const seq *sk, bool ring) {
    const mha_config *c = mha_module_config(m);
    const char *name = ring ? "ring" : "ulysses";
    if (a->training && c->out_dropout > 0.0f)
        return mha__fail(MHA_ERR_UNSUPPORTED, "mha_mpi %s: output dropout is not available",
                         name);
    if (ring && (a->attn_mask || c->add_bias_kv || c->add_zero_attn ||
                 (a->training && c->dropout > 0.0f)))
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "mha_mpi ring: attn_mask, add_bias_kv, add_zero_attn and dropout are "
                         "not available (key_padding_mask, causal, windows, RoPE, ALiBi and the "
                         "soft cap are)");
    if (a->rope.mode != MHA_ROPE_NONE && sq->T != sk->T)
        return mha__fail(MHA_ERR_UNSUPPORTED, "mha_mpi %s: RoPE needs L == S (L %lld, S %lld)",
                         name, (long long)sq->T, (long long)sk->T);
    // (a rank sees its tokens only: the positions of the whole sequence and
    // its largest, which dynamic NTK scaling decides from, are not there)
    if (a->rope.mode != MHA_ROPE_NONE &&
        (a->rope_positions ||
         (a->rope_scaling && a->rope_scaling->type == MHA_ROPE_SCALING_DYNAMIC)))
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "mha_mpi %s: rope_positions and dynamic NTK rope_scaling are not "
                         "available (head parallelism has them; rope_start and the linear, "
                         "yarn and llama3 scalings work here)",
                         name);
    if (a->query->ndim != a->key->ndim || sq->N != sk->N)
        return mha__fail(MHA_ERR_SHAPE,
                         "mha_mpi %s: query and key/value shards of "
                         "different batch (%lld, %lld)",
                         name, (long long)sq->N, (long long)sk->N);
    return MHA_OK;
}

// The query's and the key/value's shards, checked, agreed on every rank;
// on failure nothing is left to free.
mha_status mha__mpi_shards_of(job *j, seq *sq, seq *sk, const mha_module *m,
                              const mha_forward_args *a, bool ring) {
    const bool bf = mha_module_config(m)->batch_first;
    sq->t0 = mha__malloc(sizeof(int64_t) * (size_t)(j->P + 1));
    sk->t0 = mha__malloc(sizeof(int64_t) * (size_t)(j->P + 1));
    mha_status st = MHA_OK;
    if (!sq->t0 || !sk->t0) st = mha__fail(MHA_ERR_NOMEM, "mha_mpi: out of memory");
    if (!(st = mha__mpi_agree(j, st))) {
        seq_of(j, sq, a->query, bf);
        seq_of(j, sk, a->key, bf);
        st = seq_check(m, a, sq, sk, ring);
    }
    if ((st = mha__mpi_agree(j, st))) {
        free(sq->t0), free(sk->t0);
        sq->t0 = sk->t0 = NULL;
    }
    return st;
}
