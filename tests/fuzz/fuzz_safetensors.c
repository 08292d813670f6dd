// fuzz_safetensors.c: libFuzzer target for the safetensors reader on
// arbitrary bytes (mha_st_parse, the in-memory open).
//
// For every input: a failed parse must return MHA_ERR_FORMAT (never NOMEM:
// inputs are small and allocations do not fail here), leave *out NULL and
// set a one-line message naming the label. A successful parse must
// expose a self-consistent file, checked through the public API only:
//  - every tensor (mha_st_tensor_at): a non-empty name, ndim in range, dims
//    in [0, 2^53), numel = product of dims, nbytes = numel x dtype size;
//    in offset order the tensors tile the data buffer exactly, and their
//    bytes are the input's bytes at those offsets;
//  - mha_st_find by name returns that same tensor; absent names and indices
//    out of range fail with the documented status;
//  - mha_st_read into F32, F64, BF16, F16, BOOL, U8 and the tensor's own
//    dtype, each into a buffer of exactly the size needed (so ASan sees any
//    overrun): the documented conversions succeed, the others fail with
//    MHA_ERR_DTYPE; one byte short always fails; same-dtype reads
//    return the stored bytes; BOOL results are 0/1;
//  - metadata: every entry through mha_st_metadata_at and mha_st_metadata;
//  - the writer round trip: the tensors and metadata written back with
//    mha_st_writer_* to a temporary file and read with mha_st_open give the
//    same names, dtypes, shapes, bytes and metadata.
// A broken invariant prints what broke and aborts (a finding).
// Sizes stay small: every element count is bounded by the input's length.
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mha.h"

#define LABEL "fuzz.safetensors"

