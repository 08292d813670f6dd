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
static mha_status evaluate(double *acc, double *loss, tiny_model *m, const int32_t *tokens,
                           const int32_t *targets, int64_t n, int64_t T, int64_t chunk,
                           int32_t *pred) {
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
    double p = (double)(s - o->warmup) /
               (double)(o->steps - o->warmup > 0 ? o->steps - o->warmup : 1);
    double lo = o->lr * 0.1;
    return lo + 0.5 * (o->lr - lo) * (1.0 + cos(3.141592653589793 * p));
}

static void draw_progress(bool tty, int64_t step, int64_t steps, double loss, double tacc,
                          double eacc, double tok_s, double eta, const char *task) {
    char rate[32], etas[32];
    fmt_rate(rate, sizeof rate, tok_s);
    fmt_time(etas, sizeof etas, eta);
    if (tty) {
        enum { W = 24 };
        char bar[W + 1];
        int fill = (int)((double)W * (double)step / (double)steps);
        for (int i = 0; i < W; i++) bar[i] = i < fill ? '#' : '.';
        bar[W] = '\0';
        fprintf(stderr,
                "\r%s [%s] %lld/%lld  loss %.4f  acc %5.1f%%  eval %5.1f%%  "
                "%s tok/s  ETA %s\x1b[K",
                task, bar, (long long)step, (long long)steps, loss, 100.0 * tacc, 100.0 * eacc,
                rate, etas);
    } else {
        fprintf(stderr,
                "step %lld/%lld  loss %.4f  train_acc %.1f%%  eval_acc %.1f%%  "
                "%s tok/s  ETA %s\n",
                (long long)step, (long long)steps, loss, 100.0 * tacc, 100.0 * eacc, rate,
                etas);
    }
    fflush(stderr);
}

void train_opts_default(train_opts *o) {
    *o = (train_opts){.task = TINY_TASK_RECALL,
                      .pairs = 4,
                      .heads = 8,
                      .d_model = 64,
                      .layers = 2,
                      .d_ff = 0,
                      .steps = 3000,
                      .batch = 32,
                      .warmup = 100,
                      .eval_every = 100,
                      .eval_size = 1000,
                      .seed = 1,
                      .optim = MHA_OPTIM_ADAMW,
                      .lr = 3e-3,
                      .clip = 1.0,
                      .cosine = true};
}

// One training run (train_run): the model, the optimizer, the CSV, the
// batches, the clock and the running sums between evaluations.
typedef struct train_state {
    const train_opts *o;
    train_opts oo;  // o with the peak learning rate the optimizer got
    const char *cmd;
    bool tty;
    int64_t T, B, chunk, n_eval;
    tiny_model *m;
    mha_optim *opt;
    FILE *csv;  // the CSV composed in memory (csv_text, csv_n), written at the end
    char *csv_text;
    size_t csv_n;
    int32_t *ints;  // one allocation for the five below
    int32_t *tok, *tgt, *etok, *etgt, *pred;
    tiny_rng data_rng;
    uint64_t offset_stride;
    double t_start, t_train, t_int;
    double lsum, final_train_loss;
    int64_t nsum, csum, n_int_steps;
    double eacc, eloss, last_tacc, last_loss, rate;
    double last_draw;
} train_state;

// A library call failed: ends the progress line, prints; returns 1.
static int train_fail(const train_state *ts, mha_status st) {
    if (ts->tty) fputc('\n', stderr);
    return cli_fail(ts->cmd, st);
}

