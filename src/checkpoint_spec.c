// checkpoint_spec.c: what one layer of a Hugging Face checkpoint does
// beyond its parameters, read from config.json: its shapes (E, H, Hkv,
// head_dim), biases, causal mask, sliding window, scale, soft cap, RoPE and
// its scaling, as a ck_spec holding the mha_checkpoint_layer. It reads
// the config only (checkpoint.c); the tensors are checkpoint_load.c's.
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
//
// What it does not do: cross-attention (bert is_decoder with
// add_cross_attention, gpt2 crossattention) is not loaded; nested per-layer
// RoPE parameters and bidirectional gemma2 are refused (MHA_ERR_UNSUPPORTED).
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "checkpoint.h"
#include "internal.h"

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
    const ck_arch_desc *ad = &mha__ck_archs[c->arch];
    mha_checkpoint_layer *info = &s->info;
    mha_rope_init(&info->rope, MHA_ROPE_NEOX);
    memset(&info->rope_scaling, 0, sizeof info->rope_scaling);
    const cJSON *rs = mha__ck_item(cfg, "rope_scaling"),
                *rp = mha__ck_item(cfg, "rope_parameters"), *r = NULL;
    const char *rname = NULL;
    mha_status st;
    if (rs && !cJSON_IsObject(rs))
        return mha__ck_bad_type(c, "", "rope_scaling", rs, "an object");
    if (rp && !cJSON_IsObject(rp))
        return mha__ck_bad_type(c, "", "rope_parameters", rp, "an object");
    if (rs && rs->child) r = rs, rname = "rope_scaling";
    else if (rp) r = rp, rname = "rope_parameters";
    if (r && (mha__ck_item(r, "full_attention") || mha__ck_item(r, "sliding_attention")))
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "%s: %s nested per layer type is not supported for %s",
                         c->config_path, rname, ad->name);
    char pre[40];
    snprintf(pre, sizeof pre, "%s.", rname ? rname : "");
    double theta;
    bool found;
    if ((st = mha__ck_num(&theta, &found, c, r, pre, "rope_theta", 0.0))) return st;
    if (!found && (st = mha__ck_num(&theta, NULL, c, cfg, "", "rope_theta", ad->theta)))
        return st;
    if (!(theta > 0.0))
        return mha__fail(MHA_ERR_FORMAT, "%s: rope_theta %g must be positive", c->config_path,
                         theta);
    info->rope.theta = theta;
    double prf;
    if ((st = mha__ck_num(&prf, &found, c, r, pre, "partial_rotary_factor", 1.0))) return st;
    if (!found && (st = mha__ck_num(&prf, NULL, c, cfg, "", "partial_rotary_factor", 1.0)))
        return st;
    if (!(prf > 0.0 && prf <= 1.0))
        return mha__fail(MHA_ERR_FORMAT, "%s: partial_rotary_factor %g must be in (0, 1]",
                         c->config_path, prf);
    int64_t maxpos;
    if ((st = mha__ck_int(&maxpos, NULL, c, cfg, "", "max_position_embeddings", ad->max_pos, 1)))
        return st;

    // the type (gpt_oss without parameters: its default YaRN)
    const char *tname = NULL;
    if (r && (st = mha__ck_str(&tname, c, r, pre, "rope_type"))) return st;
    if (r && !tname && (st = mha__ck_str(&tname, c, r, pre, "type"))) return st;
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
    if ((st = mha__ck_int(&omp, &found, c, cfg, "", "original_max_position_embeddings", maxpos,
                          1)))
        return st;
    if (!found && (st = mha__ck_int(&omp, NULL, c, r, pre, "original_max_position_embeddings",
                                    maxpos, 1)))
        return st;
    sc->original_max_position = sc->type == MHA_ROPE_SCALING_DYNAMIC ? maxpos : omp;
    double factor;
    if ((st = mha__ck_num(&factor, &found, c, r, pre, "factor", 0.0))) return st;
    if (!found && sc->type == MHA_ROPE_SCALING_YARN) factor = (double)maxpos / (double)omp;
    else if (!found)
        return mha__fail(MHA_ERR_FORMAT, "%s: %s (rope_type %s) has no \"factor\"",
                         c->config_path, rname, tname);
    if (!(factor > 0.0))
        return mha__fail(MHA_ERR_FORMAT, "%s: %sfactor %g must be positive", c->config_path,
                         pre, factor);
    sc->factor = factor;
    if (sc->type == MHA_ROPE_SCALING_LLAMA3) {
        if ((st = mha__ck_num(&sc->low_freq_factor, NULL, c, r, pre, "low_freq_factor", 1.0)) ||
            (st = mha__ck_num(&sc->high_freq_factor, NULL, c, r, pre, "high_freq_factor", 4.0)))
            return st;
    }
    if (sc->type == MHA_ROPE_SCALING_YARN) {
        double bf, bs;  // transformers: `or 32`, `or 1` (0 falls back too)
        if ((st = mha__ck_num(&bf, NULL, c, r, pre, "beta_fast", 0.0)) ||
            (st = mha__ck_num(&bs, NULL, c, r, pre, "beta_slow", 0.0)) ||
            (st = mha__ck_num(&sc->mscale, NULL, c, r, pre, "mscale", 0.0)) ||
            (st = mha__ck_num(&sc->mscale_all_dim, NULL, c, r, pre, "mscale_all_dim", 0.0)) ||
            (st = mha__ck_num(&sc->attention_factor, NULL, c, r, pre, "attention_factor", 0.0)) ||
            (st = mha__ck_bool(&sc->truncate, c, r, pre, "truncate", true)))
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
    const cJSON *lt = mha__ck_item(c->config, "layer_types");
    bool sliding = default_sliding;
    if (lt) {
        if (!cJSON_IsArray(lt)) return mha__ck_bad_type(c, "", "layer_types", lt, "an array");
        if (cJSON_GetArraySize(lt) != c->num_layers)
            return mha__fail(MHA_ERR_FORMAT, "%s: layer_types has %d entries, expected %lld",
                             c->config_path, cJSON_GetArraySize(lt), (long long)c->num_layers);
        const cJSON *t = cJSON_GetArrayItem(lt, (int)layer);
        char key[48], q[CK_Q];
        snprintf(key, sizeof key, "layer_types[%lld]", (long long)layer);
        if (!cJSON_IsString(t)) return mha__ck_bad_type(c, "", key, t, "a string");
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

// The layer's shapes: E, H, Hkv and the head dimension d.
static mha_status spec_shape(ck_spec *s, const mha_checkpoint *c) {
    const cJSON *cfg = c->config;
    const ck_arch_desc *ad = &mha__ck_archs[c->arch];
    const ck_arch a = c->arch;
    mha_status st;
    bool found;
    const bool g2 = a == ARCH_GPT2;
    if ((st = mha__ck_int(&s->E, &found, c, cfg, "", g2 ? "n_embd" : "hidden_size", ad->E, 1)))
        return st;
    if (g2 && !found && (st = mha__ck_int(&s->E, NULL, c, cfg, "", "hidden_size", ad->E, 1)))
        return st;
    if ((st = mha__ck_int(&s->H, &found, c, cfg, "", g2 ? "n_head" : "num_attention_heads",
                          ad->H, 1)))
        return st;
    if (g2 && !found &&
        (st = mha__ck_int(&s->H, NULL, c, cfg, "", "num_attention_heads", ad->H, 1)))
        return st;
    s->Hkv = s->H;
    if (!mha__ck_has_rope(a)) {
        if (s->E % s->H != 0)
            return mha__fail(MHA_ERR_FORMAT, "%s: %s %lld is not divisible by %s %lld",
                             c->config_path, g2 ? "n_embd" : "hidden_size", (long long)s->E,
                             g2 ? "n_head" : "num_attention_heads", (long long)s->H);
        s->d = s->E / s->H;
        return MHA_OK;
    }
    const cJSON *kv = cJSON_GetObjectItemCaseSensitive(cfg, "num_key_value_heads");
    // absent: the class default; null: num_attention_heads
    int64_t def = kv ? s->H : (ad->Hkv ? ad->Hkv : s->H);
    if ((st = mha__ck_int(&s->Hkv, NULL, c, cfg, "", "num_key_value_heads", def, 1)))
        return st;
    if (s->H % s->Hkv != 0)
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: num_key_value_heads %lld does not divide "
                         "num_attention_heads %lld",
                         c->config_path, (long long)s->Hkv, (long long)s->H);
    if ((st = mha__ck_int(&s->d, NULL, c, cfg, "", "head_dim", ad->d ? ad->d : s->E / s->H, 1)))
        return st;
    if (s->d == 0)
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: hidden_size %lld / num_attention_heads %lld gives head_dim 0",
                         c->config_path, (long long)s->E, (long long)s->H);
    return MHA_OK;
}

