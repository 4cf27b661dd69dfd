// GPT-2's byte-level BPE (data/text/) against its references: tiktoken's `gpt2` encoding and Hugging Face
// tokenizers, through tests/ref/tokenizer_ref.py (the 2.11 environment has both; elsewhere those tests
// skip with the reason), on hand-picked texts in many scripts and on random ones; the scanner against
// the pattern it was written from (PCRE2); and `convert-text --tokenizer` against tiktoken, file by file.
#include "data/files/token_h5.h"
#include "data/text/bpe.h"
#include "data/text/pretokenize.h"
#include "data/text/tokenizer.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <random>

namespace test_tokenizer {
namespace {

namespace fs = std::filesystem;

std::string ref_script() { return testutil::source_dir() + "/tests/ref/tokenizer_ref.py"; }

// GPT-2's rank file, as the reference Python finds it (openai-whisper's copy); "" when it has none.
const std::string& rank_file() {
  static const std::string path = [] {
    auto r = testutil::run(testutil::python() + " " + ref_script() + " where");
    if (r.exit_code != 0) return std::string();
    std::string p = r.output.substr(0, r.output.find('\n'));
    return fs::exists(p) ? p : std::string();
  }();
  return path;
}

#define SKIP_WITHOUT_TIKTOKEN()                                                                             \
  if (rank_file().empty())                                                                                  \
  GTEST_SKIP() << "the reference Python " << testutil::python()                                             \
               << " has no tiktoken or no openai-whisper (scripts/install-torch.sh adds both to the 2.11 venv)"

std::string base64(const std::string& s) {
  static const char* abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < s.size(); i += 3) {
    const uint32_t v = (uint8_t(s[i]) << 16) | (uint8_t(s[i + 1]) << 8) | uint8_t(s[i + 2]);
    for (int k = 3; k >= 0; --k) out.push_back(abc[(v >> (6 * k)) & 63]);
  }
  if (i + 1 == s.size()) {
    const uint32_t v = uint8_t(s[i]) << 16;
    out += {abc[v >> 18], abc[(v >> 12) & 63], '=', '='};
  } else if (i + 2 == s.size()) {
    const uint32_t v = (uint8_t(s[i]) << 16) | (uint8_t(s[i + 1]) << 8);
    out += {abc[v >> 18], abc[(v >> 12) & 63], abc[(v >> 6) & 63], '='};
  }
  return out;
}

std::string unbase64(const std::string& s) {
  std::string out;
  uint32_t v = 0;
  int bits = 0;
  for (char c : s) {
    const char* abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    const char* p = std::strchr(abc, c);
    if (c == '=' || !p) break;
    v = (v << 6) | uint32_t(p - abc);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(char((v >> bits) & 0xff));
    }
  }
  return out;
}

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) s += char(cp);
  else if (cp < 0x800) s += {char(0xC0 | (cp >> 6)), char(0x80 | (cp & 0x3F))};
  else if (cp < 0x10000) s += {char(0xE0 | (cp >> 12)), char(0x80 | ((cp >> 6) & 0x3F)), char(0x80 | (cp & 0x3F))};
  else s += {char(0xF0 | (cp >> 18)), char(0x80 | ((cp >> 12) & 0x3F)), char(0x80 | ((cp >> 6) & 0x3F)), char(0x80 | (cp & 0x3F))};
  return s;
}

// Texts that each exercise a rule: the issue's list (ASCII, accented Latin, CJK, emoji, runs of spaces,
// tabs and newlines, digits, contractions) and the corners of the pattern.
std::vector<std::string> hand_texts() {
  return {
      "Hello, world! This is GPT-2's tokenizer.",
      "",
      " ",
      "   leading spaces and trailing   ",
      "tabs\tand\t\ttabs\n\nnewlines\r\n\r\nCRLF\n",
      "Ça va? Über naïve façade, Øresund, São Paulo, Dvořák, Łódź, ĳ",
      "日本語のテキストと中文文本，한국어 텍스트。",
      "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and ❤️",
      "digits 0 12 345 6789 3.14159 1,000,000 ٣٤٥ ५६७ ²³ ½",
      "don't won't I'm you're we've they'll she'd it's DON'T I'M 'S ''s '''",
      "     \n     \n\t \t \u00a0nbsp\u00a0\u00a0 en\u2002space ideographic\u3000space",
      "next line\u0085here, line sep\u2028and para sep\u2029done",
      "Ελληνικά, русский текст, עברית, العربية, हिन्दी, தமிழ், ไทย",
      "combining: e\u0301 a\u0308 and zero width\u200bspace\u200djoiner",
      "code: for (int i = 0; i < n; ++i) { x += a[i] * b[i]; }  // comment",
      "<|endoftext|> is plain text to encode_ordinary",
      [] {
        const char with_nul[] = "NUL\0byte and \x01\x7f controls";
        return std::string(with_nul, sizeof with_nul - 1);
      }(),
      "\xff\xfe invalid \xc3\x28 utf8 \xe2\x82 trunc \xf0\x9f\x98 \xed\xa0\x80 surrogate \xf4\x90\x80\x80 big \xc0\xaf overlong \x80",
      std::string(3000, 'a'),
      std::string(3000, ' ') + "x",
      "x" + std::string(2000, '\n'),
      std::string(2000, '9'),
      std::string(2000, '!') + "?",
  };
}

// Random texts from a mix of every class the pattern tells apart, and of invalid bytes.
std::vector<std::string> random_texts(int count, uint32_t seed) {
  std::mt19937 rng(seed);
  const std::vector<std::vector<uint32_t>> pools = {
      {'a', 'b', 'Z', 's', 't', 'l', 'v', 'e', 'r', 'd', 'm'},
      {'0', '7', 0x663, 0x96B, 0xB2, 0xBD, 0x2167},
      {' ', ' ', ' ', '\t', '\n', '\r', 0x0B, 0x0C, 0x85, 0xA0, 0x1680, 0x2003, 0x2028, 0x202F, 0x205F, 0x3000},
      {'\'', '!', '.', ',', '-', '_', '(', 0x301, 0x200B, 0x200D, 0x1F600, 0x1F3FD, 0xFE0F, 0x0, 0x7F, 0xE000},
      {0xE9, 0x4E2D, 0x65E5, 0xAC00, 0x3042, 0x5D0, 0x627, 0x915, 0x93F, 0x3B1, 0x10400, 0x20000, 0xD7A3},
  };
  std::vector<std::string> out;
  for (int t = 0; t < count; ++t) {
    std::string s;
    const int n = std::uniform_int_distribution<int>(1, 120)(rng);
    for (int i = 0; i < n; ++i) {
      const int pick = std::uniform_int_distribution<int>(0, 19)(rng);
      if (pick == 19) {  // an invalid byte or a cut-off sequence
        const char bad[] = {char(0x80), char(0xC3), char(0xE2), char(0xF0), char(0xFF), char(0xED)};
        s += bad[std::uniform_int_distribution<int>(0, 5)(rng)];
        continue;
      }
      const auto& pool = pools[pick % pools.size()];
      s += utf8(pool[std::uniform_int_distribution<size_t>(0, pool.size() - 1)(rng)]);
    }
    out.push_back(s);
  }
  return out;
}

