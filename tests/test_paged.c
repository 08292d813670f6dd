// test_paged.c: the paged KV cache (mha_paged_cache) against the contiguous
// one. Random schedules of adds, forks, frees, truncations and appends over
// a small pool (block sizes 1, 3, 16 and 64; every storage type); after
// each step a random group of sequences attends (decode and prefill,
// windows) and must give exactly the bits of a contiguous cache holding the
// same tokens. A mirror of every sequence's tokens (float32 rows) is the
// model. Then the block accounting (forks share, copy on write costs one
// block), the error cases (each leaving the whole state as it was: a
// digest of it, mha__paged_cache_digest, before and after) and attends and
// changes from two threads at once (each overlap forced by a hook that
// holds a call open inside the cache).
// All of it for both pool layouts (mha_paged_layout): the same bits.
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "util.h"
#include "kvcache.h"
#include "mha.h"

enum { HKV = 2, H = 4, MAXSEQ = 12, MAXLEN = 700, CAPL = 2100 };  // CAPL: a mirror's room

typedef struct mirror {
    int64_t id, len;
    float *k, *v;      // (HKV, MAXLEN, D)
    int32_t *tok;      // the token ids (MAXLEN)
    uint64_t *prefix;  // prefix[t]: the hash of tok[0..t]
} mirror;

// The pool's layout every test here creates its caches with (main runs
// the whole suite once for each).
static mha_paged_layout g_layout;

static mha_status paged_create(mha_paged_cache **c, int64_t nb, int64_t bs, int64_t hkv,
                               int64_t d, int64_t dv, mha_kv_dtype dt) {
    return mha_paged_cache_create(c, nb, bs, hkv, d, dv, dt, g_layout);
}

typedef struct world {
    mha_paged_cache *c;
    mha_kv_dtype dt;
    int64_t D, bs;
    mirror seq[MAXSEQ];
    int n;
} world;

static void mirror_init(mirror *m, int64_t D) {
    m->k = calloc((size_t)(HKV * CAPL * D), sizeof(float));
    m->v = calloc((size_t)(HKV * CAPL * D), sizeof(float));
    m->tok = calloc(CAPL, sizeof(int32_t));
    m->prefix = calloc(CAPL, sizeof(uint64_t));
    m->len = 0;
}

static void mirror_free(mirror *m) { free(m->k), free(m->v), free(m->tok), free(m->prefix); }

static void mirror_copy(mirror *d, const mirror *s, int64_t D) {
    memcpy(d->k, s->k, sizeof(float) * (size_t)(HKV * CAPL * D));
    memcpy(d->v, s->v, sizeof(float) * (size_t)(HKV * CAPL * D));
    memcpy(d->tok, s->tok, sizeof(int32_t) * CAPL);
    memcpy(d->prefix, s->prefix, sizeof(uint64_t) * CAPL);
    d->len = s->len;
}

