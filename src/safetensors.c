// safetensors.c: a strict reader of safetensors files
// (https://github.com/huggingface/safetensors, "Format"). The writer is
// safetensors_write.c; the checks of the header's bytes, of each entry and
// of "__metadata__" are safetensors_check.c; safetensors.h is what the three
// share.
//
// Layout: 8-byte little-endian header length n, n bytes of JSON header
// (padded with trailing spaces), then the data buffer. Each header entry is
// {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]} with offsets
// relative to the data buffer; "__metadata__" is an optional string map.
//
// Reader. mha_st_open reads the whole file into one allocation (no mmap, no
// lazy loading); mha_st_parse copies caller bytes into one. The JSON header
// is parsed by cJSON; the reader only checks what cJSON returns, plus three
// byte-level rules cJSON does not enforce (no byte-order mark, no raw control
// bytes, no \u0000 escape, which cJSON would silently cut a string at).
// Everything is validated before anything is exposed, and nothing is
// allocated from a size read out of the file before it is checked against
// the file's real size. Checked, each with a message naming the file, the
// tensor and the values:
//  - header length: <= MHA_ST_MAX_HEADER and <= file size - 8;
//  - the header: one JSON object followed only by whitespace;
//  - each entry: an object with exactly "dtype" (a known name), "shape" (at
//    most MHA_MAX_DIMS integers) and "data_offsets" (two integers,
//    begin <= end); integers are JSON numbers holding an exact non-negative
//    integer below 2^53 (checked by value, as cJSON stores doubles: 2.0 and
//    2e0 read as 2);
//  - numel x dtype size == end - begin, with every product overflow-checked
//    (dims of size 0 count as 1 there, so no shape's strides overflow);
//  - sorted by offset, tensors are contiguous, non-overlapping and cover
//    the data buffer exactly (zero-size tensors are allowed anywhere);
//  - names: non-empty, valid UTF-8 (no overlong forms, no surrogates), no
//    duplicates; "__metadata__" at most once, an object of strings, no
//    duplicate keys, keys and values valid UTF-8.
// What it does not check: the tensor data itself (NaNs, BOOL bytes other
// than 0/1 - mha_st_read maps nonzero to 1).
//
// Tensors are exposed sorted by data offset; names and metadata live in one
// string table owned by the file. mha_st_find and mha_st_metadata binary
// search a name-sorted index.
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "internal.h"
#include "safetensors.h"

// ---------------------------------------------------------------------------
// Small helpers

int mha__st_host_is_le(void) {
    const uint16_t one = 1;
    unsigned char b;
    memcpy(&b, &one, 1);
    return b == 1;
}

static uint16_t ld_le16(const unsigned char *p) {
    return (uint16_t)(p[0] | (uint16_t)p[1] << 8);
}

static uint32_t ld_le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t ld_le64(const unsigned char *p) {
    return (uint64_t)ld_le32(p) | (uint64_t)ld_le32(p + 4) << 32;
}

char *mha__st_str_dup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = mha__malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

// ---------------------------------------------------------------------------
// Reader

typedef struct st_meta {
    const char *key;
    const char *value;
} st_meta;

typedef struct st_name_index {
    const char *name;
    int64_t index;
} st_name_index;

struct mha_st_file {
    char *label;           // path or caller's label, for messages
    unsigned char *bytes;  // the whole file: 8 + header + data
    size_t len;
    int64_t ntensors;
    mha_st_tensor *tensors;  // (ntensors) sorted by data offset
    st_name_index *by_name;  // (ntensors) sorted by name
    int64_t nmeta;
    st_meta *meta;         // (nmeta) in header order
    st_meta *meta_by_key;  // (nmeta) sorted by key
    char *strings;         // every name, key and value, NUL-terminated
};

static int cmp_entry_offset(const void *pa, const void *pb) {
    const st_entry *a = pa, *b = pb;
    if (a->begin != b->begin) return a->begin < b->begin ? -1 : 1;
    if (a->end != b->end) return a->end < b->end ? -1 : 1;
    return (a->order > b->order) - (a->order < b->order);
}

