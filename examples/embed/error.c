// error.c: the thread's last error message of examples/embed (error.h).
#include "error.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char last_error[512];

const char *embed_last_error(void) { return last_error; }

int embed_fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return -1;
}
