// checkpoint.c: the attention of one layer of a Hugging Face checkpoint
// (a directory with config.json and model.safetensors, or the shards listed
// by model.safetensors.index.json), loaded under the architecture's own
// tensor names into a module, with what the layer does beyond its
// parameters (causal, sliding window, RoPE and its scaling, soft cap,
// scale) as a mha_checkpoint_layer.
//
// What transformers 5 does, mirrored (models/<arch>/configuration_*.py and
// modeling_*.py; a key absent from config.json takes the config class's
// default, a JSON null counts as absent):
//   bert     encoder.layer.I.attention.self.{query,key,value}, .output.dense
//            (all biased); not causal unless is_decoder
//   gpt2     h.I.attn.c_attn (Conv1D: weight (E, 3E), y = x W + b, i.e. the
//            transpose of in_proj_weight), h.I.attn.c_proj; causal; scale
//            d^-1/2 (1 when scale_attn_weights is false) divided by I + 1
//            when scale_attn_by_inverse_layer_idx
//   llama, mistral, qwen2, qwen3, gemma2, gpt_oss
//            layers.I.self_attn.{q,k,v,o}_proj; causal; RoPE rotate_half
//            (neox) over head_dim (transformers' default RoPE of these
//            architectures rotates every feature: partial_rotary_factor is
//            read but only the scaled types use it, and then rotating fewer
//            features than head_dim would fail in transformers too);
//            biases: attention_bias (llama, qwen3, gemma2, gpt_oss), q/k/v
//            biased and o not (qwen2), none (mistral); qwen3 q_norm/k_norm
//            (RMSNorm per head, eps rms_norm_eps); gpt_oss sinks; windows:
//            mistral sliding_window on every layer, qwen2/3 sliding_window
//            only with use_sliding_window, on the layers layer_types marks
//            (default: index >= max_window_layers), gemma2 and gpt_oss on
//            the layers layer_types marks (default: the even ones); a
//            window W lets query i see keys i - W < j <= i (window_left =
//            W - 1); gemma2 scale query_pre_attn_scalar^-1/2 and soft cap
//            attn_logit_softcapping.
// RoPE parameters: rope_scaling (the older spelling) when set, else
// rope_parameters (transformers 5), else none (gpt_oss: its default YaRN);
// rope_theta inside them, else top-level, else the architecture's default.
//
// Files: every path is resolved (realpath) and must lie inside the
// directory (no "..", no absolute names, no symlink leading out). Shards
// are read when a tensor of theirs is first asked for (one layer of a large
// model reads only the shards holding it); then every tensor the index puts
// in that shard must be there. Every shape of a layer is checked against
// the config before anything is written into the module.
//
// What it does not do: cross-attention (bert is_decoder with
// add_cross_attention, gpt2 crossattention) is not loaded; nested per-layer
// RoPE parameters and bidirectional gemma2 are refused
// (MHA_ERR_UNSUPPORTED). A checkpoint opens shards lazily, so one object is
// not to be used from two threads at once.
#define _XOPEN_SOURCE 700  // realpath
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "internal.h"
#include "safetensors.h"

// ---------------------------------------------------------------------------
// Architectures and the defaults of their config classes

typedef enum ck_arch {
    ARCH_BERT,
    ARCH_GPT2,
    ARCH_LLAMA,
    ARCH_MISTRAL,
    ARCH_QWEN2,
    ARCH_QWEN3,
    ARCH_GEMMA2,
    ARCH_GPT_OSS,
    ARCH_COUNT
} ck_arch;

typedef struct ck_arch_desc {
    const char *name;
    int64_t E, H, Hkv, L;  // hidden_size, heads, kv heads (0: H), layers
    int64_t d;             // head_dim default (0: E / H)
    int64_t window;        // sliding_window default (-1: none)
    bool bias;             // attention_bias default
    double theta;          // default_theta
    double eps;            // rms_norm_eps default
    int64_t max_pos;       // max_position_embeddings default
    const char *core;      // the layer's attention, printf'ed with I
    const char *prefix;    // the usual prefix of a model with a head
} ck_arch_desc;