std::vector<int32_t> ids_of(const nlohmann::json& j) { return j.get<std::vector<int32_t>>(); }

// A small rank file: the 256 bytes and a few merges of English, whitespace and CJK.
std::string mini_ranks() {
  std::string s;
  int rank = 0;
  for (int b = 0; b < 256; ++b) s += base64(std::string(1, char(b))) + " " + std::to_string(rank++) + "\n";
  for (const char* t : {"th", "he", "the", " t", " the", "  ", "    ", "\n\n", "in", "ing", " a", "ab", "\xE4\xB8", "\xE4\xB8\xAD", "\xC3\xA9", "99"})
    s += base64(t) + " " + std::to_string(rank++) + "\n";
  return s;
}

// ---- tokenizer.json of the Llama 3 and Qwen2 kinds ------------------------------------------------------

const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::string hf_ref_script() { return testutil::source_dir() + "/tests/ref/tokenizer_hf_ref.py"; }

#define SKIP_WITHOUT_HF_TOKENIZERS()                                                                        \
  if (!testutil::missing_module_of(hf_ref_script()).empty())                                                \
  GTEST_SKIP() << "the reference Python " << testutil::python() << " has no module "                        \
               << testutil::missing_module_of(hf_ref_script()) << " (scripts/install-torch.sh adds it to the 2.11 venv)"

// GPT-2's byte-to-unicode alphabet: the character that stands for byte b in a tokenizer.json.
std::string byte_char(int b) {
  int extra = 0;
  for (int x = 0; x < 256; ++x) {
    const bool printable = (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF);
    if (x == b) return utf8(printable ? x : 256 + extra);
    if (!printable) ++extra;
  }
  return "";
}
std::string alphabet(const std::string& bytes) {
  std::string s;
  for (unsigned char c : bytes) s += byte_char(c);
  return s;
}

// A small tokenizer.json by hand: byte b is id b, the merges below (ids 256 on), <|eot_id|> 300 and
// <|begin_of_text|> 301 (the post-processor's BOS), the given pattern and normalizer.
nlohmann::json hand_tokenizer(const std::string& pattern, bool nfc) {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  const std::vector<std::pair<std::string, std::string>> merges = {{"D", "O"}, {"DO", "N"}, {"'", "T"}, {"1", "2"}, {"12", "3"}, {" ", "w"}, {" w", "e"}};
  nlohmann::json m = nlohmann::json::array();
  int id = 256;
  for (const auto& [a, b] : merges) {
    vocab[alphabet(a + b)] = id++;
    m.push_back(nlohmann::json::array({alphabet(a), alphabet(b)}));
  }
  using J = nlohmann::json;
  J split = {{"type", "Split"}, {"pattern", {{"Regex", pattern}}}, {"behavior", "Isolated"}, {"invert", false}};
  J bytes = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}};
  J bos = {{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}};
  J seq = {{"Sequence", {{"id", "A"}, {"type_id", 0}}}};
  J templ = {{"type", "TemplateProcessing"}, {"single", J::array({bos, seq})}};
  J j = J::object();
  j["version"] = "1.0";
  j["added_tokens"] = J::array({J{{"id", 300}, {"content", "<|eot_id|>"}, {"special", true}},
                                J{{"id", 301}, {"content", "<|begin_of_text|>"}, {"special", true}}});
  j["normalizer"] = nfc ? J{{"type", "NFC"}} : J();
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", J::array({split, bytes})}};
  j["post_processor"] = {{"type", "Sequence"}, {"processors", J::array({J{{"type", "ByteLevel"}}, templ})}};
  j["model"] = {{"type", "BPE"}, {"byte_fallback", false}, {"ignore_merges", false}, {"vocab", vocab}, {"merges", m}};
  return j;
}

data::Tokenizer load_json(const testutil::TempDir& dir, const std::string& name, const nlohmann::json& j) {
  testutil::write_file(dir / name, j.dump());
  return data::Tokenizer::load((dir / name).string());
}

// hand_tokenizer's vocabulary with SmolLM2's pre-tokenizer (Digits, then ByteLevel with GPT-2's pattern),
// no BOS (a ByteLevel post-processor), and two more merges: " 1" 263 and "  " 264.
nlohmann::json hand_digits_tokenizer(bool individual, bool nfc) {
  using J = nlohmann::json;
  J j = hand_tokenizer("unused", nfc);
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers", J::array({J{{"type", "Digits"}, {"individual_digits", individual}},
                                                    J{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}})}};
  j["post_processor"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}};
  int id = 263;
  for (const auto& [a, b] : std::vector<std::pair<std::string, std::string>>{{" ", "1"}, {" ", " "}}) {
    j["model"]["vocab"][alphabet(a + b)] = id++;
    j["model"]["merges"].push_back(J::array({alphabet(a), alphabet(b)}));
  }
  return j;
}

// Texts for the Llama 3 and Qwen2 patterns: contractions in any case, long numbers, newline runs, Unicode
// spaces, combining accents (NFC), code, and the special tokens' texts.
std::vector<std::string> split_texts() {
  return {
      "DON'T I'M YOU'RE WE'VE THEY'LL SHE'D IT'S don't 'S 'ſ 'Ll x'ǲa",
      "1234567 89 3.14159 1,000,000 ١٢٣٤٥ 12a34",
      "line\r\nline\n\n\nline\r\r\n  \n\t\n x\n",
      "a\u0085b !\u0085 \u0085\u0085x \u00a0\u00a0a tab\t\tx \u3000y\u2028z",
      "caf\u00e9 cafe\u0301 A\u030a \u212b e\u0301\u0301 \u1100\u1161\u11a8 A\u0327\u0301",
      "<|begin_of_text|>Hello<|eot_id|> <|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
      "def f(x):\n    return x**2  # square\n\n\tif (a != b) { c += 1; }\r\n",
      "emoji 😀👍🏽 👨‍👩‍👧‍👦 日本語のテキスト 中文文本，한국어 Ελληνικά русский",
      "!!!\n\n ?? ...\r\n",
  };
}

