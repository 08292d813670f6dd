// train_loop.c: the training loop of the tiny transformer (train.h),
// run by `mha train` (train.c) and `mha demo heads` (heads.c): the steps,
// the held-out evaluation, the progress bar, the CSV of the learning curve
// and the summary line.
//
// Data: training batches are drawn fresh every step from a seeded
// generator; the accuracy reported as "eval" is on a separate held-out set
// drawn once from a different stream of the same seed (with 26P8 * 10^8
// possible recall sequences, overlap with the training draws is negligible).
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__SSE2__)
#include <xmmintrin.h>
#define TRAIN_HAVE_MXCSR 1
#endif

#include "cli.h"
#include "tiny.h"
#include "train.h"

// Flush-to-zero and denormals-are-zero for this thread and the threads it
// creates afterwards (Linux threads inherit the floating-point
// environment, so OpenMP's pool started later gets it too). Without it a
// run slows ~10x once attention is sharp: gradients of keys whose weight
// underflowed become subnormal floats (see tiny.h). x86-64 only; elsewhere
// such a run is slower.
static void flush_subnormals(void) {
#ifdef TRAIN_HAVE_MXCSR
    _mm_setcsr(_mm_getcsr() | 0x8040);  // FTZ (bit 15) | DAZ (bit 6)
#endif
}


