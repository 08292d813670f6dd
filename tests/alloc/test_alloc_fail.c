// test_alloc_fail.c: every allocation the library makes, made to fail one
// at a time. Built only with -DMHA_FAULT_INJECTION=ON (the allocation
// wrappers of src/error.c then count their calls and fail the one armed);
// tests/alloc/run.sh builds it under AddressSanitizer + LeakSanitizer.
//
// For each scenario (a file load, a Hugging Face checkpoint's layers, a
// forward, a backward, ...):
//   1. run it once, counting its allocations N and keeping its result bytes;
//   2. for n = 1..N: make the n-th allocation fail (alone, then together
//      with every later one: the error paths' own allocations fail too) and
//      require MHA_ERR_NOMEM with a last-error message about memory, the
//      caller's state unchanged where the API keeps it (a KV cache's
//      lengths, a module's parameters), and the scenario, run again without
//      failures, giving the same result bytes (nothing corrupted);
//   3. a leak check (LeakSanitizer, when built with it).
// cJSON's allocations (the safetensors header, parsed and written) are
// counted and failed too, through cJSON_InitHooks: the header's parse
// failing for memory must be MHA_ERR_NOMEM as well, not a format error.
// The atomic writer's system calls (src/file.c) are made to fail too, one
// step at a time (mha__fault_io_arm, io_faults below): MHA_ERR_IO naming
// the file and the OS error, the old file intact, no temporary file left.
// Not the library's and not swept: the C library's own (fopen's buffer) and
// OpenMP's runtime (run it with OMP_NUM_THREADS=1 for a single-threaded
// sweep; the counts do not depend on the thread count). LAPACK's workspace
// comes from the library (diag.c), so it is swept.
//
// With MHA_ALLOC_SITES=path it writes each allocation site reached (module
// offset of the return address, one line per site and scenario) for
// run.sh to map to source lines with addr2line; MHA_ALLOC_VERBOSE=1 prints
// every failing run's status and message.
//
// The MPI layer (test_alloc_fail_mpi: this file built with MHA_TEST_MPI and
// libmha_mpi, run as `mpiexec -n P test_alloc_fail_mpi --mpi`): the same
// sweep over mha_mpi_forward / _backward (every scheme, a saved ring
// forward) and mha_mpi_forward_cached, on every rank, the n-th allocation
// failing on one rank t at a time (for each t): every rank must return
// MHA_ERR_NOMEM, the others with rank t's message ("rank t: ... memory"),
// nobody left waiting; each rank then reruns clean to its own result.
// Sites go to path.<rank>.
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "../check.h"
#include "../checkpoint_util.h"
#include "file.h"
#include "internal.h"
#include "part.h"
#include "mha.h"
#ifdef MHA_TEST_MPI
#include "mha_mpi.h"
#endif

#if defined(__SANITIZE_ADDRESS__)
#define MHA_TEST_LSAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MHA_TEST_LSAN 1
#endif
#endif
#ifdef MHA_TEST_LSAN
#include <sanitizer/lsan_interface.h>
#endif

#ifndef MHA_FAULT_INJECTION
#error "build with -DMHA_FAULT_INJECTION=ON"
#endif

// ---------------------------------------------------------------------------
// Helpers: random numbers, the result buffer, files

static uint64_t g_rng = 77;
static float frand(void) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(g_rng >> 11) * 0x1p-53 * 2.0 - 1.0);
}
static void fill(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = frand();
}
static float *new_floats(int64_t n) {  // test memory: plain calloc, not counted
    float *x = calloc((size_t)(n > 0 ? n : 1), sizeof *x);
    if (!x) abort();
    fill(x, n);
    return x;
}

// What a scenario computed, as bytes (compared with the clean run's).
static unsigned char *g_res;
static size_t g_len, g_cap;
static void res_put(const void *p, size_t n) {
    if (g_len + n > g_cap) {
        g_cap = (g_len + n) * 2 + 256;
        g_res = realloc(g_res, g_cap);
        if (!g_res) abort();
    }
    if (n) memcpy(g_res + g_len, p, n);
    g_len += n;
}
static void res_put_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        res_put("<no file>", 9);
        return;
    }
    unsigned char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) res_put(buf, n);
    fclose(f);
}
static void res_put_module(const mha_module *m) {
    const mha_config *c = mha_module_config(m);
    res_put(c, sizeof *c);
    for (int i = 0; i < mha_module_num_params(m); i++) {
        mha_param p;
        if (mha_module_param_at(&p, m, i)) abort();
        res_put(p.name, strlen(p.name) + 1);
        res_put(p.storage, (size_t)p.numel * mha_dtype_size(p.dtype));
    }
    for (int64_t h = 0; h < c->num_heads; h++) {
        bool pr = mha_module_head_pruned(m, h);
        res_put(&pr, 1);
    }
}

static char g_tmp[512];
static const char *tmp_path(char *buf, size_t cap, const char *name) {
    snprintf(buf, cap, "%s/alloc_%s", g_tmp, name);
    return buf;
}

// cJSON's allocations go through the same counter (one site: this one).
static const void *g_cjson_site;
static void *cjson_malloc(size_t n) {
    void *p = mha__malloc(n);
    long k = mha__fault_count();
    if (!g_cjson_site && k > 0) g_cjson_site = mha__fault_site(k - 1);
    return p;
}

// ---------------------------------------------------------------------------
// The sweep

typedef mha_status (*scen_fn)(const void *arg);
typedef bool (*intact_fn)(const void *arg);  // after a failure: state kept

static FILE *g_sites_out;
static bool g_verbose;  // MHA_ALLOC_VERBOSE=1: every failing run's message
static long g_total_allocs, g_total_cjson, g_total_runs;
static int g_scenarios;
#define MAX_SITES 1024
static const void *g_all_sites[MAX_SITES];
static int g_nall_sites;

static void add_site(const void **set, int *n, const void *s) {
    for (int i = 0; i < *n; i++)
        if (set[i] == s) return;
    if (*n < MAX_SITES) set[(*n)++] = s;
}

static void write_site(const void *s, const char *scen) {
    if (!g_sites_out) return;
    Dl_info di;
    uintptr_t a = (uintptr_t)s;
    if (dladdr(s, &di) && di.dli_fbase) {
        const Elf64_Ehdr *eh = di.dli_fbase;
        if (eh->e_type == ET_DYN) a -= (uintptr_t)di.dli_fbase;  // PIE: offset
    }
    fprintf(g_sites_out, "0x%lx %s\n", (unsigned long)a, scen);
}

static bool mentions_memory(const char *msg) { return strstr(msg, "memory") != NULL; }

// This process among the MPI ranks (a single process: rank 0 of 1).
static int g_rank = 0, g_P = 1;
#ifdef MHA_TEST_MPI
static long from_rank(long v, int root) {  // rank root's v, on every rank
    MPI_Bcast(&v, 1, MPI_LONG, root, MPI_COMM_WORLD);
    return v;
}
static int on_any_rank(int v) {
    MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    return v;
}
#else
static long from_rank(long v, int root) { return (void)root, v; }
static int on_any_rank(int v) { return v; }
#endif

static void sweep(const char *name, scen_fn fn, const void *arg, intact_fn intact) {
    g_scenarios++;
    // 1. the clean run: its allocations, its sites, its result
    g_len = 0;
    mha__fault_arm(0, 0);
    mha_status st = fn(arg);
    const long N = mha__fault_count();
    CHECKF(st == MHA_OK, "%s: clean run -> %s: %s", name, mha_status_string(st),
           mha_last_error());
    if (st) return;
    const void *sites[MAX_SITES];
    int nsites = 0;
    long ncjson = 0;
    for (long i = 0; i < N && i < 4096; i++) {
        const void *s = mha__fault_site(i);
        if (s == g_cjson_site) {
            ncjson++;
            continue;
        }
        add_site(sites, &nsites, s);
        add_site(g_all_sites, &g_nall_sites, s);
    }
    for (int i = 0; i < nsites; i++) write_site(sites[i], name);
    unsigned char *golden = malloc(g_len ? g_len : 1);
    const size_t glen = g_len;
    if (!golden) abort();
    memcpy(golden, g_res, g_len);

    // 2. the n-th allocation fails (alone; then with every later one), on
    //    rank t (a single process: t = 0), every rank running the scenario
    int bad = 0;
    long runs = 0;
    for (int t = 0; t < g_P; t++) {
        const long Nt = from_rank(N, t);
        char where[64] = "";
        if (g_P > 1) snprintf(where, sizeof where, " on rank %d (this is rank %d)", t, g_rank);
        for (int sticky = 0; sticky < 2; sticky++)
            for (long n = 1; n <= Nt; n++) {
                g_len = 0;
                mha__fail(MHA_OK, "%s", "");  // clear the last error
                mha__fault_arm(g_rank == t ? n : 0, sticky);
                st = fn(arg);
                const long failed = mha__fault_failures();
                mha__fault_arm(0, 0);
                runs++;
                const char *msg = mha_last_error();
                bool ok = (failed > 0 || g_rank != t) && st == MHA_ERR_NOMEM &&
                          mentions_memory(msg);
                if (g_verbose)
                    printf("  %ld%s%s: %s: %s\n", n, sticky ? "+" : "", where,
                           mha_status_string(st), msg);
                CHECKF(ok,
                       "%s: allocation %ld of %ld failing%s (%s; %ld failed): -> %s: \"%s\"",
                       name, n, Nt, where, sticky ? "and every later one" : "alone", failed,
                       mha_status_string(st), msg);
                if (intact) {
                    bool kept = intact(arg);
                    CHECKF(kept, "%s: allocation %ld of %ld failing%s (%s): the state changed",
                           name, n, Nt, where, sticky ? "and every later one" : "alone");
                    ok = ok && kept;
                }
                // the same scenario, no failure: the same result
                g_len = 0;
                st = fn(arg);
                const bool same = st == MHA_OK && g_len == glen &&
                                  memcmp(g_res, golden, glen) == 0;
                CHECKF(same,
                       "%s: after allocation %ld of %ld failed%s (%s), the clean run -> "
                       "%s%s",
                       name, n, Nt, where, sticky ? "and every later one" : "alone",
                       mha_status_string(st), st ? "" : " with a different result");
                bad += !ok || !same;
            }
    }
    free(golden);
    // 3. leaks so far (LeakSanitizer)
    int leaks = 0;
#ifdef MHA_TEST_LSAN
    leaks = __lsan_do_recoverable_leak_check();
    CHECKF(!leaks, "%s: memory leaked (LeakSanitizer's report above)", name);
#endif
    g_total_allocs += N;
    g_total_cjson += ncjson;
    g_total_runs += runs;
    const int failed_somewhere = on_any_rank(bad || leaks);
    if (g_rank == 0)
        printf("%-56s %4ld allocations (%3ld cJSON) %3d sites %5ld failing runs: %s\n", name,
               N, ncjson, nsites, runs, failed_somewhere ? "FAILED" : "ok");
    fflush(stdout);
}