static uint64_t mix(uint64_t x) {  // splitmix64's finaliser
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// A token's K or V element as a model would make it: a function of the
// whole prefix up to it (so that equal prefixes hold equal rows).
static float kv_of(uint64_t prefix, int64_t h, int64_t e, int isv) {
    const uint64_t r = mix(prefix ^ mix((uint64_t)(h * 4096 + e * 2 + isv)));
    return (float)((double)(r >> 11) * 0x1p-53 * 2.0 - 1.0);
}

// Token t of m gets id `tok` and its K, V rows.
static void mirror_put(mirror *m, int64_t t, int32_t tok, int64_t D) {
    m->tok[t] = tok;
    m->prefix[t] = mix((t ? m->prefix[t - 1] : 0x1234) ^ (uint64_t)(uint32_t)tok);
    for (int64_t h = 0; h < HKV; h++)
        for (int64_t e = 0; e < D; e++) {
            m->k[((size_t)h * CAPL + (size_t)t) * (size_t)D + (size_t)e] = kv_of(m->prefix[t],
                                                                                 h, e, 0);
            m->v[((size_t)h * CAPL + (size_t)t) * (size_t)D + (size_t)e] = kv_of(m->prefix[t],
                                                                                 h, e, 1);
        }
}

static int64_t g_count;       // > 0: every sequence's count in check_attend
static float g_softcap;       // check_attend's soft cap (0: none)
static const float *g_alibi;  // check_attend's ALiBi slopes (H of them; NULL: none)

// The n sequences sel[] attend (T new queries each, counts random): the
// paged cache and a contiguous cache of their tokens, the same bits.
static void check_attend(world *w, const int *sel, int n, int64_t T, int64_t win,
                         const char *what) {
    const int64_t D = w->D;
    int64_t ids[MAXSEQ], counts[MAXSEQ], cap = 1;
    for (int i = 0; i < n; i++) {
        const mirror *m = &w->seq[sel[i]];
        ids[i] = m->id;
        counts[i] = g_count ? g_count : m->len < T ? m->len : irand(m->len ? 1 : 0, T);
        cap = m->len > cap ? m->len : cap;
    }
    mha_kv_cache *kc = NULL;
    CHECK_OK(mha_kv_cache_create(&kc, n, HKV, D, D, cap, w->dt));
    const size_t nkv = (size_t)(n * HKV * cap * D);
    float *kb = calloc(nkv, sizeof(float)), *vb = calloc(nkv, sizeof(float));
    int64_t lens[MAXSEQ];
    for (int i = 0; i < n; i++) {
        const mirror *m = &w->seq[sel[i]];
        lens[i] = m->len;
        for (int64_t h = 0; h < HKV; h++)
            for (int64_t t = 0; t < m->len; t++)
                for (int64_t e = 0; e < D; e++) {
                    const size_t dst = (((size_t)i * HKV + (size_t)h) * (size_t)cap + (size_t)t) *
                                           (size_t)D +
                                       (size_t)e;
                    kb[dst] = m->k[((size_t)h * CAPL + (size_t)t) * (size_t)D + (size_t)e];
                    vb[dst] = m->v[((size_t)h * CAPL + (size_t)t) * (size_t)D + (size_t)e];
                }
    }
    mha_tensor kt = mha_tensor_contiguous(kb, MHA_F32, 4, (int64_t[]){n, HKV, cap, D}),
               vt = mha_tensor_contiguous(vb, MHA_F32, 4, (int64_t[]){n, HKV, cap, D});
    CHECK_OK(mha_kv_cache_append(kc, &kt, &vt, lens));
    const size_t nq = (size_t)(n * H * T * D);
    float *q = malloc(sizeof(float) * nq), *o1 = malloc(sizeof(float) * nq),
          *o2 = malloc(sizeof(float) * nq);
    for (size_t i = 0; i < nq; i++) q[i] = frand(), o1[i] = 1.0f, o2[i] = 2.0f;
    const int64_t sh[4] = {n, H, T, D};
    mha_tensor qt = mha_tensor_contiguous(q, MHA_F32, 4, sh),
               t1 = mha_tensor_contiguous(o1, MHA_F32, 4, sh),
               t2 = mha_tensor_contiguous(o2, MHA_F32, 4, sh);
    mha_cache_attend_args a;
    mha_cache_attend_args_init(&a);
    a.opts.window_left = win;
    a.opts.softcap = g_softcap;
    a.opts.alibi_slopes = g_alibi;
    CHECK_OK(mha_kv_cache_attend(&t1, &qt, kc, &a, counts));
    CHECK_OK(mha_paged_cache_attend(&t2, &qt, w->c, n, ids, counts, &a));
    CHECKF(memcmp(o1, o2, sizeof(float) * nq) == 0,
           "%s: %s block %lld D %lld, %d sequences, T %lld, window %lld: paged != contiguous",
           what, mha_kv_dtype_name(w->dt), (long long)w->bs, (long long)D, n, (long long)T,
           (long long)win);
    free(q), free(o1), free(o2), free(kb), free(vb);
    mha_kv_cache_destroy(kc);
}

// Appends cnt[i] tokens to sequences sel[i] (paged and mirrors): the ids
// given[i] (NULL: drawn from a vocabulary of 3, so that prefixes repeat),
// their K, V from the prefix (kv_of); with_ids: through
// mha_paged_cache_append (else without the ids). The mirrors change
// only if the append lands.
static mha_status append_ids(world *w, const int *sel, int n, const int64_t *cnt,
                             const int32_t *const *given, bool with_ids) {
    const int64_t D = w->D;
    int64_t T = 1, ids[MAXSEQ];
    for (int i = 0; i < n; i++) T = cnt[i] > T ? cnt[i] : T, ids[i] = w->seq[sel[i]].id;
    const size_t nr = (size_t)(n * HKV * T * D);
    float *k = calloc(nr, sizeof(float)), *v = calloc(nr, sizeof(float));
    int32_t *tok = calloc((size_t)(n * T), sizeof(int32_t));
    mirror scratch;
    mirror_init(&scratch, D);
    for (int i = 0; i < n; i++) {  // the rows, as the mirror would hold them
        mirror_copy(&scratch, &w->seq[sel[i]], D);
        for (int64_t t = 0; t < cnt[i]; t++) {
            const int32_t id = given && given[i] ? given[i][t] : (int32_t)irand(0, 2);
            tok[i * T + t] = id;
            mirror_put(&scratch, scratch.len + t, id, D);
            for (int64_t h = 0; h < HKV; h++)
                memcpy(k + (((size_t)i * HKV + (size_t)h) * (size_t)T + (size_t)t) * (size_t)D,
                       scratch.k + ((size_t)h * CAPL + (size_t)(scratch.len + t)) * (size_t)D,
                       sizeof(float) * (size_t)D),
                    memcpy(v + (((size_t)i * HKV + (size_t)h) * (size_t)T + (size_t)t) *
                                   (size_t)D,
                           scratch.v +
                               ((size_t)h * CAPL + (size_t)(scratch.len + t)) * (size_t)D,
                           sizeof(float) * (size_t)D);
        }
    }
    const int64_t sh[4] = {n, HKV, T, D};
    mha_tensor kt = mha_tensor_contiguous(k, MHA_F32, 4, sh),
               vt = mha_tensor_contiguous(v, MHA_F32, 4, sh);
    mha_status st = with_ids ? mha_paged_cache_append(w->c, n, ids, cnt, &kt, &vt, tok)
                             : mha_paged_cache_append(w->c, n, ids, cnt, &kt, &vt, NULL);
    for (int i = 0; i < n && st == MHA_OK; i++) {
        mirror *m = &w->seq[sel[i]];
        for (int64_t t = 0; t < cnt[i]; t++) mirror_put(m, m->len + t, tok[i * T + t], D);
        m->len += cnt[i];
    }
    mirror_free(&scratch);
    free(k), free(v), free(tok);
    return st;
}

static mha_status append_some(world *w, const int *sel, int n, const int64_t *cnt) {
    return append_ids(w, sel, n, cnt, NULL, true);
}

// A random group of distinct live sequences.
static int pick(const world *w, int *sel, int most) {
    int n = 0;
    for (int i = 0; i < w->n && n < most; i++)
        if (next() % 2) sel[n++] = i;
    if (n == 0 && w->n > 0) sel[n++] = (int)irand(0, w->n - 1);
    return n;
}

// over every schedule: prompts added, tokens they reused, prompts whose last
// token's row a shared block held
static int64_t prompts, reused, held;

static void random_schedule(mha_kv_dtype dt, int64_t bs, int64_t D, int steps) {
    world w = {.dt = dt, .D = D, .bs = bs};
    CHECK_OK(paged_create(&w.c, (MAXSEQ * MAXLEN) / bs + 8, bs, HKV, D, D, dt));
    for (int step = 0; step < steps; step++) {
        const int op = (int)(next() % 10);
        int sel[MAXSEQ];
        if ((op == 0 || w.n == 0) && w.n < MAXSEQ) {  // add
            mirror_init(&w.seq[w.n], D);
            CHECK_OK(mha_paged_cache_add(w.c, &w.seq[w.n].id));
            w.n++;
        } else if (op == 1 && w.n < MAXSEQ) {  // fork: shares every block
            const int s = (int)irand(0, w.n - 1);
            const int64_t used = mha_paged_cache_blocks_in_use(w.c);
            mirror *m = &w.seq[w.n];
            mirror_init(m, D);
            CHECK_OK(mha_paged_cache_fork(w.c, w.seq[s].id, &m->id));
            mirror_copy(m, &w.seq[s], D);
            CHECK(mha_paged_cache_blocks_in_use(w.c) == used);
            CHECK(mha_paged_cache_length(w.c, m->id) == m->len);
            w.n++;
        } else if (op == 2 && w.n > 1) {  // free
            const int s = (int)irand(0, w.n - 1);
            const int64_t id = w.seq[s].id;
            CHECK_OK(mha_paged_cache_free(w.c, id));
            CHECK(mha_paged_cache_length(w.c, id) == -1);
            mirror_free(&w.seq[s]);
            w.seq[s] = w.seq[--w.n];
        } else if (op == 3) {  // truncate
            mirror *m = &w.seq[irand(0, w.n - 1)];
            const int64_t len = irand(0, m->len);
            CHECK_OK(mha_paged_cache_truncate(w.c, m->id, len));
            m->len = len;
        } else if (op == 4 && w.n < MAXSEQ) {  // a prompt: another's first tokens + new ones
            // (half of them exactly another's first blocks: found whole, when indexed)
            const mirror *src = &w.seq[irand(0, w.n - 1)];
            const bool whole = next() % 2 && src->len >= 2 * bs;
            const int64_t keep = whole ? irand(2, src->len / bs) * bs : irand(0, src->len),
                          extra = whole ? 0 : irand(1, 20);
            int32_t prompt[MAXLEN];
            if (keep + extra > MAXLEN) continue;
            memcpy(prompt, src->tok, sizeof(int32_t) * (size_t)keep);
            for (int64_t t = keep; t < keep + extra; t++) prompt[t] = (int32_t)irand(0, 2);
            mirror *m = &w.seq[w.n];
            mirror_init(m, D);
            int64_t cached = -1;
            const int64_t used = mha_paged_cache_blocks_in_use(w.c);
            CHECK_OK(mha_paged_cache_add_prompt(w.c, prompt, keep + extra, &m->id, &cached));
            // whole blocks, or the prompt but its last token when blocks hold all of it
            CHECKF(cached >= 0 && cached < keep + extra &&
                       (cached % bs == 0 ||
                        (cached == keep + extra - 1 && (cached + 1) % bs == 0)),
                   "prompt of %lld: %lld cached", (long long)(keep + extra), (long long)cached);
            CHECK(mha_paged_cache_blocks_in_use(w.c) == used);  // shared, nothing new
            CHECK(mha_paged_cache_length(w.c, m->id) == cached);
            for (int64_t t = 0; t < cached; t++) mirror_put(m, t, prompt[t], D);
            m->len = cached;
            w.n++;
            int s1[1] = {w.n - 1};
            const int64_t rest = keep + extra - cached;
            const int32_t *given[1] = {prompt + cached};
            CHECK_OK(append_ids(&w, s1, 1, &rest, given, true));
            if (cached % bs)  // the last token's row was in the shared block: nothing new
                CHECKF(mha_paged_cache_blocks_in_use(w.c) == used,
                       "prompt of %lld, %lld cached: %lld blocks, %lld before",
                       (long long)(keep + extra), (long long)cached,
                       (long long)mha_paged_cache_blocks_in_use(w.c), (long long)used);
            prompts++, reused += cached, held += cached % bs != 0;
        } else {  // append to a few (lengths within MAXLEN)
            const int n = pick(&w, sel, 4);
            int64_t cnt[MAXSEQ];
            for (int i = 0; i < n; i++) {
                const int64_t room = MAXLEN - w.seq[sel[i]].len;
                cnt[i] = room <= 0 ? 0 : irand(0, room < 40 ? room : (next() % 5 ? 8 : 40));
            }
            CHECK_OK(append_ids(&w, sel, n, cnt, NULL, next() % 8 != 0));
        }
        for (int i = 0; i < w.n; i++)
            CHECKF(mha_paged_cache_length(w.c, w.seq[i].id) == w.seq[i].len,
                   "step %d: sequence length", step);
        if (step % 3 == 2) {
            const int n = pick(&w, sel, MAXSEQ);
            const int64_t T = next() % 4 ? irand(1, 5) : irand(17, 40);  // decode / prefill
            check_attend(&w, sel, n, T, next() % 3 ? -1 : irand(0, 300), "random schedule");
        }
    }
    for (int i = 0; i < w.n; i++) {
        CHECK_OK(mha_paged_cache_free(w.c, w.seq[i].id));
        mirror_free(&w.seq[i]);
    }
    CHECK(mha_paged_cache_blocks_in_use(w.c) == 0);
    mha_paged_cache_destroy(w.c);
}

// Sequences that share their first blocks (forks of one 600-token prompt,
// some with tokens of their own, some not, and two others) attend in one
// call: decode reads the shared rows once for all of their queries, and
// every sequence gets exactly the bits of a contiguous cache holding its
// tokens. Every storage type; 1 and up to 4 queries a sequence (an attend
// without an append puts queries inside the shared blocks: those rows are
// then not seen by all); no window (the sharing's case) and a window; soft
// cap and ALiBi (per query position). Head dim D, a prompt of plen tokens,
// storage types dt0 .. dt1 (D 128 in float32: chunks of 512 keys, so that a
// 514-token prompt's queries start before the second chunk).
static void test_shared_decode(int64_t D, int64_t plen, int dt0, int dt1) {
    const float slopes[H] = {0.5f, 0.25f, 0.125f, 0.0625f};
    for (int dt = dt0; dt <= dt1; dt++) {
        world w = {.dt = (mha_kv_dtype)dt, .D = D, .bs = 16};
        CHECK_OK(paged_create(&w.c, (MAXSEQ * MAXLEN) / 16 + 8, 16, HKV, D, D,
                              (mha_kv_dtype)dt));
        int sel[MAXSEQ];
        for (int i = 0; i < 10; i++) sel[i] = i;
        mirror_init(&w.seq[0], D);
        CHECK_OK(mha_paged_cache_add(w.c, &w.seq[0].id));
        w.n = 1;
        CHECK_OK(append_some(&w, sel, 1, &plen));
        for (int i = 1; i < 8; i++) {  // the forks
            mirror_init(&w.seq[i], D);
            CHECK_OK(mha_paged_cache_fork(w.c, w.seq[0].id, &w.seq[i].id));
            mirror_copy(&w.seq[i], &w.seq[0], D);
            w.n++;
        }
        for (int i = 8; i < 10; i++) {  // two others
            mirror_init(&w.seq[i], D);
            CHECK_OK(mha_paged_cache_add(w.c, &w.seq[i].id));
            w.n++;
            const int64_t len = i == 8 ? 100 : 300;
            CHECK_OK(append_some(&w, sel + i, 1, &len));
        }
        for (int round = 0; round < 2; round++) {
            for (int64_t T = 1; T <= 4; T += 3)
                for (int v = 0; v < 4; v++) {
                    g_softcap = v == 1 ? 5.0f : 0.0f;
                    g_alibi = v == 2 ? slopes : NULL;
                    check_attend(&w, sel, 10, T, v == 3 ? 100 : -1, "shared decode");
                }
            // the forks' own tokens (0 for fork 1: it still shares the
            // prompt's last, partial block with the prompt's sequence)
            int64_t own[MAXSEQ] = {0};
            for (int i = 2; i < 8; i++) own[i - 1] = 3 * i;
            CHECK_OK(append_some(&w, sel + 1, 7, own));
        }
        g_softcap = 0.0f, g_alibi = NULL;
        for (int i = 0; i < w.n; i++) {
            CHECK_OK(mha_paged_cache_free(w.c, w.seq[i].id));
            mirror_free(&w.seq[i]);
        }
        mha_paged_cache_destroy(w.c);
    }
}

// Block counts: a fork shares every block; its first write into a shared
// partial block copies that one block; a write into a block of its own does
// not; truncation returns the blocks past the new length.
static void test_blocks(void) {
    enum { BS = 16, D = 8 };
    mha_paged_cache *c = NULL;
    CHECK_OK(paged_create(&c, 40, BS, HKV, D, D, MHA_KV_F32));
    world w = {.c = c, .dt = MHA_KV_F32, .D = D, .bs = BS};
    mirror_init(&w.seq[0], D);
    CHECK_OK(mha_paged_cache_add(c, &w.seq[0].id));
    w.n = 1;
    int sel[2] = {0, 1};
    int64_t cnt[2] = {100, 0};  // 100 tokens: 7 blocks, the last partial
    CHECK_OK(append_some(&w, sel, 1, cnt));
    CHECK(mha_paged_cache_blocks_in_use(c) == 7);
    mirror_init(&w.seq[1], D);
    CHECK_OK(mha_paged_cache_fork(c, w.seq[0].id, &w.seq[1].id));
    memcpy(w.seq[1].k, w.seq[0].k, sizeof(float) * (size_t)(HKV * CAPL * D));
    memcpy(w.seq[1].v, w.seq[0].v, sizeof(float) * (size_t)(HKV * CAPL * D));
    w.seq[1].len = 100;
    w.n = 2;
    CHECK(mha_paged_cache_blocks_in_use(c) == 7);  // the fork: no block
    cnt[0] = 1;
    CHECK_OK(append_some(&w, sel + 1, 1, cnt));    // one token into the shared last block
    CHECK(mha_paged_cache_blocks_in_use(c) == 8);  // its copy
    CHECK_OK(append_some(&w, sel + 1, 1, cnt));    // its own block now
    CHECK(mha_paged_cache_blocks_in_use(c) == 8);
    check_attend(&w, sel, 2, 3, -1, "fork and copy on write");
    CHECK_OK(mha_paged_cache_truncate(c, w.seq[1].id, 20));  // keeps 2 shared blocks
    w.seq[1].len = 20;
    CHECK(mha_paged_cache_blocks_in_use(c) == 7);  // its copy returned; the rest sequence 0's
    CHECK_OK(mha_paged_cache_free(c, w.seq[0].id));
    CHECK(mha_paged_cache_blocks_in_use(c) == 2);
    CHECK(mha_paged_cache_block_bytes(c) == (size_t)(HKV * BS * 2 * D) * sizeof(float));
    mirror_free(&w.seq[0]);
    mirror_free(&w.seq[1]);
    mha_paged_cache_destroy(c);
}

// Prefix sharing: a 2k-token prompt stored once for 32 sequences, each of
// which then generates its own tokens; memory against the distinct tokens;
// every sequence attends as a contiguous cache of its tokens would.
static void test_prefix(void) {
    enum { BS = 16, D = 16, P = 2048, NS = 32, GEN = 40 };
    world w = {.dt = MHA_KV_F32, .D = D, .bs = BS};
    CHECK_OK(paged_create(&w.c, 400, BS, HKV, D, D, MHA_KV_F32));
    static int32_t prompt[P];
    for (int t = 0; t < P; t++) prompt[t] = (int32_t)irand(0, 50000);
    for (int i = 0; i < NS && i < MAXSEQ; i++) {
        mirror *m = &w.seq[i];
        mirror_init(m, D);
        int64_t cached;
        CHECK_OK(mha_paged_cache_add_prompt(w.c, prompt, P, &m->id, &cached));
        // (P a whole number of blocks: every one shared, the last token's row kept)
        CHECKF(cached == (i == 0 ? 0 : P - 1), "sequence %d: %lld cached", i, (long long)cached);
        for (int64_t t = 0; t < cached; t++) mirror_put(m, t, prompt[t], D);
        m->len = cached;
        w.n = i + 1;
        int s1[1] = {i};
        const int64_t rest = P - cached;
        const int32_t *given[1] = {prompt + cached};
        CHECK_OK(append_ids(&w, s1, 1, &rest, given, true));
    }
    const int n = w.n;  // (MAXSEQ of them)
    int sel[MAXSEQ];
    int64_t cnt[MAXSEQ];
    for (int i = 0; i < n; i++) sel[i] = i, cnt[i] = GEN;
    CHECK_OK(append_ids(&w, sel, n, cnt, NULL, true));  // each its own tokens
    const int64_t used = mha_paged_cache_blocks_in_use(w.c);
    const double distinct = (double)(P + n * GEN) / BS;  // blocks' worth of distinct tokens
    printf("prefix: %d sequences sharing a %d-token prompt, %d tokens each after it: %lld "
           "blocks in use, %.2f x the distinct tokens (%d separate caches: %.1f x)\n",
           n, P, GEN, (long long)used, (double)used / distinct, n,
           (double)(n * ((P + GEN + BS - 1) / BS)) / distinct);
    // the prompt once, and each sequence's own tokens in blocks of its own
    // (their last one partly full)
    CHECKF(used == P / BS + n * ((GEN + BS - 1) / BS),
           "prefix: %lld blocks for %.1f blocks of tokens", (long long)used, distinct);
    CHECKF((double)used <= 1.1 * distinct, "prefix: %lld blocks for %.1f blocks of tokens",
           (long long)used, distinct);
    check_attend(&w, sel, n, 1, -1, "shared prompt, decode");
    check_attend(&w, sel, 4, 20, -1, "shared prompt, prefill");
    // a truncated sequence rewrites its own copy, not the shared blocks
    CHECK_OK(mha_paged_cache_truncate(w.c, w.seq[1].id, 1000));
    w.seq[1].len = 1000;
    int s1[1] = {1};
    int64_t c5 = 5;
    CHECK_OK(append_ids(&w, s1, 1, &c5, NULL, true));
    check_attend(&w, sel, n, 1, -1, "after a truncation into the shared prompt");
    // the prompt's blocks stay indexed while held; freed by all, they leave
    for (int i = 0; i < n; i++) CHECK_OK(mha_paged_cache_free(w.c, w.seq[i].id));
    CHECK(mha_paged_cache_blocks_in_use(w.c) == 0);
    int64_t id, cached;
    CHECK_OK(mha_paged_cache_add_prompt(w.c, prompt, P, &id, &cached));
    CHECK(cached == 0);
    for (int i = 0; i < n; i++) mirror_free(&w.seq[i]);
    mha_paged_cache_destroy(w.c);

    // a block held alone, cut into and rewritten, leaves the index: a prompt
    // with its old tokens shares only the block before it
    world x = {.dt = MHA_KV_F32, .D = D, .bs = BS};
    CHECK_OK(paged_create(&x.c, 10, BS, HKV, D, D, MHA_KV_F32));
    mirror_init(&x.seq[0], D);
    CHECK_OK(mha_paged_cache_add(x.c, &x.seq[0].id));
    x.n = 1;
    int s0[1] = {0};
    int64_t c32 = 32, c12 = 12;
    const int32_t *given[1] = {prompt};
    CHECK_OK(append_ids(&x, s0, 1, &c32, given, true));  // blocks 0 and 1, keyed
    CHECK_OK(mha_paged_cache_truncate(x.c, x.seq[0].id, 20));
    x.seq[0].len = 20;
    int32_t other[12];
    for (int t = 0; t < 12; t++) other[t] = prompt[20 + t] + 1;  // other tokens
    given[0] = other;
    CHECK_OK(append_ids(&x, s0, 1, &c12, given, true));  // block 1 rewritten
    mirror_init(&x.seq[1], D);
    CHECK_OK(mha_paged_cache_add_prompt(x.c, prompt, 33, &x.seq[1].id, &cached));
    CHECKF(cached == 16, "a prompt after a rewrite: %lld cached, expected 16",
           (long long)cached);
    for (int64_t t = 0; t < cached; t++) mirror_put(&x.seq[1], t, prompt[t], D);
    x.seq[1].len = cached;
    x.n = 2;
    int s1b[1] = {1};
    int64_t rest = 33 - cached;
    given[0] = prompt + cached;
    CHECK_OK(append_ids(&x, s1b, 1, &rest, given, true));
    int both[2] = {0, 1};
    check_attend(&x, both, 2, 3, -1, "a prompt after a rewrite");
    mirror_free(&x.seq[0]);
    mirror_free(&x.seq[1]);
    mha_paged_cache_destroy(x.c);
}

// A prompt that indexed blocks hold whole: add_prompt shares its last block
// too and leaves the last token to compute; appended with its id, that
// token keeps the block's row (the K and V given are not written: here they
// are zeros, and the attends still see the first sequence's rows) and costs
// no block. A different last token copies the block; without ids, too. A
// sequence that holds an indexed block alone and rewrites its last rows
// takes it out of the index (a later prompt shares only the block before).
static void test_prompt_last_row(void) {
    enum { BS = 4, D = 8 };
    world w = {.dt = MHA_KV_F32, .D = D, .bs = BS};
    CHECK_OK(paged_create(&w.c, 20, BS, HKV, D, D, MHA_KV_F32));
    int32_t p8[8] = {11, 12, 13, 14, 15, 16, 17, 18};
    for (int i = 0; i < 6; i++) mirror_init(&w.seq[i], D);
    CHECK_OK(mha_paged_cache_add(w.c, &w.seq[0].id));
    w.n = 1;
    int s0[1] = {0}, sel[5] = {0, 1, 2, 3, 4};
    int64_t c8 = 8, c1 = 1, cached = -1;
    const int32_t *g8[1] = {p8};
    CHECK_OK(append_ids(&w, s0, 1, &c8, g8, true));
    CHECK(mha_paged_cache_blocks_in_use(w.c) == 2);
    // 1: the same prompt; its last token's K and V given as zeros
    CHECK_OK(mha_paged_cache_add_prompt(w.c, p8, 8, &w.seq[1].id, &cached));
    CHECKF(cached == 7, "whole prompt: %lld cached", (long long)cached);
    CHECK(mha_paged_cache_blocks_in_use(w.c) == 2);
    CHECK(mha_paged_cache_length(w.c, w.seq[1].id) == 7);
    mirror_copy(&w.seq[1], &w.seq[0], D);
    w.n = 2;
    float zk[HKV * D] = {0}, zv[HKV * D] = {0};
    const int64_t sh[4] = {1, HKV, 1, D};
    mha_tensor zkt = mha_tensor_contiguous(zk, MHA_F32, 4, sh),
               zvt = mha_tensor_contiguous(zv, MHA_F32, 4, sh);
    CHECK_OK(mha_paged_cache_append(w.c, 1, &w.seq[1].id, NULL, &zkt, &zvt, p8 + 7));
    CHECK(mha_paged_cache_blocks_in_use(w.c) == 2);
    CHECK(mha_paged_cache_length(w.c, w.seq[1].id) == 8);
    check_attend(&w, sel, 2, 1, -1, "the last row kept");
    // 2: the prompt, then another last token: the block copied
    int32_t t99 = 99;
    CHECK_OK(mha_paged_cache_add_prompt(w.c, p8, 8, &w.seq[2].id, &cached));
    CHECK(cached == 7);
    mirror_copy(&w.seq[2], &w.seq[0], D);
    w.seq[2].len = 7;
    w.n = 3;
    int s2[1] = {2};
    const int32_t *g99[1] = {&t99};
    CHECK_OK(append_ids(&w, s2, 1, &c1, g99, true));
    CHECK(mha_paged_cache_blocks_in_use(w.c) == 3);
    // 3: the same prompt appended without its ids: copied as well
    CHECK_OK(mha_paged_cache_add_prompt(w.c, p8, 8, &w.seq[3].id, &cached));
    CHECKF(cached == 7, "third prompt: %lld cached", (long long)cached);
    mirror_copy(&w.seq[3], &w.seq[0], D);
    w.seq[3].len = 7;
    w.n = 4;
    int s3[1] = {3};
    const int32_t *g18[1] = {p8 + 7};
    CHECK_OK(append_ids(&w, s3, 1, &c1, g18, false));
    CHECK(mha_paged_cache_blocks_in_use(w.c) == 4);
    check_attend(&w, sel, 4, 1, -1, "shared last blocks, copied");
    check_attend(&w, sel, 4, 3, -1, "shared last blocks, copied (prefill)");
    // 4: a fourth copy of the prompt; once 0 and 1 are freed it holds the
    // indexed blocks alone and rewrites its last row in place
    CHECK_OK(mha_paged_cache_add_prompt(w.c, p8, 8, &w.seq[4].id, &cached));
    CHECK(cached == 7);
    mirror_copy(&w.seq[4], &w.seq[0], D);
    w.seq[4].len = 7;
    CHECK_OK(mha_paged_cache_free(w.c, w.seq[0].id));
    CHECK_OK(mha_paged_cache_free(w.c, w.seq[1].id));
    int s4[1] = {4};
    CHECK_OK(append_ids(&w, s4, 1, &c1, g99, true));  // token 99 over token 18, in place
    CHECK(mha_paged_cache_blocks_in_use(w.c) == 4);
    CHECK_OK(mha_paged_cache_add_prompt(w.c, p8, 8, &w.seq[5].id, &cached));
    CHECKF(cached == 4, "after the rewrite: %lld cached (the rewritten block left the index)",
           (long long)cached);
    for (int64_t t = 0; t < 4; t++) mirror_put(&w.seq[5], t, p8[t], D);
    w.seq[5].len = 4;
    int s5[1] = {5};
    int64_t c4 = 4;
    const int32_t *g4[1] = {p8 + 4};
    CHECK_OK(append_ids(&w, s5, 1, &c4, g4, true));
    CHECK(mha_paged_cache_blocks_in_use(w.c) == 5);
    int live[4] = {2, 3, 4, 5};
    check_attend(&w, live, 4, 1, -1, "after a rewrite of an indexed block");
    check_attend(&w, live, 4, 2, -1, "after a rewrite of an indexed block (prefill)");
    for (int i = 0; i < 6; i++) mirror_free(&w.seq[i]);
    mha_paged_cache_destroy(w.c);
}

// Where blocks go: a sequence's next block is the one after its last when
// that is free (its blocks follow each other in memory, as a contiguous
// cache's rows; decode reads them in one pass); a sequence starting a run
// takes the middle of the longest free run, so that sequences growing in
// turns (continuous batching) each keep a run of their own; a copy on
// write takes a block of its own. Every sequence still attends as a
// contiguous cache of its tokens.
static void test_placement(void) {
    enum { BS = 4, D = 8, NB = 64 };
    world w = {.dt = MHA_KV_F32, .D = D, .bs = BS};
    CHECK_OK(paged_create(&w.c, NB, BS, HKV, D, D, MHA_KV_F32));
    for (int i = 0; i < 5; i++) mirror_init(&w.seq[i], D);
    CHECK_OK(mha_paged_cache_add(w.c, &w.seq[0].id));
    w.n = 1;
    int s0[1] = {0};
    int64_t c40 = 40;
    CHECK_OK(append_ids(&w, s0, 1, &c40, NULL, true));
    for (int64_t i = 0; i < 10; i++)
        CHECKF(mha__paged_cache_block(w.c, w.seq[0].id, i) == i,
               "the first sequence's block %lld: %lld", (long long)i,
               (long long)mha__paged_cache_block(w.c, w.seq[0].id, i));
    // three sequences growing in turns, a block each per round
    for (int i = 1; i <= 3; i++) CHECK_OK(mha_paged_cache_add(w.c, &w.seq[i].id));
    w.n = 4;
    int three[3] = {1, 2, 3};
    int64_t c4[3] = {BS, BS, BS};
    for (int r = 0; r < 8; r++) CHECK_OK(append_ids(&w, three, 3, c4, NULL, true));
    for (int i = 1; i <= 3; i++) {
        const int64_t b0 = mha__paged_cache_block(w.c, w.seq[i].id, 0);
        int runs = 1;
        for (int64_t b = 1; b < 8; b++)
            runs += mha__paged_cache_block(w.c, w.seq[i].id, b) !=
                    mha__paged_cache_block(w.c, w.seq[i].id, b - 1) + 1;
        CHECKF(runs == 1, "sequence %d (first block %lld): its 8 blocks in %d runs", i,
               (long long)b0, runs);
    }
    // a fork of the first sequence halfway into its last block writes a
    // copy of that block
    CHECK_OK(mha_paged_cache_truncate(w.c, w.seq[0].id, 38));
    w.seq[0].len = 38;
    mirror *f = &w.seq[4];
    CHECK_OK(mha_paged_cache_fork(w.c, w.seq[0].id, &f->id));
    mirror_copy(f, &w.seq[0], D);
    w.n = 5;
    int s4[1] = {4};
    int64_t c1 = 1;
    CHECK_OK(append_ids(&w, s4, 1, &c1, NULL, true));
    const int64_t cow = mha__paged_cache_block(w.c, f->id, 9);
    CHECKF(cow != 9 && cow >= 0, "the fork's copy: block %lld", (long long)cow);
    int all[5] = {0, 1, 2, 3, 4};
    check_attend(&w, all, 5, 1, -1, "placement");
    check_attend(&w, all, 5, 3, -1, "placement (prefill)");
    for (int i = 0; i < 5; i++) mirror_free(&w.seq[i]);
    mha_paged_cache_destroy(w.c);
}

// The parts of mha__paged_cache_digest, as a failure names them.
static const char *const digest_part[MHA__PAGED_DIGEST_PARTS] = {
    "the K/V bytes of a held block", "the sequences (lengths, block tables, token ids, slots)",
    "the blocks' reference counts or generations", "the prefix index",
    "the pool (free map, free count, state word)"};

// The parts of c's state that differ from the digest d0 (taken before a
// failing call), into buf ("" when none); whether any did.
static bool digest_changed(const mha_paged_cache *c, const uint64_t *d0, char *buf, size_t n) {
    uint64_t d1[MHA__PAGED_DIGEST_PARTS];
    mha__paged_cache_digest(c, d1);
    buf[0] = '\0';
    for (int p = 0; p < MHA__PAGED_DIGEST_PARTS; p++)
        if (d1[p] != d0[p]) {
            const size_t at = strlen(buf);
            snprintf(buf + at, n - at, "%s%s", at ? ", " : "", digest_part[p]);
        }
    return buf[0] != '\0';
}

// The failing calls: each fails with its status and changes nothing: the
// digest of the cache's whole state (every held block's K/V bytes, the
// block tables, the reference counts, the prefix index, the free map) the
// same after it as before; and at the end of each group the lengths,
// blocks in use and the attention's bits as before. The cache holds
// shared blocks (a fork) and indexed ones (tokens appended with their
// ids), so that a failed copy on write or index change would show.
static void test_errors(void) {
    enum { BS = 4, D = 8 };
    mha_paged_cache *c = NULL;
    CHECK(paged_create(&c, 0, BS, HKV, D, D, MHA_KV_F32) == MHA_ERR_INVALID_ARG);
    CHECK(paged_create(&c, 4, 0, HKV, D, D, MHA_KV_F32) == MHA_ERR_INVALID_ARG);
    CHECK(paged_create(&c, 4, BS, HKV, D, D, (mha_kv_dtype)9) == MHA_ERR_INVALID_ARG);
    CHECK(paged_create(NULL, 4, BS, HKV, D, D, MHA_KV_F32) == MHA_ERR_INVALID_ARG);
    CHECK_OK(paged_create(&c, 6, BS, HKV, D, D, MHA_KV_F32));
    world w = {.c = c, .dt = MHA_KV_F32, .D = D, .bs = BS};
    for (int i = 0; i < 3; i++) mirror_init(&w.seq[i], D);
    for (int i = 0; i < 2; i++) CHECK_OK(mha_paged_cache_add(c, &w.seq[i].id));
    w.n = 2;
    int sel[2] = {0, 1};
    int64_t cnt[2] = {9, 5};  // 3 + 2 blocks of 6
    CHECK_OK(append_some(&w, sel, 2, cnt));
    // sequence 2, a fork of 0: its 3 blocks held twice, the last one partial
    CHECK_OK(mha_paged_cache_fork(c, w.seq[0].id, &w.seq[2].id));
    const int64_t fork_id = w.seq[2].id;
    mirror_copy(&w.seq[2], &w.seq[0], D);
    w.n = 3;
    const int64_t used = mha_paged_cache_blocks_in_use(c);
    CHECK(used == 5);
    // the snapshot: the attention of both over their tokens
    float q[2 * H * 1 * D], before[2 * H * D], after[2 * H * D];
    for (int i = 0; i < 2 * H * D; i++) q[i] = frand();
    const int64_t sh[4] = {2, H, 1, D}, ids[2] = {w.seq[0].id, w.seq[1].id};
    mha_tensor qt = mha_tensor_contiguous(q, MHA_F32, 4, sh),
               bt = mha_tensor_contiguous(before, MHA_F32, 4, sh),
               at = mha_tensor_contiguous(after, MHA_F32, 4, sh);
    CHECK_OK(mha_paged_cache_attend(&bt, &qt, c, 2, ids, NULL, NULL));
    // call fails with status, and every part of the state is as before it
#define FAILS_UNCHANGED(call, status)                                                    \
    do {                                                                                 \
        uint64_t d0_[MHA__PAGED_DIGEST_PARTS];                                           \
        char changed_[256];                                                              \
        mha__paged_cache_digest(c, d0_);                                                 \
        const mha_status st_ = (call);                                                   \
        CHECKF(st_ == (status), "%s -> %s (want %s): %s", #call, mha_status_string(st_), \
               mha_status_string(status), mha_last_error());                             \
        CHECKF(!digest_changed(c, d0_, changed_, sizeof changed_),                       \
               "the failing %s changed %s", #call, changed_);                            \
    } while (0)
#define UNCHANGED(what)                                                                  \
    do {                                                                                 \
        CHECKF(mha_paged_cache_blocks_in_use(c) == used, "%s: blocks changed", what);    \
        CHECKF(mha_paged_cache_length(c, ids[0]) == 9 &&                                 \
                   mha_paged_cache_length(c, ids[1]) == 5,                               \
               "%s: lengths changed", what);                                             \
        CHECK_OK(mha_paged_cache_attend(&at, &qt, c, 2, ids, NULL, NULL));               \
        CHECKF(memcmp(before, after, sizeof before) == 0, "%s: contents changed", what); \
    } while (0)
    // an exhausted pool: 0 + 3 blocks needed, and a copy of sequence 0's
    // shared last block: 4 needed, 1 free; nothing appended
    cnt[0] = 3, cnt[1] = 12;
    FAILS_UNCHANGED(append_some(&w, sel, 2, cnt), MHA_ERR_NOMEM);
    CHECKF(strstr(mha_last_error(), "needs 4 blocks, 1 of 6 are free") != NULL, "message: %s",
           mha_last_error());
    // the fork alone: its last block copied and 2 more (17 tokens)
    FAILS_UNCHANGED(append_some(&w, (int[]){2}, 1, (int64_t[]){8}), MHA_ERR_NOMEM);
    CHECKF(strstr(mha_last_error(), "needs 3 blocks, 1 of 6 are free") != NULL, "message: %s",
           mha_last_error());
    // without token ids
    FAILS_UNCHANGED(append_ids(&w, sel, 2, cnt, NULL, false), MHA_ERR_NOMEM);
    UNCHANGED("exhausted pool");
    // the same id twice, an unknown id, a freed id, bad counts, shapes
    int64_t dup[2] = {ids[0], ids[0]}, one = 1, bad = -1;
    float kv[2 * HKV * 1 * D] = {0};
    mha_tensor k2 = mha_tensor_contiguous(kv, MHA_F32, 4, (int64_t[]){2, HKV, 1, D}),
               k1 = mha_tensor_contiguous(kv, MHA_F32, 4, (int64_t[]){1, HKV, 1, D}),
               kbad = mha_tensor_contiguous(kv, MHA_F32, 4, (int64_t[]){1, HKV, 1, D - 1});
    FAILS_UNCHANGED(mha_paged_cache_append(c, 2, dup, NULL, &k2, &k2, NULL),
                    MHA_ERR_INVALID_ARG);
    UNCHANGED("an id twice");
    int64_t unknown = 12345;
    FAILS_UNCHANGED(mha_paged_cache_append(c, 1, &unknown, NULL, &k1, &k1, NULL),
                    MHA_ERR_INVALID_ARG);
    FAILS_UNCHANGED(mha_paged_cache_append(c, 1, &bad, NULL, &k1, &k1, NULL),
                    MHA_ERR_INVALID_ARG);
    FAILS_UNCHANGED(mha_paged_cache_append(c, 1, ids, (int64_t[]){2}, &k1, &k1, NULL),
                    MHA_ERR_INVALID_ARG);
    FAILS_UNCHANGED(mha_paged_cache_append(c, 1, ids, &one, &kbad, &k1, NULL), MHA_ERR_SHAPE);
    FAILS_UNCHANGED(mha_paged_cache_append(c, 2, ids, NULL, &k1, &k1, NULL), MHA_ERR_SHAPE);
    FAILS_UNCHANGED(mha_paged_cache_append(c, 0, ids, NULL, &k1, &k1, NULL),
                    MHA_ERR_INVALID_ARG);
    UNCHANGED("bad appends");
    FAILS_UNCHANGED(mha_paged_cache_truncate(c, ids[0], 10), MHA_ERR_INVALID_ARG);
    FAILS_UNCHANGED(mha_paged_cache_truncate(c, ids[0], -1), MHA_ERR_INVALID_ARG);
    FAILS_UNCHANGED(mha_paged_cache_truncate(c, unknown, 0), MHA_ERR_INVALID_ARG);
    FAILS_UNCHANGED(mha_paged_cache_fork(c, unknown, &one), MHA_ERR_INVALID_ARG);
    FAILS_UNCHANGED(mha_paged_cache_free(c, unknown), MHA_ERR_INVALID_ARG);
    UNCHANGED("bad truncate, fork, free");
    // bad releases and prompts; then, the fork's first block released,
    // the calls that would reach into the released tokens
    FAILS_UNCHANGED(mha_paged_cache_release(c, ids[0], -1, 4), MHA_ERR_INVALID_ARG);
    FAILS_UNCHANGED(mha_paged_cache_release(c, ids[0], 0, 10), MHA_ERR_INVALID_ARG);
    FAILS_UNCHANGED(mha_paged_cache_release(c, unknown, 0, 0), MHA_ERR_INVALID_ARG);
    int64_t pid, cached;
    FAILS_UNCHANGED(mha_paged_cache_add_prompt(c, NULL, 3, &pid, &cached), MHA_ERR_INVALID_ARG);
    FAILS_UNCHANGED(mha_paged_cache_add_prompt(c, w.seq[0].tok, -1, &pid, &cached),
                    MHA_ERR_INVALID_ARG);
    CHECK_OK(mha_paged_cache_release(c, fork_id, 0, BS));
    FAILS_UNCHANGED(mha_paged_cache_truncate(c, fork_id, 2), MHA_ERR_INVALID_ARG);
    FAILS_UNCHANGED(mha_paged_cache_release(c, fork_id, 1, 2 * BS), MHA_ERR_INVALID_ARG);
    float o1[H * D];
    mha_tensor q1 = mha_tensor_contiguous(q, MHA_F32, 4, (int64_t[]){1, H, 1, D}),
               o1t = mha_tensor_contiguous(o1, MHA_F32, 4, (int64_t[]){1, H, 1, D});
    FAILS_UNCHANGED(mha_paged_cache_attend(&o1t, &q1, c, 1, &fork_id, NULL, NULL),
                    MHA_ERR_INVALID_ARG);
    UNCHANGED("bad releases and prompts, released tokens");
    // a freed id stays unknown, also once its slot is reused
    int64_t tmp, again;
    CHECK_OK(mha_paged_cache_add(c, &tmp));
    CHECK_OK(mha_paged_cache_free(c, tmp));
    FAILS_UNCHANGED(mha_paged_cache_free(c, tmp), MHA_ERR_INVALID_ARG);
    FAILS_UNCHANGED(mha_paged_cache_fork(c, tmp, &again), MHA_ERR_INVALID_ARG);
    CHECK_OK(mha_paged_cache_add(c, &again));
    CHECK(again != tmp && mha_paged_cache_length(c, tmp) == -1 &&
          mha_paged_cache_length(c, again) == 0);
    FAILS_UNCHANGED(mha_paged_cache_attend(&at, &qt, c, 2, (int64_t[]){ids[0], tmp}, NULL, NULL),
                    MHA_ERR_INVALID_ARG);
    CHECK_OK(mha_paged_cache_free(c, again));
    UNCHANGED("freed ids");
#undef UNCHANGED
#undef FAILS_UNCHANGED
    for (int i = 0; i < 3; i++) mirror_free(&w.seq[i]);
    mha_paged_cache_destroy(c);
    CHECK(mha_paged_cache_length(NULL, 0) == -1 && mha_paged_cache_blocks_in_use(NULL) == -1);
}

// test_threads: one forced overlap of two calls. The holder's call, inside
// the cache (the hook, mha__paged_cache_set_hook, called while the call
// holds the state word), says so (inside) and waits until the other
// thread's call has returned (go); the other thread starts its call only
// once the holder is inside, or has returned (done: no hook, no overlap).
typedef struct overlap {
    atomic_int inside, go, done;
    const char *where;  // the call the hook held
} overlap;

static _Thread_local overlap *t_hold;  // this thread's next call holds on it
static atomic_int g_stuck;             // waits that ran over a minute

// Until *a >= v or, b given, *b is set; false (and g_stuck counted) after a
// minute: a deadlock fails the test rather than hang it.
static bool wait_for(atomic_int *a, int v, atomic_int *b) {
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (unsigned i = 1;; i++) {
        if (atomic_load(a) >= v || (b && atomic_load(b))) return true;
        sched_yield();
        if (i % 4096 == 0) {
            clock_gettime(CLOCK_MONOTONIC, &t);
            if (t.tv_sec - t0.tv_sec > 60) {
                atomic_fetch_add(&g_stuck, 1);
                return false;
            }
        }
    }
}

static void hold_hook(void *user, const char *what) {
    (void)user;
    overlap *o = t_hold;
    if (!o) return;  // (not this thread's held call, or the call it holds beside)
    t_hold = NULL;
    o->where = what;
    atomic_store(&o->inside, 1);
    wait_for(&o->go, 1, NULL);
}

// The calls of test_threads: thread 0 attends sequence 0 or appends a token
// to sequence 2; thread 1 attends sequence 0 or appends to sequence 1.
enum { T_ATTEND, T_APPEND };
enum { T_OK, T_REFUSED, T_BAD };

// The forced overlaps of a round: which thread holds its call open, each
// thread's call, and whether the other's is refused (a change beside
// anything) or runs (an attend beside an attend).
static const struct {
    int holder, call[2];
    bool refused;
    const char *what;
} t_forced[] = {
    {0, {T_ATTEND, T_APPEND}, true, "an append while an attend runs"},
    {1, {T_ATTEND, T_APPEND}, true, "an attend while an append runs"},
    {0, {T_APPEND, T_APPEND}, true, "an append while another append runs"},
    {1, {T_APPEND, T_APPEND}, true, "an append while another append runs (the other way)"},
    {1, {T_ATTEND, T_ATTEND}, false, "an attend while an attend runs"},
};
enum { T_NFORCED = sizeof t_forced / sizeof t_forced[0], T_ROUNDS = 60, T_D = 16 };

typedef struct threads_ctx {
    mha_paged_cache *c;
    int64_t ids[3];
    const mha_tensor *t1, *qt;
    const float *o0;
    overlap ov[T_ROUNDS][T_NFORCED];
    atomic_int bar[T_ROUNDS];  // the free-running calls of a round returned
} threads_ctx;

typedef struct threads_arg {
    threads_ctx *x;
    int me;
    // what this thread saw: per forced overlap, its calls' outcomes as
    // holder ([0]) and as the other ([1]); the free-running calls'; the
    // appends that landed; results whose bits differed
    int forced[T_NFORCED][2][3], free_run[3], landed, diff;
} threads_arg;

static int threads_call(threads_arg *a, int call) {
    const threads_ctx *x = a->x;
    if (call == T_ATTEND) {
        float o[H * T_D];
        mha_tensor ot = mha_tensor_contiguous(o, MHA_F32, 4, (int64_t[]){1, H, 1, T_D});
        const mha_status st = mha_paged_cache_attend(&ot, x->qt, x->c, 1, x->ids, NULL, NULL);
        if (st == MHA_OK) {
            a->diff += memcmp(o, x->o0, sizeof o) != 0;
            return T_OK;
        }
        return strstr(mha_last_error(), "being changed") ? T_REFUSED : T_BAD;
    }
    const mha_status st = mha_paged_cache_append(x->c, 1, &x->ids[a->me ? 1 : 2], NULL, x->t1,
                                                 x->t1, NULL);
    if (st == MHA_OK) {
        a->landed++;
        return T_OK;
    }
    return strstr(mha_last_error(), "in use") ? T_REFUSED : T_BAD;
}

static void *threads_run(void *arg) {
    threads_arg *a = arg;
    threads_ctx *x = a->x;
    for (int r = 0; r < T_ROUNDS; r++) {
        for (int p = 0; p < T_NFORCED; p++) {
            overlap *o = &x->ov[r][p];
            const int call = t_forced[p].call[a->me];
            if (t_forced[p].holder == a->me) {
                t_hold = o;
                a->forced[p][0][threads_call(a, call)]++;
                t_hold = NULL;  // (a call that did not reach the hook)
                atomic_store(&o->done, 1);
                wait_for(&o->go, 1, NULL);
            } else {
                wait_for(&o->inside, 1, &o->done);
                a->forced[p][1][threads_call(a, call)]++;
                atomic_store(&o->go, 1);
                wait_for(&o->done, 1, NULL);
            }
        }
        // free-running: thread 0 attends while thread 1 appends, nothing
        // forced (whatever overlaps by chance, the same rules); then both
        // wait until both calls returned
        a->free_run[threads_call(a, a->me ? T_APPEND : T_ATTEND)]++;
        atomic_fetch_add(&x->bar[r], 1);
        wait_for(&x->bar[r], 2, NULL);
    }
    return NULL;
}

// Two threads call into one cache at once, each pair of calls overlapping
// for certain: the cache's hook holds one call open (the state word held)
// while the other thread's call runs. A change beside any call is refused
// with the in-use message and changes nothing; an attend beside an attend
// runs; every attend of sequence 0 gives the same bits. Each round, the
// forced overlaps (t_forced), then one unforced pair (an attend and an
// append, overlapping or not). At the end each sequence holds exactly the
// tokens of the appends that landed for it. Always two threads (POSIX
// threads; the attends may use OpenMP inside): the counts the same on
// every machine.
static void test_threads(void) {
    enum { BS = 8, D = T_D };
    mha_paged_cache *c = NULL;
    CHECK_OK(paged_create(&c, 200, BS, HKV, D, D, MHA_KV_F32));
    threads_ctx *x = calloc(1, sizeof *x);
    x->c = c;
    for (int i = 0; i < 3; i++) CHECK_OK(mha_paged_cache_add(c, &x->ids[i]));
    for (int r = 0; r < T_ROUNDS; r++) {
        atomic_init(&x->bar[r], 0);
        for (int p = 0; p < T_NFORCED; p++) {
            atomic_init(&x->ov[r][p].inside, 0);
            atomic_init(&x->ov[r][p].go, 0);
            atomic_init(&x->ov[r][p].done, 0);
        }
    }
    float kv[HKV * 40 * D];
    for (int i = 0; i < HKV * 40 * D; i++) kv[i] = frand();
    mha_tensor t40 = mha_tensor_contiguous(kv, MHA_F32, 4, (int64_t[]){1, HKV, 40, D}),
               t1 = mha_tensor_contiguous(kv, MHA_F32, 4, (int64_t[]){1, HKV, 1, D});
    CHECK_OK(mha_paged_cache_append(c, 1, x->ids, NULL, &t40, &t40, NULL));
    float q[H * D], o0[H * D];
    for (int i = 0; i < H * D; i++) q[i] = frand();
    mha_tensor qt = mha_tensor_contiguous(q, MHA_F32, 4, (int64_t[]){1, H, 1, D}),
               ot = mha_tensor_contiguous(o0, MHA_F32, 4, (int64_t[]){1, H, 1, D});
    CHECK_OK(mha_paged_cache_attend(&ot, &qt, c, 1, x->ids, NULL, NULL));
    x->t1 = &t1, x->qt = &qt, x->o0 = o0;
    threads_arg arg[2] = {{.x = x, .me = 0}, {.x = x, .me = 1}};
    pthread_t th[2];
    atomic_store(&g_stuck, 0);
    mha__paged_cache_set_hook(c, hold_hook, NULL);
    bool started[2];
    for (int t = 0; t < 2; t++)
        started[t] = pthread_create(&th[t], NULL, threads_run, &arg[t]) == 0;
    CHECK(started[0] && started[1]);
    for (int t = 0; t < 2; t++)
        if (started[t]) CHECK(pthread_join(th[t], NULL) == 0);
    mha__paged_cache_set_hook(c, NULL, NULL);
    CHECKF(atomic_load(&g_stuck) == 0,
           "threads: %d waits for the other thread ran over a minute", atomic_load(&g_stuck));
    // every forced overlap, every round: the holder's call ran (held inside
    // the cache by the hook, in the call it names), the other's was refused
    // or ran as the table says
    static const char *const name[2] = {"mha_paged_cache_attend", "mha_paged_cache_append"};
    int refused = 0, beside = 0, bad = 0, diff = arg[0].diff + arg[1].diff;
    for (int p = 0; p < T_NFORCED; p++) {
        const threads_arg *h = &arg[t_forced[p].holder], *o = &arg[1 - t_forced[p].holder];
        const int want = t_forced[p].refused ? T_REFUSED : T_OK;
        int inside = 0;
        for (int r = 0; r < T_ROUNDS; r++)
            inside += x->ov[r][p].where &&
                      strcmp(x->ov[r][p].where, name[t_forced[p].call[t_forced[p].holder]]) ==
                          0;
        CHECKF(h->forced[p][0][T_OK] == T_ROUNDS && inside == T_ROUNDS,
               "threads: %s: the held call ran %d times of %d, was held inside the cache %d "
               "times",
               t_forced[p].what, h->forced[p][0][T_OK], T_ROUNDS, inside);
        CHECKF(o->forced[p][1][want] == T_ROUNDS,
               "threads: %s: %d of %d calls %s, %d ran, %d refused (the overlap did not happen)",
               t_forced[p].what, o->forced[p][1][want], T_ROUNDS,
               want == T_REFUSED ? "refused" : "ran beside it", o->forced[p][1][T_OK],
               o->forced[p][1][T_REFUSED]);
        refused += o->forced[p][1][T_REFUSED];
        beside += t_forced[p].refused ? 0 : o->forced[p][1][T_OK];
        bad += h->forced[p][0][T_BAD] + o->forced[p][1][T_BAD];
    }
    bad += arg[0].free_run[T_BAD] + arg[1].free_run[T_BAD];
    CHECKF(bad == 0 && diff == 0, "threads: %d unexpected errors, %d differing results", bad,
           diff);
    // both kinds of outcome happened (the overlap, for certain), and each
    // sequence holds exactly the appends that landed for it
    const int landed = arg[0].landed + arg[1].landed;
    CHECKF(refused > 0 && landed > 0, "threads: %d calls refused, %d appends landed", refused,
           landed);
    const int64_t len[3] = {mha_paged_cache_length(c, x->ids[0]),
                            mha_paged_cache_length(c, x->ids[1]),
                            mha_paged_cache_length(c, x->ids[2])};
    CHECKF(len[0] == 40 && len[1] == arg[1].landed && len[2] == arg[0].landed,
           "threads: sequences of %lld, %lld, %lld tokens; 40, %d and %d appends landed",
           (long long)len[0], (long long)len[1], (long long)len[2], arg[1].landed,
           arg[0].landed);
    const int free_landed = arg[1].free_run[T_OK],
              free_refused = arg[0].free_run[T_REFUSED] + arg[1].free_run[T_REFUSED];
    printf("two threads, %d rounds: forced overlaps: %d calls refused, %d appends landed, %d "
           "attends beside an attend; free-running: %d appends landed, %d calls refused; "
           "sequences 1 and 2 hold %lld and %lld tokens\n",
           T_ROUNDS, refused, landed - free_landed, beside, free_landed, free_refused,
           (long long)len[1], (long long)len[2]);
    free(x);
    mha_paged_cache_destroy(c);
}

// The forward arguments of test_forward_paged: self-attention of x, left
// window win (-1: none), RoPE (neox); causal for the full forward.
static mha_forward_args rope_args(const mha_tensor *x, int64_t win, bool causal) {
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = x;
    a.opts.is_causal = causal;
    a.opts.window_left = win;
    mha_rope_init(&a.rope, MHA_ROPE_NEOX);
    return a;
}

// mha_forward_paged: continuous batching. NS sequences of their own lengths
// (a module with GQA and RoPE; a window in one round) get their tokens in
// chunks, each call a mix of sequences and chunk sizes (prefill chunks of
// up to 30 tokens next to decode steps of 1), padded to the call's longest;
// every sequence's outputs must be its full causal forward's (2e-5), and
// the padding rows 0. Then calls where every sequence takes the same count
// give exactly the bits of mha_forward_cached over a contiguous cache fed
// the same chunks. An exhausted pool changes no sequence.
static void test_forward_paged(void) {
    enum { E = 32, NH = 4, NKV = 2, NS = 5, TMAX = 90 };
    const int64_t d = E / NH;
    mha_config cfg;
    mha_config_init(&cfg, E, NH);
    cfg.num_kv_heads = NKV;
    cfg.batch_first = true;
    mha_module *m = torch_module(&cfg, 3);
    for (int round = 0; round < 2; round++) {
        const int64_t win = round ? 12 : -1;
        int64_t len[NS];
        float *x[NS], *yf[NS], *yp[NS];
        for (int i = 0; i < NS; i++) {
            len[i] = irand(20, TMAX);
            x[i] = malloc(sizeof(float) * (size_t)(len[i] * E));
            yf[i] = malloc(sizeof(float) * (size_t)(len[i] * E));
            yp[i] = malloc(sizeof(float) * (size_t)(len[i] * E));
            for (int64_t j = 0; j < len[i] * E; j++) x[i][j] = frand();
            mha_tensor xt = mha_tensor_contiguous(x[i], MHA_F32, 3, (int64_t[]){1, len[i], E}),
                       yt = mha_tensor_contiguous(yf[i], MHA_F32, 3, (int64_t[]){1, len[i], E});
            const mha_forward_args a = rope_args(&xt, win, true);
            CHECK_OK(mha_forward(&yt, NULL, m, &a));
        }
        mha_paged_cache *pc = NULL;
        CHECK_OK(paged_create(&pc, 200, 8, NKV, d, d, MHA_KV_F32));
        int64_t ids[NS], done[NS] = {0};
        for (int i = 0; i < NS; i++) CHECK_OK(mha_paged_cache_add(pc, &ids[i]));
        int calls = 0, mixed = 0;
        for (;;) {
            int64_t cid[NS], cnt[NS], T = 0;
            int sel[NS], n = 0;
            for (int i = 0; i < NS; i++)
                if (done[i] < len[i] && next() % 3) {
                    const int64_t left = len[i] - done[i];
                    const int64_t k = next() % 2 ? 1 : irand(1, left < 30 ? left : 30);
                    sel[n] = i, cid[n] = ids[i], cnt[n] = k < left ? k : left;
                    T = cnt[n] > T ? cnt[n] : T;
                    n++;
                }
            if (n == 0) {
                bool all = true;
                for (int i = 0; i < NS; i++) all = all && done[i] == len[i];
                if (all) break;
                continue;
            }
            float *xb = calloc((size_t)(n * T * E), sizeof(float)),
                  *yb = malloc(sizeof(float) * (size_t)(n * T * E));
            for (size_t j = 0; j < (size_t)(n * T * E); j++) yb[j] = 9.0f;
            for (int j = 0; j < n; j++)
                memcpy(xb + (size_t)(j * T * E), x[sel[j]] + done[sel[j]] * E,
                       sizeof(float) * (size_t)(cnt[j] * E));
            mha_tensor xt = mha_tensor_contiguous(xb, MHA_F32, 3, (int64_t[]){n, T, E}),
                       yt = mha_tensor_contiguous(yb, MHA_F32, 3, (int64_t[]){n, T, E});
            const mha_forward_args a = rope_args(&xt, win, false);
            CHECK_OK(mha_forward_paged(&yt, m, &a, pc, cid, cnt, NULL));
            bool pad_zero = true, mix = false;
            for (int j = 0; j < n; j++) {
                memcpy(yp[sel[j]] + done[sel[j]] * E, yb + (size_t)(j * T * E),
                       sizeof(float) * (size_t)(cnt[j] * E));
                for (int64_t e = cnt[j] * E; e < T * E; e++)
                    pad_zero = pad_zero && yb[(size_t)(j * T * E + e)] == 0.0f;
                done[sel[j]] += cnt[j];
                mix = mix || cnt[j] != cnt[0];
            }
            CHECKF(pad_zero, "forward_paged: padding rows not 0");
            calls++, mixed += mix;
            free(xb), free(yb);
        }
        for (int i = 0; i < NS; i++) {
            CHECK(mha_paged_cache_length(pc, ids[i]) == len[i]);
            const double e = rel_err(yf[i], yp[i], len[i] * E);
            CHECKF(e <= 2e-5,
                   "forward_paged window %lld: sequence %d (%lld tokens): rel err %g",
                   (long long)win, i, (long long)len[i], e);
        }
        printf("forward_paged (window %lld): %d calls, %d of them mixing chunk sizes\n",
               (long long)win, calls, mixed);
        // an exhausted pool: a call that needs more blocks than are free
        {
            const int64_t free0 = mha_paged_cache_blocks_free(pc), big = 8 * free0 + 8;
            float *xb = calloc((size_t)(big * E), sizeof(float)),
                  *yb = calloc((size_t)(big * E), sizeof(float));
            mha_tensor xt = mha_tensor_contiguous(xb, MHA_F32, 3, (int64_t[]){1, big, E}),
                       yt = mha_tensor_contiguous(yb, MHA_F32, 3, (int64_t[]){1, big, E});
            mha_forward_args a;
            mha_forward_args_init(&a);
            a.query = a.key = a.value = &xt;
            CHECK(mha_forward_paged(&yt, m, &a, pc, ids, NULL, NULL) == MHA_ERR_NOMEM);
            CHECK(mha_paged_cache_length(pc, ids[0]) == len[0] &&
                  mha_paged_cache_blocks_free(pc) == free0);
            free(xb), free(yb);
        }
        // equal counts per call: the contiguous cache's bits
        {
            mha_paged_cache *p2 = NULL;
            mha_kv_cache *kc = NULL;
            const int64_t L = 40;
            CHECK_OK(paged_create(&p2, 64, 8, NKV, d, d, MHA_KV_F32));
            CHECK_OK(mha_kv_cache_create(&kc, 2, NKV, d, d, L, MHA_KV_F32));
            int64_t id2[2];
            CHECK_OK(mha_paged_cache_add(p2, &id2[0]));
            CHECK_OK(mha_paged_cache_add(p2, &id2[1]));
            float *xb = malloc(sizeof(float) * 2 * L * E),
                  *y1 = malloc(sizeof(float) * 2 * L * E),
                  *y2 = malloc(sizeof(float) * 2 * L * E);
            for (int64_t j = 0; j < 2 * L * E; j++) xb[j] = frand();
            const int64_t chunks[] = {17, 1, 5, 1, 1, 15};  // prefill, decode, small chunks
            float *xc = malloc(sizeof(float) * 2 * 17 * E);
            for (int64_t c0 = 0, ci = 0; c0 < L && ci < 6; c0 += chunks[ci], ci++) {
                const int64_t k = chunks[ci] < L - c0 ? chunks[ci] : L - c0;
                for (int b = 0; b < 2; b++)
                    memcpy(xc + b * k * E, xb + (b * L + c0) * E,
                           sizeof(float) * (size_t)(k * E));
                mha_tensor xt = mha_tensor_contiguous(xc, MHA_F32, 3, (int64_t[]){2, k, E});
                float o1[2 * 17 * E], o2[2 * 17 * E];
                mha_tensor t1 = mha_tensor_contiguous(o1, MHA_F32, 3, (int64_t[]){2, k, E}),
                           t2 = mha_tensor_contiguous(o2, MHA_F32, 3, (int64_t[]){2, k, E});
                const mha_forward_args a = rope_args(&xt, win, false);
                CHECK_OK(mha_forward_cached(&t1, m, &a, kc));
                CHECK_OK(mha_forward_paged(&t2, m, &a, p2, id2, NULL, NULL));
                CHECKF(memcmp(o1, o2, sizeof(float) * (size_t)(2 * k * E)) == 0,
                       "forward_paged chunk %lld (%lld tokens): not the contiguous cache's bits",
                       (long long)ci, (long long)k);
            }
            free(xb), free(y1), free(y2), free(xc);
            mha_kv_cache_destroy(kc);
            mha_paged_cache_destroy(p2);
        }
        for (int i = 0; i < NS; i++) free(x[i]), free(yf[i]), free(yp[i]);
        mha_paged_cache_destroy(pc);
    }
    mha_module_destroy(m);
}

// A sliding window (left 20) with bounded memory: two sequences (one a
// fork) decode 300 tokens each, releasing after every step the blocks
// their window can no longer reach: at most 4 blocks each; every step's
// attention the contiguous cache's bits (same window). Reaching back past
// the released tokens fails and changes nothing.
static void test_window_release(void) {
    enum { BS = 8, D = 16, W = 20, STEPS = 300 };
    world w = {.dt = MHA_KV_BF16, .D = D, .bs = BS};
    CHECK_OK(paged_create(&w.c, 64, BS, HKV, D, D, MHA_KV_BF16));
    mirror_init(&w.seq[0], D);
    CHECK_OK(mha_paged_cache_add(w.c, &w.seq[0].id));
    w.n = 1;
    int s0[1] = {0}, both[2] = {0, 1};
    int64_t c30 = 30, one[2] = {1, 1};
    CHECK_OK(append_some(&w, s0, 1, &c30));
    mirror_init(&w.seq[1], D);
    CHECK_OK(mha_paged_cache_fork(w.c, w.seq[0].id, &w.seq[1].id));
    mirror_copy(&w.seq[1], &w.seq[0], D);
    w.n = 2;
    int64_t most = 0;
    for (int step = 0; step < STEPS && w.seq[0].len < CAPL; step++) {
        CHECK_OK(append_some(&w, both, 2, one));
        for (int i = 0; i < 2; i++)
            CHECK_OK(mha_paged_cache_release(w.c, w.seq[i].id, 0, w.seq[i].len - W - 1));
        const int64_t used = mha_paged_cache_blocks_in_use(w.c);
        most = used > most ? used : most;
        if (step % 7 == 0) check_attend(&w, both, 2, 1, W, "sliding window");
        if (step % 50 == 49) {  // the prefill path (more than 16 queries), one of them real
            g_count = 1;
            check_attend(&w, both, 2, 20, W, "sliding window, prefill path");
            g_count = 0;
        }
    }
    CHECKF(most <= 2 * ((W + 1 + BS - 1) / BS + 1), "sliding window: %lld blocks at most",
           (long long)most);
    printf("sliding window %d over %d tokens: at most %lld blocks in use for 2 sequences\n", W,
           STEPS, (long long)most);
    // reaching back past the released tokens: refused, nothing changes
    const int64_t ids[1] = {w.seq[0].id}, len0 = w.seq[0].len,
                  used = mha_paged_cache_blocks_in_use(w.c);
    float q[H * D], o[H * D];
    for (int i = 0; i < H * D; i++) q[i] = frand();
    mha_tensor qt = mha_tensor_contiguous(q, MHA_F32, 4, (int64_t[]){1, H, 1, D}),
               ot = mha_tensor_contiguous(o, MHA_F32, 4, (int64_t[]){1, H, 1, D});
    mha_cache_attend_args a;
    mha_cache_attend_args_init(&a);
    CHECK(mha_paged_cache_attend(&ot, &qt, w.c, 1, ids, NULL, &a) == MHA_ERR_INVALID_ARG);
    CHECKF(strstr(mha_last_error(), "released its tokens 0 to") != NULL, "message: %s",
           mha_last_error());
    a.opts.window_left = W + 20;
    CHECK(mha_paged_cache_attend(&ot, &qt, w.c, 1, ids, NULL, &a) == MHA_ERR_INVALID_ARG);
    a.opts.window_left = W;
    CHECK_OK(mha_paged_cache_attend(&ot, &qt, w.c, 1, ids, NULL, &a));
    CHECK(mha_paged_cache_truncate(w.c, ids[0], 5) == MHA_ERR_INVALID_ARG);
    CHECK(mha_paged_cache_release(w.c, ids[0], 0, len0 + 1) == MHA_ERR_INVALID_ARG);
    CHECK(mha_paged_cache_length(w.c, ids[0]) == len0 &&
          mha_paged_cache_blocks_in_use(w.c) == used);
    CHECK_OK(mha_paged_cache_truncate(w.c, ids[0], 0));  // to 0: starts again
    CHECK(mha_paged_cache_length(w.c, ids[0]) == 0);
    w.seq[0].len = 0;
    int64_t c5 = 5;
    CHECK_OK(append_some(&w, s0, 1, &c5));
    check_attend(&w, s0, 1, 2, -1, "after a release and a truncation to 0");
    for (int i = 0; i < 2; i++) mirror_free(&w.seq[i]);
    mha_paged_cache_destroy(w.c);
}

// Prefix sharing through the module: sequence A's prompt (ids and hidden
// states) goes through mha_forward_paged; B starts with the same
// prompt + 5 tokens of its own via mha_paged_cache_add_prompt, takes A's
// blocks for the first 96 tokens and computes only the rest: its outputs
// equal the full causal forward of its whole input.
static void test_forward_prefix(void) {
    enum { E = 32, NH = 4, NKV = 2, P = 100, EXTRA = 5, BS = 16 };
    mha_config cfg;
    mha_config_init(&cfg, E, NH);
    cfg.num_kv_heads = NKV;
    cfg.batch_first = true;
    mha_module *m = torch_module(&cfg, 4);
    static float x[(P + EXTRA) * E], yf[(P + EXTRA) * E], yb[(P + EXTRA) * E];
    int32_t tok[P + EXTRA];
    for (int i = 0; i < (P + EXTRA) * E; i++) x[i] = frand();
    for (int t = 0; t < P + EXTRA; t++) tok[t] = (int32_t)irand(0, 1000);
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){1, P + EXTRA, E}),
               yt = mha_tensor_contiguous(yf, MHA_F32, 3, (int64_t[]){1, P + EXTRA, E});
    const mha_forward_args af = rope_args(&xt, -1, true);
    CHECK_OK(mha_forward(&yt, NULL, m, &af));
    mha_paged_cache *c = NULL;
    CHECK_OK(paged_create(&c, 32, BS, NKV, E / NH, E / NH, MHA_KV_F32));
    int64_t a, b, cached;
    CHECK_OK(mha_paged_cache_add(c, &a));
    mha_tensor xa = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){1, P, E}),
               ya = mha_tensor_contiguous(yb, MHA_F32, 3, (int64_t[]){1, P, E});
    const mha_forward_args aa = rope_args(&xa, -1, false);
    CHECK_OK(mha_forward_paged(&ya, m, &aa, c, &a, NULL, tok));
    const int64_t used = mha_paged_cache_blocks_in_use(c);
    CHECK_OK(mha_paged_cache_add_prompt(c, tok, P + EXTRA, &b, &cached));
    CHECKF(cached == P / BS * BS, "module prefix: %lld cached", (long long)cached);
    CHECK(mha_paged_cache_blocks_in_use(c) == used);
    const int64_t rest = P + EXTRA - cached;
    mha_tensor xr = mha_tensor_contiguous(x + cached * E, MHA_F32, 3, (int64_t[]){1, rest, E}),
               yr = mha_tensor_contiguous(yb + cached * E, MHA_F32, 3, (int64_t[]){1, rest, E});
    const mha_forward_args ar = rope_args(&xr, -1, false);
    CHECK_OK(mha_forward_paged(&yr, m, &ar, c, &b, NULL, tok + cached));
    const double e = rel_err(yf + cached * E, yb + cached * E, rest * E);
    CHECKF(e <= 2e-5, "module prefix: rel err %g", e);
    CHECK(mha_paged_cache_length(c, b) == P + EXTRA);
    // a prompt that the blocks hold whole (P / BS of them): its last token
    // computed (its output), its row kept, no block taken
    enum { W = P / BS * BS };
    int64_t d;
    const int64_t used2 = mha_paged_cache_blocks_in_use(c);
    CHECK_OK(mha_paged_cache_add_prompt(c, tok, W, &d, &cached));
    CHECKF(cached == W - 1, "module prefix, whole: %lld cached", (long long)cached);
    float y1[E];
    mha_tensor x1 = mha_tensor_contiguous(x + (W - 1) * E, MHA_F32, 3, (int64_t[]){1, 1, E}),
               y1t = mha_tensor_contiguous(y1, MHA_F32, 3, (int64_t[]){1, 1, E});
    const mha_forward_args a1 = rope_args(&x1, -1, false);
    CHECK_OK(mha_forward_paged(&y1t, m, &a1, c, &d, NULL, tok + W - 1));
    const double e1 = rel_err(yf + (W - 1) * E, y1, E);
    CHECKF(e1 <= 2e-5, "module prefix, whole: rel err %g", e1);
    CHECK(mha_paged_cache_blocks_in_use(c) == used2);
    CHECK(mha_paged_cache_length(c, d) == W);
    mha_paged_cache_destroy(c);
    mha_module_destroy(m);
}

