// convert-text with a BPE tokenizer: files streamed through once, cut into parts of about 1 MiB
// (TextOptions::part_bytes) where a piece begins, the parts encoded by a pool of threads and written in order.
//
//   reader (this thread)            workers (options.threads)           writer (this thread)
//   bytes -> valid UTF-8 -> parts   part -> pieces -> ids (+ <|eot|>)   ids -> train.h5 / val.h5
//
// A part owns text[0, owned) and carries up to kContext bytes after it, which the pre-tokenizer looks at
// (a look-ahead of up to two characters) but does not encode. At most 2 * threads parts are in flight.
#include "data/files/text_input.h"
#include "data/files/token_h5.h"
#include "data/text/bpe.h"
#include "data/text/pretokenize.h"

#include <cmath>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <future>
#include <mutex>
#include <thread>

namespace data {
namespace {

namespace fs = std::filesystem;

constexpr size_t kContext = 16;     // bytes after a part's end: at least three whole characters
constexpr size_t kBlock = 1 << 20;  // bytes read at a time

struct Part {
  std::string text;  // owned bytes, then the context
  size_t owned = 0;
  bool starts_document = false;  // the document's first part: the post-processor's first token goes before it
  bool ends_document = false;
  bool ends_train = false;  // the split falls right after this part
};

// A pool of threads that encode parts; results come back in submission order through futures.
class Encoders {
 public:
  Encoders(const Tokenizer& tokenizer, int32_t end_of_text, int threads)
      : tok_(tokenizer), eot_(end_of_text), bos_(tokenizer.bos_id()) {
    for (int i = 0; i < std::max(1, threads); ++i) threads_.emplace_back([this] { work(); });
  }
  ~Encoders() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    ready_.notify_all();
    for (auto& t : threads_) t.join();
  }
  std::future<std::vector<int32_t>> submit(Part part) {
    std::packaged_task<std::vector<int32_t>()> task([this, p = std::move(part)] { return encode(p); });
    auto future = task.get_future();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(task));
    }
    ready_.notify_one();
    return future;
  }

 private:
  std::vector<int32_t> encode(const Part& p) {
    thread_local Pretokenizer matcher;
    thread_local PieceCache cache;
    std::vector<int32_t> ids;
    ids.reserve(p.owned / 3);
    if (p.starts_document && bos_ >= 0) ids.push_back(bos_);
    tok_.encode_part(p.text, p.owned, matcher, cache, ids);
    if (p.ends_document) ids.push_back(eot_);
    return ids;
  }
  void work() {
    for (;;) {
      std::packaged_task<std::vector<int32_t>()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }
  const Tokenizer& tok_;
  const int32_t eot_, bos_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::packaged_task<std::vector<int32_t>()>> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

// Where the last whole UTF-8 sequence of s ends: a lead byte near the end whose sequence is cut off by
// the end of the block waits for the next block (valid or not, it is judged with what follows).
size_t complete_prefix(const std::string& s) {
  const size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const auto c = static_cast<unsigned char>(s[n - back]);
    if (c < 0x80) return n;           // ASCII: nothing open
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return need > back ? n - back : n;
  }
  return n;
}

// The valid UTF-8 text of one file after another, cut into parts.
class Parter {
 public:
  // Parts of about `part` bytes; a safe cut is looked for up to `part` bytes past that.
  Parter(const Tokenizer& tok, int64_t split_at, size_t part) : tok_(tok), split_at_(split_at), part_(part) {}

  void start_document(const std::string& path, int64_t raw_offset) {
    path_ = path;
    doc_raw_ = raw_offset;
    doc_pos_ = 0;
    buf_.clear();
    carry_.clear();
    first_ = true;
  }
  // Raw bytes of the document; parts ready are passed to emit(Part).
  template <typename Emit>
  void add(const char* bytes, size_t n, Emit&& emit) {
    carry_.append(bytes, n);
    const size_t whole = complete_prefix(carry_);
    append_valid(std::string_view(carry_).substr(0, whole));
    carry_.erase(0, whole);
    // A part is cut once there is room to look for a safe cut; when the pieces give none (one piece runs
    // past the buffer), wait until the buffer has doubled.
    while (buf_.size() >= std::max(2 * part_ + kContext, wait_until_)) {
      if (!cut(emit, false)) {
        wait_until_ = 2 * buf_.size();
        break;
      }
      wait_until_ = 0;
    }
  }
  template <typename Emit>
  void end_document(Emit&& emit) {
    append_valid(carry_);
    carry_.clear();
    wait_until_ = 0;
    while (!buf_.empty()) cut(emit, true);
  }
  int64_t replaced() const { return replaced_; }