// ---------------------------------------------------------------------------
// Modules and files

typedef struct mod_spec {
    int64_t E, H, Hkv, kdim, vdim;
    bool bias, bias_kv, zero_attn;
    mha_head_gate gate;
    mha_dtype wdt;
    float dropout;
    int npruned;  // heads 1, 3, 5, ... pruned
} mod_spec;

// A module of spec s with random parameters (gates included).
static mha_module *make_module(const mod_spec *s) {
    mha_config c;
    mha_config_init(&c, s->E, s->H);
    c.num_kv_heads = s->Hkv;
    c.kdim = s->kdim;
    c.vdim = s->vdim;
    c.bias = s->bias;
    c.add_bias_kv = s->bias_kv;
    c.add_zero_attn = s->zero_attn;
    c.head_gate = s->gate;
    c.dropout = s->dropout;
    mha_module *m = NULL, *h = NULL;
    if (mha_module_create(&m, &c)) abort();
    for (int i = 0; i < mha_module_num_params(m); i++) {
        mha_param p;
        if (mha_module_param_at(&p, m, i)) abort();
        for (int64_t j = 0; j < p.numel; j++) p.data[j] = 0.5f * frand();
    }
    int64_t heads[16], n = 0;
    for (int64_t k = 0; k < s->npruned; k++) heads[n++] = (2 * k + 1) % s->H;
    if (n && mha_module_prune_heads(m, heads, n)) abort();
    if (s->wdt == MHA_F32) return m;
    if (mha_module_convert(&h, m, s->wdt)) abort();
    mha_module_destroy(m);
    return h;
}

// safetensors: open (or parse from memory), every tensor read as F32, the
// metadata, close.
typedef struct st_arg {
    const char *path;
    bool from_memory;
    const unsigned char *bytes;
    size_t len;
} st_arg;

static mha_status sc_st_read(const void *argp) {
    const st_arg *a = argp;
    mha_st_file *f;
    mha_status st = a->from_memory ? mha_st_parse(&f, a->bytes, a->len, "mem.safetensors")
                                   : mha_st_open(&f, a->path);
    if (st) return st;
    for (int64_t i = 0; i < mha_st_num_tensors(f); i++) {
        mha_st_tensor t;
        if ((st = mha_st_tensor_at(&t, f, i))) break;
        float *x = calloc((size_t)t.numel + 1, sizeof *x);
        if ((st = mha_st_read(x, sizeof *x * (size_t)(t.numel + 1), MHA_F32, &t))) {
            free(x);
            break;
        }
        res_put(t.name, strlen(t.name) + 1);
        res_put(t.shape, sizeof t.shape);
        res_put(x, sizeof *x * (size_t)t.numel);
        free(x);
    }
    for (int64_t i = 0; !st && i < mha_st_num_metadata(f); i++) {
        const char *k, *v;
        if ((st = mha_st_metadata_at(&k, &v, f, i))) break;
        res_put(k, strlen(k) + 1);
        res_put(v, strlen(v) + 1);
    }
    mha_st_tensor t;
    if (!st) st = mha_st_find(&t, f, "w.bf16");
    const char *lab = mha_st_label(f);
    res_put(lab, strlen(lab) + 1);
    mha_st_close(f);
    return st;
}

// safetensors: a writer with several tensors and metadata (one replaced),
// saved; the file's bytes.
static mha_status sc_st_write(const void *argp) {
    const char *path = argp;
    static float w[6 * 5], b[7];
    static uint16_t h[4 * 3];
    static int64_t ids[5] = {1, 2, 3, 5, 8};
    static bool init;
    if (!init) {
        fill(w, 30), fill(b, 7);
        for (int i = 0; i < 12; i++) h[i] = mha_f32_to_bf16(frand());
        init = true;
    }
    mha_st_writer *wr;
    mha_status st = mha_st_writer_create(&wr);
    if (st) return st;
    if (!st) st = mha_st_writer_add(wr, "w.f32", MHA_F32, 2, (int64_t[]){6, 5}, w);
    if (!st) st = mha_st_writer_add(wr, "b", MHA_F32, 1, (int64_t[]){7}, b);
    if (!st) st = mha_st_writer_add(wr, "w.bf16", MHA_BF16, 2, (int64_t[]){4, 3}, h);
    if (!st) st = mha_st_writer_add(wr, "ids", MHA_I64, 1, (int64_t[]){5}, ids);
    if (!st) st = mha_st_writer_add(wr, "scalar", MHA_F32, 0, NULL, b);
    if (!st) st = mha_st_writer_set_metadata(wr, "format", "pt");
    if (!st) st = mha_st_writer_set_metadata(wr, "note", "first");
    if (!st) st = mha_st_writer_set_metadata(wr, "note", "replaced");
    if (!st) st = mha_st_writer_set_metadata(wr, "num_heads", "4");
    if (!st) st = mha_st_writer_save(wr, path);
    mha_st_writer_destroy(wr);
    if (!st) res_put_file(path);
    return st;
}

// I/O faults: each step of the atomic writer (src/file.c) made to fail
// with ENOSPC and with EIO (mha__fault_io_arm) under mha_st_writer_save and
// mha_file_write: MHA_ERR_IO with a message naming the file and the OS
// error, the old file byte for byte as it was (after a failing directory
// fsync, the last step, the new file is already in place: the message
// says so), no temporary file left; the next save works.
static size_t file_bytes(const char *path, unsigned char *buf, size_t cap) {
    FILE *f = fopen(path, "rb");
    size_t n = f ? fread(buf, 1, cap, f) : 0;
    if (f) fclose(f);
    return n;
}
static int dir_entries(const char *dir) {  // besides . and ..
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));)
        n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    if (d) closedir(d);
    return n;
}
static mha_status sc_st_write(const void *argp);
static void io_faults(void) {
    char dir[600], path[700];
    tmp_path(dir, sizeof dir, "io");
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) perror(dir);
    snprintf(path, sizeof path, "%s/t.safetensors", dir);
    static const char old[] = "the old file";
    static const char *const steps[] = {"",      "open",   "write",          "fsync",
                                        "close", "rename", "directory fsync"};
    const int errs[2] = {ENOSPC, EIO};
    int runs = 0;
    for (int step = MHA__IO_OPEN; step <= MHA__IO_DIR_FSYNC; step++) {
        for (int e = 0; e < 4; e++) {
            CHECK_OK(mha_file_write(path, old, sizeof old - 1));
            mha__fault_io_arm((mha__io_step)step, errs[e % 2]);
            mha_status st = e < 2 ? sc_st_write(path) : mha_file_write(path, "new!", 4);
            g_len = 0;
            mha__fault_io_arm(0, 0);
            const char *msg = mha_last_error();
            if (g_verbose) printf("  %s fault: %s\n", steps[step], msg);
            CHECKF(st == MHA_ERR_IO && strstr(msg, path) && strstr(msg, strerror(errs[e % 2])),
                   "%s fault (%s): %s: %s", steps[step], strerror(errs[e % 2]),
                   mha_status_string(st), msg);
            unsigned char buf[4096];
            size_t n = file_bytes(path, buf, sizeof buf);
            if (step == MHA__IO_DIR_FSYNC)
                CHECKF(n > 0 && !(n == sizeof old - 1 && !memcmp(buf, old, n)) &&
                           strstr(msg, "renamed into place"),
                       "directory fsync fault: the new file should be in place: %s", msg);
            else
                CHECKF(n == sizeof old - 1 && !memcmp(buf, old, n),
                       "%s fault: the old file changed (%zu bytes)", steps[step], n);
            const int entries = dir_entries(dir);
            CHECKF(entries == 1, "%s fault: %d entries left in %s", steps[step], entries, dir);
            runs++;
        }
        CHECK_OK(sc_st_write(path));  // and then a clean save
        g_len = 0;
    }
    remove(path);
    printf("I/O faults: %d failing saves (6 steps x ENOSPC/EIO x st writer/mha_file_write)\n",
           runs);
}

// mha_module_load from a file saved by mha_module_save.
typedef struct load_arg {
    char path[600];
    mha_config base;
    bool use_base;
} load_arg;

static mha_status sc_module_load(const void *argp) {
    const load_arg *a = argp;
    mha_st_file *f;
    mha_status st = mha_st_open(&f, a->path);
    if (st) return st;
    mha_module *m;
    st = mha_module_load(&m, f, a->use_base ? &a->base : NULL);
    mha_st_close(f);
    if (st) return st;
    res_put_module(m);
    mha_module_destroy(m);
    return MHA_OK;
}

// create, init (orthogonal), convert to BF16 and back, save.
typedef struct create_arg {
    mod_spec spec;
    char path[600];
} create_arg;

static mha_status sc_module_create(const void *argp) {
    const create_arg *a = argp;
    const mod_spec *s = &a->spec;
    mha_config c;
    mha_config_init(&c, s->E, s->H);
    c.num_kv_heads = s->Hkv;
    c.kdim = s->kdim;
    c.vdim = s->vdim;
    c.add_bias_kv = s->bias_kv;
    c.head_gate = s->gate;
    mha_module *m = NULL, *h = NULL, *f = NULL;
    mha_status st = mha_module_create(&m, &c);
    mha_init_options io;
    mha_init_options_init(&io);
    io.scheme = MHA_INIT_ORTHOGONAL;
    io.seed = 3;
    if (!st) st = mha_module_init(m, &io);
    if (!st) st = mha_module_prune_heads(m, (int64_t[]){1}, 1);
    if (!st) st = mha_module_convert(&h, m, MHA_BF16);
    if (!st) st = mha_module_init(h, &io);  // half weights: through a float32 copy
    if (!st) st = mha_module_convert(&f, h, MHA_F32);
    if (!st) st = mha_module_save(h, a->path);
    if (!st) {
        res_put_module(m);
        res_put_module(f);
        res_put_file(a->path);
    }
    mha_module_destroy(m);
    mha_module_destroy(h);
    mha_module_destroy(f);
    return st;
}

