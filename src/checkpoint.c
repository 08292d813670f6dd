// checkpoint.c: a Hugging Face checkpoint opened (a directory with
// config.json and model.safetensors, or the shards listed by
// model.safetensors.index.json): its files, config.json and the typed
// values read from it, the index of tensor names and its shards, a tensor
// found by name; and the table of the architectures' defaults. What a
// layer does (checkpoint_spec.c) and loading its attention into a module
// (checkpoint_load.c) are built on it; this file knows neither.
//
// Files: every path is resolved (realpath) and must lie inside the
// directory (no "..", no absolute names, no symlink leading out). Shards
// are read when a tensor of theirs is first asked for (one layer of a large
// model reads only the shards holding it); then every tensor the index puts
// in that shard must be there.
//
// A checkpoint opens shards lazily, so one object is not to be used from
// two threads at once.
#define _XOPEN_SOURCE 700  // realpath
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "checkpoint.h"
#include "internal.h"
#include "safetensors.h"

// ---------------------------------------------------------------------------
// Architectures and the defaults of their config classes (checkpoint.h)

const ck_arch_desc mha__ck_archs[ARCH_COUNT] = {
    {"bert", 768, 12, 0, 12, 0, -1, true, 10000.0, 1e-12, 512, "encoder.layer.%lld.attention.",
     "bert."},
    {"gpt2", 768, 12, 0, 12, 0, -1, true, 10000.0, 1e-5, 1024, "h.%lld.attn.", "transformer."},
    {"llama", 4096, 32, 0, 32, 0, -1, false, 10000.0, 1e-6, 2048, "layers.%lld.self_attn.",
     "model."},
    {"mistral", 4096, 32, 8, 32, 0, 4096, false, 10000.0, 1e-6, 131072,
     "layers.%lld.self_attn.", "model."},
    {"qwen2", 4096, 32, 32, 32, 0, 4096, true, 10000.0, 1e-6, 32768, "layers.%lld.self_attn.",
     "model."},
    {"qwen3", 4096, 32, 32, 32, 128, 4096, false, 10000.0, 1e-6, 32768,
     "layers.%lld.self_attn.", "model."},
    {"gemma2", 2304, 8, 4, 26, 256, 4096, false, 10000.0, 1e-6, 8192, "layers.%lld.self_attn.",
     "model."},
    {"gpt_oss", 2880, 64, 8, 36, 64, 128, true, 150000.0, 1e-5, 131072,
     "layers.%lld.self_attn.", "model."},
};

#define CK_MAX_JSON (64u * 1024u * 1024u)

static char *str_cat3(const char *a, const char *b, const char *c) {
    size_t la = strlen(a), lb = strlen(b), lc = strlen(c);
    char *s = mha__malloc(la + lb + lc + 1);
    if (!s) return NULL;
    memcpy(s, a, la);
    memcpy(s + la, b, lb);
    memcpy(s + la + lb, c, lc + 1);
    return s;
}

// Whether rel is a relative path without a ".." component.
static bool rel_path_ok(const char *rel) {
    if (!rel[0] || rel[0] == '/') return false;
    for (const char *p = rel; *p;) {
        const char *e = strchr(p, '/');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        if (n == 2 && p[0] == '.' && p[1] == '.') return false;
        if (!e) break;
        p = e + 1;
    }
    return true;
}

