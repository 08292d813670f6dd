// tokenizer.c: BERT's WordPiece tokenizer (tokenizer.h has the rules).
// The vocabulary is an open-addressing hash table of the tokens (FNV-1a),
// the text goes through code points (utf8proc) once per step.
#include "tokenizer.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

enum { MAX_WORD_CHARS = 100, NUM_SPECIAL = 5 };

struct embed_tokenizer {
    char *blob;      // the vocabulary file, each token NUL-terminated
    char **tokens;   // (n) token i
    size_t *lens;    // (n) its bytes
    int64_t n;       // vocabulary size
    int64_t *table;  // (cap) ids, -1 empty
    size_t cap;      // a power of two >= 2 n
    int64_t cls, sep, unk;
    // the special tokens matched in the raw text before normalisation
    // (tokenizers' added tokens: [PAD] [UNK] [CLS] [SEP] [MASK])
    int64_t special[NUM_SPECIAL];
    embed_tokenizer_options opt;
};

static uint64_t fnv1a(const char *s, size_t len) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < len; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h;
}

int64_t embed_tokenizer_id(const embed_tokenizer *t, const char *tok, size_t len) {
    size_t mask = t->cap - 1;
    for (size_t i = (size_t)fnv1a(tok, len) & mask;; i = (i + 1) & mask) {
        int64_t id = t->table[i];
        if (id < 0) return -1;
        if (t->lens[id] == len && !memcmp(t->tokens[id], tok, len)) return id;
    }
}

int64_t embed_tokenizer_vocab_size(const embed_tokenizer *t) { return t->n; }
embed_tokenizer_options embed_tokenizer_get_options(const embed_tokenizer *t) {
    return t->opt;
}
const char *embed_tokenizer_token(const embed_tokenizer *t, int64_t id) {
    return id >= 0 && id < t->n ? t->tokens[id] : NULL;
}

void embed_tokenizer_destroy(embed_tokenizer *t) {
    if (!t) return;
    free(t->blob);
    free(t->tokens);
    free(t->lens);
    free(t->table);
    free(t);
}

// The whole file into a NUL-terminated buffer.
static int read_file(char **out, size_t *len, const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return embed_fail("%s: cannot open: %s", path, strerror(errno));
    char *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n + 65536 + 1 > cap) {
            cap = 2 * cap + 65536 + 1;
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                fclose(f);
                return embed_fail("%s: out of memory reading it", path);
            }
            buf = nb;
        }
        size_t got = fread(buf + n, 1, 65536, f);
        n += got;
        if (got < 65536) break;
    }
    int err = ferror(f);
    fclose(f);
    if (err) {
        free(buf);
        return embed_fail("%s: read error", path);
    }
    buf[n] = '\0';
    *out = buf;
    *len = n;
    return 0;
}

// tokenizer_config.json's options, and its special tokens' names (the
// defaults when absent). A missing file leaves the defaults.
static int read_options(embed_tokenizer_options *o, char names[NUM_SPECIAL][64],
                        const char *dir) {
    static const char *keys[NUM_SPECIAL] = {"pad_token", "unk_token", "cls_token", "sep_token",
                                            "mask_token"};
    static const char *defaults[NUM_SPECIAL] = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"};
    for (int i = 0; i < NUM_SPECIAL; i++) snprintf(names[i], 64, "%s", defaults[i]);
    o->lowercase = o->strip_accents = o->chinese_chars = true;
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    FILE *probe = fopen(path, "rb");
    if (!probe) return 0;
    fclose(probe);
    char *text;
    size_t len;
    if (read_file(&text, &len, path)) return -1;
    cJSON *j = cJSON_ParseWithLength(text, len);
    free(text);
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        return embed_fail("%s: not a JSON object", path);
    }
    const cJSON *v;
    int rc = 0;
    if ((v = cJSON_GetObjectItemCaseSensitive(j, "do_lower_case"))) {
        if (!cJSON_IsBool(v)) rc = embed_fail("%s: do_lower_case is not a boolean", path);
        o->lowercase = cJSON_IsTrue(v);
    }
    o->strip_accents = o->lowercase;
    if ((v = cJSON_GetObjectItemCaseSensitive(j, "strip_accents")) && !cJSON_IsNull(v)) {
        if (!cJSON_IsBool(v))
            rc = embed_fail("%s: strip_accents is not a boolean or null", path);
        o->strip_accents = cJSON_IsTrue(v);
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(j, "tokenize_chinese_chars"))) {
        if (!cJSON_IsBool(v))
            rc = embed_fail("%s: tokenize_chinese_chars is not a boolean", path);
        o->chinese_chars = cJSON_IsTrue(v);
    }
    for (int i = 0; i < NUM_SPECIAL && !rc; i++) {
        v = cJSON_GetObjectItemCaseSensitive(j, keys[i]);
        if (cJSON_IsString(v)) {
            if (strlen(v->valuestring) >= 64 || !v->valuestring[0])
                rc = embed_fail("%s: %s is empty or longer than 63 bytes", path, keys[i]);
            else snprintf(names[i], 64, "%s", v->valuestring);
        } else if (v && !cJSON_IsNull(v)) {
            rc = embed_fail("%s: %s is not a string", path, keys[i]);
        }
    }
    cJSON_Delete(j);
    return rc;
}