// mha_module_init on an existing module: on failure the parameters stay.
typedef struct init_arg {
    mha_module *m;
    unsigned char *snap;  // the parameters before
    size_t snap_len;
    mha_init_scheme scheme;
} init_arg;

static size_t module_bytes(const mha_module *m, unsigned char *out) {
    size_t n = 0;
    for (int i = 0; i < mha_module_num_params(m); i++) {
        mha_param p;
        if (mha_module_param_at(&p, m, i)) abort();
        size_t b = (size_t)p.numel * mha_dtype_size(p.dtype);
        if (out) memcpy(out + n, p.storage, b);
        n += b;
    }
    return n;
}
static void module_restore(mha_module *m, const unsigned char *in) {
    size_t n = 0;
    for (int i = 0; i < mha_module_num_params(m); i++) {
        mha_param p;
        if (mha_module_param_at(&p, m, i)) abort();
        size_t b = (size_t)p.numel * mha_dtype_size(p.dtype);
        memcpy(p.storage, in + n, b);
        n += b;
    }
}
static bool module_same(const mha_module *m, const unsigned char *snap, size_t len) {
    unsigned char *now = malloc(len);
    bool same = module_bytes(m, now) == len && memcmp(now, snap, len) == 0;
    free(now);
    return same;
}

static mha_status sc_module_init(const void *argp) {
    const init_arg *a = argp;
    mha_init_options io;
    mha_init_options_init(&io);
    io.scheme = a->scheme;
    io.seed = 11;
    mha_status st = mha_module_init(a->m, &io);
    if (st) return st;
    res_put_module(a->m);
    module_restore(a->m, a->snap);
    return MHA_OK;
}
static bool init_intact(const void *argp) {
    const init_arg *a = argp;
    bool same = module_same(a->m, a->snap, a->snap_len);
    if (!same) module_restore(a->m, a->snap);
    return same;
}

// ---------------------------------------------------------------------------
// Forward and backward

typedef struct fwd_arg {
    const char *name;
    mha_module *m, *grads;
    mha_impl impl;
    int64_t L, S, N;
    bool f64;      // float64 input views
    bool weights;  // need_weights
    bool average;  // averaged weights
    bool masks;    // key padding (bool) and attn_mask (float)
    bool causal;
    bool extras;      // RoPE, ALiBi, window, soft cap
    bool training;    // dropout
    bool saved;       // backward through mha_saved
    bool accumulate;  // backward adds to the gradients (then kept on failure)
    void *q, *k, *v, *dout, *dq, *dk, *dv;  // (L|S, N, E|kdim|vdim)
    void *dq0, *dk0, *dv0;                  // their values before a backward
    unsigned char *gsnap;                   // the grads module's before
    void *y, *w;
    unsigned char *kpm;  // (N, S)
    float *am;           // (L, S)
} fwd_arg;

static void fwd_setup(fwd_arg *a) {
    const mha_config *c = mha_module_config(a->m);
    const int64_t E = c->embed_dim, kd = c->kdim, vd = c->vdim, H = c->num_heads;
    const int64_t Sp = a->S + c->add_bias_kv + c->add_zero_attn;
    const size_t es = a->f64 ? sizeof(double) : sizeof(float);
    const int64_t nq = a->L * a->N * E, nk = a->S * a->N * kd, nv = a->S * a->N * vd;
    float *tq = new_floats(nq), *tk = new_floats(nk), *tv = new_floats(nv),
          *td = new_floats(nq);
    if (a->f64) {
        double *q = malloc(es * (size_t)nq), *k = malloc(es * (size_t)nk),
               *v = malloc(es * (size_t)nv), *d = malloc(es * (size_t)nq);
        for (int64_t i = 0; i < nq; i++) q[i] = tq[i], d[i] = td[i];
        for (int64_t i = 0; i < nk; i++) k[i] = tk[i];
        for (int64_t i = 0; i < nv; i++) v[i] = tv[i];
        free(tq), free(tk), free(tv), free(td);
        a->q = q, a->k = k, a->v = v, a->dout = d;
    } else {
        a->q = tq, a->k = tk, a->v = tv, a->dout = td;
    }
    a->dq = calloc((size_t)nq, es), a->dk = calloc((size_t)nk, es),
    a->dv = calloc((size_t)nv, es);
    a->dq0 = malloc(es * (size_t)nq), a->dk0 = malloc(es * (size_t)nk);
    a->dv0 = malloc(es * (size_t)nv);
    for (int64_t i = 0; i < (int64_t)(es * (size_t)nq); i++)
        ((unsigned char *)a->dq0)[i] = 0x3c;
    for (int64_t i = 0; i < (int64_t)(es * (size_t)nk); i++)
        ((unsigned char *)a->dk0)[i] = 0x3d;
    for (int64_t i = 0; i < (int64_t)(es * (size_t)nv); i++)
        ((unsigned char *)a->dv0)[i] = 0x3e;
    a->y = calloc((size_t)nq, es);
    a->w = calloc((size_t)(a->N * H * a->L * Sp), es);
    a->kpm = calloc((size_t)(a->N * a->S), 1);
    for (int64_t n = 0; n < a->N; n++) a->kpm[n * a->S + a->S - 1 - n] = 1;
    a->am = new_floats(a->L * a->S);
    if (a->grads == NULL && a->m) {
        mha_config gc = *c;
        if (mha_module_create(&a->grads, &gc)) abort();
        for (int i = 0; i < mha_module_num_params(a->grads); i++) {
            mha_param p;
            if (mha_module_param_at(&p, a->grads, i)) abort();
            if (p.dtype == MHA_F32) fill(p.data, p.numel);
        }
        a->gsnap = malloc(module_bytes(a->grads, NULL));
        module_bytes(a->grads, a->gsnap);
    }
}

static void fwd_free(fwd_arg *a) {
    free(a->q), free(a->k), free(a->v), free(a->dout), free(a->dq), free(a->dk), free(a->dv);
    free(a->y), free(a->w), free(a->kpm), free(a->am);
    free(a->dq0), free(a->dk0), free(a->dv0), free(a->gsnap);
    mha_module_destroy(a->m);
    mha_module_destroy(a->grads);
}

typedef struct fwd_views {
    mha_tensor q, k, v, y, w, dout, dq, dk, dv, kpm, am;
    mha_forward_args args;
} fwd_views;

static void fwd_views_of(fwd_views *t, const fwd_arg *a) {
    const mha_config *c = mha_module_config(a->m);
    const int64_t E = c->embed_dim, kd = c->kdim, vd = c->vdim, H = c->num_heads;
    const int64_t Sp = a->S + c->add_bias_kv + c->add_zero_attn;
    const mha_dtype dt = a->f64 ? MHA_F64 : MHA_F32;
    t->q = mha_tensor_contiguous(a->q, dt, 3, (int64_t[]){a->L, a->N, E});
    t->k = mha_tensor_contiguous(a->k, dt, 3, (int64_t[]){a->S, a->N, kd});
    t->v = mha_tensor_contiguous(a->v, dt, 3, (int64_t[]){a->S, a->N, vd});
    t->y = mha_tensor_contiguous(a->y, dt, 3, (int64_t[]){a->L, a->N, E});
    t->dout = mha_tensor_contiguous(a->dout, dt, 3, (int64_t[]){a->L, a->N, E});
    t->dq = mha_tensor_contiguous(a->dq, dt, 3, (int64_t[]){a->L, a->N, E});
    t->dk = mha_tensor_contiguous(a->dk, dt, 3, (int64_t[]){a->S, a->N, kd});
    t->dv = mha_tensor_contiguous(a->dv, dt, 3, (int64_t[]){a->S, a->N, vd});
    t->w = a->average ? mha_tensor_contiguous(a->w, dt, 3, (int64_t[]){a->N, a->L, Sp})
                      : mha_tensor_contiguous(a->w, dt, 4, (int64_t[]){a->N, H, a->L, Sp});
    t->kpm = mha_tensor_contiguous(a->kpm, MHA_BOOL, 2, (int64_t[]){a->N, a->S});
    t->am = mha_tensor_contiguous(a->am, MHA_F32, 2, (int64_t[]){a->L, a->S});
    mha_forward_args *f = &t->args;
    mha_forward_args_init(f);
    f->query = &t->q, f->key = &t->k, f->value = &t->v;
    f->impl = a->impl;
    f->need_weights = a->weights;
    f->average_attn_weights = a->average;
    f->opts.is_causal = a->causal;
    if (a->masks) f->key_padding_mask = &t->kpm, f->attn_mask = &t->am;
    if (a->extras) {
        mha_rope_init(&f->rope, MHA_ROPE_NEOX);
        f->opts.alibi = true;
        f->opts.window_left = 5;
        f->opts.softcap = 20.0f;
    }
    if (a->training) {
        f->training = true;
        f->opts.dropout_seed = 42;
    }
}

static mha_status sc_forward(const void *argp) {
    const fwd_arg *a = argp;
    fwd_views t;
    fwd_views_of(&t, a);
    mha_status st = mha_forward(&t.y, a->weights ? &t.w : NULL, a->m, &t.args);
    if (st) return st;
    res_put(a->y, mha_tensor_numel(&t.y) * mha_dtype_size(t.y.dtype));
    if (a->weights) res_put(a->w, mha_tensor_numel(&t.w) * mha_dtype_size(t.w.dtype));
    return MHA_OK;
}

// The gradients' starting values (what accumulate adds to).
static size_t grad_bytes(const fwd_views *t, int which) {
    const mha_tensor *g = which == 0 ? &t->dq : which == 1 ? &t->dk : &t->dv;
    return (size_t)mha_tensor_numel(g) * mha_dtype_size(g->dtype);
}
static void grads_reset(const fwd_arg *a, const fwd_views *t) {
    memcpy(a->dq, a->dq0, grad_bytes(t, 0));
    memcpy(a->dk, a->dk0, grad_bytes(t, 1));
    memcpy(a->dv, a->dv0, grad_bytes(t, 2));
    module_restore(a->grads, a->gsnap);
}

static mha_status sc_backward(const void *argp) {
    const fwd_arg *a = argp;
    fwd_views t;
    fwd_views_of(&t, a);
    grads_reset(a, &t);
    mha_saved *sv = NULL;
    mha_status st = MHA_OK;
    if (a->saved) {
        if ((st = mha_saved_create(&sv))) return st;
        t.args.save = sv;
        st = mha_forward(&t.y, NULL, a->m, &t.args);
    }
    if (!st)
        st = mha_backward(&t.dq, &t.dk, &t.dv, a->grads, a->m, &t.args, &t.dout, a->accumulate);
    mha_saved_destroy(sv);
    if (st) return st;
    res_put(a->dq, mha_tensor_numel(&t.dq) * mha_dtype_size(t.dq.dtype));
    res_put(a->dk, mha_tensor_numel(&t.dk) * mha_dtype_size(t.dk.dtype));
    res_put(a->dv, mha_tensor_numel(&t.dv) * mha_dtype_size(t.dv.dtype));
    res_put_module(a->grads);
    return MHA_OK;
}

