// test_safetensors.c: the safetensors reader and writer.
//
// Round trips (every dtype, F16/BF16 conversions, a 0-d scalar, zero-size
// tensors, metadata) through a file; then one malformed file per class,
// built in memory and fed to mha_st_parse, each of which must fail with the
// right status and a message naming the source (the label).
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "mha.h"

#define LABEL "bad.safetensors"

static char g_tmpdir[512];

static const char *tmp_path(char *buf, size_t cap, const char *name) {
    snprintf(buf, cap, "%s/%s", g_tmpdir, name);
    return buf;
}

// A file image: 8-byte LE length of header, header, data. Caller frees.
static unsigned char *make_file(size_t *len, const char *header, const void *data,
                                size_t data_len) {
    size_t n = strlen(header);
    *len = 8 + n + data_len;
    unsigned char *b = malloc(*len ? *len : 1);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)n >> (8 * i));
    memcpy(b + 8, header, n);
    if (data_len) memcpy(b + 8 + n, data, data_len);
    return b;
}

// Parses header + data_len zero bytes; checks the status and the message.
static void expect_bad(int line, const char *header, size_t data_len, mha_status want,
                       const char *must_contain) {
    unsigned char zeros[256] = {0};
    size_t len;
    unsigned char *b = make_file(&len, header, zeros, data_len);
    mha_st_file *f = (mha_st_file *)&len;  // must be reset to NULL
    mha_status st = mha_st_parse(&f, b, len, LABEL);
    const char *msg = mha_last_error();
    CHECKF(st == want, "line %d: %s (want %s): %s\n  header: %s", line, mha_status_string(st),
           mha_status_string(want), msg, header);
    CHECKF(f == NULL, "line %d: out not NULL on failure", line);
    CHECKF(msg[0] != '\0' && strstr(msg, LABEL) != NULL,
           "line %d: message lacks the label: \"%s\"", line, msg);
    CHECKF(strchr(msg, '\n') == NULL, "line %d: multi-line message", line);
    if (must_contain)
        CHECKF(strstr(msg, must_contain) != NULL, "line %d: message \"%s\" lacks \"%s\"", line,
               msg, must_contain);
    if (st == MHA_OK) mha_st_close(f);
    free(b);
}

#define BAD(header, data_len, want) expect_bad(__LINE__, header, data_len, want, NULL)
#define BADM(header, data_len, want, text) expect_bad(__LINE__, header, data_len, want, text)

// A valid file must parse.
static void expect_good(int line, const char *header, size_t data_len) {
    unsigned char zeros[256] = {0};
    size_t len;
    unsigned char *b = make_file(&len, header, zeros, data_len);
    mha_st_file *f = NULL;
    mha_status st = mha_st_parse(&f, b, len, "good.safetensors");
    CHECKF(st == MHA_OK, "line %d: %s: %s\n  header: %s", line, mha_status_string(st),
           mha_last_error(), header);
    mha_st_close(f);
    free(b);
}

#define GOOD(header, data_len) expect_good(__LINE__, header, data_len)

