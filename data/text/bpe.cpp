#include "data/text/bpe.h"

#include <queue>

namespace data {
namespace {

// A candidate merge: the symbol starting at byte `left` with the one after it. Ordered by priority, then
// by position (the leftmost first), as tiktoken's scan for the minimum with a strict `<`.
struct Candidate {
  int32_t priority;
  int32_t left;
  int32_t left_id, right_id;
  bool operator>(const Candidate& o) const {
    return priority != o.priority ? priority > o.priority : left > o.left;
  }
};

}  // namespace

void Bpe::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  const auto n = static_cast<int32_t>(piece.size());
  if (n == 0) return;
  if (n == 1) {
    out.push_back(t_.byte_id[static_cast<unsigned char>(piece[0])]);
    return;
  }
  if (t_.whole_pieces) {
    if (auto it = t_.ids.find(std::string(piece)); it != t_.ids.end()) {
      out.push_back(it->second);
      return;
    }
  }
  // Symbols are byte ranges [i, next[i]) with id[i]; a merged-away symbol has next[i] = -1.
  std::vector<int32_t> id(n), next(n), prev(n);
  for (int32_t i = 0; i < n; ++i) {
    id[i] = t_.byte_id[static_cast<unsigned char>(piece[i])];
    next[i] = i + 1;
    prev[i] = i - 1;
  }
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  auto consider = [&](int32_t left) {
    const int32_t right = next[left];
    if (right >= n) return;
    if (auto it = t_.pairs.find(pair_key(id[left], id[right])); it != t_.pairs.end())
      heap.push({it->second.first, left, id[left], id[right]});
  };
  for (int32_t i = 0; i + 1 < n; ++i) consider(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    // Stale: the left symbol was merged away or changed, or its right neighbour changed.
    if (next[c.left] < 0 || id[c.left] != c.left_id) continue;
    const int32_t right = next[c.left];
    if (right >= n || id[right] != c.right_id) continue;
    id[c.left] = t_.pairs.at(pair_key(c.left_id, c.right_id)).second;
    next[c.left] = next[right];
    next[right] = -1;
    if (next[c.left] < n) prev[next[c.left]] = c.left;
    if (prev[c.left] >= 0) consider(prev[c.left]);
    consider(c.left);
  }
  for (int32_t i = 0; i < n; i = next[i]) out.push_back(id[i]);
}

}  // namespace data