static int cmp_name_index(const void *pa, const void *pb) {
    const st_name_index *a = pa, *b = pb;
    int c = strcmp(a->name, b->name);
    if (c) return c;
    return (a->index > b->index) - (a->index < b->index);
}

static int cmp_meta_key(const void *pa, const void *pb) {
    const st_meta *a = pa, *b = pb;
    int c = strcmp(a->key, b->key);
    if (c) return c;
    return (a->value > b->value) - (a->value < b->value);
}

void mha_st_close(mha_st_file *f) {
    if (!f) return;
    free(f->label);
    free(f->bytes);
    free(f->tensors);
    free(f->by_name);
    free(f->meta);
    free(f->meta_by_key);
    free(f->strings);
    free(f);
}

// The length field: *hlen, the JSON header's length, within the limit and
// the file.
static mha_status st_header_length(size_t *hlen, const mha_st_file *f) {
    const char *label = f->label;
    if (f->len < 8)
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: file is %zu bytes, too short for the 8-byte "
                         "header length",
                         label, f->len);
    uint64_t n = ld_le64(f->bytes);
    if (n > MHA_ST_MAX_HEADER)
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: header length %llu exceeds the limit of %u "
                         "bytes",
                         label, (unsigned long long)n, MHA_ST_MAX_HEADER);
    if (n > f->len - 8)
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: header length %llu exceeds the %zu bytes after "
                         "the length field (file truncated or not "
                         "safetensors?)",
                         label, (unsigned long long)n, f->len - 8);
    *hlen = (size_t)n;
    return MHA_OK;
}

// The hlen header bytes: the byte-level rules, then cJSON's tree into *root,
// one JSON object followed only by whitespace. On error *root is NULL.
static mha_status st_parse_header(cJSON **root, const unsigned char *header, size_t hlen,
                                  const char *label) {
    *root = NULL;
    mha_status st = mha__st_check_header_bytes(header, hlen, label);
    if (st) return st;

    const char *end = NULL;
    cJSON *r = cJSON_ParseWithLengthOpts((const char *)header, hlen, &end, 0);
    if (!r) {
        // cJSON says NULL for both; valid JSON means memory ran out
        if (mha__st_json_value_valid(header, hlen))
            return mha__fail(MHA_ERR_NOMEM,
                             "%s: out of memory parsing the header (%zu "
                             "bytes of JSON)",
                             label, hlen);
        size_t at = end ? (size_t)(end - (const char *)header) : 0;
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: header (%zu bytes) is not valid JSON: parse "
                         "error at byte %zu",
                         label, hlen, at);
    }
    char vb[64];
    for (size_t i = (size_t)(end - (const char *)header); i < hlen; i++) {
        unsigned char c = header[i];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') {
            cJSON_Delete(r);
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: header byte %zu: unexpected 0x%02x after "
                             "the JSON value (only whitespace may follow)",
                             label, i, c);
        }
    }
    if (!cJSON_IsObject(r)) {
        st = mha__fail(MHA_ERR_FORMAT, "%s: header is %s, not a JSON object", label,
                       mha__st_json_describe(vb, sizeof vb, r));
        cJSON_Delete(r);
        return st;
    }
    *root = r;
    return MHA_OK;
}

// What st_load builds from the parsed header: counts, then the tables,
// owned by st_load until st_build_tables hands them to the file.
typedef struct st_tables {
    const cJSON *meta_json;  // "__metadata__", or NULL
    int64_t ntensors, nmeta;
    size_t strings_len;           // every name, key and value, with its NUL
    st_entry *entries;            // (ntensors + 1) header order, then by offset
    st_name_index *by_name;       // (ntensors + 1)
    st_meta *meta, *meta_by_key;  // (nmeta + 1)
    char *strings;                // (strings_len + 1)
} st_tables;

