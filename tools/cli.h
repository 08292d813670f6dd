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
// cli_usage with a printf format.
int cli_usagef(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// Like cli_fail but returns 2: an option's value that the library's
// parser refused (mha_impl_from_name, ...), or a configuration the options
// alone describe that it refused.
int cli_bad_value(const char *cmd, mha_status st);

// The exit status convention of every command (cmd.h): 0 success, 1 a
// failure while running (a file not found, the library failing), 2 a usage
// error (an unknown or incomplete option, a bad value, a missing or
// unexpected argument); the message names the option and the value.

struct option;
// For getopt_long's '?' (every command sets opterr = 0 and an empty short
// option string): names what is wrong with the option it stopped at, from
// optind, optopt and the command's table opts: unknown option "--foo",
// --embed-dim needs a value, --no-bias takes no value, ambiguous option
// "--num" (--num-heads, --num-kv-heads). Returns 2.
int cli_bad_option(const char *cmd, char *const *argv, const struct option *opts);
// "mha <cmd>: unexpected argument "ARG"" (a positional argument the
// command does not take). Returns 2.
int cli_unexpected(const char *cmd, const char *arg);
// A decimal integer option value in [lo, hi] (cli_parse_int), else "mha
// <cmd>: <opt> needs an integer >= lo, got "S"" (or "in [lo, hi]"):
// returns 0 with *out set, or 2.
int cli_int_option(int64_t *out, const char *cmd, const char *opt, const char *s, int64_t lo,
                   int64_t hi);

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
