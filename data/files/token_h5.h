// The project's HDF5 token format ("trainer.tokens", version 1; docs/TRANSFORMERS.md), converters from
// text (byte-level tokens) and from nanoGPT's uint16 .bin files, and the reader: TokenDataset, a
// TokenSource for the loaders of data/samples/token_loader.h.
//
// Layout of a file:
//   /tokens  uint16 (vocab_size <= 65536) or int32, 1-D (N), chunked (65536 tokens a chunk)
//   root attributes: format = "trainer.tokens", format_version = 1 (int64), vocab_size (int64),
//                    source (string: what the tokens came from); for BPE tokens (convert-text
//                    --tokenizer) also tokenizer (string: its name, "gpt2") and tokenizer_path (string:
//                    the absolute path of the tokenizer file, which `trainer sample` reads)
// Every token is in [0, vocab_size). Strings are variable-length UTF-8 (h5py reads them as str).
//
// Every HDF5 call is made while holding data::hdf5_lock() (data/files/hdf5_lock.h).
#pragma once

#include "data/samples/token_loader.h"
#include "data/text/tokenizer.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace data {

/// The format's name and version, written as root attributes `format` and `format_version`.
inline constexpr const char* kTokensFormat = "trainer.tokens";
inline constexpr int64_t kTokensVersion = 1;
/// Tokens per chunk of /tokens.
inline constexpr int64_t kTokensChunk = 65536;

/// Writes a trainer.tokens file token by token (for streams that do not fit in memory). The file is
/// written as `path + ".tmp"` and renamed to `path` by finish(), so an interrupted conversion never
/// leaves a file that looks complete. The dataset is uint16 when vocab_size <= 65536, else int32.
class TokenWriter {
 public:
  /// Creates "<path>.tmp". Throws std::invalid_argument for vocab_size outside [1, 2^31) and
  /// std::runtime_error naming the path if the file cannot be created.
  TokenWriter(std::string path, int64_t vocab_size, std::string source);
  /// Closes the file; without finish() the partial "<path>.tmp" is removed.
  ~TokenWriter();
  TokenWriter(const TokenWriter&) = delete;
  TokenWriter& operator=(const TokenWriter&) = delete;

  /// Appends n tokens. Throws std::invalid_argument "... token X at position P is outside
  /// [0, vocab_size = V)" (P counted from the start of the file) and writes nothing of this call.
  void append(const int64_t* tokens, int64_t n);
  void append(const std::vector<int64_t>& tokens) { append(tokens.data(), static_cast<int64_t>(tokens.size())); }
  /// Records the tokenizer (attributes `tokenizer` and `tokenizer_path`, written by finish()).
  void set_tokenizer(std::string name, std::string path) {
    tokenizer_ = std::move(name);
    tokenizer_path_ = std::move(path);
  }
  /// Writes the attributes, closes and renames the file. Returns the number of tokens.
  int64_t finish();

 private:
  void flush();
  std::string path_, tmp_, source_, tokenizer_, tokenizer_path_;
  int64_t vocab_;
  int64_t written_ = 0;  // in the file
  std::vector<int64_t> buffer_;
  int64_t file_ = -1, dset_ = -1;  // hid_t
  bool finished_ = false;
};

/// Writes `tokens` as one trainer.tokens file (TokenWriter in one call). Returns tokens.size().
int64_t write_tokens(const std::string& path, const std::vector<int64_t>& tokens, int64_t vocab_size,
                     const std::string& source);

/// What a conversion wrote.
struct TokenConversion {
  /// The input files, in the order their bytes were concatenated.
  std::vector<std::string> files;
  /// Paths written ("" for a split that was not written).
  std::string train_path, val_path;
  int64_t train_tokens = 0, val_tokens = 0;
  /// Bytes read, and the tokenizer's name ("" for bytes) and vocabulary.
  int64_t bytes = 0;
  std::string tokenizer;
  int64_t vocab_size = 256;
  /// Invalid UTF-8 sequences replaced by U+FFFD (BPE only; bytes are taken as they are).
  int64_t replaced = 0;
  /// One line: "N files, X bytes: train.h5 A tokens, val.h5 B tokens (gpt2, vocab 50257)", and the
  /// replacements when there were any.
  std::string summary() const;
};

/// How convert_text makes its tokens.
struct TextOptions {
  /// The tokenizer; null: bytes (token = byte value, vocabulary 256).
  std::shared_ptr<const Tokenizer> tokenizer;
  /// Threads that encode (BPE only); at least 1.
  int threads = 1;
  /// The special token that ends each document (BPE only); empty: the tokenizer's own, the first of
  /// <|endoftext|> (GPT-2, Qwen2, SmolLM2) and <|end_of_text|> (Llama 3) it has (end_of_text_of).
  std::string end_of_text;
  /// The size of the parts the text is cut into for the threads (BPE only; the tests make it small, to
  /// cut often: the ids do not depend on it).
  size_t part_bytes = 1 << 20;
};