// The masks and scales of the architectures (spec_masks) -----------------
//
// Each fills s->info.opts (is_causal and scale set to their defaults
// before: causal, 1 / sqrt(d)) and, for a sliding window, *W (the config's
// window, -1: none) and *default_sliding (whether this layer slides when
// layer_types does not say).

static mha_status spec_bert(ck_spec *s, const mha_checkpoint *c) {
    const char *pet;
    mha_status st;
    if ((st = mha__ck_bool(&s->info.opts.is_causal, c, c->config, "", "is_decoder", false)) ||
        (st = mha__ck_str(&pet, c, c->config, "", "position_embedding_type")))
        return st;
    if (pet && strcmp(pet, "absolute") != 0) {
        char q[CK_Q];
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "%s: position_embedding_type %s is not supported (absolute only)",
                         c->config_path, mha_escape(q, sizeof q, pet));
    }
    return MHA_OK;
}

static mha_status spec_gpt2(ck_spec *s, const mha_checkpoint *c, int64_t layer) {
    bool saw, inv;
    mha_status st;
    if ((st = mha__ck_bool(&saw, c, c->config, "", "scale_attn_weights", true)) ||
        (st = mha__ck_bool(&inv, c, c->config, "", "scale_attn_by_inverse_layer_idx", false)))
        return st;
    double scale = saw ? 1.0 / sqrt((double)s->d) : 1.0;
    if (inv) scale /= (double)(layer + 1);
    if (!saw || inv) s->info.opts.scale = scale;
    return MHA_OK;
}

