// mha_mpi.h: multi-head attention across MPI ranks (libmha_mpi, built
// when CMake finds MPI; libmha itself never uses MPI).
//
// MPI must be initialised by the caller, at least MPI_THREAD_FUNNELED when
// the library uses OpenMP threads (ring attention calls MPI_Testall from
// the parallel region's main thread). Every call is collective over comm: all ranks call it with the same
// module (the same parameters), the same configuration and arguments of
// the same shapes. A call that fails on one rank fails on every rank with
// the same status and the failing rank's message (prefixed "rank r: ");
// no rank is left waiting.
//
// Schemes (mha_parallel):
//   MHA_PAR_HEADS       head (tensor) parallelism as in Megatron-LM: the KV
//                       heads (and their query heads) are split across the
//                       ranks, as evenly as they go (KV heads [Hkv r / P,
//                       Hkv (r+1) / P) on rank r; with fewer KV heads than
//                       ranks some ranks have none). Each rank projects only
//                       its heads' rows of W_Q, W_K, W_V and runs only their
//                       attention. Exact: the contexts (forward) and the
//                       projections' gradients (backward) are gathered and
//                       every rank finishes with the same operations as one
//                       process, so outputs and gradients are bit-identical
//                       to the single-process fused path.
//   MHA_PAR_HEADS_FAST  the same split; each rank's share of the output
//                       (its context times its columns of W_O) and of the
//                       input gradients are summed with MPI_Allreduce:
//                       within the tolerance rule, not bit-identical.
//   MHA_PAR_ULYSSES     sequence parallelism as in DeepSpeed-Ulysses: the
//                       query, key, value, output and their gradients are
//                       sharded by sequence: rank r holds the r-th block of
//                       consecutive tokens of every batch element (blocks of
//                       any sizes, in rank order; T r / P .. T (r+1) / P is
//                       the even split) for the query and output (L) and
//                       for key and value (S): views of the local tokens in
//                       the module's layout. Output dropout is not
//                       available (its masks index tokens globally). Each rank
//                       projects its tokens (all heads, RoPE at the global
//                       positions), an all-to-all hands every rank the whole
//                       sequence of its heads (split as for MHA_PAR_HEADS),
//                       it attends, and an all-to-all brings the context
//                       back to the token owners for W_O. Bit-identical to
//                       one process. The backward gathers the inputs and the
//                       output gradient (the weight gradients sum over every
//                       token in one fixed order), runs its heads' backward
//                       over the whole sequence, and an all-to-all returns
//                       the projections' gradients to the token owners.
//                       Masks (key_padding_mask, attn_mask) and rope_start
//                       are given whole on every rank; RoPE needs L == S.
// Inputs and outputs for MHA_PAR_HEADS[_FAST]: every rank passes the whole
// query/key/value (and masks) and receives the whole output and every
// gradient. Parameter gradients are combined across ranks and every rank
// receives all of them: heads, heads-fast and ulysses compute each rank's
// heads' rows and columns, the rest exactly 0, so the sum is exact; ring
// sums each rank's tokens' terms (MPI_Allreduce).
//   MHA_PAR_RING        ring attention (Liu et al. 2023), forward and
//                       backward, with zigzag balancing: the query/output
//                       and key/value (and their gradients) are sharded by
//                       tokens, rank r holding chunks r and 2P-1-r of the
//                       sequence cut into 2P (mha_mpi_ring_chunks; the
//                       local views hold chunk r's tokens, then chunk
//                       2P-1-r's), so that under a causal mask every rank
//                       computes the same number of score tiles. Each rank
//                       projects its tokens (RoPE at their global
//                       positions); the key/value blocks travel around the
//                       ring (MPI_Isend/Irecv of the next block posted
//                       before the current block's compute, MPI_Testall
//                       between tiles), each rank attending its queries to
//                       the block it holds at the global positions (causal,
//                       windows, ALiBi, soft cap; key padding) and merging
//                       the blocks by log-sum-exp in double; then W_O on its
//                       tokens. The backward passes the blocks around again
//                       with their dK/dV accumulators, which end at their
//                       owners; dQ is summed per rank, the parameter
//                       gradients over the ranks. Within the tolerance rule
//                       (not bit-identical). args.save is supported (the
//                       backward then skips the forward; the state serves
//                       only mha_mpi_backward's ring with the same args).
//                       No attn_mask, bias_kv, zero_attn or dropout; RoPE
//                       needs L == S.
#ifndef MHA_MPI_H
#define MHA_MPI_H

