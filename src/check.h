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
// Window bounds, soft cap and (custom_scale) scale; who names the caller.
mha_status mha__check_attn_opts(const char *who, int64_t window_left, int64_t window_right,
                                float softcap, bool custom_scale, double scale);

#endif