// Self-attention of x with RoPE (neox; variant 0) or ALiBi (1).
static mha_forward_args position_args(const mha_tensor *x, int variant) {
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = x;
    if (variant == 0) mha_rope_init(&a.rope, MHA_ROPE_NEOX);
    else a.opts.alibi = true;
    return a;
}

// StreamingLLM (Xiao et al., "Efficient Streaming Language Models with
// Attention Sinks"): K sinks + a window of W through mha_forward_paged with
// opts.sink_tokens, the blocks between them released after every call
// (mha_paged_cache_release). Memory stays bounded, and every token's
// output is the paper's: the reference path's causal forward over the
// cache the paper would hold for it (the sinks' hidden states, then the
// window's) at positions 0.. within that cache, its last row. RoPE (neox:
// the keys re-rotated at their cache positions) and ALiBi (the distances
// within the cache), GQA; decode steps, small chunks and chunks of more
// than 16 (the prefill path).
static void test_streaming(void) {
    enum { E = 32, NH = 4, NKV = 2, K = 4, W = 20, BS = 8, L = 170 };
    for (int variant = 0; variant < 2; variant++) {
        mha_config cfg;
        mha_config_init(&cfg, E, NH);
        cfg.num_kv_heads = NKV;
        cfg.batch_first = true;
        mha_module *m = torch_module(&cfg, 5 + (uint64_t)variant);
        float *x = malloc(sizeof(float) * L * E), *yp = malloc(sizeof(float) * L * E),
              *yo = malloc(sizeof(float) * L * E), *xs = malloc(sizeof(float) * L * E),
              *ys = malloc(sizeof(float) * L * E);
        for (int64_t j = 0; j < L * E; j++) x[j] = frand();
        mha_paged_cache *pc = NULL;
        CHECK_OK(paged_create(&pc, 64, BS, NKV, E / NH, E / NH, MHA_KV_F32));
        int64_t id, done = 0, most = 0, calls = 0;
        CHECK_OK(mha_paged_cache_add(pc, &id));
        while (done < L) {
            int64_t cnt = calls % 9 == 4 ? 18 : next() % 3 ? 1 : irand(2, 6);
            if (cnt > L - done) cnt = L - done;
            mha_tensor xt = mha_tensor_contiguous(x + done * E, MHA_F32, 3,
                                                  (int64_t[]){1, cnt, E}),
                       yt = mha_tensor_contiguous(yp + done * E, MHA_F32, 3,
                                                  (int64_t[]){1, cnt, E});
            mha_forward_args a = position_args(&xt, variant);
            a.opts.window_left = W;
            a.opts.sink_tokens = K;
            CHECK_OK(mha_forward_paged(&yt, m, &a, pc, &id, NULL, NULL));
            done += cnt, calls++;
            if (done - W > 0) CHECK_OK(mha_paged_cache_release(pc, id, K, done - W));
            const int64_t used = mha_paged_cache_blocks_in_use(pc);
            most = used > most ? used : most;
        }
        // the paper's cache for each token p: sinks [0, min(K, p - W)), then
        // the window [max(0, p - W), p], at positions 0..n-1
        for (int64_t p = 0; p < L; p++) {
            int64_t n = 0;
            for (int64_t j = 0; j < K && j < p - W; j++)
                memcpy(xs + n++ * E, x + j * E, sizeof(float) * E);
            for (int64_t j = p - W > 0 ? p - W : 0; j <= p; j++)
                memcpy(xs + n++ * E, x + j * E, sizeof(float) * E);
            mha_tensor st = mha_tensor_contiguous(xs, MHA_F32, 3, (int64_t[]){1, n, E}),
                       yt = mha_tensor_contiguous(ys, MHA_F32, 3, (int64_t[]){1, n, E});
            mha_forward_args a = position_args(&st, variant);
            a.opts.is_causal = true;
            a.impl = MHA_IMPL_REFERENCE;
            CHECK_OK(mha_forward(&yt, NULL, m, &a));
            memcpy(yo + p * E, ys + (n - 1) * E, sizeof(float) * E);
        }
        const double e = rel_err(yo, yp, L * E);
        CHECKF(e <= 2e-5, "StreamingLLM (%s): rel err %g against the paper's caches",
               variant ? "ALiBi" : "RoPE", e);
        // the blocks: the sinks' first block, the window's and the chunk's
        const int64_t bound = (K + BS - 1) / BS + (W + 18 + BS - 1) / BS + 2;
        CHECKF(most <= bound, "StreamingLLM: %lld blocks at most, expected <= %lld",
               (long long)most, (long long)bound);
        printf("StreamingLLM (%s, %d sinks, window %d, %d tokens in %lld calls): rel err %.2g, "
               "at most %lld blocks of %d tokens in use\n",
               variant ? "ALiBi" : "RoPE", K, W, L, (long long)calls, e, (long long)most, BS);
        // what reaches the released tokens is refused and changes nothing
        {
            float q[NH * (E / NH)], o[NH * (E / NH)];
            for (int i = 0; i < NH * (E / NH); i++) q[i] = frand();
            mha_tensor qt = mha_tensor_contiguous(q, MHA_F32, 4, (int64_t[]){1, NH, 1, E / NH}),
                       ot = mha_tensor_contiguous(o, MHA_F32, 4, (int64_t[]){1, NH, 1, E / NH});
            mha_cache_attend_args ca;
            mha_cache_attend_args_init(&ca);
            ca.opts.window_left = W;  // (no sinks: the window alone is fine)
            CHECK_OK(mha_paged_cache_attend(&ot, &qt, pc, 1, &id, NULL, &ca));
            ca.opts.sink_tokens = BS + 1;  // sinks past the kept block
            CHECK(mha_paged_cache_attend(&ot, &qt, pc, 1, &id, NULL, &ca) ==
                  MHA_ERR_INVALID_ARG);
            CHECKF(strstr(mha_last_error(), "the sinks") != NULL, "message: %s",
                   mha_last_error());
            ca.opts.sink_tokens = K, ca.opts.window_left = W + 30;  // a window past the hole
            CHECK(mha_paged_cache_attend(&ot, &qt, pc, 1, &id, NULL, &ca) ==
                  MHA_ERR_INVALID_ARG);
            const int64_t used = mha_paged_cache_blocks_in_use(pc);
            CHECK(mha_paged_cache_release(pc, id, 2 * BS, L - W) == MHA_ERR_INVALID_ARG);
            CHECK(mha_paged_cache_release(pc, id, -1, 3) == MHA_ERR_INVALID_ARG);
            CHECK(mha_paged_cache_truncate(pc, id, BS + 2) == MHA_ERR_INVALID_ARG);
            CHECK(mha_paged_cache_blocks_in_use(pc) == used &&
                  mha_paged_cache_length(pc, id) == L);
            CHECK_OK(mha_paged_cache_truncate(pc, id, BS));  // into the kept block: fine
            CHECK(mha_paged_cache_length(pc, id) == BS);
        }
        // sink_tokens without a window, or with a plain forward: refused
        {
            mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){1, 2, E}),
                       yt = mha_tensor_contiguous(yp, MHA_F32, 3, (int64_t[]){1, 2, E});
            mha_forward_args a;
            mha_forward_args_init(&a);
            a.query = a.key = a.value = &xt;
            a.opts.sink_tokens = K;
            CHECK(mha_forward_paged(&yt, m, &a, pc, &id, NULL, NULL) == MHA_ERR_INVALID_ARG);
            CHECK(mha_paged_cache_length(pc, id) == BS);
            a.opts.window_left = W;
            CHECK(mha_forward(&yt, NULL, m, &a) == MHA_ERR_UNSUPPORTED);
        }
        mha_paged_cache_destroy(pc);
        mha_module_destroy(m);
        free(x), free(yp), free(yo), free(xs), free(ys);
    }
}

