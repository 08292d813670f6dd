// check.h: the tiny test harness every C test uses. CHECK records a failure
// (with file, line and the expression) and carries on; the test's main
// returns check_summary(), which prints "N passed, M failed" and is non-zero
// when anything failed. No test exits 0 after a failed check.
#ifndef MHA_TEST_CHECK_H
#define MHA_TEST_CHECK_H

#include <math.h>
#include <stdio.h>

static int check_passed_, check_failed_;

#define CHECK(cond)                                                        \
    do {                                                                   \
        if (cond) {                                                        \
            check_passed_++;                                               \
        } else {                                                           \
            check_failed_++;                                               \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, \
                    #cond);                                                \
        }                                                                  \
    } while (0)

// CHECK with a printf-style explanation printed on failure.
#define CHECKF(cond, ...)                                                  \
    do {                                                                   \
        if (cond) {                                                        \
            check_passed_++;                                               \
        } else {                                                           \
            check_failed_++;                                               \
            fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, \
                    #cond);                                                \
            fprintf(stderr, __VA_ARGS__);                                  \
            fputc('\n', stderr);                                           \
        }                                                                  \
    } while (0)

// A call that must succeed; prints mha_last_error() otherwise.
#define CHECK_OK(call)                                                     \
    do {                                                                   \
        mha_status st_ = (call);                                           \
        CHECKF(st_ == MHA_OK, "%s -> %s: %s", #call,                       \
               mha_status_string(st_), mha_last_error());                  \
    } while (0)

// A call that must fail with the given status and a non-empty message.
#define CHECK_FAILS(call, status)                                          \
    do {                                                                   \
        mha_status st_ = (call);                                           \
        CHECKF(st_ == (status) && mha_last_error()[0] != '\0',             \
               "%s -> %s (want %s): %s", #call, mha_status_string(st_),    \
               mha_status_string(status), mha_last_error());               \
    } while (0)

static inline int check_summary(const char *name) {
    printf("%s: %d passed, %d failed\n", name, check_passed_, check_failed_);
    return check_failed_ ? 1 : 0;
}

#endif