std::vector<int64_t> all_ids(const data::TokenConversion& conv) {
  std::vector<int64_t> got;
  for (const auto& path : {conv.train_path, conv.val_path}) {
    if (path.empty()) continue;
    data::TokenDataset ds(path, true);
    std::vector<int64_t> part(ds.size());
    ds.read(0, ds.size(), part.data());
    got.insert(got.end(), part.begin(), part.end());
  }
  return got;
}

}  // namespace

TEST(Tokenizer, TheScannerCutsAsThePattern) {
  data::Pretokenizer scanner;
  data::PatternMatcher pattern;
  auto texts = hand_texts();
  for (auto& t : random_texts(3000, 7)) texts.push_back(t);
  for (const auto& raw : texts) {
    const std::string text = data::replace_invalid_utf8(raw);
    for (size_t at = 0; at < text.size();) {
      const size_t end = scanner.piece_end(text, at);
      ASSERT_EQ(end, pattern.piece_end(text, at)) << "at byte " << at << " of '" << text << "'";
      at = end;
    }
  }
}

TEST(Tokenizer, ASafeCutIsWhereAPieceBegins) {
  data::Pretokenizer scanner;
  int cuts = 0;
  for (const auto& raw : random_texts(2000, 11)) {
    const std::string text = data::replace_invalid_utf8(raw);
    std::vector<bool> starts(text.size() + 1, false);
    for (size_t at = 0; at < text.size(); at = scanner.piece_end(text, at)) starts[at] = true;
    for (size_t from = 1; from < text.size();) {
      const size_t p = data::safe_cut(text, from, text.size());
      if (p == std::string_view::npos) break;
      ASSERT_TRUE(starts[p]) << "byte " << p << " of '" << text << "'";
      ++cuts;
      from = p + 1;
    }
  }
  EXPECT_GT(cuts, 1000);
}

TEST(Tokenizer, ReplacesInvalidUtf8AsPythonDoes) {
  // Python: b.decode("utf-8", errors="replace"), written out by hand (one U+FFFD per maximal subpart).
  const std::string R = "\xEF\xBF\xBD";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"ok \xC3\xA9", "ok \xC3\xA9"},
      {"\xC3\x28", R + "("},
      {"\xE2\x82", R},
      {"\xE2\x82\x28", R + "("},
      {"\xF0\x9F\x98", R},
      {"\xED\xA0\x80", R + R + R},          // a surrogate: ED then A0 is out of range
      {"\xF4\x90\x80\x80", R + R + R + R},  // over U+10FFFF
      {"\xC0\xAF", R + R},                  // overlong
      {"\xE0\x80\x80", R + R + R},          // overlong three-byte
      {"\x80\xBF", R + R},
      {"\xFF", R},
      {"a\xF0\x9F\x98\x80z", "a\xF0\x9F\x98\x80z"},
  };
  for (const auto& [in, want] : cases) {
    int64_t replaced = -1;
    EXPECT_EQ(data::replace_invalid_utf8(in, &replaced), want) << base64(in);
  }
}

