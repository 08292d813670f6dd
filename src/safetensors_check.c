// safetensors_check.c: the checks of a safetensors header that the reader
// (safetensors.c, st_load) makes before it builds anything: the byte-level
// rules cJSON does not enforce, an allocation-free JSON syntax check (which
// tells an invalid header from cJSON running out of memory), each tensor
// entry and "__metadata__"; and the two checks the writer shares (UTF-8,
// the overflow-checked element count). The rules are listed in the file
// comment of safetensors.c; the layout of the tensors (sorted, contiguous,
// no duplicate names) is checked there. Nothing here allocates.
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "internal.h"
#include "safetensors.h"

// Length of the valid UTF-8 prefix of s (RFC 3629: no overlong forms, no
// surrogates, nothing above U+10FFFF). s is valid iff s[result] == '\0'.
size_t mha__st_utf8_valid_prefix(const char *str) {
    const unsigned char *s = (const unsigned char *)str;
    size_t i = 0;
    while (s[i]) {
        unsigned c = s[i];
        size_t n;
        unsigned lo = 0x80, hi = 0xbf;  // allowed range of the 2nd byte
        if (c < 0x80) {
            i++;
            continue;
        } else if (c >= 0xc2 && c <= 0xdf) {
            n = 2;
        } else if (c >= 0xe0 && c <= 0xef) {
            n = 3;
            if (c == 0xe0) lo = 0xa0;  // overlong
            if (c == 0xed) hi = 0x9f;  // surrogates U+D800..U+DFFF
        } else if (c >= 0xf0 && c <= 0xf4) {
            n = 4;
            if (c == 0xf0) lo = 0x90;  // overlong
            if (c == 0xf4) hi = 0x8f;  // above U+10FFFF
        } else {
            return i;  // 0x80..0xc1 (continuation, overlong lead), 0xf5..
        }
        if (s[i + 1] < lo || s[i + 1] > hi) return i;
        for (size_t k = 2; k < n; k++)
            if (s[i + k] < 0x80 || s[i + k] > 0xbf) return i;
        i += n;
    }
    return i;
}

// What a JSON value is, for messages: the number itself, or its kind.
const char *mha__st_json_describe(char *buf, size_t cap, const cJSON *v) {
    if (!v) return "missing";
    if (cJSON_IsNumber(v)) {
        snprintf(buf, cap, "%.17g", v->valuedouble);
        return buf;
    }
    if (cJSON_IsString(v)) return "a string";
    if (cJSON_IsArray(v)) return "an array";
    if (cJSON_IsObject(v)) return "an object";
    if (cJSON_IsBool(v)) return "a boolean";
    if (cJSON_IsNull(v)) return "null";
    return "an invalid value";
}

// A JSON number holding an exact integer in [0, 2^53): 1 and *out, else 0.
static int json_uint(uint64_t *out, const cJSON *v) {
    if (!cJSON_IsNumber(v)) return 0;
    double d = v->valuedouble;
    if (!(d >= 0.0) || signbit(d) || !(d < ST_INT_LIMIT) || d != floor(d)) return 0;
    *out = (uint64_t)d;
    return 1;
}

// Product of the dims with 0 counted as 1 (so that any row-major stride fits
// in int64) into *span, and the true numel into *numel. 1 on overflow.
int mha__st_shape_numel(int64_t *numel, int ndim, const int64_t *shape) {
    int64_t span = 1;
    int zero = 0;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] == 0) {
            zero = 1;
            continue;
        }
        if (mha__mul_overflow_i64(span, shape[i], &span)) return 1;
    }
    *numel = zero ? 0 : span;
    return 0;
}

// Is dtype name s known? Looked up through mha_dtype_name so that an
// unknown name does not set (and log) a second, label-less error.
static int dtype_lookup(mha_dtype *out, const char *s) {
    for (int t = 0; t < MHA_DTYPE_COUNT; t++) {
        if (strcmp(s, mha_dtype_name((mha_dtype)t)) == 0) {
            *out = (mha_dtype)t;
            return 1;
        }
    }
    return 0;
}