static void test_roundtrip(void) {
    float f32[6] = {1.5f, -2.25f, 0.0f, 3.0e-8f, 65504.0f, -1.0e30f};
    double f64[3] = {1.0 / 3.0, -1e300, 0.5};
    int64_t i64[3] = {-9007199254740993LL, 0, INT64_MAX};
    int32_t i32[4] = {INT32_MIN, -1, 0, 123456789};
    uint8_t u8[5] = {0, 1, 2, 255, 7};
    uint8_t b8[4] = {1, 0, 0, 1};
    float halfs[5] = {1.0f, -0.5f, 65504.0f, 0.0f, 0.099975586f};
    uint16_t f16[5], bf16[5];
    for (int i = 0; i < 5; i++) {
        f16[i] = mha_f32_to_f16(halfs[i]);
        bf16[i] = mha_f32_to_bf16(halfs[i]);
    }
    float scalar = 42.0f;

    mha_st_writer *w = NULL;
    CHECK_OK(mha_st_writer_create(&w));
    if (!w) return;
    const int64_t s23[2] = {2, 3}, s3[1] = {3}, s4[1] = {4}, s5[1] = {5};
    const int64_t s14[2] = {1, 5}, s22[2] = {2, 2}, s03[2] = {0, 3};
    CHECK_OK(mha_st_writer_add(w, "f32", MHA_F32, 2, s23, f32));
    CHECK_OK(mha_st_writer_add(w, "f64", MHA_F64, 1, s3, f64));
    CHECK_OK(mha_st_writer_add(w, "i64", MHA_I64, 1, s3, i64));
    CHECK_OK(mha_st_writer_add(w, "empty", MHA_F32, 2, s03, NULL));
    CHECK_OK(mha_st_writer_add(w, "i32", MHA_I32, 1, s4, i32));
    CHECK_OK(mha_st_writer_add(w, "u8", MHA_U8, 1, s5, u8));
    CHECK_OK(mha_st_writer_add(w, "bool", MHA_BOOL, 2, s22, b8));
    CHECK_OK(mha_st_writer_add(w, "f16", MHA_F16, 2, s14, f16));
    CHECK_OK(mha_st_writer_add(w, "bf16", MHA_BF16, 1, s5, bf16));
    CHECK_OK(mha_st_writer_add(w, "scalar", MHA_F32, 0, NULL, &scalar));
    CHECK_OK(mha_st_writer_add(w, "caf\xc3\xa9 \"q\"", MHA_U8, 1, s5, u8));
    CHECK_OK(mha_st_writer_set_metadata(w, "num_heads", "3"));
    CHECK_OK(mha_st_writer_set_metadata(w, "format", "pt"));
    CHECK_OK(mha_st_writer_set_metadata(w, "num_heads", "2"));  // replaces

    // Writer misuse.
    CHECK_FAILS(mha_st_writer_add(w, "f32", MHA_F32, 1, s3, f32), MHA_ERR_INVALID_ARG);
    CHECK_FAILS(mha_st_writer_add(w, "x", (mha_dtype)99, 1, s3, f32), MHA_ERR_INVALID_ARG);
    const int64_t s9[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    CHECK_FAILS(mha_st_writer_add(w, "x", MHA_F32, 9, s9, f32), MHA_ERR_INVALID_ARG);
    const int64_t sneg[2] = {2, -3};
    CHECK_FAILS(mha_st_writer_add(w, "x", MHA_F32, 2, sneg, f32), MHA_ERR_INVALID_ARG);
    const int64_t sbig[3] = {4294967296LL, 4294967296LL, 16};
    CHECK_FAILS(mha_st_writer_add(w, "x", MHA_F32, 3, sbig, f32), MHA_ERR_OVERFLOW);
    CHECK_FAILS(mha_st_writer_add(w, "", MHA_F32, 1, s3, f32), MHA_ERR_INVALID_ARG);
    CHECK_FAILS(mha_st_writer_add(w, "__metadata__", MHA_F32, 1, s3, f32), MHA_ERR_INVALID_ARG);
    CHECK_FAILS(mha_st_writer_add(w, "x", MHA_F32, 1, s3, NULL), MHA_ERR_INVALID_ARG);

    char path[1024];
    tmp_path(path, sizeof path, "test_safetensors_rt.safetensors");
    CHECK_OK(mha_st_writer_save(w, path));
    mha_st_writer_destroy(w);

    // The header is padded with spaces to a multiple of 8.
    FILE *fp = fopen(path, "rb");
    CHECK(fp != NULL);
    if (fp) {
        unsigned char len8[8];
        CHECK(fread(len8, 1, 8, fp) == 8);
        uint64_t n = 0;
        for (int i = 0; i < 8; i++) n |= (uint64_t)len8[i] << (8 * i);
        CHECKF(n % 8 == 0, "header length %llu", (unsigned long long)n);
        char *h = malloc(n + 1);
        CHECK(fread(h, 1, n, fp) == n);
        h[n] = '\0';
        CHECK(h[0] == '{');
        CHECK(strchr(h, '}') != NULL);
        for (const char *c = strrchr(h, '}') + 1; *c; c++) CHECK(*c == ' ');
        free(h);
        fclose(fp);
    }

    mha_st_file *f = NULL;
    CHECK_OK(mha_st_open(&f, path));
    if (!f) return;
    CHECK(mha_st_num_tensors(f) == 11);
    CHECK(mha_st_num_metadata(f) == 2);
    CHECK(mha_st_metadata(f, "num_heads") && strcmp(mha_st_metadata(f, "num_heads"), "2") == 0);
    CHECK(mha_st_metadata(f, "format") && strcmp(mha_st_metadata(f, "format"), "pt") == 0);
    CHECK(mha_st_metadata(f, "nope") == NULL);
    const char *k = NULL, *v = NULL;
    CHECK_OK(mha_st_metadata_at(&k, &v, f, 0));
    CHECK(k && v && strcmp(k, "num_heads") == 0 && strcmp(v, "2") == 0);
    CHECK_FAILS(mha_st_metadata_at(&k, &v, f, 2), MHA_ERR_INVALID_ARG);

    // Exposed in data-offset order, which is the order added; offsets
    // increase and each tensor starts where the previous ended.
    const char *order[11] = {"f32",
                             "f64",
                             "i64",
                             "empty",
                             "i32",
                             "u8",
                             "bool",
                             "f16",
                             "bf16",
                             "scalar",
                             "caf\xc3\xa9 \"q\""};
    const unsigned char *prev_end = NULL;
    for (int64_t i = 0; i < 11; i++) {
        mha_st_tensor t;
        CHECK_OK(mha_st_tensor_at(&t, f, i));
        CHECKF(strcmp(t.name, order[i]) == 0, "tensor %lld is %s", (long long)i, t.name);
        if (prev_end) CHECK((const unsigned char *)t.data == prev_end);
        prev_end = (const unsigned char *)t.data + t.nbytes;
    }
    mha_st_tensor t;
    CHECK_FAILS(mha_st_tensor_at(&t, f, 11), MHA_ERR_INVALID_ARG);
    CHECK_FAILS(mha_st_tensor_at(&t, f, -1), MHA_ERR_INVALID_ARG);

    // F32: exact.
    CHECK_OK(mha_st_find(&t, f, "f32"));
    CHECK(t.dtype == MHA_F32 && t.ndim == 2 && t.shape[0] == 2 && t.shape[1] == 3 &&
          t.numel == 6 && t.nbytes == 24);
    float g32[6];
    CHECK_OK(mha_st_read(g32, sizeof g32, MHA_F32, &t));
    CHECK(memcmp(g32, f32, sizeof f32) == 0);
    double g64[6];
    CHECK_OK(mha_st_read(g64, sizeof g64, MHA_F64, &t));
    for (int i = 0; i < 6; i++) CHECK(g64[i] == (double)f32[i]);
    CHECK_FAILS(mha_st_read(g32, sizeof g32 - 1, MHA_F32, &t), MHA_ERR_INVALID_ARG);
    int64_t gi64[6];
    CHECK_FAILS(mha_st_read(gi64, sizeof gi64, MHA_I64, &t), MHA_ERR_DTYPE);
    uint8_t gb[8];
    CHECK_FAILS(mha_st_read(gb, sizeof gb, MHA_BOOL, &t), MHA_ERR_DTYPE);

    // F64
    CHECK_OK(mha_st_find(&t, f, "f64"));
    CHECK(t.dtype == MHA_F64 && t.numel == 3);
    CHECK_OK(mha_st_read(g64, sizeof g64, MHA_F64, &t));
    CHECK(memcmp(g64, f64, sizeof f64) == 0);
    CHECK_OK(mha_st_read(g32, sizeof g32, MHA_F32, &t));
    CHECK(g32[0] == (float)(1.0 / 3.0) && g32[2] == 0.5f);
    CHECK(g32[1] < -1e38f);  // -1e300 -> -inf

    // I64
    CHECK_OK(mha_st_find(&t, f, "i64"));
    CHECK(t.dtype == MHA_I64);
    CHECK_OK(mha_st_read(gi64, sizeof gi64, MHA_I64, &t));
    CHECK(memcmp(gi64, i64, sizeof i64) == 0);
    CHECK_OK(mha_st_read(g64, sizeof g64, MHA_F64, &t));
    CHECK(g64[0] == (double)i64[0] && g64[1] == 0.0);
    CHECK_FAILS(mha_st_read(gi64, sizeof gi64, MHA_I32, &t), MHA_ERR_DTYPE);

    // Zero-size tensor: found, zero bytes, reads into a NULL dst.
    CHECK_OK(mha_st_find(&t, f, "empty"));
    CHECK(t.numel == 0 && t.nbytes == 0 && t.ndim == 2 && t.shape[0] == 0 && t.shape[1] == 3);
    CHECK_OK(mha_st_read(NULL, 0, MHA_F32, &t));

    // I32
    CHECK_OK(mha_st_find(&t, f, "i32"));
    int32_t gi32[4];
    CHECK_OK(mha_st_read(gi32, sizeof gi32, MHA_I32, &t));
    CHECK(memcmp(gi32, i32, sizeof i32) == 0);
    CHECK_OK(mha_st_read(g32, sizeof g32, MHA_F32, &t));
    CHECK(g32[0] == -2147483648.0f && g32[1] == -1.0f && g32[3] == 123456792.0f);

    // U8: same dtype is a plain copy; to BOOL nonzero -> 1.
    CHECK_OK(mha_st_find(&t, f, "u8"));
    uint8_t gu8[5];
    CHECK_OK(mha_st_read(gu8, sizeof gu8, MHA_U8, &t));
    CHECK(memcmp(gu8, u8, 5) == 0);
    CHECK_OK(mha_st_read(gu8, sizeof gu8, MHA_BOOL, &t));
    CHECK(gu8[0] == 0 && gu8[1] == 1 && gu8[2] == 1 && gu8[3] == 1 && gu8[4] == 1);
    CHECK_OK(mha_st_read(g32, sizeof g32, MHA_F32, &t));
    CHECK(g32[3] == 255.0f && g32[4] == 7.0f);

    // BOOL
    CHECK_OK(mha_st_find(&t, f, "bool"));
    CHECK(t.dtype == MHA_BOOL && t.numel == 4);
    CHECK_OK(mha_st_read(gb, sizeof gb, MHA_BOOL, &t));
    CHECK(memcmp(gb, b8, 4) == 0);
    CHECK_OK(mha_st_read(gb, sizeof gb, MHA_U8, &t));
    CHECK(memcmp(gb, b8, 4) == 0);
    CHECK_OK(mha_st_read(g32, sizeof g32, MHA_F32, &t));
    CHECK(g32[0] == 1.0f && g32[1] == 0.0f && g32[3] == 1.0f);

    // F16 / BF16 -> F32
    CHECK_OK(mha_st_find(&t, f, "f16"));
    CHECK(t.dtype == MHA_F16 && t.ndim == 2 && t.nbytes == 10);
    CHECK_OK(mha_st_read(g32, sizeof g32, MHA_F32, &t));
    for (int i = 0; i < 5; i++)
        CHECKF(g32[i] == mha_f16_to_f32(f16[i]), "f16[%d] = %g", i, (double)g32[i]);
    CHECK(g32[0] == 1.0f && g32[1] == -0.5f && g32[2] == 65504.0f);
    uint16_t g16[5];
    CHECK_OK(mha_st_read(g16, sizeof g16, MHA_F16, &t));
    CHECK(memcmp(g16, f16, sizeof f16) == 0);
    CHECK_OK(mha_st_read(g64, sizeof g64, MHA_F64, &t));
    CHECK(g64[1] == -0.5);
    CHECK_OK(mha_st_find(&t, f, "bf16"));
    CHECK(t.dtype == MHA_BF16);
    CHECK_OK(mha_st_read(g32, sizeof g32, MHA_F32, &t));
    for (int i = 0; i < 5; i++)
        CHECKF(g32[i] == mha_bf16_to_f32(bf16[i]), "bf16[%d] = %g", i, (double)g32[i]);
    CHECK(g32[0] == 1.0f && g32[1] == -0.5f && g32[2] == 65536.0f);
    // bf16 -> f16 goes through float32 (nearest even): 65536 overflows f16
    CHECK_OK(mha_st_read(g16, sizeof g16, MHA_F16, &t));
    for (int i = 0; i < 5; i++)
        CHECKF(g16[i] == mha_f32_to_f16(mha_bf16_to_f32(bf16[i])), "bf16->f16[%d] = %04x", i,
               (unsigned)g16[i]);
    CHECK(g16[0] == 0x3c00 && g16[2] == 0x7c00);
    // integers and bools do not convert to a half type
    CHECK_OK(mha_st_find(&t, f, "i64"));
    CHECK_FAILS(mha_st_read(g16, sizeof g16, MHA_BF16, &t), MHA_ERR_DTYPE);

    // 0-d scalar
    CHECK_OK(mha_st_find(&t, f, "scalar"));
    CHECK(t.ndim == 0 && t.numel == 1 && t.nbytes == 4);
    float gs = 0;
    CHECK_OK(mha_st_read(&gs, sizeof gs, MHA_F32, &t));
    CHECK(gs == 42.0f);

    // A name that needs JSON escaping and is non-ASCII.
    CHECK_OK(mha_st_find(&t, f, "caf\xc3\xa9 \"q\""));

    // Missing name: NOT_FOUND naming the file and the tensor.
    CHECK_FAILS(mha_st_find(&t, f, "missing_tensor"), MHA_ERR_NOT_FOUND);
    CHECK(strstr(mha_last_error(), path) != NULL);
    CHECK(strstr(mha_last_error(), "missing_tensor") != NULL);
    mha_st_close(f);

    // The same bytes through mha_st_parse.
    fp = fopen(path, "rb");
    if (fp) {
        unsigned char buf[4096];
        size_t n = fread(buf, 1, sizeof buf, fp);
        fclose(fp);
        f = NULL;
        CHECK_OK(mha_st_parse(&f, buf, n, "rt"));
        CHECK(mha_st_num_tensors(f) == 11);
        mha_st_close(f);
        // Any truncation of a valid file is an error.
        for (size_t cut = 0; cut < n; cut++) {
            f = NULL;
            mha_status st = mha_st_parse(&f, buf, cut, "cut");
            CHECKF(st == MHA_ERR_FORMAT && f == NULL, "truncated to %zu of %zu bytes: %s", cut,
                   n, mha_status_string(st));
            mha_st_close(f);
        }
    }
    remove(path);
}

// An empty writer gives a valid file with no tensors; metadata only too.
static void test_empty_files(void) {
    char path[1024];
    tmp_path(path, sizeof path, "test_safetensors_empty.safetensors");
    mha_st_writer *w = NULL;
    CHECK_OK(mha_st_writer_create(&w));
    CHECK_OK(mha_st_writer_save(w, path));
    mha_st_file *f = NULL;
    CHECK_OK(mha_st_open(&f, path));
    CHECK(mha_st_num_tensors(f) == 0 && mha_st_num_metadata(f) == 0);
    mha_st_close(f);
    CHECK_OK(mha_st_writer_set_metadata(w, "k", "v"));
    CHECK_OK(mha_st_writer_save(w, path));
    f = NULL;
    CHECK_OK(mha_st_open(&f, path));
    CHECK(mha_st_num_tensors(f) == 0 && mha_st_num_metadata(f) == 1);
    mha_st_close(f);
    mha_st_writer_destroy(w);
    remove(path);

    // Saving into a directory that does not exist: IO, nothing left over.
    w = NULL;
    CHECK_OK(mha_st_writer_create(&w));
    tmp_path(path, sizeof path, "no_such_dir/x.safetensors");
    CHECK_FAILS(mha_st_writer_save(w, path), MHA_ERR_IO);
    CHECK(strstr(mha_last_error(), path) != NULL);
    mha_st_writer_destroy(w);
    mha_st_writer_destroy(NULL);
    mha_st_close(NULL);
}

static void test_open_errors(void) {
    char path[1024];
    mha_st_file *f = NULL;
    tmp_path(path, sizeof path, "test_safetensors_missing.safetensors");
    remove(path);
    CHECK_FAILS(mha_st_open(&f, path), MHA_ERR_IO);
    CHECK(f == NULL);
    CHECK(strstr(mha_last_error(), path) != NULL);
    CHECK_FAILS(mha_st_open(&f, g_tmpdir), MHA_ERR_IO);  // a directory
    CHECK_FAILS(mha_st_open(NULL, path), MHA_ERR_INVALID_ARG);
    CHECK_FAILS(mha_st_parse(&f, NULL, 8, "x"), MHA_ERR_INVALID_ARG);

    // A file on disk with a lying header length: FORMAT naming the path.
    tmp_path(path, sizeof path, "test_safetensors_lying.safetensors");
    FILE *fp = fopen(path, "wb");
    CHECK(fp != NULL);
    if (!fp) return;
    const unsigned char lying[12] = {0xff, 0xff, 0, 0, 0, 0, 0, 0, '{', '}', ' ', ' '};
    CHECK(fwrite(lying, 1, sizeof lying, fp) == sizeof lying);
    fclose(fp);
    CHECK_FAILS(mha_st_open(&f, path), MHA_ERR_FORMAT);
    CHECK(strstr(mha_last_error(), path) != NULL);
    remove(path);
}

static void test_malformed(void) {
    unsigned char b[16] = {0};
    mha_st_file *f = NULL;

    // Shorter than the 8-byte length.
    CHECK_FAILS(mha_st_parse(&f, b, 5, LABEL), MHA_ERR_FORMAT);
    CHECK(strstr(mha_last_error(), LABEL) != NULL);
    CHECK_FAILS(mha_st_parse(&f, b, 0, LABEL), MHA_ERR_FORMAT);
    CHECK(strstr(mha_last_error(), LABEL) != NULL);

    // Header length larger than the file; larger than the cap; huge.
    {
        size_t len;
        unsigned char *img = make_file(&len, "{}      ", NULL, 0);
        img[0] = 64;  // 64 > 8 header bytes present
        CHECK_FAILS(mha_st_parse(&f, img, len, LABEL), MHA_ERR_FORMAT);
        CHECK(strstr(mha_last_error(), LABEL) != NULL);
        CHECK(strstr(mha_last_error(), "64") != NULL);
        uint64_t big = (uint64_t)MHA_ST_MAX_HEADER + 1;
        for (int i = 0; i < 8; i++) img[i] = (unsigned char)(big >> (8 * i));
        CHECK_FAILS(mha_st_parse(&f, img, len, LABEL), MHA_ERR_FORMAT);
        CHECK(strstr(mha_last_error(), "limit") != NULL);
        memset(img, 0xff, 8);
        CHECK_FAILS(mha_st_parse(&f, img, len, LABEL), MHA_ERR_FORMAT);
        CHECK(strstr(mha_last_error(), LABEL) != NULL);
        free(img);
    }

    // A minimal valid file, and valid variations (controls).
    GOOD("{}", 0);
    GOOD("{}       ", 0);
    GOOD("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8);
    GOOD(" {\"a\":{\"shape\":[2],\"data_offsets\":[0,8],\"dtype\":\"F32\"}}\n", 8);
    GOOD("{\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]},"
         "\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
         "\"z\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,4]},"
         "\"__metadata__\":{\"k\":\"v\"}}",
         8);
    GOOD("{\"a\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]}}", 4);
    GOOD("{\"\\u00e9\\ud83d\\ude00\":{\"dtype\":\"BOOL\",\"shape\":[1],"
         "\"data_offsets\":[0,1]}}",
         1);

    // Truncated data: the entry wants [0, 24) but the buffer has 20.
    BADM("{\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}}", 20,
         MHA_ERR_FORMAT, "\"w\"");

    // Header not JSON / JSON but not an object / trailing garbage.
    BAD("{not json}", 0, MHA_ERR_FORMAT);
    BAD("", 0, MHA_ERR_FORMAT);
    BAD("{\"a\":", 0, MHA_ERR_FORMAT);
    BAD("[1, 2, 3]", 0, MHA_ERR_FORMAT);
    BAD("\"str\"", 0, MHA_ERR_FORMAT);
    BAD("42", 0, MHA_ERR_FORMAT);
    BAD("null", 0, MHA_ERR_FORMAT);
    BAD("{} x", 0, MHA_ERR_FORMAT);
    BAD("{}{}", 0, MHA_ERR_FORMAT);
    BAD("{}\x01", 0, MHA_ERR_FORMAT);
    BAD("\xef\xbb\xbf{}", 0, MHA_ERR_FORMAT);  // byte-order mark
    {
        // A NUL byte inside the header.
        size_t len;
        unsigned char *img = make_file(&len, "{}  ", NULL, 0);
        img[8 + 2] = 0;
        CHECK_FAILS(mha_st_parse(&f, img, len, LABEL), MHA_ERR_FORMAT);
        CHECK(strstr(mha_last_error(), LABEL) != NULL);
        free(img);
    }

    // Entry not an object; missing keys; extra keys; repeated keys.
    BAD("{\"a\":3}", 0, MHA_ERR_FORMAT);
    BAD("{\"a\":[]}", 0, MHA_ERR_FORMAT);
    BAD("{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, MHA_ERR_FORMAT);
    BAD("{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, MHA_ERR_FORMAT);
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, MHA_ERR_FORMAT);
    BADM("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],"
         "\"extra\":1}}",
         4, MHA_ERR_FORMAT, "extra");
    BAD("{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],"
        "\"data_offsets\":[0,4]}}",
        4, MHA_ERR_FORMAT);

    // dtype: unknown, not a string, wrong case.
    BADM("{\"a\":{\"dtype\":\"F8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, MHA_ERR_FORMAT,
         "F8");
    BAD("{\"a\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, MHA_ERR_FORMAT);
    BAD("{\"a\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, MHA_ERR_FORMAT);
    BAD("{\"a\":{\"dtype\":null,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, MHA_ERR_FORMAT);

    // shape: not an array, negative, fractional, not a number, too many
    // dims, too large for a double to hold exactly.
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":4,\"data_offsets\":[0,16]}}", 16, MHA_ERR_FORMAT);
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":{},\"data_offsets\":[0,0]}}", 0, MHA_ERR_FORMAT);
    BADM("{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,0]}}", 0,
         MHA_ERR_FORMAT, "-1");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[-0],\"data_offsets\":[0,0]}}", 0, MHA_ERR_FORMAT);
    BADM("{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],"
         "\"data_offsets\":[0,4]}}",
         4, MHA_ERR_FORMAT, "1.5");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[\"2\"],"
        "\"data_offsets\":[0,8]}}",
        8, MHA_ERR_FORMAT);
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[[2]],\"data_offsets\":[0,8]}}", 8, MHA_ERR_FORMAT);
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1e400],"
        "\"data_offsets\":[0,8]}}",
        8, MHA_ERR_FORMAT);
    BADM("{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],"
         "\"data_offsets\":[0,1]}}",
         1, MHA_ERR_FORMAT, "9 dims");
    GOOD("{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1],"
         "\"data_offsets\":[0,1]}}",
         1);
    BAD("{\"a\":{\"dtype\":\"U8\",\"shape\":[9007199254740992,0],"
        "\"data_offsets\":[0,0]}}",
        0, MHA_ERR_FORMAT);

    // data_offsets: wrong length, begin > end, not integers, negative.
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4, MHA_ERR_FORMAT);
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 8, MHA_ERR_FORMAT);
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[]}}", 4, MHA_ERR_FORMAT);
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":4}}", 4, MHA_ERR_FORMAT);
    BADM("{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,4]}}", 8, MHA_ERR_FORMAT,
         "[8, 4]");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4.5]}}", 8, MHA_ERR_FORMAT);
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 8, MHA_ERR_FORMAT);
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[\"0\",4]}}", 4,
        MHA_ERR_FORMAT);

    // Offsets past the end of the buffer.
    BADM("{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 8,
         MHA_ERR_FORMAT, "past the end");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[12,12]}}", 8, MHA_ERR_FORMAT);

    // Overlapping, gap, not starting at 0, trailing bytes, no tensors but
    // data.
    BADM("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
         12, MHA_ERR_FORMAT, "overlap");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
        "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
        8, MHA_ERR_FORMAT);
    BADM("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
         12, MHA_ERR_FORMAT, "no tensor");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, MHA_ERR_FORMAT);
    BADM("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8, MHA_ERR_FORMAT,
         "trailing");
    BAD("{}", 4, MHA_ERR_FORMAT);

    // shape x dtype size != end - begin (message with the values).
    BADM("{\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,20]}}", 20,
         MHA_ERR_FORMAT, "shape (2, 3) x F32 = 24 bytes");
    BAD("{\"w\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[0,16]}}", 16, MHA_ERR_FORMAT);
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,0]}}", 0, MHA_ERR_FORMAT);

    // Dims whose product overflows int64 / size_t, also with a zero dim.
    BADM("{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,16],"
         "\"data_offsets\":[0,0]}}",
         0, MHA_ERR_FORMAT, "overflow");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],"
        "\"data_offsets\":[0,0]}}",
        0, MHA_ERR_FORMAT);
    BAD("{\"w\":{\"dtype\":\"F64\",\"shape\":[2305843009213693952],"
        "\"data_offsets\":[0,0]}}",
        0, MHA_ERR_FORMAT);
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,0,4294967296],"
        "\"data_offsets\":[0,0]}}",
        0, MHA_ERR_FORMAT);

    // Duplicate names (cJSON keeps both), including via an escape.
    BADM("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
         8, MHA_ERR_FORMAT, "twice");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
        "\"\\u0061\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
        8, MHA_ERR_FORMAT);

    // Names: invalid UTF-8 (stray byte, overlong, surrogate, truncated,
    // above U+10FFFF), empty, a \u0000 escape, a lone surrogate escape.
    const char *bad_names[] = {"\xff",
                               "a\x80",
                               "\xc0\xaf",
                               "\xe0\x80\xaf",
                               "\xed\xa0\x80",
                               "\xe2\x82",
                               "\xf4\x90\x80\x80",
                               "\xf8\x88\x80\x80\x80",
                               "",
                               "a\\u0000b",
                               "\\ud800",
                               "\\udc00x"};
    for (size_t i = 0; i < sizeof bad_names / sizeof *bad_names; i++) {
        char h[256];
        snprintf(h, sizeof h,
                 "{\"%s\":{\"dtype\":\"F32\",\"shape\":[1],"
                 "\"data_offsets\":[0,4]}}",
                 bad_names[i]);
        BAD(h, 4, MHA_ERR_FORMAT);
    }
    GOOD("{\"a\\\\u0000\":{\"dtype\":\"F32\",\"shape\":[1],"
         "\"data_offsets\":[0,4]}}",
         4);  // an escaped backslash then "u0000": fine

    // __metadata__: not an object, a non-string value, twice, duplicate
    // keys, invalid UTF-8.
    BAD("{\"__metadata__\":\"x\"}", 0, MHA_ERR_FORMAT);
    BAD("{\"__metadata__\":[]}", 0, MHA_ERR_FORMAT);
    BADM("{\"__metadata__\":{\"a\":\"1\",\"b\":2}}", 0, MHA_ERR_FORMAT, "\"b\"");
    BAD("{\"__metadata__\":{\"a\":null}}", 0, MHA_ERR_FORMAT);
    BAD("{\"__metadata__\":{\"a\":{}}}", 0, MHA_ERR_FORMAT);
    BAD("{\"__metadata__\":{},\"__metadata__\":{}}", 0, MHA_ERR_FORMAT);
    BAD("{\"__metadata__\":{\"a\":\"1\",\"a\":\"2\"}}", 0, MHA_ERR_FORMAT);
    BAD("{\"__metadata__\":{\"a\":\"\xff\"}}", 0, MHA_ERR_FORMAT);
    BAD("{\"__metadata__\":{\"\xc0\x80\":\"x\"}}", 0, MHA_ERR_FORMAT);
    GOOD("{\"__metadata__\":{}}", 0);
}

