// Unicode normalization for tokenizer.json's `normalizer: {"type": "NFC"}` (Qwen2's): canonical
// decomposition then canonical composition (Unicode Standard Annex #15), by ICU.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace data {

/// The NFC form of `text` (valid UTF-8); the text itself when it is already in NFC (all of ASCII is).
/// Throws std::length_error for a text of 1 GiB or more (ICU counts in int32).
std::string nfc(std::string_view text);

/// True when NFC leaves the character cp as it is whatever stands around it: it neither combines with
/// a neighbour nor changes (ICU's unorm2_isInert). A text cut between two such characters normalizes as
/// its two parts do.
bool nfc_inert(uint32_t cp);

}  // namespace data
