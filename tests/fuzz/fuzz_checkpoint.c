// fuzz_checkpoint.c: libFuzzer target for the Hugging Face checkpoint
// reader (mha_checkpoint_open, mha_checkpoint_load_layer): config.json and
// model.safetensors.index.json from the input, in a directory that also
// holds fixed shard files (and a symlink and a file outside it).
//
// Input layout (tests/fuzz/make_corpus.py writes seeds):
//   [0]  flags: 0x0f the layer asked for; 0x10 write the index (else no
//        index: model.safetensors is used); 0x20 model.safetensors is the
//        input's third part (else the fixed llama layer file); 0x40 BF16
//        weights into the module (base weight_dtype); 0x80 base NULL
//   then config.json's bytes, a 0x00 byte, the index's bytes, a 0x00 byte,
//   the third part (to the end).
// Fixed files in the directory: a.safetensors (layers.0 of a llama with
// E 8, H 2, Hkv 1: q/k/v/o_proj), b.safetensors (layer 1 of it, with
// biases), g.safetensors (a GPT-2 layer 0, E 8), e.safetensors (bert layer
// 0, E 8), bad.safetensors (not a safetensors file), link.safetensors (a
// symlink to a file outside the directory), sub/a.safetensors (a copy of
// a); outside the directory: ../outside.safetensors.
//
// Invariants: every call returns MHA_OK or an error with a non-empty,
// one-line message, never MHA_ERR_NOMEM (the files are small); a failed
// load leaves *out NULL; a loaded module's config is what a checkpoint
// layer can give (E, H > 0, Hkv dividing H, batch_first as asked), its
// parameters readable, and the layer's options sane (window_left >= -1,
// a RoPE theta > 0, scale >= 0 (0: the default) and finite, softcap >= 0). Crashes,
// sanitizer reports and leaks are findings.
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mha.h"

static void require(int ok, const char *fmt, ...) {
    if (ok) return;
    va_list ap;
    va_start(ap, fmt);
    fputs("fuzz_checkpoint: invariant broken: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}

static void require_status(mha_status st, const char *what) {
    if (st == MHA_OK) return;
    const char *msg = mha_last_error();
    require(st != MHA_ERR_NOMEM, "%s: MHA_ERR_NOMEM on small files: %s", what, msg);
    require(msg && msg[0] != '\0', "%s: empty error message", what);
    require(strchr(msg, '\n') == NULL, "%s: multi-line message: %s", what, msg);
}

static char g_root[256], g_dir[300];

static void put(const char *name, const void *data, size_t n) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", g_dir, name);
    FILE *f = fopen(p, "wb");
    require(f != NULL, "cannot write %s", p);
    if (n) require(fwrite(data, 1, n, f) == n, "short write %s", p);
    fclose(f);
}

static void drop(const char *name) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", g_dir, name);
    unlink(p);
}

// A safetensors file of F32 tensors (values i * 0.01) at path.
static void write_st(const char *path, int n, const char *const *names, const int *ndim,
                     const int64_t (*shape)[2]) {
    mha_st_writer *w;
    require(mha_st_writer_create(&w) == MHA_OK, "writer");
    for (int k = 0; k < n; k++) {
        int64_t numel = shape[k][0] * (ndim[k] > 1 ? shape[k][1] : 1);
        float *v = calloc((size_t)numel, sizeof(float));
        for (int64_t i = 0; i < numel; i++) v[i] = (float)i * 0.01f;
        require(mha_st_writer_add(w, names[k], MHA_F32, ndim[k], shape[k], v) == MHA_OK,
                "add %s", names[k]);
        free(v);
    }
    require(mha_st_writer_save(w, path) == MHA_OK, "save %s", path);
    mha_st_writer_destroy(w);
}

static void cleanup(void) {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_root);
    if (system(cmd) != 0) fprintf(stderr, "fuzz_checkpoint: could not remove %s\n", g_root);
}

