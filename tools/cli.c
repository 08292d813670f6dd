// cli.c: the helpers every command of the CLI shares (cli.h): the error
// and usage messages, the clock, the strict parsers of option values.
// Public API only.
#include <errno.h>
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