static const ck_arch_desc archs[ARCH_COUNT] = {
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

static bool arch_has_rope(ck_arch a) { return a != ARCH_BERT && a != ARCH_GPT2; }

// ---------------------------------------------------------------------------
// The checkpoint object

typedef struct ck_name {
    const char *name;  // owned by the index's cJSON tree or the single file
    int shard;
} ck_name;

typedef struct ck_shard {
    char *rel;       // the name the index gives (or "model.safetensors")
    char *path;      // resolved, inside the directory
    mha_st_file *f;  // NULL until first needed
} ck_shard;

struct mha_checkpoint {
    char *dir;          // resolved directory
    char *config_path;  // dir/config.json (for messages)
    char *index_path;   // dir/model.safetensors.index.json, or NULL
    cJSON *config, *index;
    ck_arch arch;
    char model_type[32];
    int64_t num_layers;
    int nshards;
    ck_shard *shards;
    int64_t nnames;
    ck_name *names;  // sorted by name
};

#define CK_MAX_JSON (64u * 1024u * 1024u)
#define CK_Q 200  // room for a quoted name in a message

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
// Typed config values. Each looks key up in obj (the config or a nested
// object named by pre, e.g. "rope_parameters."); absent or null: *found
// false and the default. A value of the wrong type is MHA_ERR_FORMAT
// naming the key and the file.

static const cJSON *item(const cJSON *obj, const char *key) {
    const cJSON *v = obj ? cJSON_GetObjectItemCaseSensitive(obj, key) : NULL;
    return v && !cJSON_IsNull(v) ? v : NULL;
}

static mha_status bad_type(const mha_checkpoint *c, const char *pre, const char *key,
                           const cJSON *v, const char *expected) {
    char vb[64];
    return mha__fail(MHA_ERR_FORMAT, "%s: \"%s%s\" is %s, expected %s", c->config_path, pre,
                     key, mha__st_json_describe(vb, sizeof vb, v), expected);
}

static mha_status cfg_num(double *out, bool *found, const mha_checkpoint *c, const cJSON *obj,
                          const char *pre, const char *key, double def) {
    const cJSON *v = item(obj, key);
    if (found) *found = v != NULL;
    *out = def;
    if (!v) return MHA_OK;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return bad_type(c, pre, key, v, "a number");
    *out = v->valuedouble;
    return MHA_OK;
}

// An integer in [lo, 2^53).
static mha_status cfg_int(int64_t *out, bool *found, const mha_checkpoint *c, const cJSON *obj,
                          const char *pre, const char *key, int64_t def, int64_t lo) {
    const cJSON *v = item(obj, key);
    if (found) *found = v != NULL;
    *out = def;
    if (!v) return MHA_OK;
    char what[48];
    snprintf(what, sizeof what, "an integer >= %lld", (long long)lo);
    if (!cJSON_IsNumber(v)) return bad_type(c, pre, key, v, what);
    const double x = v->valuedouble;
    if (!(x >= (double)lo && x < ST_INT_LIMIT) || x != floor(x))
        return bad_type(c, pre, key, v, what);
    *out = (int64_t)x;
    return MHA_OK;
}

static mha_status cfg_bool(bool *out, const mha_checkpoint *c, const cJSON *obj,
                           const char *pre, const char *key, bool def) {
    const cJSON *v = item(obj, key);
    *out = def;
    if (!v) return MHA_OK;
    if (!cJSON_IsBool(v)) return bad_type(c, pre, key, v, "true or false");
    *out = cJSON_IsTrue(v);
    return MHA_OK;
}

// The sliding_window (-1: none): absent takes the class default def, null
// is none (transformers' None).
static mha_status cfg_window(int64_t *out, const mha_checkpoint *c, int64_t def) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(c->config, "sliding_window");
    if (v && cJSON_IsNull(v)) {
        *out = -1;
        return MHA_OK;
    }
    return cfg_int(out, NULL, c, c->config, "", "sliding_window", def, 1);
}

static mha_status cfg_str(const char **out, const mha_checkpoint *c, const cJSON *obj,
                          const char *pre, const char *key) {
    const cJSON *v = item(obj, key);
    *out = NULL;
    if (!v) return MHA_OK;
    if (!cJSON_IsString(v)) return bad_type(c, pre, key, v, "a string");
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
    if ((st = cfg_str(&mt, c, c->config, "", "model_type"))) return st;
    if (!mt) return mha__fail(MHA_ERR_FORMAT, "%s: no \"model_type\"", c->config_path);
    char q[CK_Q];
    int a = 0;
    while (a < ARCH_COUNT && strcmp(archs[a].name, mt) != 0) a++;
    if (a == ARCH_COUNT)
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "%s: model_type %s is not supported (supported: bert, gpt2, llama, "
                         "mistral, qwen2, qwen3, gemma2, gpt_oss)",
                         c->config_path, mha_escape(q, sizeof q, mt));
    c->arch = (ck_arch)a;
    snprintf(c->model_type, sizeof c->model_type, "%s", archs[a].name);
    bool found;
    const char *lk = c->arch == ARCH_GPT2 ? "n_layer" : "num_hidden_layers";
    if ((st = cfg_int(&c->num_layers, &found, c, c->config, "", lk, archs[a].L, 1))) return st;
    if (!found && c->arch == ARCH_GPT2 &&
        (st = cfg_int(&c->num_layers, NULL, c, c->config, "", "num_hidden_layers", archs[a].L,
                      1)))
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
static const char *where(const mha_checkpoint *c) {
    return c->index_path ? c->index_path : c->shards[0].path;
}

