// bench_report.c: what `mha bench`'s benchmarks measured, as they print
// it: a text block, or one JSON line (--json) whose keys
// bench/bench_torch.py and bench/compare.sh read. The module (or core)
// benchmark's (bench_module.c) and the decode benchmarks' (bench_decode.c)
// results; every fraction of a probe's ceiling (bench_peak.c) is printed
// capped at 100% with a "probe disturbed" warning (a JSON flag) when the
// rate was above it, never silently.
//
// What it deliberately does not do: measure anything (the process's max
// RSS aside, read when printed).
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>

#include "bench.h"

double bench_max_rss_mib(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru)) return 0;
    return (double)ru.ru_maxrss / 1024.0;  // ru_maxrss is in KiB on Linux
}

double bench_median_sorted(const double *t, int64_t n) {
    return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

double bench_frac_capped(double rate, double ceiling, double *raw, bool *disturbed) {
    *raw = ceiling > 0 ? rate / ceiling : 0.0;
    *disturbed = *raw > 1.0;
    return *disturbed ? 1.0 : *raw;
}

// "83.2%", or "100.0% (capped, see the warning)" for a disturbed fraction.
static const char *frac_text(char *buf, size_t cap, double raw) {
    if (raw > 1.0) snprintf(buf, cap, "100.0%% (capped, see the warning)");
    else snprintf(buf, cap, "%.1f%%", 100.0 * raw);
    return buf;
}

// The warning line under a capped fraction: what it was held against.
static void frac_warn(double raw, const char *probe) {
    if (raw > 1.0)
        printf("  warning    probe disturbed: measured rate above the probe's %s (%.1f%% of "
               "it): the fraction is printed capped at 100%%\n",
               probe, 100.0 * raw);
}

// "best of 14 trials, settled" / "... not settled"
static const char *probe_text(char *buf, size_t cap, const bench_probe *p) {
    snprintf(buf, cap, "best of %d %s, %s", p->trials, p->trials == 1 ? "trial" : "trials",
             p->settled ? "settled" : "not settled within its bound");
    return buf;
}

// ---------------------------------------------------------------------------
// The module (or core) benchmark

// The dense FLOP count the rate is given under, in words.
static const char *flop_note(const bench_opts *o) {
    if (o->core && o->backward)
        return o->causal ? "core dense 4BLSE (QK^T + PV), x3 for forward + backward "
                           "(mha_sdpa_backward = 2x forward); causal counted as dense"
                         : "core dense 4BLSE (QK^T + PV), x3 for forward + backward "
                           "(mha_sdpa_backward = 2x forward)";
    if (o->core)
        return o->causal ? "core dense 4BLSE (QK^T + PV); causal counted as dense"
                         : "core dense 4BLSE (QK^T + PV)";
    if (o->backward)
        return o->causal ? "module forward dense 4BLE^2 + 4BSE^2 + 4BLSE (projections "
                           "+ QK^T + PV), x3 for forward + backward (backward = 2x "
                           "forward); causal counted as dense"
                         : "module forward dense 4BLE^2 + 4BSE^2 + 4BLSE (projections "
                           "+ QK^T + PV), x3 for forward + backward (backward = 2x "
                           "forward)";
    return o->causal ? "module forward dense 4BLE^2 + 4BSE^2 + 4BLSE (projections + "
                       "QK^T + PV); causal counted as dense"
                     : "module forward dense 4BLE^2 + 4BSE^2 + 4BLSE (projections + "
                       "QK^T + PV)";
}

static const char *dtype_label(mha_dtype d) {
    return d == MHA_BF16 ? "bf16" : d == MHA_F16 ? "f16" : "f32";
}

static void print_json(const bench_opts *o, const bench_result *r) {
    double raw;
    bool dist;
    const double frac = bench_frac_capped(r->gflops, r->peak.best, &raw, &dist);
    printf("{\"what\": \"mha\", \"impl\": \"%s\", \"impl_ran\": \"%s\", "
           "\"backward_impl\": \"%s\", \"isa\": \"%s\", \"threads\": %d, "
           "\"batch\": %lld, \"seq\": %lld, \"kv_seq\": %lld, \"embed_dim\": %lld, "
           "\"num_heads\": %lld, \"causal\": %s, \"backward\": %s, \"core\": %s, "
           "\"workspace\": \"%s\", \"repeat\": %lld, \"warmup\": %lld, "
           "\"median_ms\": %.4f, \"min_ms\": %.4f, \"max_ms\": %.4f, "
           "\"flop_count\": %.6g, \"gflops\": %.3f, \"peak_gflops\": %.3f, "
           "\"peak_isa\": \"%s\", \"peak_kind\": \"%s\", \"peak_fraction\": %.4f, \"peak_fraction_raw\": %.4f, "
           "\"peak_probe_disturbed\": %s, \"peak_trials\": %d, \"peak_settled\": %s, "
           "\"peak_probes\": %d, \"peak_wall_gflops\": %.3f, \"max_rss_mib\": %.1f, "
           "\"rss_before_mib\": %.1f, \"inputs_mib\": %.1f, "
           "\"window\": %lld, \"visible_fraction\": %.6f, \"saved_forward\": %s, "
           "\"dtype\": \"%s\", \"weight_dtype\": \"%s\", \"pruned_heads\": %lld, "
           "\"head_gate\": \"%s\", \"flop_count_note\": \"%s\"}\n",
           mha_impl_name(o->impl), r->fwd_ran, r->bwd_ran, r->isa, r->threads, (long long)o->B,
           (long long)o->L, (long long)o->S, (long long)o->E, (long long)o->H,
           o->causal ? "true" : "false", o->backward ? "true" : "false",
           o->core ? "true" : "false",
           o->core        ? "n/a"
           : o->workspace ? "preallocated"
                          : "per-call",
           (long long)o->repeat, (long long)o->warmup, r->median, r->min, r->max, r->flops,
           r->gflops, r->peak.best, r->peak.kernel, r->peak_bf16 ? "bf16 dot" : "fp32 FMA",
           frac, raw, dist ? "true" : "false", r->peak.trials,
           r->peak.settled ? "true" : "false", r->peak_probes, r->peak.best_wall, r->rss_max,
           r->rss_before, r->inputs_mib, (long long)o->window, r->visible,
           o->backward && !o->no_save ? "true" : "false", dtype_label(o->dtype),
           dtype_label(o->wdtype), (long long)o->prune, mha_head_gate_name(o->gate),
           flop_note(o));
}

static void print_text(const bench_opts *o, const bench_result *r) {
    printf("mha bench: %s, impl %s (ran: %s), fused kernels %s, %d thread%s\n",
           o->core       ? "attention core (mha_sdpa)"
           : o->backward ? "module forward + backward"
                         : "module forward",
           mha_impl_name(o->impl), r->fwd_ran, r->isa, r->threads, r->threads == 1 ? "" : "s");
    if (o->backward && o->core)
        printf("  backward   mha_sdpa_backward ran the %s implementation%s\n", r->bwd_ran,
               o->no_save ? ", the forward's rows recomputed (--no-save)"
                          : ", from the forward's saved rows (args.save)");
    else if (o->backward)
        printf("  backward   mha_backward ran the %s implementation%s\n", r->bwd_ran,
               o->no_save ? ", re-running the forward (--no-save)"
                          : ", from the forward's saved state (args.save)");
    if (o->core)
        printf("  shape      q (%lld, %lld, %lld, %lld), k/v (%lld, %lld, %lld, %lld)%s\n",
               (long long)o->B, (long long)o->H, (long long)o->L, (long long)(o->E / o->H),
               (long long)o->B, (long long)o->H, (long long)o->S, (long long)(o->E / o->H),
               o->causal ? ", causal" : "");
    else
        printf("  shape      batch %lld, seq %lld, kv_seq %lld, embed_dim %lld, heads %lld "
               "(d %lld)%s%s\n",
               (long long)o->B, (long long)o->L, (long long)o->S, (long long)o->E,
               (long long)o->H, (long long)(o->E / o->H), o->causal ? ", causal" : "",
               o->S == o->L ? ", self-attention" : "");
    if (o->prune || o->gate)
        printf("  heads      %lld of %lld pruned (the last; their attention skipped), "
               "gates %s\n",
               (long long)o->prune, (long long)o->H, mha_head_gate_name(o->gate));
    printf("  time       median %.3f ms (min %.3f, max %.3f; %lld run%s after %lld "
           "warm-up%s)\n",
           r->median, r->min, r->max, (long long)o->repeat, o->repeat == 1 ? "" : "s",
           (long long)o->warmup, o->warmup == 1 ? "" : "s");
    printf("  work       %.3f GFLOP: %s\n", r->flops * 1e-9, flop_note(o));
    if (o->causal || o->window)
        printf("  band       %s%s: %.1f%% of the (i, j) score pairs are visible\n",
               o->causal ? (o->window ? "causal, " : "causal") : "", o->window ? "window" : "",
               100.0 * r->visible);
    char ft[64], pt[96];
    double raw;
    bool dist;
    (void)bench_frac_capped(r->gflops, r->peak.best, &raw, &dist);
    printf("  speed      %.1f GFLOP/s = %s of the measured %s peak %.1f GFLOP/s (%s, "
           "%d thread%s; each thread's products on its CPU time, %s%s; %.1f on the wall "
           "clock%s)\n",
           r->gflops, frac_text(ft, sizeof ft, raw), r->peak_bf16 ? "bf16 dot" : "fp32 FMA",
           r->peak.best, r->peak.kernel, r->threads, r->threads == 1 ? "" : "s",
           probe_text(pt, sizeof pt, &r->peak),
           r->peak_probes > 1 ? "; probed again after the runs" : "", r->peak.best_wall,
           r->peak.best_wall < 0.9 * r->peak.best ? ": the CPUs shared with other work" : "");
    frac_warn(raw, "peak");
    printf("  memory     process max RSS %.1f MiB (%.1f MiB before the first call; the "
           "benchmark's own tensors %.1f MiB)\n",
           r->rss_max, r->rss_before, r->inputs_mib);
    if (!o->core)
        printf("  scratch    %s\n", o->workspace ? "allocated once (args.workspace)"
                                                 : "allocated by every call (mha_forward)");
    if (o->impl == MHA_IMPL_FUSED && strncmp(r->fwd_ran, "fused", 5) != 0)
        printf("  note       --impl fused was accepted but the %s path ran\n", r->fwd_ran);
}

void bench_print_module(const bench_opts *o, const bench_result *r) {
    if (o->json) print_json(o, r);
    else print_text(o, r);
}

// ---------------------------------------------------------------------------
// The decode benchmarks

void bench_print_decode(const bench_opts *o, const bench_decode_result *r) {
    const int64_t B = o->B, H = o->H, Hkv = o->kv_heads, d = o->E / o->H, N = o->kv_len,
                  T = o->L;
    const char *kv_name = mha_kv_dtype_name(o->kv_dtype);
    if (o->json)
        printf("{\"what\": \"mha\", \"decode\": true, \"threads\": %d, \"isa\": \"%s\", "
               "\"batch\": %lld, \"num_heads\": %lld, \"num_kv_heads\": %lld, "
               "\"head_dim\": %lld, \"queries\": %lld, \"kv_len\": %lld, "
               "\"kv_dtype\": \"%s\", \"block_size\": %lld, \"pool_layout\": \"%s\", "
               "\"repeat\": %lld, "
               "\"median_ms\": %.4f, "
               "\"min_ms\": %.4f, \"max_ms\": %.4f, \"kv_bytes\": %.6g, "
               "\"kv_gbps\": %.3f, \"read_bandwidth_gbps\": %.3f, "
               "\"read_bandwidth_wall_gbps\": %.3f, "
               "\"bandwidth_fraction\": %.4f, \"bandwidth_fraction_raw\": %.4f, "
               "\"bandwidth_probe_disturbed\": %s, \"bandwidth_kernel\": \"%s\", "
               "\"bandwidth_best_gbps\": %.3f, \"bandwidth_best_fraction\": %.4f, "
               "\"bandwidth_best_fraction_raw\": %.4f, \"bandwidth_trials\": %d, "
               "\"bandwidth_settled\": %s, \"bandwidth_buffer_mib\": %.1f, "
               "\"bandwidth_hugepage_mib\": %.1f, \"piece_bytes\": %zu, "
               "\"random_pieces_gbps\": %.3f, \"random_pieces_fraction\": %.4f, "
               "\"random_pieces_fraction_raw\": %.4f, \"max_rss_mib\": %.1f}\n",
               r->threads, mha_isa(), (long long)B, (long long)H, (long long)Hkv, (long long)d,
               (long long)T, (long long)N, kv_name, (long long)o->block,
               r->paged ? mha_paged_layout_name(o->layout) : "", (long long)o->repeat,
               r->median, r->min, r->max, r->bytes, r->gbs, r->bw, r->bw_wall, r->frac, r->raw,
               r->dist || r->best_dist || r->pieces_dist ? "true" : "false",
               r->bp.kernel ? r->bp.kernel : "", r->bp.best, r->best_frac, r->best_raw,
               r->bp.trials, r->bp.settled ? "true" : "false", r->bp.buffer_mib,
               r->bp.huge_mib, r->pbw > 0 ? r->piece : 0, r->pbw, r->pieces_frac,
               r->pieces_raw, bench_max_rss_mib());
    else {
        char ft[64], bft[64], pt[96];
        printf("mha bench: decode step (%s), %d thread%s, kernels %s\n"
               "  shape      batch %lld, %lld query head%s x %lld quer%s, %lld KV head%s, "
               "d %lld, %lld cached tokens (%s)\n"
               "  time       median %.3f ms (min %.3f, max %.3f; %lld runs)\n"
               "  reads      K and V: %.1f MiB per step = %.1f GB/s; %s of the read "
               "bandwidth (the median over the steps of each step's\n"
               "             against a pass of the best read kernel right after it; "
               "median %.1f GB/s on the threads' CPU time, %.1f on the wall clock%s, %d "
               "thread%s)\n",
               r->paged ? "mha_paged_cache_attend" : "mha_kv_cache_attend", r->threads,
               r->threads == 1 ? "" : "s", mha_isa(), (long long)B, (long long)H,
               H == 1 ? "" : "s", (long long)T, T == 1 ? "y" : "ies", (long long)Hkv,
               Hkv == 1 ? "" : "s", (long long)d, (long long)N, r->what, r->median, r->min,
               r->max, (long long)o->repeat, r->bytes / 1048576.0, r->gbs,
               frac_text(ft, sizeof ft, r->raw), r->bw, r->bw_wall,
               r->bw_wall < 0.9 * r->bw ? ": the CPUs shared with other work" : "", r->threads,
               r->threads == 1 ? "" : "s");
        frac_warn(r->raw, "read bandwidth at its step");
        printf("  bandwidth  best read kernel %s: %.1f GB/s (%s; each thread's bytes on "
               "its CPU time; a %.0f MiB buffer, %.0f MiB of it on huge pages%s); the "
               "step reads %s of that\n",
               r->bp.kernel ? r->bp.kernel : "none", r->bp.best,
               probe_text(pt, sizeof pt, &r->bp), r->bp.buffer_mib,
               r->bp.huge_mib > 0 ? r->bp.huge_mib : 0.0,
               r->bp.huge_mib < 0 ? " (unknown)" : "", frac_text(bft, sizeof bft, r->best_raw));
        frac_warn(r->best_raw, "best read bandwidth");
        if (r->pbw > 0) {
            printf("  pieces     the same bytes read as random %zu-byte pieces (%s "
                   "block of K rows; the\n"
                   "             pool's blocks scattered): %.1f GB/s here; the step reads "
                   "%s of that\n",
                   r->piece, r->block_major ? "a" : "a head's", r->pbw,
                   frac_text(pt, sizeof pt, r->pieces_raw));
            frac_warn(r->pieces_raw, "random-pieces bandwidth");
        }
        printf("  memory     process max RSS %.1f MiB\n", bench_max_rss_mib());
    }
}

void bench_print_decode_module(const bench_opts *o, const bench_decode_result *r) {
    const int64_t B = o->B, E = o->E, H = o->H, Hkv = o->kv_heads, d = E / H, N = o->kv_len,
                  T = o->L;
    const char *kv_name = mha_kv_dtype_name(o->kv_dtype);
    if (o->json)
        printf("{\"what\": \"mha\", \"decode\": true, \"module\": true, \"threads\": %d, "
               "\"isa\": \"%s\", \"batch\": %lld, \"embed_dim\": %lld, "
               "\"num_heads\": %lld, \"num_kv_heads\": %lld, \"head_dim\": %lld, "
               "\"tokens\": %lld, \"kv_len\": %lld, \"weight_dtype\": \"%s\", "
               "\"kv_dtype\": \"%s\", \"head_gate\": \"%s\", \"pruned\": %lld, "
               "\"repeat\": %lld, \"median_ms\": %.4f, \"min_ms\": %.4f, "
               "\"max_ms\": %.4f, \"ms_per_token\": %.4f, \"weight_bytes\": %.6g, "
               "\"kv_bytes\": %.6g, \"bytes_per_token\": %.6g, \"gbps\": %.3f, "
               "\"read_bandwidth_gbps\": %.3f, \"read_bandwidth_wall_gbps\": %.3f, "
               "\"bandwidth_fraction\": %.4f, "
               "\"bandwidth_fraction_raw\": %.4f, \"bandwidth_probe_disturbed\": %s, "
               "\"bandwidth_kernel\": \"%s\", \"bandwidth_trials\": %d, "
               "\"bandwidth_settled\": %s, \"max_rss_mib\": %.1f}\n",
               r->threads, mha_isa(), (long long)B, (long long)E, (long long)H, (long long)Hkv,
               (long long)d, (long long)T, (long long)N, dtype_label(o->wdtype), kv_name,
               mha_head_gate_name(o->gate), (long long)o->prune, (long long)o->repeat,
               r->median, r->min, r->max, r->median / (double)(B * T), r->wbytes, r->kvbytes,
               r->bytes / (double)(B * T), r->gbs, r->bw, r->bp.best_wall, r->frac, r->raw,
               r->dist ? "true" : "false", r->bp.kernel ? r->bp.kernel : "", r->bp.trials,
               r->bp.settled ? "true" : "false", bench_max_rss_mib());
    else {
        char ft[64], pt[96];
        printf("mha bench: module decode step (mha_forward_cached), %d thread%s, kernels "
               "%s\n"
               "  shape      batch %lld x %lld new token%s, E %lld, %lld head%s (%lld KV), "
               "d %lld, %lld cached tokens, weights %s, cache %s\n"
               "  time       median %.3f ms (min %.3f, max %.3f; %lld runs) = %.3f ms per "
               "token\n"
               "  reads      weights %.2f MiB + K and V %.2f MiB = %.2f MiB per step "
               "(%.2f MiB per token)\n"
               "             = %.1f GB/s = %s of the read bandwidth %.1f GB/s measured "
               "here (%d thread%s; best read kernel %s, %s)\n",
               r->threads, r->threads == 1 ? "" : "s", mha_isa(), (long long)B, (long long)T,
               T == 1 ? "" : "s", (long long)E, (long long)H, H == 1 ? "" : "s",
               (long long)Hkv, (long long)d, (long long)N, dtype_label(o->wdtype), kv_name,
               r->median, r->min, r->max, (long long)o->repeat, r->median / (double)(B * T),
               r->wbytes / 1048576.0, r->kvbytes / 1048576.0, r->bytes / 1048576.0,
               r->bytes / (double)(B * T) / 1048576.0, r->gbs,
               frac_text(ft, sizeof ft, r->raw), r->bw, r->threads, r->threads == 1 ? "" : "s",
               r->bp.kernel ? r->bp.kernel : "none", probe_text(pt, sizeof pt, &r->bp));
        frac_warn(r->raw, "read bandwidth (a step's bytes that stay in the caches read "
                          "faster than memory)");
        printf("  memory     process max RSS %.1f MiB\n", bench_max_rss_mib());
    }
}