// Checks one header entry (name -> object) into e. data_len bounds offsets.
// A cohesive validator: kept whole (the name, the keys, dtype, shape,
// data_offsets and the size, each check returning its own message, top to
// bottom).
mha_status mha__st_check_entry(st_entry *e, const cJSON *item, const char *label,
                               size_t data_len) {
    char qn[QUOTE_CAP], vb[64];
    const char *name = item->string;
    mha_escape(qn, sizeof qn, name);

    if (name[0] == '\0')
        return mha__fail(MHA_ERR_FORMAT, "%s: a tensor has an empty name", label);
    size_t ok = mha__st_utf8_valid_prefix(name);
    if (name[ok] != '\0')
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: tensor name %s is not valid UTF-8 (bad byte "
                         "0x%02x at offset %zu)",
                         label, qn, (unsigned char)name[ok], ok);
    if (!cJSON_IsObject(item))
        return mha__fail(MHA_ERR_FORMAT, "%s: tensor %s: entry is %s, not an object", label,
                         qn, mha__st_json_describe(vb, sizeof vb, item));

    const cJSON *dtype = NULL, *shape = NULL, *offsets = NULL;
    for (const cJSON *k = item->child; k; k = k->next) {
        const cJSON **slot = NULL;
        if (strcmp(k->string, "dtype") == 0) slot = &dtype;
        else if (strcmp(k->string, "shape") == 0) slot = &shape;
        else if (strcmp(k->string, "data_offsets") == 0) slot = &offsets;
        if (!slot) {
            char qk[QUOTE_CAP];
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: tensor %s: unknown key %s (allowed: dtype, "
                             "shape, data_offsets)",
                             label, qn, mha_escape(qk, sizeof qk, k->string));
        }
        if (*slot)
            return mha__fail(MHA_ERR_FORMAT, "%s: tensor %s: key \"%s\" appears twice", label,
                             qn, k->string);
        *slot = k;
    }
    if (!dtype || !shape || !offsets)
        return mha__fail(MHA_ERR_FORMAT, "%s: tensor %s: missing key \"%s\"", label, qn,
                         !dtype   ? "dtype"
                         : !shape ? "shape"
                                  : "data_offsets");

    // dtype
    if (!cJSON_IsString(dtype))
        return mha__fail(MHA_ERR_FORMAT, "%s: tensor %s: dtype is %s, not a string", label, qn,
                         mha__st_json_describe(vb, sizeof vb, dtype));
    if (!dtype_lookup(&e->dtype, dtype->valuestring)) {
        char qd[QUOTE_CAP];
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: tensor %s: unknown dtype %s (known: F32, F16, "
                         "BF16, BOOL, I64, I32, U8, F64)",
                         label, qn, mha_escape(qd, sizeof qd, dtype->valuestring));
    }

    // shape
    if (!cJSON_IsArray(shape))
        return mha__fail(MHA_ERR_FORMAT, "%s: tensor %s: shape is %s, not an array", label, qn,
                         mha__st_json_describe(vb, sizeof vb, shape));
    int ndim = cJSON_GetArraySize(shape);
    if (ndim > MHA_MAX_DIMS)
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: tensor %s: shape has %d dims, at most %d are "
                         "supported",
                         label, qn, ndim, MHA_MAX_DIMS);
    e->ndim = ndim;
    int i = 0;
    for (const cJSON *d = shape->child; d; d = d->next, i++) {
        uint64_t v;
        if (!json_uint(&v, d))
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: tensor %s: shape[%d] is %s, not an integer "
                             "in [0, 2^53)",
                             label, qn, i, mha__st_json_describe(vb, sizeof vb, d));
        e->shape[i] = (int64_t)v;
    }

    // data_offsets
    char sb[256];
    mha__shape_str(sb, sizeof sb, e->ndim, e->shape);
    if (!cJSON_IsArray(offsets))
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: tensor %s: data_offsets is %s, not an array of "
                         "2 integers",
                         label, qn, mha__st_json_describe(vb, sizeof vb, offsets));
    if (cJSON_GetArraySize(offsets) != 2)
        return mha__fail(MHA_ERR_FORMAT, "%s: tensor %s: data_offsets has %d elements, not 2",
                         label, qn, cJSON_GetArraySize(offsets));
    const cJSON *b = offsets->child, *en = b->next;
    if (!json_uint(&e->begin, b))
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: tensor %s: data_offsets[0] is %s, not an "
                         "integer in [0, 2^53)",
                         label, qn, mha__st_json_describe(vb, sizeof vb, b));
    if (!json_uint(&e->end, en))
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: tensor %s: data_offsets[1] is %s, not an "
                         "integer in [0, 2^53)",
                         label, qn, mha__st_json_describe(vb, sizeof vb, en));
    if (e->begin > e->end)
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: tensor %s: data_offsets [%llu, %llu] begin "
                         "after their end",
                         label, qn, (unsigned long long)e->begin, (unsigned long long)e->end);

    // size: numel x dtype size == end - begin, every product checked
    size_t esize = mha_dtype_size(e->dtype);
    if (mha__st_shape_numel(&e->numel, e->ndim, e->shape) || (uint64_t)e->numel > SIZE_MAX ||
        mha__mul_overflow_size((size_t)e->numel, esize, &e->nbytes))
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: tensor %s: shape %s x %s: the product of "
                         "the dims overflows int64/size_t",
                         label, qn, sb, mha_dtype_name(e->dtype));
    uint64_t span = e->end - e->begin;
    if ((uint64_t)e->nbytes != span)
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: tensor %s: shape %s x %s = %zu bytes but "
                         "data_offsets [%llu, %llu] span %llu",
                         label, qn, sb, mha_dtype_name(e->dtype), e->nbytes,
                         (unsigned long long)e->begin, (unsigned long long)e->end,
                         (unsigned long long)span);
    if (e->end > (uint64_t)data_len)
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: tensor %s: data_offsets [%llu, %llu] past the "
                         "end of the data buffer (%zu bytes; file truncated?)",
                         label, qn, (unsigned long long)e->begin, (unsigned long long)e->end,
                         data_len);
    return MHA_OK;
}