static mha_status spec_qwen(int64_t *W, bool *default_sliding, const mha_checkpoint *c,
                            int64_t layer) {
    const cJSON *cfg = c->config;
    bool use_sw = true;
    int64_t mwl;
    mha_status st;
    if ((st = mha__ck_bool(&use_sw, c, cfg, "", "use_sliding_window", false)) ||
        (st = mha__ck_window(W, c, mha__ck_archs[c->arch].window)) ||
        (st = mha__ck_int(&mwl, NULL, c, cfg, "", "max_window_layers", 28, 0)))
        return st;
    if (!use_sw) *W = -1;
    *default_sliding = *W > 0 && layer >= mwl;
    return MHA_OK;
}

static mha_status spec_gemma2(ck_spec *s, int64_t *W, bool *default_sliding,
                              const mha_checkpoint *c, int64_t layer) {
    const cJSON *cfg = c->config;
    bool bidir;
    double qpas, cap;
    mha_status st;
    if ((st = mha__ck_bool(&bidir, c, cfg, "", "use_bidirectional_attention", false)) ||
        (st = mha__ck_window(W, c, mha__ck_archs[c->arch].window)) ||
        (st = mha__ck_num(&qpas, NULL, c, cfg, "", "query_pre_attn_scalar", 256.0)) ||
        (st = mha__ck_num(&cap, NULL, c, cfg, "", "attn_logit_softcapping", 0.0)))
        return st;
    if (!mha__ck_item(cfg, "attn_logit_softcapping") &&
        !cJSON_GetObjectItemCaseSensitive(cfg, "attn_logit_softcapping"))
        cap = 50.0;  // absent: the class default; null: none
    if (bidir)
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "%s: use_bidirectional_attention is not supported", c->config_path);
    if (!(qpas > 0.0))
        return mha__fail(MHA_ERR_FORMAT, "%s: query_pre_attn_scalar %g must be positive",
                         c->config_path, qpas);
    if (cap < 0.0 || cap > 3.0e38)
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: attn_logit_softcapping %g must be positive (or null)",
                         c->config_path, cap);
    s->info.opts.softcap = (float)cap;
    if (qpas != (double)s->d) s->info.opts.scale = 1.0 / sqrt(qpas);
    *default_sliding = layer % 2 == 0;
    return MHA_OK;
}