// The resolved path of dir/rel (a mha__malloc'ed string in *out), which
// must name a regular file inside the directory. what names the file's
// role in messages.
static mha_status resolve_inside(char **out, const mha_checkpoint *c, const char *rel,
                                 const char *what) {
    *out = NULL;
    char q[CK_Q];
    mha_escape(q, sizeof q, rel);
    if (!rel_path_ok(rel))
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: %s %s is not a relative path inside the directory (absolute or "
                         "with a \"..\" component)",
                         c->index_path ? c->index_path : c->dir, what, q);
    char *joined = str_cat3(c->dir, "/", rel);
    if (!joined) return mha__fail(MHA_ERR_NOMEM, "%s: out of memory", c->dir);
    errno = 0;
    char *real = realpath(joined, NULL);
    if (!real) {
        int err = errno;
        mha_status st = mha__fail(err == ENOMEM ? MHA_ERR_NOMEM : MHA_ERR_IO,
                                  "%s: %s %s: cannot open: %s",
                                  c->index_path ? c->index_path : c->dir, what, q,
                                  strerror(err));
        free(joined);
        return st;
    }
    size_t ld = strlen(c->dir);
    bool inside = strcmp(c->dir, "/") == 0 ? real[0] == '/'
                                           : strncmp(real, c->dir, ld) == 0 && real[ld] == '/';
    if (!inside) {
        char qr[CK_Q];
        mha_status st = mha__fail(MHA_ERR_FORMAT,
                                  "%s: %s %s resolves to %s, outside the checkpoint "
                                  "directory %s",
                                  c->index_path ? c->index_path : c->dir, what, q,
                                  mha_escape(qr, sizeof qr, real), c->dir);
        free(real);
        free(joined);
        return st;
    }
    struct stat sb;
    if (stat(real, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        mha_status st = mha__fail(MHA_ERR_IO, "%s: %s %s is not a regular file", joined, what,
                                  q);
        free(real);
        free(joined);
        return st;
    }
    free(joined);
    char *dup = mha__st_str_dup(real);
    free(real);
    if (!dup) return mha__fail(MHA_ERR_NOMEM, "%s: out of memory", c->dir);
    *out = dup;
    return MHA_OK;
}

// Reads a JSON file (at most CK_MAX_JSON bytes) into a cJSON tree that
// must be an object.
static mha_status read_json(cJSON **out, const char *path) {
    *out = NULL;
    FILE *fp = fopen(path, "rb");
    if (!fp) return mha__fail(MHA_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    unsigned char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len == cap) {
            if (cap >= CK_MAX_JSON) {
                fclose(fp);
                free(buf);
                return mha__fail(MHA_ERR_FORMAT, "%s: larger than %u bytes", path, CK_MAX_JSON);
            }
            size_t nc = cap ? cap * 2 : 4096;
            unsigned char *nb = mha__realloc(buf, nc + 1);
            if (!nb) {
                fclose(fp);
                free(buf);
                return mha__fail(MHA_ERR_NOMEM, "%s: out of memory reading it", path);
            }
            buf = nb, cap = nc;
        }
        size_t got = fread(buf + len, 1, cap - len, fp);
        len += got;
        if (got == 0) break;
    }
    int err = ferror(fp) ? errno : 0;
    fclose(fp);
    if (err) {
        free(buf);
        return mha__fail(MHA_ERR_IO, "%s: read failed: %s", path, strerror(err));
    }
    for (size_t i = 0; i < len; i++)
        if (buf[i] < 0x20 && buf[i] != '\t' && buf[i] != '\n' && buf[i] != '\r') {
            const unsigned b = buf[i];
            free(buf);
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: byte %zu is the control byte 0x%02x (not JSON)", path, i, b);
        }
    const char *end = NULL;
    cJSON *r = cJSON_ParseWithLengthOpts((const char *)buf, len, &end, 0);
    if (!r) {
        bool valid = mha__st_json_value_valid(buf, len);
        size_t at = end ? (size_t)(end - (const char *)buf) : 0;
        free(buf);
        if (valid) return mha__fail(MHA_ERR_NOMEM, "%s: out of memory parsing it", path);
        return mha__fail(MHA_ERR_FORMAT, "%s: not valid JSON (parse error at byte %zu)", path,
                         at);
    }
    size_t extra = len;  // the first byte after the value that is not whitespace
    for (size_t i = (size_t)(end - (const char *)buf); i < len && extra == len; i++)
        if (buf[i] != ' ' && buf[i] != '\t' && buf[i] != '\n' && buf[i] != '\r') extra = i;
    free(buf);
    if (extra != len) {
        cJSON_Delete(r);
        return mha__fail(MHA_ERR_FORMAT, "%s: byte %zu: unexpected text after the JSON value",
                         path, extra);
    }
    if (!cJSON_IsObject(r)) {
        char vb[64];
        mha_status st = mha__fail(MHA_ERR_FORMAT, "%s: is %s, not a JSON object", path,
                                  mha__st_json_describe(vb, sizeof vb, r));
        cJSON_Delete(r);
        return st;
    }
    *out = r;
    return MHA_OK;
}

// ---------------------------------------------------------------------------
// Typed config values (checkpoint.h)

const cJSON *mha__ck_item(const cJSON *obj, const char *key) {
    const cJSON *v = obj ? cJSON_GetObjectItemCaseSensitive(obj, key) : NULL;
    return v && !cJSON_IsNull(v) ? v : NULL;
}

mha_status mha__ck_bad_type(const mha_checkpoint *c, const char *pre, const char *key,
                            const cJSON *v, const char *expected) {
    char vb[64];
    return mha__fail(MHA_ERR_FORMAT, "%s: \"%s%s\" is %s, expected %s", c->config_path, pre,
                     key, mha__st_json_describe(vb, sizeof vb, v), expected);
}