mha_status mha_checkpoint_find(mha_st_tensor *out, const mha_checkpoint *c, const char *name) {
    if (!out || !c || !name)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_checkpoint_find: NULL argument");
    const ck_name *e = find_name(c, name);
    char q[CK_Q];
    if (!e)
        return mha__fail(MHA_ERR_NOT_FOUND, "%s: no tensor %s", where(c),
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
    mha_status st = cfg_num(out, &found, c, c->config, "", key, 0.0);
    if (st) return st;
    char q[CK_Q];
    if (!found)
        return mha__fail(MHA_ERR_NOT_FOUND, "%s: no %s", c->config_path,
                         mha_escape(q, sizeof q, key));
    return MHA_OK;
}

// ---------------------------------------------------------------------------
// A layer's spec from the config

typedef struct ck_spec {
    int64_t E, H, Hkv, d;
    bool qkv_bias, o_bias;
    bool qk_norm;
    double eps;
    bool sinks;
    mha_checkpoint_layer info;
} ck_spec;

// "default" -> NONE, and the scaled types transformers names.
static mha_status rope_type_of(mha_rope_scaling_type *out, const mha_checkpoint *c,
                               const char *rname, const char *name) {
    if (mha_rope_scaling_type_from_name(out, name) == MHA_OK) return MHA_OK;
    char q[CK_Q];
    return mha__fail(MHA_ERR_UNSUPPORTED,
                     "%s: %s rope_type %s is not supported (supported: default, linear, "
                     "dynamic, yarn, llama3)",
                     c->config_path, rname, mha_escape(q, sizeof q, name));
}

// RoPE and its scaling (see the file's header).
static mha_status spec_rope(ck_spec *s, const mha_checkpoint *c) {
    const cJSON *cfg = c->config;
    const ck_arch_desc *ad = &archs[c->arch];
    mha_checkpoint_layer *info = &s->info;
    mha_rope_init(&info->rope, MHA_ROPE_NEOX);
    memset(&info->rope_scaling, 0, sizeof info->rope_scaling);
    const cJSON *rs = item(cfg, "rope_scaling"), *rp = item(cfg, "rope_parameters"), *r = NULL;
    const char *rname = NULL;
    mha_status st;
    if (rs && !cJSON_IsObject(rs)) return bad_type(c, "", "rope_scaling", rs, "an object");
    if (rp && !cJSON_IsObject(rp)) return bad_type(c, "", "rope_parameters", rp, "an object");
    if (rs && rs->child) r = rs, rname = "rope_scaling";
    else if (rp) r = rp, rname = "rope_parameters";
    if (r && (item(r, "full_attention") || item(r, "sliding_attention")))
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "%s: %s nested per layer type is not supported for %s",
                         c->config_path, rname, ad->name);
    char pre[40];
    snprintf(pre, sizeof pre, "%s.", rname ? rname : "");
    double theta;
    bool found;
    if ((st = cfg_num(&theta, &found, c, r, pre, "rope_theta", 0.0))) return st;
    if (!found && (st = cfg_num(&theta, NULL, c, cfg, "", "rope_theta", ad->theta))) return st;
    if (!(theta > 0.0))
        return mha__fail(MHA_ERR_FORMAT, "%s: rope_theta %g must be positive", c->config_path,
                         theta);
    info->rope.theta = theta;
    double prf;
    if ((st = cfg_num(&prf, &found, c, r, pre, "partial_rotary_factor", 1.0))) return st;
    if (!found && (st = cfg_num(&prf, NULL, c, cfg, "", "partial_rotary_factor", 1.0)))
        return st;
    if (!(prf > 0.0 && prf <= 1.0))
        return mha__fail(MHA_ERR_FORMAT, "%s: partial_rotary_factor %g must be in (0, 1]",
                         c->config_path, prf);
    int64_t maxpos;
    if ((st = cfg_int(&maxpos, NULL, c, cfg, "", "max_position_embeddings", ad->max_pos, 1)))
        return st;

    // the type (gpt_oss without parameters: its default YaRN)
    const char *tname = NULL;
    if (r && (st = cfg_str(&tname, c, r, pre, "rope_type"))) return st;
    if (r && !tname && (st = cfg_str(&tname, c, r, pre, "type"))) return st;
    mha_rope_scaling *sc = &info->rope_scaling;
    mha_rope_scaling_init(sc, MHA_ROPE_SCALING_NONE);
    if (!r && c->arch == ARCH_GPT_OSS) {
        sc->type = MHA_ROPE_SCALING_YARN;
        sc->factor = 32.0;
        sc->truncate = false;
        sc->original_max_position = 4096;
        return MHA_OK;
    }
    if ((st = rope_type_of(&sc->type, c, rname ? rname : "rope_parameters",
                           tname ? tname : "default")))
        return st;
    if (sc->type == MHA_ROPE_SCALING_NONE) return MHA_OK;  // every feature rotated
    const int64_t dim = (int64_t)((double)s->d * prf);
    if (dim != s->d)
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "%s: partial_rotary_factor %g with rope_type %s: transformers' %s "
                         "attention rotates all %lld features of a head",
                         c->config_path, prf, tname, ad->name, (long long)s->d);
    // original_max_position_embeddings: top-level first (transformers'
    // priority), then inside, then max_position_embeddings
    int64_t omp;
    if ((st = cfg_int(&omp, &found, c, cfg, "", "original_max_position_embeddings", maxpos, 1)))
        return st;
    if (!found &&
        (st = cfg_int(&omp, NULL, c, r, pre, "original_max_position_embeddings", maxpos, 1)))
        return st;
    sc->original_max_position = sc->type == MHA_ROPE_SCALING_DYNAMIC ? maxpos : omp;
    double factor;
    if ((st = cfg_num(&factor, &found, c, r, pre, "factor", 0.0))) return st;
    if (!found && sc->type == MHA_ROPE_SCALING_YARN) factor = (double)maxpos / (double)omp;
    else if (!found)
        return mha__fail(MHA_ERR_FORMAT, "%s: %s (rope_type %s) has no \"factor\"",
                         c->config_path, rname, tname);
    if (!(factor > 0.0))
        return mha__fail(MHA_ERR_FORMAT, "%s: %sfactor %g must be positive", c->config_path,
                         pre, factor);
    sc->factor = factor;
    if (sc->type == MHA_ROPE_SCALING_LLAMA3) {
        if ((st = cfg_num(&sc->low_freq_factor, NULL, c, r, pre, "low_freq_factor", 1.0)) ||
            (st = cfg_num(&sc->high_freq_factor, NULL, c, r, pre, "high_freq_factor", 4.0)))
            return st;
    }
    if (sc->type == MHA_ROPE_SCALING_YARN) {
        double bf, bs;  // transformers: `or 32`, `or 1` (0 falls back too)
        if ((st = cfg_num(&bf, NULL, c, r, pre, "beta_fast", 0.0)) ||
            (st = cfg_num(&bs, NULL, c, r, pre, "beta_slow", 0.0)) ||
            (st = cfg_num(&sc->mscale, NULL, c, r, pre, "mscale", 0.0)) ||
            (st = cfg_num(&sc->mscale_all_dim, NULL, c, r, pre, "mscale_all_dim", 0.0)) ||
            (st = cfg_num(&sc->attention_factor, NULL, c, r, pre, "attention_factor", 0.0)) ||
            (st = cfg_bool(&sc->truncate, c, r, pre, "truncate", true)))
            return st;
        sc->beta_fast = bf != 0.0 ? bf : 32.0;
        sc->beta_slow = bs != 0.0 ? bs : 1.0;
    }
    return MHA_OK;
}

