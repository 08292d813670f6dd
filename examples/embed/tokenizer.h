// tokenizer.h: BERT's WordPiece tokenizer (examples/embed/tokenizer.c), as
// transformers' BertTokenizer runs it for an uncased model such as
// all-MiniLM-L6-v2 (the tokenizers library's BertNormalizer,
// BertPreTokenizer and WordPiece, which AutoTokenizer loads from the
// model's tokenizer.json):
//   1. clean: drop U+0000, U+FFFD and control characters (categories Cc,
//      Cf, Co, Cs; not \t \n \r), every white space (\t \n \r, Zs, Zl, Zp)
//      becomes ' '
//   2. CJK ideographs (the CJK Unified Ideographs blocks and their
//      extensions, the compatibility ideographs) get a space on each side
//   3. strip accents: NFD, then drop the nonspacing marks (category Mn)
//   4. lower-case (Unicode simple lower-case mapping, per character)
//   5. split on white space, and every punctuation character (ASCII
//      !"#$%&'()*+,-./:;<=>?@[\]^_`{|}~ or a category P*) is a word alone
//   6. WordPiece: greedy longest match from the left, continuation pieces
//      prefixed "##"; a word with no full match, or longer than 100
//      characters, is [UNK]
//   7. [CLS] pieces [SEP], the pieces cut to max_length - 2 (transformers'
//      truncation=True keeps the first ones)
// Unicode data (categories, decompositions, case) comes from utf8proc.
//
// Input is UTF-8. Invalid UTF-8 (a Python str cannot hold it, so
// transformers never sees it) is refused with an error naming the byte
// offset. What it deliberately does not do: pairs of sentences, offsets,
// added tokens, never_split lists, cased models' special rules.
//
// Errors: every function returning int returns 0, or -1 with a message for
// embed_last_error() (error.h); nothing prints or exits.
#ifndef EMBED_TOKENIZER_H
#define EMBED_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "error.h"

typedef struct embed_tokenizer embed_tokenizer;

typedef struct embed_tokenizer_options {
    bool lowercase;      // tokenizer_config.json do_lower_case (default true)
    bool strip_accents;  // strip_accents; null: same as lowercase
    bool chinese_chars;  // tokenize_chinese_chars (default true)
} embed_tokenizer_options;

// Reads vocab.txt (one token a line, its id the line number, "\n" ends a
// line; a repeated token keeps its last id) and, when present,
// tokenizer_config.json of the same directory for the options. [CLS],
// [SEP] and [UNK] must be in the vocabulary.
int embed_tokenizer_load(embed_tokenizer **out, const char *model_dir);
void embed_tokenizer_destroy(embed_tokenizer *t);
int64_t embed_tokenizer_vocab_size(const embed_tokenizer *t);
embed_tokenizer_options embed_tokenizer_get_options(const embed_tokenizer *t);
// The id of a token (len bytes), -1 when it is not in the vocabulary.
int64_t embed_tokenizer_id(const embed_tokenizer *t, const char *tok, size_t len);
// The token of id, NULL when out of range.
const char *embed_tokenizer_token(const embed_tokenizer *t, int64_t id);

// ids (max_length) <- [CLS] WordPiece(text) [SEP], at most max_length
// (>= 2) ids in all; *n their count. text: len bytes of UTF-8 (NUL bytes
// count as U+0000 and are dropped).
int embed_tokenize(int64_t *ids, int64_t *n, const embed_tokenizer *t, const char *text,
                   size_t len, int64_t max_length);

#endif