static void fmt_time(char *buf, size_t cap, double s) {
    if (!(s >= 0) || s > 1e7) s = 0;
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(buf, cap, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
    else snprintf(buf, cap, "%ld:%02ld", t / 60, t % 60);
}

static void fmt_rate(char *buf, size_t cap, double r) {
    if (r >= 1e6) snprintf(buf, cap, "%.2fM", r / 1e6);
    else if (r >= 1e3) snprintf(buf, cap, "%.1fk", r / 1e3);
    else snprintf(buf, cap, "%.0f", r);
}

// Accuracy (count of argmax == target) and mean loss on the held-out set.
static mha_status evaluate(double *acc, double *loss, tiny_model *m,
                           const int32_t *tokens, const int32_t *targets,
                           int64_t n, int64_t T, int64_t chunk, int32_t *pred) {
    int64_t correct = 0;
    double lsum = 0.0;
    for (int64_t i = 0; i < n; i += chunk) {
        int64_t b = n - i < chunk ? n - i : chunk;
        float l;
        mha_status st = tiny_forward(m, &l, tokens + i * T, targets + i, b, false, 0);
        if (st) return st;
        tiny_predict(m, pred);
        for (int64_t k = 0; k < b; k++) correct += pred[k] == targets[i + k];
        lsum += (double)l * (double)b;
    }
    *acc = (double)correct / (double)n;
    *loss = lsum / (double)n;
    return MHA_OK;
}

// Learning rate at step s (1-based): linear warmup, then cosine to lr/10 or
// constant.
static double lr_at(const train_opts *o, int64_t s) {
    if (s <= o->warmup) return o->lr * (double)s / (double)o->warmup;
    if (!o->cosine) return o->lr;
    double p = (double)(s - o->warmup) / (double)(o->steps - o->warmup > 0 ? o->steps - o->warmup : 1);
    double lo = o->lr * 0.1;
    return lo + 0.5 * (o->lr - lo) * (1.0 + cos(3.141592653589793 * p));
}

static void draw_progress(bool tty, int64_t step, int64_t steps, double loss,
                          double tacc, double eacc, double tok_s, double eta,
                          const char *task) {
    char rate[32], etas[32];
    fmt_rate(rate, sizeof rate, tok_s);
    fmt_time(etas, sizeof etas, eta);
    if (tty) {
        enum { W = 24 };
        char bar[W + 1];
        int fill = (int)((double)W * (double)step / (double)steps);
        for (int i = 0; i < W; i++) bar[i] = i < fill ? '#' : '.';
        bar[W] = '\0';
        fprintf(stderr, "\r%s [%s] %lld/%lld  loss %.4f  acc %5.1f%%  eval %5.1f%%  "
                "%s tok/s  ETA %s\x1b[K", task, bar, (long long)step, (long long)steps,
                loss, 100.0 * tacc, 100.0 * eacc, rate, etas);
    } else {
        fprintf(stderr, "step %lld/%lld  loss %.4f  train_acc %.1f%%  eval_acc %.1f%%  "
                "%s tok/s  ETA %s\n", (long long)step, (long long)steps, loss,
                100.0 * tacc, 100.0 * eacc, rate, etas);
    }
    fflush(stderr);
}

void train_opts_default(train_opts *o) {
    *o = (train_opts){.task = TINY_TASK_RECALL, .pairs = 4, .heads = 8, .d_model = 64,
                      .layers = 2, .d_ff = 0, .steps = 3000, .batch = 32, .warmup = 100,
                      .eval_every = 100, .eval_size = 1000, .seed = 1,
                      .optim = MHA_OPTIM_ADAMW, .lr = 3e-3, .clip = 1.0, .cosine = true};
}

int train_run(const train_opts *o, tiny_model **keep, double *eval_acc) {
    const char *cmd = o->cmd ? o->cmd : "train";
    flush_subnormals();
    int64_t T = tiny_task_seq_len(o->task, o->pairs), B = o->batch;
    int64_t chunk = B > 250 ? B : 250;  // eval batch
    tiny_config tc = {.vocab = TINY_VOCAB, .seq_len = T, .d_model = o->d_model,
                      .n_heads = o->heads, .n_layers = o->layers, .d_ff = o->d_ff,
                      .dropout = (float)o->dropout, .causal = o->causal,
                      .seed = (uint64_t)o->seed};
    int rc = 1;
    mha_status st;
    bool tty = !o->quiet && isatty(fileno(stderr));
    tiny_model *m = NULL;
    mha_optimizer *opt = NULL;
    FILE *csv = NULL;
    int64_t n_eval = o->eval_size;
    int32_t *ints = malloc(sizeof(int32_t) *
                           (size_t)(B * T + B + n_eval * T + n_eval + chunk + B));
    if (!ints) {
        fprintf(stderr, "mha %s: out of memory\n", cmd);
        return 1;
    }
    int32_t *tok = ints;                   // (B, T)
    int32_t *tgt = tok + B * T;            // (B)
    int32_t *etok = tgt + B;               // (n_eval, T)
    int32_t *etgt = etok + n_eval * T;     // (n_eval)
    int32_t *pred = etgt + n_eval;         // (max(chunk, B))

    if ((st = tiny_create(&m, &tc, chunk))) goto fail;
    mha_optim_config oc;
    mha_optim_config_init(&oc, o->optim);
    oc.lr = o->lr_set ? o->lr : o->optim == MHA_OPTIM_SGD ? 0.1 : 3e-3;
    if (o->wd_set) oc.weight_decay = o->weight_decay;
    if (o->optim == MHA_OPTIM_SGD) oc.momentum = 0.9;
    train_opts oo = *o;
    oo.lr = oc.lr;
    if ((st = mha_optimizer_create(&opt, &oc))) goto fail;
    if ((st = tiny_optimizer_register(m, opt))) goto fail;

    if (o->csv) {
        csv = fopen(o->csv, "w");
        if (!csv) {
            fprintf(stderr, "mha %s: cannot write %s: %s\n", cmd, o->csv, strerror(errno));
            goto cleanup;
        }
        fprintf(csv, "step,loss,train_acc,eval_acc,tokens_per_s\n");
    }

    tiny_rng data_rng = {(uint64_t)o->seed * 0xD1B54A32D192ED03ull + 7};
    tiny_rng eval_rng = {(uint64_t)o->seed * 0xD1B54A32D192ED03ull + 0xE7A1E7A1ull};
    tiny_task_sample(etok, etgt, o->task, o->pairs, n_eval, &eval_rng);

    if (!o->quiet) {
        char ex[64];
        tiny_task_render(ex, sizeof ex, etok, T);
        fprintf(stderr, "mha %s: task %s (T %lld, e.g. %s -> %d), d_model %lld, "
                "heads %lld, layers %lld, %lld parameters, %s lr %g, batch %lld, "
                "%lld steps\n", cmd, tiny_task_name(o->task), (long long)T, ex, etgt[0],
                (long long)o->d_model, (long long)o->heads, (long long)o->layers,
                (long long)tiny_num_params(m), o->optim == MHA_OPTIM_SGD ? "sgd" : "adamw",
                oc.lr, (long long)B, (long long)o->steps);
    }

    // dropout masks: a fresh (seed, offset) window per step, wider than any
    // element count of one forward
    uint64_t offset_stride = (uint64_t)(B * o->heads * T * T + 1);
    double t_start = cli_now(), t_train = 0.0, t_int = 0.0;
    double lsum = 0.0, final_train_loss = 0.0;
    int64_t nsum = 0, csum = 0, n_int_steps = 0;
    double eacc = 0.0, eloss = 0.0, last_tacc = 0.0, last_loss = 0.0, rate = 0.0;
    double last_draw = -1.0;
    for (int64_t s = 1; s <= o->steps; s++) {
        double t0 = cli_now();
        tiny_task_sample(tok, tgt, o->task, o->pairs, B, &data_rng);
        mha_optimizer_zero_grad(opt);
        float loss;
        if ((st = tiny_forward(m, &loss, tok, tgt, B, true, (uint64_t)s * offset_stride))) goto fail;
        if (!isfinite(loss)) {
            fprintf(stderr, "%smha %s: the loss is %g at step %lld (try a smaller --lr)\n",
                    tty ? "\n" : "", cmd, (double)loss, (long long)s);
            goto cleanup;
        }
        tiny_predict(m, pred);
        for (int64_t b = 0; b < B; b++) csum += pred[b] == tgt[b];
        if ((st = tiny_backward(m))) goto fail;
        if (o->clip > 0 && (st = mha_optimizer_clip_grad_norm(opt, o->clip, NULL))) goto fail;
        if ((st = mha_optimizer_set_lr(opt, lr_at(&oo, s)))) goto fail;
        if ((st = mha_optimizer_step(opt))) goto fail;
        double dt = cli_now() - t0;
        t_train += dt;
        t_int += dt;
        n_int_steps++;
        lsum += loss;
        nsum++;
        bool eval_now = s % o->eval_every == 0 || s == o->steps;
        if (eval_now) {
            if ((st = evaluate(&eacc, &eloss, m, etok, etgt, n_eval, T, chunk, pred))) goto fail;
            last_loss = lsum / (double)nsum;
            last_tacc = (double)csum / (double)(nsum * B);
            rate = (double)(n_int_steps * B * T) / (t_int > 0 ? t_int : 1e-9);
            if (csv) fprintf(csv, "%lld,%.6f,%.6f,%.6f,%.1f\n", (long long)s, last_loss,
                             last_tacc, eacc, rate);
            final_train_loss = last_loss;
            lsum = 0.0;
            nsum = 0;
            csum = 0;
            t_int = 0.0;
            n_int_steps = 0;
        }
        double now = cli_now();
        double eta = (now - t_start) / (double)s * (double)(o->steps - s);
        if (!o->quiet) {
            if (tty && (now - last_draw > 0.1 || eval_now)) {
                double shown_loss = nsum ? lsum / (double)nsum : last_loss;
                double shown_acc = nsum ? (double)csum / (double)(nsum * B) : last_tacc;
                double shown_rate = rate > 0 ? rate : (double)(s * B * T) / t_train;
                draw_progress(true, s, o->steps, shown_loss, shown_acc, eacc, shown_rate,
                              eta, tiny_task_name(o->task));
                last_draw = now;
            } else if (!tty && eval_now) {
                draw_progress(false, s, o->steps, last_loss, last_tacc, eacc, rate, eta,
                              tiny_task_name(o->task));
            }
        }
    }
    if (tty) fputc('\n', stderr);
    double elapsed = cli_now() - t_start;
    if (csv) {
        if (fclose(csv)) {
            csv = NULL;
            fprintf(stderr, "mha %s: error writing %s\n", cmd, o->csv);
            goto cleanup;
        }
        csv = NULL;
    }
    if (!o->quiet) {
        // a few held-out examples with the model's answers
        if ((st = tiny_forward(m, NULL, etok, NULL, 3 < n_eval ? 3 : n_eval, false, 0))) goto fail;
        tiny_predict(m, pred);
        for (int64_t i = 0; i < 3 && i < n_eval; i++) {
            char ex[64];
            tiny_task_render(ex, sizeof ex, etok + i * T, T);
            fprintf(stderr, "  %s -> %d (answer %d)\n", ex, pred[i], etgt[i]);
        }
    }
    printf("train %s: heads %lld, d_model %lld, layers %lld, %lld params, %lld steps x "
           "batch %lld, seed %lld: eval accuracy %.2f%% (%lld held-out), eval loss %.4f, "
           "train loss %.4f, %.1f s (%.0f tokens/s)\n",
           tiny_task_name(o->task), (long long)o->heads, (long long)o->d_model,
           (long long)o->layers, (long long)tiny_num_params(m), (long long)o->steps,
           (long long)B, (long long)o->seed, 100.0 * eacc, (long long)n_eval, eloss,
           final_train_loss, elapsed, (double)(o->steps * B * T) / t_train);
    fflush(stdout);
    rc = 0;
    if (eval_acc) *eval_acc = eacc;
    if (keep) *keep = m, m = NULL;
    goto cleanup;
fail:
    if (tty) fputc('\n', stderr);
    rc = cli_fail(cmd, st);
cleanup:
    if (csv) fclose(csv);
    mha_optimizer_destroy(opt);
    tiny_destroy(m);
    free(ints);
    return rc;
}