// The sliding window of the layer (-1: none), from W (the config's window,
// -1: none) and layer_types (default: sliding where default_sliding says).
static mha_status spec_window(ck_spec *s, const mha_checkpoint *c, int64_t layer, int64_t W,
                              bool default_sliding) {
    const cJSON *lt = item(c->config, "layer_types");
    bool sliding = default_sliding;
    if (lt) {
        if (!cJSON_IsArray(lt)) return bad_type(c, "", "layer_types", lt, "an array");
        if (cJSON_GetArraySize(lt) != c->num_layers)
            return mha__fail(MHA_ERR_FORMAT, "%s: layer_types has %d entries, expected %lld",
                             c->config_path, cJSON_GetArraySize(lt), (long long)c->num_layers);
        const cJSON *t = cJSON_GetArrayItem(lt, (int)layer);
        char key[48], q[CK_Q];
        snprintf(key, sizeof key, "layer_types[%lld]", (long long)layer);
        if (!cJSON_IsString(t)) return bad_type(c, "", key, t, "a string");
        if (strcmp(t->valuestring, "sliding_attention") == 0) sliding = true;
        else if (strcmp(t->valuestring, "full_attention") == 0) sliding = false;
        else
            return mha__fail(MHA_ERR_UNSUPPORTED,
                             "%s: %s is %s (supported: full_attention, sliding_attention)",
                             c->config_path, key, mha_escape(q, sizeof q, t->valuestring));
    }
    s->info.opts.window_left = sliding && W > 0 ? W - 1 : -1;
    return MHA_OK;
}

