// Byte-level BPE: the merge tables of a tokenizer and the merging of one pre-tokenized piece.
//
// A piece (a few bytes of UTF-8 text, data/text/pretokenize.h) starts as one symbol per byte. While two
// adjacent symbols form a pair the table knows, the pair of lowest priority is merged into one symbol,
// the leftmost pair among equal priorities first. The symbols left are the piece's tokens. This is
// tiktoken's `byte_pair_merge` and Hugging Face tokenizers' BPE `merge_all`; here it runs over a heap of
// candidate pairs, so a long piece costs O(n log n) instead of tiktoken's O(n^2).
//
// The two file forms differ only in where a pair's priority comes from:
//   - tiktoken: two tokens merge when their concatenated bytes are a token; the priority is that token's
//     rank (its id). A piece that is itself a token is taken whole, before any merge
//     (`whole_pieces`, as tiktoken's encoder does).
//   - tokenizer.json: two tokens merge when the merges list holds them; the priority is the merge's index
//     in the list. `ignore_merges` in the file takes whole pieces as tiktoken does.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace data {

class SplitPattern;

/// One thread's memory of the pieces it has encoded (a piece -> its tokens): text repeats its words, and
/// a repeated piece costs a hash lookup instead of a merge. Bounded: emptied when it holds kMaxEntries.
class PieceCache {
 public:
  static constexpr size_t kMaxEntries = 1 << 16;
  /// Longer pieces are not kept.
  static constexpr size_t kMaxPieceBytes = 64;
  const std::vector<int32_t>* find(std::string_view piece) const {
    auto it = map_.find(std::string(piece));
    return it == map_.end() ? nullptr : &it->second;
  }
  void put(std::string_view piece, const int32_t* ids, size_t n) {
    if (piece.size() > kMaxPieceBytes) return;
    if (map_.size() >= kMaxEntries) map_.clear();
    map_.emplace(std::string(piece), std::vector<int32_t>(ids, ids + n));
  }

 private:
  std::unordered_map<std::string, std::vector<int32_t>> map_;
};

class Bpe {
 public:
  /// The tables, filled by the readers (data/text/tokenizer_load.cpp); check() validates them.
  struct Tables {
    /// id -> its bytes (specials hold their text). An id without a token holds "" and `present` false.
    std::vector<std::string> bytes;
    std::vector<bool> present;
    /// The id of each single byte.
    int32_t byte_id[256];
    /// (left id, right id) -> (priority, merged id).
    std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> pairs;
    /// bytes -> id of every ordinary token (for whole pieces).
    std::unordered_map<std::string, int32_t> ids;
    /// name -> id of the special tokens ("<|endoftext|>").
    std::unordered_map<std::string, int32_t> specials;
    /// Take a piece that is itself a token whole (tiktoken; tokenizer.json's ignore_merges).
    bool whole_pieces = true;
    /// Hugging Face ByteLevel's add_prefix_space: a space is put before a text that does not start
    /// with one.
    bool add_prefix_space = false;
    /// The pre-tokenizer's pattern (GPT-2's for a rank file and for ByteLevel alone).
    std::shared_ptr<const SplitPattern> split;
    /// tokenizer.json's normalizer is NFC.
    bool nfc = false;
    /// The special token the post-processor puts before each sequence (Llama 3's <|begin_of_text|>), or -1.
    int32_t bos = -1;
  };

  explicit Bpe(Tables tables) : t_(std::move(tables)) {}
  const Tables& tables() const { return t_; }

  /// The tokens of one piece (its bytes), appended to out.
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;

  static uint64_t pair_key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }

 private:
  Tables t_;
};

}  // namespace data