mha_status mha__ck_num(double *out, bool *found, const mha_checkpoint *c, const cJSON *obj,
                       const char *pre, const char *key, double def) {
    const cJSON *v = mha__ck_item(obj, key);
    if (found) *found = v != NULL;
    *out = def;
    if (!v) return MHA_OK;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return mha__ck_bad_type(c, pre, key, v, "a number");
    *out = v->valuedouble;
    return MHA_OK;
}

// An integer in [lo, 2^53).
mha_status mha__ck_int(int64_t *out, bool *found, const mha_checkpoint *c, const cJSON *obj,
                       const char *pre, const char *key, int64_t def, int64_t lo) {
    const cJSON *v = mha__ck_item(obj, key);
    if (found) *found = v != NULL;
    *out = def;
    if (!v) return MHA_OK;
    char what[48];
    snprintf(what, sizeof what, "an integer >= %lld", (long long)lo);
    if (!cJSON_IsNumber(v)) return mha__ck_bad_type(c, pre, key, v, what);
    const double x = v->valuedouble;
    if (!(x >= (double)lo && x < ST_INT_LIMIT) || x != floor(x))
        return mha__ck_bad_type(c, pre, key, v, what);
    *out = (int64_t)x;
    return MHA_OK;
}

mha_status mha__ck_bool(bool *out, const mha_checkpoint *c, const cJSON *obj, const char *pre,
                        const char *key, bool def) {
    const cJSON *v = mha__ck_item(obj, key);
    *out = def;
    if (!v) return MHA_OK;
    if (!cJSON_IsBool(v)) return mha__ck_bad_type(c, pre, key, v, "true or false");
    *out = cJSON_IsTrue(v);
    return MHA_OK;
}

// The sliding_window (-1: none): absent takes the class default def, null
// is none (transformers' None).
mha_status mha__ck_window(int64_t *out, const mha_checkpoint *c, int64_t def) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(c->config, "sliding_window");
    if (v && cJSON_IsNull(v)) {
        *out = -1;
        return MHA_OK;
    }
    return mha__ck_int(out, NULL, c, c->config, "", "sliding_window", def, 1);
}

mha_status mha__ck_str(const char **out, const mha_checkpoint *c, const cJSON *obj,
                       const char *pre, const char *key) {
    const cJSON *v = mha__ck_item(obj, key);
    *out = NULL;
    if (!v) return MHA_OK;
    if (!cJSON_IsString(v)) return mha__ck_bad_type(c, pre, key, v, "a string");
    *out = v->valuestring;
    return MHA_OK;
}

// ---------------------------------------------------------------------------
// Open and close

static int cmp_name(const void *pa, const void *pb) {
    const ck_name *a = pa, *b = pb;
    return strcmp(a->name, b->name);
}

void mha_checkpoint_close(mha_checkpoint *c) {
    if (!c) return;
    for (int i = 0; i < c->nshards; i++) {
        mha_st_close(c->shards[i].f);
        free(c->shards[i].rel);
        free(c->shards[i].path);
    }
    free(c->shards);
    free(c->names);
    cJSON_Delete(c->config);
    cJSON_Delete(c->index);
    free(c->dir);
    free(c->config_path);
    free(c->index_path);
    free(c);
}

// The shard named rel (index of c->shards), added (and its path checked)
// when new.
static mha_status add_shard(int *out, mha_checkpoint *c, const char *rel, const char *tensor) {
    for (int i = 0; i < c->nshards; i++)
        if (strcmp(c->shards[i].rel, rel) == 0) {
            *out = i;
            return MHA_OK;
        }
    if (c->nshards >= 1 << 20)
        return mha__fail(MHA_ERR_FORMAT, "%s: more than %d shards", c->index_path, 1 << 20);
    ck_shard *ns = mha__realloc(c->shards, sizeof *ns * (size_t)(c->nshards + 1));
    if (!ns) return mha__fail(MHA_ERR_NOMEM, "%s: out of memory", c->dir);
    c->shards = ns;
    ck_shard *s = &c->shards[c->nshards];
    memset(s, 0, sizeof *s);
    char what[CK_Q + 32] = "file", q[CK_Q];
    if (tensor)
        snprintf(what, sizeof what, "shard of tensor %s", mha_escape(q, sizeof q, tensor));
    mha_status st = resolve_inside(&s->path, c, rel, what);
    if (st) return st;
    if (!(s->rel = mha__st_str_dup(rel))) {
        free(s->path);
        return mha__fail(MHA_ERR_NOMEM, "%s: out of memory", c->dir);
    }
    *out = c->nshards++;
    return MHA_OK;
}