// Messages about names stay on one line and are cut when long.
static void test_messages(void) {
    char h[3000];
    char name[2100];
    memset(name, 'n', 2000);
    name[2000] = '\0';
    snprintf(h, sizeof h,
             "{\"%s\\n\":{\"dtype\":\"F32\",\"shape\":[1],"
             "\"data_offsets\":[0,4]}}",
             name);
    BAD(h, 0, MHA_ERR_FORMAT);
    CHECK(strlen(mha_last_error()) < 400);
}

// A module file from a stranger: k/v_proj_weight with zero rows hold no
// bytes whatever their column count, which mha_module_load takes as kdim /
// vdim. It must refuse them (MHA_ERR_SHAPE, naming the tensor) before it
// sizes the module, not allocate (Ekv, 2^40) floats first (found by
// tests/fuzz fuzz_forward: 4 GiB allocated for a 724-byte file).
static void test_module_load_bounds(void) {
    static const char *fmt =
        "{\"__metadata__\":{\"num_heads\":\"2\"%s},"
        "\"q_proj_weight\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[0,64]},"
        "\"k_proj_weight\":{\"dtype\":\"F32\",\"shape\":[%s],\"data_offsets\":[64,%d]},"
        "\"v_proj_weight\":{\"dtype\":\"F32\",\"shape\":[%s],\"data_offsets\":[%d,%d]},"
        "\"out_proj.weight\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[%d,%d]}}";
    static const struct {
        const char *meta, *k, *v;  // meta: more __metadata__
        int kbytes, vbytes;
        mha_status want;
        const char *text;
    } cases[] = {
        {"", "4,3", "4,5", 48, 80, MHA_OK, NULL},  // control: kdim 3, vdim 5
        {",\"num_kv_heads\":\"2\"", "0,1099511627776", "4,5", 0, 80, MHA_ERR_SHAPE,
         "k_proj_weight has shape (0, 1099511627776), expected (4, kdim)"},
        // (num_kv_heads from k_proj_weight's rows: 2)
        {"", "4,3", "0,1099511627776", 48, 0, MHA_ERR_SHAPE,
         "v_proj_weight has shape (0, 1099511627776), expected (4, vdim)"},
        {",\"num_kv_heads\":\"1\"", "4,3", "4,5", 48, 80, MHA_ERR_SHAPE,
         "k_proj_weight has shape (4, 3), expected (2, kdim) (num_kv_heads 1"},
    };
    unsigned char zeros[256] = {0};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char header[1024];
        const int k1 = 64 + cases[i].kbytes, v1 = k1 + cases[i].vbytes;
        snprintf(header, sizeof header, fmt, cases[i].meta, cases[i].k, k1, cases[i].v, k1, v1,
                 v1, v1 + 64);
        size_t len;
        unsigned char *b = make_file(&len, header, zeros, (size_t)v1 + 64);
        mha_st_file *f = NULL;
        CHECK_OK(mha_st_parse(&f, b, len, "module.safetensors"));
        mha_module *m = NULL;
        mha_status st = f ? mha_module_load(&m, f, NULL) : MHA_ERR_FORMAT;
        CHECKF(st == cases[i].want, "case %zu: %s (want %s): %s", i, mha_status_string(st),
               mha_status_string(cases[i].want), mha_last_error());
        if (cases[i].text)
            CHECKF(strstr(mha_last_error(), cases[i].text) != NULL &&
                       strstr(mha_last_error(), "module.safetensors") != NULL,
                   "case %zu: message \"%s\" lacks \"%s\"", i, mha_last_error(), cases[i].text);
        mha_module_destroy(m);
        mha_st_close(f);
        free(b);
    }
}

int main(void) {
    const char *t = getenv("MHA_TEST_TMPDIR");
    snprintf(g_tmpdir, sizeof g_tmpdir, "%s", t && *t ? t : "/tmp");
    test_roundtrip();
    test_empty_files();
    test_open_errors();
    test_malformed();
    test_messages();
    test_module_load_bounds();
    return check_summary("test_safetensors");
}
