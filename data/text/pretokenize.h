// GPT-2's pre-tokenizer: the regular expression that cuts text into the pieces BPE then merges
// (Radford et al. 2019, section 2.2; OpenAI's encoder.py, tiktoken's `gpt2` encoding):
//
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//
// Two implementations cut alike: Pretokenizer, a scanner written from the pattern (what the tokenizer
// uses), and PatternMatcher, the pattern itself matched by PCRE2 (Unicode properties, JIT-compiled),
// which the tests and fuzz_text hold the scanner to. `\s` is Unicode's White_Space property, which is
// what tiktoken's regex engine (Rust's) means by it; PCRE2's own `\s` leaves out U+0085. The last
// alternative matches one character, as in tiktoken's pattern: it is reached only by a single whitespace
// character before a non-space, so the two forms cut alike.
//
// Each match starts where the previous one ended and depends only on the text from its start on (the
// pattern has no look-behind), so text may be cut into parts that are pre-tokenized apart wherever a
// match begins: safe_cut finds such places without matching.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace data {

/// The pieces, found by a scanner written from the pattern: a table of the Unicode classes it tests
/// (\p{L}, \p{N}, White_Space; built once from PCRE2's own property tables) and the alternatives in
/// order. It cuts exactly as the pattern does (PatternMatcher below, which the tests hold it to), several
/// times faster: one call a piece of a regex engine costs more than the piece's merges.
class Pretokenizer {
 public:
  Pretokenizer();
  ~Pretokenizer();
  Pretokenizer(Pretokenizer&&) noexcept;
  /// The end of the piece that starts at `at` in `text` (valid UTF-8; at < text.size()).
  size_t piece_end(std::string_view text, size_t at) const;
  /// As piece_end, after a Digits pre-tokenizer (tokenizers' Digits, then ByteLevel with GPT-2's
  /// pattern: SmolLM2, StarCoder): each \p{N} character is a piece of its own (`individual`), or each
  /// run of them is one piece; the text between is cut by GPT-2's pattern as if each stretch were a
  /// whole text.
  size_t piece_end_digits(std::string_view text, size_t at, bool individual) const;

  /// Calls f(piece) for every piece of `text` (valid UTF-8), in order.
  template <typename F>
  void split(std::string_view text, F&& f) const {
    for (size_t at = 0; at < text.size();) {
      const size_t end = piece_end(text, at);
      f(text.substr(at, end - at));
      at = end;
    }
  }

 private:
  friend class SplitPattern;
  struct MatchState;
  const unsigned char* classes_;  // per code point: kOther, kLetter, kNumber, kSpace
  // PCRE2's match state for a SplitPattern, made on first use: one thread's scratch for any pattern.
  std::unique_ptr<MatchState> state_;
};

/// The pattern itself, matched by PCRE2 (JIT-compiled), one thread's match state: the plain version the
/// scanner is tested against.
class PatternMatcher {
 public:
  PatternMatcher();
  ~PatternMatcher();
  PatternMatcher(const PatternMatcher&) = delete;
  PatternMatcher& operator=(const PatternMatcher&) = delete;
  /// As Pretokenizer::piece_end.
  size_t piece_end(std::string_view text, size_t at);

 private:
  void* match_data_;  // pcre2_match_data_8
  void* stack_;       // pcre2_jit_stack_8
  void* context_;     // pcre2_match_context_8
};

/// The first position p in [from, to) (0 < from, to <= text.size()) where a piece of `text` surely
/// begins, judged from the two bytes around it: an ASCII whitespace after a printable ASCII character,
/// or a printable ASCII character after an ASCII whitespace other than the space. Returns
/// std::string_view::npos when there is none.
size_t safe_cut(std::string_view text, size_t from, size_t to);

/// A tokenizer.json's Split pre-tokenizer pattern (behavior Isolated, invert false): the text is cut into
/// the pattern's matches, found one after another from the start (leftmost-first, as Hugging Face
/// tokenizers' Oniguruma finds them), and the text between two matches, each a piece. Compiled by PCRE2
/// (Unicode properties, JIT) with `\s` and `\S` rewritten to mean Unicode's White_Space, as Oniguruma's
/// do (PCRE2's own leave out U+0085). Three patterns are recognized by their text:
///   - GPT-2's (tokenizers' ByteLevel pattern): pieces come from the scanner, Pretokenizer;
///   - Llama 3's:  (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
///   - Qwen2's:    the same with \p{N} for \p{N}{1,3}.
/// Their safe cuts are known (safe_cut below); any other pattern is matched as it is but has none.
/// Immutable: shared by threads, each with its own Pretokenizer as scratch.
class SplitPattern {
 public:
  enum class Kind { kGpt2, kLlama3, kQwen2, kOther, kDigitsGpt2, kDigitRunsGpt2 };
  /// Throws std::runtime_error with one line: a pattern that does not compile (PCRE2's message and
  /// offset), one over 4096 bytes, one that can match the empty text, or one that looks behind (a
  /// lookbehind, \b, \B, \A, \G), which would see across the places where convert-text cuts.
  explicit SplitPattern(const std::string& regex);
  ~SplitPattern();
  SplitPattern(const SplitPattern&) = delete;
  SplitPattern& operator=(const SplitPattern&) = delete;
  Kind kind() const { return kind_; }

  /// GPT-2's, shared.
  static std::shared_ptr<const SplitPattern> gpt2();
  /// Not a Split but a Sequence of Digits and ByteLevel with GPT-2's pattern (SmolLM2's, StarCoder's):
  /// every number (\p{N}, which is Rust's char::is_numeric, the categories Nd, Nl and No: "7", "٣",
  /// "²", "½", "Ⅻ") apart, each character (`individual`, kind kDigitsGpt2) or each run (kDigitRunsGpt2)
  /// a piece, and GPT-2's pieces of the text between (Pretokenizer::piece_end_digits). Shared.
  static std::shared_ptr<const SplitPattern> digits_then_gpt2(bool individual);

  /// The end of the piece that starts at `at` (a piece's start; text valid UTF-8, at < text.size()).
  /// *matched (when given) is false for a piece of text between two matches (it then ends where the next
  /// match begins, or at the end of `text`). Throws std::runtime_error when PCRE2 gives up (its match
  /// limit: a pattern that backtracks without end).
  size_t piece_end(std::string_view text, size_t at, Pretokenizer& scratch, bool* matched = nullptr) const;
  /// As data::safe_cut, for this pattern: GPT-2's rule for GPT-2's; for Digits then GPT-2's, GPT-2's
  /// rule or a place next to a number (not between two of a run); for Llama 3's and Qwen2's, a place
  /// between two characters whose classes no alternative can span (a letter then a digit, a digit then a
  /// space, ...; see the .cpp); npos always for another pattern. When `inert` is given, both characters
  /// must also be ones it accepts (the NFC normalizer's characters that normalize apart from their
  /// neighbours).
  size_t safe_cut(std::string_view text, size_t from, size_t to, bool (*inert)(uint32_t) = nullptr) const;

 private:
  explicit SplitPattern(Kind kind) : code_(nullptr), kind_(kind) {}
  void* code_;  // pcre2_code_8; null for GPT-2's and Digits then GPT-2's (the scanner)
  Kind kind_;
};

}  // namespace data