// Counts tensors, finds (and checks) __metadata__, sizes the string table.
static mha_status st_count(st_tables *t, const cJSON *root, const char *label) {
    const cJSON *meta_json = NULL;
    int64_t ntensors = 0;
    size_t strings_len = 0;
    for (const cJSON *it = root->child; it; it = it->next) {
        if (strcmp(it->string, "__metadata__") == 0) {
            if (meta_json)
                return mha__fail(MHA_ERR_FORMAT, "%s: \"__metadata__\" appears twice", label);
            meta_json = it;
            mha_status st = mha__st_check_metadata(it, label);
            if (st) return st;
            for (const cJSON *k = it->child; k; k = k->next)
                strings_len += strlen(k->string) + strlen(k->valuestring) + 2;
            continue;
        }
        ntensors++;
        strings_len += strlen(it->string) + 1;
    }
    t->meta_json = meta_json;
    t->ntensors = ntensors;
    t->strings_len = strings_len;
    t->nmeta = meta_json ? cJSON_GetArraySize(meta_json) : 0;
    return MHA_OK;
}

// Every count is bounded by the parsed header (<= 100 MiB).
static mha_status st_alloc_tables(st_tables *t, const char *label) {
    t->entries = mha__calloc((size_t)t->ntensors + 1, sizeof *t->entries);
    t->by_name = mha__calloc((size_t)t->ntensors + 1, sizeof *t->by_name);
    t->meta = mha__calloc((size_t)t->nmeta + 1, sizeof *t->meta);
    t->meta_by_key = mha__calloc((size_t)t->nmeta + 1, sizeof *t->meta_by_key);
    t->strings = mha__malloc(t->strings_len + 1);
    if (!t->entries || !t->by_name || !t->meta || !t->meta_by_key || !t->strings)
        return mha__fail(MHA_ERR_NOMEM, "%s: out of memory for %lld tensor entries", label,
                         (long long)t->ntensors);
    return MHA_OK;
}

// Checks every entry (mha__st_check_entry), then that no name appears twice
// (cJSON keeps repeated keys).
static mha_status st_check_entries(st_tables *t, const cJSON *root, const char *label,
                                   size_t data_len) {
    int64_t k = 0;
    for (const cJSON *it = root->child; it; it = it->next) {
        if (it == t->meta_json) continue;
        st_entry *e = &t->entries[k];
        e->name = it->string;
        e->order = k++;
        mha_status st = mha__st_check_entry(e, it, label, data_len);
        if (st) return st;
    }

    char qa[QUOTE_CAP];
    st_name_index *by_name = t->by_name;
    for (int64_t i = 0; i < t->ntensors; i++)
        by_name[i] = (st_name_index){t->entries[i].name, i};
    qsort(by_name, (size_t)t->ntensors, sizeof *by_name, cmp_name_index);
    for (int64_t i = 1; i < t->ntensors; i++) {
        if (strcmp(by_name[i - 1].name, by_name[i].name) == 0)
            return mha__fail(MHA_ERR_FORMAT, "%s: tensor name %s appears twice", label,
                             mha_escape(qa, sizeof qa, by_name[i].name));
    }
    return MHA_OK;
}

// Layout: sorted by offset, the tensors tile [0, data_len) exactly.
static mha_status st_check_layout(st_tables *t, const char *label, size_t data_len) {
    char qa[QUOTE_CAP], qb[QUOTE_CAP];
    st_entry *entries = t->entries;
    qsort(entries, (size_t)t->ntensors, sizeof *entries, cmp_entry_offset);
    uint64_t at = 0;
    for (int64_t i = 0; i < t->ntensors; i++) {
        const st_entry *e = &entries[i];
        if (e->begin < at) {
            const st_entry *p = &entries[i - 1];
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: tensors %s [%llu, %llu] and %s [%llu, %llu] "
                             "overlap",
                             label, mha_escape(qa, sizeof qa, p->name),
                             (unsigned long long)p->begin, (unsigned long long)p->end,
                             mha_escape(qb, sizeof qb, e->name), (unsigned long long)e->begin,
                             (unsigned long long)e->end);
        }
        if (e->begin > at)
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: data bytes [%llu, %llu) belong to no tensor "
                             "(tensor %s begins at %llu)",
                             label, (unsigned long long)at, (unsigned long long)e->begin,
                             mha_escape(qa, sizeof qa, e->name), (unsigned long long)e->begin);
        at = e->end;
    }
    if (at != (uint64_t)data_len)
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: the tensors cover %llu bytes but the data buffer "
                         "is %zu bytes (%llu trailing bytes belong to no "
                         "tensor)",
                         label, (unsigned long long)at, data_len,
                         (unsigned long long)((uint64_t)data_len - at));
    return MHA_OK;
}

