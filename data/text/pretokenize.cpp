#define PCRE2_CODE_UNIT_WIDTH 8
#include "data/text/pretokenize.h"

#include <pcre2.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace data {
namespace {

// Unicode's White_Space property (PropList.txt; unchanged since Unicode 6.3), as a class body.
#define TRAINER_WS "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"
constexpr const char* kGpt2Pattern =
    "'(?:[sdmt]|ll|ve|re)"        // contractions ('s 't 'd 'm 'll 've 're), lower case only
    "| ?\\p{L}++"                 // a word, with the space before it
    "| ?\\p{N}++"                 // a number, with the space before it
    "| ?[^" TRAINER_WS "\\p{L}\\p{N}]++"  // other characters, with the space before them
    "|[" TRAINER_WS "]+(?![^" TRAINER_WS "])"  // spaces, but the last before a non-space
    "|[" TRAINER_WS "]";          // that last one
#undef TRAINER_WS

pcre2_code* compiled() {
  static pcre2_code* code = [] {
    int error = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code* c = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kGpt2Pattern), PCRE2_ZERO_TERMINATED,
                                  PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
    if (!c) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof message);
      throw std::logic_error(std::string("GPT-2's pattern does not compile: ") + reinterpret_cast<char*>(message));
    }
    // Without the JIT (a PCRE2 built without it) the interpreter gives the same matches, slower.
    pcre2_jit_compile(c, PCRE2_JIT_COMPLETE);
    return c;
  }();
  return code;
}

enum : unsigned char { kOther = 0, kLetter = 1, kNumber = 2, kSpace = 3 };
constexpr uint32_t kCodePoints = 0x110000;

void put_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// The code point at s[i] (valid UTF-8) and its length in bytes.
inline uint32_t decode(const unsigned char* s, size_t i, size_t& len) {
  const unsigned char c = s[i];
  if (c < 0x80) return len = 1, c;
  if (c < 0xE0) return len = 2, ((c & 0x1Fu) << 6) | (s[i + 1] & 0x3Fu);
  if (c < 0xF0) return len = 3, ((c & 0x0Fu) << 12) | ((s[i + 1] & 0x3Fu) << 6) | (s[i + 2] & 0x3Fu);
  return len = 4, ((c & 0x07u) << 18) | ((s[i + 1] & 0x3Fu) << 12) | ((s[i + 2] & 0x3Fu) << 6) | (s[i + 3] & 0x3Fu);
}

// The class of every code point, read off PCRE2's property tables: every code point (surrogates left
// out) written in order, then each run that \p{L}+ or \p{N}+ matches marked. Built once, 1.1 MB.
const unsigned char* class_table() {
  static const std::vector<unsigned char> table = [] {
    std::vector<unsigned char> t(kCodePoints, kOther);
    std::string all;
    all.reserve(4 * kCodePoints);
    for (uint32_t cp = 0; cp < kCodePoints; ++cp)
      if (cp < 0xD800 || cp > 0xDFFF) put_utf8(cp, all);
    for (auto [pattern, cls] : {std::pair<const char*, unsigned char>{"\\p{L}+", kLetter}, {"\\p{N}+", kNumber}}) {
      int error = 0;
      PCRE2_SIZE offset = 0;
      pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern), PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                                       &error, &offset, nullptr);
      if (!code) throw std::logic_error("the Unicode class patterns do not compile");
      pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
      pcre2_match_data* md = pcre2_match_data_create_from_pattern(code, nullptr);
      const auto* s = reinterpret_cast<const unsigned char*>(all.data());
      for (size_t at = 0; at < all.size();) {
        if (pcre2_match(code, s, all.size(), at, PCRE2_NO_UTF_CHECK, md, nullptr) < 0) break;
        const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
        for (size_t i = ov[0], len = 0; i < ov[1]; i += len) t[decode(s, i, len)] = cls;
        at = ov[1];
      }
      pcre2_match_data_free(md);
      pcre2_code_free(code);
    }
    // Unicode's White_Space, as in the pattern above.
    for (uint32_t cp : {0x09u, 0x0Au, 0x0Bu, 0x0Cu, 0x0Du, 0x20u, 0x85u, 0xA0u, 0x1680u, 0x2028u, 0x2029u, 0x202Fu, 0x205Fu, 0x3000u})
      t[cp] = kSpace;
    for (uint32_t cp = 0x2000; cp <= 0x200A; ++cp) t[cp] = kSpace;
    return t;
  }();
  return table.data();
}

