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
//   - a Hugging Face `tokenizer.json` whose model is byte-level BPE: its vocabulary in GPT-2's
//     byte-to-unicode alphabet, its merges (either "a b" strings or ["a", "b"] pairs; a merge's index is
//     its priority), and its added tokens as special tokens. Its pre-tokenizer is either ByteLevel with
//     GPT-2's pattern (GPT-2, RoBERTa, ...) or a Sequence of a Split by a pattern (Isolated, not
//     inverted) and ByteLevel without its own (Llama 3, Qwen2; data/text/pretokenize.h, SplitPattern),
//     or a Sequence of Digits and ByteLevel with GPT-2's pattern (SmolLM2, StarCoder: every number apart,
//     GPT-2's pieces between; SplitPattern::digits_then_gpt2).
//     Its normalizer is null or NFC (Qwen2). The BOS token a TemplateProcessing (or Roberta/Bert)
//     post-processor puts first is bos_id(). Anything else (Unigram, WordPiece, Metaspace, byte_fallback,
//     another normalizer or pre-tokenizer) is refused in one line.
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
  /// calling thread's matcher and cache. The parts must be cut where safe_cut or piece_end below say;
  /// a piece that crosses `owned` throws std::logic_error. With NFC, text[0, owned) and the bytes after
  /// are normalized apart.
  void encode_part(std::string_view text, size_t owned, Pretokenizer& matcher, PieceCache& cache,
                   std::vector<int32_t>& out) const;
  /// True when a space goes before each document (tokenizer.json's ByteLevel add_prefix_space).
  bool adds_prefix_space() const;
  /// For callers that cut: the first position p in [from, to) (0 < from, to <= text.size(); `text` valid
  /// UTF-8 as it will be passed to encode_part) where the text may be cut into parts that encode_part
  /// encodes apart with the ids of the whole: a piece begins there, and with NFC the text normalizes as
  /// its two sides do. npos when there is none (always for a Split pattern other than GPT-2's, Llama 3's
  /// and Qwen2's: such text is cut only where piece_end says).
  size_t safe_cut(std::string_view text, size_t from, size_t to) const;
  /// For callers that cut when safe_cut finds nothing: from `at`, a place where the text may be cut, the
  /// next such place, judged from `text` and at most 16 bytes after the place (the text read so far
  /// may end there). GPT-2's pattern, alone or after Digits: the end of the piece at `at`; Llama 3's and Qwen2's, or NFC: the
  /// next safe cut; another pattern: text.size() (a document is then cut nowhere but at its end).
  size_t piece_end(std::string_view text, size_t at, Pretokenizer& matcher) const;

  /// The ids of `text` (UTF-8; an invalid sequence is first replaced by U+FFFD as Python's
  /// errors="replace" does, see replace_invalid_utf8; then normalized when the tokenizer has NFC),
  /// special tokens not recognized: tiktoken's `encode_ordinary`, Hugging Face tokenizers' encode with
  /// add_special_tokens=False and encode_special_tokens=True. Appends to `out`. The byte tokenizer takes the bytes as they are.
  void encode(std::string_view text, std::vector<int32_t>& out) const;
  std::vector<int32_t> encode(std::string_view text) const;
  /// As encode, but the added tokens' texts ("<|eot_id|>", "<|im_start|>") found in `text` become their
  /// ids (the longest at the leftmost place first, as Hugging Face tokenizers' encode with special tokens
  /// recognized; their lstrip/rstrip/single_word options are not applied). No BOS is added: see bos_id.
  /// For prompts and chat templates; training text goes through encode.
  void encode_with_specials(std::string_view text, std::vector<int32_t>& out) const;
  std::vector<int32_t> encode_with_specials(std::string_view text) const;
  /// The bytes of the tokens, concatenated (a special token gives its text). Throws std::out_of_range
  /// for an id outside [0, vocab_size()). The bytes need not be valid UTF-8: a token may end inside a
  /// character; to print, pass them through replace_invalid_utf8.
  std::string decode(const std::vector<int32_t>& ids) const;
  std::string decode(const int32_t* ids, int64_t n) const;

  /// The id of a special token ("<|endoftext|>"), or -1 when the tokenizer has none of that name.
  int32_t special(const std::string& name) const;
  /// The id of the special token tokenizer.json's post-processor puts at the start of each sequence
  /// (Llama 3's <|begin_of_text|>, 128000), or -1 when it puts none (GPT-2, Qwen2, a rank file, bytes).
  /// encode never adds it: a caller that wants the model's training form puts it before each document.
  int32_t bos_id() const;
  /// Ids are in [0, vocab_size()): the largest id + 1, added tokens included (50257 for GPT-2, 128256
  /// for Llama 3).
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