// Metadata keys must be unique for mha_st_metadata to mean anything.
static mha_status st_check_meta_keys(st_tables *t, const char *label) {
    char qa[QUOTE_CAP];
    st_meta *meta_by_key = t->meta_by_key;
    int64_t k = 0;
    if (t->meta_json) {
        for (const cJSON *m = t->meta_json->child; m; m = m->next, k++)
            meta_by_key[k] = (st_meta){m->string, m->valuestring};
        qsort(meta_by_key, (size_t)t->nmeta, sizeof *meta_by_key, cmp_meta_key);
        for (int64_t i = 1; i < t->nmeta; i++) {
            if (strcmp(meta_by_key[i - 1].key, meta_by_key[i].key) == 0)
                return mha__fail(MHA_ERR_FORMAT, "%s: __metadata__ key %s appears twice",
                                 label, mha_escape(qa, sizeof qa, meta_by_key[i].key));
        }
    }
    return MHA_OK;
}

// Valid: copy strings out of the cJSON tree and build the tables; the file
// takes t's by_name, meta, meta_by_key and strings (NULL in t after).
static mha_status st_build_tables(mha_st_file *f, st_tables *t, const unsigned char *data,
                                  const char *label) {
    const int64_t ntensors = t->ntensors, nmeta = t->nmeta;
    st_name_index *by_name = t->by_name;
    st_meta *meta = t->meta, *meta_by_key = t->meta_by_key;
    f->tensors = mha__calloc((size_t)ntensors + 1, sizeof *f->tensors);
    if (!f->tensors)
        return mha__fail(MHA_ERR_NOMEM,
                         "%s: out of memory for %lld tensor descriptors (%zu "
                         "bytes)",
                         label, (long long)ntensors,
                         ((size_t)ntensors + 1) * sizeof *f->tensors);
    char *s = t->strings;
    for (int64_t i = 0; i < ntensors; i++) {
        const st_entry *e = &t->entries[i];
        mha_st_tensor *x = &f->tensors[i];
        size_t len = strlen(e->name) + 1;
        memcpy(s, e->name, len);
        x->name = s;
        s += len;
        x->dtype = e->dtype;
        x->ndim = e->ndim;
        memcpy(x->shape, e->shape, sizeof x->shape);
        x->numel = e->numel;
        x->data = data + e->begin;
        x->nbytes = e->nbytes;
    }
    for (int64_t i = 0; i < ntensors; i++) by_name[i] = (st_name_index){f->tensors[i].name, i};
    qsort(by_name, (size_t)ntensors, sizeof *by_name, cmp_name_index);
    int64_t k = 0;
    if (t->meta_json) {
        for (const cJSON *m = t->meta_json->child; m; m = m->next, k++) {
            size_t kl = strlen(m->string) + 1, vl = strlen(m->valuestring) + 1;
            memcpy(s, m->string, kl);
            memcpy(s + kl, m->valuestring, vl);
            meta[k] = (st_meta){s, s + kl};
            meta_by_key[k] = meta[k];
            s += kl + vl;
        }
        qsort(meta_by_key, (size_t)nmeta, sizeof *meta_by_key, cmp_meta_key);
    }
    f->ntensors = ntensors;
    f->by_name = by_name;
    f->nmeta = nmeta;
    f->meta = meta;
    f->meta_by_key = meta_by_key;
    f->strings = t->strings;
    t->by_name = NULL;
    t->meta = t->meta_by_key = NULL;
    t->strings = NULL;
    return MHA_OK;
}