 private:
  void append_valid(std::string_view raw) {
    if (raw.empty()) return;
    int64_t r = 0;
    std::string valid = replace_invalid_utf8(raw, &r);
    replaced_ += r;
    if (first_ && tok_.adds_prefix_space() && valid[0] != ' ') valid.insert(valid.begin(), ' ');
    first_ = false;
    buf_ += valid;
  }

  // Cuts one part off buf_ and passes it on; false when no place to cut is known yet. At the document's
  // end (final) the rest may go whole, and a part is always cut.
  template <typename Emit>
  bool cut(Emit&& emit, bool final) {
    size_t target = part_;
    bool split_here = false;
    // The split, placed as if the text had its raw length (replacements move it by a few bytes).
    const int64_t buf_raw = doc_raw_ + doc_pos_;
    if (!split_done_ && split_at_ <= buf_raw) {  // right here: an empty part ends the training split
      Part empty;
      empty.ends_train = true;
      split_done_ = true;
      emit(std::move(empty));
    } else if (!split_done_ && split_at_ < buf_raw + static_cast<int64_t>(buf_.size())) {
      target = static_cast<size_t>(split_at_ - buf_raw);
      split_here = true;
    }
    size_t end = std::string::npos;
    if (final && buf_.size() <= target) {
      end = buf_.size();
    } else {
      const size_t limit = final ? buf_.size() : buf_.size() - kContext;
      end = target < limit ? tok_.safe_cut(buf_, target, std::min(limit, target + part_)) : std::string::npos;
      if (end == std::string::npos) end = scan_cut(target, limit, final);
      if (end == std::string::npos) return false;
    }
    Part p;
    p.owned = end;
    // The context ends on a whole character (buf_ holds whole characters: step back off a continuation).
    size_t context_end = std::min(buf_.size(), end + kContext);
    while (context_end < buf_.size() && (static_cast<unsigned char>(buf_[context_end]) & 0xC0) == 0x80) --context_end;
    p.text = buf_.substr(0, context_end);
    p.starts_document = doc_pos_ == 0;
    p.ends_document = final && end == buf_.size();
    if (split_here) {
      p.ends_train = true;
      split_done_ = true;
    }
    buf_.erase(0, end);
    doc_pos_ += static_cast<int64_t>(end);
    emit(std::move(p));
    return true;
  }

  // No safe cut near the target: the pieces themselves, from the part's start, give one. Cuts after the
  // first piece that ends at or past the target, or after the last one that ends before the limit; npos
  // when the first piece runs past the limit (more text is needed).
  size_t scan_cut(size_t target, size_t limit, bool final) {
    size_t at = 0, last = 0;
    while (at < limit) {
      const size_t end = tok_.piece_end(buf_, at, matcher_);
      if (end - at > static_cast<size_t>(kMaxPieceBytes)) refuse(at);
      if (end > limit) break;
      last = end;
      if (end >= target) return end;
      at = end;
    }
    if (final && at >= limit) return buf_.size();
    if (last == 0) {
      if (buf_.size() > static_cast<size_t>(kMaxPieceBytes) + kContext) refuse(0);
      return std::string::npos;
    }
    return last;
  }

  [[noreturn]] void refuse(size_t at) const {
    throw std::invalid_argument("convert-text: '" + path_ + "': at byte " + std::to_string(doc_pos_ + static_cast<int64_t>(at)) +
                                ", a run of more than 1 MiB without a break between pieces (letters, digits, spaces or "
                                "other characters, all of one kind); GPT-2's BPE would take it as one word, so the "
                                "file is refused");
  }