// After a failed accumulating backward: every gradient as it was.
static bool backward_intact(const void *argp) {
    const fwd_arg *a = argp;
    fwd_views t;
    fwd_views_of(&t, a);
    return memcmp(a->dq, a->dq0, grad_bytes(&t, 0)) == 0 &&
           memcmp(a->dk, a->dk0, grad_bytes(&t, 1)) == 0 &&
           memcmp(a->dv, a->dv0, grad_bytes(&t, 2)) == 0 &&
           module_same(a->grads, a->gsnap, module_bytes(a->grads, NULL));
}

// mha_forward with the caller's workspace allocates nothing.
static void forward_ex_no_alloc(const fwd_arg *a, const char *name) {
    fwd_views t;
    fwd_views_of(&t, a);
    size_t bytes = 0;
    CHECK_OK(mha_forward_workspace_size(&bytes, a->m, &t.args));
    void *ws = malloc(bytes + 1);
    mha__fault_arm(0, 0);
    t.args.workspace = ws, t.args.workspace_bytes = bytes + 1;
    CHECK_OK(mha_forward(&t.y, a->weights ? &t.w : NULL, a->m, &t.args));
    const long n = mha__fault_count();
    CHECKF(n == 0, "%s: mha_forward with a workspace made %ld allocations", name, n);
    free(ws);
}

// ---------------------------------------------------------------------------
// sdpa, varlen, RoPE

typedef struct sdpa_arg {
    mha_impl impl;
    int64_t B, H, Hkv, L, S, D;
    bool weights, causal;
    float *q, *k, *v, *o, *w;
} sdpa_arg;

static mha_status sc_sdpa(const void *argp) {
    const sdpa_arg *a = argp;
    mha_tensor q = mha_tensor_contiguous(a->q, MHA_F32, 4, (int64_t[]){a->B, a->H, a->L, a->D});
    mha_tensor k = mha_tensor_contiguous(a->k, MHA_F32, 4,
                                         (int64_t[]){a->B, a->Hkv, a->S, a->D});
    mha_tensor v = mha_tensor_contiguous(a->v, MHA_F32, 4,
                                         (int64_t[]){a->B, a->Hkv, a->S, a->D});
    mha_tensor o = mha_tensor_contiguous(a->o, MHA_F32, 4, (int64_t[]){a->B, a->H, a->L, a->D});
    mha_tensor w = mha_tensor_contiguous(a->w, MHA_F32, 4, (int64_t[]){a->B, a->H, a->L, a->S});
    mha_sdpa_args sa;
    mha_sdpa_args_init(&sa);
    sa.q = &q, sa.k = &k, sa.v = &v;
    sa.opts.is_causal = a->causal;
    sa.impl = a->impl;
    mha_status st = mha_sdpa(&o, a->weights ? &w : NULL, &sa);
    if (st) return st;
    res_put(a->o, sizeof(float) * (size_t)mha_tensor_numel(&o));
    if (a->weights) res_put(a->w, sizeof(float) * (size_t)mha_tensor_numel(&w));
    // the backward, dout = the output itself
    const size_t nq = (size_t)mha_tensor_numel(&q), nk = (size_t)mha_tensor_numel(&k);
    float *dq = malloc(sizeof(float) * nq), *dk = malloc(sizeof(float) * nk),
          *dv = malloc(sizeof(float) * nk), *dout = malloc(sizeof(float) * nq);
    memcpy(dout, a->o, sizeof(float) * nq);
    mha_tensor tdq = q, tdk = k, tdv = v, tdo = o;
    tdq.data = dq, tdk.data = dk, tdv.data = dv, tdo.data = dout;
    st = mha_sdpa_backward(&tdq, &tdk, &tdv, NULL, &tdo, &sa);
    if (!st) {
        res_put(dq, sizeof(float) * nq);
        res_put(dk, sizeof(float) * nk);
        res_put(dv, sizeof(float) * nk);
    }
    free(dq), free(dk), free(dv), free(dout);
    if (st) return st;
    // varlen over the same rows (batch element 0 as two sequences)
    const int64_t cq[3] = {0, a->L / 2, a->L}, ck[3] = {0, a->S / 2, a->S};
    mha_tensor q2 = {a->q, MHA_F32, 3, {a->L, a->H, a->D}, {a->D, a->L * a->D, 1}};
    mha_tensor k2 = {a->k, MHA_F32, 3, {a->S, a->Hkv, a->D}, {a->D, a->S * a->D, 1}};
    mha_tensor v2 = {a->v, MHA_F32, 3, {a->S, a->Hkv, a->D}, {a->D, a->S * a->D, 1}};
    mha_tensor o2 = {a->o, MHA_F32, 3, {a->L, a->H, a->D}, {a->D, a->L * a->D, 1}};
    mha_varlen_args va;
    mha_varlen_args_init(&va);
    va.cu_seqlens_q = cq, va.cu_seqlens_k = ck, va.num_seqs = 2;
    va.opts.is_causal = a->causal;
    if ((st = mha_sdpa_varlen(&o2, &q2, &k2, &v2, &va))) return st;
    res_put(a->o, sizeof(float) * (size_t)(a->L * a->H * a->D));
    // RoPE in place on a copy of q
    float *qc = malloc(sizeof(float) * (size_t)mha_tensor_numel(&q));
    memcpy(qc, a->q, sizeof(float) * (size_t)mha_tensor_numel(&q));
    mha_tensor qt = mha_tensor_contiguous(qc, MHA_F32, 4, (int64_t[]){a->B, a->H, a->L, a->D});
    mha_rope r;
    mha_rope_init(&r, MHA_ROPE_INTERLEAVED);
    st = mha_rope_apply(&qt, &r, NULL, NULL, NULL, 0, false);
    if (!st) res_put(qc, sizeof(float) * (size_t)mha_tensor_numel(&q));
    free(qc);
    return st;
}

// ---------------------------------------------------------------------------
// KV cache

// A fresh cache: create, append (two chunks, per-sequence counts), attend
// (decode and a prefill chunk), destroy.
typedef struct kv_arg {
    mha_kv_dtype dt;
    int64_t B, Hkv, H, D, cap;
    float *k, *v, *q, *o;  // (B, Hkv, 24, D), q/o (B, H, 24, D)
} kv_arg;

static mha_status sc_kv(const void *argp) {
    const kv_arg *a = argp;
    const int64_t T = 24;
    mha_kv_cache *c;
    mha_status st = mha_kv_cache_create(&c, a->B, a->Hkv, a->D, a->D, a->cap, a->dt);
    if (st) return st;
    mha_tensor k = mha_tensor_contiguous(a->k, MHA_F32, 4, (int64_t[]){a->B, a->Hkv, T, a->D});
    mha_tensor v = mha_tensor_contiguous(a->v, MHA_F32, 4, (int64_t[]){a->B, a->Hkv, T, a->D});
    int64_t counts[4] = {T, T - 3, T, T};
    if (!st) st = mha_kv_cache_append(c, &k, &v, counts);
    mha_tensor q = mha_tensor_contiguous(a->q, MHA_F32, 4, (int64_t[]){a->B, a->H, T, a->D});
    mha_tensor o = mha_tensor_contiguous(a->o, MHA_F32, 4, (int64_t[]){a->B, a->H, T, a->D});
    if (!st) st = mha_kv_cache_attend(&o, &q, c, NULL, counts);  // prefill: T > 16
    if (!st) res_put(a->o, sizeof(float) * (size_t)mha_tensor_numel(&o));
    mha_tensor k1 = k, v1 = v, q1 = q, o1 = o;
    k1.shape[2] = v1.shape[2] = q1.shape[2] = o1.shape[2] = 1;
    if (!st) st = mha_kv_cache_append(c, &k1, &v1, NULL);
    if (!st) st = mha_kv_cache_attend(&o1, &q1, c, NULL, NULL);  // decode
    if (!st) res_put(a->o, sizeof(float) * (size_t)mha_tensor_numel(&o));
    // a bf16 query (the float32 attend on its converted copy): q's first
    // row's bits reread as bf16 pairs, out as bf16 in o's storage
    mha_tensor qh = q1, oh = o1;
    qh.dtype = oh.dtype = MHA_BF16;
    if (!st) st = mha_kv_cache_attend(&oh, &qh, c, NULL, NULL);
    if (!st) res_put(a->o, 2 * (size_t)mha_tensor_numel(&oh));
    mha_kv_cache_destroy(c);
    return st;
}

// A paged cache: create, add two sequences, append with token ids (two
// chunks), a prompt sharing the first's blocks, a fork written into (copy
// on write), attends (decode and prefill), a release and a truncation,
// free, destroy.
static mha_status sc_paged(const void *argp) {
    const kv_arg *a = argp;
    const int64_t T = 24;
    mha_paged_cache *c;
    mha_status st = mha_paged_cache_create(&c, 40, 4, a->Hkv, a->D, a->D, a->dt,
                                           MHA_PAGED_HEAD_MAJOR);
    if (st) return st;
    int64_t ids[2], p = -1, f = -1, cached = 0;
    int32_t tok[2 * 24];
    for (int i = 0; i < 2 * 24; i++) tok[i] = i % 24;
    mha_tensor k = mha_tensor_contiguous(a->k, MHA_F32, 4, (int64_t[]){2, a->Hkv, T, a->D});
    mha_tensor v = mha_tensor_contiguous(a->v, MHA_F32, 4, (int64_t[]){2, a->Hkv, T, a->D});
    int64_t counts[2] = {T, T - 3};
    if (!st) st = mha_paged_cache_add(c, &ids[0]);
    if (!st) st = mha_paged_cache_add(c, &ids[1]);
    if (!st) st = mha_paged_cache_append(c, 2, ids, counts, &k, &v, tok);
    if (!st) st = mha_paged_cache_add_prompt(c, tok, 20, &p, &cached);
    if (!st) st = mha_paged_cache_fork(c, ids[1], &f);
    mha_tensor k1 = k, v1 = v;
    k1.shape[0] = v1.shape[0] = 1, k1.shape[2] = v1.shape[2] = 1;
    if (!st) st = mha_paged_cache_append(c, 1, &f, NULL, &k1, &v1, NULL);  // copy on write
    mha_tensor q = mha_tensor_contiguous(a->q, MHA_F32, 4, (int64_t[]){2, a->H, T, a->D});
    mha_tensor o = mha_tensor_contiguous(a->o, MHA_F32, 4, (int64_t[]){2, a->H, T, a->D});
    if (!st) st = mha_paged_cache_attend(&o, &q, c, 2, ids, counts, NULL);  // prefill
    if (!st) res_put(a->o, sizeof(float) * (size_t)mha_tensor_numel(&o));
    mha_tensor q1 = q, o1 = o;
    q1.shape[2] = o1.shape[2] = 1;
    const int64_t two[2] = {ids[0], f};
    if (!st) st = mha_paged_cache_attend(&o1, &q1, c, 2, two, NULL, NULL);  // decode
    if (!st) res_put(a->o, sizeof(float) * (size_t)mha_tensor_numel(&o1));
    if (!st) st = mha_paged_cache_release(c, ids[0], 0, 9);
    if (!st) st = mha_paged_cache_truncate(c, ids[1], 10);
    if (!st) st = mha_paged_cache_free(c, p);
    int64_t used = mha_paged_cache_blocks_in_use(c);
    res_put(&used, sizeof used);
    mha_paged_cache_destroy(c);
    return st;
}

