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
#include <string_view>

namespace data {

/// The pieces, found by a scanner written from the pattern: a table of the Unicode classes it tests
/// (\p{L}, \p{N}, White_Space; built once from PCRE2's own property tables) and the alternatives in
/// order. It cuts exactly as the pattern does (PatternMatcher below, which the tests hold it to), several
/// times faster: one call a piece of a regex engine costs more than the piece's merges.
class Pretokenizer {
 public:
  Pretokenizer();
  /// The end of the piece that starts at `at` in `text` (valid UTF-8; at < text.size()).
  size_t piece_end(std::string_view text, size_t at) const;

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
  const unsigned char* classes_;  // per code point: kOther, kLetter, kNumber, kSpace
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

}  // namespace data
