// test_errors.c: every documented misuse of the forward and SDPA entry
// points returns the right status with a message naming the problem and the
// values; nothing is printed (stdout and stderr are captured during the
// calls and must stay empty), nothing exits; the log callback sees each
// message.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "mha.h"

static int g_logged;
static void on_log(mha_status s, const char *msg, void *user) {
    (void)s;
    (void)msg;
    (*(int *)user)++;
}

// The message must contain every one of the given substrings.
static void msg_has(const char *a, const char *b) {
    const char *m = mha_last_error();
    CHECKF(strstr(m, a) && (!b || strstr(m, b)), "message \"%s\" lacks \"%s\"/\"%s\"", m, a,
           b ? b : "");
}

enum { E = 8, H = 2, L = 3, S = 4, N = 2 };
static float q[L * N * E], kv[S * N * E], y[L * N * E], w[N * H * L * (S + 1)];
static uint8_t bmask[N * H * L * S];

static mha_tensor T3(void *p, int64_t a, int64_t b, int64_t c) {
    return mha_tensor_contiguous(p, MHA_F32, 3, (int64_t[]){a, b, c});
}

static void forward_errors(void) {
    mha_config c;
    mha_config_init(&c, E, H);
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, &c));
    mha_tensor qt = T3(q, L, N, E), kt = T3(kv, S, N, E), yt = T3(y, L, N, E);
    mha_tensor wt = T3(w, N, L, S);
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = &qt;
    a.key = a.value = &kt;
    CHECK_OK(mha_forward(&yt, NULL, m, &a));  // the baseline is valid

    CHECK_FAILS(mha_forward(&yt, NULL, NULL, &a), MHA_ERR_INVALID_ARG);
    CHECK_FAILS(mha_forward(&yt, NULL, m, NULL), MHA_ERR_INVALID_ARG);
    CHECK_FAILS(mha_forward(NULL, NULL, m, &a), MHA_ERR_INVALID_ARG);
    mha_forward_args b = a;
    b.query = NULL;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &b), MHA_ERR_INVALID_ARG);
    msg_has("query", NULL);

    // wrong embed dim of the query
    mha_tensor q7 = T3(q, L, N, 7);
    b = a;
    b.query = &q7;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &b), MHA_ERR_SHAPE);
    msg_has("embed_dim", "7");
    // key with the wrong feature size (kdim)
    mha_tensor k5 = T3(kv, S, N, 5);
    b = a;
    b.key = &k5;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &b), MHA_ERR_SHAPE);
    msg_has("kdim", "5");
    b = a;
    b.value = &k5;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &b), MHA_ERR_SHAPE);
    msg_has("vdim", "5");
    // batch mismatch
    mha_tensor k1 = T3(kv, S, 1, E);
    b = a;
    b.key = b.value = &k1;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &b), MHA_ERR_SHAPE);
    msg_has("batch", NULL);
    // key and value lengths differ
    mha_tensor v3 = T3(kv, 3, N, E);
    b = a;
    b.value = &v3;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &b), MHA_ERR_SHAPE);
    msg_has("key", "value");
    // dims: 4-D query, mixed 2-D/3-D
    mha_tensor q4 = mha_tensor_contiguous(q, MHA_F32, 4, (int64_t[]){1, L, N, E});
    b = a;
    b.query = &q4;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &b), MHA_ERR_SHAPE);
    mha_tensor k2 = mha_tensor_contiguous(kv, MHA_F32, 2, (int64_t[]){S, E});
    b = a;
    b.key = b.value = &k2;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &b), MHA_ERR_SHAPE);
    // dtype, negative dim, NULL data
    mha_tensor qh = qt;
    qh.dtype = MHA_I32;  // not a float type (F32, F64, BF16 and F16 are)
    b = a;
    b.query = &qh;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &b), MHA_ERR_DTYPE);
    msg_has("I32", NULL);
    mha_tensor qn = qt;
    qn.shape[0] = -1;
    b.query = &qn;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &b), MHA_ERR_SHAPE);
    mha_tensor q0 = qt;
    q0.data = NULL;
    b.query = &q0;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &b), MHA_ERR_INVALID_ARG);
    mha_tensor qo = qt;
    qo.shape[0] = INT64_MAX / 2;
    qo.shape[1] = 4;
    b.query = &qo;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &b), MHA_ERR_OVERFLOW);

    // key_padding_mask: wrong shape, wrong dtype
    mha_tensor kp = mha_tensor_contiguous(bmask, MHA_BOOL, 2, (int64_t[]){N, S + 1});
    b = a;
    b.key_padding_mask = &kp;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &b), MHA_ERR_SHAPE);
    msg_has("key_padding_mask", "(2, 5)");
    kp = mha_tensor_contiguous(bmask, MHA_I32, 2, (int64_t[]){N, S});
    CHECK_FAILS(mha_forward(&yt, NULL, m, &b), MHA_ERR_DTYPE);
    // attn_mask: (L, S+1), (N*H+1, L, S), 4-D
    mha_tensor am = mha_tensor_contiguous(bmask, MHA_BOOL, 2, (int64_t[]){L, S + 1});
    b = a;
    b.attn_mask = &am;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &b), MHA_ERR_SHAPE);
    msg_has("attn_mask", "(3, 5)");
    am = mha_tensor_contiguous(bmask, MHA_BOOL, 3, (int64_t[]){N * H + 1, L, S});
    CHECK_FAILS(mha_forward(&yt, NULL, m, &b), MHA_ERR_SHAPE);
    msg_has("N*num_heads", "(4, 3, 4)");
    am = mha_tensor_contiguous(bmask, MHA_BOOL, 3, (int64_t[]){N * H, L, S});
    CHECK_OK(mha_forward(&yt, NULL, m, &b));

    // outputs: wrong shape, missing weights, wrong weights shape, aliasing
    mha_tensor yb = T3(y, N, L, E);
    CHECK_FAILS(mha_forward(&yb, NULL, m, &a), MHA_ERR_SHAPE);
    msg_has("attn_output", "(2, 3, 8)");
    b = a;
    b.need_weights = true;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &b), MHA_ERR_INVALID_ARG);
    mha_tensor wbad = T3(w, N, L, S + 1);
    CHECK_FAILS(mha_forward(&yt, &wbad, m, &b), MHA_ERR_SHAPE);
    CHECK_OK(mha_forward(&yt, &wt, m, &b));
    mha_tensor yq = T3(q, L, N, E);
    CHECK_FAILS(mha_forward(&yq, NULL, m, &a), MHA_ERR_INVALID_ARG);
    msg_has("overlap", NULL);
    b = a;
    b.impl = (mha_impl)99;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &b), MHA_ERR_UNSUPPORTED);
    mha_impl impl;
    CHECK_FAILS(mha_impl_from_name(&impl, "flash"), MHA_ERR_UNSUPPORTED);
    CHECK_OK(mha_impl_from_name(&impl, "reference"));
    mha_kv_dtype kvd;
    CHECK_FAILS(mha_kv_dtype_from_name(&kvd, "fp8"), MHA_ERR_UNSUPPORTED);
    msg_has("fp8", "int8");
    CHECK_OK(mha_kv_dtype_from_name(&kvd, "bf16"));
    CHECK(kvd == MHA_KV_BF16 && strcmp(mha_kv_dtype_name(kvd), "bf16") == 0);
    CHECK_OK(mha_kv_dtype_from_name(&kvd, "int4"));
    CHECK(kvd == MHA_KV_INT4 && strcmp(mha_kv_dtype_name(kvd), "int4") == 0);
    CHECK(strcmp(mha_kv_dtype_name((mha_kv_dtype)5), "unknown") == 0);
    {
        mha_kv_cache *bad = NULL;
        CHECK_FAILS(mha_kv_cache_create(&bad, 1, 1, 8, 8, 4, (mha_kv_dtype)5),
                    MHA_ERR_INVALID_ARG);
        msg_has("storage type 5", NULL);
        CHECK(bad == NULL);
        // int4 sizes that overflow: refused, not wrapped
        CHECK_FAILS(mha_kv_cache_create(&bad, 1, 1, INT64_MAX / 2, 8, 4, MHA_KV_INT4),
                    MHA_ERR_OVERFLOW);
    }
    mha_rope_mode rm;
    CHECK_FAILS(mha_rope_mode_from_name(&rm, "yarn"), MHA_ERR_UNSUPPORTED);
    msg_has("yarn", "neox");
    mha_kv_cache *kc = NULL;
    CHECK_FAILS(mha_kv_cache_create(&kc, 1, 1, 8, 8, 0, MHA_KV_F32), MHA_ERR_INVALID_ARG);
    msg_has("capacity", NULL);
    CHECK_OK(mha_kv_cache_create(&kc, 1, 1, 8, 8, 4, MHA_KV_INT8));
    CHECK_FAILS(mha_kv_cache_truncate(kc, 0, 1), MHA_ERR_INVALID_ARG);  // holds 0
    msg_has("truncate", NULL);
    mha_kv_cache_destroy(kc);
    size_t bytes;
    CHECK_FAILS(mha_forward_workspace_size(NULL, m, &a), MHA_ERR_INVALID_ARG);
    CHECK_OK(mha_forward_workspace_size(&bytes, m, &a));
    mha_module_destroy(m);
}

