// error.c: status strings, the per-thread last-error message, the log
// callback, checked size arithmetic and the allocation wrappers (with
// optional fault injection for tests).
#if defined(__linux__) && !defined(_DEFAULT_SOURCE)
#define _DEFAULT_SOURCE  // madvise
#endif
#include <pthread.h>
#include <stdarg.h>
#ifdef MHA_FAULT_INJECTION
#include <stdatomic.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

#define MHA__ERRMSG_CAP 1024

static _Thread_local char g_errmsg[MHA__ERRMSG_CAP];
static mha_log_fn g_log_fn;
static void *g_log_user;

const char *mha_version(void) {
#define MHA__STR2(x) #x
#define MHA__STR(x) MHA__STR2(x)
    return MHA__STR(MHA_VERSION_MAJOR) "." MHA__STR(MHA_VERSION_MINOR) "." MHA__STR(
        MHA_VERSION_PATCH);
}

const char *mha_status_string(mha_status s) {
    switch (s) {
    case MHA_OK: return "MHA_OK";
    case MHA_ERR_INVALID_ARG: return "MHA_ERR_INVALID_ARG";
    case MHA_ERR_SHAPE: return "MHA_ERR_SHAPE";
    case MHA_ERR_NOMEM: return "MHA_ERR_NOMEM";
    case MHA_ERR_IO: return "MHA_ERR_IO";
    case MHA_ERR_FORMAT: return "MHA_ERR_FORMAT";
    case MHA_ERR_UNSUPPORTED: return "MHA_ERR_UNSUPPORTED";
    case MHA_ERR_NOT_FOUND: return "MHA_ERR_NOT_FOUND";
    case MHA_ERR_OVERFLOW: return "MHA_ERR_OVERFLOW";
    case MHA_ERR_DTYPE: return "MHA_ERR_DTYPE";
    }
    return "MHA_ERR_UNKNOWN";
}

const char *mha_last_error(void) { return g_errmsg; }

static _Thread_local char g_impl[32];

const char *mha_last_impl(void) { return g_impl; }

void mha__set_impl(bool fused, const char *isa, bool bf16) {
    if (fused) snprintf(g_impl, sizeof g_impl, "fused %s%s", isa, bf16 ? " bf16" : "");
    else snprintf(g_impl, sizeof g_impl, "reference");
}

void mha_set_log_callback(mha_log_fn fn, void *user) {
    g_log_fn = fn;
    g_log_user = user;
}

mha_status mha__fail(mha_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_errmsg, sizeof g_errmsg, fmt, ap);
    va_end(ap);
    // One line, whatever a caller's string held: a control byte left
    // unescaped (a name that missed mha_escape) becomes '?'.
    for (char *p = g_errmsg; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f) *p = '?';
    if (g_log_fn) g_log_fn(status, g_errmsg, g_log_user);
    return status;
}

int mha__mul_overflow_i64(int64_t a, int64_t b, int64_t *out) {
    int64_t r;
    if (__builtin_mul_overflow(a, b, &r)) return 1;
    *out = r;
    return 0;
}

int mha__mul_overflow_size(size_t a, size_t b, size_t *out) {
    size_t r;
    if (__builtin_mul_overflow(a, b, &r)) return 1;
    *out = r;
    return 0;
}

int mha__add_overflow_size(size_t a, size_t b, size_t *out) {
    size_t r;
    if (__builtin_add_overflow(a, b, &r)) return 1;
    *out = r;
    return 0;
}

// Every heap allocation of the library goes through the four functions
// below. Built with MHA_FAULT_INJECTION (a test build only), they count the
// calls and fail the one that mha__fault_arm chose; otherwise they are the
// C library's functions and nothing else.
#ifdef MHA_FAULT_INJECTION
static atomic_long g_fault_calls;   // allocations since mha__fault_arm
static atomic_long g_fault_at;      // the call that fails (1-based), 0: none
static atomic_int g_fault_sticky;   // and every later one
static atomic_long g_fault_failed;  // calls failed since mha__fault_arm
#define MHA__FAULT_SITES 4096
// The return address of each of the first MHA__FAULT_SITES calls: which
// line of the library allocated.
static const void *g_fault_site[MHA__FAULT_SITES];