// mha_linear: create (a BF16 weight, contiguous: widened a panel at a
// time; or transposed: widened whole first) and forwards with x and y in
// place and through a gathered x and a staged y, destroy.
typedef struct dense_arg {
    bool transposed;
    float *x, *y, *b;  // x (3, 7, 37) (and a seq-first copy), y (3, 7, 29), b (29)
    uint16_t *w;       // (29, 37) or its transpose
} dense_arg;

static mha_status sc_dense(const void *argp) {
    const dense_arg *a = argp;
    enum { B = 3, L = 7, I = 37, O = 29 };
    mha_tensor w = mha_tensor_contiguous(a->w, MHA_BF16, 2, (int64_t[]){O, I});
    if (a->transposed) w.stride[0] = 1, w.stride[1] = O;
    mha_tensor b = mha_tensor_contiguous(a->b, MHA_F32, 1, (int64_t[]){O});
    mha_linear *l;
    mha_status st = mha_linear_create(&l, &w, &b);
    if (st) return st;
    mha_tensor x = mha_tensor_contiguous(a->x, MHA_F32, 3, (int64_t[]){B, L, I});
    mha_tensor y = mha_tensor_contiguous(a->y, MHA_F32, 3, (int64_t[]){B, L, O});
    st = mha_linear_forward(l, &y, &x);
    if (!st) res_put(a->y, sizeof(float) * B * L * O);
    mha_tensor xs = x, ys = y;  // (B, L) over (L, B) storage: gathered, staged
    xs.data = a->x + B * L * I;
    xs.stride[0] = I, xs.stride[1] = B * I;
    ys.stride[0] = O, ys.stride[1] = B * O;
    if (!st) st = mha_linear_forward(l, &ys, &xs);
    if (!st) res_put(a->y, sizeof(float) * B * L * O);
    mha_linear_destroy(l);
    return st;
}

// A cache that persists between runs: mha_forward_cached (or an append)
// on it; on failure its lengths must stay.
typedef struct cached_arg {
    mha_module *m;
    mha_kv_cache *c;
    int64_t N, T, prefix;  // the cache holds prefix tokens of each sequence
    float *x, *y;          // (T, N, E)
    bool extras;           // RoPE + ALiBi + window + 2 StreamingLLM sinks
    bool append_only;      // mha_kv_cache_append of (N, 1, T, D) x, y
    int64_t D;             // (append_only) head dim
} cached_arg;

// Self-attention of x (T, N, E) into y (T, N, E): the views and the args.
static void self_attention(mha_forward_args *f, mha_tensor *x, mha_tensor *y,
                           const mha_module *m, float *xp, float *yp, int64_t T, int64_t N) {
    const int64_t E = mha_module_config(m)->embed_dim;
    *x = mha_tensor_contiguous(xp, MHA_F32, 3, (int64_t[]){T, N, E});
    *y = mha_tensor_contiguous(yp, MHA_F32, 3, (int64_t[]){T, N, E});
    mha_forward_args_init(f);
    f->query = f->key = f->value = x;
}

static mha_status sc_cached(const void *argp) {
    const cached_arg *a = argp;
    mha_status st;
    if (a->append_only) {
        const int64_t B = a->N, Hkv = 1, D = a->D, Dv = a->D;
        mha_tensor k = mha_tensor_contiguous(a->x, MHA_F32, 4, (int64_t[]){B, Hkv, a->T, D});
        mha_tensor v = mha_tensor_contiguous(a->y, MHA_F32, 4, (int64_t[]){B, Hkv, a->T, Dv});
        if ((st = mha_kv_cache_append(a->c, &k, &v, NULL))) return st;
        mha_tensor q = mha_tensor_contiguous(a->x, MHA_F32, 4, (int64_t[]){B, Hkv, 1, D});
        float *o = calloc((size_t)(B * Hkv * Dv), sizeof *o);
        mha_tensor ot = mha_tensor_contiguous(o, MHA_F32, 4, (int64_t[]){B, Hkv, 1, Dv});
        st = mha_kv_cache_attend(&ot, &q, a->c, NULL, NULL);
        if (!st) res_put(o, sizeof *o * (size_t)(B * Hkv * Dv));
        free(o);
    } else {
        const int64_t E = mha_module_config(a->m)->embed_dim;
        mha_tensor x, y;
        mha_forward_args f;
        self_attention(&f, &x, &y, a->m, a->x, a->y, a->T, a->N);
        f.opts.is_causal = true;
        if (a->extras) {  // (and StreamingLLM's sinks: their queries and scratch)
            mha_rope_init(&f.rope, MHA_ROPE_NEOX);
            f.opts.alibi = true;
            f.opts.window_left = 7;
            f.opts.sink_tokens = 2;
        }
        if ((st = mha_forward_cached(&y, a->m, &f, a->c))) return st;
        res_put(a->y, sizeof(float) * (size_t)(a->T * a->N * E));
    }
    for (int64_t n = 0; n < a->N; n++) {
        int64_t len = mha_kv_cache_length(a->c, n);
        res_put(&len, sizeof len);
    }
    if (mha_kv_cache_truncate(a->c, -1, a->prefix)) abort();  // back to the prefix
    return st;
}

static bool cached_intact(const void *argp) {
    const cached_arg *a = argp;
    bool same = true;
    for (int64_t n = 0; n < a->N; n++)
        same = same && mha_kv_cache_length(a->c, n) == a->prefix;
    if (!same) {
        fprintf(stderr, "  cache lengths after the failure:");
        for (int64_t n = 0; n < a->N; n++)
            fprintf(stderr, " %lld", (long long)mha_kv_cache_length(a->c, n));
        fprintf(stderr, " (expected %lld)\n", (long long)a->prefix);
        if (mha_kv_cache_truncate(a->c, -1, a->prefix)) abort();
    }
    return same;
}

// ---------------------------------------------------------------------------
// Diagnostics and the optimizer

static mha_status sc_diagnose(const void *argp) {
    const fwd_arg *a = argp;
    fwd_views t;
    fwd_views_of(&t, a);
    mha_diag *d;
    mha_diag_options o;
    mha_diag_options_init(&o);
    o.max_rows = 5;
    mha_status st = mha_diag_create(&d, a->m, &t.args, &o);
    if (st) return st;
    const int64_t H = mha_diag_num_heads(d);
    for (int64_t h = 0; h < H; h++) {
        res_put(mha_diag_head(d, h), sizeof(mha_head_diag));
        for (int64_t g = 0; g < H; g++) {
            double s = mha_diag_similarity(d, h, g);
            res_put(&s, sizeof s);
        }
        int64_t n;
        const double *sp = mha_diag_spectrum(d, h, 'o', &n);
        res_put(sp, sizeof(double) * (size_t)n);
    }
    const char *nf = mha_diag_nonfinite(d);
    if (nf) res_put(nf, strlen(nf));
    mha_diag_destroy(d);
    return MHA_OK;
}

typedef struct optim_arg {
    mha_optim_kind kind;
    mha_module *m, *g;
    unsigned char *snap, *gsnap;  // the module's parameters and gradients before
    float *extra, *extra_g, *extra0, *extra_g0;  // 9 more tensors of 16, and before
} optim_arg;

static mha_status sc_optim(const void *argp) {
    const optim_arg *a = argp;
    mha_optim_config c;
    mha_optim_config_init(&c, a->kind);
    if (a->kind == MHA_OPTIM_SGD) c.momentum = 0.9;
    mha_optim *o;
    mha_status st = mha_optim_create(&o, &c);
    if (st) return st;
    // more tensors than the first growth of the list (8)
    for (int i = 0; i < 9 && !st; i++)
        st = mha_optim_add(o, a->extra + 16 * i, a->extra_g + 16 * i, 16);
    if (!st) st = mha_optim_add_module(o, a->m, a->g);
    double norm = 0;
    if (!st) st = mha_optim_clip_grad_norm(o, 1.0, &norm);
    if (!st) st = mha_optim_step(o);
    if (!st) st = mha_optim_step(o);
    mha_optim_destroy(o);
    if (!st) {
        res_put_module(a->m);
        res_put(a->extra, sizeof(float) * 16 * 9);
        res_put(&norm, sizeof norm);
    }
    // the same start every run (clipping scales the gradients)
    module_restore(a->m, a->snap);
    module_restore(a->g, a->gsnap);
    memcpy(a->extra, a->extra0, sizeof(float) * 16 * 9);
    memcpy(a->extra_g, a->extra_g0, sizeof(float) * 16 * 9);
    return st;
}

