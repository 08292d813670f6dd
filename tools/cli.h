// cli.h: helpers shared by the CLI's source files (tools/cli.c), the bottom
// of the CLI: it calls nothing in tools/. Public API only.
#ifndef MHA_CLI_H
#define MHA_CLI_H

#include "mha.h"

// Prints "mha <cmd>: <mha_last_error()>" on stderr; returns 1.
int cli_fail(const char *cmd, mha_status st);
// Wall-clock seconds (monotonic).
double cli_now(void);
// Prints "mha <cmd>: <msg> (see mha <cmd> --help)" on stderr; returns 2.
int cli_usage(const char *cmd, const char *msg);

// The option values' parsers, one per kind, for every command. Each takes
// the whole string or nothing: 0 with *out set, or -1 with *out untouched.
// A decimal integer in [lo, hi] (strtoll base 10: leading white space and
// a sign allowed; no overflow).
int cli_parse_int(int64_t *out, const char *s, int64_t lo, int64_t hi);
// A number as strtod reads it, "inf" and "nan" included (callers check the
// range and whether it must be finite).
int cli_parse_f64(double *out, const char *s);
// "A:B" or "A:" (*end = -1) with integers A, B >= 0.
int cli_parse_range(int64_t *begin, int64_t *end, const char *s);
// A float storage type: "f32", "bf16" or "f16".
int cli_float_dtype(mha_dtype *out, const char *s);

// qsort's comparison of doubles: ascending.
int cli_cmp_double(const void *a, const void *b);

#endif
