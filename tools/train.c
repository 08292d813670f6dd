// train.c: `mha train`, a tiny transformer (tools/tiny/) trained on a
// synthetic task that needs attention (the loop: train_loop.c), with a
// progress bar, a CSV of the learning curve and a PNG plot of it; `mha
// train plot` overlays several runs' CSVs. Here: the options, the help and
// `mha train plot`.
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cmd.h"
#include "plot.h"
#include "train.h"
#include "tiny.h"

static const char *train_help =
    "Usage: mha train [options]\n"
    "       mha train plot --out FILE.png [--title TEXT] RUN.csv [RUN.csv ...]\n"
    "Trains a tiny transformer (token embedding + learned positions, N pre-LN\n"
    "blocks of libmha attention + LayerNorm + GELU MLP with residuals, final\n"
    "LayerNorm, a classifier on the last position) on a synthetic task:\n"
    "  recall   associative recall: K distinct keys (letters), each followed\n"
    "           by a value digit, then '?' and one of the keys; the answer is\n"
    "           that key's value.       a3c7e1?c -> 7          (T = 2K + 2)\n"
    "  tworel   two relations at once: K key/value pairs, '|', then two\n"
    "           different keys qa qb; the answer is (value(qa) + value(qb))\n"
    "           mod 10, so the last position needs both values, read from two\n"
    "           different places.        a3c7e1|ce -> 8         (T = 2K + 3)\n"
    "Options:\n"
    "  --task recall|tworel  the task (default recall)\n"
    "  --pairs K          key/value pairs per sequence, 2..26 (default 4)\n"
    "  --heads H          attention heads (default 8; must divide d_model)\n"
    "  --d-model D        model width (default 64)\n"
    "  --layers N         blocks (default 2)\n"
    "  --d-ff F           MLP hidden width (default 4 D)\n"
    "  --steps N          optimizer steps (default 3000)\n"
    "  --batch B          sequences per step (default 32)\n"
    "  --optim adamw|sgd  optimizer (default adamw; sgd uses momentum 0.9)\n"
    "  --lr LR            peak learning rate (default 3e-3 adamw, 0.1 sgd)\n"
    "  --weight-decay W   (default 0.01 adamw, 0 sgd)\n"
    "  --warmup N         linear warmup steps (default 100)\n"
    "  --schedule cosine|constant  after warmup (default cosine, to lr/10)\n"
    "  --clip NORM        clip the global gradient norm (default 1; 0 off)\n"
    "  --dropout P        attention-weight dropout while training (default 0)\n"
    "  --causal           causal attention in all blocks but the last\n"
    "  --seed N           model, data and dropout seed (default 1)\n"
    "  --eval-every N     evaluate and write a CSV row every N steps\n"
    "                     (default 100)\n"
    "  --eval-size N      held-out sequences (default 1000)\n"
    "  --csv FILE         learning curve: step,loss,train_acc,eval_acc,\n"
    "                     tokens_per_s (loss and train_acc averaged over the\n"
    "                     steps since the previous row; written when the run\n"
    "                     ends, replacing FILE atomically)\n"
    "  --plot FILE.png    plot of the learning curve (needs cairo); without\n"
    "                     --csv the curve is also written to FILE.csv\n"
    "  --quiet            no progress bar\n"
    "Progress goes to stderr (redrawn in place on a terminal, one line per\n"
    "evaluation otherwise); the final summary line goes to stdout.\n"
    "plot: overlays RUN.csv files (labels: the file names without .csv).\n";

static int usage(const char *msg) { return cli_usage("train", msg); }

// ---------------------------------------------------------------------------
// mha train plot

static int cmd_train_plot(int argc, char **argv) {
    static const struct option opts[] = {{"out", required_argument, 0, 'o'},
                                         {"title", required_argument, 0, 't'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *out = NULL, *title = NULL;
    int c;
    opterr = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'o': out = optarg; break;
        case 't': title = optarg; break;
        case 'h': fputs(train_help, stdout); return 0;
        default: return cli_bad_option("train plot", argv, opts);
        }
    }
    if (!out) return usage("plot: --out is required");
    int n = argc - optind;
    if (n < 1) return usage("plot: give at least one CSV file");
    if (n > 16) return usage("plot: at most 16 CSV files");
    const char *paths[16];
    char labels_buf[16][64];
    const char *labels[16];
    for (int i = 0; i < n; i++) {
        paths[i] = argv[optind + i];
        const char *b = strrchr(paths[i], '/');
        b = b ? b + 1 : paths[i];
        snprintf(labels_buf[i], sizeof labels_buf[i], "%s", b);
        size_t len = strlen(labels_buf[i]);
        if (len > 4 && !strcmp(labels_buf[i] + len - 4, ".csv")) labels_buf[i][len - 4] = '\0';
        labels[i] = labels_buf[i];
    }
    return plot_runs("train plot", out, title, n, paths, labels);
}