bool ascii_space(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }
bool ascii_printable(unsigned char c) { return c > ' ' && c < 0x7f; }

}  // namespace

PatternMatcher::PatternMatcher() {
  pcre2_code* code = compiled();
  match_data_ = pcre2_match_data_create_from_pattern(code, nullptr);
  // A whitespace run is matched greedily and given back one character: the JIT's default stack (32 KiB)
  // holds that for any length, 1 MiB is room to spare.
  stack_ = pcre2_jit_stack_create(32 * 1024, 1024 * 1024, nullptr);
  context_ = pcre2_match_context_create(nullptr);
  if (!match_data_ || !stack_ || !context_) throw std::bad_alloc();
  pcre2_jit_stack_assign(static_cast<pcre2_match_context*>(context_), nullptr, stack_);
}

PatternMatcher::~PatternMatcher() {
  pcre2_match_context_free(static_cast<pcre2_match_context*>(context_));
  pcre2_jit_stack_free(static_cast<pcre2_jit_stack*>(stack_));
  pcre2_match_data_free(static_cast<pcre2_match_data*>(match_data_));
}

size_t PatternMatcher::piece_end(std::string_view text, size_t at) {
  auto* md = static_cast<pcre2_match_data*>(match_data_);
  // PCRE2_NO_UTF_CHECK: the text was made valid UTF-8 first (replace_invalid_utf8). PCRE2_ANCHORED: the
  // next piece starts here; every character starts a piece of some alternative, so this always matches.
  const int rc = pcre2_match(compiled(), reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), at,
                             PCRE2_ANCHORED | PCRE2_NO_UTF_CHECK, md, static_cast<pcre2_match_context*>(context_));
  if (rc < 0) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(rc, message, sizeof message);
    throw std::runtime_error(std::string("pre-tokenizer: ") + reinterpret_cast<char*>(message) + " at byte " +
                             std::to_string(at));
  }
  const size_t end = pcre2_get_ovector_pointer(md)[1];
  if (end <= at) throw std::logic_error("pre-tokenizer: an empty piece at byte " + std::to_string(at));
  return end;
}

// One thread's PCRE2 state for SplitPattern: match data with room for any pattern's captures, a JIT
// stack, and a match limit, so that a pattern which backtracks without end stops with an error.
struct Pretokenizer::MatchState {
  pcre2_match_data* data = pcre2_match_data_create(64, nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 1024 * 1024, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  MatchState() {
    if (!data || !stack || !context) throw std::bad_alloc();
    pcre2_jit_stack_assign(context, nullptr, stack);
    pcre2_set_match_limit(context, 100000000);
  }
  ~MatchState() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(stack);
    pcre2_match_data_free(data);
  }
};

Pretokenizer::Pretokenizer() : classes_(class_table()) {}
Pretokenizer::~Pretokenizer() = default;
Pretokenizer::Pretokenizer(Pretokenizer&&) noexcept = default;

namespace {

// The scanner, for GPT-2's pattern over the whole text (kWhole), or over the text that a Digits
// pre-tokenizer leaves between numbers (kDigits: each \p{N} a piece of its own; kDigitRuns: each run of
// them one piece). Digits' segments end at a number, and GPT-2's pattern sees a segment's end as the end
// of the text: a space before a number is not the number's (" ?\p{N}+" does not reach across), and a
// whitespace run before a number is taken whole (\s+(?!\S) holds at the end of the text).
enum class Scan { kWhole, kDigits, kDigitRuns };

template <Scan kMode>
size_t scan_piece(const unsigned char* classes, std::string_view text, size_t at) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t len = 0;
  const uint32_t c = decode(s, at, len);
  if constexpr (kMode != Scan::kWhole) {
    if (classes[c] == kNumber) {
      if constexpr (kMode == Scan::kDigits) return at + len;
      size_t i = at + len;
      while (i < n && classes[decode(s, i, len)] == kNumber) i += len;
      return i;
    }
  }
  // 1. 's 't 'd 'm 'll 've 're (letters: a number is none of them, so a segment's end changes nothing)
  if (c == '\'' && at + 1 < n) {
    const unsigned char a = s[at + 1], b = at + 2 < n ? s[at + 2] : 0;
    if (a == 's' || a == 't' || a == 'd' || a == 'm') return at + 2;
    if ((a == 'l' && b == 'l') || (a == 'v' && b == 'e') || (a == 'r' && b == 'e')) return at + 3;
  }
  // 2.-4. " ?X++" for X = letters, numbers, others: a space takes the run after it, if one follows (in
  // a Digits segment, not a number: it is the next segment's).
  size_t start = at;
  unsigned char cls = classes[c];
  if (c == ' ' && at + 1 < n) {
    size_t next_len = 0;
    const unsigned char next = classes[decode(s, at + 1, next_len)];
    if (next != kSpace && (kMode == Scan::kWhole || next != kNumber)) start = at + 1, cls = next;
  }
  if (cls != kSpace) {
    size_t i = start;
    while (i < n) {
      const uint32_t cp = decode(s, i, len);
      if (classes[cp] != cls) break;
      i += len;
    }
    return i;
  }
  // 5.-6. Whitespace: the run, less its last character when a non-space follows and the run has two or
  // more (\s+(?!\S)); a single one before a non-space is the last alternative. In a Digits segment a
  // number after the run is the segment's end: the run is taken whole.
  size_t i = at, last = at;
  unsigned char after = kSpace;
  while (i < n) {
    const uint32_t cp = decode(s, i, len);
    after = classes[cp];
    if (after != kSpace) break;
    last = i;
    i += len;
  }
  if (i < n && last > at && (kMode == Scan::kWhole || after != kNumber)) return last;
  return i;
}

}  // namespace