// The index's weight_map: every name and its shard.
static mha_status read_index(mha_checkpoint *c) {
    mha_status st = read_json(&c->index, c->index_path);
    if (st) return st;
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(c->index, "weight_map");
    char vb[64];
    if (!cJSON_IsObject(wm))
        return mha__fail(MHA_ERR_FORMAT, "%s: \"weight_map\" is %s, expected an object",
                         c->index_path,
                         wm ? mha__st_json_describe(vb, sizeof vb, wm) : "absent");
    int64_t n = 0;
    for (const cJSON *e = wm->child; e; e = e->next) n++;
    if (n == 0) return mha__fail(MHA_ERR_FORMAT, "%s: \"weight_map\" is empty", c->index_path);
    c->names = mha__malloc(sizeof *c->names * (size_t)n);
    if (!c->names) return mha__fail(MHA_ERR_NOMEM, "%s: out of memory", c->index_path);
    for (const cJSON *e = wm->child; e; e = e->next) {
        char q[CK_Q];
        if (!cJSON_IsString(e))
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: weight_map entry %s is %s, expected a shard file name",
                             c->index_path, mha_escape(q, sizeof q, e->string),
                             mha__st_json_describe(vb, sizeof vb, e));
        int s;
        if ((st = add_shard(&s, c, e->valuestring, e->string))) return st;
        c->names[c->nnames++] = (ck_name){e->string, s};
    }
    qsort(c->names, (size_t)c->nnames, sizeof *c->names, cmp_name);
    for (int64_t i = 1; i < c->nnames; i++)
        if (strcmp(c->names[i - 1].name, c->names[i].name) == 0) {
            char q[CK_Q];
            return mha__fail(MHA_ERR_FORMAT, "%s: weight_map lists tensor %s twice",
                             c->index_path, mha_escape(q, sizeof q, c->names[i].name));
        }
    return MHA_OK;
}

// Opens shard i if not yet open, checking that it holds every tensor the
// index puts in it.
static mha_status shard_file(const mha_st_file **out, const mha_checkpoint *cc, int i) {
    mha_checkpoint *c = (mha_checkpoint *)cc;  // the lazily filled cache
    ck_shard *s = &c->shards[i];
    if (!s->f) {
        mha_st_file *f;
        mha_status st = mha_st_open(&f, s->path);
        if (st) return st;
        for (int64_t k = 0; c->index && k < c->nnames; k++) {
            mha_st_tensor t;
            if (c->names[k].shard != i) continue;
            if (mha_st_find(&t, f, c->names[k].name) != MHA_OK) {
                char q[CK_Q], qs[CK_Q];
                mha_st_close(f);
                return mha__fail(MHA_ERR_FORMAT,
                                 "%s: lists tensor %s in shard %s, which has no such tensor",
                                 c->index_path, mha_escape(q, sizeof q, c->names[k].name),
                                 mha_escape(qs, sizeof qs, s->rel));
            }
        }
        s->f = f;
    }
    *out = s->f;
    return MHA_OK;
}

static mha_status open_config(mha_checkpoint *c) {
    char *path;
    mha_status st = resolve_inside(&path, c, "config.json", "file");
    if (st) return st;
    free(c->config_path);
    c->config_path = path;
    if ((st = read_json(&c->config, c->config_path))) return st;
    const char *mt;
    if ((st = mha__ck_str(&mt, c, c->config, "", "model_type"))) return st;
    if (!mt) return mha__fail(MHA_ERR_FORMAT, "%s: no \"model_type\"", c->config_path);
    char q[CK_Q];
    int a = 0;
    while (a < ARCH_COUNT && strcmp(mha__ck_archs[a].name, mt) != 0) a++;
    if (a == ARCH_COUNT)
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "%s: model_type %s is not supported (supported: bert, gpt2, llama, "
                         "mistral, qwen2, qwen3, gemma2, gpt_oss)",
                         c->config_path, mha_escape(q, sizeof q, mt));
    c->arch = (ck_arch)a;
    snprintf(c->model_type, sizeof c->model_type, "%s", mha__ck_archs[a].name);
    bool found;
    const char *lk = c->arch == ARCH_GPT2 ? "n_layer" : "num_hidden_layers";
    if ((st = mha__ck_int(&c->num_layers, &found, c, c->config, "", lk, mha__ck_archs[a].L, 1)))
        return st;
    if (!found && c->arch == ARCH_GPT2 &&
        (st = mha__ck_int(&c->num_layers, NULL, c, c->config, "", "num_hidden_layers",
                          mha__ck_archs[a].L, 1)))
        return st;
    return MHA_OK;
}

