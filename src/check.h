// check.h: the argument checks shared by the entry points (check.c). Base
// layer: depends on internal.h only.
#ifndef MHA_CHECK_H
#define MHA_CHECK_H

#include <stdbool.h>

#include "internal.h"

// impl is one of the mha_impl values.
mha_status mha__check_impl(mha_impl impl);
// A float view (MHA_F32, MHA_F64, MHA_BF16 or MHA_F16): valid dims, no
// overflow, data present (name in messages).
mha_status mha__check_float(const mha_tensor *t, const char *name);
// A mask view: valid, of dtype BOOL, U8, F32 or F64.
mha_status mha__check_mask_dtype(const mha_tensor *t, const char *name);
// An output view of exactly the shape `want`.
mha_status mha__check_output(const mha_tensor *t, const char *name, const mha_shape *want);
// out must not overlap in (either may be NULL or empty).
mha_status mha__check_no_overlap(const mha_tensor *out, const char *oname,
                                 const mha_tensor *in, const char *iname);
// The last dim of t (its features) must be `want`, the module's `what`.
mha_status mha__check_features(const mha_tensor *t, const char *name, const char *what,
                               int64_t want);
// The attention options (mha_attn_opts): window bounds (-1 or >= 0), soft
// cap (>= 0, finite), scale (finite), dropout_p in [0, 1), sink_tokens >= 0,
// and what the caller refuses (MHA__REFUSE_*, or-ed) unset; who names the
// caller. ALiBi slopes and sinks are checked where their count is known.
enum {
    MHA__REFUSE_SINKS = 1,        // opts.sinks (the module's are a parameter)
    MHA__REFUSE_DROPOUT = 2,      // opts.dropout_p
    MHA__REFUSE_SINK_TOKENS = 4,  // opts.sink_tokens (caches only)
};
mha_status mha__check_attn_opts(const char *who, const mha_attn_opts *o, unsigned refuse);

#endif