static mha_status layer_spec(ck_spec *s, const mha_checkpoint *c, int64_t layer) {
    const cJSON *cfg = c->config;
    const ck_arch_desc *ad = &archs[c->arch];
    const ck_arch a = c->arch;
    mha_status st;
    bool found;
    memset(s, 0, sizeof *s);
    mha_checkpoint_layer *info = &s->info;
    snprintf(info->model_type, sizeof info->model_type, "%s", ad->name);
    info->layer = layer;
    info->opts.window_left = -1;
    const bool g2 = a == ARCH_GPT2;
    if ((st = cfg_int(&s->E, &found, c, cfg, "", g2 ? "n_embd" : "hidden_size", ad->E, 1)))
        return st;
    if (g2 && !found && (st = cfg_int(&s->E, NULL, c, cfg, "", "hidden_size", ad->E, 1)))
        return st;
    if ((st = cfg_int(&s->H, &found, c, cfg, "", g2 ? "n_head" : "num_attention_heads", ad->H,
                      1)))
        return st;
    if (g2 && !found && (st = cfg_int(&s->H, NULL, c, cfg, "", "num_attention_heads", ad->H, 1)))
        return st;
    s->Hkv = s->H;
    if (arch_has_rope(a)) {
        const cJSON *kv = cJSON_GetObjectItemCaseSensitive(cfg, "num_key_value_heads");
        // absent: the class default; null: num_attention_heads
        int64_t def = kv ? s->H : (ad->Hkv ? ad->Hkv : s->H);
        if ((st = cfg_int(&s->Hkv, NULL, c, cfg, "", "num_key_value_heads", def, 1)))
            return st;
        if (s->H % s->Hkv != 0)
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: num_key_value_heads %lld does not divide "
                             "num_attention_heads %lld",
                             c->config_path, (long long)s->Hkv, (long long)s->H);
        if ((st = cfg_int(&s->d, NULL, c, cfg, "", "head_dim", ad->d ? ad->d : s->E / s->H, 1)))
            return st;
        if (s->d == 0)
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: hidden_size %lld / num_attention_heads %lld gives head_dim 0",
                             c->config_path, (long long)s->E, (long long)s->H);
    } else {
        if (s->E % s->H != 0)
            return mha__fail(MHA_ERR_FORMAT, "%s: %s %lld is not divisible by %s %lld",
                             c->config_path, g2 ? "n_embd" : "hidden_size", (long long)s->E,
                             g2 ? "n_head" : "num_attention_heads", (long long)s->H);
        s->d = s->E / s->H;
    }
    if (layer < 0 || layer >= c->num_layers)
        return mha__fail(MHA_ERR_INVALID_ARG, "%s: layer %lld is out of range [0, %lld)",
                         c->dir, (long long)layer, (long long)c->num_layers);

    // biases
    bool ab;
    if ((st = cfg_bool(&ab, c, cfg, "", "attention_bias", ad->bias))) return st;
    s->qkv_bias = s->o_bias = ab;
    if (a == ARCH_BERT || a == ARCH_GPT2) s->qkv_bias = s->o_bias = true;
    if (a == ARCH_MISTRAL) s->qkv_bias = s->o_bias = false;
    if (a == ARCH_QWEN2) s->qkv_bias = true, s->o_bias = false;

    // masks and scale
    info->opts.is_causal = true;
    info->opts.scale = 0.0;  // 1 / sqrt(d)
    int64_t W = -1;
    bool use_sw = true, default_sliding = false;
    switch (a) {
    case ARCH_BERT: {
        const char *pet;
        if ((st = cfg_bool(&info->opts.is_causal, c, cfg, "", "is_decoder", false)) ||
            (st = cfg_str(&pet, c, cfg, "", "position_embedding_type")))
            return st;
        if (pet && strcmp(pet, "absolute") != 0) {
            char q[CK_Q];
            return mha__fail(MHA_ERR_UNSUPPORTED,
                             "%s: position_embedding_type %s is not supported (absolute only)",
                             c->config_path, mha_escape(q, sizeof q, pet));
        }
        break;
    }
    case ARCH_GPT2: {
        bool saw, inv;
        if ((st = cfg_bool(&saw, c, cfg, "", "scale_attn_weights", true)) ||
            (st = cfg_bool(&inv, c, cfg, "", "scale_attn_by_inverse_layer_idx", false)))
            return st;
        double scale = saw ? 1.0 / sqrt((double)s->d) : 1.0;
        if (inv) scale /= (double)(layer + 1);
        if (!saw || inv) info->opts.scale = scale;
        break;
    }
    case ARCH_MISTRAL:
        if ((st = cfg_window(&W, c, ad->window))) return st;
        default_sliding = true;
        break;
    case ARCH_QWEN2:
    case ARCH_QWEN3: {
        int64_t mwl;
        if ((st = cfg_bool(&use_sw, c, cfg, "", "use_sliding_window", false)) ||
            (st = cfg_window(&W, c, ad->window)) ||
            (st = cfg_int(&mwl, NULL, c, cfg, "", "max_window_layers", 28, 0)))
            return st;
        if (!use_sw) W = -1;
        default_sliding = W > 0 && layer >= mwl;
        break;
    }
    case ARCH_GEMMA2: {
        bool bidir;
        double qpas, cap;
        if ((st = cfg_bool(&bidir, c, cfg, "", "use_bidirectional_attention", false)) ||
            (st = cfg_window(&W, c, ad->window)) ||
            (st = cfg_num(&qpas, NULL, c, cfg, "", "query_pre_attn_scalar", 256.0)) ||
            (st = cfg_num(&cap, NULL, c, cfg, "", "attn_logit_softcapping", 0.0)))
            return st;
        if (!item(cfg, "attn_logit_softcapping") &&
            !cJSON_GetObjectItemCaseSensitive(cfg, "attn_logit_softcapping"))
            cap = 50.0;  // absent: the class default; null: none
        if (bidir)
            return mha__fail(MHA_ERR_UNSUPPORTED,
                             "%s: use_bidirectional_attention is not supported",
                             c->config_path);
        if (!(qpas > 0.0))
            return mha__fail(MHA_ERR_FORMAT, "%s: query_pre_attn_scalar %g must be positive",
                             c->config_path, qpas);
        if (cap < 0.0 || cap > 3.0e38)
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: attn_logit_softcapping %g must be positive (or null)",
                             c->config_path, cap);
        info->opts.softcap = (float)cap;
        if (qpas != (double)s->d) info->opts.scale = 1.0 / sqrt(qpas);
        default_sliding = layer % 2 == 0;
        break;
    }
    case ARCH_GPT_OSS:
        if ((st = cfg_window(&W, c, ad->window))) return st;
        default_sliding = layer % 2 == 0;
        s->sinks = true;
        break;
    default: break;
    }
    if (arch_has_rope(a) && a != ARCH_MISTRAL &&
        (st = spec_window(s, c, layer, W, default_sliding)))
        return st;
    if (a == ARCH_MISTRAL) info->opts.window_left = W > 0 ? W - 1 : -1;
    if (a == ARCH_QWEN3) {
        s->qk_norm = true;
        if ((st = cfg_num(&s->eps, NULL, c, cfg, "", "rms_norm_eps", ad->eps))) return st;
        if (!(s->eps > 0.0))
            return mha__fail(MHA_ERR_FORMAT, "%s: rms_norm_eps %g must be positive",
                             c->config_path, s->eps);
    }
    if (arch_has_rope(a)) {
        if ((st = spec_rope(s, c))) return st;
    } else {
        mha_rope_init(&info->rope, MHA_ROPE_NONE);
    }
    return MHA_OK;
}

