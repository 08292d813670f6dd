// safetensors.h: what the files of the safetensors reader (safetensors.c),
// its header checks (safetensors_check.c) and the writer
// (safetensors_write.c) share. Internal: the API is in mha.h.
#ifndef MHA_SAFETENSORS_H
#define MHA_SAFETENSORS_H

#include <cjson/cJSON.h>

#include "internal.h"

// Largest integer (exclusive) a JSON number may hold here: doubles are exact
// below 2^53.
#define ST_INT_LIMIT 9007199254740992.0  // 2^53
#define ST_INT_LIMIT_U ((uint64_t)1 << 53)

// Room for a name quoted by mha_escape in a message.
#define QUOTE_CAP 400

// One tensor entry while the header is being checked.
typedef struct st_entry {
    const char *name;  // cJSON's string, until copied
    int64_t order;     // position in the header
    mha_dtype dtype;
    int ndim;
    int64_t shape[MHA_MAX_DIMS];
    int64_t numel;
    size_t nbytes;
    uint64_t begin, end;
} st_entry;

// safetensors.c
int mha__st_host_is_le(void);          // 1 on a little-endian host
char *mha__st_str_dup(const char *s);  // a mha__malloc'ed copy, or NULL

// safetensors_check.c (each function's comment there says what it checks)
size_t mha__st_utf8_valid_prefix(const char *str);
const char *mha__st_json_describe(char *buf, size_t cap, const cJSON *v);
int mha__st_shape_numel(int64_t *numel, int ndim, const int64_t *shape);
mha_status mha__st_check_entry(st_entry *e, const cJSON *item, const char *label,
                               size_t data_len);
mha_status mha__st_check_metadata(const cJSON *m, const char *label);
bool mha__st_json_value_valid(const unsigned char *s, size_t n);
mha_status mha__st_check_header_bytes(const unsigned char *h, size_t n, const char *label);

#endif