// A released block's successor in the prefix index: once the released
// block returns to the pool and holds other tokens, a prompt with those
// tokens and then the successor's must not reach the successor (its keys
// and values were computed after other tokens).
static void test_released_parent(void) {
    enum { BS = 4, D = 8 };
    mha_paged_cache *c = NULL;
    CHECK_OK(paged_create(&c, 8, BS, 1, D, D, MHA_KV_F32));
    float ka[3 * BS * D], kb[3 * BS * D];
    for (int i = 0; i < 3 * BS * D; i++) ka[i] = frand(), kb[i] = frand();
    mha_tensor ta = mha_tensor_contiguous(ka, MHA_F32, 4, (int64_t[]){1, 1, 3 * BS, D}),
               tb = mha_tensor_contiguous(kb, MHA_F32, 4, (int64_t[]){1, 1, 3 * BS, D});
    int32_t a_tok[3 * BS], b_tok[3 * BS];
    for (int i = 0; i < 3 * BS; i++) a_tok[i] = 100 + i, b_tok[i] = i < BS ? 500 + i : 100 + i;
    int64_t a, b, p, fb, cached;
    CHECK_OK(mha_paged_cache_add(c, &a));
    CHECK_OK(mha_paged_cache_append(c, 1, &a, NULL, &ta, &ta, a_tok));
    CHECK_OK(mha_paged_cache_release(c, a, 0, BS));  // A's first block back to the pool
    // B: its own first block (the freed one, reused), then A's later tokens' ids (other
    // keys and values: they follow other tokens)
    CHECK_OK(mha_paged_cache_add(c, &b));
    CHECK_OK(mha_paged_cache_append(c, 1, &b, NULL, &tb, &tb, b_tok));
    // B's prompt again: its blocks, not A's second one (whose parent was the freed block)
    // (all three blocks: the last token's row is in the third)
    CHECK_OK(mha_paged_cache_add_prompt(c, b_tok, 3 * BS, &p, &cached));
    CHECKF(cached == 3 * BS - 1, "B's prompt: %lld cached", (long long)cached);
    CHECK_OK(mha_paged_cache_fork(c, b, &fb));
    CHECK_OK(mha_paged_cache_truncate(c, fb, 3 * BS - 1));
    float q[D], o1[D], o2[D];
    for (int i = 0; i < D; i++) q[i] = frand();
    mha_tensor qt = mha_tensor_contiguous(q, MHA_F32, 4, (int64_t[]){1, 1, 1, D}),
               t1 = mha_tensor_contiguous(o1, MHA_F32, 4, (int64_t[]){1, 1, 1, D}),
               t2 = mha_tensor_contiguous(o2, MHA_F32, 4, (int64_t[]){1, 1, 1, D});
    CHECK_OK(mha_paged_cache_attend(&t1, &qt, c, 1, &p, NULL, NULL));
    CHECK_OK(mha_paged_cache_attend(&t2, &qt, c, 1, &fb, NULL, NULL));
    CHECKF(memcmp(o1, o2, sizeof o1) == 0,
           "a prompt took a block whose parent was released and reused");
    mha_paged_cache_destroy(c);
}

