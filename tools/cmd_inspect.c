// cmd_inspect.c: `mha inspect`. Public API only.
//
// mha inspect: mha_diag_create on the loaded module and inputs, written as
// DIR/diagnostics.json (r->ypath is the directory; NaN -> null), then the
// pictures and report.html (inspect_plot.c) from the same numbers and the
// per-head attention weights of one batch element.
#include <errno.h>
#include <stdarg.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cmd.h"
#include "inspect_plot.h"
#include "run.h"

// --tokens FILE: its lines, without line ends. Returns 0, or 1 after
// printing.
static int read_tokens(run *r) {
    FILE *f = fopen(r->tokens_path, "r");
    if (!f) {
        fprintf(stderr, "mha %s: cannot read the tokens file %s: %s\n", r->cmd, r->tokens_path,
                strerror(errno));
        return 1;
    }
    char *line = NULL;
    size_t cap = 0, tcap = 0;
    ssize_t len;
    int rc = 0;
    while (!rc && (len = getline(&line, &cap, f)) != -1) {
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = '\0';
        if ((size_t)r->ntokens == tcap) {
            tcap = tcap ? 2 * tcap : 256;
            char **t = realloc(r->tokens, tcap * sizeof *t);
            if (!t) rc = 1;
            else r->tokens = t;
        }
        if (!rc && !(r->tokens[r->ntokens] = strdup(line))) rc = 1;
        if (!rc) r->ntokens++;
    }
    if (rc) fprintf(stderr, "mha %s: out of memory reading %s\n", r->cmd, r->tokens_path);
    else if (ferror(f)) {
        fprintf(stderr, "mha %s: cannot read the tokens file %s: %s\n", r->cmd, r->tokens_path,
                strerror(errno));
        rc = 1;
    }
    free(line);
    fclose(f);
    return rc;
}

// diagnostics.json as a cJSON tree (NULL when out of memory).
static cJSON *diag_json(const mha_diag *d) {
    const int64_t H = mha_diag_num_heads(d);
    cJSON *root = cJSON_CreateObject(), *heads = cJSON_AddArrayToObject(root, "heads");
    for (int64_t h = 0; h < H; h++) {
        const mha_head_diag *x = mha_diag_head(d, h);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "head", (double)x->head);
        cJSON_AddNumberToObject(o, "entropy_mean", x->entropy_mean);
        cJSON_AddNumberToObject(o, "entropy_min", x->entropy_min);
        cJSON_AddNumberToObject(o, "entropy_norm", x->entropy_norm);
        cJSON_AddNumberToObject(o, "mean_distance", x->mean_distance);
        cJSON_AddBoolToObject(o, "dead", x->dead);
        cJSON_AddNumberToObject(o, "rank_q", (double)x->rank_q);
        cJSON_AddNumberToObject(o, "rank_k", (double)x->rank_k);
        cJSON_AddNumberToObject(o, "rank_v", (double)x->rank_v);
        cJSON_AddNumberToObject(o, "rank_o", (double)x->rank_o);
        cJSON_AddNumberToObject(o, "logit_max", x->logit_max);
        cJSON_AddNumberToObject(o, "logit_std", x->logit_std);
        cJSON_AddNumberToObject(o, "output_var_ratio", x->output_var_ratio);
        cJSON_AddNumberToObject(o, "rows", (double)x->rows);
        cJSON_AddBoolToObject(o, "pruned", x->pruned);
        cJSON_AddNumberToObject(o, "gate_mean", x->gate_mean);
        static const char *sn[4] = {"singular_q", "singular_k", "singular_v", "singular_o"};
        for (int w = 0; w < 4; w++) {
            int64_t n = 0;
            const double *sv = mha_diag_spectrum(d, h, "qkvo"[w], &n);
            cJSON *arr = cJSON_AddArrayToObject(o, sn[w]);
            for (int64_t i = 0; i < n; i++)
                cJSON_AddItemToArray(arr, cJSON_CreateNumber(sv[i]));
        }
        cJSON_AddItemToArray(heads, o);
    }
    cJSON *sim = cJSON_AddArrayToObject(root, "similarity");
    for (int64_t i = 0; i < H; i++) {
        cJSON *row = cJSON_CreateArray();
        for (int64_t j = 0; j < H; j++)
            cJSON_AddItemToArray(row, cJSON_CreateNumber(mha_diag_similarity(d, i, j)));
        cJSON_AddItemToArray(sim, row);
    }
    const char *nf = mha_diag_nonfinite(d);
    if (nf) cJSON_AddStringToObject(root, "nonfinite", nf);
    else cJSON_AddNullToObject(root, "nonfinite");
    cJSON_AddNumberToObject(root, "rows_examined", (double)mha_diag_rows(d));
    return root;
}

