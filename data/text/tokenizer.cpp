// The Tokenizer: text to ids (the pieces of its split pattern, each encoded by the BPE, NFC first where
// the file asks for it, added tokens found with encode_with_specials), ids back to bytes, and where a
// text may be cut; replace_invalid_utf8. Reading the files is tokenizer_load.cpp's.
#include "data/text/tokenizer.h"

#include "data/text/bpe.h"
#include "data/text/normalize.h"
#include "data/text/pretokenize.h"

#include <algorithm>
#include <stdexcept>

namespace data {
namespace {

// `s` less a character its end cuts off (a look-ahead cut at a byte count).
std::string_view whole_characters(std::string_view s) {
  for (size_t back = 1; back <= 3 && back <= s.size(); ++back) {
    const auto c = static_cast<unsigned char>(s[s.size() - back]);
    if ((c & 0xC0) == 0x80) continue;
    const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return need > back ? s.substr(0, s.size() - back) : s;
  }
  return s;
}

}  // namespace

Tokenizer Tokenizer::bytes() {
  Tokenizer t;
  t.name_ = "bytes";
  return t;
}

void Tokenizer::encode_part(std::string_view text, size_t owned, Pretokenizer& matcher, PieceCache& cache,
                            std::vector<int32_t>& out) const {
  if (!bpe_) {
    for (size_t i = 0; i < owned; ++i) out.push_back(static_cast<unsigned char>(text[i]));
    return;
  }
  const Bpe::Tables& t = bpe_->tables();
  std::string normal;
  if (t.nfc) {  // the part and its look-ahead apart: the cut is where NFC splits (safe_cut)
    normal = nfc(text.substr(0, owned));
    const size_t normal_owned = normal.size();
    normal += nfc(whole_characters(text.substr(owned)));
    owned = normal_owned;
    text = normal;
  }
  const std::string_view subject = text;
  for (size_t at = 0; at < owned;) {
    bool matched = true;
    size_t end = t.split->piece_end(subject, at, matcher, &matched);
    if (end > owned && !matched) end = owned;  // text between matches, cut where the caller cut
    if (end > owned) throw std::logic_error("tokenizer: a piece crosses the end of a part at byte " + std::to_string(owned));
    const std::string_view piece = subject.substr(at, end - at);
    at = end;
    if (const auto* hit = cache.find(piece)) {
      out.insert(out.end(), hit->begin(), hit->end());
      continue;
    }
    const size_t before = out.size();
    bpe_->encode_piece(piece, out);
    cache.put(piece, out.data() + before, out.size() - before);
  }
}

void Tokenizer::encode(std::string_view text, std::vector<int32_t>& out) const {
  if (!bpe_) {  // bytes are taken as they are
    for (unsigned char c : text) out.push_back(c);
    return;
  }
  std::string valid = replace_invalid_utf8(text);
  // A space before normalizing is one after: NFC leaves a space and what follows it apart.
  if (bpe_->tables().add_prefix_space && !valid.empty() && valid[0] != ' ') valid.insert(valid.begin(), ' ');
  Pretokenizer matcher;
  PieceCache cache;
  encode_part(valid, valid.size(), matcher, cache, out);  // normalizes (NFC)
}

void Tokenizer::encode_with_specials(std::string_view text, std::vector<int32_t>& out) const {
  if (!bpe_ || bpe_->tables().specials.empty()) return encode(text, out);
  // The added tokens by length, longest first, and the bytes they start with.
  std::vector<std::pair<std::string_view, int32_t>> specials;
  bool starts[256] = {};
  for (const auto& [name, id] : bpe_->tables().specials) {
    specials.emplace_back(name, id);
    starts[static_cast<unsigned char>(name[0])] = true;
  }
  std::sort(specials.begin(), specials.end(), [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  size_t plain = 0;  // the start of the text before the next added token
  for (size_t i = 0; i < text.size();) {
    const auto found = !starts[static_cast<unsigned char>(text[i])] ? specials.end()
        : std::find_if(specials.begin(), specials.end(), [&](const auto& s) { return text.compare(i, s.first.size(), s.first) == 0; });
    if (found == specials.end()) {
      ++i;
      continue;
    }
    if (i > plain) encode(text.substr(plain, i - plain), out);
    out.push_back(found->second);
    i += found->first.size();
    plain = i;
  }
  if (plain < text.size()) encode(text.substr(plain), out);
}

std::vector<int32_t> Tokenizer::encode_with_specials(std::string_view text) const {
  std::vector<int32_t> out;
  encode_with_specials(text, out);
  return out;
}

size_t Tokenizer::safe_cut(std::string_view text, size_t from, size_t to) const {
  if (!bpe_) return from < to ? from : std::string_view::npos;
  const Bpe::Tables& t = bpe_->tables();
  return t.split->safe_cut(text, from, to, t.nfc ? nfc_inert : nullptr);
}

size_t Tokenizer::piece_end(std::string_view text, size_t at, Pretokenizer& matcher) const {
  if (!bpe_) return at + 1;
  const Bpe::Tables& t = bpe_->tables();
  // GPT-2's pieces depend on at most one character after them (a whitespace run less its last character
  // before a non-space), and so do they after Digits (also: whether that character is a number; a run of
  // numbers ends before the first that is not one). Llama 3's \s*[\r\n]+ looks to the end of a whitespace run however long, so a
  // piece of the text read so far may be longer in the whole text; and with NFC the pieces of the text as
  // it is are not those of its normal form: the next safe cut instead, which depends on two characters
  // alone. Another pattern's look-ahead is not known: no cut before the end.
  const auto kind = t.split->kind();
  const bool scanner = kind == SplitPattern::Kind::kGpt2 || kind == SplitPattern::Kind::kDigitsGpt2 || kind == SplitPattern::Kind::kDigitRunsGpt2;
  if (scanner && !t.nfc) return t.split->piece_end(text, at, matcher);
  const size_t p = safe_cut(text, at + 1, text.size());
  return p == std::string_view::npos ? text.size() : p;
}

int32_t Tokenizer::bos_id() const { return bpe_ ? bpe_->tables().bos : -1; }

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  encode(text, out);
  return out;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  return decode(ids.data(), static_cast<int64_t>(ids.size()));
}

std::string Tokenizer::decode(const int32_t* ids, int64_t n) const {
  std::string s;
  const int64_t vocab = vocab_size();
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= vocab || (bpe_ && !bpe_->tables().present[ids[i]]))
      throw std::out_of_range("token id " + std::to_string(ids[i]) + " is not in the " + name_ + " vocabulary (ids below " + std::to_string(vocab) + ")");
    if (bpe_) s += bpe_->tables().bytes[ids[i]];
    else s.push_back(static_cast<char>(ids[i]));
  }
  return s;
}