/// The end-of-text token of `tokenizer` when none is named: the first of <|endoftext|> and <|end_of_text|>
/// it has; "" when it has neither.
std::string end_of_text_of(const Tokenizer& tokenizer);

/// The largest piece (data/text/pretokenize.h) a BPE conversion takes: a longer run of letters, digits,
/// other characters or spaces is refused. GPT-2's BPE would take such a run whole, in time that grows
/// with its length, and no text has one.
inline constexpr int64_t kMaxPieceBytes = 1 << 20;

/// Byte-level tokens (vocabulary 256: token = byte value) from text files. Each entry of
/// `files_or_dirs` is a file (taken as given) or a directory (every file below it, recursively, except
/// the fortunes package's `.dat` index files and `.u8` links). All files are concatenated in that order
/// (directory contents sorted by path) with nothing in between, and the stream is split at its end:
/// the last round(val_fraction * total) bytes go to out_dir/val.h5, the rest to out_dir/train.h5.
/// val_fraction in [0, 1); 0 writes no val.h5. Sizes are taken before reading: a file whose size says
/// 0 (procfs: /proc/self/status) is read whole at that point, and any other file contributes the bytes
/// its size promised (a file growing meanwhile is cut there). Creates out_dir. Throws
/// std::invalid_argument for a missing input, no files, or a bad val_fraction; std::runtime_error for I/O
/// failures and for a file that gives fewer bytes than its size promised, naming the path.
///
/// With a BPE tokenizer (options.tokenizer, data/text/tokenizer.h), tokens are its ids instead, equal
/// to tiktoken's encode_ordinary of each file's text, id for id:
///   - each file is one document: its tokens are followed by options.end_of_text (GPT-2's
///     <|endoftext|>, 50256), and preceded by the token the tokenizer's post-processor puts first, where it
///     has one (Llama 3's <|begin_of_text|>: Tokenizer::bos_id), as transformers' tokenizer(text) gives
///     them; an empty file adds nothing;
///   - invalid UTF-8 is replaced by U+FFFD, as Python's errors="replace" does (counted in `replaced`);
///   - the stream is split where a piece begins, at the first such place from about the last
///     round(val_fraction * total) bytes on;
///   - it runs in bounded memory (a few MiB a thread) on files of any size; a piece of more than
///     kMaxPieceBytes is refused (std::invalid_argument naming the file and the byte offset), as is a
///     tokenizer without the end_of_text special.
/// The files record the tokenizer (TokenWriter::set_tokenizer).
TokenConversion convert_text(const std::vector<std::string>& files_or_dirs, const std::string& out_dir,
                             double val_fraction, const TextOptions& options = {});

/// A nanoGPT train.bin / val.bin (raw little-endian uint16 tokens, e.g. GPT-2 BPE with vocab 50257) as
/// a trainer.tokens file `out` (uint16). Throws std::invalid_argument for an odd file size or a token
/// >= vocab_size (naming its position), std::runtime_error for I/O failures. Returns the tokens written.
int64_t convert_uint16_bin(const std::string& path, int64_t vocab_size, const std::string& out);

/// A trainer.tokens file, read from disk on demand (hyperslab reads under hdf5_lock(); the file stays
/// open) or held in memory. Thread-safe for concurrent read() calls.
class TokenDataset : public TokenSource {
 public:
  /// Opens and checks the file: it exists, is HDF5, has format "trainer.tokens", format_version 1, a
  /// positive vocab_size and a 1-D uint16 or int32 /tokens whose extent the file really stores
  /// (dataset_size_problem in data/files/hdf5_lock.h). With in_memory, reads every token and checks
  /// each is in [0, vocab_size). Throws std::runtime_error with one line "token file 'PATH': ..." that
  /// says what is wrong.
  TokenDataset(const std::string& path, bool in_memory);
  ~TokenDataset();
  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;

  /// Tokens in the file, N.
  int64_t size() const override { return size_; }
  int64_t vocab_size() const override { return vocab_; }
  /// The path.
  const std::string& name() const override { return path_; }
  /// The `source` attribute ("" if absent).
  const std::string& source() const { return source_; }
  /// The `tokenizer` and `tokenizer_path` attributes: "" for byte tokens and files written before them.
  const std::string& tokenizer() const { return tokenizer_; }
  const std::string& tokenizer_path() const { return tokenizer_path_; }
  const std::string& path() const { return path_; }
  bool in_memory() const { return in_memory_; }

  /// Copies tokens [begin, begin + n) to out. Throws std::out_of_range outside [0, N), and
  /// std::runtime_error "token file 'PATH': token X at position P is outside [0, vocab_size = V)".
  void read(int64_t begin, int64_t n, int64_t* out) const override;

 private:
  std::string path_, source_, tokenizer_, tokenizer_path_;
  int64_t size_ = 0, vocab_ = 0;
  bool in_memory_ = false;
  bool uint16_ = true;
  std::vector<uint16_t> u16_;
  std::vector<int32_t> i32_;
  int64_t file_ = -1, dset_ = -1;  // hid_t, open when !in_memory
};

}  // namespace data