int embed_tokenizer_load(embed_tokenizer **out, const char *model_dir) {
    *out = NULL;
    embed_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return embed_fail("out of memory for the tokenizer");
    char names[NUM_SPECIAL][64];
    if (read_options(&t->opt, names, model_dir)) goto fail;
    char path[4096];
    snprintf(path, sizeof path, "%s/vocab.txt", model_dir);
    size_t len;
    if (read_file(&t->blob, &len, path)) goto fail;
    int64_t lines = 0;
    for (size_t i = 0; i < len; i++) lines += t->blob[i] == '\n';
    if (len && t->blob[len - 1] != '\n') lines++;  // a last line without "\n"
    if (lines == 0) {
        embed_fail("%s: empty vocabulary", path);
        goto fail;
    }
    t->n = lines;
    t->tokens = malloc((size_t)lines * sizeof *t->tokens);
    t->lens = malloc((size_t)lines * sizeof *t->lens);
    for (t->cap = 16; t->cap < 2 * (size_t)lines;) t->cap *= 2;
    t->table = malloc(t->cap * sizeof *t->table);
    if (!t->tokens || !t->lens || !t->table) {
        embed_fail("%s: out of memory for %lld tokens", path, (long long)lines);
        goto fail;
    }
    memset(t->table, 0xff, t->cap * sizeof *t->table);  // every slot -1
    char *p = t->blob;
    for (int64_t id = 0; id < lines; id++) {
        char *nl = memchr(p, '\n', (size_t)(t->blob + len - p));
        size_t l = nl ? (size_t)(nl - p) : strlen(p);
        p[l] = '\0';
        t->tokens[id] = p;
        t->lens[id] = l;
        size_t mask = t->cap - 1, i = (size_t)fnv1a(p, l) & mask;
        for (; t->table[i] >= 0; i = (i + 1) & mask) {
            int64_t o = t->table[i];
            if (t->lens[o] == l && !memcmp(t->tokens[o], p, l))
                break;  // repeated: last id wins
        }
        t->table[i] = id;
        p += l + 1;
    }
    for (int i = 0; i < NUM_SPECIAL; i++) {
        t->special[i] = embed_tokenizer_id(t, names[i], strlen(names[i]));
        if (t->special[i] < 0 && i >= 1 && i <= 3) {
            embed_fail("%s: the special token \"%s\" is not in the vocabulary", path, names[i]);
            goto fail;
        }
    }
    t->unk = t->special[1];
    t->cls = t->special[2];
    t->sep = t->special[3];
    *out = t;
    return 0;
fail:
    embed_tokenizer_destroy(t);
    return -1;
}

// ---------------------------------------------------------------------------
// Character classes (tokenizers' BertNormalizer and BertPreTokenizer)

static bool is_control(utf8proc_int32_t c) {
    if (c == '\t' || c == '\n' || c == '\r') return false;
    utf8proc_category_t k = utf8proc_category(c);
    // "other" as the tokenizers library counts it: Cc, Cf, Co, Cs (an
    // unassigned code point, Cn, stays)
    return k == UTF8PROC_CATEGORY_CC || k == UTF8PROC_CATEGORY_CF ||
           k == UTF8PROC_CATEGORY_CO || k == UTF8PROC_CATEGORY_CS;
}

// Unicode White_Space (Rust's char::is_whitespace) with \t \n \r.
static bool is_whitespace(utf8proc_int32_t c) {
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || (c >= 0x0b && c <= 0x0c) || c == 0x85)
        return true;
    utf8proc_category_t k = utf8proc_category(c);
    return k == UTF8PROC_CATEGORY_ZS || k == UTF8PROC_CATEGORY_ZL || k == UTF8PROC_CATEGORY_ZP;
}