size_t Pretokenizer::piece_end(std::string_view text, size_t at) const { return scan_piece<Scan::kWhole>(classes_, text, at); }

size_t Pretokenizer::piece_end_digits(std::string_view text, size_t at, bool individual) const {
  return individual ? scan_piece<Scan::kDigits>(classes_, text, at) : scan_piece<Scan::kDigitRuns>(classes_, text, at);
}

size_t safe_cut(std::string_view text, size_t from, size_t to) {
  // Why these two places are safe (no piece spans them):
  //  - printable ASCII c0, then whitespace c1: no alternative matches a non-space and then a space (the
  //    optional leading space comes first, the whitespace alternatives take only whitespace).
  //  - whitespace c0 other than ' ', then printable ASCII c1: the whitespace alternatives stop at c1, and
  //    the optional leading space of the others is ' ' only.
  // Either way a piece ends at p, and the next one, which depends only on the text from p on, begins there.
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  for (size_t p = from; p < to; ++p) {
    const unsigned char c0 = s[p - 1], c1 = s[p];
    if ((ascii_printable(c0) && ascii_space(c1)) || (ascii_space(c0) && c0 != ' ' && ascii_printable(c1))) return p;
  }
  return std::string_view::npos;
}

// ---- SplitPattern ---------------------------------------------------------------------------------------

namespace {

// The patterns recognized by their text, as tokenizer.json files write them.
constexpr const char* kTokenizersGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr size_t kMaxPatternBytes = 4096;

struct BadPattern : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Oniguruma's pattern as PCRE2 should read it: \s and \S with U+0085 (Unicode's White_Space; PCRE2's \s
// in UCP mode is \p{Z} and \t\n\v\f\r). \h means a hex digit to Oniguruma and horizontal space to PCRE2,
// and a ^ outside a class looks at the character before (Oniguruma's ^ is a line start): both refused.
std::string onig_to_pcre2(const std::string& p) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[++i];
      if (e == 's') out += in_class ? "\\s\\x{85}" : "[\\s\\x{85}]";
      else if (e == 'S' && !in_class) out += "[^\\s\\x{85}]";
      else if (e == 'S') throw BadPattern("\\S inside a character class is not supported");
      else if (e == 'h' || e == 'H') throw BadPattern(std::string("\\") + e + " (a hex digit to Oniguruma) is not supported");
      else if (e == 'Q') throw BadPattern("\\Q...\\E quoting is not supported");
      else out += {c, e};
      continue;
    }
    if (!in_class && c == '^') throw BadPattern("^ (a line start, which looks at the character before) is not supported");
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];  // a ] first in a class is itself
      continue;
    }
    if (in_class && c == '[' && i + 1 < p.size() && p[i + 1] == ':') {  // [:alpha:] inside a class
      const size_t close = p.find(":]", i + 2);
      if (close != std::string::npos) {
        out += p.substr(i, close + 2 - i);
        i = close + 1;
        continue;
      }
    }
    if (in_class && c == '[') throw BadPattern("a class inside a class (Oniguruma's set operations) is not supported");
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