// An int4 row of n elements: ceil(n / 2) bytes and ceil(n / 32) float
// scales (mha.h), in a block (the scales in the row, after its bytes
// rounded up to 4: 17 -> 20, 35 -> 36) and in a contiguous cache.
static void test_int4_bytes(void) {
    mha_paged_cache *c = NULL;
    CHECK_OK(paged_create(&c, 4, 5, 3, 33, 70, MHA_KV_INT4));
    CHECKF(mha_paged_cache_block_bytes(c) == (size_t)(3 * 5) * (20 + 36 + 4 * (2 + 3)),
           "int4 block bytes %zu", mha_paged_cache_block_bytes(c));
    mha_paged_cache_destroy(c);
    mha_kv_cache *kc = NULL;
    CHECK_OK(mha_kv_cache_create(&kc, 2, 3, 33, 70, 7, MHA_KV_INT4));
    CHECKF(mha_kv_cache_bytes(kc) == (size_t)(2 * 3 * 7) * (17 + 35 + 4 * (2 + 3)),
           "int4 cache bytes %zu", mha_kv_cache_bytes(kc));
    mha_kv_cache_destroy(kc);
}

// The layouts' names, their errors and the getter; mha_paged_cache_create
// is head-major.
static void test_layout_api(void) {
    mha_paged_layout l = MHA_PAGED_HEAD_MAJOR;
    CHECK(strcmp(mha_paged_layout_name(MHA_PAGED_HEAD_MAJOR), "head-major") == 0);
    CHECK(strcmp(mha_paged_layout_name(MHA_PAGED_BLOCK_MAJOR), "block-major") == 0);
    CHECK(mha_paged_layout_name((mha_paged_layout)2) == NULL);
    CHECK_OK(mha_paged_layout_from_name(&l, "block-major"));
    CHECK(l == MHA_PAGED_BLOCK_MAJOR);
    CHECK(mha_paged_layout_from_name(&l, "blocks") == MHA_ERR_INVALID_ARG);
    CHECK(strstr(mha_last_error(), "'blocks'") != NULL);
    CHECK(l == MHA_PAGED_BLOCK_MAJOR);
    CHECK(mha_paged_layout_from_name(NULL, "head-major") == MHA_ERR_INVALID_ARG);
    mha_paged_cache *c = (mha_paged_cache *)&l;
    CHECK(mha_paged_cache_create(&c, 4, 4, 1, 8, 8, MHA_KV_F32, (mha_paged_layout)2) ==
          MHA_ERR_INVALID_ARG);
    CHECK(c == NULL && strstr(mha_last_error(), "layout 2") != NULL);
    CHECK(mha_paged_cache_create(&c, 4, 4, 1, 8, 8, MHA_KV_F32, (mha_paged_layout)-1) ==
          MHA_ERR_INVALID_ARG);
    CHECK_OK(mha_paged_cache_create(&c, 4, 4, 1, 8, 8, MHA_KV_F32, MHA_PAGED_HEAD_MAJOR));
    CHECK(mha_paged_cache_layout(c) == MHA_PAGED_HEAD_MAJOR);
    mha_paged_cache_destroy(c);
    CHECK_OK(mha_paged_cache_create(&c, 4, 4, 1, 8, 8, MHA_KV_F32, MHA_PAGED_BLOCK_MAJOR));
    CHECK(mha_paged_cache_layout(c) == MHA_PAGED_BLOCK_MAJOR);
    mha_paged_cache_destroy(c);
    CHECK(mha_paged_cache_layout(NULL) == MHA_PAGED_HEAD_MAJOR);
}

