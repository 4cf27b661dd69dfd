// Tokenizer::load: a tokenizer's file read into the BPE's tables, a tiktoken rank file or a Hugging Face
// tokenizer.json (its vocabulary, merges, pre-tokenizer, normalizer, added tokens and post-processor),
// and every refusal of a file that is not one this BPE encodes as its library does.
#include "data/text/tokenizer.h"

#include "data/text/bpe.h"
#include "data/text/pretokenize.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>

namespace data {
namespace {

namespace fs = std::filesystem;

// Tokenizer files are a few MB (GPT-2's rank file 0.8 MB, its tokenizer.json 1.4 MB); anything past this
// is not one.
constexpr int64_t kMaxFileBytes = 256 << 20;
// No token of a real vocabulary comes near this; a longer one is a corrupt file.
constexpr size_t kMaxTokenBytes = 4096;
constexpr size_t kMaxIdGap = 65536;

struct Problem : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string read_file(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw Problem("no such file");
  if (!fs::is_regular_file(path, ec)) throw Problem("not a regular file");
  const auto size = fs::file_size(path, ec);
  if (ec) throw Problem("cannot read its size: " + ec.message());
  if (static_cast<int64_t>(size) > kMaxFileBytes) throw Problem("is " + std::to_string(size) + " bytes, over the 256 MiB a tokenizer file may have");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Problem("cannot open it");
  std::string s(std::istreambuf_iterator<char>(in), {});
  if (in.bad()) throw Problem("reading failed");
  return s;
}

// ---- tiktoken rank files ------------------------------------------------------------------------------

int base64_value(unsigned char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

// Standard base64 with padding, strictly (what Python's base64.b64decode(..., validate=True) takes).
bool base64_decode(std::string_view in, std::string& out) {
  out.clear();
  if (in.empty() || in.size() % 4 != 0) return false;
  size_t pad = 0;
  while (pad < 2 && in[in.size() - 1 - pad] == '=') ++pad;
  for (size_t i = 0; i < in.size(); i += 4) {
    uint32_t v = 0;
    for (size_t k = 0; k < 4; ++k) {
      const bool padded = i + k >= in.size() - pad;
      const int d = padded ? 0 : base64_value(static_cast<unsigned char>(in[i + k]));
      if (d < 0) return false;
      v = (v << 6) | static_cast<uint32_t>(d);
    }
    const size_t bytes = i + 4 < in.size() ? 3 : 3 - pad;
    for (size_t k = 0; k < bytes; ++k) out.push_back(static_cast<char>((v >> (16 - 8 * k)) & 0xff));
  }
  return true;
}

// Adds token `bytes` with id `id`; a repeated id or repeated bytes is an error. Ids must stay near the
// count of tokens (a vocabulary's ids are 0..n-1, with few gaps): a hostile id cannot size the tables.
void add_token(Bpe::Tables& t, std::string bytes, int64_t id, const std::string& where) {
  if (id < 0 || id >= INT32_MAX) throw Problem(where + ": id " + std::to_string(id) + " is outside [0, 2^31 - 1)");
  if (bytes.empty()) throw Problem(where + ": an empty token");
  if (bytes.size() > kMaxTokenBytes) throw Problem(where + ": a token of " + std::to_string(bytes.size()) + " bytes (at most 4096)");
  if (static_cast<size_t>(id) >= t.ids.size() + kMaxIdGap)
    throw Problem(where + ": id " + std::to_string(id) + " leaves a gap of more than 65536 ids after the " + std::to_string(t.ids.size()) + " tokens before it");
  if (static_cast<size_t>(id) >= t.bytes.size()) {
    t.bytes.resize(id + 1);
    t.present.resize(id + 1, false);
  }
  if (t.present[id]) throw Problem(where + ": id " + std::to_string(id) + " is given twice");
  if (!t.ids.emplace(bytes, static_cast<int32_t>(id)).second) throw Problem(where + ": a token is given twice (id " + std::to_string(id) + ")");
  t.bytes[id] = std::move(bytes);
  t.present[id] = true;
}

// The single bytes must all be tokens: every text is then encodable.
void find_byte_ids(Bpe::Tables& t) {
  for (int b = 0; b < 256; ++b) {
    auto it = t.ids.find(std::string(1, static_cast<char>(b)));
    if (it == t.ids.end()) throw Problem("byte " + std::to_string(b) + " has no token of its own (a byte-level BPE needs all 256)");
    t.byte_id[b] = it->second;
  }
}

// Ids past the last token, dropped from the tables' tail; the specials go after the tokens.
void trim(Bpe::Tables& t) {
  size_t n = t.bytes.size();
  while (n > 0 && !t.present[n - 1]) --n;
  t.bytes.resize(n);
  t.present.resize(n);
}

void add_special(Bpe::Tables& t, const std::string& text, int64_t id, const std::string& where) {
  if (id < 0 || static_cast<size_t>(id) >= t.bytes.size() + kMaxIdGap)
    throw Problem(where + ": id " + std::to_string(id) + " of '" + text.substr(0, 40) + "' is outside [0, " + std::to_string(t.bytes.size() + kMaxIdGap) + ")");
  if (text.empty() || text.size() > kMaxTokenBytes) throw Problem(where + ": a special token of " + std::to_string(text.size()) + " bytes");
  if (static_cast<size_t>(id) >= t.bytes.size()) {
    t.bytes.resize(id + 1);
    t.present.resize(id + 1, false);
  }
  if (t.present[id]) {
    if (t.bytes[id] != text) throw Problem(where + ": id " + std::to_string(id) + " is both a token and the special '" + text + "'");
  } else {
    t.bytes[id] = text;
    t.present[id] = true;
  }
  t.specials[text] = static_cast<int32_t>(id);
}

// tiktoken: two tokens merge when their bytes, concatenated, are a token; the priority is its rank.
void pairs_from_ranks(Bpe::Tables& t) {
  for (size_t id = 0; id < t.bytes.size(); ++id) {
    if (!t.present[id]) continue;
    const std::string& s = t.bytes[id];
    for (size_t k = 1; k < s.size(); ++k) {
      auto l = t.ids.find(s.substr(0, k));
      if (l == t.ids.end()) continue;
      auto r = t.ids.find(s.substr(k));
      if (r == t.ids.end()) continue;
      t.pairs.emplace(Bpe::pair_key(l->second, r->second), std::make_pair(static_cast<int32_t>(id), static_cast<int32_t>(id)));
    }
  }
}

Bpe::Tables read_tiktoken(const std::string& content) {
  Bpe::Tables t;
  std::string bytes;
  size_t line_no = 0;
  for (size_t at = 0; at < content.size();) {
    size_t end = content.find('\n', at);
    if (end == std::string::npos) end = content.size();
    std::string_view line(content.data() + at, end - at);
    at = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const std::string where = "line " + std::to_string(line_no);
    const size_t space = line.find(' ');
    if (space == std::string_view::npos || line.find(' ', space + 1) != std::string_view::npos)
      throw Problem(where + ": expected '<base64 token> <rank>'");
    if (!base64_decode(line.substr(0, space), bytes)) throw Problem(where + ": the token is not valid base64");
    const std::string_view rank_text = line.substr(space + 1);
    if (rank_text.empty() || rank_text.size() > 10 || !std::all_of(rank_text.begin(), rank_text.end(), [](char c) { return c >= '0' && c <= '9'; }))
      throw Problem(where + ": the rank '" + std::string(rank_text.substr(0, 20)) + "' is not a number below 2^31");
    add_token(t, bytes, std::stoll(std::string(rank_text)), where);
  }
  if (t.ids.empty()) throw Problem("no tokens (a tiktoken rank file has '<base64 token> <rank>' lines)");
  trim(t);
  find_byte_ids(t);
  pairs_from_ranks(t);
  // tiktoken's gpt2 encoding puts <|endoftext|> right after the ranks (50256).
  add_special(t, "<|endoftext|>", static_cast<int64_t>(t.bytes.size()), "<|endoftext|>");
  t.whole_pieces = true;
  t.split = SplitPattern::gpt2();
  return t;
}

// ---- Hugging Face tokenizer.json ----------------------------------------------------------------------

// GPT-2's byte-to-unicode alphabet (OpenAI's encoder.py `bytes_to_unicode`): the printable bytes stand
// for themselves, the others for U+0100 on, in byte order. Returns code point -> byte, -1 elsewhere.
std::vector<int> unicode_to_byte() {
  std::vector<int> map(512, -1);
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    map[printable ? b : 256 + extra++] = b;
  }
  return map;
}

// A vocabulary string of the byte-level alphabet -> its bytes.
std::string alphabet_bytes(const std::string& s, const std::vector<int>& map, const std::string& where) {
  std::string out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    uint32_t cp = 0;
    size_t len = 1;
    if (c < 0x80) cp = c;
    else if ((c & 0xE0) == 0xC0 && i + 1 < s.size()) cp = ((c & 0x1F) << 6) | (s[i + 1] & 0x3F), len = 2;
    else cp = 0xFFFFFFFF;
    if (cp >= map.size() || map[cp] < 0)
      throw Problem(where + ": '" + s.substr(0, 40) + "' has a character outside GPT-2's byte-level alphabet");
    out.push_back(static_cast<char>(map[cp]));
    i += len;
  }
  return out;
}

const nlohmann::json* child(const nlohmann::json& j, const char* key) {
  if (!j.is_object()) return nullptr;
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

bool flag(const nlohmann::json& j, const char* key, bool fallback) {
  const auto* v = child(j, key);
  if (!v) return fallback;
  if (!v->is_boolean()) throw Problem(std::string("'") + key + "' is not true or false");
  return v->get<bool>();
}

std::string type_of(const nlohmann::json& j) {
  const auto* type = child(j, "type");
  return !type ? std::string("untyped") : type->is_string() ? type->get<std::string>() : type->dump().substr(0, 40);
}

// A Split step's pattern as a regular expression: {"Regex": "..."}, or {"String": "..."} taken literally.
std::string split_regex(const nlohmann::json& split) {
  const auto* pattern = child(split, "pattern");
  if (const auto* re = pattern ? child(*pattern, "Regex") : nullptr; re && re->is_string()) return re->get<std::string>();
  if (const auto* str = pattern ? child(*pattern, "String") : nullptr; str && str->is_string() && !str->get<std::string>().empty()) {
    std::string quoted;
    for (char c : str->get<std::string>()) {
      if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) quoted.push_back('\\');
      quoted.push_back(c);
    }
    return quoted;
  }
  throw Problem("pre_tokenizer: Split's pattern is not {\"Regex\": \"...\"} or {\"String\": \"...\"}");
}

// A Sequence of Digits and ByteLevel with GPT-2's pattern (SmolLM2, StarCoder): numbers apart, GPT-2's
// pieces between.
void read_digits(const nlohmann::json& digits, const nlohmann::json& bytes, Bpe::Tables& t) {
  if (!flag(bytes, "use_regex", true)) throw Problem("pre_tokenizer: ByteLevel without use_regex after Digits (the text between numbers one piece) is not supported");
  if (flag(bytes, "add_prefix_space", false)) throw Problem("pre_tokenizer: ByteLevel after Digits with add_prefix_space (a space before every stretch between numbers) is not supported");
  t.split = SplitPattern::digits_then_gpt2(flag(digits, "individual_digits", false));
}

// The pre-tokenizer: ByteLevel with GPT-2's pattern (alone or a Sequence of one), a Sequence of a Split
// by a pattern and ByteLevel without one (Llama 3, Qwen2), or a Sequence of Digits and ByteLevel with
// GPT-2's pattern (SmolLM2). Anything else is another tokenizer's.
void read_pre_tokenizer(const nlohmann::json& root, Bpe::Tables& t) {
  const auto* pre = child(root, "pre_tokenizer");
  if (!pre) throw Problem("no pre_tokenizer (a byte-level BPE has ByteLevel)");
  std::vector<const nlohmann::json*> steps = {pre};
  std::string kinds = "\"" + type_of(*pre) + "\"";
  if (type_of(*pre) == "Sequence") {
    const auto* list = child(*pre, "pretokenizers");
    if (!list || !list->is_array()) throw Problem("pre_tokenizer is a Sequence without a 'pretokenizers' list");
    steps.clear();
    kinds = "a Sequence of [";
    for (const auto& step : *list) {
      kinds += (steps.empty() ? "" : ", ") + type_of(step);
      steps.push_back(&step);
    }
    kinds += "]";
  }
  const std::string supported = "; supported: ByteLevel (GPT-2's), or a Sequence of Split and ByteLevel (Llama 3's, Qwen2's) or of Digits and ByteLevel (SmolLM2's)";
  if (steps.size() == 1 && type_of(*steps[0]) == "ByteLevel") {
    if (!flag(*steps[0], "use_regex", true)) throw Problem("ByteLevel without use_regex and without a Split before it is not supported (the text would be one piece)");
    t.add_prefix_space = flag(*steps[0], "add_prefix_space", false);
    t.split = SplitPattern::gpt2();
    return;
  }
  if (steps.size() == 2 && type_of(*steps[0]) == "Digits" && type_of(*steps[1]) == "ByteLevel") return read_digits(*steps[0], *steps[1], t);
  if (steps.size() != 2 || type_of(*steps[0]) != "Split" || type_of(*steps[1]) != "ByteLevel") throw Problem("pre_tokenizer is " + kinds + supported);
  const auto& split = *steps[0];
  const auto& bytes = *steps[1];
  if (flag(bytes, "use_regex", true)) throw Problem("pre_tokenizer: ByteLevel after a Split splits again by GPT-2's pattern (use_regex); not supported");
  if (flag(bytes, "add_prefix_space", false)) throw Problem("pre_tokenizer: ByteLevel after a Split with add_prefix_space (a space before every piece) is not supported");
  const auto* behavior = child(split, "behavior");
  if (!behavior || *behavior != "Isolated") throw Problem("pre_tokenizer: Split's behavior is " + (behavior ? behavior->dump().substr(0, 40) : std::string("missing")) + "; only Isolated is supported");
  if (flag(split, "invert", false)) throw Problem("pre_tokenizer: Split with invert is not supported");
  try {
    t.split = std::make_shared<const SplitPattern>(split_regex(split));
  } catch (const Problem&) {
    throw;
  } catch (const std::runtime_error& e) {
    throw Problem(std::string("pre_tokenizer: ") + e.what());
  }
}

// The normalizer: none, or NFC.
bool read_normalizer(const nlohmann::json& root) {
  const auto* norm = child(root, "normalizer");
  if (!norm) return false;
  const auto* kind = norm->is_object() ? child(*norm, "type") : norm;  // of any shape: its type, or the value itself
  const std::string what = !kind ? "?" : kind->is_string() ? kind->get<std::string>() : kind->dump().substr(0, 40);
  if (what != "NFC") throw Problem("a normalizer (" + what + ") is not supported (only NFC is)");
  return true;
}

// The special token the post-processor puts first: TemplateProcessing's `single` starting with a
// SpecialToken (Llama 3; also inside a Sequence of processors), or Roberta/Bert's `cls`. -1 for none.
int32_t read_bos(const nlohmann::json& root, const Bpe::Tables& t) {
  const auto* post = child(root, "post_processor");
  if (!post) return -1;
  std::vector<const nlohmann::json*> processors = {post};
  if (type_of(*post) == "Sequence") {
    processors.clear();
    if (const auto* list = child(*post, "processors"); list && list->is_array())
      for (const auto& p : *list) processors.push_back(&p);
  }
  auto id_of = [&](const std::string& name) -> int32_t {
    auto it = t.specials.find(name);
    if (it == t.specials.end()) throw Problem("post_processor: its token '" + name.substr(0, 40) + "' is not an added token");
    return it->second;
  };
  for (const auto* p : processors) {
    const std::string type = type_of(*p);
    if (type == "TemplateProcessing") {
      const auto* single = child(*p, "single");
      if (!single || !single->is_array() || single->empty()) continue;
      const auto* special = child((*single)[0], "SpecialToken");
      const auto* name = special ? child(*special, "id") : nullptr;
      if (!name || !name->is_string()) return -1;
      return id_of(name->get<std::string>());
    }
    if (type == "RobertaProcessing" || type == "BertProcessing") {
      const auto* cls = child(*p, "cls");
      if (!cls || !cls->is_array() || cls->empty() || !(*cls)[0].is_string()) throw Problem("post_processor: " + type + " without a 'cls' token");
      return id_of((*cls)[0].get<std::string>());
    }
  }
  return -1;
}

Bpe::Tables read_tokenizer_json(const std::string& content) {
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(content);
  } catch (const nlohmann::json::exception& e) {
    throw Problem(std::string("not valid JSON: ") + e.what());
  }
  if (!root.is_object()) throw Problem("not a JSON object");
  const auto* model = child(root, "model");
  if (!model || !model->is_object()) throw Problem("no 'model'");
  const auto* type = child(*model, "type");
  if (type && *type != "BPE") throw Problem("the model is " + type->dump() + "; only BPE is supported");
  const bool nfc = read_normalizer(root);
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (const auto* v = child(*model, key); v && !(v->is_string() && v->get<std::string>().empty()))
      throw Problem(std::string("model.") + key + " is set; GPT-2's BPE has none");
  }
  if (const auto* v = child(*model, "dropout"); v && !(v->is_number() && v->get<double>() == 0))
    throw Problem("model.dropout is set; encoding must be deterministic");
  if (flag(*model, "byte_fallback", false)) throw Problem("model.byte_fallback is a SentencePiece-style BPE, not byte-level");
  Bpe::Tables t;
  t.nfc = nfc;
  read_pre_tokenizer(root, t);
  t.whole_pieces = flag(*model, "ignore_merges", false);
  const std::vector<int> alphabet = unicode_to_byte();
  const auto* vocab = child(*model, "vocab");
  if (!vocab || !vocab->is_object() || vocab->empty()) throw Problem("model.vocab is not an object of tokens");
  for (const auto& [token, id] : vocab->items()) {
    if (!id.is_number_integer()) throw Problem("model.vocab['" + token.substr(0, 40) + "'] is not an integer id");
    add_token(t, alphabet_bytes(token, alphabet, "model.vocab"), id.get<int64_t>(), "model.vocab");
  }
  trim(t);
  find_byte_ids(t);

  const auto* merges = child(*model, "merges");
  if (!merges || !merges->is_array()) throw Problem("model.merges is not a list");
  for (size_t i = 0; i < merges->size(); ++i) {
    const auto& m = (*merges)[i];
    const std::string where = "model.merges[" + std::to_string(i) + "]";
    std::string a, b;
    if (m.is_string()) {  // "a b" (tokenizers before 0.20)
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) throw Problem(where + ": expected 'a b'");
      a = s.substr(0, space), b = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {  // ["a", "b"]
      a = m[0].get<std::string>(), b = m[1].get<std::string>();
    } else {
      throw Problem(where + ": expected 'a b' or [\"a\", \"b\"]");
    }
    const std::string ab = alphabet_bytes(a, alphabet, where), bb = alphabet_bytes(b, alphabet, where);
    auto l = t.ids.find(ab), r = t.ids.find(bb), lr = t.ids.find(ab + bb);
    if (l == t.ids.end() || r == t.ids.end() || lr == t.ids.end()) throw Problem(where + ": '" + a + " " + b + "' merges tokens not in the vocabulary");
    // A pair listed twice keeps its first (lowest) priority, as tokenizers' BPE builder does.
    t.pairs.emplace(Bpe::pair_key(l->second, r->second), std::make_pair(static_cast<int32_t>(i), lr->second));
  }
  if (const auto* added = child(root, "added_tokens")) {
    if (!added->is_array()) throw Problem("added_tokens is not a list");
    for (const auto& a : *added) {
      if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() || !a.contains("content") || !a["content"].is_string())
        throw Problem("added_tokens: an entry without an integer 'id' and a string 'content'");
      add_special(t, a["content"].get<std::string>(), a["id"].get<int64_t>(), "added_tokens");
    }
  }
  t.bos = read_bos(root, t);
  return t;
}