// The model, the optimizer, the CSV's header, the held-out set and the
// header line. Returns 0, or 1 after printing (what it made is in ts).
static int train_setup(train_state *ts, const train_opts *o) {
    const char *cmd = ts->cmd;
    mha_status st;
    int64_t T = tiny_task_seq_len(o->task, o->pairs), B = o->batch;
    int64_t chunk = B > 250 ? B : 250;  // eval batch
    tiny_config tc = {.vocab = TINY_VOCAB,
                      .seq_len = T,
                      .d_model = o->d_model,
                      .n_heads = o->heads,
                      .n_layers = o->layers,
                      .d_ff = o->d_ff,
                      .dropout = (float)o->dropout,
                      .causal = o->causal,
                      .seed = (uint64_t)o->seed};
    ts->T = T, ts->B = B, ts->chunk = chunk;
    ts->tty = !o->quiet && isatty(fileno(stderr));
    int64_t n_eval = ts->n_eval = o->eval_size;
    ts->ints = malloc(sizeof(int32_t) * (size_t)(B * T + B + n_eval * T + n_eval + chunk + B));
    if (!ts->ints) {
        fprintf(stderr, "mha %s: out of memory\n", cmd);
        return 1;
    }
    ts->tok = ts->ints;                // (B, T)
    ts->tgt = ts->tok + B * T;         // (B)
    ts->etok = ts->tgt + B;            // (n_eval, T)
    ts->etgt = ts->etok + n_eval * T;  // (n_eval)
    ts->pred = ts->etgt + n_eval;      // (max(chunk, B))

    if ((st = tiny_create(&ts->m, &tc, chunk))) return train_fail(ts, st);
    mha_optim_config oc;
    mha_optim_config_init(&oc, o->optim);
    oc.lr = o->lr_set ? o->lr : o->optim == MHA_OPTIM_SGD ? 0.1 : 3e-3;
    if (o->wd_set) oc.weight_decay = o->weight_decay;
    if (o->optim == MHA_OPTIM_SGD) oc.momentum = 0.9;
    ts->oo = *o;
    ts->oo.lr = oc.lr;
    if ((st = mha_optim_create(&ts->opt, &oc))) return train_fail(ts, st);
    if ((st = tiny_optimizer_register(ts->m, ts->opt))) return train_fail(ts, st);

    if (o->csv) {
        ts->csv = open_memstream(&ts->csv_text, &ts->csv_n);
        if (!ts->csv) {
            fprintf(stderr, "mha %s: cannot compose %s: %s\n", cmd, o->csv, strerror(errno));
            return 1;
        }
        fprintf(ts->csv, "step,loss,train_acc,eval_acc,tokens_per_s\n");
    }

    ts->data_rng = (tiny_rng){(uint64_t)o->seed * 0xD1B54A32D192ED03ull + 7};
    tiny_rng eval_rng = {(uint64_t)o->seed * 0xD1B54A32D192ED03ull + 0xE7A1E7A1ull};
    tiny_task_sample(ts->etok, ts->etgt, o->task, o->pairs, n_eval, &eval_rng);

    if (!o->quiet) {
        char ex[64];
        tiny_task_render(ex, sizeof ex, ts->etok, T);
        fprintf(stderr,
                "mha %s: task %s (T %lld, e.g. %s -> %d), d_model %lld, "
                "heads %lld, layers %lld, %lld parameters, %s lr %g, batch %lld, "
                "%lld steps\n",
                cmd, tiny_task_name(o->task), (long long)T, ex, ts->etgt[0],
                (long long)o->d_model, (long long)o->heads, (long long)o->layers,
                (long long)tiny_num_params(ts->m), o->optim == MHA_OPTIM_SGD ? "sgd" : "adamw",
                oc.lr, (long long)B, (long long)o->steps);
    }

    // dropout masks: a fresh (seed, offset) window per step, wider than any
    // element count of one forward
    ts->offset_stride = (uint64_t)(B * o->heads * T * T + 1);
    ts->t_start = cli_now();
    ts->last_draw = -1.0;
    return 0;
}

// Step s (1-based): a fresh batch, forward, backward, clipping, the
// learning rate, the optimizer's step; the running sums. Returns 0, or 1
// after printing.
static int train_step(train_state *ts, int64_t s) {
    const train_opts *o = ts->o;
    const int64_t B = ts->B;
    mha_status st;
    double t0 = cli_now();
    tiny_task_sample(ts->tok, ts->tgt, o->task, o->pairs, B, &ts->data_rng);
    mha_optim_zero_grad(ts->opt);
    float loss;
    if ((st = tiny_forward(ts->m, &loss, ts->tok, ts->tgt, B, true,
                           (uint64_t)s * ts->offset_stride)))
        return train_fail(ts, st);
    if (!isfinite(loss)) {
        fprintf(stderr, "%smha %s: the loss is %g at step %lld (try a smaller --lr)\n",
                ts->tty ? "\n" : "", ts->cmd, (double)loss, (long long)s);
        return 1;
    }
    tiny_predict(ts->m, ts->pred);
    for (int64_t b = 0; b < B; b++) ts->csum += ts->pred[b] == ts->tgt[b];
    if ((st = tiny_backward(ts->m))) return train_fail(ts, st);
    if (o->clip > 0 && (st = mha_optim_clip_grad_norm(ts->opt, o->clip, NULL)))
        return train_fail(ts, st);
    if ((st = mha_optim_set_lr(ts->opt, lr_at(&ts->oo, s)))) return train_fail(ts, st);
    if ((st = mha_optim_step(ts->opt))) return train_fail(ts, st);
    double dt = cli_now() - t0;
    ts->t_train += dt;
    ts->t_int += dt;
    ts->n_int_steps++;
    ts->lsum += loss;
    ts->nsum++;
    return 0;
}

// After step s: the held-out evaluation, the CSV's row, the running sums
// restarted. Returns 0, or 1 after printing.
static int train_eval(train_state *ts, int64_t s) {
    const int64_t B = ts->B, T = ts->T;
    mha_status st;
    if ((st = evaluate(&ts->eacc, &ts->eloss, ts->m, ts->etok, ts->etgt, ts->n_eval, T,
                       ts->chunk, ts->pred)))
        return train_fail(ts, st);
    ts->last_loss = ts->lsum / (double)ts->nsum;
    ts->last_tacc = (double)ts->csum / (double)(ts->nsum * B);
    ts->rate = (double)(ts->n_int_steps * B * T) / (ts->t_int > 0 ? ts->t_int : 1e-9);
    if (ts->csv)
        fprintf(ts->csv, "%lld,%.6f,%.6f,%.6f,%.1f\n", (long long)s, ts->last_loss,
                ts->last_tacc, ts->eacc, ts->rate);
    ts->final_train_loss = ts->last_loss;
    ts->lsum = 0.0;
    ts->nsum = 0;
    ts->csum = 0;
    ts->t_int = 0.0;
    ts->n_int_steps = 0;
    return 0;
}