void mha__fault_arm(long n, int sticky) {
    atomic_store(&g_fault_at, n);
    atomic_store(&g_fault_sticky, sticky);
    atomic_store(&g_fault_calls, 0);
    atomic_store(&g_fault_failed, 0);
}

long mha__fault_count(void) { return atomic_load(&g_fault_calls); }
long mha__fault_failures(void) { return atomic_load(&g_fault_failed); }

const void *mha__fault_site(long i) {
    return i >= 0 && i < MHA__FAULT_SITES && i < atomic_load(&g_fault_calls) ? g_fault_site[i]
                                                                             : NULL;
}

static int fault_now(const void *site) {
    long k = atomic_fetch_add(&g_fault_calls, 1) + 1;
    if (k <= MHA__FAULT_SITES) g_fault_site[k - 1] = site;
    long at = atomic_load(&g_fault_at);
    if (at <= 0 || k < at || (k > at && !atomic_load(&g_fault_sticky))) return 0;
    atomic_fetch_add(&g_fault_failed, 1);
    return 1;
}
#define MHA__FAULT_NOW() fault_now(__builtin_return_address(0))
#else
#define MHA__FAULT_NOW() 0
#endif

void *mha__malloc(size_t bytes) {
    if (MHA__FAULT_NOW()) return NULL;
    return malloc(bytes);
}

void *mha__calloc(size_t n, size_t size) {
    if (MHA__FAULT_NOW()) return NULL;
    return calloc(n, size);
}

void *mha__realloc(void *p, size_t bytes) {
    if (MHA__FAULT_NOW()) return NULL;
    return realloc(p, bytes);
}

// A buffer of at least MHA__HUGE_MIN bytes (a KV cache, a paged cache's
// pool, the weights) starts on a 2 MiB boundary and asks the kernel for
// transparent huge pages (Linux: honoured where THP is "madvise" or
// "always"; a hint, its failure harmless). Decode reads such a buffer in
// pieces scattered over it (a paged cache's blocks): with 4 KiB pages each
// piece would cost a TLB miss.
#define MHA__HUGE_PAGE ((size_t)2 << 20)
#define MHA__HUGE_MIN ((size_t)16 << 20)

// bytes (0 taken as 1) rounded up to a multiple of 64; 0 on overflow
static size_t round64(size_t bytes) {
    if (bytes == 0) bytes = 1;
    const size_t rounded = (bytes + 63) & ~(size_t)63;
    return rounded < bytes ? 0 : rounded;
}

// (mha__alloc past its fault check)
static void *alloc_aligned(size_t rounded) {
    if (rounded < MHA__HUGE_MIN) return aligned_alloc(64, rounded);
    const size_t huge = (rounded + MHA__HUGE_PAGE - 1) & ~(MHA__HUGE_PAGE - 1);
    if (huge < rounded) return NULL;
    void *p = aligned_alloc(MHA__HUGE_PAGE, huge);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (p) (void)madvise(p, huge, MADV_HUGEPAGE);
#endif
    return p;
}

void *mha__alloc(size_t bytes) {
    const size_t rounded = round64(bytes);
    if (!rounded) return NULL;
    if (MHA__FAULT_NOW()) return NULL;
    return alloc_aligned(rounded);
}

void mha__free(void *p) { free(p); }

// The calling thread's kept scratch blocks (internal.h): two slots, so
// that training's alternating forward and backward, of different sizes,
// each find theirs; each block's address and size here, and as the value
// of a thread-specific key whose destructor frees it when the thread exits.
#define MHA__SCRATCH_KEEP_MIN ((size_t)1 << 20)
#define MHA__SCRATCH_SLOTS 2
static _Thread_local void *t_scratch[MHA__SCRATCH_SLOTS];
static _Thread_local size_t t_scratch_bytes[MHA__SCRATCH_SLOTS];
static _Thread_local int t_scratch_older;  // the slot kept longer ago
// Kept blocks handed out and not yet given back, with their sizes (a block
// serves a smaller need: given back, it is kept at its own size).
static _Thread_local void *t_lent[MHA__SCRATCH_SLOTS];
static _Thread_local size_t t_lent_bytes[MHA__SCRATCH_SLOTS];
static pthread_key_t g_scratch_key[MHA__SCRATCH_SLOTS];
static bool g_scratch_key_ok;
static void scratch_key_make(void) {
    g_scratch_key_ok = true;
    for (int i = 0; i < MHA__SCRATCH_SLOTS; i++)
        g_scratch_key_ok &= !pthread_key_create(&g_scratch_key[i], free);
}
static void scratch_keep(int i, void *p, size_t bytes) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, scratch_key_make);
    t_scratch[i] = p, t_scratch_bytes[i] = bytes;
    if (g_scratch_key_ok) (void)pthread_setspecific(g_scratch_key[i], p);
}