// ---------------------------------------------------------------------------
// mha train

static const struct option train_long_opts[] = {{"task", required_argument, 0, 'T'},
                                                {"pairs", required_argument, 0, 'K'},
                                                {"heads", required_argument, 0, 'H'},
                                                {"d-model", required_argument, 0, 'D'},
                                                {"layers", required_argument, 0, 'L'},
                                                {"d-ff", required_argument, 0, 'F'},
                                                {"steps", required_argument, 0, 'n'},
                                                {"batch", required_argument, 0, 'b'},
                                                {"optim", required_argument, 0, 'o'},
                                                {"lr", required_argument, 0, 'l'},
                                                {"weight-decay", required_argument, 0, 'w'},
                                                {"warmup", required_argument, 0, 'W'},
                                                {"schedule", required_argument, 0, 'S'},
                                                {"clip", required_argument, 0, 'c'},
                                                {"dropout", required_argument, 0, 'd'},
                                                {"causal", no_argument, 0, 'C'},
                                                {"seed", required_argument, 0, 's'},
                                                {"eval-every", required_argument, 0, 'e'},
                                                {"eval-size", required_argument, 0, 'E'},
                                                {"csv", required_argument, 0, 'v'},
                                                {"plot", required_argument, 0, 'p'},
                                                {"quiet", no_argument, 0, 'q'},
                                                {"help", no_argument, 0, 'h'},
                                                {0, 0, 0, 0}};

// One handler per group of options: each takes option c (its value in
// optarg) and returns -1 when it took it, the exit status when its value
// is bad, or TRAIN_NOT_MINE when c is not of its group.
enum { TRAIN_NOT_MINE = -2 };

// The task and the model: --task, --pairs, --heads, --d-model, --layers,
// --d-ff.
static int train_opt_model(train_opts *o, int c) {
    int k;
    switch (c) {
    case 'T':
        if ((k = tiny_task_from_name(optarg)) < 0) return usage("--task is recall or tworel");
        o->task = (tiny_task_kind)k;
        break;
    case 'K':
        if (cli_parse_int(&o->pairs, optarg, 2, 26))
            return usage("--pairs needs an integer in 2..26");
        break;
    case 'H':
        if (cli_parse_int(&o->heads, optarg, 1, 4096))
            return usage("--heads needs a positive integer");
        break;
    case 'D':
        if (cli_parse_int(&o->d_model, optarg, 1, 1 << 16))
            return usage("--d-model needs a positive integer");
        break;
    case 'L':
        if (cli_parse_int(&o->layers, optarg, 1, 64))
            return usage("--layers needs an integer in 1..64");
        break;
    case 'F':
        if (cli_parse_int(&o->d_ff, optarg, 1, 1 << 20))
            return usage("--d-ff needs a positive integer");
        break;
    default: return TRAIN_NOT_MINE;
    }
    return -1;
}

// The optimisation: --steps, --batch, --optim, --lr, --weight-decay,
// --warmup, --schedule, --clip, --dropout.
static int train_opt_optim(train_opts *o, int c) {
    double f;
    switch (c) {
    case 'n':
        if (cli_parse_int(&o->steps, optarg, 1, (int64_t)1 << 40))
            return usage("--steps needs a positive integer");
        break;
    case 'b':
        if (cli_parse_int(&o->batch, optarg, 1, 1 << 20))
            return usage("--batch needs a positive integer");
        break;
    case 'o':
        if (!strcmp(optarg, "adamw")) o->optim = MHA_OPTIM_ADAMW;
        else if (!strcmp(optarg, "sgd")) o->optim = MHA_OPTIM_SGD;
        else return usage("--optim is adamw or sgd");
        break;
    case 'l':
        if (cli_parse_f64(&f, optarg) || !isfinite(f) || f <= 0)
            return usage("--lr needs a positive number");
        o->lr = f;
        o->lr_set = true;
        break;
    case 'w':
        if (cli_parse_f64(&f, optarg) || !isfinite(f) || f < 0)
            return usage("--weight-decay needs a number >= 0");
        o->weight_decay = f;
        o->wd_set = true;
        break;
    case 'W':
        if (cli_parse_int(&o->warmup, optarg, 0, (int64_t)1 << 40))
            return usage("--warmup needs an integer >= 0");
        break;
    case 'S':
        if (!strcmp(optarg, "cosine")) o->cosine = true;
        else if (!strcmp(optarg, "constant")) o->cosine = false;
        else return usage("--schedule is cosine or constant");
        break;
    case 'c':
        if (cli_parse_f64(&f, optarg) || !isfinite(f) || f < 0)
            return usage("--clip needs a number >= 0");
        o->clip = f;
        break;
    case 'd':
        if (cli_parse_f64(&f, optarg) || !(f >= 0 && f < 1))
            return usage("--dropout needs P in [0, 1)");
        o->dropout = f;
        break;
    default: return TRAIN_NOT_MINE;
    }
    return -1;
}