int32_t Tokenizer::special(const std::string& name) const {
  if (!bpe_) return -1;
  auto it = bpe_->tables().specials.find(name);
  return it == bpe_->tables().specials.end() ? -1 : it->second;
}

int64_t Tokenizer::vocab_size() const { return bpe_ ? static_cast<int64_t>(bpe_->tables().bytes.size()) : 256; }

bool Tokenizer::adds_prefix_space() const { return bpe_ && bpe_->tables().add_prefix_space; }

std::string replace_invalid_utf8(std::string_view bytes, int64_t* replaced) {
  std::string out;
  out.reserve(bytes.size());
  int64_t count = 0;
  const auto* s = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = s[i];
    if (c < 0x80) {
      // ASCII runs are most text: copy them in one go.
      size_t j = i + 1;
      while (j < n && s[j] < 0x80) ++j;
      out.append(bytes.data() + i, j - i);
      i = j;
      continue;
    }
    // The well-formed sequences (Unicode table 3-7): the lead byte sets the length and the range of the
    // second byte; the others are 80..BF.
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c == 0xE0) len = 3, lo = 0xA0;
    else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) len = 3;
    else if (c == 0xED) len = 3, hi = 0x9F;
    else if (c == 0xF0) len = 4, lo = 0x90;
    else if (c >= 0xF1 && c <= 0xF3) len = 4;
    else if (c == 0xF4) len = 4, hi = 0x8F;
    size_t k = 1;  // bytes of a valid prefix (the maximal subpart when the sequence breaks off)
    if (len > 0) {
      while (k < len && i + k < n) {
        const unsigned char b = s[i + k];
        if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) break;
        ++k;
      }
    }
    if (len > 0 && k == len) {
      out.append(bytes.data() + i, len);
    } else {
      out.append("\xEF\xBF\xBD");
      ++count;
    }
    i += len > 0 ? k : 1;
  }
  if (replaced) *replaced = count;
  return out;
}

}  // namespace data
