// safetensors_write.c: the safetensors writer (the reader is
// safetensors.c).
//
// mha_st_writer_add copies the data (stored little-endian);
// mha_st_writer_save builds the header with cJSON (integers written as exact
// decimal literals), pads it with spaces to a multiple of 8 and hands the
// length, header and tensors' data to the atomic writer of file.c (a
// temporary file renamed over the target: the old file survives any
// failure).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "file.h"
#include "internal.h"
#include "safetensors.h"

typedef struct st_wtensor {
    char *name;
    mha_dtype dtype;
    int ndim;
    int64_t shape[MHA_MAX_DIMS];
    unsigned char *data;  // (nbytes) little-endian copy
    size_t nbytes;
} st_wtensor;

typedef struct st_wmeta {
    char *key;
    char *value;
} st_wmeta;

struct mha_st_writer {
    st_wtensor *tensors;
    int64_t ntensors, tensors_cap;
    st_wmeta *meta;
    int64_t nmeta, meta_cap;
    uint64_t data_total;  // sum of nbytes, < 2^53
};

mha_status mha_st_writer_create(mha_st_writer **out) {
    if (!out) return mha__fail(MHA_ERR_INVALID_ARG, "mha_st_writer_create: out is NULL");
    *out = mha__calloc(1, sizeof **out);
    if (!*out)
        return mha__fail(MHA_ERR_NOMEM, "mha_st_writer_create: out of memory (%zu bytes)",
                         sizeof **out);
    return MHA_OK;
}

void mha_st_writer_destroy(mha_st_writer *w) {
    if (!w) return;
    for (int64_t i = 0; i < w->ntensors; i++) {
        free(w->tensors[i].name);
        free(w->tensors[i].data);
    }
    for (int64_t i = 0; i < w->nmeta; i++) {
        free(w->meta[i].key);
        free(w->meta[i].value);
    }
    free(w->tensors);
    free(w->meta);
    free(w);
}

// Room for one more element after count: arr itself, or a larger copy of
// it (then *cap is updated), or NULL on out of memory (arr still valid).
static void *grow(void *arr, int64_t *cap, int64_t count, size_t elem) {
    if (count < *cap) return arr;
    int64_t ncap = *cap ? *cap * 2 : 8;
    size_t bytes;
    if (mha__mul_overflow_size((size_t)ncap, elem, &bytes)) return NULL;
    void *p = mha__realloc(arr, bytes);
    if (p) *cap = ncap;
    return p;
}

mha_status mha_st_writer_add(mha_st_writer *w, const char *name, mha_dtype dtype, int ndim,
                             const int64_t *shape, const void *data) {
    if (!w || !name) return mha__fail(MHA_ERR_INVALID_ARG, "mha_st_writer_add: NULL argument");
    char q[QUOTE_CAP];
    mha_escape(q, sizeof q, name);
    size_t ok = mha__st_utf8_valid_prefix(name);
    if (name[0] == '\0' || name[ok] != '\0' || strcmp(name, "__metadata__") == 0)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_st_writer_add: tensor name %s is empty, not "
                         "valid UTF-8 or reserved",
                         q);
    size_t esize = mha_dtype_size(dtype);
    if (!esize)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_st_writer_add: tensor %s: invalid dtype %d",
                         q, (int)dtype);
    if (ndim < 0 || ndim > MHA_MAX_DIMS || (ndim > 0 && !shape))
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_st_writer_add: tensor %s: ndim %d not in [0, "
                         "%d] (or shape NULL)",
                         q, ndim, MHA_MAX_DIMS);
    char sb[256];
    mha__shape_str(sb, sizeof sb, ndim, shape);
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "mha_st_writer_add: tensor %s: shape %s has a "
                             "negative dim",
                             q, sb);
        if ((uint64_t)shape[i] >= ST_INT_LIMIT_U)
            return mha__fail(MHA_ERR_OVERFLOW,
                             "mha_st_writer_add: tensor %s: shape %s has a "
                             "dim >= 2^53",
                             q, sb);
    }
    int64_t numel;
    size_t nbytes;
    uint64_t total = w->data_total;
    if (mha__st_shape_numel(&numel, ndim, shape) || (uint64_t)numel > SIZE_MAX ||
        mha__mul_overflow_size((size_t)numel, esize, &nbytes) ||
        (uint64_t)nbytes >= ST_INT_LIMIT_U - total)
        return mha__fail(MHA_ERR_OVERFLOW,
                         "mha_st_writer_add: tensor %s: shape %s x %s "
                         "overflows the size types",
                         q, sb, mha_dtype_name(dtype));
    if (nbytes && !data)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_st_writer_add: tensor %s: data is NULL", q);
    for (int64_t i = 0; i < w->ntensors; i++)
        if (strcmp(w->tensors[i].name, name) == 0)
            return mha__fail(MHA_ERR_INVALID_ARG, "mha_st_writer_add: tensor %s added twice", q);

    st_wtensor *grown = grow(w->tensors, &w->tensors_cap, w->ntensors, sizeof *w->tensors);
    if (!grown)
        return mha__fail(MHA_ERR_NOMEM,
                         "mha_st_writer_add: tensor %s: out of memory growing "
                         "the list of %lld tensors",
                         q, (long long)w->ntensors);
    w->tensors = grown;
    st_wtensor *t = &w->tensors[w->ntensors];
    memset(t, 0, sizeof *t);
    t->name = mha__st_str_dup(name);
    t->data = mha__malloc(nbytes ? nbytes : 1);
    if (!t->name || !t->data) {
        free(t->name);
        free(t->data);
        return mha__fail(MHA_ERR_NOMEM,
                         "mha_st_writer_add: tensor %s: out of memory for "
                         "%zu bytes",
                         q, nbytes);
    }
    if (nbytes) memcpy(t->data, data, nbytes);
    if (!mha__st_host_is_le() && esize > 1) {
        for (size_t i = 0; i < (size_t)numel; i++) {
            unsigned char *e = t->data + i * esize;
            for (size_t a = 0, b = esize - 1; a < b; a++, b--) {
                unsigned char c = e[a];
                e[a] = e[b];
                e[b] = c;
            }
        }
    }
    t->dtype = dtype;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    t->nbytes = nbytes;
    w->ntensors++;
    w->data_total = total + nbytes;
    return MHA_OK;
}