static void sdpa_errors(void) {
    enum { B = 2, Hh = 2, D = 4 };
    static float qd[B * Hh * L * D], kd[B * Hh * S * D], od[B * Hh * L * D];
    mha_tensor qt = mha_tensor_contiguous(qd, MHA_F32, 4, (int64_t[]){B, Hh, L, D});
    mha_tensor kt = mha_tensor_contiguous(kd, MHA_F32, 4, (int64_t[]){B, Hh, S, D});
    mha_tensor ot = mha_tensor_contiguous(od, MHA_F32, 4, (int64_t[]){B, Hh, L, D});
    mha_sdpa_args a;
    mha_sdpa_args_init(&a);
    a.q = &qt;
    a.k = a.v = &kt;
    CHECK_OK(mha_sdpa(&ot, NULL, &a));
    CHECK_FAILS(mha_sdpa(&ot, NULL, NULL), MHA_ERR_INVALID_ARG);
    mha_sdpa_args b = a;
    mha_tensor q3 = mha_tensor_contiguous(qd, MHA_F32, 3, (int64_t[]){B * Hh, L, D});
    b.q = &q3;
    CHECK_FAILS(mha_sdpa(&ot, NULL, &b), MHA_ERR_SHAPE);
    mha_tensor kbad = mha_tensor_contiguous(kd, MHA_F32, 4, (int64_t[]){B, Hh, S, D - 1});
    b = a;
    b.k = &kbad;
    CHECK_FAILS(mha_sdpa(&ot, NULL, &b), MHA_ERR_SHAPE);
    mha_tensor mm = mha_tensor_contiguous(bmask, MHA_BOOL, 2, (int64_t[]){L, S - 1});
    b = a;
    b.attn_mask = &mm;
    CHECK_FAILS(mha_sdpa(&ot, NULL, &b), MHA_ERR_SHAPE);
    msg_has("broadcast", NULL);
    mm = mha_tensor_contiguous(bmask, MHA_BOOL, 3, (int64_t[]){Hh, 1, S});
    CHECK_OK(mha_sdpa(&ot, NULL, &b));  // (H, 1, S) broadcasts
    mha_tensor kp = mha_tensor_contiguous(bmask, MHA_BOOL, 2, (int64_t[]){B + 1, S});
    b = a;
    b.key_padding_mask = &kp;
    CHECK_FAILS(mha_sdpa(&ot, NULL, &b), MHA_ERR_SHAPE);
    b = a;
    b.opts.scale = NAN;
    CHECK_FAILS(mha_sdpa(&ot, NULL, &b), MHA_ERR_INVALID_ARG);
    mha_tensor q0 = mha_tensor_contiguous(qd, MHA_F32, 4, (int64_t[]){B, Hh, L, 0});
    mha_tensor k0 = mha_tensor_contiguous(kd, MHA_F32, 4, (int64_t[]){B, Hh, S, 0});
    b = a;
    b.q = &q0;
    b.k = &k0;
    CHECK_FAILS(mha_sdpa(&ot, NULL, &b), MHA_ERR_SHAPE);
    msg_has("scale", NULL);
    b = a;
    b.impl = MHA_IMPL_FUSED;  // fused needs unit stride along D: said so
    static float od2[2 * B * Hh * L * D];
    mha_tensor os2 = mha_tensor_contiguous(od2, MHA_F32, 4, (int64_t[]){B, Hh, L, 2 * D});
    os2.shape[3] = D;
    os2.stride[3] = 2;
    CHECK_FAILS(mha_sdpa(&os2, NULL, &b), MHA_ERR_UNSUPPORTED);
    msg_has("fused", "stride");
    b.impl = MHA_IMPL_AUTO;  // auto falls back to the reference there
    CHECK_OK(mha_sdpa(&os2, NULL, &b));
    mha_tensor o_alias = mha_tensor_contiguous(kd, MHA_F32, 4, (int64_t[]){B, Hh, L, D});
    CHECK_FAILS(mha_sdpa(&o_alias, NULL, &a), MHA_ERR_INVALID_ARG);
    // the attention options: each refusal names the option and its value
    b = a;
    b.opts.sink_tokens = 2;  // a cache's
    CHECK_FAILS(mha_sdpa(&ot, NULL, &b), MHA_ERR_INVALID_ARG);
    msg_has("sink_tokens 2", "cache");
    float vec[Hh] = {0.5f, NAN};
    b = a;
    b.opts.alibi_slopes = vec;
    CHECK_FAILS(mha_sdpa(&ot, NULL, &b), MHA_ERR_INVALID_ARG);
    msg_has("sdpa", "alibi_slopes[1]");
    b = a;
    b.opts.sinks = vec;
    CHECK_FAILS(mha_sdpa(&ot, NULL, &b), MHA_ERR_INVALID_ARG);
    msg_has("sdpa", "sinks[1]");
    b = a;
    b.opts.softcap = -1.0f;
    CHECK_FAILS(mha_sdpa(&ot, NULL, &b), MHA_ERR_INVALID_ARG);
    msg_has("softcap", NULL);
    b = a;
    b.opts.dropout_p = 1.0f;
    CHECK_FAILS(mha_sdpa(&ot, NULL, &b), MHA_ERR_INVALID_ARG);
    msg_has("dropout_p", NULL);
    b = a;
    b.opts.window_left = -2;
    CHECK_FAILS(mha_sdpa(&ot, NULL, &b), MHA_ERR_INVALID_ARG);
    msg_has("window_left -2", NULL);
    // a dtype the call does not take: MHA_ERR_DTYPE
    static int32_t qi[B * Hh * L * D];
    mha_tensor qit = mha_tensor_contiguous(qi, MHA_I32, 4, (int64_t[]){B, Hh, L, D});
    b = a;
    b.q = &qit;
    CHECK_FAILS(mha_sdpa(&ot, NULL, &b), MHA_ERR_DTYPE);
    msg_has("I32", NULL);
    // varlen and the caches have no dropout
    const int64_t cu[2] = {0, L}, cuk[2] = {0, S};
    mha_tensor vq = mha_tensor_contiguous(qd, MHA_F32, 3, (int64_t[]){L, Hh, D});
    mha_tensor vk = mha_tensor_contiguous(kd, MHA_F32, 3, (int64_t[]){S, Hh, D});
    mha_tensor vo = mha_tensor_contiguous(od, MHA_F32, 3, (int64_t[]){L, Hh, D});
    mha_varlen_args va;
    mha_varlen_args_init(&va);
    va.cu_seqlens_q = cu, va.cu_seqlens_k = cuk, va.num_seqs = 1;
    CHECK_OK(mha_sdpa_varlen(&vo, &vq, &vk, &vk, &va));
    va.opts.dropout_p = 0.1f;
    CHECK_FAILS(mha_sdpa_varlen(&vo, &vq, &vk, &vk, &va), MHA_ERR_INVALID_ARG);
    msg_has("dropout_p", "no dropout");
    mha_kv_cache *kc = NULL;
    CHECK_OK(mha_kv_cache_create(&kc, B, Hh, D, D, S, MHA_KV_F32));
    CHECK_OK(mha_kv_cache_append(kc, &kt, &kt, NULL));
    mha_cache_attend_args ca;
    mha_cache_attend_args_init(&ca);
    CHECK_OK(mha_kv_cache_attend(&ot, &qt, kc, &ca, NULL));
    ca.opts.dropout_p = 0.1f;
    CHECK_FAILS(mha_kv_cache_attend(&ot, &qt, kc, &ca, NULL), MHA_ERR_INVALID_ARG);
    msg_has("dropout_p", "no dropout");
    mha_kv_cache_destroy(kc);
}