// The distributed layer's head parts (plan.h), in one process: the first
// half of the KV heads' context, the out projection from it, their
// backward and the input gradients from its projection gradients.
static mha_status sc_parts(const void *argp) {
    const fwd_arg *a = argp;
    fwd_views t;
    fwd_views_of(&t, a);
    const mha_config *c = mha_module_config(a->m);
    const int64_t E = c->embed_dim, H = c->num_heads, Ekv = c->num_kv_heads * (E / H);
    const int64_t Rq = a->L * a->N, Rk = a->S * a->N;
    static float ctx[4096], dq[4096], dk[4096], dv[4096], dz[1024];
    if (Rq * E > 4096 || Rk * Ekv > 4096 || Rq * H > 1024) return MHA_ERR_INVALID_ARG;
    memset(ctx, 0, sizeof ctx);
    mha__part pt = {.g0 = 0, .g1 = (c->num_kv_heads + 1) / 2, .out.ctx = ctx, .bias = true};
    mha_status st = mha__part_forward(NULL, a->m, &t.args, &pt);
    if (!st) st = mha__part_out_project(&t.y, a->m, &t.args, ctx);
    if (st) return st;
    res_put(a->y, mha_tensor_numel(&t.y) * mha_dtype_size(t.y.dtype));
    pt.out.ctx = NULL, pt.out.dq = dq, pt.out.dk = dk, pt.out.dv = dv, pt.out.dz = dz;
    grads_reset(a, &t);
    if ((st = mha__part_backward(&t.dq, &t.dk, &t.dv, a->grads, a->m, &t.args, &t.dout, &pt)))
        return st;
    if ((st = mha__part_input_grads(&t.dq, &t.dk, &t.dv, a->m, &t.args, dq, dk, dv, dz, false)))
        return st;
    res_put(a->dq, grad_bytes(&t, 0));
    if (c->add_bias_kv || c->add_zero_attn) return MHA_OK;  // (no block backward with those)
    // ring attention's block backward: the projections, the context with
    // its row stats from them, then the block's dq, dk, dv
    static float qp[4096], kp[4096], vp[4096], rs[2048], ds[1024], bq[4096], bk[4096], bv[4096];
    const int64_t Hkv = c->num_kv_heads, nst = a->N * H * a->L;
    if (2 * nst > 2048) return MHA_ERR_INVALID_ARG;
    mha__part pj = {.g0 = 0, .g1 = Hkv, .proj.q_out = qp, .proj.k_out = kp, .proj.v_out = vp};
    if ((st = mha__part_forward(NULL, a->m, &t.args, &pj))) return st;
    mha__part pb = {.g0 = 0,
                    .g1 = Hkv,
                    .out.ctx = ctx,
                    .proj.q_in = qp,
                    .proj.k_in = kp,
                    .proj.v_in = vp,
                    .block.stats = rs};
    if ((st = mha__part_forward(NULL, a->m, &t.args, &pb))) return st;
    for (int64_t i = 0; i < nst; i++) ds[i] = 0.125f;
    pb.out.ctx = NULL, pb.block.o_in = ctx, pb.block.do_in = ctx, pb.block.dsum_in = ds;
    pb.out.dq = bq, pb.out.dk = bk, pb.out.dv = bv;
    if ((st = mha__part_attn_backward(a->m, &t.args, &pb))) return st;
    res_put(bq, sizeof(float) * (size_t)(Rq * E));
    res_put(bk, sizeof(float) * (size_t)(Rk * Ekv));
    return MHA_OK;
}

// ---------------------------------------------------------------------------

static void load_case(const char *name, const mod_spec *s, bool use_base, mha_dtype base_wdt) {
    mha_module *m = make_module(s);
    load_arg *a = calloc(1, sizeof *a);
    char fn[128];
    snprintf(fn, sizeof fn, "%s.safetensors", name);
    for (char *c = fn; *c; c++)
        if (*c == '/' || *c == ' ' || *c == '+') *c = '_';
    tmp_path(a->path, sizeof a->path, fn);
    if (mha_module_save(m, a->path)) {
        CHECKF(0, "%s: save: %s", name, mha_last_error());
        return;
    }
    mha_config_init(&a->base, 0, 0);
    a->base.weight_dtype = base_wdt;
    a->use_base = use_base;
    sweep(name, sc_module_load, a, NULL);
    mha_module_destroy(m);
    free(a);
}

// Hugging Face checkpoints (src/checkpoint.c), written here by
// checkpoint_util.h: config.json, the single file or the sharded index
// and its shards (opened when first needed), each layer's tensors (q/k/v
// packed into in_proj_weight, GPT-2's Conv1D transposed), converted to the
// base's weight dtype; through mha_checkpoint_open + find + load_layer
// (open) or mha_module_load_checkpoint. The result: the model type, the
// layer count, each layer's options and module.
typedef struct ckpt_arg {
    char dir[600];
    bool open;
    mha_config base;
} ckpt_arg;

static void res_put_layer(const mha_checkpoint_layer *info, const mha_module *m) {
    res_put(info->model_type, strlen(info->model_type) + 1);
    res_put(&info->layer, sizeof info->layer);
    res_put(&info->opts.is_causal, sizeof info->opts.is_causal);
    res_put(&info->opts.window_left, sizeof info->opts.window_left);
    res_put(&info->rope.mode, sizeof info->rope.mode);
    res_put(&info->rope.theta, sizeof info->rope.theta);
    res_put(&info->opts.scale, sizeof info->opts.scale);
    res_put_module(m);
}

static mha_status sc_checkpoint(const void *argp) {
    const ckpt_arg *a = argp;
    mha_status st = MHA_OK;
    mha_checkpoint *c = NULL;
    if (a->open) {
        if ((st = mha_checkpoint_open(&c, a->dir))) return st;
        const char *mt = mha_checkpoint_model_type(c);
        const int64_t nl = mha_checkpoint_num_layers(c);
        res_put(mt, strlen(mt) + 1);
        res_put(&nl, sizeof nl);
        mha_st_tensor t;  // layer 1's first tensor (the second shard when sharded)
        const char *name = strcmp(mt, "gpt2") == 0 ? "transformer.h.1.attn.c_attn.weight"
                                                   : "model.layers.1.self_attn.q_proj.weight";
        if ((st = mha_checkpoint_find(&t, c, name))) {
            mha_checkpoint_close(c);
            return st;
        }
        res_put(t.shape, sizeof t.shape);
    }
    for (int64_t layer = 0; layer < 2 && !st; layer++) {
        mha_module *m;
        mha_checkpoint_layer info;
        st = a->open ? mha_checkpoint_load_layer(&m, &info, c, layer, &a->base)
                     : mha_module_load_checkpoint(&m, &info, a->dir, layer, &a->base);
        if (st) break;
        res_put_layer(&info, m);
        mha_module_destroy(m);
    }
    mha_checkpoint_close(c);
    return st;
}

static void checkpoint_cases(void) {
    static ckpt_arg a[3];
    const char *dirs[3] = {"ck_llama", "ck_sharded", "ck_gpt2"};
    for (int k = 0; k < 3; k++) {
        tmp_path(a[k].dir, sizeof a[k].dir, dirs[k]);
        CHECKF(mkdir(a[k].dir, 0755) == 0 || errno == EEXIST, "cannot make %s", a[k].dir);
        mha_config_init(&a[k].base, 0, 0);
    }
    make_llama(a[0].dir, NULL, "model.");
    tensor_spec t[8];
    char index[4096];
    make_llama_sharded(index, sizeof index, t, a[1].dir);
    make_gpt2(a[2].dir);
    for (int open = 1; open >= 0; open--) {
        char name[96];
        for (int k = 0; k < 3; k++) {
            a[k].open = open;
            a[k].base.weight_dtype = k == 0 && !open ? MHA_BF16 : MHA_F32;
            snprintf(name, sizeof name, "checkpoint %s%s: %s",
                     k == 1 ? "llama sharded"
                     : k    ? "gpt2 Conv1D"
                            : "llama",
                     a[k].base.weight_dtype == MHA_BF16 ? " into BF16" : "",
                     open ? "open+find+load_layer" : "load_checkpoint");
            sweep(name, sc_checkpoint, &a[k], NULL);
        }
    }
}

static void fwd_case(fwd_arg a, const mod_spec *s, bool backward, bool diag) {
    a.m = make_module(s);
    fwd_setup(&a);
    char name[96];
    snprintf(name, sizeof name, "forward %s", a.name);
    sweep(name, sc_forward, &a, NULL);
    if (!a.saved) forward_ex_no_alloc(&a, name);
    if (backward) {
        snprintf(name, sizeof name, "backward %s", a.name);
        sweep(name, sc_backward, &a, NULL);
        a.accumulate = true;
        snprintf(name, sizeof name, "backward += %s", a.name);
        sweep(name, sc_backward, &a, backward_intact);
        a.accumulate = false;
    }
    if (diag) {
        snprintf(name, sizeof name, "diagnose %s", a.name);
        sweep(name, sc_diagnose, &a, NULL);
    }
    fwd_free(&a);
}

#ifdef MHA_TEST_MPI
// ---------------------------------------------------------------------------
// The MPI layer (mha_mpi.h), on every rank: each scheme's forward and
// backward on this rank's tokens (heads, heads-fast: every token, the same
// on every rank; ulysses: a block; ring: its zigzag chunks), and the
// sharded-KV decode.

typedef struct mpi_arg {
    mha_parallel scheme;
    bool backward;
    mha_module *m, *grads;
    mha_saved *save;         // ring: a saved forward (grown beforehand, kept)
    int64_t N, T;            // batch, this rank's tokens
    float *x, *y, *dy, *dx;  // (T, N, E)
} mpi_arg;

static mha_status sc_mpi(const void *argp) {
    const mpi_arg *a = argp;
    const int64_t E = mha_module_config(a->m)->embed_dim, n = a->T * a->N * E;
    const int64_t sh[3] = {a->T, a->N, E};
    mha_tensor x, y;
    mha_forward_args f;
    self_attention(&f, &x, &y, a->m, a->x, a->y, a->T, a->N);
    mha_tensor dy = mha_tensor_contiguous(a->dy, MHA_F32, 3, sh);
    mha_tensor dx = mha_tensor_contiguous(a->dx, MHA_F32, 3, sh);
    f.opts.is_causal = true;
    f.save = a->save;
    mha_status st = MHA_OK;
    if (!a->backward || a->save) {
        st = mha_mpi_forward(MPI_COMM_WORLD, a->scheme, &y, a->m, &f, NULL);
        if (!st) res_put(a->y, sizeof(float) * (size_t)n);
    }
    if (!st && a->backward) {
        st = mha_mpi_backward(MPI_COMM_WORLD, a->scheme, &dx, NULL, NULL, a->grads, a->m, &f,
                              &dy, false, NULL);
        if (!st) res_put(a->dx, sizeof(float) * (size_t)n), res_put_module(a->grads);
    }
    return st;
}

