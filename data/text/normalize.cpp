#include "data/text/normalize.h"

#include <unicode/unorm2.h>
#include <unicode/ustring.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace data {
namespace {

const UNormalizer2* nfc_instance() {
  static const UNormalizer2* n = [] {
    UErrorCode e = U_ZERO_ERROR;
    const UNormalizer2* got = unorm2_getNFCInstance(&e);
    if (U_FAILURE(e)) throw std::runtime_error(std::string("ICU's NFC normalizer is not available: ") + u_errorName(e));
    return got;
  }();
  return n;
}

void check_icu(UErrorCode e, const char* what) {
  if (U_FAILURE(e)) throw std::runtime_error(std::string("NFC: ") + what + ": " + u_errorName(e));
}

}  // namespace

std::string nfc(std::string_view text) {
  bool ascii = true;
  for (unsigned char c : text) ascii = ascii && c < 0x80;
  if (ascii) return std::string(text);
  if (text.size() >= (1u << 30)) throw std::length_error("NFC: a text of 1 GiB or more");
  const UNormalizer2* norm = nfc_instance();
  UErrorCode e = U_ZERO_ERROR;
  std::vector<UChar> in(text.size() + 1);  // UTF-16 has at most as many units as UTF-8 has bytes
  int32_t n16 = 0;
  u_strFromUTF8(in.data(), static_cast<int32_t>(in.size()), &n16, text.data(), static_cast<int32_t>(text.size()), &e);
  check_icu(e, "reading UTF-8");
  if (unorm2_spanQuickCheckYes(norm, in.data(), n16, &e) == n16 && U_SUCCESS(e)) return std::string(text);
  e = U_ZERO_ERROR;
  // NFC grows a text by at most 3 times (UAX #15, "Stabilized Strings"); preflight if ever not.
  std::vector<UChar> out(3 * static_cast<size_t>(n16) + 16);
  int32_t m = unorm2_normalize(norm, in.data(), n16, out.data(), static_cast<int32_t>(out.size()), &e);
  if (e == U_BUFFER_OVERFLOW_ERROR) {
    e = U_ZERO_ERROR;
    out.resize(static_cast<size_t>(m) + 1);
    m = unorm2_normalize(norm, in.data(), n16, out.data(), static_cast<int32_t>(out.size()), &e);
  }
  check_icu(e, "normalizing");
  int32_t n8 = 0;
  std::string result(3 * static_cast<size_t>(m) + 1, '\0');  // a UTF-16 unit is at most 3 bytes of UTF-8
  u_strToUTF8(result.data(), static_cast<int32_t>(result.size()), &n8, out.data(), m, &e);
  check_icu(e, "writing UTF-8");
  result.resize(static_cast<size_t>(n8));
  return result;
}

bool nfc_inert(uint32_t cp) { return unorm2_isInert(nfc_instance(), static_cast<UChar32>(cp)) != 0; }

}  // namespace data
