// schemes.h: the schemes' entry points that mha_mpi.c dispatches to (not
// installed; ulysses.c, ring.c), each described at its definition. Apart
// from mpi_internal.h, so that the shared helpers (mpi_common.c) do not see
// them.
#ifndef MHA_MPI_SCHEMES_H
#define MHA_MPI_SCHEMES_H

#include "mpi_internal.h"

// ulysses.c: Ulysses' forward (out: this rank's tokens) and backward
mha_status mha__mpi_ulysses_forward(job *j, mha_tensor *out, const mha_module *m,
                                    const mha_forward_args *a, double *model);
mha_status mha__mpi_ulysses_backward(job *j, mha_tensor *gq, mha_tensor *gk, mha_tensor *gv,
                                     mha_module *gr, const mha_module *m,
                                     const mha_forward_args *a, const mha_tensor *gout,
                                     bool accumulate, double *model);

// ring.c: one rank's state in a ring call (the caller's storage, filled by
// mha__mpi_ring_run), ring attention's forward (out) or backward, and the
// ring's stats
typedef struct ring {
    job *j;
    const mha_module *m;
    const mha_forward_args *a;  // the caller's: local views, whole masks
    int64_t N, E, H, d, Hkv, Ekv, Tq, Tk;
    int sd;  // the views' sequence dim
    bool seq_first;
    int64_t qs[2], ql[2];  // my query chunks: global start, length
    int entered;           // attention callbacks entered
    bool fwd_done;         // q, o, st hold this call's forward
    // per query chunk (rows as the views', chunk-long): the projections,
    // the context, the rows' stats (global max, 1/sum; (N, H, ql, 2))
    float *q[2], *o[2], *st[2];
    // a key/value block (k chunk 0, k chunk 1, v chunk 0, v chunk 1) held
    // and next; room for the largest
    float *blk, *nblk;
    int64_t nmax;
    MPI_Request req[4];
    int nreq;
    int64_t tiles;
    double wait_s;
} ring;

mha_status mha__mpi_ring_run(job *j, mha_tensor *out, mha_tensor *gq, mha_tensor *gk,
                             mha_tensor *gv, mha_module *gr, const mha_module *m,
                             const mha_forward_args *a, const mha_tensor *gout, double *model,
                             ring *r);
void mha__mpi_ring_stats(mha_mpi_stats *stats, const mha_module *m, const ring *r);

#endif