// The progress after step s: on a terminal redrawn at most every 0.1 s
// (and at evaluations), else a line per evaluation.
static void train_progress(train_state *ts, int64_t s, bool eval_now) {
    const train_opts *o = ts->o;
    const int64_t B = ts->B, T = ts->T;
    double now = cli_now();
    double eta = (now - ts->t_start) / (double)s * (double)(o->steps - s);
    if (!o->quiet) {
        if (ts->tty && (now - ts->last_draw > 0.1 || eval_now)) {
            double shown_loss = ts->nsum ? ts->lsum / (double)ts->nsum : ts->last_loss;
            double shown_acc = ts->nsum ? (double)ts->csum / (double)(ts->nsum * B)
                                        : ts->last_tacc;
            double shown_rate = ts->rate > 0 ? ts->rate : (double)(s * B * T) / ts->t_train;
            draw_progress(true, s, o->steps, shown_loss, shown_acc, ts->eacc, shown_rate, eta,
                          tiny_task_name(o->task));
            ts->last_draw = now;
        } else if (!ts->tty && eval_now) {
            draw_progress(false, s, o->steps, ts->last_loss, ts->last_tacc, ts->eacc, ts->rate,
                          eta, tiny_task_name(o->task));
        }
    }
}

// After the last step: the CSV written, a few held-out examples with the
// model's answers, the summary line. Returns 0, or 1 after printing.
static int train_finish(train_state *ts) {
    const train_opts *o = ts->o;
    const int64_t B = ts->B, T = ts->T, n_eval = ts->n_eval;
    mha_status st;
    if (ts->tty) fputc('\n', stderr);
    double elapsed = cli_now() - ts->t_start;
    if (ts->csv) {  // written whole, atomically: a failed run leaves an old file as it was
        int bad = fclose(ts->csv);
        ts->csv = NULL;
        if (bad) {
            fprintf(stderr, "mha %s: out of memory composing %s\n", ts->cmd, o->csv);
            return 1;
        }
        if ((st = mha_file_write(o->csv, ts->csv_text, ts->csv_n)))
            return cli_fail(ts->cmd, st);
    }
    if (!o->quiet) {
        // a few held-out examples with the model's answers
        if ((st = tiny_forward(ts->m, NULL, ts->etok, NULL, 3 < n_eval ? 3 : n_eval, false, 0)))
            return train_fail(ts, st);
        tiny_predict(ts->m, ts->pred);
        for (int64_t i = 0; i < 3 && i < n_eval; i++) {
            char ex[64];
            tiny_task_render(ex, sizeof ex, ts->etok + i * T, T);
            fprintf(stderr, "  %s -> %d (answer %d)\n", ex, ts->pred[i], ts->etgt[i]);
        }
    }
    printf("train %s: heads %lld, d_model %lld, layers %lld, %lld params, %lld steps x "
           "batch %lld, seed %lld: eval accuracy %.2f%% (%lld held-out), eval loss %.4f, "
           "train loss %.4f, %.1f s (%.0f tokens/s)\n",
           tiny_task_name(o->task), (long long)o->heads, (long long)o->d_model,
           (long long)o->layers, (long long)tiny_num_params(ts->m), (long long)o->steps,
           (long long)B, (long long)o->seed, 100.0 * ts->eacc, (long long)n_eval, ts->eloss,
           ts->final_train_loss, elapsed, (double)(o->steps * B * T) / ts->t_train);
    fflush(stdout);
    return 0;
}

int train_run(const train_opts *o, tiny_model **keep, double *eval_acc) {
    flush_subnormals();
    train_state ts = {.o = o, .cmd = o->cmd ? o->cmd : "train"};
    int rc = train_setup(&ts, o);
    for (int64_t s = 1; !rc && s <= o->steps; s++) {
        rc = train_step(&ts, s);
        const bool eval_now = s % o->eval_every == 0 || s == o->steps;
        if (!rc && eval_now) rc = train_eval(&ts, s);
        if (!rc) train_progress(&ts, s, eval_now);
    }
    if (!rc) rc = train_finish(&ts);
    if (!rc) {
        if (eval_acc) *eval_acc = ts.eacc;
        if (keep) *keep = ts.m, ts.m = NULL;
    }
    if (ts.csv) fclose(ts.csv);
    free(ts.csv_text);
    mha_optim_destroy(ts.opt);
    tiny_destroy(ts.m);
    free(ts.ints);
    return rc;
}
