// save_util.h: what the tests of the atomic saves (test_save_atomic.c,
// test_save_full.c) share: a file's bytes, the temporary files left in a
// directory, and a one-tensor safetensors file whose values a seed fixes.
#ifndef MHA_TEST_SAVE_UTIL_H
#define MHA_TEST_SAVE_UTIL_H

#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "check.h"
#include "mha.h"

// The bytes of the file at path (*n of them; malloc'ed, free them), or
// NULL when it cannot be read.
static inline unsigned char *read_all(const char *path, size_t *n) {
    *n = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, len = 0;
    unsigned char *b = malloc(cap);
    for (size_t r; b && (r = fread(b + len, 1, cap - len, f)) > 0;) {
        len += r;
        if (len == cap) {
            unsigned char *nb = realloc(b, cap *= 2);
            if (!nb) free(b);
            b = nb;
        }
    }
    fclose(f);
    *n = len;
    return b;
}

// 1 when the file at path holds exactly the n bytes of want.
static inline int same_bytes(const char *path, const unsigned char *want, size_t n) {
    size_t got_n;
    unsigned char *got = read_all(path, &got_n);
    int same = got && got_n == n && (n == 0 || memcmp(got, want, n) == 0);
    free(got);
    return same;
}

// How many entries of dir (besides . and ..) there are; of them, how many
// are temporary files of a save to `name` (".<name>.tmp.*"), the first one's
// name copied to first (cap bytes) when first is not NULL.
static inline int dir_count(const char *dir, const char *name, int *ntmp, char *first,
                            size_t cap) {
    char prefix[512];
    snprintf(prefix, sizeof prefix, ".%s.tmp.", name ? name : "");
    DIR *d = opendir(dir);
    int n = 0;
    *ntmp = 0;
    if (first && cap) first[0] = '\0';
    if (!d) return -1;
    for (struct dirent *e; (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        n++;
        if (name && !strncmp(e->d_name, prefix, strlen(prefix))) {
            if (first && !*ntmp) snprintf(first, cap, "%s", e->d_name);
            ++*ntmp;
        }
    }
    closedir(d);
    return n;
}

// The value of element i of the tensor of seed s.
static inline float pattern(uint64_t s, int64_t i) {
    return (float)((uint64_t)(i * 2654435761u + s * 40503u) % 1000003u) * 0.5f - 7.0f;
}

// Saves a file holding one F32 tensor "t" of n elements (pattern(seed, i)).
static inline mha_status save_tensor(const char *path, int64_t n, uint64_t seed) {
    float *x = malloc(sizeof(float) * (size_t)(n ? n : 1));
    if (!x) return MHA_ERR_NOMEM;
    for (int64_t i = 0; i < n; i++) x[i] = pattern(seed, i);
    mha_st_writer *w = NULL;
    mha_status st = mha_st_writer_create(&w);
    if (!st) st = mha_st_writer_add(w, "t", MHA_F32, 1, &n, x);
    if (!st) st = mha_st_writer_set_metadata(w, "seed", seed & 1 ? "odd" : "even");
    if (!st) st = mha_st_writer_save(w, path);
    mha_st_writer_destroy(w);
    free(x);
    return st;
}

// 1 when path reads back as save_tensor(path, n, seed) wrote it.
static inline int reads_back(const char *path, int64_t n, uint64_t seed) {
    mha_st_file *f = NULL;
    mha_st_tensor t;
    int ok = mha_st_open(&f, path) == MHA_OK && mha_st_find(&t, f, "t") == MHA_OK &&
             t.dtype == MHA_F32 && t.ndim == 1 && t.shape[0] == n;
    float *x = ok ? malloc(sizeof(float) * (size_t)(n ? n : 1)) : NULL;
    if (ok) ok = x && mha_st_read(x, sizeof(float) * (size_t)n, MHA_F32, &t) == MHA_OK;
    for (int64_t i = 0; ok && i < n; i++) ok = x[i] == pattern(seed, i);
    free(x);
    mha_st_close(f);
    return ok;
}

// 1 when the last error names path and contains what.
static inline int error_names(const char *path, const char *what) {
    const char *e = mha_last_error();
    return strstr(e, path) != NULL && strstr(e, what) != NULL;
}

#endif
