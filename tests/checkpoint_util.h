// checkpoint_util.h: the small Hugging Face checkpoint directories that
// test_checkpoint.c and the allocation-failure sweep (tests/alloc) build:
// config.json and safetensors files of named tensors whose values tell
// tensors and positions apart (value_of), a two-layer LLaMA layer in one
// file or in two shards listed by an index, and a two-layer GPT-2 one
// (Conv1D weights, a BF16 c_proj, buffers the loader skips).
#ifndef MHA_TEST_CHECKPOINT_UTIL_H
#define MHA_TEST_CHECKPOINT_UTIL_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "check.h"
#include "mha.h"

static inline void path_of(char *buf, size_t cap, const char *dir, const char *name) {
    snprintf(buf, cap, "%s/%s", dir, name);
}

static inline void write_text(const char *dir, const char *name, const char *text) {
    char p[1024];
    path_of(p, sizeof p, dir, name);
    FILE *f = fopen(p, "wb");
    CHECKF(f != NULL, "cannot write %s", p);
    if (!f) return;
    fputs(text, f);
    fclose(f);
}

// Element i of tensor `name`: a value that tells tensors and positions apart.
static inline float value_of(const char *name, int64_t i) {
    unsigned h = 0;
    for (const char *c = name; *c; c++) h = h * 31u + (unsigned char)*c;
    return (float)((h % 97u) + 1) * 0.01f + (float)i * 0.001f;
}

typedef struct tensor_spec {
    const char *name;
    int ndim;
    int64_t shape[2];
    mha_dtype dtype;
} tensor_spec;

// Writes the tensors into dir/file (values value_of; F32, BF16 or I64).
static inline void write_tensors(const char *dir, const char *file, const tensor_spec *t,
                                 int n) {
    mha_st_writer *w;
    CHECK_OK(mha_st_writer_create(&w));
    for (int k = 0; k < n; k++) {
        int64_t numel = t[k].shape[0] * (t[k].ndim > 1 ? t[k].shape[1] : 1);
        void *buf = calloc((size_t)numel, 8);
        for (int64_t i = 0; i < numel; i++) {
            float v = value_of(t[k].name, i);
            if (t[k].dtype == MHA_F32) ((float *)buf)[i] = v;
            else if (t[k].dtype == MHA_BF16) ((uint16_t *)buf)[i] = mha_f32_to_bf16(v);
            else ((int64_t *)buf)[i] = i;
        }
        CHECK_OK(mha_st_writer_add(w, t[k].name, t[k].dtype, t[k].ndim, t[k].shape, buf));
        free(buf);
    }
    char p[1024];
    path_of(p, sizeof p, dir, file);
    CHECK_OK(mha_st_writer_save(w, p));
    mha_st_writer_destroy(w);
}

// A LLaMA layer: E 8, H 2, Hkv 1, d 4.
static const char *llama_config =
    "{\"model_type\": \"llama\", \"hidden_size\": 8, \"num_attention_heads\": 2,\n"
    " \"num_key_value_heads\": 1, \"num_hidden_layers\": 2, \"rope_theta\": 500.0,\n"
    " \"attention_bias\": false, \"rope_scaling\": null}\n";

// Layer `layer` (0 or 1)'s four tensors, named prefix + "layers.<layer>...".
static inline int llama_tensors(tensor_spec *t, int layer, const char *prefix) {
    static char names[2][4][96];
    const char *suf[4] = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"};
    const int64_t rows[4] = {8, 4, 4, 8}, cols[4] = {8, 8, 8, 8};
    for (int k = 0; k < 4; k++) {
        snprintf(names[layer][k], sizeof names[layer][k], "%slayers.%d.self_attn.%s", prefix,
                 layer, suf[k]);
        t[k] = (tensor_spec){names[layer][k], 2, {rows[k], cols[k]}, MHA_F32};
    }
    return 4;
}

// A two-layer llama checkpoint in dir (one file), with the given config.
static inline void make_llama(const char *dir, const char *config, const char *prefix) {
    tensor_spec t[8];
    int n = llama_tensors(t, 0, prefix);
    n += llama_tensors(t + n, 1, prefix);
    write_tensors(dir, "model.safetensors", t, n);
    write_text(dir, "config.json", config ? config : llama_config);
}

// A two-layer llama checkpoint in dir, sharded: layer 0 in
// model-00001-of-00002.safetensors, layer 1 in
// sub/model-00002-of-00002.safetensors (sub/ made here), listed by
// model.safetensors.index.json, whose text goes to index (cap bytes); t:
// the eight tensors, layer 0's first.
static inline void make_llama_sharded(char *index, size_t cap, tensor_spec t[8],
                                      const char *dir) {
    llama_tensors(t, 0, "model.");
    llama_tensors(t + 4, 1, "model.");
    write_tensors(dir, "model-00001-of-00002.safetensors", t, 4);
    char sub[1024];
    path_of(sub, sizeof sub, dir, "sub");
    CHECKF(mkdir(sub, 0755) == 0 || errno == EEXIST, "cannot make %s", sub);
    write_tensors(dir, "sub/model-00002-of-00002.safetensors", t + 4, 4);
    write_text(dir, "config.json", llama_config);
    size_t n = (size_t)snprintf(index, cap,
                                "{\"metadata\": {\"total_size\": 1}, \"weight_map\": {");
    for (int k = 0; k < 8 && n < cap; k++)
        n += (size_t)snprintf(index + n, cap - n, "%s\"%s\": \"%s\"", k ? ", " : "", t[k].name,
                              k < 4 ? "model-00001-of-00002.safetensors"
                                    : "sub/model-00002-of-00002.safetensors");
    if (n < cap) snprintf(index + n, cap - n, "}}");
    write_text(dir, "model.safetensors.index.json", index);
}

// A two-layer GPT-2 checkpoint (E 8, H 2; scale_attn_by_inverse_layer_idx)
// in dir: Conv1D weights (in, out), layer 0's c_proj in BF16, and two
// tensors the loader skips (an old causal-mask buffer, a layer norm).
static const tensor_spec gpt2_tensors[10] = {
    {"transformer.h.0.attn.c_attn.weight", 2, {8, 24}, MHA_F32},
    {"transformer.h.0.attn.c_attn.bias", 1, {24, 0}, MHA_F32},
    {"transformer.h.0.attn.c_proj.weight", 2, {8, 8}, MHA_BF16},
    {"transformer.h.0.attn.c_proj.bias", 1, {8, 0}, MHA_F32},
    {"transformer.h.0.attn.bias", 2, {4, 4}, MHA_F32},
    {"transformer.h.0.ln_1.weight", 1, {8, 0}, MHA_F32},
    {"transformer.h.1.attn.c_attn.weight", 2, {8, 24}, MHA_F32},
    {"transformer.h.1.attn.c_attn.bias", 1, {24, 0}, MHA_F32},
    {"transformer.h.1.attn.c_proj.weight", 2, {8, 8}, MHA_F32},
    {"transformer.h.1.attn.c_proj.bias", 1, {8, 0}, MHA_F32},
};

static inline void make_gpt2(const char *dir) {
    write_tensors(dir, "model.safetensors", gpt2_tensors, 10);
    write_text(dir, "config.json",
               "{\"model_type\": \"gpt2\", \"n_embd\": 8, \"n_head\": 2, \"n_layer\": 2,\n"
               " \"scale_attn_by_inverse_layer_idx\": true}");
}

#endif