// The architecture's masks, scale and window (see the file's header).
static mha_status spec_masks(ck_spec *s, const mha_checkpoint *c, int64_t layer) {
    const ck_arch a = c->arch;
    mha_checkpoint_layer *info = &s->info;
    mha_status st = MHA_OK;
    info->opts.is_causal = true;
    info->opts.scale = 0.0;  // 1 / sqrt(d)
    int64_t W = -1;
    bool default_sliding = false;
    switch (a) {
    case ARCH_BERT: st = spec_bert(s, c); break;
    case ARCH_GPT2: st = spec_gpt2(s, c, layer); break;
    case ARCH_MISTRAL:
        st = mha__ck_window(&W, c, mha__ck_archs[a].window);
        default_sliding = true;
        break;
    case ARCH_QWEN2:
    case ARCH_QWEN3: st = spec_qwen(&W, &default_sliding, c, layer); break;
    case ARCH_GEMMA2: st = spec_gemma2(s, &W, &default_sliding, c, layer); break;
    case ARCH_GPT_OSS:
        st = mha__ck_window(&W, c, mha__ck_archs[a].window);
        default_sliding = layer % 2 == 0;
        s->sinks = true;
        break;
    default: break;
    }
    if (st) return st;
    if (mha__ck_has_rope(a) && a != ARCH_MISTRAL &&
        (st = spec_window(s, c, layer, W, default_sliding)))
        return st;
    if (a == ARCH_MISTRAL) info->opts.window_left = W > 0 ? W - 1 : -1;
    return MHA_OK;
}

mha_status mha__ck_layer_spec(ck_spec *s, const mha_checkpoint *c, int64_t layer) {
    const cJSON *cfg = c->config;
    const ck_arch_desc *ad = &mha__ck_archs[c->arch];
    const ck_arch a = c->arch;
    mha_status st;
    memset(s, 0, sizeof *s);
    mha_checkpoint_layer *info = &s->info;
    snprintf(info->model_type, sizeof info->model_type, "%s", ad->name);
    info->layer = layer;
    info->opts.window_left = -1;
    if ((st = spec_shape(s, c))) return st;
    if (layer < 0 || layer >= c->num_layers)
        return mha__fail(MHA_ERR_INVALID_ARG, "%s: layer %lld is out of range [0, %lld)",
                         c->dir, (long long)layer, (long long)c->num_layers);

    // biases
    bool ab;
    if ((st = mha__ck_bool(&ab, c, cfg, "", "attention_bias", ad->bias))) return st;
    s->qkv_bias = s->o_bias = ab;
    if (a == ARCH_BERT || a == ARCH_GPT2) s->qkv_bias = s->o_bias = true;
    if (a == ARCH_MISTRAL) s->qkv_bias = s->o_bias = false;
    if (a == ARCH_QWEN2) s->qkv_bias = true, s->o_bias = false;

    if ((st = spec_masks(s, c, layer))) return st;
    if (a == ARCH_QWEN3) {
        s->qk_norm = true;
        if ((st = mha__ck_num(&s->eps, NULL, c, cfg, "", "rms_norm_eps", ad->eps))) return st;
        if (!(s->eps > 0.0))
            return mha__fail(MHA_ERR_FORMAT, "%s: rms_norm_eps %g must be positive",
                             c->config_path, s->eps);
    }
    if (mha__ck_has_rope(a)) {
        if ((st = spec_rope(s, c))) return st;
    } else {
        mha_rope_init(&info->rope, MHA_ROPE_NONE);
    }
    return MHA_OK;
}
