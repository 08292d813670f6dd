// cli.c: the helpers every command of the CLI shares (cli.h): the error
// and usage messages, the clock, the strict parsers of option values.
// Public API only.
#include <errno.h>
#include <getopt.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"

int cli_fail(const char *cmd, mha_status st) {
    fprintf(stderr, "mha %s: %s\n", cmd,
            mha_last_error()[0] ? mha_last_error() : mha_status_string(st));
    return 1;
}

double cli_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int cli_usage(const char *cmd, const char *msg) {
    fprintf(stderr, "mha %s: %s (see mha %s --help)\n", cmd, msg, cmd);
    return 2;
}

int cli_usagef(const char *cmd, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return cli_usage(cmd, msg);
}

int cli_bad_value(const char *cmd, mha_status st) {
    cli_fail(cmd, st);
    return 2;
}

// An argument as the messages quote it (mha_escape: in double quotes,
// escaped, cut to fit).
static const char *quoted(char *buf, size_t n, const char *s) {
    return mha_escape(buf, n, s ? s : "");
}

int cli_bad_option(const char *cmd, char *const *argv, const struct option *opts) {
    char q[96];
    // getopt_long has stepped past the option it refused (optind - 1),
    // unless that was a short option inside a group ("-xy": optopt, optind
    // still on the group)
    const char *arg = optind >= 1 ? argv[optind - 1] : NULL;
    if (arg && !strncmp(arg, "--", 2) && arg[2]) {
        const char *name = arg + 2, *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        const struct option *match = NULL;
        int prefixes = 0;
        char cands[256] = "";
        for (const struct option *o = opts; o->name; o++) {
            if (strncmp(o->name, name, len)) continue;
            if (strlen(o->name) == len) {  // exact
                match = o;
                prefixes = 1;
                break;
            }
            match = o;
            prefixes++;
            size_t used = strlen(cands);
            snprintf(cands + used, sizeof cands - used, "%s--%s", used ? ", " : "", o->name);
        }
        // (optopt: the option's own val when getopt_long knew it, else 0)
        if (prefixes == 1 && (optopt == 0 || optopt == match->val)) {
            if (match->has_arg == required_argument && !eq)
                return cli_usagef(cmd, "--%s needs a value", match->name);
            if (match->has_arg == no_argument && eq)
                return cli_usagef(cmd, "--%s takes no value, got %s", match->name,
                                  quoted(q, sizeof q, eq + 1));
        } else if (prefixes > 1 && optopt == 0) {
            return cli_usagef(cmd, "ambiguous option %s (%s)", quoted(q, sizeof q, arg), cands);
        }
        if (optopt == 0) return cli_usagef(cmd, "unknown option %s", quoted(q, sizeof q, arg));
    }
    if (optopt > 0 && optopt < 128 && optopt != '?')
        return cli_usagef(cmd, "unknown option \"-%c\" (options are --name)", optopt);
    return cli_usagef(cmd, "unknown option %s", quoted(q, sizeof q, arg));
}

int cli_unexpected(const char *cmd, const char *arg) {
    char q[96];
    return cli_usagef(cmd, "unexpected argument %s", quoted(q, sizeof q, arg));
}

int cli_int_option(int64_t *out, const char *cmd, const char *opt, const char *s, int64_t lo,
                   int64_t hi) {
    if (!cli_parse_int(out, s, lo, hi)) return 0;
    char q[96];
    if (hi == INT64_MAX)
        return cli_usagef(cmd, "%s needs an integer >= %lld, got %s", opt, (long long)lo,
                          quoted(q, sizeof q, s));
    return cli_usagef(cmd, "%s needs an integer in [%lld, %lld], got %s", opt, (long long)lo,
                      (long long)hi, quoted(q, sizeof q, s));
}

// Strict option values: the whole string or nothing (cli.h).
int cli_parse_int(int64_t *out, const char *s, int64_t lo, int64_t hi) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

int cli_parse_f64(double *out, const char *s) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end) return -1;
    *out = v;
    return 0;
}

int cli_float_dtype(mha_dtype *out, const char *s) {
    if (!strcmp(s, "f32")) *out = MHA_F32;
    else if (!strcmp(s, "bf16")) *out = MHA_BF16;
    else if (!strcmp(s, "f16")) *out = MHA_F16;
    else return -1;
    return 0;
}

// "A:B" or "A:" (end -1) with A, B >= 0.
int cli_parse_range(int64_t *begin, int64_t *end, const char *s) {
    const char *colon = strchr(s, ':');
    if (!colon || colon == s) return -1;
    char first[32];
    size_t n = (size_t)(colon - s);
    if (n >= sizeof first) return -1;
    memcpy(first, s, n);
    first[n] = '\0';
    int64_t b, e = -1;
    if (cli_parse_int(&b, first, 0, INT64_MAX)) return -1;
    if (colon[1] != '\0' && cli_parse_int(&e, colon + 1, 0, INT64_MAX)) return -1;
    *begin = b;
    *end = e;
    return 0;
}

// qsort's comparison of doubles: ascending.
int cli_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