std::string tokenizer_name(const std::string& path) {
  const fs::path p(path);
  std::string stem = p.stem().string();
  // A Hub folder holds "tokenizer.json": the folder's name says which ("gpt2/tokenizer.json" -> gpt2).
  if (stem == "tokenizer" && p.has_parent_path() && !p.parent_path().filename().empty()) stem = p.parent_path().filename().string();
  return stem.empty() ? "tokenizer" : stem;
}

bool json_content(const std::string& content) {
  for (unsigned char c : content) {
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') continue;
    return c == '{';
  }
  return false;
}

}  // namespace

Tokenizer Tokenizer::load(const std::string& path) {
  Tokenizer t;
  try {
    const std::string content = read_file(path);
    t.bpe_ = std::make_shared<const Bpe>(json_content(content) ? read_tokenizer_json(content) : read_tiktoken(content));
  } catch (const Problem& e) {
    throw std::runtime_error("tokenizer '" + path + "': " + e.what());
  } catch (const std::bad_alloc&) {
    throw std::runtime_error("tokenizer '" + path + "': out of memory while reading it");
  }
  std::error_code ec;
  const fs::path absolute = fs::absolute(path, ec);
  t.path_ = ec ? path : absolute.lexically_normal().string();
  t.name_ = tokenizer_name(path);
  return t;
}

}  // namespace data