static bool is_punctuation(utf8proc_int32_t c) {
    if ((c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) ||
        (c >= 123 && c <= 126))
        return true;
    utf8proc_category_t k = utf8proc_category(c);
    return k >= UTF8PROC_CATEGORY_PC && k <= UTF8PROC_CATEGORY_PO;
}

// The CJK Unified Ideographs blocks (and extensions A-F) and the CJK
// compatibility ideographs: BERT's "Chinese characters".
static bool is_cjk(utf8proc_int32_t c) {
    return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) ||
           (c >= 0x20000 && c <= 0x2A6DF) || (c >= 0x2A700 && c <= 0x2B73F) ||
           (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
           (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

// ---------------------------------------------------------------------------
// Tokenizing

// A growing array of code points.
typedef struct cps {
    utf8proc_int32_t *v;
    size_t n, cap;
} cps;

static int cps_push(cps *a, utf8proc_int32_t c) {
    if (a->n == a->cap) {
        size_t cap = a->cap ? 2 * a->cap : 256;
        utf8proc_int32_t *nv = realloc(a->v, cap * sizeof *nv);
        if (!nv) return embed_fail("out of memory tokenizing");
        a->v = nv;
        a->cap = cap;
    }
    a->v[a->n++] = c;
    return 0;
}

// The output ids so far and their bound (max_length - 1: room for [SEP]).
typedef struct ids_out {
    int64_t *ids;
    int64_t n, cap;
} ids_out;

static bool ids_full(const ids_out *o) { return o->n >= o->cap; }
static void ids_push(ids_out *o, int64_t id) {
    if (o->n < o->cap) o->ids[o->n++] = id;
}

// WordPiece of one word (bytes w[0, len), nchars code points) into o.
// buf: at least len + 3 bytes.
static void wordpiece(ids_out *o, const embed_tokenizer *t, const char *w, size_t len,
                      size_t nchars, char *buf) {
    if (nchars > MAX_WORD_CHARS) {
        ids_push(o, t->unk);
        return;
    }
    int64_t pieces[MAX_WORD_CHARS];  // a word of k chars has at most k pieces
    int np = 0;
    size_t start = 0;
    while (start < len) {
        size_t end = len;
        int64_t id = -1;
        while (end > start) {
            size_t pl = 0;
            if (start > 0) buf[pl++] = '#', buf[pl++] = '#';
            memcpy(buf + pl, w + start, end - start);
            id = embed_tokenizer_id(t, buf, pl + end - start);
            if (id >= 0) break;
            do end--;  // back to the previous character boundary
            while (end > start && ((unsigned char)w[end] & 0xC0) == 0x80);
        }
        if (id < 0) {  // no piece matches here: the whole word is [UNK]
            ids_push(o, t->unk);
            return;
        }
        pieces[np++] = id;
        start = end;
    }
    for (int i = 0; i < np; i++) ids_push(o, pieces[i]);
}

// Normalises and tokenizes text[0, len) (no special tokens inside) into o.
static int tokenize_span(ids_out *o, const embed_tokenizer *t, const char *text, size_t len,
                         size_t offset) {
    int rc = 0;
    cps clean = {0};
    char *utf8 = NULL, *word = NULL, *buf = NULL;
    utf8proc_int32_t *nfd = NULL;
    // 1-2: clean, spaces around CJK ideographs
    for (size_t i = 0; i < len && !rc;) {
        utf8proc_int32_t c;
        utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)text + i,
                                              (utf8proc_ssize_t)(len - i), &c);
        if (k < 0) {
            rc = embed_fail("invalid UTF-8 at byte %zu (0x%02x)", offset + i,
                            (unsigned char)text[i]);
            break;
        }
        i += (size_t)k;
        if (c == 0 || c == 0xFFFD || is_control(c)) continue;
        if (is_whitespace(c)) c = ' ';
        if (t->opt.chinese_chars && is_cjk(c)) {
            rc = cps_push(&clean, ' ');
            if (!rc) rc = cps_push(&clean, c);
            if (!rc) rc = cps_push(&clean, ' ');
        } else {
            rc = cps_push(&clean, c);
        }
    }
    if (rc || clean.n == 0) goto done;
    // 3: NFD (decomposition and canonical order), then drop category Mn.
    // utf8proc decomposes UTF-8, so the cleaned text is encoded once.
    utf8 = malloc(4 * clean.n + 1);
    if (!utf8) {
        rc = embed_fail("out of memory tokenizing");
        goto done;
    }
    size_t ulen = 0;
    for (size_t i = 0; i < clean.n; i++)
        ulen += (size_t)utf8proc_encode_char(clean.v[i], (utf8proc_uint8_t *)utf8 + ulen);
    utf8proc_ssize_t nn = (utf8proc_ssize_t)clean.n;
    if (t->opt.strip_accents) {
        utf8proc_ssize_t cap = (utf8proc_ssize_t)clean.n * 4 + 16;
        for (;;) {
            free(nfd);
            nfd = malloc((size_t)cap * sizeof *nfd);
            if (!nfd) {
                rc = embed_fail("out of memory tokenizing");
                goto done;
            }
            nn = utf8proc_decompose((const utf8proc_uint8_t *)utf8, (utf8proc_ssize_t)ulen,
                                    nfd, cap, UTF8PROC_DECOMPOSE | UTF8PROC_STABLE);
            if (nn < 0) {
                rc = embed_fail("NFD failed: %s", utf8proc_errmsg(nn));
                goto done;
            }
            if (nn <= cap) break;
            cap = nn;
        }
        utf8proc_ssize_t k = 0;
        for (utf8proc_ssize_t i = 0; i < nn; i++)
            if (utf8proc_category(nfd[i]) != UTF8PROC_CATEGORY_MN) nfd[k++] = nfd[i];
        nn = k;
    } else {
        nfd = malloc(clean.n * sizeof *nfd);
        if (!nfd) {
            rc = embed_fail("out of memory tokenizing");
            goto done;
        }
        memcpy(nfd, clean.v, clean.n * sizeof *nfd);
    }
    // 4: lower case
    if (t->opt.lowercase)
        for (utf8proc_ssize_t i = 0; i < nn; i++) nfd[i] = utf8proc_tolower(nfd[i]);
    // 5-6: words split on white space and punctuation, each WordPiece'd
    word = malloc(4 * (size_t)nn + 4);
    buf = malloc(4 * (size_t)nn + 8);
    if (!word || !buf) {
        rc = embed_fail("out of memory tokenizing");
        goto done;
    }
    size_t wlen = 0, wchars = 0;
    for (utf8proc_ssize_t i = 0; i <= nn && !ids_full(o); i++) {
        utf8proc_int32_t c = i < nn ? nfd[i] : ' ';
        bool ws = is_whitespace(c), punct = !ws && is_punctuation(c);
        if ((ws || punct) && wlen) {
            wordpiece(o, t, word, wlen, wchars, buf);
            wlen = wchars = 0;
        }
        if (ws) continue;
        wlen += (size_t)utf8proc_encode_char(c, (utf8proc_uint8_t *)word + wlen);
        wchars++;
        if (punct) {
            wordpiece(o, t, word, wlen, wchars, buf);
            wlen = wchars = 0;
        }
    }
done:
    free(clean.v);
    free(utf8);
    free(nfd);
    free(word);
    free(buf);
    return rc;
}