// One query per KV head (H = Hkv: a block-major pool's decode calls its
// kernels on each head's rows of a block directly): three sequences over
// several of decode's chunks, blocks of 1, 7 and 16, no window and a
// window, against a contiguous cache of the same rows, the same bits.
static void test_one_query_a_head(void) {
    enum { NK = 3, NSEQ = 3, D = 16 };
    const int64_t lens[NSEQ] = {9000, 300, 4100}, cap = 9000, bss[] = {1, 7, 16};
    const mha_kv_dtype dts[] = {MHA_KV_F32, MHA_KV_BF16, MHA_KV_INT4};
    const size_t nkv = (size_t)(NSEQ * NK * cap * D), nq = (size_t)(NSEQ * NK * D);
    float *kb = malloc(sizeof(float) * nkv), *vb = malloc(sizeof(float) * nkv),
          *q = malloc(sizeof(float) * nq), *o1 = malloc(sizeof(float) * nq),
          *o2 = malloc(sizeof(float) * nq);
    for (size_t i = 0; i < nkv; i++) kb[i] = frand(), vb[i] = frand();
    for (size_t i = 0; i < nq; i++) q[i] = frand();
    const int64_t sh[4] = {NSEQ, NK, 1, D};
    mha_tensor kt = mha_tensor_contiguous(kb, MHA_F32, 4, (int64_t[]){NSEQ, NK, cap, D}),
               vt = mha_tensor_contiguous(vb, MHA_F32, 4, (int64_t[]){NSEQ, NK, cap, D}),
               qt = mha_tensor_contiguous(q, MHA_F32, 4, sh),
               t1 = mha_tensor_contiguous(o1, MHA_F32, 4, sh),
               t2 = mha_tensor_contiguous(o2, MHA_F32, 4, sh);
    for (int di = 0; di < 3; di++)
        for (int bi = 0; bi < 3; bi++) {
            const int64_t bs = bss[bi];
            mha_kv_cache *kc = NULL;
            mha_paged_cache *pc = NULL;
            CHECK_OK(mha_kv_cache_create(&kc, NSEQ, NK, D, D, cap, dts[di]));
            CHECK_OK(mha_kv_cache_append(kc, &kt, &vt, lens));
            CHECK_OK(paged_create(&pc, (13400 + 3 * bs) / bs, bs, NK, D, D, dts[di]));
            int64_t ids[NSEQ];
            for (int i = 0; i < NSEQ; i++) CHECK_OK(mha_paged_cache_add(pc, &ids[i]));
            CHECK_OK(mha_paged_cache_append(pc, NSEQ, ids, lens, &kt, &vt, NULL));
            for (int w = 0; w < 2; w++) {
                mha_cache_attend_args a;
                mha_cache_attend_args_init(&a);
                a.opts.window_left = w ? 700 : -1;
                for (size_t i = 0; i < nq; i++) o1[i] = 1.0f, o2[i] = 2.0f;
                CHECK_OK(mha_kv_cache_attend(&t1, &qt, kc, &a, NULL));
                CHECK_OK(mha_paged_cache_attend(&t2, &qt, pc, NSEQ, ids, NULL, &a));
                CHECKF(memcmp(o1, o2, sizeof(float) * nq) == 0,
                       "one query a head: %s, blocks of %lld, window %lld: paged != contiguous",
                       mha_kv_dtype_name(dts[di]), (long long)bs,
                       (long long)a.opts.window_left);
            }
            mha_paged_cache_destroy(pc);
            mha_kv_cache_destroy(kc);
        }
    free(kb), free(vb), free(q), free(o1), free(o2);
}

