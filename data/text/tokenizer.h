// Byte-level BPE tokenizers (GPT-2's, Radford et al. 2019) read from the two files they are shipped as,
// and the byte tokenizer of the trainer's byte-level models. Encoding equals tiktoken's
// `encode_ordinary` (OpenAI's `gpt2` encoding), token for token: the text is split by GPT-2's
// pre-tokenizer pattern (data/text/pretokenize.h), and each piece is merged pair by pair, lowest rank
// first and leftmost among equal ranks (data/text/bpe.h).
//
// The two file forms:
//   - a tiktoken rank file (`gpt2.tiktoken`): one token a line, "<base64 of its bytes> <rank>"; the rank
//     is the token's id and its merge priority. `<|endoftext|>` gets the id after the last rank (50256
//     for GPT-2), as tiktoken's `gpt2` encoding adds it.
//   - a Hugging Face `tokenizer.json` whose model is BPE and whose pre-tokenizer is ByteLevel with
//     GPT-2's pattern (GPT-2, RoBERTa, ...): its vocabulary in GPT-2's byte-to-unicode alphabet, its
//     merges (either "a b" strings or ["a", "b"] pairs; a merge's index is its priority), and its added
//     tokens as special tokens.
// The form is told from the content: a file whose first non-blank byte is '{' is JSON.
//
// Nothing here uses LibTorch; ids are int32 (every vocabulary here is below 2^31).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace data {

class Bpe;
class PieceCache;
class Pretokenizer;

/// Text to token ids and back. Immutable after load: encode and decode may be called from many threads.
class Tokenizer {
 public:
  /// The byte tokenizer: token = byte value, vocabulary 256, no special tokens (convert-text without
  /// --tokenizer, and the byte-level models).
  static Tokenizer bytes();
  /// Reads a tiktoken rank file or a Hugging Face tokenizer.json (see the file comment). Throws
  /// std::runtime_error with one line "tokenizer 'PATH': ..." naming what is wrong (a missing file, a
  /// bad line and its number, a rank that repeats, a JSON tokenizer of a kind not supported, ...).
  static Tokenizer load(const std::string& path);

  /// For callers that cut a long text into parts (convert-text): the ids of text[0, owned), where `text`
  /// is valid UTF-8 whose bytes past `owned` (the start of the next part) are only looked at, with the
  /// calling thread's matcher and cache. The parts must be cut where a piece begins (safe_cut in
  /// data/text/pretokenize.h); a piece that crosses `owned` throws std::logic_error.
  void encode_part(std::string_view text, size_t owned, Pretokenizer& matcher, PieceCache& cache,
                   std::vector<int32_t>& out) const;
  /// True when a space goes before each document (tokenizer.json's ByteLevel add_prefix_space).
  bool adds_prefix_space() const;

  /// The ids of `text` (UTF-8; an invalid sequence is first replaced by U+FFFD as Python's
  /// errors="replace" does, see replace_invalid_utf8), special tokens not recognized: tiktoken's
  /// `encode_ordinary`. Appends to `out`. The byte tokenizer takes the bytes as they are.
  void encode(std::string_view text, std::vector<int32_t>& out) const;
  std::vector<int32_t> encode(std::string_view text) const;
  /// The bytes of the tokens, concatenated (a special token gives its text). Throws std::out_of_range
  /// for an id outside [0, vocab_size()). The bytes need not be valid UTF-8: a token may end inside a
  /// character; to print, pass them through replace_invalid_utf8.
  std::string decode(const std::vector<int32_t>& ids) const;
  std::string decode(const int32_t* ids, int64_t n) const;

  /// The id of a special token ("<|endoftext|>"), or -1 when the tokenizer has none of that name.
  int32_t special(const std::string& name) const;
  /// Ids are in [0, vocab_size()): the largest id + 1 (50257 for GPT-2).
  int64_t vocab_size() const;
  /// "bytes" for the byte tokenizer, else the file's name without its folder and extension ("gpt2").
  const std::string& name() const { return name_; }
  /// The path it was loaded from ("" for bytes()).
  const std::string& path() const { return path_; }
  /// True for bytes().
  bool is_bytes() const { return bpe_ == nullptr; }

 private:
  std::shared_ptr<const Bpe> bpe_;  // null: the byte tokenizer
  std::string name_, path_;
};

/// `bytes` with every maximal invalid UTF-8 subsequence replaced by U+FFFD (EF BF BD), exactly as
/// Python's bytes.decode("utf-8", errors="replace") does (Unicode's "maximal subpart" practice), also
/// for surrogates (ED A0..BF ..) and code points over U+10FFFF. Counts the replacements in *replaced
/// when given.
std::string replace_invalid_utf8(std::string_view bytes, int64_t* replaced = nullptr);

}  // namespace data
