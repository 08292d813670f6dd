// error.h: the error message of examples/embed (error.c). Every embed_*
// function that can fail returns 0, or -1 after embed_fail stored a
// one-line message naming the problem and the values; nothing in
// examples/embed prints or exits.
#ifndef EMBED_ERROR_H
#define EMBED_ERROR_H

// The message of the last failed embed_* call on this thread ("" if none).
const char *embed_last_error(void);
// Stores the printf-formatted message; returns -1.
int embed_fail(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

#endif
