// mpi_internal.h: what the files of the MPI layer (src/mpi/, libmha_mpi)
// share; not installed. One call's state on a rank (job), the sequence
// shards of the sequence-parallel schemes (seq) and the helpers of
// mpi_common.c, prefixed mha__mpi_. The schemes' entry points are
// schemes.h's.
#ifndef MHA_MPI_INTERNAL_H
#define MHA_MPI_INTERNAL_H

#include "mha_mpi.h"

// One call's state on this rank.
typedef struct job {
    MPI_Comm comm;
    int rank, P;
    double t0, comm_s, sent;
    mha_status failed;  // the failure the ranks agreed on (MHA_OK: none yet)
} job;

// A sequence of T tokens (N batch elements) in consecutive blocks, one per
// rank: t0[q] .. t0[q + 1]; rows t N + n (seq_first) or n T + t.
typedef struct seq {
    int64_t N, T;
    bool seq_first;
    int64_t *t0;  // (P + 1)
} seq;

// mpi_common.c (each described at its definition)
// a call's start on this rank (MPI must be initialised)
mha_status mha__mpi_job_init(job *j, MPI_Comm comm);
// the first failing rank's status and message on every rank, or MHA_OK
mha_status mha__mpi_agree(job *j, mha_status st);
// MHA_ERR_OVERFLOW: n elements do not fit MPI's int counts
mha_status mha__mpi_too_big(int64_t n);
// the KV heads [g0, g1) of rank r of P
void mha__mpi_kv_range(const mha_module *m, int r, int P, int64_t *g0, int64_t *g1);
// MPI_Allreduce(SUM) of n floats in place
mha_status mha__mpi_allreduce(job *j, float *x, int64_t n);
// a view of up to 3 dims <-> the same shape contiguous in float32
void mha__mpi_view_xfer(const mha_tensor *t, float *buf, bool into_view, bool add);
// a rank's local views and output gradient checked as the fused path would
mha_status mha__mpi_local_check(const mha_module *m, const mha_forward_args *a,
                                const mha_tensor *gout);
// the call's stats (stats may be NULL)
void mha__mpi_finish(job *j, mha_mpi_stats *stats, const mha_module *m, double model);
// the query's and the key/value's shards, checked and agreed on every rank
mha_status mha__mpi_shards_of(job *j, seq *sq, seq *sk, const mha_module *m,
                              const mha_forward_args *a, bool ring);

#endif