#include <mpi.h>

#include "mha.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum mha_parallel {
    MHA_PAR_HEADS = 0,
    MHA_PAR_HEADS_FAST = 1,
    MHA_PAR_ULYSSES = 2,
    MHA_PAR_RING = 3,
} mha_parallel;

// "heads" / "heads-fast" / "ulysses" / "ring" -> scheme
// (MHA_ERR_UNSUPPORTED otherwise, naming the available ones).
MHA_API MHA_NODISCARD mha_status mha_parallel_from_name(mha_parallel *out, const char *name);
MHA_API const char *mha_parallel_name(mha_parallel p);

// What one rank did in the last call.
typedef struct mha_mpi_stats {
    double seconds;                      // the whole call on this rank
    double comm_seconds;                 // inside MPI calls (communication and waiting)
    double bytes_sent;                   // bytes this rank sent
    double bytes_model;                  // what the scheme's communication model predicts
    int64_t heads;                       // query heads this rank computed
    int64_t kv_head_begin, kv_head_end;  // its KV heads [begin, end)
    // ring: the (64-query, 128-key) score tiles this rank's attention
    // computed (forward and backward each count theirs), and the seconds
    // it waited for the ring's messages after its compute (MPI_Waitall;
    // the rest of comm_seconds is collectives: error agreement, gradient
    // sums). 0 for the other schemes.
    int64_t tiles;
    double wait_seconds;
} mha_mpi_stats;

// Ring attention's zigzag layout: the sequence of T tokens is cut into 2P
// chunks [T c / (2P), T (c + 1) / (2P)); rank r holds chunks r and
// 2P - 1 - r, in that order (start[i], len[i]: their first token and
// length), for the query and output (T = L) and for the key and value
// (T = S).
MHA_API void mha_mpi_ring_chunks(int64_t T, int P, int rank, int64_t start[2], int64_t len[2]);

// The forward of mha_forward (need_weights must be false; training
// dropout allowed: the masks depend on global indices only). out: the
// whole output on every rank (heads, heads-fast) or this rank's tokens
// (ulysses, ring). args.save: ring only. stats may be NULL.
MHA_API MHA_NODISCARD mha_status mha_mpi_forward(MPI_Comm comm, mha_parallel scheme,
                                                 mha_tensor *out, const mha_module *m,
                                                 const mha_forward_args *a,
                                                 mha_mpi_stats *stats);

// The backward of mha_backward (accumulate as there); grad_query/key/value
// and grads may be NULL; every rank receives all of them.
MHA_API MHA_NODISCARD mha_status mha_mpi_backward(
    MPI_Comm comm, mha_parallel scheme, mha_tensor *grad_query, mha_tensor *grad_key,
    mha_tensor *grad_value, mha_module *grads, const mha_module *m, const mha_forward_args *a,
    const mha_tensor *grad_output, bool accumulate, mha_mpi_stats *stats);

// Decoding with a sharded KV cache: each rank's cache holds its share of
// every sequence's past tokens (any share: the keys' global positions are
// not kept, so windows and ALiBi are refused; the soft cap and RoPE work).
// Every rank passes the same new tokens a->query (as mha_forward_cached:
// (T, N, E) or (N, T, E), float32) and receives the whole output out on
// every rank. Each rank projects them (RoPE at the global positions: the
// sequences' lengths summed over the ranks, plus t); rank `owner` appends
// their keys and values to its cache; every rank attends the queries to
// its cache (the owner causally within the chunk, the others to all of
// theirs) keeping each row's max and sum; the partial contexts are
// gathered and merged by log-sum-exp in rank order (in double: every rank
// gets the same bits), then gates and W_O. Within the tolerance rule of
// the single-process forward. On error every rank fails and the owner's
// cache keeps its lengths. The caller picks the owner (say, the rank with
// the fewest tokens, or round-robin) and sizes each cache.
MHA_API MHA_NODISCARD mha_status mha_mpi_forward_cached(MPI_Comm comm, mha_tensor *out,
                                                        const mha_module *m,
                                                        const mha_forward_args *a,
                                                        mha_kv_cache *cache, int owner,
                                                        mha_mpi_stats *stats);

#ifdef __cplusplus
}
#endif

#endif
