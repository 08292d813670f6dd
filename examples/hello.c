// hello.c: the README's example. Self-attention over 4 tokens with
// nn.MultiheadAttention(embed_dim=8, num_heads=2) and PyTorch's default
// initialisation; prints the output and the averaged attention weights.
#include <stdio.h>

#include <mha.h>

int main(void) {
    enum { L = 4, N = 1, E = 8, H = 2 };
    mha_config cfg;
    mha_config_init(&cfg, E, H);  // bias on, everything else as PyTorch's
    mha_module *m = NULL;
    mha_status st = mha_module_create(&m, &cfg);
    mha_init_options init;
    mha_init_options_init(&init);  // xavier_uniform, seed 0
    if (!st) st = mha_module_init(m, &init);
    if (st) {
        fprintf(stderr, "mha: %s\n", mha_last_error());
        return 1;
    }

    float x[L * N * E], y[L * N * E], w[N * L * L];
    for (int i = 0; i < L * N * E; i++) x[i] = (float)((i * 7) % 5) - 2.0f;
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor wt = mha_tensor_contiguous(w, MHA_F32, 3, (int64_t[]){N, L, L});

    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;  // (L, N, E)
    a.opts.is_causal = true;
    a.need_weights = true;  // averaged over heads: (N, L, S)
    if ((st = mha_forward(&yt, &wt, m, &a))) {
        fprintf(stderr, "mha: %s\n", mha_last_error());
        mha_module_destroy(m);
        return 1;
    }
    for (int i = 0; i < L; i++) {
        printf("token %d: y[0..3] = %7.4f %7.4f %7.4f %7.4f   weights:", i, y[i * E],
               y[i * E + 1], y[i * E + 2], y[i * E + 3]);
        for (int j = 0; j < L; j++) printf(" %.3f", w[i * L + j]);
        printf("\n");
    }
    mha_module_destroy(m);
    return 0;
}