  const Tokenizer& tok_;
  Pretokenizer matcher_;
  const int64_t split_at_;
  const size_t part_;
  size_t wait_until_ = 0;
  bool split_done_ = false;
  std::string path_, buf_, carry_;
  int64_t doc_raw_ = 0, doc_pos_ = 0, replaced_ = 0;
  bool first_ = true;
};

}  // namespace

std::string end_of_text_of(const Tokenizer& tokenizer) {
  for (const char* name : {"<|endoftext|>", "<|end_of_text|>"})
    if (tokenizer.special(name) >= 0) return name;
  return "";
}

TokenConversion convert_text_bpe(const std::vector<std::string>& files_or_dirs, const std::string& out_dir,
                                 double val_fraction, const TextOptions& options) {
  const Tokenizer& tok = *options.tokenizer;
  const std::string end_of_text = options.end_of_text.empty() ? end_of_text_of(tok) : options.end_of_text;
  const int32_t eot = tok.special(end_of_text);
  if (eot < 0) {
    throw std::invalid_argument("convert-text: the tokenizer '" + tok.path() + "' has no special token '" +
                                (end_of_text.empty() ? std::string("<|endoftext|> or <|end_of_text|>") : end_of_text) +
                                "' to end each document (--end-of-text names another)");
  }
  TokenConversion r;
  r.files = text_files(files_or_dirs);
  r.tokenizer = tok.name();
  r.vocab_size = tok.vocab_size();
  const std::vector<TextInput> inputs = plan_text_inputs(r.files);
  int64_t total = 0;
  for (const auto& in : inputs) total += in.bytes;
  if (total == 0) throw std::invalid_argument("convert-text: the input files are all empty");
  const int64_t val = static_cast<int64_t>(std::llround(val_fraction * static_cast<double>(total)));
  fs::create_directories(out_dir);
  r.train_path = (fs::path(out_dir) / "train.h5").string();
  if (val > 0) r.val_path = (fs::path(out_dir) / "val.h5").string();
  const std::string source = tok.name() + " tokens of " + std::to_string(r.files.size()) + " text files (" + r.files.front() +
                             (r.files.size() > 1 ? " ... " + r.files.back() : std::string()) + ")";
  TokenWriter train_w(r.train_path, r.vocab_size, source + ", before about byte " + std::to_string(total - val));
  train_w.set_tokenizer(tok.name(), tok.path());
  std::unique_ptr<TokenWriter> val_w;
  if (val > 0) {
    val_w = std::make_unique<TokenWriter>(r.val_path, r.vocab_size, source + ", from about byte " + std::to_string(total - val));
    val_w->set_tokenizer(tok.name(), tok.path());
  }

  Encoders encoders(tok, eot, options.threads);
  struct Pending {
    std::future<std::vector<int32_t>> ids;
    bool ends_train;
  };
  std::deque<Pending> pending;
  bool in_val = false;
  std::vector<int64_t> wide;
  auto write_front = [&] {
    Pending p = std::move(pending.front());
    pending.pop_front();
    const std::vector<int32_t> ids = p.ids.get();
    wide.assign(ids.begin(), ids.end());
    (in_val ? *val_w : train_w).append(wide.data(), static_cast<int64_t>(wide.size()));
    if (p.ends_train && val_w) in_val = true;
  };
  auto emit = [&](Part part) {
    const bool ends_train = part.ends_train;
    pending.push_back({encoders.submit(std::move(part)), ends_train});
    while (pending.size() > 2 * static_cast<size_t>(std::max(1, options.threads))) write_front();
  };
  if (options.part_bytes < 1) throw std::invalid_argument("convert-text: part_bytes must be at least 1");
  Parter parter(tok, val > 0 ? total - val : INT64_MAX, options.part_bytes);
  std::vector<char> block(kBlock);
  int64_t offset = 0;
  for (const auto& in : inputs) {
    parter.start_document(in.path, offset);
    stream_text(in, block, [&](const char* bytes, int64_t n) { parter.add(bytes, static_cast<size_t>(n), emit); });
    parter.end_document(emit);
    offset += in.bytes;
  }
  while (!pending.empty()) write_front();
  r.train_tokens = train_w.finish();
  if (val_w) r.val_tokens = val_w->finish();
  r.bytes = total;
  r.replaced = parter.replaced();
  return r;
}

}  // namespace data