// Sharded-KV decode: every rank's cache holds prefix tokens of its own; T
// new tokens (the same on every rank), appended by rank 0; afterwards the
// caches go back to the prefix. On failure every rank's lengths stay.
typedef struct mpi_cached_arg {
    mha_module *m;
    mha_kv_cache *c;
    int64_t N, T, prefix;
    float *x, *y;  // (T, N, E)
} mpi_cached_arg;

static mha_status sc_mpi_cached(const void *argp) {
    const mpi_cached_arg *a = argp;
    const int64_t E = mha_module_config(a->m)->embed_dim;
    mha_tensor x, y;
    mha_forward_args f;
    self_attention(&f, &x, &y, a->m, a->x, a->y, a->T, a->N);
    mha_status st = mha_mpi_forward_cached(MPI_COMM_WORLD, &y, a->m, &f, a->c, 0, NULL);
    if (st) return st;
    res_put(a->y, sizeof(float) * (size_t)(a->T * a->N * E));
    for (int64_t b = 0; b < a->N; b++) {
        const int64_t len = mha_kv_cache_length(a->c, b);
        res_put(&len, sizeof len);
    }
    if (mha_kv_cache_truncate(a->c, -1, a->prefix)) abort();
    return MHA_OK;
}

static bool mpi_cached_intact(const void *argp) {
    const mpi_cached_arg *a = argp;
    for (int64_t b = 0; b < a->N; b++)
        if (mha_kv_cache_length(a->c, b) != a->prefix) return false;
    return true;
}

static void sweep_mpi(void) {
    const mod_spec spec = {
        .E = 24, .H = 6, .Hkv = 3, .bias = true, .gate = MHA_GATE_DYNAMIC, .npruned = 1};
    const int64_t L = 8, N = 2;
    const mha_parallel schemes[4] = {MHA_PAR_HEADS, MHA_PAR_HEADS_FAST, MHA_PAR_ULYSSES,
                                     MHA_PAR_RING};
    for (int i = 0; i < 4; i++) {
        g_rng = 77;  // the same module (and whole inputs) on every rank
        mpi_arg a = {.scheme = schemes[i], .m = make_module(&spec), .N = N, .T = L};
        if (schemes[i] == MHA_PAR_ULYSSES) a.T = L * (g_rank + 1) / g_P - L * g_rank / g_P;
        if (schemes[i] == MHA_PAR_RING) {
            int64_t cs[2], cl[2];
            mha_mpi_ring_chunks(L, g_P, g_rank, cs, cl);
            a.T = cl[0] + cl[1];
        }
        const int64_t n = a.T * N * spec.E;
        a.x = new_floats(n), a.y = new_floats(n), a.dy = new_floats(n), a.dx = new_floats(n);
        if (mha_module_create(&a.grads, mha_module_config(a.m))) abort();
        char name[96];
        snprintf(name, sizeof name, "mpi %s forward, GQA, gates", mha_parallel_name(a.scheme));
        sweep(name, sc_mpi, &a, NULL);
        a.backward = true;
        snprintf(name, sizeof name, "mpi %s backward, GQA, gates", mha_parallel_name(a.scheme));
        sweep(name, sc_mpi, &a, NULL);
        if (a.scheme == MHA_PAR_RING) {
            if (mha_saved_create(&a.save) || sc_mpi(&a)) abort();  // (the state grown)
            sweep("mpi ring forward + backward, saved state", sc_mpi, &a, NULL);
            mha_saved_destroy(a.save);
        }
        free(a.x), free(a.y), free(a.dy), free(a.dx);
        mha_module_destroy(a.m);
        mha_module_destroy(a.grads);
    }
    g_rng = 78;
    const mod_spec cspec = {
        .E = 16, .H = 4, .Hkv = 2, .bias = true, .gate = MHA_GATE_DYNAMIC, .npruned = 1};
    const int64_t d = cspec.E / cspec.H;
    mpi_cached_arg c = {.m = make_module(&cspec), .N = N, .T = 3, .prefix = 4};
    float *k = new_floats(N * cspec.Hkv * c.prefix * d),
          *v = new_floats(N * cspec.Hkv * c.prefix * d);
    const int64_t kv_shape[4] = {N, cspec.Hkv, c.prefix, d};
    mha_tensor kt = mha_tensor_contiguous(k, MHA_F32, 4, kv_shape);
    mha_tensor vt = mha_tensor_contiguous(v, MHA_F32, 4, kv_shape);
    if (mha_kv_cache_create(&c.c, N, cspec.Hkv, d, d, 16, MHA_KV_F32) ||
        mha_kv_cache_append(c.c, &kt, &vt, NULL))
        abort();
    c.x = new_floats(c.T * N * cspec.E), c.y = new_floats(c.T * N * cspec.E);
    sweep("mpi forward_cached (sharded KV decode), GQA, gates", sc_mpi_cached, &c,
          mpi_cached_intact);
    free(k), free(v), free(c.x), free(c.y);
    mha_kv_cache_destroy(c.c);
    mha_module_destroy(c.m);
}
#endif  // MHA_TEST_MPI