pcre2_code* compile_split(const std::string& regex) {
  if (regex.size() > kMaxPatternBytes)
    throw BadPattern("a pattern of " + std::to_string(regex.size()) + " bytes (at most 4096)");
  const std::string pcre = onig_to_pcre2(regex);
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pcre.data()), pcre.size(), PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE,
                                   &error, &offset, nullptr);
  if (!code) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof message);
    throw BadPattern(std::string("does not compile: ") + reinterpret_cast<char*>(message));
  }
  uint32_t min_length = 0, look_behind = 0;
  pcre2_pattern_info(code, PCRE2_INFO_MINLENGTH, &min_length);
  pcre2_pattern_info(code, PCRE2_INFO_MAXLOOKBEHIND, &look_behind);
  if (min_length == 0 || look_behind > 0) {
    pcre2_code_free(code);
    throw BadPattern(min_length == 0 ? "it can match the empty text" : "it looks behind (a lookbehind, \\b, \\B, \\A or \\G)");
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  return code;
}

// The code point that ends at s[p - 1] (valid UTF-8, p > 0).
uint32_t code_point_before(const unsigned char* s, size_t p) {
  size_t start = p - 1;
  while (start > 0 && (s[start] & 0xC0) == 0x80) --start;
  size_t len = 0;
  return decode(s, start, len);
}

// Llama 3's and Qwen2's classes: a letter, a number, \r or \n, other whitespace, anything else.
enum SplitClass { kSplitLetter, kSplitNumber, kSplitNewline, kSplitSpace, kSplitOther };
SplitClass split_class(const unsigned char* classes, uint32_t cp) {
  if (cp == '\r' || cp == '\n') return kSplitNewline;
  switch (classes[cp]) {
    case kLetter: return kSplitLetter;
    case kNumber: return kSplitNumber;
    case kSpace: return kSplitSpace;
    default: return kSplitOther;
  }
}

// True when no alternative of Llama 3's pattern (of Qwen2's, with `single_digits`) matches across the
// boundary between c0 and c1, a letter etc. by their classes. The pairs an alternative can span:
//   '(?i:s|t|re|ve|m|ll|d)   other-letter, letter-letter
//   [^\r\n\p{L}\p{N}]?\p{L}+  other-letter, space-letter, letter-letter
//   \p{N}{1,3}               number-number (Llama 3 only)
//   " ?[^\s\p{L}\p{N}]+[\r\n]*"  ' '-other, other-other, other-newline, newline-newline
//   \s*[\r\n]+, \s+(?!\S), \s+ whitespace-whitespace (spaces and newlines)
// Every character begins a match of some alternative, and none looks behind, so a boundary that no match
// can span is where one piece ends and the next begins, whatever came before.
bool split_pair_safe(SplitClass a, SplitClass b, uint32_t c0, bool single_digits) {
  switch (a) {
    case kSplitLetter: return b != kSplitLetter;
    case kSplitNumber: return b != kSplitNumber || single_digits;
    case kSplitOther: return b == kSplitNumber || b == kSplitSpace;
    case kSplitSpace: return b == kSplitNumber || (b == kSplitOther && c0 != ' ');
    case kSplitNewline: return b == kSplitLetter || b == kSplitNumber || b == kSplitOther;
  }
  return false;
}

// Digits then GPT-2's pattern (kDigitsGpt2, kDigitRunsGpt2): a place between c0 and c1 is safe when
//   (a) c0 or c1 is a number (\p{N}: the class Digits tests, Rust's char::is_numeric), with digits apart,
//       or exactly one of the two is, with runs. Digits cuts there whatever else the text holds: it
//       looks at each character alone (with runs, at whether its neighbour is a number too), so the
//       Digits pieces of text[p, ...) are those of the whole from p on, and those of text[0, p) the
//       whole's before p. GPT-2's pattern then cuts each Digits piece by itself: a number piece matches
//       \p{N}+ whole (" ?\p{N}+" with no space), and a segment between numbers is cut the same wherever
//       the text around it ends, since its pieces depend only on the segment.
//   (b) neither is a number and GPT-2's rule holds (ASCII printable then whitespace, or whitespace other
//       than ' ' then ASCII printable). c0 and c1 are then in one segment, whose own pieces GPT-2's
//       pattern finds: a piece ends at p within it (GPT-2's argument, data::safe_cut), and the segment
//       from p on is a segment of text[p, ...) (it ends at the same number or at the end, and Digits
//       begins a segment at the start of any text).
// Each match depends only on the text from its start on (no look-behind), so either way text[0, p) and
// text[p, ...) pre-tokenized apart give the pieces of the whole.
bool digits_pair_safe(bool number0, bool number1, bool individual) {
  return individual ? (number0 || number1) : number0 != number1;
}

}  // namespace

