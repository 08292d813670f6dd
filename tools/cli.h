// cli.h: helpers shared by the CLI's source files (tools/). Public API only.
#ifndef MHA_CLI_H
#define MHA_CLI_H

#include "mha.h"

// Prints "mha <cmd>: <mha_last_error()>" on stderr; returns 1.
int cli_fail(const char *cmd, mha_status st);
// "f32", "bf16", "f16" -> *out; -1 (out untouched) otherwise.
int cli_float_dtype(const char *s, mha_dtype *out);
// Wall-clock seconds (monotonic).
double cli_now(void);
// Prints "mha <cmd>: <msg> (see mha <cmd> --help)" on stderr; returns 2.
int usage_error(const char *cmd, const char *msg);
// Strict option values: the whole string, base 10. Return 0, else -1 (1 for
// parse_range) with *out untouched.
int parse_i64(const char *s, int64_t *out);
int parse_f64(const char *s, double *out);
// "A:B" or "A:" (end -1) with A, B >= 0.
int parse_range(const char *s, int64_t *begin, int64_t *end);
// qsort's comparison of doubles: ascending.
int cmp_double(const void *a, const void *b);

#endif