// Under AddressSanitizer (the asan suite) every scratch block handed out
// is filled with 0xff bytes (NaN floats): a call that read scratch it had
// not written, fresh pages' zeros or a kept block's old values, would show.
#if defined(__SANITIZE_ADDRESS__)
#define MHA__POISON_SCRATCH 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MHA__POISON_SCRATCH 1
#endif
#endif
static void *scratch_poison(void *p, size_t bytes) {
#ifdef MHA__POISON_SCRATCH
    if (p) memset(p, 0xff, bytes);
#else
    (void)bytes;
#endif
    return p;
}

void *mha__scratch_alloc(size_t bytes) {
    const size_t rounded = round64(bytes);
    if (!rounded) return NULL;
    if (MHA__FAULT_NOW()) return NULL;
    // a kept block when it fits and is not more than twice the need
    for (int i = 0; i < MHA__SCRATCH_SLOTS; i++) {
        void *p = t_scratch[i];
        if (p && t_scratch_bytes[i] >= rounded && t_scratch_bytes[i] / 2 <= rounded) {
            for (int j = 0; j < MHA__SCRATCH_SLOTS; j++)
                if (!t_lent[j]) {
                    t_lent[j] = p, t_lent_bytes[j] = t_scratch_bytes[i];
                    break;
                }
            scratch_keep(i, NULL, 0);
            return scratch_poison(p, rounded);
        }
    }
    // none: the smaller ones never will serve this size
    for (int i = 0; i < MHA__SCRATCH_SLOTS; i++)
        if (t_scratch[i] && t_scratch_bytes[i] < rounded) {
            free(t_scratch[i]);
            scratch_keep(i, NULL, 0);
        }
    return scratch_poison(alloc_aligned(rounded), rounded);
}

void mha__scratch_free(void *p, size_t bytes) {
    if (!p) return;
    size_t rounded = round64(bytes);  // (the size mha__scratch_alloc took)
    for (int j = 0; j < MHA__SCRATCH_SLOTS; j++)
        if (t_lent[j] == p) {  // a kept block: its own size
            rounded = t_lent_bytes[j];
            t_lent[j] = NULL;
        }
    if (rounded < MHA__SCRATCH_KEEP_MIN) {
        free(p);
        return;
    }
    // an empty slot, else the older one's
    const int i = !t_scratch[0] ? 0 : !t_scratch[1] ? 1 : t_scratch_older;
    free(t_scratch[i]);
    scratch_keep(i, p, rounded);
    t_scratch_older = 1 - i;
}

void mha_release_scratch(void) {
    for (int i = 0; i < MHA__SCRATCH_SLOTS; i++) {
        free(t_scratch[i]);
        scratch_keep(i, NULL, 0);
    }
}

const char *mha__shape_str(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t n = 0;
    n += (size_t)snprintf(buf + n, cap - n, "(");
    for (int i = 0; i < ndim && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (n < cap) snprintf(buf + n, cap - n, ndim == 1 ? ",)" : ")");
    return buf;
}

// A quoted, printable, single-line copy of name for messages: bytes
// outside printable ASCII, quotes and backslashes as \xNN; at most 80
// characters, then "...".
const char *mha_escape(char *buf, size_t cap, const char *name) {
    size_t n = 0;
    const size_t max_chars = 80;
    buf[n++] = '"';
    for (size_t i = 0; name[i]; i++) {
        unsigned char c = (unsigned char)name[i];
        if (i >= max_chars || n + 8 >= cap) {
            memcpy(buf + n, "...", 3);
            n += 3;
            break;
        }
        if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
            buf[n++] = (char)c;
        } else {
            n += (size_t)snprintf(buf + n, cap - n, "\\x%02x", c);
        }
    }
    buf[n++] = '"';
    buf[n] = '\0';
    return buf;
}