// The whole suite under one layout (g_layout).
static void suite(void) {
    printf("pool layout %s\n", mha_paged_layout_name(g_layout));
    const int64_t blocks[] = {1, 3, 16, 64};
    // (int4: head dims 33, odd, cut into a group of 32 and one of 1, and 40)
    for (int dt = MHA_KV_F32; dt <= MHA_KV_INT4; dt++)
        for (int b = 0; b < 4; b++)
            random_schedule((mha_kv_dtype)dt, blocks[b],
                            b % 2               ? 40
                            : dt == MHA_KV_INT4 ? 33
                                                : 16,
                            dt == 0 ? 90 : 45);
    test_int4_bytes();
    test_shared_decode(40, 600, MHA_KV_F32, MHA_KV_INT4);
    test_shared_decode(128, 514, MHA_KV_F32, MHA_KV_F32);
    // (int8 and int4 at head dim 128: their queries rounded to int8, the
    // rows' scales in the blocks)
    test_shared_decode(128, 514, MHA_KV_INT8, MHA_KV_INT4);
    printf("random schedules: %lld prompts added, %lld of their tokens found in the cache, "
           "%lld whose last row was held\n",
           (long long)prompts, (long long)reused, (long long)held);
    CHECK(reused > 0 && held > 0);
    test_blocks();
    test_prefix();
    test_prompt_last_row();
    test_placement();
    test_errors();
    test_threads();
    test_forward_paged();
    test_window_release();
    test_forward_prefix();
    test_streaming();
    test_released_parent();
    test_one_query_a_head();
}

int main(void) {
    seed_rng(19);
    test_layout_api();
    g_layout = MHA_PAGED_HEAD_MAJOR;
    suite();
    g_layout = MHA_PAGED_BLOCK_MAJOR;
    suite();
    return check_summary("test_paged");
}