// Validates f->bytes (f->len bytes) and builds the tables, phase by phase
// (each check in the order above). On error the caller closes f.
static mha_status st_load(mha_st_file *f) {
    const char *label = f->label;
    size_t hlen = 0;
    mha_status st = st_header_length(&hlen, f);
    if (st) return st;
    const unsigned char *header = f->bytes + 8;
    const unsigned char *data = header + hlen;
    size_t data_len = f->len - 8 - hlen;

    cJSON *root;
    if ((st = st_parse_header(&root, header, hlen, label))) return st;
    st_tables t = {0};
    st = st_count(&t, root, label);
    if (!st) st = st_alloc_tables(&t, label);
    if (!st) st = st_check_entries(&t, root, label, data_len);
    if (!st) st = st_check_layout(&t, label, data_len);
    if (!st) st = st_check_meta_keys(&t, label);
    if (!st) st = st_build_tables(f, &t, data, label);
    cJSON_Delete(root);
    free(t.entries);
    free(t.by_name);
    free(t.meta);
    free(t.meta_by_key);
    free(t.strings);
    return st;
}

// Takes ownership of bytes (len bytes, malloc'ed) and validates them.
static mha_status st_open_bytes(mha_st_file **out, unsigned char *bytes, size_t len,
                                const char *label) {
    mha_st_file *f = mha__calloc(1, sizeof *f);
    char *lab = mha__st_str_dup(label);
    if (!f || !lab) {
        free(f);
        free(lab);
        free(bytes);
        return mha__fail(MHA_ERR_NOMEM, "%s: out of memory for the file object (%zu bytes)",
                         label, sizeof *f + strlen(label) + 1);
    }
    f->label = lab;
    f->bytes = bytes;
    f->len = len;
    mha_status st = st_load(f);
    if (st) {
        mha_st_close(f);
        return st;
    }
    *out = f;
    return MHA_OK;
}

mha_status mha_st_parse(mha_st_file **out, const void *bytes, size_t len, const char *label) {
    if (!out) return mha__fail(MHA_ERR_INVALID_ARG, "mha_st_parse: out is NULL");
    *out = NULL;
    if (!label) label = "<memory>";
    if (!bytes && len)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_st_parse: %s: bytes is NULL, len %zu",
                         label, len);
    unsigned char *copy = mha__malloc(len ? len : 1);
    if (!copy) return mha__fail(MHA_ERR_NOMEM, "%s: out of memory for %zu bytes", label, len);
    if (len) memcpy(copy, bytes, len);
    return st_open_bytes(out, copy, len, label);
}

mha_status mha_st_open(mha_st_file **out, const char *path) {
    if (!out) return mha__fail(MHA_ERR_INVALID_ARG, "mha_st_open: out is NULL");
    *out = NULL;
    if (!path) return mha__fail(MHA_ERR_INVALID_ARG, "mha_st_open: path is NULL");
    FILE *fp = fopen(path, "rb");
    if (!fp) return mha__fail(MHA_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(fp), &sb) != 0) {
        int err = errno;
        fclose(fp);
        return mha__fail(MHA_ERR_IO, "%s: cannot stat: %s", path, strerror(err));
    }
    if (!S_ISREG(sb.st_mode)) {
        fclose(fp);
        return mha__fail(MHA_ERR_IO, "%s: not a regular file", path);
    }
    if (sb.st_size < 0 || (uintmax_t)sb.st_size >= (uintmax_t)SIZE_MAX) {
        fclose(fp);
        return mha__fail(MHA_ERR_IO,
                         "%s: file size %lld does not fit in "
                         "memory",
                         path, (long long)sb.st_size);
    }
    size_t len = (size_t)sb.st_size;
    unsigned char *bytes = mha__malloc(len ? len : 1);
    if (!bytes) {
        fclose(fp);
        return mha__fail(MHA_ERR_NOMEM, "%s: out of memory for %zu bytes", path, len);
    }
    size_t got = fread(bytes, 1, len, fp);
    if (got != len) {
        int err = ferror(fp) ? errno : 0;
        fclose(fp);
        free(bytes);
        if (err)
            return mha__fail(MHA_ERR_IO,
                             "%s: read failed after %zu of %zu "
                             "bytes: %s",
                             path, got, len, strerror(err));
        return mha__fail(MHA_ERR_IO,
                         "%s: file shrank while reading (%zu of "
                         "%zu bytes)",
                         path, got, len);
    }
    fclose(fp);  // read-only: nothing to flush
    return st_open_bytes(out, bytes, len, path);
}