// ---------------------------------------------------------------------------
// The layer's tensors

typedef struct ck_want {
    const char *suffix;  // after the layer's attention prefix
    int ndim;
    int64_t shape[2];
    const char *param;  // destination; NULL: a known tensor not loaded
    int64_t row0;       // first row (or element) of the destination
    bool transpose;     // Conv1D: stored (in, out)
    bool required;
    mha_st_tensor t;
    bool found;
} ck_want;

#define CK_MAX_WANT 16

static void want(ck_want *w, int *n, const char *suffix, int ndim, int64_t d0, int64_t d1,
                 const char *param, int64_t row0, bool transpose, bool required) {
    ck_want *x = &w[(*n)++];
    memset(x, 0, sizeof *x);
    x->suffix = suffix;
    x->ndim = ndim;
    x->shape[0] = d0;
    x->shape[1] = d1;
    x->param = param;
    x->row0 = row0;
    x->transpose = transpose;
    x->required = required;
}

// The tensors of the layer's attention under the architecture's names.
static int layer_wants(ck_want *w, const ck_spec *s, ck_arch a) {
    const int64_t E = s->E, Eq = s->H * s->d, Ekv = s->Hkv * s->d;
    int n = 0;
    switch (a) {
    case ARCH_BERT:
        want(w, &n, "self.query.weight", 2, E, E, "in_proj_weight", 0, false, true);
        want(w, &n, "self.key.weight", 2, E, E, "in_proj_weight", E, false, true);
        want(w, &n, "self.value.weight", 2, E, E, "in_proj_weight", 2 * E, false, true);
        want(w, &n, "self.query.bias", 1, E, 0, "in_proj_bias", 0, false, true);
        want(w, &n, "self.key.bias", 1, E, 0, "in_proj_bias", E, false, true);
        want(w, &n, "self.value.bias", 1, E, 0, "in_proj_bias", 2 * E, false, true);
        want(w, &n, "output.dense.weight", 2, E, E, "out_proj.weight", 0, false, true);
        want(w, &n, "output.dense.bias", 1, E, 0, "out_proj.bias", 0, false, true);
        want(w, &n, "output.LayerNorm.weight", 1, E, 0, NULL, 0, false, false);
        want(w, &n, "output.LayerNorm.bias", 1, E, 0, NULL, 0, false, false);
        break;
    case ARCH_GPT2:
        want(w, &n, "c_attn.weight", 2, E, 3 * E, "in_proj_weight", 0, true, true);
        want(w, &n, "c_attn.bias", 1, 3 * E, 0, "in_proj_bias", 0, false, true);
        want(w, &n, "c_proj.weight", 2, E, E, "out_proj.weight", 0, true, true);
        want(w, &n, "c_proj.bias", 1, E, 0, "out_proj.bias", 0, false, true);
        // the causal-mask buffers older checkpoints saved
        want(w, &n, "bias", -1, 0, 0, NULL, 0, false, false);
        want(w, &n, "masked_bias", -1, 0, 0, NULL, 0, false, false);
        break;
    default:
        want(w, &n, "q_proj.weight", 2, Eq, E, "in_proj_weight", 0, false, true);
        want(w, &n, "k_proj.weight", 2, Ekv, E, "in_proj_weight", Eq, false, true);
        want(w, &n, "v_proj.weight", 2, Ekv, E, "in_proj_weight", Eq + Ekv, false, true);
        want(w, &n, "o_proj.weight", 2, E, Eq, "out_proj.weight", 0, false, true);
        if (s->qkv_bias) {
            want(w, &n, "q_proj.bias", 1, Eq, 0, "in_proj_bias", 0, false, true);
            want(w, &n, "k_proj.bias", 1, Ekv, 0, "in_proj_bias", Eq, false, true);
            want(w, &n, "v_proj.bias", 1, Ekv, 0, "in_proj_bias", Eq + Ekv, false, true);
        }
        if (s->o_bias) want(w, &n, "o_proj.bias", 1, E, 0, "out_proj.bias", 0, false, true);
        if (s->qk_norm) {
            want(w, &n, "q_norm.weight", 1, s->d, 0, "q_norm.weight", 0, false, true);
            want(w, &n, "k_norm.weight", 1, s->d, 0, "k_norm.weight", 0, false, true);
        }
        if (s->sinks) want(w, &n, "sinks", 1, s->H, 0, "sinks", 0, false, true);
        want(w, &n, "rotary_emb.inv_freq", -1, 0, 0, NULL, 0, false, false);
        break;
    }
    return n;
}