// The run: --causal, --seed, --eval-every, --eval-size, --csv, --plot
// (*plot), --quiet.
static int train_opt_run(train_opts *o, const char **plot, int c) {
    int64_t v;
    switch (c) {
    case 'C': o->causal = true; break;
    case 's':
        if (cli_parse_int(&v, optarg, 0, INT64_MAX))
            return usage("--seed needs a non-negative integer");
        o->seed = v;
        break;
    case 'e':
        if (cli_parse_int(&o->eval_every, optarg, 1, (int64_t)1 << 40))
            return usage("--eval-every needs a positive integer");
        break;
    case 'E':
        if (cli_parse_int(&o->eval_size, optarg, 1, 1 << 22))
            return usage("--eval-size needs a positive integer");
        break;
    case 'v': o->csv = optarg; break;
    case 'p': *plot = optarg; break;
    case 'q': o->quiet = true; break;
    default: return TRAIN_NOT_MINE;
    }
    return -1;
}

// Reads the options into o and *plot (--plot FILE.png) and checks them.
// Returns -1 to go on, else the exit status (0 after --help).
static int train_parse(train_opts *o, const char **plot, int argc, char **argv) {
    int c;
    opterr = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", train_long_opts, NULL)) != -1) {
        if (c == 'h') {
            fputs(train_help, stdout);
            return 0;
        }
        int rc = train_opt_model(o, c);
        if (rc == TRAIN_NOT_MINE) rc = train_opt_optim(o, c);
        if (rc == TRAIN_NOT_MINE) rc = train_opt_run(o, plot, c);
        if (rc == TRAIN_NOT_MINE) rc = cli_bad_option("train", argv, train_long_opts);
        if (rc != -1) return rc;
    }
    if (optind < argc) return cli_unexpected("train", argv[optind]);
    if (o->d_model % o->heads) {
        fprintf(stderr, "mha train: --heads %lld does not divide --d-model %lld\n",
                (long long)o->heads, (long long)o->d_model);
        return 2;
    }
    if (*plot && !plot_available()) {
        fprintf(stderr, "mha train: --plot needs cairo, and this mha was built without it "
                        "(install libcairo2-dev and rebuild)\n");
        return 2;  // (an option this build cannot run: a usage error, as --parallel's)
    }
    return -1;
}

int cmd_train(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "plot")) return cmd_train_plot(argc - 1, argv + 1);
    train_opts o;
    train_opts_default(&o);
    const char *plot = NULL;  // --plot FILE.png, drawn from the CSV afterwards
    int rc = train_parse(&o, &plot, argc, argv);
    if (rc >= 0) return rc;
    // the plot is drawn from the CSV: write one next to the PNG if none given
    char csv_buf[4096];
    if (plot && !o.csv) {
        size_t len = strlen(plot);
        if (len > 4 && !strcmp(plot + len - 4, ".png")) len -= 4;
        if (len + 5 > sizeof csv_buf) return usage("--plot path too long");
        memcpy(csv_buf, plot, len);
        memcpy(csv_buf + len, ".csv", 5);
        o.csv = csv_buf;
    }
    rc = train_run(&o, NULL, NULL);
    if (rc || !plot) return rc;
    char label[96];
    snprintf(label, sizeof label, "%s, %lld head%s", tiny_task_name(o.task),
             (long long)o.heads, o.heads == 1 ? "" : "s");
    const char *lab = label;
    return plot_runs("train", plot, NULL, 1, &o.csv, &lab);
}