// t with its dim `dim` narrowed to index b.
static void narrow(mha_tensor *t, int dim, int64_t b, int64_t count) {
    t->data = (char *)t->data + b * t->stride[dim] * (int64_t)mha_dtype_size(t->dtype);
    t->shape[dim] = count;
}

// The per-head attention weights of batch element b, query rows [0, rows):
// (H, rows, S') into *w (owned by r; S' counts the appended keys). The
// forward sees views of element b alone, so only its weights are computed.
// Returns 0, or 1 after printing.
static int inspect_attention(run *r, int64_t b, int64_t rows, float **w, int64_t *S1) {
    mha_forward_args a = r->a;
    mha_tensor q = *a.query, k = *a.key, v = *a.value, kpm, am;
    const int64_t H = mha_module_config(r->m)->num_heads;
    if (q.ndim == 3) {  // (L, N, E) or (N, L, E): element b of each input
        const int bd = r->base.batch_first ? 0 : 1;
        narrow(&q, bd, b, 1);
        narrow(&k, bd, b, 1);
        narrow(&v, bd, b, 1);
        if (a.key_padding_mask && a.key_padding_mask->ndim == 2) {  // (N, S)
            kpm = *a.key_padding_mask;
            narrow(&kpm, 0, b, 1);
            a.key_padding_mask = &kpm;
        }
        if (a.attn_mask && a.attn_mask->ndim == 3) {  // (N*H, L, S)
            am = *a.attn_mask;
            narrow(&am, 0, b * H, H);
            a.attn_mask = &am;
        }
        if (a.rope_start) a.rope_start += b;
        if (a.rope_positions) a.rope_positions += b * q.shape[1 - bd];  // (N, L): row b
    }
    a.query = &q;
    a.key = r->a.key == r->a.query ? &q : &k;
    a.value = r->a.value == r->a.query ? &q : &v;
    a.need_weights = true;
    a.average_attn_weights = false;
    a.weights_row_begin = 0;
    a.weights_row_end = rows;
    mha_shape os, ws;
    mha_status st = mha_forward_shapes(&os, &ws, r->m, &a);
    if (st) return cli_fail(r->cmd, st);
    float *yo = run_alloc(r, shape_numel(&os)), *yw = run_alloc(r, shape_numel(&ws));
    if (!yo || !yw) return 1;
    mha_tensor ot = mha_tensor_contiguous(yo, MHA_F32, os.ndim, os.dims);
    mha_tensor wt = mha_tensor_contiguous(yw, MHA_F32, ws.ndim, ws.dims);
    if ((st = mha_forward(&ot, &wt, r->m, &a))) return cli_fail(r->cmd, st);
    *w = yw;
    *S1 = ws.dims[ws.ndim - 1];
    return 0;
}

// Appends "name: value" to the report's inputs table (at most 16 rows).
typedef struct info_table {
    int n;
    const char *name[16];
    const char *value[16];
    char buf[16][1024];
} info_table;

static void info_add(info_table *t, const char *name, const char *fmt, ...) {
    if (t->n == 16) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->buf[t->n], sizeof t->buf[t->n], fmt, ap);
    va_end(ap);
    t->name[t->n] = name;
    t->value[t->n] = t->buf[t->n];
    t->n++;
}