// mha_attn_opts_init's defaults, the status names, and the module's
// refusals of the options that are its own parameters.
static void attn_opts_errors(void) {
    mha_attn_opts o;
    memset(&o, 0x5a, sizeof o);
    mha_attn_opts_init(&o);
    CHECK(o.window_left == -1 && o.window_right == -1 && !o.is_causal && o.scale == 0.0 &&
          o.softcap == 0.0f && !o.alibi && !o.alibi_slopes && !o.sinks && o.sink_tokens == 0 &&
          o.dropout_p == 0.0f && o.dropout_seed == 0 && o.dropout_offset == 0);
    CHECK(strcmp(mha_status_string(MHA_ERR_DTYPE), "MHA_ERR_DTYPE") == 0);
    mha_config c;
    mha_config_init(&c, E, H);
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, &c));
    mha_tensor qt = T3(q, L, N, E), yt = T3(y, L, N, E);
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &qt;
    CHECK_OK(mha_forward(&yt, NULL, m, &a));
    float sinks[H] = {0};
    a.opts.sinks = sinks;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &a), MHA_ERR_INVALID_ARG);
    msg_has("opts.sinks", "mha_config.sinks");
    a.opts.sinks = NULL;
    a.opts.dropout_p = 0.25f;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &a), MHA_ERR_INVALID_ARG);
    msg_has("dropout_p 0.25", "mha_config.dropout");
    a.opts.dropout_p = 0.0f;
    a.opts.sink_tokens = 4;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &a), MHA_ERR_UNSUPPORTED);
    msg_has("sink_tokens 4", "mha_forward_cached");
    mha_module_destroy(m);
}