int embed_tokenize(int64_t *ids, int64_t *n, const embed_tokenizer *t, const char *text,
                   size_t len, int64_t max_length) {
    *n = 0;
    if (max_length < 2)
        return embed_fail("max_length %lld: at least 2 ([CLS] and [SEP])",
                          (long long)max_length);
    ids_out o = {ids, 0, max_length - 1};
    ids_push(&o, t->cls);
    // Special tokens in the raw text are matched first (case-sensitive,
    // before normalisation, as tokenizers' added tokens), the spans between
    // them tokenized alone.
    size_t span = 0;
    for (size_t i = 0; i <= len && !ids_full(&o);) {
        int hit = -1;
        size_t hl = 0;
        if (i < len)
            for (int s = 0; s < NUM_SPECIAL; s++) {
                if (t->special[s] < 0) continue;
                const char *name = t->tokens[t->special[s]];
                size_t l = t->lens[t->special[s]];
                if (l > hl && l <= len - i && !memcmp(text + i, name, l)) hit = s, hl = l;
            }
        if (hit < 0 && i < len) {
            i++;
            continue;
        }
        if (i > span && tokenize_span(&o, t, text + span, i - span, span)) return -1;
        if (hit >= 0) ids_push(&o, t->special[hit]);
        i += hit >= 0 ? hl : 1;
        span = i;
    }
    if (span < len) {  // truncated: the rest must still be valid UTF-8
        utf8proc_int32_t c;
        for (size_t i = span; i < len;) {
            utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)text + i,
                                                  (utf8proc_ssize_t)(len - i), &c);
            if (k < 0)
                return embed_fail("invalid UTF-8 at byte %zu (0x%02x)", i,
                                  (unsigned char)text[i]);
            i += (size_t)k;
        }
    }
    ids[o.n++] = t->sep;
    *n = o.n;
    return 0;
}