// Checks "__metadata__" (an object of strings, no duplicate keys, UTF-8).
mha_status mha__st_check_metadata(const cJSON *m, const char *label) {
    char vb[64], qk[QUOTE_CAP];
    if (!cJSON_IsObject(m))
        return mha__fail(MHA_ERR_FORMAT, "%s: __metadata__ is %s, not an object of strings",
                         label, mha__st_json_describe(vb, sizeof vb, m));
    for (const cJSON *k = m->child; k; k = k->next) {
        mha_escape(qk, sizeof qk, k->string);
        if (!cJSON_IsString(k))
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: __metadata__ value of %s is %s, not a "
                             "string",
                             label, qk, mha__st_json_describe(vb, sizeof vb, k));
        size_t ok = mha__st_utf8_valid_prefix(k->string);
        if (k->string[ok])
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: __metadata__ key %s is not valid UTF-8 (bad "
                             "byte at offset %zu)",
                             label, qk, ok);
        ok = mha__st_utf8_valid_prefix(k->valuestring);
        if (k->valuestring[ok])
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: __metadata__ value of %s is not valid UTF-8 "
                             "(bad byte at offset %zu)",
                             label, qk, ok);
    }
    return MHA_OK;
}

// JSON syntax, allocation-free, for telling apart the two reasons cJSON
// returns NULL: invalid text or out of memory. Each checker reads one token
// at s[*i] (of n bytes), advances *i past it and says whether it is valid.
// They are at least as strict as cJSON (so a text they accept failed in
// cJSON for memory only): RFC 8259 numbers of at most 63 bytes (cJSON's
// buffer in some versions), escapes with 4 hex digits and surrogates
// paired.
static bool json_hex4(const unsigned char *s, size_t n, size_t i, unsigned *code) {
    if (n < 4 || i > n - 4) return false;
    unsigned v = 0;
    for (size_t k = 0; k < 4; k++) {
        unsigned char c = s[i + k];
        unsigned d = c >= '0' && c <= '9'   ? (unsigned)(c - '0')
                     : c >= 'a' && c <= 'f' ? (unsigned)(c - 'a' + 10)
                     : c >= 'A' && c <= 'F' ? (unsigned)(c - 'A' + 10)
                                            : 16u;
        if (d > 15) return false;
        v = v * 16 + d;
    }
    *code = v;
    return true;
}

static bool json_string(const unsigned char *s, size_t n, size_t *i) {
    size_t k = *i + 1;  // s[*i] == '"'
    while (k < n && s[k] != '"') {
        if (s[k] < 0x20) return false;
        if (s[k++] != '\\') continue;
        if (k >= n) return false;
        unsigned char e = s[k++];
        if (strchr("\"\\/bfnrt", e) && e) continue;
        unsigned c1, c2;
        if (e != 'u' || !json_hex4(s, n, k, &c1) || (c1 >= 0xdc00 && c1 <= 0xdfff))
            return false;
        k += 4;
        if (c1 >= 0xd800 && c1 <= 0xdbff) {  // a low surrogate must follow
            if (k + 1 >= n || s[k] != '\\' || s[k + 1] != 'u' ||
                !json_hex4(s, n, k + 2, &c2) || c2 < 0xdc00 || c2 > 0xdfff)
                return false;
            k += 6;
        }
    }
    if (k >= n) return false;
    *i = k + 1;
    return true;
}

