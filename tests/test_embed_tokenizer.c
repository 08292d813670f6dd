// test_embed_tokenizer.c: the WordPiece tokenizer of examples/embed
// (tokenizer.h) on a small vocabulary written here, without PyTorch: the
// rules one by one (cleaning, CJK, accents, case, punctuation, WordPiece,
// [UNK], special tokens in the text, truncation) and its errors. The real
// vocabulary against transformers is tests/embed/test_embed.py.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "tokenizer.h"

static const char *vocab[] = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
                              "hello", "world", "un",    "##aff", "##able",
                              ",",     "!",     "cafe",  "naive", "\xe4\xb8\xad" /* 中 */,
                              "a",     "##a",   "##aa",  "'",     "s",
                              "x",     "##x",   "."};
enum { NV = sizeof vocab / sizeof vocab[0] };

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    if (!f) {
        perror(path);
        exit(1);
    }
    fputs(text, f);
    fclose(f);
}

// Tokenizes text (len bytes) and compares with the expected tokens
// (space-separated names, [CLS] and [SEP] included).
static void expect(const embed_tokenizer *t, const char *text, size_t len, int64_t max_len,
                   const char *want) {
    int64_t ids[512], n = 0;
    int rc = embed_tokenize(ids, &n, t, text, len, max_len);
    char got[2048] = "";
    size_t k = 0;
    for (int64_t i = 0; i < n && k < sizeof got - 64; i++)
        k += (size_t)snprintf(got + k, sizeof got - k, "%s%s", i ? " " : "",
                              embed_tokenizer_token(t, ids[i]));
    CHECKF(rc == 0 && !strcmp(got, want), "\"%s\": got \"%s\" (rc %d: %s), want \"%s\"", text,
           got, rc, rc ? embed_last_error() : "", want);
}

int main(void) {
    const char *tmp = getenv("MHA_TEST_TMPDIR");
    char dir[512], path[600];
    snprintf(dir, sizeof dir, "%s/embed_tok", tmp ? tmp : "/tmp");
    snprintf(path, sizeof path, "mkdir -p '%s'", dir);
    if (system(path)) return 1;
    char text[4096] = "";
    for (int i = 0; i < NV; i++) strcat(strcat(text, vocab[i]), "\n");
    snprintf(path, sizeof path, "%s/vocab.txt", dir);
    write_file(path, text);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    write_file(path, "{\"do_lower_case\": true, \"strip_accents\": null}");

    embed_tokenizer *t = NULL;
    CHECKF(embed_tokenizer_load(&t, dir) == 0, "%s", embed_last_error());
    if (!t) return check_summary("test_embed_tokenizer");
    CHECK(embed_tokenizer_vocab_size(t) == NV);
    CHECK(embed_tokenizer_id(t, "##aff", 5) == 8);
    CHECK(embed_tokenizer_id(t, "##af", 4) == -1);

#define E(s, want) expect(t, s, strlen(s), 64, want)
    E("", "[CLS] [SEP]");
    E("Hello, World!", "[CLS] hello , world ! [SEP]");
    E("  hello\t\n\r world  ", "[CLS] hello world [SEP]");
    E("unaffable", "[CLS] un ##aff ##able [SEP]");
    E("unaffabley", "[CLS] [UNK] [SEP]");  // no piece for "y" after "##able"
    E("Caf\xc3\xa9 NA\xc3\x8fVE", "[CLS] cafe naive [SEP]");  // Café NAÏVE: NFD, Mn dropped
    E("Cafe\xcc\x81", "[CLS] cafe [SEP]");                    // combining acute
    E("x\xe4\xb8\xadx", "[CLS] x \xe4\xb8\xad x [SEP]");      // x中x: spaces around CJK
    E("\xe6\x96\x87", "[CLS] [UNK] [SEP]");                   // 文: not in the vocabulary
    E("hel\xe2\x80\x8blo", "[CLS] hello [SEP]");              // U+200B (Cf) dropped
    E("hello\xc2\xa0world", "[CLS] hello world [SEP]");       // U+00A0 (Zs) splits
    E("hello\xe2\x80\xa8world", "[CLS] hello world [SEP]");   // U+2028 (Zl) splits
    E("x\xe2\x80\x94x", "[CLS] x [UNK] x [SEP]");             // em dash (Pd) alone
    E("x$x", "[CLS] x [UNK] x [SEP]");                        // ASCII '$' (Sc) alone
    E("a's", "[CLS] a ' s [SEP]");
    E("hello [MASK] world[SEP]", "[CLS] hello [MASK] world [SEP] [SEP]");
    E("[mask]", "[CLS] [UNK] [UNK] [UNK] [SEP]");      // case-sensitive: [ mask ]
    E("aaaaa", "[CLS] a ##aa ##aa [SEP]");             // longest match first
    expect(t, "hel\0lo", 6, 64, "[CLS] hello [SEP]");  // U+0000 dropped
    char longw[202];
    memset(longw, 'a', 101);
    longw[101] = '\0';
    E(longw, "[CLS] [UNK] [SEP]");  // 101 characters: [UNK]
    longw[100] = '\0';
    int64_t ids[512], n;
    CHECK(embed_tokenize(ids, &n, t, longw, 100, 512) == 0 && n == 2 + 51);  // a ##aa x 50
    // truncation: max_length counts [CLS] and [SEP]
    expect(t, "hello world hello world", 23, 4, "[CLS] hello world [SEP]");
    expect(t, "unaffable", 9, 4, "[CLS] un ##aff [SEP]");
    expect(t, "hello", 5, 2, "[CLS] [SEP]");
    // errors
    CHECK(embed_tokenize(ids, &n, t, "hello", 5, 1) == -1);
    CHECK(strstr(embed_last_error(), "max_length") != NULL);
    CHECK(embed_tokenize(ids, &n, t, "ok \xc3(", 5, 64) == -1);
    CHECKF(strstr(embed_last_error(), "invalid UTF-8 at byte 3") != NULL, "%s",
           embed_last_error());
    CHECK(embed_tokenize(ids, &n, t, "\xed\xa0\x80", 3, 64) == -1);  // a surrogate
    // invalid bytes past the truncation point are refused too
    CHECK(embed_tokenize(ids, &n, t, "hello world \xff", 13, 3) == -1);
    embed_tokenizer_destroy(t);

    embed_tokenizer *bad = NULL;
    snprintf(path, sizeof path, "%s/missing", dir);
    CHECK(embed_tokenizer_load(&bad, path) == -1 && !bad);
    CHECK(strstr(embed_last_error(), "vocab.txt") != NULL);
    snprintf(path, sizeof path, "%s/vocab.txt", dir);
    write_file(path, "[PAD]\n[UNK]\nhello\n");
    CHECK(embed_tokenizer_load(&bad, dir) == -1 && !bad);
    CHECKF(strstr(embed_last_error(), "[CLS]") != NULL, "%s", embed_last_error());
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    write_file(path, "{\"do_lower_case\": 1}");
    CHECK(embed_tokenizer_load(&bad, dir) == -1 && !bad);
    CHECKF(strstr(embed_last_error(), "do_lower_case") != NULL, "%s", embed_last_error());
    return check_summary("test_embed_tokenizer");
}