mha_status mha_st_writer_set_metadata(mha_st_writer *w, const char *key, const char *value) {
    if (!w || !key || !value)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_st_writer_set_metadata: NULL argument");
    char q[QUOTE_CAP];
    if (key[mha__st_utf8_valid_prefix(key)] || value[mha__st_utf8_valid_prefix(value)])
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_st_writer_set_metadata: key %s or its value is "
                         "not valid UTF-8",
                         mha_escape(q, sizeof q, key));
    char *v = mha__st_str_dup(value);
    if (!v)
        return mha__fail(MHA_ERR_NOMEM,
                         "mha_st_writer_set_metadata: key %s: out of memory "
                         "for a %zu-byte value",
                         mha_escape(q, sizeof q, key), strlen(value) + 1);
    for (int64_t i = 0; i < w->nmeta; i++) {
        if (strcmp(w->meta[i].key, key) == 0) {
            free(w->meta[i].value);
            w->meta[i].value = v;
            return MHA_OK;
        }
    }
    char *k = mha__st_str_dup(key);
    st_wmeta *grown = grow(w->meta, &w->meta_cap, w->nmeta, sizeof *w->meta);
    if (grown) w->meta = grown;
    if (!k || !grown) {
        free(k);
        free(v);
        return mha__fail(MHA_ERR_NOMEM,
                         "mha_st_writer_set_metadata: key %s: out of memory "
                         "adding entry %lld",
                         mha_escape(q, sizeof q, key), (long long)w->nmeta + 1);
    }
    w->meta[w->nmeta++] = (st_wmeta){k, v};
    return MHA_OK;
}

// Appends an exact decimal integer literal (cJSON would print large doubles
// in exponent form) to arr. 0 on out of memory.
static int add_int(cJSON *arr, uint64_t v) {
    char buf[32];
    snprintf(buf, sizeof buf, "%llu", (unsigned long long)v);
    cJSON *item = cJSON_CreateRaw(buf);
    if (!item) return 0;
    cJSON_AddItemToArray(arr, item);
    return 1;
}

// The header JSON (NULL on out of memory); free with cJSON_free.
static char *build_header(const mha_st_writer *w) {
    cJSON *root = cJSON_CreateObject();
    if (!root) return NULL;
    if (w->nmeta) {
        cJSON *m = cJSON_AddObjectToObject(root, "__metadata__");
        if (!m) goto fail;
        for (int64_t i = 0; i < w->nmeta; i++)
            if (!cJSON_AddStringToObject(m, w->meta[i].key, w->meta[i].value)) goto fail;
    }
    uint64_t at = 0;
    for (int64_t i = 0; i < w->ntensors; i++) {
        const st_wtensor *t = &w->tensors[i];
        cJSON *e = cJSON_AddObjectToObject(root, t->name);
        if (!e || !cJSON_AddStringToObject(e, "dtype", mha_dtype_name(t->dtype))) goto fail;
        cJSON *shape = cJSON_AddArrayToObject(e, "shape");
        if (!shape) goto fail;
        for (int d = 0; d < t->ndim; d++)
            if (!add_int(shape, (uint64_t)t->shape[d])) goto fail;
        cJSON *off = cJSON_AddArrayToObject(e, "data_offsets");
        if (!off || !add_int(off, at) || !add_int(off, at + t->nbytes)) goto fail;
        at += t->nbytes;
    }
    char *text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return text;
fail:
    cJSON_Delete(root);
    return NULL;
}

mha_status mha_st_writer_save(const mha_st_writer *w, const char *path) {
    if (!w || !path)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_st_writer_save: NULL argument");
    char *text = build_header(w);
    if (!text)
        return mha__fail(MHA_ERR_NOMEM,
                         "%s: out of memory building the header (%lld "
                         "tensors, %lld metadata entries)",
                         path, (long long)w->ntensors, (long long)w->nmeta);
    size_t n = strlen(text);
    size_t padded = (n + 7) & ~(size_t)7;
    if (padded > MHA_ST_MAX_HEADER) {
        cJSON_free(text);
        return mha__fail(MHA_ERR_INVALID_ARG, "%s: header of %zu bytes exceeds the limit of %u",
                         path, padded, MHA_ST_MAX_HEADER);
    }
    // the pieces: length, header, padding, then every tensor's data
    mha__file_part *parts = mha__malloc(sizeof *parts * (size_t)(w->ntensors + 3));
    if (!parts) {
        cJSON_free(text);
        return mha__fail(MHA_ERR_NOMEM, "%s: out of memory listing %lld tensors to write",
                         path, (long long)w->ntensors);
    }
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)padded >> (8 * i));
    static const char spaces[8] = {' ', ' ', ' ', ' ', ' ', ' ', ' ', ' '};
    parts[0] = (mha__file_part){len8, 8};
    parts[1] = (mha__file_part){text, n};
    parts[2] = (mha__file_part){spaces, padded - n};
    for (int64_t i = 0; i < w->ntensors; i++)
        parts[3 + i] = (mha__file_part){w->tensors[i].data, w->tensors[i].nbytes};
    mha_status st = mha__file_write_parts(path, parts, w->ntensors + 3);
    free(parts);
    cJSON_free(text);
    return st;
}