static bool json_number(const unsigned char *s, size_t n, size_t *i) {
#define MHA__DIGIT(k) ((k) < n && s[k] >= '0' && s[k] <= '9')
    size_t k = *i;
    if (k < n && s[k] == '-') k++;
    if (k < n && s[k] == '0') k++;
    else if (MHA__DIGIT(k))
        while (MHA__DIGIT(k)) k++;
    else return false;
    if (k < n && s[k] == '.') {
        if (!MHA__DIGIT(k + 1)) return false;
        for (k++; MHA__DIGIT(k); k++) {}
    }
    if (k < n && (s[k] == 'e' || s[k] == 'E')) {
        k++;
        if (k < n && (s[k] == '+' || s[k] == '-')) k++;
        if (!MHA__DIGIT(k)) return false;
        while (MHA__DIGIT(k)) k++;
    }
#undef MHA__DIGIT
    if (k - *i > 63) return false;
    *i = k;
    return true;
}

// Whether the n bytes at s begin with one JSON value nested at most
// CJSON_NESTING_LIMIT deep (what follows it is not looked at).
bool mha__st_json_value_valid(const unsigned char *s, size_t n) {
    bool in_object[CJSON_NESTING_LIMIT];  // per open container
    size_t depth = 0, i = 0;
#define MHA__WS() \
    while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) i++
    for (;;) {
        // a value
        MHA__WS();
        if (i >= n) return false;
        const unsigned char c = s[i];
        if (c == '{' || c == '[') {
            if (depth >= CJSON_NESTING_LIMIT) return false;
            in_object[depth++] = c == '{';
            i++;
            MHA__WS();
            if (i < n && s[i] == (c == '{' ? '}' : ']')) {
                i++;
                depth--;
            } else if (c == '[') {
                continue;  // the first element
            } else {
                goto key;
            }
        } else if (c == '"') {
            if (!json_string(s, n, &i)) return false;
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            if (!json_number(s, n, &i)) return false;
        } else {
            static const char *lit[3] = {"true", "false", "null"};
            size_t l = 0;
            for (int k = 0; k < 3 && !l; k++)
                if (n - i >= strlen(lit[k]) && memcmp(s + i, lit[k], strlen(lit[k])) == 0)
                    l = strlen(lit[k]);
            if (!l) return false;
            i += l;
        }
        // after a value: the end, a separator or a closing bracket
        for (;;) {
            MHA__WS();
            if (depth == 0) return true;
            if (i >= n) return false;
            if (s[i] == (in_object[depth - 1] ? '}' : ']')) {
                i++;
                depth--;
                continue;
            }
            if (s[i++] != ',') return false;
            break;
        }
        if (!in_object[depth - 1]) continue;
    key:
        MHA__WS();
        if (i >= n || s[i] != '"' || !json_string(s, n, &i)) return false;
        MHA__WS();
        if (i >= n || s[i] != ':') return false;
        i++;
    }
#undef MHA__WS
}

// Byte-level rules cJSON does not enforce on the n header bytes h.
mha_status mha__st_check_header_bytes(const unsigned char *h, size_t n, const char *label) {
    if (n >= 3 && h[0] == 0xef && h[1] == 0xbb && h[2] == 0xbf)
        return mha__fail(MHA_ERR_FORMAT, "%s: header starts with a UTF-8 byte-order mark",
                         label);
    size_t backslashes = 0;  // run of '\' just before h[i]
    for (size_t i = 0; i < n; i++) {
        unsigned char c = h[i];
        if (c < 0x20 && c != '\t' && c != '\n' && c != '\r')
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: header byte %zu is the control byte 0x%02x "
                             "(not allowed in JSON)",
                             label, i, c);
        // "\u0000" (an odd run of backslashes): cJSON would cut the string
        if (c == 'u' && (backslashes & 1) && i + 4 < n && memcmp(h + i + 1, "0000", 4) == 0)
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: header byte %zu: a string contains \\u0000 "
                             "(NUL characters are not supported)",
                             label, i - 1);
        backslashes = c == '\\' ? backslashes + 1 : 0;
    }
    return MHA_OK;
}
