// module.h: the module struct, shared by module.c, init.c and forward.c.
#ifndef MHA_MODULE_H
#define MHA_MODULE_H

#include "internal.h"

#define MHA__MAX_PARAMS 8

struct mha_module {
    mha_config cfg;       // kdim/vdim resolved
    bool packed;          // in_proj_weight (kdim == vdim == E)
    int64_t head_dim;     // d = E / H
    int64_t kv_dim;       // Ekv = num_kv_heads * d (E without GQA)
    int nparams;
    mha_param params[MHA__MAX_PARAMS];
    float **slots[MHA__MAX_PARAMS];  // where each param's pointer is kept
    void *block;          // one allocation holding every parameter
    // Named pointers into block (NULL when absent):
    float *in_proj_weight;                // (E + 2 Ekv, E) when packed
    float *q_weight, *k_weight, *v_weight;  // (E, E), (Ekv, kdim), (Ekv, vdim);
                                          // rows of in_proj_weight if packed
    float *in_proj_bias;                  // (E + 2 Ekv): Q, K, V biases
    float *bias_k, *bias_v;               // (Ekv)
    float *out_weight;                    // (E, E)
    float *out_bias;                      // (E)
};

#endif