mha_status mha_checkpoint_open(mha_checkpoint **out, const char *dir) {
    if (!out) return mha__fail(MHA_ERR_INVALID_ARG, "mha_checkpoint_open: out is NULL");
    *out = NULL;
    if (!dir) return mha__fail(MHA_ERR_INVALID_ARG, "mha_checkpoint_open: dir is NULL");
    mha_checkpoint *c = mha__calloc(1, sizeof *c);
    if (!c) return mha__fail(MHA_ERR_NOMEM, "mha_checkpoint_open: out of memory");
    mha_status st = MHA_OK;
    errno = 0;
    char *real = realpath(dir, NULL);
    struct stat sb;
    if (!real) {
        st = mha__fail(MHA_ERR_IO, "%s: cannot open the checkpoint directory: %s", dir,
                       strerror(errno));
    } else if (stat(real, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
        st = mha__fail(MHA_ERR_IO, "%s: not a directory", dir);
    } else if (!(c->dir = mha__st_str_dup(real)) ||
               !(c->config_path = str_cat3(c->dir, "/", "config.json"))) {
        st = mha__fail(MHA_ERR_NOMEM, "mha_checkpoint_open: out of memory");
    }
    free(real);
    if (!st) st = open_config(c);
    if (!st) {
        // the index when there is one, else the single file
        char *ip = str_cat3(c->dir, "/", "model.safetensors.index.json");
        if (!ip) st = mha__fail(MHA_ERR_NOMEM, "mha_checkpoint_open: out of memory");
        struct stat ib;
        if (!st && lstat(ip, &ib) == 0) {
            free(ip);
            if (!(st = resolve_inside(&c->index_path, c, "model.safetensors.index.json", "file")))
                st = read_index(c);
        } else if (!st) {
            free(ip);
            int s;
            if (!(st = add_shard(&s, c, "model.safetensors", NULL))) {
                const mha_st_file *f;
                if (!(st = shard_file(&f, c, s))) {
                    int64_t n = mha_st_num_tensors(f);
                    c->names = mha__malloc(sizeof *c->names * (size_t)(n ? n : 1));
                    if (!c->names) st = mha__fail(MHA_ERR_NOMEM, "%s: out of memory", dir);
                    for (int64_t i = 0; !st && i < n; i++) {
                        mha_st_tensor t;
                        if (!(st = mha_st_tensor_at(&t, f, i)))
                            c->names[c->nnames++] = (ck_name){t.name, s};
                    }
                    if (!st) qsort(c->names, (size_t)c->nnames, sizeof *c->names, cmp_name);
                }
            }
        }
    }
    if (st) {
        mha_checkpoint_close(c);
        return st;
    }
    *out = c;
    return MHA_OK;
}

const char *mha_checkpoint_model_type(const mha_checkpoint *c) {
    return c ? c->model_type : "";
}

int64_t mha_checkpoint_num_layers(const mha_checkpoint *c) { return c ? c->num_layers : 0; }

static const ck_name *find_name(const mha_checkpoint *c, const char *name) {
    ck_name key = {name, 0};
    return bsearch(&key, c->names, (size_t)c->nnames, sizeof key, cmp_name);
}

// Where messages say a tensor was looked for: the index, or the file.
const char *mha__ck_where(const mha_checkpoint *c) {
    return c->index_path ? c->index_path : c->shards[0].path;
}

mha_status mha_checkpoint_find(mha_st_tensor *out, const mha_checkpoint *c, const char *name) {
    if (!out || !c || !name)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_checkpoint_find: NULL argument");
    const ck_name *e = find_name(c, name);
    char q[CK_Q];
    if (!e)
        return mha__fail(MHA_ERR_NOT_FOUND, "%s: no tensor %s", mha__ck_where(c),
                         mha_escape(q, sizeof q, name));
    const mha_st_file *f;
    mha_status st = shard_file(&f, c, e->shard);
    if (st) return st;
    return mha_st_find(out, f, name);
}

mha_status mha_checkpoint_config_number(double *out, const mha_checkpoint *c, const char *key) {
    if (!out || !c || !key)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_checkpoint_config_number: NULL argument");
    bool found;
    mha_status st = mha__ck_num(out, &found, c, c->config, "", key, 0.0);
    if (st) return st;
    char q[CK_Q];
    if (!found)
        return mha__fail(MHA_ERR_NOT_FOUND, "%s: no %s", c->config_path,
                         mha_escape(q, sizeof q, key));
    return MHA_OK;
}