static void shape_text(char *buf, size_t cap, const mha_tensor *t) {
    size_t k = (size_t)snprintf(buf, cap, "%s (", mha_dtype_name(t->dtype));
    for (int i = 0; i < t->ndim && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    if (k < cap) snprintf(buf + k, cap - k, ")");
}

// The report's inputs table: files, shapes, module, options, command.
static void inspect_info(info_table *t, const run *r, int64_t N, int64_t L, int64_t S,
                         int64_t S1) {
    const mha_config *c = mha_module_config(r->m);
    char sh[256], line[1024];
    size_t k = 0;
    for (int i = 0; i < r->argc && k < sizeof line; i++)
        k += (size_t)snprintf(line + k, sizeof line - k, "%s%s", i ? " " : "mha ", r->argv[i]);
    info_add(t, "command", "%s", line);
    info_add(t, "weights", "%s", r->wpath);
    info_add(t, "module",
             "E %lld, %lld heads, %lld KV heads, head dim %lld, kdim %lld, "
             "vdim %lld, bias %s, add_bias_kv %s, add_zero_attn %s, weights %s",
             (long long)c->embed_dim, (long long)c->num_heads, (long long)c->num_kv_heads,
             (long long)c->head_dim, (long long)c->kdim, (long long)c->vdim,
             c->bias ? "yes" : "no", c->add_bias_kv ? "yes" : "no",
             c->add_zero_attn ? "yes" : "no", mha_dtype_name(c->weight_dtype));
    info_add(t, "inputs", "%s", r->xpath);
    shape_text(sh, sizeof sh, r->a.query);
    info_add(t, "query", "%s%s", sh, r->base.batch_first ? ", batch first" : "");
    if (r->a.key == r->a.query) {
        info_add(t, "key, value", "the query (self-attention)");
    } else {
        shape_text(sh, sizeof sh, r->a.key);
        info_add(t, "key", "%s", sh);
        shape_text(sh, sizeof sh, r->a.value);
        info_add(t, "value", "%s", sh);
    }
    if (r->a.key_padding_mask) {
        shape_text(sh, sizeof sh, r->a.key_padding_mask);
        info_add(t, "key_padding_mask", "%s", sh);
    }
    if (r->a.attn_mask) {
        shape_text(sh, sizeof sh, r->a.attn_mask);
        info_add(t, "attn_mask", "%s", sh);
    }
    const mha_forward_args *a = &r->a;
    info_add(t, "options",
             "causal %s, window left/right %lld/%lld (-1: unbounded), RoPE %s, "
             "ALiBi %s, soft cap %g (0: none)",
             a->opts.is_causal ? "yes" : "no", (long long)a->opts.window_left,
             (long long)a->opts.window_right,
             a->rope.mode == MHA_ROPE_NONE   ? "none"
             : a->rope.mode == MHA_ROPE_NEOX ? "neox"
                                             : "interleaved",
             a->opts.alibi ? "yes" : "no", (double)a->opts.softcap);
    info_add(t, "sizes", "batch %lld, %lld query positions, %lld keys%s", (long long)N,
             (long long)L, (long long)S, S1 > S ? " (and the appended bias_k / zero key)" : "");
    if (r->diag.max_rows)
        info_add(t, "rows examined",
                 "at most %lld per batch element "
                 "(--max-rows)",
                 (long long)r->diag.max_rows);
    else info_add(t, "rows examined", "every row (--max-rows 0)");
    if (r->tokens_path)
        info_add(t, "tokens", "%s (%lld lines)", r->tokens_path, (long long)r->ntokens);
    else info_add(t, "tokens", "none: positions are labelled by index");
}

// text and a newline as the new contents of path (mha_file_write:
// atomically). 0, or 1 after printing.
static int write_text(const char *cmd, const char *path, const char *text) {
    size_t n = text ? strlen(text) : 0;
    char *buf = text ? malloc(n + 1) : NULL;
    if (!buf) {
        fprintf(stderr, "mha %s: out of memory writing %s\n", cmd, path);
        return 1;
    }
    memcpy(buf, text, n);
    buf[n] = '\n';
    mha_status st = mha_file_write(path, buf, n + 1);
    free(buf);
    return st ? cli_fail(cmd, st) : 0;
}

static int run_inspect(run *r) {
    const char *cmd = r->cmd;
    const mha_tensor *q = r->a.query, *k = r->a.key;
    const int sd = q->ndim == 2 || !r->base.batch_first ? 0 : 1;  // the sequence dim
    const int64_t L = q->shape[sd], S = k->shape[sd], N = q->ndim == 3 ? q->shape[1 - sd] : 1;
    if (r->batch_index >= N) {
        char msg[160];
        snprintf(msg, sizeof msg,
                 "--batch-index %lld is out of range: the inputs hold %lld "
                 "batch element%s (0 to %lld)",
                 (long long)r->batch_index, (long long)N, N == 1 ? "" : "s", (long long)N - 1);
        return cli_usage(cmd, msg);
    }
    if (r->tokens_path && read_tokens(r)) return 1;
    if (r->ntokens > L)
        fprintf(stderr,
                "mha %s: note: %s has %lld lines for %lld positions; the extra lines "
                "are not used\n",
                cmd, r->tokens_path, (long long)r->ntokens, (long long)L);
    mha_diag *d = NULL;
    mha_status st = mha_diag_create(&d, r->m, &r->a, &r->diag);
    if (st) return cli_fail(cmd, st);
    if (mkdir(r->ypath, 0777) && errno != EEXIST) {
        fprintf(stderr, "mha %s: cannot create directory %s: %s\n", cmd, r->ypath,
                strerror(errno));
        mha_diag_destroy(d);
        return 1;
    }
    const int64_t H = mha_diag_num_heads(d), rows_examined = mha_diag_rows(d);
    const char *nf = mha_diag_nonfinite(d);
    cJSON *root = diag_json(d);
    char *text = root ? cJSON_Print(root) : NULL;
    char path[4096];
    snprintf(path, sizeof path, "%s/diagnostics.json", r->ypath);
    int rc = write_text(cmd, path, text);
    if (!rc)
        printf("wrote %s (%lld heads, %lld rows examined)%s%s\n", path, (long long)H,
               (long long)rows_examined, nf ? "; non-finite: " : "", nf ? nf : "");
    free(text);
    mha_diag_destroy(d);

    // the pictures: the weights of one batch element, positions [0, plot_len)
    float *w = NULL;
    int64_t S1 = S;
    const int64_t rows = L < r->plot_len ? L : r->plot_len;
    char **labels = NULL;
    char(*num)[24] = NULL;
    if (!rc && inspect_pictures_available())
        rc = inspect_attention(r, r->batch_index, rows, &w, &S1);
    if (!rc) {
        const int64_t cols = S1 < r->plot_len ? S1 : r->plot_len;
        const float *src = w;
        float *blk = w ? run_alloc(r, H * rows * cols) : NULL;
        labels = malloc(sizeof *labels * (size_t)(rows + cols + 1));
        num = malloc(sizeof *num * (size_t)(rows + cols + 1));
        if (!labels || !num || (w && !blk)) {
            fprintf(stderr, "mha %s: out of memory\n", cmd);
            rc = 1;
        }
        for (int64_t h = 0; !rc && blk && h < H; h++)  // (H, rows, S') -> (H, rows, cols)
            for (int64_t i = 0; i < rows; i++)
                memcpy(blk + (h * rows + i) * cols, src + (h * rows + i) * S1,
                       sizeof(float) * (size_t)cols);
        // labels: the tokens (keys too in self-attention), else the index;
        // bias_k and the zero key past the S keys
        const bool self = r->a.key == r->a.query;
        for (int64_t i = 0; !rc && i < rows + cols; i++) {
            const int64_t p = i < rows ? i : i - rows;
            const bool is_key = i >= rows;
            if (is_key && p >= S)
                snprintf(num[i], sizeof num[i], "%s",
                         p == S && mha_module_config(r->m)->add_bias_kv ? "bias_k"
                                                                        : "zero_attn");
            else snprintf(num[i], sizeof num[i], "%lld", (long long)p);
            labels[i] = (!is_key || (self && p < S)) && p < r->ntokens && r->tokens[p][0]
                            ? r->tokens[p]
                            : num[i];
        }
        info_table t;
        t.n = 0;
        inspect_info(&t, r, N, L, S, S1);
        inspect_report rep = {.diag = root,
                              .attn = blk,
                              .H = H,
                              .rows = rows,
                              .cols = cols,
                              .L = L,
                              .S = S1,
                              .batch = r->batch_index,
                              .batch_size = N,
                              .qlabels = (const char *const *)labels,
                              .klabels = (const char *const *)labels + rows,
                              .ninfo = t.n,
                              .info_name = t.name,
                              .info_value = t.value,
                              .ntokens = r->ntokens,
                              .tokens = (const char *const *)r->tokens};
        if (!rc) rc = inspect_write_pictures(cmd, r->ypath, &rep);
    }
    free(labels);
    free(num);
    cJSON_Delete(root);
    return rc;
}

int cmd_inspect(int argc, char **argv) {
    run r;
    memset(&r, 0, sizeof r);
    r.cmd = "inspect";
    int rc = run_parse(&r, false, argc, argv);
    if (rc >= 0) return rc;
    rc = run_load(&r);  // (one process: mha inspect has no --parallel)
    if (!rc) rc = run_inspect(&r);
    run_free(&r);
    return rc;
}