int64_t mha_st_num_tensors(const mha_st_file *f) { return f ? f->ntensors : 0; }

mha_status mha_st_tensor_at(mha_st_tensor *out, const mha_st_file *f, int64_t i) {
    if (!out || !f) return mha__fail(MHA_ERR_INVALID_ARG, "mha_st_tensor_at: NULL argument");
    if (i < 0 || i >= f->ntensors)
        return mha__fail(MHA_ERR_INVALID_ARG, "%s: tensor index %lld out of range [0, %lld)",
                         f->label, (long long)i, (long long)f->ntensors);
    *out = f->tensors[i];
    return MHA_OK;
}

mha_status mha_st_find(mha_st_tensor *out, const mha_st_file *f, const char *name) {
    if (!out || !f || !name)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_st_find: NULL argument");
    size_t lo = 0, hi = (size_t)f->ntensors;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(f->by_name[mid].name, name);
        if (c == 0) {
            *out = f->tensors[f->by_name[mid].index];
            return MHA_OK;
        }
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    char q[QUOTE_CAP];
    return mha__fail(MHA_ERR_NOT_FOUND, "%s: no tensor named %s", f->label,
                     mha_escape(q, sizeof q, name));
}

int64_t mha_st_num_metadata(const mha_st_file *f) { return f ? f->nmeta : 0; }

mha_status mha_st_metadata_at(const char **key, const char **value, const mha_st_file *f,
                              int64_t i) {
    if (!f) return mha__fail(MHA_ERR_INVALID_ARG, "mha_st_metadata_at: file is NULL");
    if (i < 0 || i >= f->nmeta)
        return mha__fail(MHA_ERR_INVALID_ARG, "%s: metadata index %lld out of range [0, %lld)",
                         f->label, (long long)i, (long long)f->nmeta);
    if (key) *key = f->meta[i].key;
    if (value) *value = f->meta[i].value;
    return MHA_OK;
}