// The prefix ("" or the architecture's) under which the checkpoint holds
// the layer's attention, as the full attention prefix in buf.
static mha_status layer_prefix(char *buf, size_t cap, const mha_checkpoint *c, int64_t layer) {
    const ck_arch_desc *ad = &archs[c->arch];
    char core[96], cand[2][160];
    snprintf(core, sizeof core, ad->core, (long long)layer);
    snprintf(cand[0], sizeof cand[0], "%s", core);
    snprintf(cand[1], sizeof cand[1], "%s%s", ad->prefix, core);
    int hits[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        const size_t n = strlen(cand[k]);
        for (int64_t i = 0; i < c->nnames && !hits[k]; i++)
            hits[k] = strncmp(c->names[i].name, cand[k], n) == 0;
    }
    if (hits[0] && hits[1])
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: holds tensors under both \"%s*\" and \"%s*\" (which layer?)",
                         where(c), cand[0], cand[1]);
    if (!hits[0] && !hits[1])
        return mha__fail(MHA_ERR_NOT_FOUND,
                         "%s: no tensor of layer %lld's attention (looked for \"%s*\" and "
                         "\"%s*\")",
                         where(c), (long long)layer, cand[0], cand[1]);
    snprintf(buf, cap, "%s", cand[hits[0] ? 0 : 1]);
    return MHA_OK;
}

// Finds every tensor of the layer's attention and checks its dtype and
// shape; a tensor under the prefix that is not expected is an error.
static mha_status find_layer_tensors(ck_want *w, int nw, const mha_checkpoint *c,
                                     const char *prefix, int64_t layer) {
    const size_t pl = strlen(prefix);
    char q[CK_Q], s1[96], s2[96];
    mha_status st;
    for (int64_t i = 0; i < c->nnames; i++) {
        const char *name = c->names[i].name;
        if (strncmp(name, prefix, pl) != 0) continue;
        int k = 0;
        while (k < nw && strcmp(name + pl, w[k].suffix) != 0) k++;
        if (k == nw)
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: unexpected tensor %s in layer %lld's attention (not a "
                             "parameter of a %s layer with this config)",
                             where(c), mha_escape(q, sizeof q, name), (long long)layer,
                             archs[c->arch].name);
        if ((st = mha_checkpoint_find(&w[k].t, c, name))) return st;
        w[k].found = true;
    }
    for (int k = 0; k < nw; k++) {
        char full[256];
        snprintf(full, sizeof full, "%s%s", prefix, w[k].suffix);
        mha_escape(q, sizeof q, full);
        if (!w[k].found) {
            if (w[k].required)
                return mha__fail(MHA_ERR_NOT_FOUND,
                                 "%s: layer %lld's attention has no tensor %s", where(c),
                                 (long long)layer, q);
            continue;
        }
        if (w[k].ndim < 0) continue;  // a buffer we skip, whatever its shape
        const mha_st_tensor *t = &w[k].t;
        if (t->dtype != MHA_F32 && t->dtype != MHA_F16 && t->dtype != MHA_BF16)
            return mha__fail(MHA_ERR_DTYPE,
                             "%s: tensor %s has dtype %s (F32, F16 or "
                             "BF16 load)",
                             where(c), q, mha_dtype_name(t->dtype));
        bool ok = t->ndim == w[k].ndim;
        for (int dd = 0; ok && dd < t->ndim; dd++) ok = t->shape[dd] == w[k].shape[dd];
        if (!ok)
            return mha__fail(MHA_ERR_SHAPE, "%s: tensor %s has shape %s, the config says %s",
                             where(c), q, mha__shape_str(s1, sizeof s1, t->ndim, t->shape),
                             mha__shape_str(s2, sizeof s2, w[k].ndim, w[k].shape));
    }
    return MHA_OK;
}