// Every library scenario (one process).
static void sweep_library(void) {
    // safetensors: write, read back (file and memory)
    char p1[600];
    tmp_path(p1, sizeof p1, "tensors.safetensors");
    sweep("safetensors write", sc_st_write, p1, NULL);
    io_faults();
    st_arg sa = {p1, false, NULL, 0};
    sweep("safetensors open+read", sc_st_read, &sa, NULL);
    {
        FILE *f = fopen(p1, "rb");
        static unsigned char buf[1 << 16];
        size_t n = f ? fread(buf, 1, sizeof buf, f) : 0;
        if (f) fclose(f);
        st_arg sm = {NULL, true, buf, n};
        sweep("safetensors parse (memory)", sc_st_read, &sm, NULL);
    }

    // mha_module_load
    const mod_spec packed = {.E = 16, .H = 4, .bias = true};
    const mod_spec separate = {
        .E = 16, .H = 4, .kdim = 6, .vdim = 10, .bias = true, .bias_kv = true};
    const mod_spec gqa = {.E = 24, .H = 6, .Hkv = 2, .bias = true};
    const mod_spec gated_static = {
        .E = 16, .H = 4, .bias = true, .gate = MHA_GATE_STATIC, .npruned = 2};
    const mod_spec gated_dyn = {.E = 16, .H = 4, .gate = MHA_GATE_DYNAMIC, .npruned = 1};
    const mod_spec bf16 = {.E = 16, .H = 4, .bias = true, .wdt = MHA_BF16};
    load_case("load packed", &packed, false, MHA_F32);
    load_case("load kdim/vdim + bias_kv", &separate, false, MHA_F32);
    load_case("load GQA", &gqa, false, MHA_F32);
    load_case("load head_gate + pruned_heads", &gated_static, false, MHA_F32);
    load_case("load gate_proj + pruned_heads", &gated_dyn, false, MHA_F32);
    load_case("load BF16 into BF16", &bf16, true, MHA_BF16);
    load_case("load BF16 into F32", &bf16, false, MHA_F32);

    // Hugging Face checkpoints
    checkpoint_cases();

    // create / init / convert / save
    {
        create_arg ca = {
            .spec = {
                .E = 16, .H = 4, .kdim = 6, .vdim = 10, .bias_kv = true, .gate = MHA_GATE_STATIC}};
        tmp_path(ca.path, sizeof ca.path, "created.safetensors");
        sweep("create+init+convert+save", sc_module_create, &ca, NULL);
        mod_spec s = {.E = 16, .H = 4, .kdim = 6, .vdim = 10, .bias = true, .bias_kv = true};
        for (int half = 0; half < 2; half++) {
            s.wdt = half ? MHA_F16 : MHA_F32;
            init_arg ia = {.m = make_module(&s), .scheme = MHA_INIT_ORTHOGONAL};
            ia.snap_len = module_bytes(ia.m, NULL);
            ia.snap = malloc(ia.snap_len);
            module_bytes(ia.m, ia.snap);
            sweep(half ? "init orthogonal (F16 weights)" : "init orthogonal", sc_module_init,
                  &ia, init_intact);
            free(ia.snap);
            mha_module_destroy(ia.m);
        }
    }

    // forward / backward / diagnose
    const mod_spec full = {.E = 16, .H = 4, .bias = true, .bias_kv = true, .zero_attn = true};
    const mod_spec gqa_gate = {
        .E = 24, .H = 6, .Hkv = 3, .bias = true, .gate = MHA_GATE_DYNAMIC, .npruned = 1};
    const mod_spec sep = {.E = 16,
                          .H = 2,
                          .kdim = 5,
                          .vdim = 7,
                          .bias = true,
                          .gate = MHA_GATE_STATIC,
                          .dropout = 0.2f};
    const mod_spec half16 = {.E = 16, .H = 4, .bias = true, .wdt = MHA_F16};
    const mod_spec halfbf = {
        .E = 24, .H = 4, .Hkv = 2, .bias = true, .wdt = MHA_BF16, .gate = MHA_GATE_STATIC};
    for (int impl = 0; impl < 2; impl++) {
        const mha_impl im = impl ? MHA_IMPL_FUSED : MHA_IMPL_REFERENCE;
        const bool fu = impl == 1;
        fwd_case((fwd_arg){.name = fu ? "fused, masks, averaged weights, bias_kv, zero_attn"
                                      : "ref, masks, averaged weights, bias_kv, zero_attn",
                           .impl = im,
                           .L = 7,
                           .S = 9,
                           .N = 2,
                           .weights = true,
                           .average = true,
                           .masks = true},
                 &full, true, !fu);
        fwd_case((fwd_arg){.name = fu ? "fused, causal, per-head weights, GQA, gates"
                                      : "ref, causal, per-head weights, GQA, gates",
                           .impl = im,
                           .L = 9,
                           .S = 9,
                           .N = 2,
                           .weights = true,
                           .causal = true},
                 &gqa_gate, true, !fu);
        fwd_case((fwd_arg){.name = fu ? "fused, kdim/vdim, RoPE/ALiBi/window, dropout"
                                      : "ref, kdim/vdim, RoPE/ALiBi/window, dropout",
                           .impl = im,
                           .L = 6,
                           .S = 6,
                           .N = 3,
                           .extras = true,
                           .training = true},
                 &sep, true, false);
        fwd_case((fwd_arg){.name = fu ? "fused, saved state" : "ref, saved state (unused)",
                           .impl = im,
                           .L = 8,
                           .S = 8,
                           .N = 2,
                           .causal = true,
                           .saved = true},
                 &gqa_gate, true, false);
        fwd_case((fwd_arg){.name = fu ? "fused, F16 weights, weights"
                                      : "ref, F16 weights, weights",
                           .impl = im,
                           .L = 5,
                           .S = 7,
                           .N = 2,
                           .weights = true,
                           .average = true,
                           .masks = true},
                 &half16, false, false);
        fwd_case((fwd_arg){.name = fu ? "fused, BF16 weights, GQA, gates"
                                      : "ref, BF16 weights, GQA, gates",
                           .impl = im,
                           .L = 6,
                           .S = 6,
                           .N = 2,
                           .causal = true},
                 &halfbf, false, !fu);
    }
    {  // the head parts of the MPI layer (fused path), gates and GQA
        fwd_arg pa = {.name = "head parts (MPI layer), GQA, gates",
                      .impl = MHA_IMPL_FUSED,
                      .L = 9,
                      .S = 9,
                      .N = 2,
                      .causal = true};
        pa.m = make_module(&gqa_gate);
        fwd_setup(&pa);
        sweep(pa.name, sc_parts, &pa, NULL);
        fwd_free(&pa);
    }
    fwd_case((fwd_arg){.name = "ref, float64 inputs",
                       .impl = MHA_IMPL_REFERENCE,
                       .L = 5,
                       .S = 6,
                       .N = 2,
                       .f64 = true,
                       .weights = true,
                       .masks = true},
             &full, true, false);

    // mha_sdpa (+ varlen, RoPE)
    for (int impl = 0; impl < 2; impl++) {
        sdpa_arg s = {.impl = impl ? MHA_IMPL_FUSED : MHA_IMPL_REFERENCE,
                      .B = 2,
                      .H = 4,
                      .Hkv = 2,
                      .L = 7,
                      .S = 9,
                      .D = 8,
                      .weights = true,
                      .causal = impl == 1};
        s.q = new_floats(s.B * s.H * s.L * s.D), s.k = new_floats(s.B * s.Hkv * s.S * s.D);
        s.v = new_floats(s.B * s.Hkv * s.S * s.D), s.o = new_floats(s.B * s.H * s.L * s.D);
        s.w = new_floats(s.B * s.H * s.L * s.S);
        sweep(impl ? "sdpa fused (+ backward) + varlen + rope"
                   : "sdpa ref (+ backward) + varlen + rope",
              sc_sdpa, &s, NULL);
        free(s.q), free(s.k), free(s.v), free(s.o), free(s.w);
    }

    // KV cache
    for (int dt = 0; dt <= MHA_KV_INT4; dt++) {
        kv_arg k = {.dt = (mha_kv_dtype)dt, .B = 2, .Hkv = 2, .H = 4, .D = 8, .cap = 32};
        k.k = new_floats(k.B * k.Hkv * 24 * k.D), k.v = new_floats(k.B * k.Hkv * 24 * k.D);
        k.q = new_floats(k.B * k.H * 24 * k.D), k.o = new_floats(k.B * k.H * 24 * k.D);
        char name[64];
        snprintf(name, sizeof name, "kv cache %s create/append/attend",
                 mha_kv_dtype_name((mha_kv_dtype)dt));
        sweep(name, sc_kv, &k, NULL);
        snprintf(name, sizeof name, "paged cache %s add/append/prompt/fork/attend",
                 mha_kv_dtype_name((mha_kv_dtype)dt));
        sweep(name, sc_paged, &k, NULL);
        free(k.k), free(k.v), free(k.q), free(k.o);
    }
    for (int tr = 0; tr < 2; tr++) {  // the dense layer
        dense_arg d = {.transposed = tr};
        d.x = new_floats(2 * 3 * 7 * 37), d.y = new_floats(3 * 7 * 29), d.b = new_floats(29);
        d.w = calloc(29 * 37, sizeof *d.w);
        if (!d.w) abort();
        for (int k = 0; k < 29 * 37; k++) d.w[k] = mha_f32_to_bf16(frand());
        sweep(tr ? "linear create (transposed BF16 weight) + forwards"
                 : "linear create (BF16 weight) + forwards",
              sc_dense, &d, NULL);
        free(d.x), free(d.y), free(d.b), free(d.w);
    }
    {
        const mod_spec cs[2] = {{.E = 16, .H = 4, .Hkv = 2, .bias = true},
                                {.E = 16,
                                 .H = 4,
                                 .bias = true,
                                 .gate = MHA_GATE_DYNAMIC,
                                 .npruned = 1,
                                 .wdt = MHA_BF16}};
        for (int i = 0; i < 2; i++)
            for (int chunk = 0; chunk < 2; chunk++) {
                cached_arg c = {.m = make_module(&cs[i]),
                                .N = 2,
                                .T = chunk ? 20 : 1,
                                .prefix = 6,
                                .extras = i == 1};
                const mha_config *mc = mha_module_config(c.m);
                const int64_t E = mc->embed_dim, d = E / mc->num_heads;
                if (mha_kv_cache_create(&c.c, c.N, mc->num_kv_heads, d, d, 64, MHA_KV_F32))
                    abort();
                float *px = new_floats(c.prefix * c.N * E),
                      *py = new_floats(c.prefix * c.N * E);
                // fill the prefix (kept: sc_cached truncates back to prefix)
                mha_tensor x = mha_tensor_contiguous(px, MHA_F32, 3,
                                                     (int64_t[]){c.prefix, c.N, E});
                mha_tensor y = mha_tensor_contiguous(py, MHA_F32, 3,
                                                     (int64_t[]){c.prefix, c.N, E});
                mha_forward_args f;
                mha_forward_args_init(&f);
                f.query = f.key = f.value = &x;
                f.opts.is_causal = true;
                if (c.extras) {
                    mha_rope_init(&f.rope, MHA_ROPE_NEOX);
                    f.opts.alibi = true;
                    f.opts.window_left = 7;
                }
                CHECK_OK(mha_forward_cached(&y, c.m, &f, c.c));
                c.x = new_floats(c.T * c.N * E), c.y = new_floats(c.T * c.N * E);
                char name[96];
                snprintf(name, sizeof name, "forward_cached %s, %s", i ? "BF16, gates" : "GQA",
                         chunk ? "prefill chunk 20" : "decode");
                sweep(name, sc_cached, &c, cached_intact);
                free(px), free(py), free(c.x), free(c.y);
                mha_kv_cache_destroy(c.c);
                mha_module_destroy(c.m);
            }
        // head dim above 4096 (append's row buffer comes from the heap)
        const int64_t D = 4100;
        cached_arg c = {.N = 1, .T = 2, .prefix = 1, .append_only = true, .D = D};
        if (mha_kv_cache_create(&c.c, 1, 1, D, D, 4, MHA_KV_INT8)) abort();
        c.x = new_floats(2 * D), c.y = new_floats(2 * D);
        mha_tensor k = mha_tensor_contiguous(c.x, MHA_F32, 4, (int64_t[]){1, 1, 1, D});
        CHECK_OK(mha_kv_cache_append(c.c, &k, &k, NULL));
        sweep("kv cache append, head dim 4100", sc_cached, &c, cached_intact);
        free(c.x), free(c.y);
        mha_kv_cache_destroy(c.c);
    }

    // the optimizers
    for (int kind = 0; kind < 2; kind++) {
        const mod_spec s = {
            .E = 16, .H = 4, .bias = true, .bias_kv = true, .gate = MHA_GATE_STATIC};
        optim_arg o = {.kind = (mha_optim_kind)kind, .m = make_module(&s), .g = make_module(&s)};
        o.snap = malloc(module_bytes(o.m, NULL));
        module_bytes(o.m, o.snap);
        o.gsnap = malloc(module_bytes(o.g, NULL));
        module_bytes(o.g, o.gsnap);
        o.extra = new_floats(16 * 9), o.extra_g = new_floats(16 * 9);
        o.extra0 = malloc(sizeof(float) * 16 * 9);
        o.extra_g0 = malloc(sizeof(float) * 16 * 9);
        memcpy(o.extra0, o.extra, sizeof(float) * 16 * 9);
        memcpy(o.extra_g0, o.extra_g, sizeof(float) * 16 * 9);
        sweep(kind ? "optimizer AdamW create/add/step" : "optimizer SGD create/add/step",
              sc_optim, &o, NULL);
        free(o.snap), free(o.gsnap), free(o.extra), free(o.extra_g), free(o.extra0);
        free(o.extra_g0);
        mha_module_destroy(o.m);
        mha_module_destroy(o.g);
    }
}

int main(int argc, char **argv) {
    const char *td = getenv("MHA_TEST_TMPDIR");
    snprintf(g_tmp, sizeof g_tmp, "%s", td && *td ? td : "/tmp");
    const char *verbose = getenv("MHA_ALLOC_VERBOSE");
    g_verbose = verbose && *verbose && strcmp(verbose, "0") != 0;
    cJSON_Hooks hooks = {cjson_malloc, free};
    cJSON_InitHooks(&hooks);
    setvbuf(stdout, NULL, _IOLBF, 0);
    bool mpi = false;
#ifdef MHA_TEST_MPI
    mpi = argc > 1 && strcmp(argv[1], "--mpi") == 0;
    if (mpi) {
        int provided;
        MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
        MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
        MPI_Comm_size(MPI_COMM_WORLD, &g_P);
    }
#else
    (void)argc, (void)argv;
#endif
    const char *sites = getenv("MHA_ALLOC_SITES");
    if (sites && *sites) {  // (MPI: one file per rank, path.<rank>)
        char path[600];
        if (mpi) snprintf(path, sizeof path, "%s.%d", sites, g_rank);
        else snprintf(path, sizeof path, "%s", sites);
        g_sites_out = fopen(path, "w");
        CHECKF(g_sites_out != NULL, "MHA_ALLOC_SITES: cannot write %s: %s", path,
               strerror(errno));
    }
#ifdef MHA_TEST_MPI
    if (mpi) sweep_mpi();
    else sweep_library();
#else
    sweep_library();
#endif
    if (g_rank == 0)
        printf("total: %d scenarios, %ld allocations (%ld of them cJSON's), %d library "
               "allocation sites reached, %ld failing runs%s\n",
               g_scenarios, g_total_allocs, g_total_cjson, g_nall_sites, g_total_runs,
               mpi ? " (rank 0's)" : "");
    if (g_sites_out) fclose(g_sites_out);
    free(g_res);
    char name[64] = "test_alloc_fail";
    if (mpi) snprintf(name, sizeof name, "test_alloc_fail --mpi, rank %d", g_rank);
    const int rc = check_summary(name);
#ifdef MHA_TEST_MPI
    if (mpi) MPI_Finalize();
#endif
    return rc;
}
