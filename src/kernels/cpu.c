// cpu.c: picks the kernel table once per process. Generic kernels fill
// every slot; then the best ISA this build has and this CPU (and OS)
// supports overwrites what it implements.
// MHA_ISA=scalar|avx2|avx512|avx512bf16|amx forces one (an unknown or
// unsupported name is ignored: mha_isa() tells what was chosen). The avx512
// table takes vdpbf16ps for its bf16 slots where the CPU has AVX512-BF16
// but computes bf16 attention in float32 (bf_fast false); "avx512bf16" is
// that table computing bf16 with vdpbf16ps (bf_fast), chosen by default
// where vdpbf16ps runs at twice the float32 FMA rate: AMD Zen 4 and later
// (measured on an EPYC Zen 4, 2 threads: 472 against 236 GFLOP/s, and
// (1, 12, 2048, 64) bf16 attention 56 against 94 ms), not Intel's cores
// (one vdpbf16ps per cycle against two FMAs; a Sapphire Rapids ran the same
// call slower in bf16, 97-106 against 71 ms), which still can choose it;
// "amx" is the avx512 table with AMX-BF16 tiles for the bf16 products,
// chosen first where the CPU has them and Linux grants the tile state.
#define _DEFAULT_SOURCE  // syscall (unistd.h)
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "../internal.h"
#include "kernels.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(MHA_SCALAR_ONLY)
#define MHA__X86 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#ifdef MHA__X86
// AMD's CPUs (CPUID leaf 0 vendor "AuthenticAMD"): those with AVX512-BF16
// (Zen 4 and later) issue vdpbf16ps at twice their float32 FMA rate.
static bool is_amd(void) {
    unsigned a, b, c, d;
    return __get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u && d == 0x69746e65u &&
           c == 0x444d4163u;
}

// F16C (the f16 rows' conversion; every AVX2 CPU has it): CPUID leaf 1,
// ECX bit 29 (clang's __builtin_cpu_supports does not know "f16c").
static bool has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c >> 29 & 1);
}
#endif

#if defined(MHA__X86) && !defined(MHA_NO_AVX512BF16)
// AVX512-BF16 (CPUID leaf 7 subleaf 1, EAX bit 5), with AVX512BW and VL
// (every CPU with it has them; its kernels use them).
// (and AVX512-VNNI, which every such CPU has: avx512bf16.c's int8 dot)
static bool has_avx512bf16(void) {
    unsigned a, b, c, d, a0, b0, c0, d0;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 5 & 1) &&
           __get_cpuid_count(7, 0, &a0, &b0, &c0, &d0) && (c0 >> 11 & 1) &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}
#endif

#if defined(MHA__X86) && !defined(MHA_NO_AMX)
// AMX-BF16 and AMX-TILE (CPUID leaf 7, EDX bits 22 and 24), and Linux's
// permission to use the tile data (XFEATURE_XTILEDATA, 18), asked once for
// the process: arch_prctl(ARCH_REQ_XCOMP_PERM = 0x1023) fails on kernels
// before 5.16 and where the state is not enabled; then no AMX.
static bool g_amx;
static void ask_amx(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 22 & 1) || !(d >> 24 & 1)) return;
    g_amx = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}
static bool has_amx(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, ask_amx);
    return g_amx;
}
#endif

static bool cpu_has(const char *isa) {
    if (strcmp(isa, "scalar") == 0) return true;
#ifdef MHA__X86
    __builtin_cpu_init();
    if (strcmp(isa, "avx2") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
                        __builtin_cpu_supports("fma") && has_f16c();
    if (strcmp(isa, "avx512") == 0) return avx512;
#if !defined(MHA_NO_AVX512BF16)
    if (strcmp(isa, "avx512bf16") == 0) return avx512 && has_avx512bf16();
#endif
#if !defined(MHA_NO_AMX)
    if (strcmp(isa, "amx") == 0) return avx512 && has_avx512bf16() && has_amx();
#endif
#endif
    return false;
}

static bool fill(mha__kernels *k, const char *isa) {
    if (!cpu_has(isa)) return false;
    mha__kernels_fill_generic(k);
#ifdef MHA__X86
    if (strcmp(isa, "avx2") == 0) mha__kernels_fill_avx2(k);
    if (strcmp(isa, "avx512") == 0 || strcmp(isa, "avx512bf16") == 0 ||
        strcmp(isa, "amx") == 0) {
        mha__kernels_fill_avx512(k);
#if !defined(MHA_NO_AVX512BF16)
        if (has_avx512bf16()) mha__kernels_fill_avx512bf16(k);
        if (strcmp(isa, "avx512bf16") == 0) k->isa = "avx512bf16", k->bf_fast = true;
#endif
    }
#if !defined(MHA_NO_AMX)
    if (strcmp(isa, "amx") == 0) mha__kernels_fill_amx(k);
#endif
#endif
    return true;
}

static mha__kernels g_table;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void choose(void) {
    const char *want = getenv("MHA_ISA");
    if (want && fill(&g_table, want)) return;
    if (fill(&g_table, "amx")) return;
#ifdef MHA__X86
    if (is_amd() && fill(&g_table, "avx512bf16")) return;
#endif
    if (fill(&g_table, "avx512")) return;
    if (fill(&g_table, "avx2")) return;
    fill(&g_table, "scalar");
}

const mha__kernels *mha__kernels_get(void) {
    pthread_once(&g_once, choose);
    return &g_table;
}

const mha__kernels *mha__kernels_for(const char *isa) {
    enum { NT = 5 };
    static const char *names[NT] = {"scalar", "avx2", "avx512", "avx512bf16", "amx"};
    static mha__kernels tables[NT];
    static bool tried[NT], ok[NT];
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    for (int i = 0; i < NT; i++) {
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
