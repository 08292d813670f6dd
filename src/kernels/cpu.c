// cpu.c: picks the kernel table once per process. Generic kernels fill
// every slot; then the best ISA this build has and this CPU (and OS)
// supports overwrites what it implements. MHA_ISA=scalar|avx2|avx512 forces
// one (an unknown or unsupported name is ignored: mha_isa() tells what was
// chosen).
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "../internal.h"
#include "kernels.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(MHA_SCALAR_ONLY)
#define MHA__X86 1
#include <cpuid.h>
#endif

#ifdef MHA__X86
// F16C (the f16 rows' conversion; every AVX2 CPU has it): CPUID leaf 1,
// ECX bit 29 (clang's __builtin_cpu_supports does not know "f16c").
static bool has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c >> 29 & 1);
}
#endif

static bool cpu_has(const char *isa) {
    if (strcmp(isa, "scalar") == 0) return true;
#ifdef MHA__X86
    __builtin_cpu_init();
    if (strcmp(isa, "avx2") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
    if (strcmp(isa, "avx512") == 0)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
               __builtin_cpu_supports("fma") && has_f16c();
#endif
    return false;
}

static bool fill(mha__kernels *k, const char *isa) {
    if (!cpu_has(isa)) return false;
    mha__kernels_fill_generic(k);
#ifdef MHA__X86
    if (strcmp(isa, "avx2") == 0) mha__kernels_fill_avx2(k);
    if (strcmp(isa, "avx512") == 0) mha__kernels_fill_avx512(k);
#endif
    return true;
}

static mha__kernels g_table;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void choose(void) {
    const char *want = getenv("MHA_ISA");
    if (want && fill(&g_table, want)) return;
    if (fill(&g_table, "avx512")) return;
    if (fill(&g_table, "avx2")) return;
    fill(&g_table, "scalar");
}

const mha__kernels *mha__kernels_get(void) {
    pthread_once(&g_once, choose);
    return &g_table;
}

const mha__kernels *mha__kernels_for(const char *isa) {
    static const char *names[3] = {"scalar", "avx2", "avx512"};
    static mha__kernels tables[3];
    static bool tried[3], ok[3];
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    for (int i = 0; i < 3; i++) {
        if (strcmp(isa, names[i]) != 0) continue;
        pthread_mutex_lock(&mu);
        if (!tried[i]) {
            ok[i] = fill(&tables[i], names[i]);
            tried[i] = true;
        }
        pthread_mutex_unlock(&mu);
        return ok[i] ? &tables[i] : NULL;
    }
    return NULL;
}

const char *mha_isa(void) { return mha__kernels_get()->isa; }

int mha_isa_supported(const char *name) { return name && mha__kernels_for(name) ? 1 : 0; }