int main(void) {
    mha_set_log_callback(on_log, &g_logged);
    // Capture stdout and stderr while the library runs: it must not print.
    const char *dir = getenv("MHA_TEST_TMPDIR");
    char path[512];
    snprintf(path, sizeof path, "%s/test_errors_capture.txt", dir ? dir : "/tmp");
    fflush(stdout);
    fflush(stderr);
    int out_fd = dup(1), err_fd = dup(2);
    FILE *cap = fopen(path, "w+");
    if (!cap) {
        perror(path);
        return 1;
    }
    dup2(fileno(cap), 1);
    dup2(fileno(cap), 2);
    forward_errors();
    sdpa_errors();
    attn_opts_errors();
    fflush(stdout);
    fflush(stderr);
    dup2(out_fd, 1);
    dup2(err_fd, 2);
    long size = ftell(cap) >= 0 ? (fseek(cap, 0, SEEK_END), ftell(cap)) : -1;
    if (size > 0) {  // check failures (or library prints) land here
        rewind(cap);
        char buf[512];
        while (fgets(buf, sizeof buf, cap)) fputs(buf, stderr);
    }
    fclose(cap);
    CHECKF(size == 0, "%ld bytes were printed during the calls", size);
    CHECKF(g_logged >= 30, "log callback saw %d messages", g_logged);
    mha_set_log_callback(NULL, NULL);
    return check_summary("test_errors");
}