SplitPattern::SplitPattern(const std::string& regex) : code_(nullptr), kind_(Kind::kOther) {
  if (regex == kTokenizersGpt2Pattern) {
    kind_ = Kind::kGpt2;
    return;
  }
  if (regex == kLlama3Pattern) kind_ = Kind::kLlama3;
  if (regex == kQwen2Pattern) kind_ = Kind::kQwen2;
  try {
    code_ = compile_split(regex);
  } catch (const BadPattern& e) {
    throw std::runtime_error("the Split pattern '" + regex.substr(0, 60) + (regex.size() > 60 ? "...'" : "'") + ": " + e.what());
  }
}

SplitPattern::~SplitPattern() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

std::shared_ptr<const SplitPattern> SplitPattern::gpt2() {
  static const auto pattern = std::make_shared<const SplitPattern>(kTokenizersGpt2Pattern);
  return pattern;
}

std::shared_ptr<const SplitPattern> SplitPattern::digits_then_gpt2(bool individual) {
  static const std::shared_ptr<const SplitPattern> apart(new SplitPattern(Kind::kDigitsGpt2));
  static const std::shared_ptr<const SplitPattern> runs(new SplitPattern(Kind::kDigitRunsGpt2));
  return individual ? apart : runs;
}

size_t SplitPattern::piece_end(std::string_view text, size_t at, Pretokenizer& scratch, bool* matched) const {
  if (matched) *matched = true;
  if (kind_ == Kind::kDigitsGpt2 || kind_ == Kind::kDigitRunsGpt2) return scratch.piece_end_digits(text, at, kind_ == Kind::kDigitsGpt2);
  if (!code_) return scratch.piece_end(text, at);
  if (!scratch.state_) scratch.state_ = std::make_unique<Pretokenizer::MatchState>();
  auto& st = *scratch.state_;
  // Unanchored, as tokenizers' find_iter: the text before the next match is a piece of its own.
  const int rc = pcre2_match(static_cast<pcre2_code*>(code_), reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), at,
                             PCRE2_NO_UTF_CHECK, st.data, st.context);
  if (rc == PCRE2_ERROR_NOMATCH) {
    if (matched) *matched = false;
    return text.size();
  }
  if (rc < 0) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(rc, message, sizeof message);
    throw std::runtime_error(std::string("pre-tokenizer: ") + reinterpret_cast<char*>(message) + " at byte " + std::to_string(at));
  }
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.data);
  if (ov[0] > at) {
    if (matched) *matched = false;
    return ov[0];
  }
  if (ov[1] <= at) throw std::logic_error("pre-tokenizer: an empty piece at byte " + std::to_string(at));
  return ov[1];
}

size_t SplitPattern::safe_cut(std::string_view text, size_t from, size_t to, bool (*inert)(uint32_t)) const {
  if (kind_ == Kind::kOther) return std::string_view::npos;
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const unsigned char* classes = class_table();
  for (size_t p = from; p < to; ++p) {
    if ((s[p] & 0xC0) == 0x80) continue;  // inside a character
    if (kind_ == Kind::kGpt2 && !inert) {
      const unsigned char c0 = s[p - 1], c1 = s[p];
      if ((ascii_printable(c0) && ascii_space(c1)) || (ascii_space(c0) && c0 != ' ' && ascii_printable(c1))) return p;
      continue;
    }
    size_t len = 0;
    const uint32_t c0 = code_point_before(s, p), c1 = decode(s, p, len);
    if (inert && !((c0 < 0x80 || inert(c0)) && inert(c1))) continue;
    if (kind_ == Kind::kDigitsGpt2 || kind_ == Kind::kDigitRunsGpt2) {
      if (digits_pair_safe(classes[c0] == kNumber, classes[c1] == kNumber, kind_ == Kind::kDigitsGpt2)) return p;
    }
    if (kind_ != Kind::kLlama3 && kind_ != Kind::kQwen2) {  // GPT-2's rule, by characters
      if ((c0 < 0x80 && ascii_printable(c0) && c1 < 0x80 && ascii_space(c1)) ||
          (c0 < 0x80 && ascii_space(c0) && c0 != ' ' && c1 < 0x80 && ascii_printable(c1)))
        return p;
      continue;
    }
    if (split_pair_safe(split_class(classes, c0), split_class(classes, c1), c0, kind_ == Kind::kQwen2)) return p;
  }
  return std::string_view::npos;
}

}  // namespace data