static void require(int ok, const char *fmt, ...) {
    if (ok) return;
    va_list ap;
    va_start(ap, fmt);
    fputs("fuzz_safetensors: invariant broken: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}

// A message from a failing call: non-empty, one line.
static void require_message(const char *what) {
    const char *msg = mha_last_error();
    require(msg && msg[0] != '\0', "%s: empty error message", what);
    require(strchr(msg, '\n') == NULL, "%s: multi-line message: %s", what, msg);
}

static int is_float(mha_dtype t) {
    return t == MHA_F32 || t == MHA_F64 || t == MHA_BF16 || t == MHA_F16;
}

// Whether mha_st_read documents the conversion from -> to as allowed.
static int read_allowed(mha_dtype from, mha_dtype to) {
    if (to == MHA_F32 || to == MHA_F64 || to == from) return 1;
    if ((to == MHA_BF16 || to == MHA_F16) && is_float(from)) return 1;
    if ((to == MHA_BOOL || to == MHA_U8) && (from == MHA_BOOL || from == MHA_U8))
        return 1;
    return 0;
}

static void check_reads(const mha_st_tensor *t) {
    static const mha_dtype targets[] = {MHA_F32, MHA_F64, MHA_BF16, MHA_F16,
                                        MHA_BOOL, MHA_U8, MHA_I64, MHA_I32};
    for (size_t k = 0; k < sizeof targets / sizeof targets[0]; k++) {
        const mha_dtype to = targets[k];
        const size_t need = (size_t)t->numel * mha_dtype_size(to);
        unsigned char *dst = malloc(need ? need : 1);
        require(dst != NULL, "out of memory for %zu bytes", need);
        mha_status st = mha_st_read(dst, need, to, t);
        if (read_allowed(t->dtype, to)) {
            require(st == MHA_OK, "read %s -> %s failed: %s",
                    mha_dtype_name(t->dtype), mha_dtype_name(to), mha_last_error());
            if (to == t->dtype && to != MHA_BOOL && need)
                require(memcmp(dst, t->data, need) == 0,
                        "same-dtype read of %s changed the bytes", mha_dtype_name(to));
            if (to == MHA_BOOL)
                for (size_t i = 0; i < need; i++)
                    require(dst[i] <= 1, "BOOL read gave byte %u", dst[i]);
        } else {
            require(st == MHA_ERR_DTYPE, "read %s -> %s: status %s, expected "
                    "MHA_ERR_DTYPE", mha_dtype_name(t->dtype),
                    mha_dtype_name(to), mha_status_string(st));
            require_message("mha_st_read (unsupported)");
        }
        if (need) {
            st = mha_st_read(dst, need - 1, to, t);
            require(st != MHA_OK, "read into %zu of %zu bytes succeeded", need - 1, need);
            require_message("mha_st_read (short buffer)");
        }
        free(dst);
    }
}

// Writes f back with the writer and reads it again: the same content.
static void check_roundtrip(const mha_st_file *f) {
    static char path[256];
    if (!path[0]) {
        const char *dir = getenv("TMPDIR");
        snprintf(path, sizeof path, "%s/mha_fuzz_st_%ld.safetensors",
                 dir && *dir ? dir : "/tmp", (long)getpid());
    }
    mha_st_writer *w = NULL;
    require(mha_st_writer_create(&w) == MHA_OK, "writer_create: %s", mha_last_error());
    const int64_t n = mha_st_num_tensors(f), nm = mha_st_num_metadata(f);
    for (int64_t i = 0; i < n; i++) {
        mha_st_tensor t;
        require(mha_st_tensor_at(&t, f, i) == MHA_OK, "tensor_at(%lld)", (long long)i);
        // (stored little-endian: on a little-endian host these are the
        // native values the writer expects)
        mha_status st = mha_st_writer_add(w, t.name, t.dtype, t.ndim, t.shape, t.data);
        require(st == MHA_OK, "writer_add of a parsed tensor failed: %s", mha_last_error());
    }
    for (int64_t i = 0; i < nm; i++) {
        const char *k, *v;
        require(mha_st_metadata_at(&k, &v, f, i) == MHA_OK, "metadata_at");
        require(mha_st_writer_set_metadata(w, k, v) == MHA_OK,
                "writer_set_metadata of parsed metadata failed: %s", mha_last_error());
    }
    mha_status st = mha_st_writer_save(w, path);
    mha_st_writer_destroy(w);
    if (st == MHA_ERR_IO) return;  // the temporary directory, not the library
    require(st == MHA_OK, "writer_save failed: %s", mha_last_error());
    mha_st_file *g = NULL;
    st = mha_st_open(&g, path);
    remove(path);
    require(st == MHA_OK, "re-reading the written file failed: %s", mha_last_error());
    require(mha_st_num_tensors(g) == n && mha_st_num_metadata(g) == nm,
            "round trip: %lld tensors, %lld metadata became %lld, %lld", (long long)n,
            (long long)nm, (long long)mha_st_num_tensors(g),
            (long long)mha_st_num_metadata(g));
    for (int64_t i = 0; i < n; i++) {
        mha_st_tensor a, b;
        require(mha_st_tensor_at(&a, f, i) == MHA_OK && mha_st_tensor_at(&b, g, i) == MHA_OK,
                "tensor_at in round trip");
        require(strcmp(a.name, b.name) == 0 && a.dtype == b.dtype && a.ndim == b.ndim &&
                    a.numel == b.numel && a.nbytes == b.nbytes &&
                    memcmp(a.shape, b.shape, sizeof(int64_t) * (size_t)a.ndim) == 0 &&
                    (a.nbytes == 0 || memcmp(a.data, b.data, a.nbytes) == 0),
                "round trip changed tensor %lld", (long long)i);
    }
    for (int64_t i = 0; i < nm; i++) {
        const char *k1, *v1, *k2, *v2;
        require(mha_st_metadata_at(&k1, &v1, f, i) == MHA_OK &&
                    mha_st_metadata_at(&k2, &v2, g, i) == MHA_OK,
                "metadata_at in round trip");
        require(strcmp(k1, k2) == 0 && strcmp(v1, v2) == 0,
                "round trip changed metadata entry %lld", (long long)i);
    }
    mha_st_close(g);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    mha_st_file *f = (mha_st_file *)&size;  // must be reset
    mha_status st = mha_st_parse(&f, data, size, LABEL);
    if (st != MHA_OK) {
        require(st < 0, "mha_st_parse returned %d", (int)st);
        // Inputs here are small and allocations do not fail, so NOMEM would
        // be a wrong status (e.g. JSON that cJSON rejects but the reader's
        // own syntax check accepts): the header is FORMAT or nothing.
        require(st == MHA_ERR_FORMAT, "mha_st_parse: %s on %zu bytes (expected "
                "MHA_ERR_FORMAT): %s", mha_status_string(st), size, mha_last_error());
        require(f == NULL, "mha_st_parse failed but left *out set");
        require_message("mha_st_parse");
        require(strstr(mha_last_error(), LABEL) != NULL,
                "message lacks the label: %s", mha_last_error());
        return 0;
    }
    require(size >= 8, "a %zu-byte input parsed", size);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++) hlen |= (uint64_t)data[i] << (8 * i);
    require(hlen <= size - 8, "header length %llu beyond the %zu-byte input",
            (unsigned long long)hlen, size);
    const unsigned char *buf = data + 8 + hlen;  // the input's data buffer
    const size_t buf_len = size - 8 - (size_t)hlen;
    require(strcmp(mha_st_label(f), LABEL) == 0, "label \"%s\"", mha_st_label(f));

    const int64_t n = mha_st_num_tensors(f);
    require(n >= 0, "num_tensors %lld", (long long)n);
    const unsigned char *first = NULL, *next = NULL;
    size_t covered = 0;
    for (int64_t i = 0; i < n; i++) {
        mha_st_tensor t;
        require(mha_st_tensor_at(&t, f, i) == MHA_OK, "tensor_at(%lld): %s", (long long)i,
                mha_last_error());
        require(t.name && t.name[0], "tensor %lld has no name", (long long)i);
        require(strcmp(t.name, "__metadata__") != 0, "a tensor named __metadata__");
        require((unsigned)t.dtype < MHA_DTYPE_COUNT, "dtype %d", (int)t.dtype);
        require(t.ndim >= 0 && t.ndim <= MHA_MAX_DIMS, "ndim %d", t.ndim);
        // (the reader promises the product with zero dims counted as 1 fits
        // int64, so no row-major stride overflows)
        int64_t numel = 1, span = 1;
        for (int d = 0; d < t.ndim; d++) {
            require(t.shape[d] >= 0 && t.shape[d] < ((int64_t)1 << 53), "dim %lld",
                    (long long)t.shape[d]);
            require(!__builtin_mul_overflow(span, t.shape[d] ? t.shape[d] : 1, &span),
                    "tensor %lld: the dims overflow int64", (long long)i);
            numel = t.shape[d] == 0 ? 0 : numel * t.shape[d];
        }
        require(numel <= (int64_t)size, "numel %lld beyond the input's size",
                (long long)numel);
        require(t.numel == numel, "numel %lld, dims give %lld", (long long)t.numel,
                (long long)numel);
        require(t.nbytes == (size_t)numel * mha_dtype_size(t.dtype), "nbytes %zu", t.nbytes);
        // Contiguous in offset order, covering the buffer; the input's bytes.
        const unsigned char *p = t.data;
        if (!first) first = next = p;
        require(p == next, "tensor %lld does not start where the previous ends",
                (long long)i);
        const size_t off = (size_t)(p - first);
        require(off + t.nbytes <= buf_len, "tensor %lld beyond the data buffer",
                (long long)i);
        require(t.nbytes == 0 || memcmp(p, buf + off, t.nbytes) == 0,
                "tensor %lld bytes differ from the input", (long long)i);
        next = p + t.nbytes;
        covered += t.nbytes;

        mha_st_tensor u;
        require(mha_st_find(&u, f, t.name) == MHA_OK, "find(own name): %s", mha_last_error());
        require(u.data == t.data && u.dtype == t.dtype && u.nbytes == t.nbytes &&
                    strcmp(u.name, t.name) == 0,
                "find(\"%s\") returned another tensor", t.name);
        check_reads(&t);
    }
    require(covered == buf_len, "tensors cover %zu of %zu data bytes", covered, buf_len);

    mha_st_tensor t;
    require(mha_st_tensor_at(&t, f, -1) == MHA_ERR_INVALID_ARG, "tensor_at(-1)");
    require(mha_st_tensor_at(&t, f, n) == MHA_ERR_INVALID_ARG, "tensor_at(n)");
    require_message("mha_st_tensor_at");
    // Names are valid UTF-8, so "\xff" is never one.
    require(mha_st_find(&t, f, "\xff") == MHA_ERR_NOT_FOUND, "find(\"\\xff\")");
    require_message("mha_st_find");

    const int64_t nm = mha_st_num_metadata(f);
    require(nm >= 0, "num_metadata %lld", (long long)nm);
    for (int64_t i = 0; i < nm; i++) {
        const char *k = NULL, *v = NULL;
        require(mha_st_metadata_at(&k, &v, f, i) == MHA_OK, "metadata_at(%lld)",
                (long long)i);
        require(k && v, "metadata_at gave NULL");
        const char *w = mha_st_metadata(f, k);
        require(w && strcmp(w, v) == 0, "metadata(\"%s\") disagrees with metadata_at", k);
    }
    const char *k, *v;
    require(mha_st_metadata_at(&k, &v, f, nm) == MHA_ERR_INVALID_ARG, "metadata_at(n)");
    require(mha_st_metadata(f, "\xff") == NULL, "metadata(\"\\xff\")");
    // The keys mha_module_load reads.
    (void)mha_st_metadata(f, "num_heads");
    (void)mha_st_metadata(f, "num_kv_heads");
    (void)mha_st_metadata(f, "pruned_heads");

    check_roundtrip(f);
    mha_st_close(f);
    return 0;
}