TEST(Tokenizer, Gpt2IdsEqualTiktokenAndTokenizersOnEveryTestText) {
  SKIP_WITHOUT_TIKTOKEN();
  testutil::TempDir dir("tokenizer_ref");
  auto texts = hand_texts();
  for (auto& t : random_texts(300, 3)) texts.push_back(t);
  nlohmann::json in = nlohmann::json::array();
  for (const auto& t : texts) in.push_back(base64(t));
  testutil::write_file(dir / "texts.json", in.dump());
  const std::string py = testutil::python() + " " + ref_script();
  auto r = testutil::run(py + " hf-json --out " + (dir / "tokenizer.json").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  fs::create_directories(dir / "strings");
  r = testutil::run(py + " hf-json --string-merges --out " + (dir / "strings" / "tokenizer.json").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = testutil::run(py + " encode --texts " + (dir / "texts.json").string() + " --tokenizer-json " + (dir / "tokenizer.json").string() +
                    " --out " + (dir / "ref.json").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto ref = nlohmann::json::parse(testutil::read_file(dir / "ref.json"));

  const auto tiktoken_form = data::Tokenizer::load(rank_file());
  const auto hf_form = data::Tokenizer::load((dir / "tokenizer.json").string());
  const auto hf_strings = data::Tokenizer::load((dir / "strings" / "tokenizer.json").string());
  EXPECT_EQ(tiktoken_form.vocab_size(), 50257);
  EXPECT_EQ(tiktoken_form.special("<|endoftext|>"), 50256);
  EXPECT_EQ(tiktoken_form.name(), "gpt2");
  EXPECT_EQ(hf_form.vocab_size(), 50257);
  EXPECT_EQ(hf_form.special("<|endoftext|>"), 50256);
  EXPECT_EQ(hf_form.name(), fs::path(dir.str()).filename().string());  // the folder of tokenizer.json
  size_t tokens = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const auto want = ids_of(ref["tiktoken"][i]);
    const auto ours = tiktoken_form.encode(texts[i]);
    ASSERT_EQ(ours, want) << "text " << i << ": '" << texts[i] << "'";
    EXPECT_EQ(hf_form.encode(texts[i]), ids_of(ref["hf"][i])) << "text " << i;
    EXPECT_EQ(hf_strings.encode(texts[i]), ids_of(ref["hf"][i])) << "text " << i;
    // Decoding gives back the text after replacement, byte for byte.
    EXPECT_EQ(tiktoken_form.decode(ours), unbase64(ref["replaced"][i].get<std::string>())) << "text " << i;
    EXPECT_EQ(data::replace_invalid_utf8(texts[i]), unbase64(ref["replaced"][i].get<std::string>())) << "text " << i;
    tokens += ours.size();
  }
  EXPECT_GT(tokens, 10000u);
}

TEST(Tokenizer, ALongPieceMergesAsTiktokenDoes) {
  SKIP_WITHOUT_TIKTOKEN();
  // One piece of 20,000 letters: the heap's merge order against tiktoken's scan.
  testutil::TempDir dir("tokenizer_long");
  std::mt19937 rng(5);
  std::string word;
  for (int i = 0; i < 20000; ++i) word += "etaoinshrdlu"[std::uniform_int_distribution<int>(0, 11)(rng)];
  nlohmann::json in = nlohmann::json::array({base64(word), base64(" " + word)});
  testutil::write_file(dir / "texts.json", in.dump());
  auto r = testutil::run(testutil::python() + " " + ref_script() + " encode --texts " + (dir / "texts.json").string() + " --out " +
                         (dir / "ref.json").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto ref = nlohmann::json::parse(testutil::read_file(dir / "ref.json"));
  const auto tok = data::Tokenizer::load(rank_file());
  EXPECT_EQ(tok.encode(word), ids_of(ref["tiktoken"][0]));
  EXPECT_EQ(tok.encode(" " + word), ids_of(ref["tiktoken"][1]));
}

TEST(Tokenizer, TheByteTokenizerIsTheBytes) {
  const auto b = data::Tokenizer::bytes();
  EXPECT_TRUE(b.is_bytes());
  EXPECT_EQ(b.vocab_size(), 256);
  EXPECT_EQ(b.special("<|endoftext|>"), -1);
  EXPECT_EQ(b.encode("a\xff"), (std::vector<int32_t>{'a', 0xff}));
  EXPECT_EQ(b.decode({'h', 'i'}), "hi");
  EXPECT_THROW(b.decode({256}), std::out_of_range);
}

TEST(Tokenizer, ABadFileGetsOneLineNamingIt) {
  testutil::TempDir dir("tokenizer_bad");
  auto error = [&](const std::string& name, const std::string& content) {
    testutil::write_file(dir / name, content);
    try {
      data::Tokenizer::load((dir / name).string());
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("(loaded)");
  };
  auto all_bytes = [] {
    std::string s;
    for (int b = 0; b < 256; ++b) s += base64(std::string(1, char(b))) + " " + std::to_string(b) + "\n";
    return s;
  };
  const std::string p = "tokenizer '" + dir.str() + "/";
  EXPECT_EQ(error("a.tiktoken", all_bytes() + base64("ab") + " 256\n"), "(loaded)");
  EXPECT_EQ(error("b.tiktoken", "IQ== 0\nnot base64 1\n"), p + "b.tiktoken': line 2: expected '<base64 token> <rank>'");
  EXPECT_EQ(error("c.tiktoken", "IQ== 0\nI*== 1\n"), p + "c.tiktoken': line 2: the token is not valid base64");
  EXPECT_EQ(error("d.tiktoken", "IQ== 0\nIg== 0\n"), p + "d.tiktoken': line 2: id 0 is given twice");
  EXPECT_EQ(error("e.tiktoken", "IQ== 0\nIQ== 1\n"), p + "e.tiktoken': line 2: a token is given twice (id 1)");
  EXPECT_EQ(error("f.tiktoken", "IQ== 0\n"), p + "f.tiktoken': byte 0 has no token of its own (a byte-level BPE needs all 256)");
  EXPECT_EQ(error("g.tiktoken", "IQ== 99999999\n"), p + "g.tiktoken': line 1: id 99999999 leaves a gap of more than 65536 ids after the 0 tokens before it");
  EXPECT_EQ(error("h.tiktoken", "IQ== -1\n"), p + "h.tiktoken': line 1: the rank '-1' is not a number below 2^31");
  EXPECT_EQ(error("i.tiktoken", ""), p + "i.tiktoken': no tokens (a tiktoken rank file has '<base64 token> <rank>' lines)");
  EXPECT_EQ(error("j.json", "{\"model\": {\"type\": \"WordPiece\"}}"), p + "j.json': the model is \"WordPiece\"; only BPE is supported");
  EXPECT_EQ(error("k.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": []}, \"pre_tokenizer\": {\"type\": \"Metaspace\"}}"),
            p + "k.json': pre_tokenizer is \"Metaspace\"; supported: ByteLevel (GPT-2's), or a Sequence of Split and ByteLevel (Llama 3's, Qwen2's) or of Digits and ByteLevel (SmolLM2's)");
  EXPECT_EQ(error("l.json", "{\"model\": "), p + "l.json': not valid JSON: " +
                                                 [] {
                                                   try {
                                                     const auto never = nlohmann::json::parse("{\"model\": ");
                                                     (void)never;
                                                   } catch (const nlohmann::json::exception& e) {
                                                     return std::string(e.what());
                                                   }
                                                   return std::string();
                                                 }());
  EXPECT_EQ(error("m.json", "{\"normalizer\": {\"type\": \"Lowercase\"}, \"model\": {\"type\": \"BPE\"}}"), p + "m.json': a normalizer (Lowercase) is not supported (only NFC is)");
  // A normalizer that is not an object (found by fuzz_tokenizer: it was nlohmann's type_error, not this line).
  EXPECT_EQ(error("m2.json", "{\"normalizer\": 18, \"model\": {\"type\": \"BPE\"}}"), p + "m2.json': a normalizer (18) is not supported (only NFC is)");
  EXPECT_EQ(error("m3.json", "{\"normalizer\": {\"type\": 7}, \"model\": {\"type\": \"BPE\"}}"), p + "m3.json': a normalizer (7) is not supported (only NFC is)");
  EXPECT_EQ(error("n.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"\\u4e2d\": 0}, \"merges\": []}, \"pre_tokenizer\": {\"type\": \"ByteLevel\"}}"),
            p + "n.json': model.vocab: '\xE4\xB8\xAD' has a character outside GPT-2's byte-level alphabet");
  EXPECT_EQ([&] {
    try {
      data::Tokenizer::load((dir / "missing").string());
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string();
  }(), p + "missing': no such file");
}

TEST(Tokenizer, ALlamaOrQwen2TokenizerJsonByHand) {
  // Ids worked out by hand: byte b is id b; merges DO 256, DON 257, 'T 258, 12 259, 123 260, " w" 261,
  // " we" 262. Llama 3 cuts "DON'T 1234567 we" into DON | 'T | " " | 123 | 456 | 7 | " we"
  // (the contraction in upper case; numbers by three), Qwen2 the number digit by digit.
  testutil::TempDir dir("tokenizer_hand");
  const auto llama = load_json(dir, "llama.json", hand_tokenizer(kLlama3Pattern, false));
  const auto qwen = load_json(dir, "qwen.json", hand_tokenizer(kQwen2Pattern, true));
  EXPECT_EQ(llama.encode("DON'T 1234567 we"), (std::vector<int32_t>{257, 258, ' ', 260, '4', '5', '6', '7', 262}));
  EXPECT_EQ(qwen.encode("DON'T 1234567 we"), (std::vector<int32_t>{257, 258, ' ', '1', '2', '3', '4', '5', '6', '7', 262}));
  // "\t\n\n x": \s*[\r\n]+ takes "\t\n\n", then " x" is a word with its space.
  EXPECT_EQ(llama.encode("\t\n\n x"), (std::vector<int32_t>{'\t', '\n', '\n', ' ', 'x'}));
  // NFC: e + U+0301 is é (C3 A9) for Qwen2's normalizer, two characters for Llama 3's none.
  EXPECT_EQ(qwen.encode("e\xCC\x81"), (std::vector<int32_t>{0xC3, 0xA9}));
  EXPECT_EQ(llama.encode("e\xCC\x81"), (std::vector<int32_t>{'e', 0xCC, 0x81}));
  // Added tokens: text to encode, ids to encode_with_specials; the post-processor's BOS; the vocabulary.
  EXPECT_EQ(llama.encode("<|eot_id|>").size(), 10u);
  EXPECT_EQ(llama.encode_with_specials("we<|eot_id|><|begin_of_text|> we"), (std::vector<int32_t>{'w', 'e', 300, 301, 262}));
  EXPECT_EQ(llama.special("<|eot_id|>"), 300);
  EXPECT_EQ(llama.bos_id(), 301);
  EXPECT_EQ(llama.vocab_size(), 302);
  EXPECT_EQ(llama.decode(std::vector<int32_t>{257, 258, 300}), "DON'T<|eot_id|>");
  // The same ids for the same pieces from a pattern that is neither (matched as it is, by PCRE2): a
  // Split that leaves text between its matches (here, letters) makes that text a piece too.
  const auto other = load_json(dir, "other.json", hand_tokenizer(R"(\p{N}{1,3}|\s+)", false));
  EXPECT_EQ(other.encode("DON 1234567"), (std::vector<int32_t>{257, ' ', 260, '4', '5', '6', '7'}));
  EXPECT_EQ(other.bos_id(), 301);
  // GPT-2's own pattern in a Split is GPT-2's scanner.
  const auto gpt2 = load_json(dir, "gpt2.json", hand_tokenizer(R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)", false));
  EXPECT_EQ(gpt2.encode("DON'T 1234567 we"), (std::vector<int32_t>{257, '\'', 'T', ' ', 260, '4', '5', '6', '7', 262}));
  EXPECT_EQ(data::Tokenizer::bytes().bos_id(), -1);
}

TEST(Tokenizer, ASmolLM2TokenizerJsonByHand) {
  // Digits then GPT-2's pattern, ids by hand (hand_digits_tokenizer: byte b is id b; DO 256, DON 257,
  // 'T 258, 12 259, 123 260, " w" 261, " we" 262, " 1" 263, "  " 264). "DON'T 1234567 we" is cut into
  // DON | ' | T | " " | 1 | 2 | ... | 7 | " we": GPT-2's contractions are lower case only, and the space
  // before the number ends its stretch (GPT-2's pattern alone would give " 1234567", merged " 1" first).
  testutil::TempDir dir("tokenizer_hand_digits");
  const auto apart = load_json(dir, "apart.json", hand_digits_tokenizer(true, false));
  const auto runs = load_json(dir, "runs.json", hand_digits_tokenizer(false, false));
  EXPECT_EQ(apart.encode("DON'T 1234567 we"), (std::vector<int32_t>{257, '\'', 'T', ' ', '1', '2', '3', '4', '5', '6', '7', 262}));
  // Runs: "1234567" one piece, merged 12 then 123.
  EXPECT_EQ(runs.encode("DON'T 1234567 we"), (std::vector<int32_t>{257, '\'', 'T', ' ', 260, '4', '5', '6', '7', 262}));
  // Two spaces before a number are one piece ("  " 264: the stretch ends there as a text would), not
  // " " and " 1" as GPT-2's pattern alone cuts them.
  EXPECT_EQ(apart.encode("a  1"), (std::vector<int32_t>{'a', 264, '1'}));
  EXPECT_EQ(runs.encode(" 12\n"), (std::vector<int32_t>{' ', 259, '\n'}));
  // Numbers are Unicode's (Rust's char::is_numeric, as tokenizers' Digits tests): superscript two
  // (U+00B2, No), Arabic-Indic three (U+0663, Nd), one half (U+00BD, No), Roman twelve (U+216B, Nl).
  EXPECT_EQ(apart.encode("x\u00b2\u0663y \u00bd\u216b"),
            (std::vector<int32_t>{'x', 0xC2, 0xB2, 0xD9, 0xA3, 'y', ' ', 0xC2, 0xBD, 0xE2, 0x85, 0xAB}));
  // Each of those a piece of its own: "12" is not merged; as one run it is.
  EXPECT_EQ(apart.encode("\u00b212"), (std::vector<int32_t>{0xC2, 0xB2, '1', '2'}));
  EXPECT_EQ(runs.encode("\u00b212"), (std::vector<int32_t>{0xC2, 0xB2, 259}));
  // No BOS (a ByteLevel post-processor); added tokens as before.
  EXPECT_EQ(apart.bos_id(), -1);
  EXPECT_EQ(apart.encode_with_specials("<|eot_id|> we1"), (std::vector<int32_t>{300, 262, '1'}));
  EXPECT_EQ(apart.vocab_size(), 302);
}

TEST(Tokenizer, TheDigitsScannerCutsAsDigitsThenThePattern) {
  // The plain computation: a Split by \p{N} (or \p{N}+) matched by PCRE2 gives the numbers and the
  // stretches between; each stretch, as a text of its own, is cut by GPT-2's pattern (PCRE2 too).
  const auto digit = std::make_shared<data::SplitPattern>(R"(\p{N})");
  const auto digit_runs = std::make_shared<data::SplitPattern>(R"(\p{N}+)");
  data::Pretokenizer scanner;
  data::PatternMatcher pattern;
  auto texts = hand_texts();
  for (auto& t : split_texts()) texts.push_back(t);
  for (auto& t : random_texts(2000, 9)) texts.push_back(t);
  int numbers = 0;
  for (const bool individual : {true, false}) {
    const auto& split = individual ? *digit : *digit_runs;
    for (const auto& raw : texts) {
      const std::string text = data::replace_invalid_utf8(raw);
      std::vector<size_t> want;
      for (size_t at = 0; at < text.size();) {
        bool matched = false;
        const size_t end = split.piece_end(text, at, scanner, &matched);
        if (matched) {
          want.push_back(end);
          ++numbers;
        } else {
          const std::string stretch = text.substr(at, end - at);
          for (size_t i = 0; i < stretch.size(); i = pattern.piece_end(stretch, i)) want.push_back(at + pattern.piece_end(stretch, i));
        }
        at = end;
      }
      std::vector<size_t> got;
      for (size_t at = 0; at < text.size(); at = got.back()) got.push_back(scanner.piece_end_digits(text, at, individual));
      ASSERT_EQ(got, want) << (individual ? "digits apart" : "digit runs") << ": '" << text << "'";
    }
  }
  EXPECT_GT(numbers, 1000);
}

TEST(Tokenizer, LlamaAndQwen2IdsEqualTokenizers) {
  SKIP_WITHOUT_HF_TOKENIZERS();
  const std::string src = "/usr/share/games/fortunes";
  if (!fs::exists(src)) GTEST_SKIP() << src << " is missing (apt-get install fortunes)";
  testutil::TempDir dir("tokenizer_hf");
  std::string files;
  for (const auto& e : fs::directory_iterator(src))
    if (e.is_regular_file() && e.path().extension() != ".dat" && e.path().extension() != ".u8") files += " " + e.path().string();
  auto texts = split_texts();
  for (auto& t : hand_texts()) texts.push_back(t);
  for (auto& t : random_texts(400, 13)) texts.push_back(t);
  nlohmann::json in = nlohmann::json::array();
  for (const auto& t : texts) in.push_back(base64(t));
  testutil::write_file(dir / "texts.json", in.dump());
  const std::string py = testutil::python() + " " + hf_ref_script();
  for (const std::string kind : {"llama3", "qwen2", "smollm2"}) {
    const std::string json = (dir / (kind + ".json")).string(), ref_path = (dir / (kind + "_ref.json")).string();
    auto r = testutil::run(py + " build --kind " + kind + " --vocab 2000 --out " + json + " --files" + files);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = testutil::run(py + " encode --tokenizer-json " + json + " --texts " + (dir / "texts.json").string() + " --out " + ref_path);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto ref = nlohmann::json::parse(testutil::read_file(ref_path));
    const auto tok = data::Tokenizer::load(json);
    const int32_t bos = kind == "llama3" ? tok.special("<|begin_of_text|>") : -1;
    EXPECT_EQ(tok.bos_id(), bos) << kind;
    // SmolLM2's special tokens are ids 0, 1, 2, inside the vocabulary; the others' after it.
    EXPECT_EQ(tok.vocab_size(), kind == "llama3" ? 2005 : kind == "qwen2" ? 2003 : 2000) << kind;
    if (kind == "smollm2") EXPECT_EQ(tok.special("<|im_end|>"), 2);
    size_t tokens = 0, merged = 0;
    for (size_t i = 0; i < texts.size(); ++i) {
      const auto ours = tok.encode(texts[i]);
      ASSERT_EQ(ours, ids_of(ref["plain"][i])) << kind << ", text " << i << ": '" << texts[i] << "'";
      EXPECT_EQ(tok.encode_with_specials(texts[i]), ids_of(ref["specials"][i])) << kind << ", text " << i;
      // With the post-processor (add_special_tokens=True): the BOS, then the text with its added tokens.
      std::vector<int32_t> templated = tok.encode_with_specials(texts[i]);
      if (bos >= 0) templated.insert(templated.begin(), bos);
      EXPECT_EQ(templated, ids_of(ref["template"][i])) << kind << ", text " << i;
      tokens += ours.size();
      for (int32_t id : ours) merged += tok.decode(&id, 1).size() > 1;
    }
    EXPECT_GT(tokens, 10000u) << kind;
    EXPECT_GT(merged, 1000u) << kind;  // the merges are used, not bytes alone
  }
}

TEST(Tokenizer, LlamaAndQwen2SafeCutsEncodeAsTheWhole) {
  // Every place safe_cut gives, on random texts in every class the patterns tell apart: the two sides
  // encoded apart (the first with a look-ahead, as convert-text's parts) give the ids of the whole, also
  // with NFC (combining accents across the cut) and for GPT-2's pattern inside a Split.
  testutil::TempDir dir("tokenizer_cuts");
  std::vector<std::pair<std::string, data::Tokenizer>> toks;
  toks.emplace_back("llama3", load_json(dir, "l.json", hand_tokenizer(kLlama3Pattern, false)));
  toks.emplace_back("qwen2+nfc", load_json(dir, "q.json", hand_tokenizer(kQwen2Pattern, true)));
  toks.emplace_back("llama3+nfc", load_json(dir, "ln.json", hand_tokenizer(kLlama3Pattern, true)));
  toks.emplace_back("gpt2+nfc", load_json(dir, "g.json", hand_tokenizer(R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)", true)));
  toks.emplace_back("smollm2", load_json(dir, "s.json", hand_digits_tokenizer(true, false)));
  toks.emplace_back("digit runs", load_json(dir, "r.json", hand_digits_tokenizer(false, false)));
  toks.emplace_back("smollm2+nfc", load_json(dir, "sn.json", hand_digits_tokenizer(true, true)));
  auto texts = split_texts();
  for (auto& t : random_texts(1500, 17)) texts.push_back(t);
  for (const auto& [name, tok] : toks) {
    int cuts = 0;
    for (const auto& raw : texts) {
      const std::string text = data::replace_invalid_utf8(raw);
      const auto whole = tok.encode(text);
      for (size_t from = 1; from < text.size();) {
        const size_t p = tok.safe_cut(text, from, text.size());
        if (p == std::string_view::npos) break;
        data::Pretokenizer matcher;
        data::PieceCache cache;
        std::vector<int32_t> ids;
        tok.encode_part(text.substr(0, std::min(text.size(), p + 16)), p, matcher, cache, ids);
        tok.encode_part(text.substr(p), text.size() - p, matcher, cache, ids);
        ASSERT_EQ(ids, whole) << name << ": cut at byte " << p << " of '" << text << "'";
        ++cuts;
        from = p + 1;
      }
    }
    EXPECT_GT(cuts, 1000) << name;
  }
}

TEST(Tokenizer, AHostileTokenizerJsonIsOneLine) {
  testutil::TempDir dir("tokenizer_hostile");
  auto error = [&](const std::string& name, const nlohmann::json& j) {
    try {
      load_json(dir, name, j);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("(loaded)");
  };
  const std::string p = "tokenizer '" + dir.str() + "/";
  auto with_pattern = [](const std::string& pattern) { return hand_tokenizer(pattern, false); };
  EXPECT_EQ(error("a.json", with_pattern("(ab")), p + "a.json': pre_tokenizer: the Split pattern '(ab': does not compile: missing closing parenthesis");
  EXPECT_EQ(error("b.json", with_pattern(std::string(5000, 'a'))),
            p + "b.json': pre_tokenizer: the Split pattern '" + std::string(60, 'a') + "...': a pattern of 5000 bytes (at most 4096)");
  EXPECT_EQ(error("c.json", with_pattern("x*")), p + "c.json': pre_tokenizer: the Split pattern 'x*': it can match the empty text");
  EXPECT_EQ(error("d.json", with_pattern("(?<=a)b|.")), p + "d.json': pre_tokenizer: the Split pattern '(?<=a)b|.': it looks behind (a lookbehind, \\b, \\B, \\A or \\G)");
  EXPECT_EQ(error("e.json", with_pattern("^a|.")), p + "e.json': pre_tokenizer: the Split pattern '^a|.': ^ (a line start, which looks at the character before) is not supported");
  auto j = hand_tokenizer(kLlama3Pattern, false);
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed";
  EXPECT_EQ(error("f.json", j), p + "f.json': pre_tokenizer: Split's behavior is \"Removed\"; only Isolated is supported");
  j = hand_tokenizer(kLlama3Pattern, false);
  j["pre_tokenizer"]["pretokenizers"][1]["use_regex"] = true;
  EXPECT_EQ(error("g.json", j), p + "g.json': pre_tokenizer: ByteLevel after a Split splits again by GPT-2's pattern (use_regex); not supported");
  j = hand_tokenizer(kLlama3Pattern, false);
  j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "\xE2\x96\x81"}};
  EXPECT_EQ(error("h.json", j), p + "h.json': pre_tokenizer is \"Metaspace\"; supported: ByteLevel (GPT-2's), or a Sequence of Split and ByteLevel (Llama 3's, Qwen2's) or of Digits and ByteLevel (SmolLM2's)");
  j = hand_tokenizer(kLlama3Pattern, false);
  j["pre_tokenizer"]["pretokenizers"].push_back({{"type", "Digits"}});
  EXPECT_EQ(error("i.json", j), p + "i.json': pre_tokenizer is a Sequence of [Split, ByteLevel, Digits]; supported: ByteLevel (GPT-2's), or a Sequence of Split and ByteLevel (Llama 3's, Qwen2's) or of Digits and ByteLevel (SmolLM2's)");
  j = hand_digits_tokenizer(true, false);
  j["pre_tokenizer"]["pretokenizers"][1]["use_regex"] = false;
  EXPECT_EQ(error("i2.json", j), p + "i2.json': pre_tokenizer: ByteLevel without use_regex after Digits (the text between numbers one piece) is not supported");
  j = hand_digits_tokenizer(true, false);
  j["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true;
  EXPECT_EQ(error("i3.json", j), p + "i3.json': pre_tokenizer: ByteLevel after Digits with add_prefix_space (a space before every stretch between numbers) is not supported");
  j = hand_tokenizer(kLlama3Pattern, false);
  j["normalizer"] = {{"type", "NFKC"}};
  EXPECT_EQ(error("k.json", j), p + "k.json': a normalizer (NFKC) is not supported (only NFC is)");
  j = hand_tokenizer(kLlama3Pattern, false);
  j["model"]["byte_fallback"] = true;
  EXPECT_EQ(error("l.json", j), p + "l.json': model.byte_fallback is a SentencePiece-style BPE, not byte-level");
  j = hand_tokenizer(kLlama3Pattern, false);
  j["post_processor"]["processors"][1]["single"][0]["SpecialToken"]["id"] = "<s>";
  EXPECT_EQ(error("m.json", j), p + "m.json': post_processor: its token '<s>' is not an added token");
  // A pattern that backtracks without end stops at PCRE2's match limit, in one line, when encoding.
  const auto slow = load_json(dir, "slow.json", with_pattern("(a|aa)+[bc]|."));
  EXPECT_THROW(slow.encode(std::string(200, 'a')), std::runtime_error);
}

TEST(ConvertTextBpe, EachFileIsADocumentOfTiktokensIdsAndAnEndOfText) {
  SKIP_WITHOUT_TIKTOKEN();
  testutil::TempDir dir("convert_bpe");
  fs::create_directories(dir / "in");
  // Parts: a long English file (several 1 MiB parts, safe cuts at spaces), a file with no ASCII
  // whitespace for over 2 MiB (cuts found by the scanner), invalid UTF-8, an empty file, and one that
  // ends inside a multi-byte character.
  std::string english;
  std::mt19937 rng(1);
  const std::vector<std::string> words = {"the", "don't", "tokenizer", "3.14", "  ", "\n", "Ça", "日本", "😀", "it's", "\t", ",", "!!"};
  while (english.size() < (3u << 20)) english += words[rng() % words.size()] + (rng() % 3 ? " " : "");
  std::string cjk;
  while (cjk.size() < (5u << 19)) cjk += std::string("中文文本，") + (rng() % 50 == 0 ? "123" : "") + "テキスト。";
  testutil::write_file(dir / "in" / "a_english.txt", english);
  testutil::write_file(dir / "in" / "b_cjk.txt", cjk);
  testutil::write_file(dir / "in" / "c_invalid.txt", "caf\xC3 \xFF\xFE ok\xE2\x82");
  testutil::write_file(dir / "in" / "d_empty.txt", "");
  testutil::write_file(dir / "in" / "e_short.txt", "Hello world\n\n\n");
  const auto r = testutil::run(testutil::python() + " " + ref_script() + " files --out " + (dir / "ref.bin").string() + " --files " +
                               (dir / "in" / "a_english.txt").string() + " " + (dir / "in" / "b_cjk.txt").string() + " " +
                               (dir / "in" / "c_invalid.txt").string() + " " + (dir / "in" / "d_empty.txt").string() + " " +
                               (dir / "in" / "e_short.txt").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string ref_bytes = testutil::read_file(dir / "ref.bin");
  std::vector<int64_t> want(ref_bytes.size() / 4);
  for (size_t i = 0; i < want.size(); ++i) {
    int32_t v;
    std::memcpy(&v, ref_bytes.data() + 4 * i, 4);
    want[i] = v;
  }
  for (const auto& [threads, val_fraction] : std::vector<std::pair<int, double>>{{2, 0.3}, {1, 0.0}}) {
    const std::string out = (dir / ("out" + std::to_string(threads))).string();
    data::TextOptions options;
    options.tokenizer = std::make_shared<const data::Tokenizer>(data::Tokenizer::load(rank_file()));
    options.threads = threads;
    const auto conv = data::convert_text({(dir / "in").string()}, out, val_fraction, options);
    std::vector<int64_t> got;
    for (const auto& path : {conv.train_path, conv.val_path}) {
      if (path.empty()) continue;
      data::TokenDataset ds(path, true);
      EXPECT_EQ(ds.vocab_size(), 50257);
      EXPECT_EQ(ds.tokenizer(), "gpt2");
      EXPECT_EQ(ds.tokenizer_path(), fs::absolute(rank_file()).lexically_normal().string());
      std::vector<int64_t> part(ds.size());
      ds.read(0, ds.size(), part.data());
      got.insert(got.end(), part.begin(), part.end());
    }
    ASSERT_EQ(got.size(), want.size()) << threads << " threads";
    EXPECT_TRUE(got == want) << threads << " threads";
    EXPECT_EQ(conv.replaced, 4);
    if (val_fraction > 0) {
      // The split is at about 30% from the end, by bytes (the CJK file's tokens are denser).
      EXPECT_GT(conv.val_tokens, 0);
      EXPECT_GT(conv.train_tokens, conv.val_tokens);
    }
    EXPECT_NE(conv.summary().find("(gpt2, vocab 50257); 4 invalid UTF-8 sequences replaced by U+FFFD"), std::string::npos) << conv.summary();
  }
}

TEST(ConvertTextBpe, TinyPartsGiveTheIdsOfTheWholeText) {
  // Parts of 1 to 64 bytes: every way of cutting (safe cuts, cuts found by the scanner, a piece longer
  // than the buffer waiting for more text, the split) against each file encoded whole.
  testutil::TempDir dir("convert_bpe_parts");
  testutil::write_file(dir / "mini.tiktoken", mini_ranks());
  auto tok = std::make_shared<const data::Tokenizer>(data::Tokenizer::load((dir / "mini.tiktoken").string()));
  fs::create_directories(dir / "in");
  const auto texts = random_texts(60, 21);
  std::vector<int64_t> want;
  for (int f = 0; f < 6; ++f) {
    std::string doc;
    for (int i = 0; i < 10; ++i) doc += texts[f * 10 + i];
    if (f == 2) doc += std::string(300, 'a') + "   " + std::string(200, '\n');  // pieces longer than the parts
    if (f == 4) doc.clear();                                                    // an empty file adds nothing
    testutil::write_file(dir / "in" / ("doc" + std::to_string(f)), doc);
    for (int32_t id : tok->encode(doc)) want.push_back(id);
    if (!doc.empty()) want.push_back(tok->special("<|endoftext|>"));
  }
  for (size_t part : {1, 7, 64}) {
    for (int threads : {1, 3}) {
      data::TextOptions options;
      options.tokenizer = tok;
      options.threads = threads;
      options.part_bytes = part;
      const auto conv = data::convert_text({(dir / "in").string()}, (dir / "out").string(), 0.25, options);
      EXPECT_TRUE(all_ids(conv) == want) << "parts of " << part << " bytes, " << threads << " threads";
      EXPECT_GT(conv.val_tokens, 0);
    }
  }
}

TEST(ConvertTextBpe, SplitPatternsInTinyPartsGiveTheIdsOfTheWholeText) {
  // convert-text's cuts for Llama 3's and Qwen2's patterns (with NFC: combining accents across parts),
  // and for a pattern with no known safe cut (cut only where its pieces end), against each file whole.
  testutil::TempDir dir("convert_split_parts");
  fs::create_directories(dir / "in");
  const auto texts = random_texts(40, 23);
  std::vector<std::string> docs;
  for (int f = 0; f < 4; ++f) {
    std::string doc;
    for (int i = 0; i < 10; ++i) doc += texts[f * 10 + i] + split_texts()[(f + i) % split_texts().size()];
    if (f == 2) doc += std::string(300, 'a') + "  \n  " + std::string(200, '7');
    testutil::write_file(dir / "in" / ("doc" + std::to_string(f)), doc);
    docs.push_back(doc);
  }
  const std::vector<std::pair<std::string, nlohmann::json>> kinds = {{"llama3", hand_tokenizer(kLlama3Pattern, false)},
                                                                     {"qwen2", hand_tokenizer(kQwen2Pattern, true)},
                                                                     {"other", hand_tokenizer(R"(\p{N}{1,3}|\s+|[.,!?]+)", false)},
                                                                     {"smollm2", hand_digits_tokenizer(true, false)},
                                                                     {"digit_runs", hand_digits_tokenizer(false, false)}};
  for (const auto& [name, json] : kinds) {
    auto tok = std::make_shared<const data::Tokenizer>(load_json(dir, name + ".json", json));
    std::vector<int64_t> want;
    for (const auto& doc : docs) {  // each document: the BOS where the tokenizer has one, its ids, <|eot_id|>
      if (tok->bos_id() >= 0) want.push_back(tok->bos_id());
      for (int32_t id : tok->encode(doc)) want.push_back(id);
      want.push_back(300);
    }
    for (size_t part : {1, 5, 64}) {
      data::TextOptions options;
      options.tokenizer = tok;
      options.end_of_text = "<|eot_id|>";
      options.threads = 2;
      options.part_bytes = part;
      data::TokenConversion conv;
      ASSERT_NO_THROW(conv = data::convert_text({(dir / "in").string()}, (dir / ("out_" + name)).string(), 0.25, options))
          << name << ", parts of " << part << " bytes";
      EXPECT_TRUE(all_ids(conv) == want) << name << ", parts of " << part << " bytes";
      EXPECT_EQ(conv.vocab_size, 302) << name;
    }
  }
}

TEST(ConvertTextBpe, ARunOfOneKindOverOneMiBIsRefusedInOneLine) {
  testutil::TempDir dir("convert_bpe_refused");
  std::string ranks;
  for (int b = 0; b < 256; ++b) ranks += base64(std::string(1, char(b))) + " " + std::to_string(b) + "\n";
  testutil::write_file(dir / "mini.tiktoken", ranks);
  testutil::write_file(dir / "nul.txt", "start " + std::string(3 << 20, '\0'));
  testutil::write_file(dir / "letters.txt", std::string(1 << 21, 'a'));
  testutil::write_file(dir / "ok.txt", "fine text\n");
  for (const auto& [file, at] : std::vector<std::pair<std::string, int>>{{"nul.txt", 5}, {"letters.txt", 0}}) {
    const auto r = testutil::run(testutil::trainer_bin() + " convert-text --src " + (dir / file).string() + " --out " + (dir / "out").string() +
                                 " --tokenizer " + (dir / "mini.tiktoken").string());
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_EQ(r.output, "error: convert-text: '" + (dir / file).string() + "': at byte " + std::to_string(at) +
                            ", a run of more than 1 MiB without a break between pieces (letters, digits, spaces or other "
                            "characters, all of one kind); GPT-2's BPE would take it as one word, so the file is refused\n");
    EXPECT_FALSE(fs::exists(dir / "out" / "train.h5"));
  }
  // A tokenizer without <|endoftext|> (a tokenizer.json without it), and a bad flag.
  auto r = testutil::run(testutil::trainer_bin() + " convert-text --src " + (dir / "ok.txt").string() + " --out " + (dir / "out").string() +
                         " --tokenizer " + (dir / "mini.tiktoken").string() + " --end-of-text '<|eot|>'");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(r.output, "error: convert-text: the tokenizer '" + (dir / "mini.tiktoken").string() +
                          "' has no special token '<|eot|>' to end each document (--end-of-text names another)\n");
  r = testutil::run(testutil::trainer_bin() + " convert-text --src " + (dir / "ok.txt").string() + " --tokenizer " + (dir / "nope").string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(r.output, "error: tokenizer '" + (dir / "nope").string() + "': no such file\n");
  r = testutil::run(testutil::trainer_bin() + " convert-text --src " + (dir / "ok.txt").string() + " --out " + (dir / "out").string() +
                    " --tokenizer " + (dir / "mini.tiktoken").string() + " --val-fraction 0");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, "1 file, 10 bytes: " + (dir / "out" / "train.h5").string() + " 11 tokens (mini, vocab 257)\n");
}

}  // namespace test_tokenizer
