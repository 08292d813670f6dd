// checkpoint.h: what the files of the Hugging Face checkpoint loader share
// (checkpoint.c: the directory, config.json, the index and its shards, the
// typed config values; checkpoint_spec.c: a layer's spec from the config;
// checkpoint_load.c: the layer's tensors under the architecture's names,
// loaded into a module). Internal to the model layer.
#ifndef MHA_CHECKPOINT_H
#define MHA_CHECKPOINT_H

#include <stdbool.h>
#include <stdint.h>

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

// One row per architecture (checkpoint.c).
extern const ck_arch_desc mha__ck_archs[ARCH_COUNT];

static inline bool mha__ck_has_rope(ck_arch a) { return a != ARCH_BERT && a != ARCH_GPT2; }

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

#define CK_Q 200  // room for a quoted name in a message

// Typed config values (checkpoint.c). Each looks key up in obj (the config
// or a nested object named by pre, e.g. "rope_parameters."); absent or
// null: *found false and the default. A value of the wrong type is
// MHA_ERR_FORMAT naming the key and the file.
const cJSON *mha__ck_item(const cJSON *obj, const char *key);
mha_status mha__ck_bad_type(const mha_checkpoint *c, const char *pre, const char *key,
                            const cJSON *v, const char *expected);
mha_status mha__ck_num(double *out, bool *found, const mha_checkpoint *c, const cJSON *obj,
                       const char *pre, const char *key, double def);
// An integer in [lo, 2^53).
mha_status mha__ck_int(int64_t *out, bool *found, const mha_checkpoint *c, const cJSON *obj,
                       const char *pre, const char *key, int64_t def, int64_t lo);
mha_status mha__ck_bool(bool *out, const mha_checkpoint *c, const cJSON *obj, const char *pre,
                        const char *key, bool def);
// The sliding_window (-1: none): absent takes the class default def, null
// is none (transformers' None).
mha_status mha__ck_window(int64_t *out, const mha_checkpoint *c, int64_t def);
mha_status mha__ck_str(const char **out, const mha_checkpoint *c, const cJSON *obj,
                       const char *pre, const char *key);
// Where messages say a tensor was looked for: the index, or the file.
const char *mha__ck_where(const mha_checkpoint *c);

// A layer's spec from the config (checkpoint_spec.c).
typedef struct ck_spec {
    int64_t E, H, Hkv, d;
    bool qkv_bias, o_bias;
    bool qk_norm;
    double eps;
    bool sinks;
    mha_checkpoint_layer info;
} ck_spec;

// Fills s for layer of c: shapes, biases, masks and scale, window, RoPE.
mha_status mha__ck_layer_spec(ck_spec *s, const mha_checkpoint *c, int64_t layer);

#endif