// Writes one tensor into rows [row0, ...) of its parameter.
static mha_status write_tensor(mha_module *m, const ck_want *w) {
    mha_param p;
    mha_status st = mha_module_param(&p, m, w->param);
    if (st) return st;
    const int64_t cols = p.ndim == 2 ? p.shape[1] : 1;
    const size_t es = mha_dtype_size(p.dtype);
    char *dst = (char *)p.storage + (size_t)(w->row0 * cols) * es;
    const size_t bytes = (size_t)w->t.numel * es;
    if (!w->transpose) return mha_st_read(dst, bytes, p.dtype, &w->t);
    // Conv1D (in, out) -> rows of (out, in)
    const int64_t in = w->t.shape[0], out = w->t.shape[1];
    float *tmp = mha__malloc(sizeof(float) * (size_t)(w->t.numel ? w->t.numel : 1));
    if (!tmp) return mha__fail(MHA_ERR_NOMEM, "out of memory transposing %s", w->t.name);
    if ((st = mha_st_read(tmp, sizeof(float) * (size_t)w->t.numel, MHA_F32, &w->t))) {
        free(tmp);
        return st;
    }
    for (int64_t r = 0; r < out; r++)
        for (int64_t k = 0; k < in; k++) {
            const float v = tmp[k * out + r];
            const size_t at = (size_t)(r * in + k);
            if (p.dtype == MHA_F32) ((float *)dst)[at] = v;
            else
                ((uint16_t *)dst)[at] = p.dtype == MHA_BF16 ? mha_f32_to_bf16(v)
                                                            : mha_f32_to_f16(v);
        }
    free(tmp);
    return MHA_OK;
}

mha_status mha_checkpoint_load_layer(mha_module **out, mha_checkpoint_layer *info,
                                     const mha_checkpoint *c, int64_t layer,
                                     const mha_config *base) {
    if (!out || !c)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_checkpoint_load_layer: NULL argument");
    *out = NULL;
    ck_spec s;
    mha_status st = layer_spec(&s, c, layer);
    if (st) return st;
    char prefix[200];
    if ((st = layer_prefix(prefix, sizeof prefix, c, layer))) return st;
    ck_want w[CK_MAX_WANT];
    const int nw = layer_wants(w, &s, c->arch);
    if ((st = find_layer_tensors(w, nw, c, prefix, layer))) return st;

    // the module: q/k/v packed into in_proj_weight (exact)
    mha_config cfg;
    mha_config_init(&cfg, s.E, s.H);
    cfg.num_kv_heads = s.Hkv;
    if (s.d * s.H != s.E) cfg.head_dim = s.d;
    cfg.bias = s.qkv_bias;
    cfg.no_out_bias = s.qkv_bias && !s.o_bias;
    cfg.qk_norm = s.qk_norm ? MHA_QK_NORM_HEAD : MHA_QK_NORM_NONE;
    cfg.qk_norm_eps = s.qk_norm ? (float)s.eps : 0.0f;
    cfg.sinks = s.sinks;
    cfg.batch_first = base ? base->batch_first : true;
    cfg.weight_dtype = base ? base->weight_dtype : MHA_F32;
    mha_module *m = NULL;
    if ((st = mha_module_create(&m, &cfg))) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", mha_last_error());
        return mha__fail(st, "%s: layer %lld of a %s checkpoint: %s", c->dir, (long long)layer,
                         archs[c->arch].name, msg);
    }
    for (int k = 0; k < nw && !st; k++)
        if (w[k].found && w[k].param) st = write_tensor(m, &w[k]);
    if (st) {
        mha_module_destroy(m);
        return st;
    }
    if (info) *info = s.info;
    *out = m;
    return MHA_OK;
}

mha_status mha_module_load_checkpoint(mha_module **out, mha_checkpoint_layer *info,
                                      const char *dir, int64_t layer, const mha_config *base) {
    if (!out) return mha__fail(MHA_ERR_INVALID_ARG, "mha_module_load_checkpoint: out is NULL");
    *out = NULL;
    mha_checkpoint *c;
    mha_status st = mha_checkpoint_open(&c, dir);
    if (st) return st;
    st = mha_checkpoint_load_layer(out, info, c, layer, base);
    mha_checkpoint_close(c);
    return st;
}

void mha_checkpoint_layer_apply(const mha_checkpoint_layer *info, mha_forward_args *a) {
    if (!info || !a) return;
    a->opts.is_causal = info->opts.is_causal;
    a->opts.window_left = info->opts.window_left;
    a->opts.window_right = -1;
    a->rope = info->rope;
    a->rope_scaling = info->rope_scaling.type != MHA_ROPE_SCALING_NONE ? &info->rope_scaling
                                                                       : NULL;
    a->opts.softcap = info->opts.softcap;
    a->opts.scale = info->opts.scale;
}