const char *mha_st_metadata(const mha_st_file *f, const char *key) {
    if (!f || !key) return NULL;
    size_t lo = 0, hi = (size_t)f->nmeta;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(f->meta_by_key[mid].key, key);
        if (c == 0) return f->meta_by_key[mid].value;
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

// ---------------------------------------------------------------------------
// Conversion

// Element p (little-endian, dtype t) as double / as float. The float path
// converts integers directly (no double rounding through double).
static double elem_f64(mha_dtype t, const unsigned char *p) {
    switch (t) {
    case MHA_F32: {
        uint32_t u = ld_le32(p);
        float v;
        memcpy(&v, &u, 4);
        return (double)v;
    }
    case MHA_F16: return (double)mha_f16_to_f32(ld_le16(p));
    case MHA_BF16: return (double)mha_bf16_to_f32(ld_le16(p));
    case MHA_BOOL: return p[0] ? 1.0 : 0.0;
    case MHA_I64: {
        uint64_t u = ld_le64(p);
        int64_t v;
        memcpy(&v, &u, 8);
        return (double)v;
    }
    case MHA_I32: {
        uint32_t u = ld_le32(p);
        int32_t v;
        memcpy(&v, &u, 4);
        return v;
    }
    case MHA_U8: return p[0];
    case MHA_F64: {
        uint64_t u = ld_le64(p);
        double v;
        memcpy(&v, &u, 8);
        return v;
    }
    case MHA_DTYPE_COUNT: break;
    }
    return 0.0;
}

static float elem_f32(mha_dtype t, const unsigned char *p) {
    if (t == MHA_I64) {
        uint64_t u = ld_le64(p);
        int64_t v;
        memcpy(&v, &u, 8);
        return (float)v;
    }
    if (t == MHA_I32) {
        uint32_t u = ld_le32(p);
        int32_t v;
        memcpy(&v, &u, 4);
        return (float)v;
    }
    return (float)elem_f64(t, p);
}

mha_status mha_st_read(void *dst, size_t dst_bytes, mha_dtype to, const mha_st_tensor *t) {
    if (!t) return mha__fail(MHA_ERR_INVALID_ARG, "mha_st_read: tensor is NULL");
    const char *name = t->name ? t->name : "?";
    char q[QUOTE_CAP];
    mha_escape(q, sizeof q, name);
    size_t from_size = mha_dtype_size(t->dtype), to_size = mha_dtype_size(to);
    if (!from_size || !to_size)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_st_read: tensor %s: invalid dtype (%d -> %d)", q, (int)t->dtype,
                         (int)to);
    size_t need, have;
    if (t->numel < 0 || (uint64_t)t->numel > SIZE_MAX ||
        mha__mul_overflow_size((size_t)t->numel, from_size, &have) || have != t->nbytes ||
        mha__mul_overflow_size((size_t)t->numel, to_size, &need))
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_st_read: tensor %s: numel %lld inconsistent "
                         "with nbytes %zu",
                         q, (long long)t->numel, t->nbytes);
    if (need && (!dst || !t->data))
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_st_read: tensor %s: NULL data pointer", q);
    if (dst_bytes < need)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_st_read: tensor %s: dst has %zu bytes, %lld x "
                         "%s needs %zu",
                         q, dst_bytes, (long long)t->numel, mha_dtype_name(to), need);

    const unsigned char *src = t->data;
    unsigned char *out = dst;
    size_t n = (size_t)t->numel;
    int flag_in = t->dtype == MHA_BOOL || t->dtype == MHA_U8;
    int flag_out = to == MHA_BOOL || to == MHA_U8;
    if (to == t->dtype && t->dtype != MHA_BOOL) {
        // Same dtype: bytes as stored, swapped on a big-endian host.
        if (!n) return MHA_OK;
        memcpy(out, src, need);
        if (!mha__st_host_is_le() && to_size > 1) {
            for (size_t i = 0; i < n; i++) {
                unsigned char *e = out + i * to_size;
                for (size_t a = 0, b = to_size - 1; a < b; a++, b--) {
                    unsigned char c = e[a];
                    e[a] = e[b];
                    e[b] = c;
                }
            }
        }
        return MHA_OK;
    }
    if (flag_in && flag_out) {
        for (size_t i = 0; i < n; i++) out[i] = src[i] ? 1 : 0;
        return MHA_OK;
    }
    if (to == MHA_F32) {
        for (size_t i = 0; i < n; i++) {
            float v = elem_f32(t->dtype, src + i * from_size);
            memcpy(out + i * 4, &v, 4);
        }
        return MHA_OK;
    }
    if (to == MHA_F64) {
        for (size_t i = 0; i < n; i++) {
            double v = elem_f64(t->dtype, src + i * from_size);
            memcpy(out + i * 8, &v, 8);
        }
        return MHA_OK;
    }
    const bool from_float = t->dtype == MHA_F32 || t->dtype == MHA_F64 ||
                            t->dtype == MHA_BF16 || t->dtype == MHA_F16;
    if ((to == MHA_BF16 || to == MHA_F16) && from_float) {
        for (size_t i = 0; i < n; i++) {
            const float v = elem_f32(t->dtype, src + i * from_size);
            const uint16_t h = to == MHA_BF16 ? mha_f32_to_bf16(v) : mha_f32_to_f16(v);
            memcpy(out + i * 2, &h, 2);
        }
        return MHA_OK;
    }
    return mha__fail(MHA_ERR_DTYPE,
                     "mha_st_read: tensor %s: cannot convert %s to %s "
                     "(allowed: any to F32/F64, F32/F64/BF16/F16 to BF16/F16, BOOL/U8 "
                     "to BOOL/U8, same dtype)",
                     q, mha_dtype_name(t->dtype), mha_dtype_name(to));
}

const char *mha_st_label(const mha_st_file *f) { return f ? f->label : ""; }