static void setup(void) {
    if (g_dir[0]) return;
    const char *t = getenv("TMPDIR");
    snprintf(g_root, sizeof g_root, "%s/fuzz_checkpoint.XXXXXX", t && *t ? t : "/tmp");
    require(mkdtemp(g_root) != NULL, "mkdtemp %s", g_root);
    atexit(cleanup);
    snprintf(g_dir, sizeof g_dir, "%s/ck", g_root);
    require(mkdir(g_dir, 0755) == 0, "mkdir %s", g_dir);
    char p[512];
    snprintf(p, sizeof p, "%s/sub", g_dir);
    require(mkdir(p, 0755) == 0, "mkdir %s", p);
    static const char *const la[] = {
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight"};
    static const char *const lb[] = {
        "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.o_proj.weight",
        "model.layers.1.self_attn.q_proj.bias",   "model.layers.1.self_attn.k_proj.bias",
        "model.layers.1.self_attn.v_proj.bias",   "model.layers.1.self_attn.o_proj.bias"};
    static const int nd[] = {2, 2, 2, 2, 1, 1, 1, 1};
    static const int64_t sh[][2] = {{8, 8}, {4, 8}, {4, 8}, {8, 8},
                                    {8, 0}, {4, 0}, {4, 0}, {8, 0}};
    snprintf(p, sizeof p, "%s/a.safetensors", g_dir);
    write_st(p, 4, la, nd, sh);
    snprintf(p, sizeof p, "%s/sub/a.safetensors", g_dir);
    write_st(p, 4, la, nd, sh);
    snprintf(p, sizeof p, "%s/b.safetensors", g_dir);
    write_st(p, 8, lb, nd, sh);
    static const char *const g[] = {"h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias",
                                    "h.0.attn.c_proj.weight", "h.0.attn.c_proj.bias"};
    static const int gnd[] = {2, 1, 2, 1};
    static const int64_t gsh[][2] = {{8, 24}, {24, 0}, {8, 8}, {8, 0}};
    snprintf(p, sizeof p, "%s/g.safetensors", g_dir);
    write_st(p, 4, g, gnd, gsh);
    static const char *const e[] = {"encoder.layer.0.attention.self.query.weight",
                                    "encoder.layer.0.attention.self.query.bias",
                                    "encoder.layer.0.attention.self.key.weight",
                                    "encoder.layer.0.attention.self.key.bias",
                                    "encoder.layer.0.attention.self.value.weight",
                                    "encoder.layer.0.attention.self.value.bias",
                                    "encoder.layer.0.attention.output.dense.weight",
                                    "encoder.layer.0.attention.output.dense.bias"};
    static const int end[] = {2, 1, 2, 1, 2, 1, 2, 1};
    static const int64_t esh[][2] = {{8, 8}, {8, 0}, {8, 8}, {8, 0},
                                     {8, 8}, {8, 0}, {8, 8}, {8, 0}};
    snprintf(p, sizeof p, "%s/e.safetensors", g_dir);
    write_st(p, 8, e, end, esh);
    put("bad.safetensors", "not a safetensors file", 22);
    snprintf(p, sizeof p, "%s/outside.safetensors", g_root);
    write_st(p, 4, la, nd, sh);
    char l[512];
    snprintf(l, sizeof l, "%s/link.safetensors", g_dir);
    require(symlink(p, l) == 0, "symlink %s", l);
}

// The part of data up to the next 0x00 (or the end): [*at, end), *at
// moved past the 0x00.
static size_t part(const uint8_t *data, size_t size, size_t *at, const uint8_t **out) {
    size_t b = *at, e = b;
    while (e < size && data[e] != 0) e++;
    *out = data + b;
    *at = e < size ? e + 1 : e;
    return e - b;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    setup();
    if (size < 1) return 0;
    const uint8_t flags = data[0];
    size_t at = 1;
    const uint8_t *cfg, *idx, *third;
    size_t ncfg = part(data, size, &at, &cfg);
    size_t nidx = part(data, size, &at, &idx);
    size_t nthird = size - at;
    third = data + at;
    put("config.json", cfg, ncfg);
    if (flags & 0x10) put("model.safetensors.index.json", idx, nidx);
    else drop("model.safetensors.index.json");
    if (flags & 0x20) {
        put("model.safetensors", third, nthird);
    } else {
        char src[512], dst[512];
        snprintf(src, sizeof src, "%s/a.safetensors", g_dir);
        snprintf(dst, sizeof dst, "%s/model.safetensors", g_dir);
        unlink(dst);
        require(link(src, dst) == 0, "link %s", dst);
    }
    mha_checkpoint *c = NULL;
    mha_status st = mha_checkpoint_open(&c, g_dir);
    require_status(st, "mha_checkpoint_open");
    require((st == MHA_OK) == (c != NULL), "open: status %d with handle %p", (int)st, (void *)c);
    if (!c) return 0;
    require(mha_checkpoint_num_layers(c) >= 1, "num_layers %lld",
            (long long)mha_checkpoint_num_layers(c));
    require(strlen(mha_checkpoint_model_type(c)) > 0, "empty model_type");
    double v;
    require_status(mha_checkpoint_config_number(&v, c, "hidden_size"), "config_number");
    mha_st_tensor t;
    require_status(mha_checkpoint_find(&t, c, "model.layers.0.self_attn.q_proj.weight"), "find");
    mha_config base;
    mha_config_init(&base, 0, 0);
    base.batch_first = true;
    base.weight_dtype = flags & 0x40 ? MHA_BF16 : MHA_F32;
    for (int64_t layer = flags & 0x0f; layer <= (flags & 0x0f) + 1; layer++) {
        mha_module *m = (mha_module *)&base;  // must come back NULL on failure
        mha_checkpoint_layer info;
        st = mha_checkpoint_load_layer(&m, &info, c, layer, flags & 0x80 ? NULL : &base);
        require_status(st, "mha_checkpoint_load_layer");
        require((st == MHA_OK) == (m != NULL), "load: status %d with module %p", (int)st,
                (void *)m);
        if (!m) continue;
        const mha_config *mc = mha_module_config(m);
        require(mc->embed_dim > 0 && mc->num_heads > 0 && mc->num_kv_heads > 0 &&
                    mc->num_heads % mc->num_kv_heads == 0 && mc->batch_first,
                "module config E %lld H %lld Hkv %lld", (long long)mc->embed_dim,
                (long long)mc->num_heads, (long long)mc->num_kv_heads);
        for (int i = 0; i < mha_module_num_params(m); i++) {
            mha_param p;
            require(mha_module_param_at(&p, m, i) == MHA_OK, "param %d", i);
        }
        require(info.layer == layer && info.opts.window_left >= -1, "layer %lld window %lld",
                (long long)info.layer, (long long)info.opts.window_left);
        require(info.rope.mode == MHA_ROPE_NONE || info.rope.theta > 0.0, "theta %g",
                info.rope.theta);
        require(info.opts.scale >= 0.0 && isfinite(info.opts.scale) && info.opts.softcap >= 0.0f,
                "scale %g softcap %g", info.opts.scale, (double)info.opts.softcap);
        mha_forward_args a;
        mha_forward_args_init(&a);
        mha_checkpoint_layer_apply(&info, &a);
        mha_module_destroy(m);
    }
    mha_checkpoint_close(c);
    return 0;
}
