// Tests of data/files/token_h5.h: the trainer.tokens format (written, read back, attributes, errors), the text
// converter on hand-written files (exact bytes) and on the real fortunes, the uint16 .bin converter, and
// the loaders (determinism per (seed, epoch), resume by seek, targets = inputs shifted by one against the
// raw stream, rank slices, the evaluation pass), and the synthetic token stream against its definition.
// data/files/token_h5.h first: it brings torch, whose c10/util/variant.h calls a function `data(...)` and does
// not compile after a `namespace data` is declared (hdf5_lock.h, rng.h) without the precompiled header.
#include "data/files/token_h5.h"
#include "data/files/hdf5_lock.h"
#include "data/pixels/rng.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <hdf5.h>
#include <torch/torch.h>

#include <algorithm>
#include <fstream>
#include <numeric>
#include <set>
#include <string>
#include <vector>

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_tokens {

namespace {

namespace fs = std::filesystem;

std::vector<int64_t> all_tokens(const data::TokenDataset& ds) {
  std::vector<int64_t> t(ds.size());
  ds.read(0, ds.size(), t.data());
  return t;
}

std::vector<int64_t> bytes_of(const std::string& s) {
  std::vector<int64_t> t;
  for (unsigned char c : s) t.push_back(c);
  return t;
}

// Expects `f` to throw E whose message contains `text`.
template <typename E, typename F>
void expect_error(F&& f, const std::string& text) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected one containing: " << text;
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << "message: " << e.what() << "\nexpected: " << text;
  }
}

// An HDF5 file written with the C API directly, for the reader's error paths: /tokens int32 with
// the given values, and the given format / vocab_size attributes (format "" = none).
void write_raw(const std::string& path, const std::vector<int32_t>& tokens, const std::string& format, int64_t vocab) {
  std::lock_guard<std::mutex> lock(data::hdf5_lock());
  hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  const hsize_t n = tokens.size();
  hid_t space = H5Screate_simple(1, &n, nullptr);
  hid_t d = H5Dcreate2(f, "tokens", H5T_STD_I32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  H5Dwrite(d, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, tokens.data());
  hid_t scalar = H5Screate(H5S_SCALAR);
  if (!format.empty()) {
    // Fixed-length, as some tools write it (the converter writes variable-length strings).
    hid_t st = H5Tcopy(H5T_C_S1);
    H5Tset_size(st, format.size() + 1);
    hid_t a = H5Acreate2(f, "format", st, scalar, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(a, st, format.c_str());
    H5Aclose(a);
    H5Tclose(st);
  }
  const int64_t version = 1;
  hid_t a = H5Acreate2(f, "format_version", H5T_STD_I64LE, scalar, H5P_DEFAULT, H5P_DEFAULT);
  H5Awrite(a, H5T_NATIVE_INT64, &version);
  H5Aclose(a);
  a = H5Acreate2(f, "vocab_size", H5T_STD_I64LE, scalar, H5P_DEFAULT, H5P_DEFAULT);
  H5Awrite(a, H5T_NATIVE_INT64, &vocab);
  H5Aclose(a);
  H5Sclose(scalar);
  H5Dclose(d);
  H5Sclose(space);
  H5Fclose(f);
}

// A stream of N tokens whose value at i is i % vocab: every window's content says where it came from.
std::shared_ptr<data::TokenDataset> counting_dataset(const testutil::TempDir& dir, int64_t n, bool in_memory = true) {
  std::vector<int64_t> t(n);
  for (int64_t i = 0; i < n; ++i) t[i] = i % 50000;
  const auto path = (dir / ("count" + std::to_string(n) + ".h5")).string();
  if (!fs::exists(path)) data::write_tokens(path, t, 50000, "counting");
  return std::make_shared<data::TokenDataset>(path, in_memory);
}

// ---------------------------------------------------------------------------------------------------------
// Format, converters, reader.

TEST(TokensConvert, HandWrittenTextExactBytes) {
  testutil::TempDir dir("tok_text");
  fs::create_directories(dir / "in" / "sub");
  const std::string a = "Hello, world!\n", b = "caf\xc3\xa9 \x01\xff\n", c = "%\nlast!";
  testutil::write_file(dir / "in" / "b", a);  // sorted by path: in/b, in/c.txt, in/sub/a
  testutil::write_file(dir / "in" / "c.txt", b);
  testutil::write_file(dir / "in" / "sub" / "a", c);
  testutil::write_file(dir / "in" / "b.dat", "INDEX");  // skipped: the fortunes package's index files
  fs::create_symlink("b", dir / "in" / "b.u8");          // skipped: its links
  const auto r = data::convert_text({(dir / "in").string()}, (dir / "out").string(), 0.25);

  const std::string all = a + b + c;  // 14 + 9 + 7 = 30 bytes; val = round(7.5) = 8
  ASSERT_EQ(r.files.size(), 3u);
  EXPECT_EQ(r.files[0], (dir / "in" / "b").string());
  EXPECT_EQ(r.files[2], (dir / "in" / "sub" / "a").string());
  EXPECT_EQ(r.train_tokens, 22);
  EXPECT_EQ(r.val_tokens, 8);
  data::TokenDataset train((dir / "out" / "train.h5").string(), false), val(r.val_path, true);
  EXPECT_EQ(all_tokens(train), bytes_of(all.substr(0, 22)));
  EXPECT_EQ(all_tokens(val), bytes_of(all.substr(22)));
  EXPECT_EQ(train.vocab_size(), 256);
  EXPECT_NE(train.source().find("bytes of 3 text files"), std::string::npos) << train.source();
  EXPECT_EQ(r.summary(), "3 files, 30 bytes: " + r.train_path + " 22 tokens, " + r.val_path + " 8 tokens (vocab 256)");

  // A file named explicitly is taken as given; val_fraction 0 writes no val.h5.
  const auto one = data::convert_text({(dir / "in" / "b.dat").string()}, (dir / "out2").string(), 0.0);
  EXPECT_EQ(all_tokens(data::TokenDataset(one.train_path, true)), bytes_of("INDEX"));
  EXPECT_EQ(one.val_path, "");
  EXPECT_FALSE(fs::exists(dir / "out2" / "val.h5"));

  expect_error<std::invalid_argument>([&] { data::convert_text({(dir / "nope").string()}, dir.str(), 0.1); },
                                      "convert-text: '" + (dir / "nope").string() + "' is neither a file nor a directory");
  expect_error<std::invalid_argument>([&] { data::convert_text({(dir / "in").string()}, dir.str(), 1.0); },
                                      "convert-text: val_fraction must be in [0, 1), got 1");
}

TEST(TokensConvert, RealFortunes) {
  const std::string src = "/usr/share/games/fortunes";
  if (!fs::exists(src)) GTEST_SKIP() << src << " is missing (apt-get install fortunes)";
  testutil::TempDir dir("tok_fortunes");
  // The reference size from the shell: every regular file but the .dat indexes and .u8 links.
  const auto wc = testutil::run("find " + src + " -type f ! -name '*.dat' ! -name '*.u8' -print0 | xargs -0 cat | wc -c");
  ASSERT_EQ(wc.exit_code, 0) << wc.output;
  const int64_t expected = std::stoll(wc.output);
  EXPECT_GT(expected, 2000000);
  const auto r = data::convert_text({src}, dir.str(), 0.1);
  EXPECT_EQ(r.train_tokens + r.val_tokens, expected);
  EXPECT_EQ(r.val_tokens, std::llround(0.1 * expected));
  for (const auto& f : r.files) {
    EXPECT_NE(fs::path(f).extension(), ".dat") << f;
    EXPECT_NE(fs::path(f).extension(), ".u8") << f;
  }
  data::TokenDataset train(r.train_path, true);
  EXPECT_EQ(train.size(), r.train_tokens);
  EXPECT_EQ(train.vocab_size(), 256);
  // The first bytes are those of the first file in path order.
  std::ifstream first(r.files.front(), std::ios::binary);
  std::string head(64, '\0');
  first.read(head.data(), 64);
  EXPECT_EQ(train.slice(0, 64).equal(torch::tensor(bytes_of(head))), true);
  // English text: mostly printable ASCII, spaces the most common byte.
  auto counts = torch::bincount(train.slice(0, train.size()), {}, 256);
  EXPECT_EQ(counts.argmax().item<int64_t>(), ' ');
}

TEST(TokensConvert, Uint16BinLikeNanoGpt) {
  testutil::TempDir dir("tok_bin");
  const std::vector<uint16_t> tokens = {0, 1, 50256, 300, 65535 % 50257, 42};
  {
    std::ofstream f(dir / "train.bin", std::ios::binary);
    for (uint16_t t : tokens) {
      const char le[2] = {static_cast<char>(t & 0xff), static_cast<char>(t >> 8)};
      f.write(le, 2);
    }
  }
  EXPECT_EQ(data::convert_uint16_bin((dir / "train.bin").string(), 50257, (dir / "train.h5").string()), 6);
  data::TokenDataset ds((dir / "train.h5").string(), false);
  EXPECT_EQ(all_tokens(ds), std::vector<int64_t>(tokens.begin(), tokens.end()));
  EXPECT_EQ(ds.vocab_size(), 50257);
  expect_error<std::invalid_argument>(
      [&] { data::convert_uint16_bin((dir / "train.bin").string(), 1000, (dir / "bad.h5").string()); },
      "convert-bin: token 50256 at position 2 of '" + (dir / "train.bin").string() + "' is >= vocab_size 1000");
  EXPECT_FALSE(fs::exists(dir / "bad.h5"));
  EXPECT_FALSE(fs::exists(dir / "bad.h5.tmp"));
  testutil::write_file(dir / "odd.bin", "abc");
  expect_error<std::invalid_argument>(
      [&] { data::convert_uint16_bin((dir / "odd.bin").string(), 256, (dir / "odd.h5").string()); },
      "has an odd size (3 bytes); expected raw uint16 tokens");
}

TEST(TokensDataset, RoundTripBothDtypesInMemoryAndOnDisk) {
  testutil::TempDir dir("tok_rt");
  const std::vector<int64_t> small = {5, 0, 255, 7}, big = {70000, 0, 99999, 65536};
  data::write_tokens((dir / "u16.h5").string(), small, 256, "s");
  data::write_tokens((dir / "i32.h5").string(), big, 100000, "b");
  for (bool mem : {true, false}) {
    data::TokenDataset a((dir / "u16.h5").string(), mem), b((dir / "i32.h5").string(), mem);
    EXPECT_EQ(all_tokens(a), small);
    EXPECT_EQ(all_tokens(b), big);
    EXPECT_EQ(b.vocab_size(), 100000);
    EXPECT_EQ(a.source(), "s");
    EXPECT_TRUE(torch::equal(b.slice(1, 2), torch::tensor(std::vector<int64_t>{0, 99999})));
    EXPECT_THROW(a.read(3, 2, nullptr), std::out_of_range);
  }
  // The dtype follows the vocabulary: uint16 up to 65536, int32 above.
  std::lock_guard<std::mutex> lock(data::hdf5_lock());
  const std::vector<std::pair<std::string, size_t>> files = {{"u16.h5", 2}, {"i32.h5", 4}};
  for (const auto& [name, size] : files) {
    hid_t f = H5Fopen((dir / name).string().c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t d = H5Dopen2(f, "tokens", H5P_DEFAULT);
    hid_t t = H5Dget_type(d);
    EXPECT_EQ(H5Tget_size(t), size) << name;
    hid_t plist = H5Dget_create_plist(d);
    EXPECT_EQ(H5Pget_layout(plist), H5D_CHUNKED) << name;
    H5Pclose(plist);
    H5Tclose(t);
    H5Dclose(d);
    H5Fclose(f);
  }
}

TEST(TokensDataset, ErrorsNameTheFileAndTheProblem) {
  testutil::TempDir dir("tok_err");
  const auto missing = (dir / "missing.h5").string();
  expect_error<std::runtime_error>([&] { data::TokenDataset(missing, true); },
                                   "token file '" + missing + "': no such file (make one with `trainer convert-text`");
  testutil::write_file(dir / "text.h5", "just text");
  expect_error<std::runtime_error>([&] { data::TokenDataset((dir / "text.h5").string(), true); },
                                   "token file '" + (dir / "text.h5").string() + "': not an HDF5 file");
  write_raw((dir / "images.h5").string(), {1, 2}, "trainer.images", 10);
  expect_error<std::runtime_error>([&] { data::TokenDataset((dir / "images.h5").string(), true); },
                                   "': format is 'trainer.images', expected 'trainer.tokens' (docs/TRANSFORMERS.md)");
  write_raw((dir / "noformat.h5").string(), {1, 2}, "", 10);
  expect_error<std::runtime_error>([&] { data::TokenDataset((dir / "noformat.h5").string(), true); },
                                   "': no root attribute 'format'; expected a trainer.tokens file");
  // Fixed-length strings are read too, and a token >= vocab_size is named with its position.
  const auto bad = (dir / "bad.h5").string();
  write_raw(bad, {1, 2, 12, 3}, "trainer.tokens", 10);
  expect_error<std::runtime_error>([&] { data::TokenDataset(bad, true); },
                                   "token file '" + bad + "': token 12 at position 2 is outside [0, vocab_size = 10)");
  data::TokenDataset lazy(bad, false);  // on disk: checked as read
  std::vector<int64_t> out(4);
  lazy.read(0, 2, out.data());
  EXPECT_EQ(out[1], 2);
  expect_error<std::runtime_error>([&] { lazy.read(1, 3, out.data()); },
                                   "token file '" + bad + "': token 12 at position 2 is outside [0, vocab_size = 10)");
  expect_error<std::invalid_argument>([&] { data::write_tokens((dir / "w.h5").string(), {3, 256}, 256, ""); },
                                      "token 256 at position 1 is outside [0, vocab_size = 256)");
  EXPECT_FALSE(fs::exists(dir / "w.h5.tmp"));
}

// ---------------------------------------------------------------------------------------------------------
// Loaders.

TEST(TokensLoader, WindowsAreAFunctionOfSeedAndEpoch) {
  testutil::TempDir dir("tok_loader");
  auto ds = counting_dataset(dir, 10007);
  data::TokenLoaderOptions o;
  o.global_batch = 8;
  o.context = 32;
  o.seed = 5;
  data::TokenLoader a(ds, o), b(ds, o);
  // S = floor((N - 1) / T) - 1 = floor(10006 / 32) - 1 = 311 slots; 311 / 8 = 38 steps.
  EXPECT_EQ(a.windows_per_epoch(), 311);
  EXPECT_EQ(a.steps_per_epoch(), 38);
  for (int64_t e : {0, 1, 7}) {
    const auto w = a.epoch_windows(e);
    EXPECT_EQ(w, b.epoch_windows(e));
    // Non-overlapping slots of one offset: sorted, they step by exactly T, and the last window fits.
    auto sorted = w;
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 1; i < sorted.size(); ++i) ASSERT_EQ(sorted[i] - sorted[i - 1], 32);
    EXPECT_GE(sorted.front(), 0);
    EXPECT_LE(sorted.back() + 33, ds->size());
  }
  EXPECT_NE(a.epoch_windows(0), a.epoch_windows(1));
  o.seed = 6;
  EXPECT_NE(data::TokenLoader(ds, o).epoch_windows(0), a.epoch_windows(0));
  // The offset moves between epochs (over 20 epochs, at least two distinct offsets).
  std::set<int64_t> offsets;
  for (int64_t e = 0; e < 20; ++e) {
    const auto w = a.epoch_windows(e);
    offsets.insert(*std::min_element(w.begin(), w.end()));
  }
  EXPECT_GT(offsets.size(), 1u);

  // The same seed and epoch give the same batches, in the epoch's order.
  for (int i = 0; i < 40; ++i) {
    const auto x = a.next(), y = b.next();
    ASSERT_TRUE(torch::equal(x.images, y.images));
    ASSERT_EQ(x.indices, y.indices);
  }
}

TEST(TokensLoader, TargetsAreInputsShiftedByOneAgainstTheRawStream) {
  testutil::TempDir dir("tok_shift");
  // Real text on disk (not in memory), so every window is a hyperslab read.
  const std::string text = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. ";
  std::string all;
  for (int i = 0; i < 40; ++i) all += text + std::to_string(i);
  testutil::write_file(dir / "t.txt", all);
  const auto r = data::convert_text({(dir / "t.txt").string()}, (dir / "out").string(), 0.0);
  auto ds = std::make_shared<data::TokenDataset>(r.train_path, false);
  data::TokenLoaderOptions o;
  o.global_batch = 4;
  o.context = 16;
  data::TokenLoader loader(ds, o);
  const auto w0 = loader.epoch_windows(0);
  for (int k = 0; k < 5; ++k) {
    const auto b = loader.next();
    ASSERT_EQ(b.images.sizes(), (std::vector<int64_t>{4, 16}));
    ASSERT_EQ(b.labels.sizes(), (std::vector<int64_t>{4, 16}));
    EXPECT_EQ(b.images.scalar_type(), torch::kLong);
    EXPECT_EQ(b.epoch, 0);
    EXPECT_EQ(b.position, 4 * k);
    EXPECT_EQ(b.global_size, 4);
    for (int64_t i = 0; i < 4; ++i) {
      const int64_t s = b.indices[i];
      EXPECT_EQ(s, w0[4 * k + i]);
      for (int64_t t = 0; t < 16; ++t) {
        ASSERT_EQ(b.images[i][t].item<int64_t>(), static_cast<unsigned char>(all[s + t]));
        ASSERT_EQ(b.labels[i][t].item<int64_t>(), static_cast<unsigned char>(all[s + t + 1]));
      }
    }
  }
}

// With pin_memory (the trainer sets it for a CUDA device) the batches are page-locked, so that their
// copy to the GPU does not wait for the device; the same tokens as without.
TEST(TokensLoaderCuda, PinnedBatchesHoldTheSameTokens) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs a CUDA device (pinned memory needs its driver)";
  auto ds = std::make_shared<data::SyntheticTokens>(4096, 50257, 3);
  data::TokenLoaderOptions o;
  o.global_batch = 4;
  o.context = 64;
  data::TokenLoader plain(ds, o);
  o.pin_memory = true;
  data::TokenLoader pinned(ds, o);
  for (int k = 0; k < 3; ++k) {
    const auto a = plain.next(), b = pinned.next();
    EXPECT_FALSE(a.images.is_pinned());
    EXPECT_TRUE(b.images.is_pinned());
    EXPECT_TRUE(b.labels.is_pinned());
    EXPECT_TRUE(b.images.equal(a.images));
    EXPECT_TRUE(b.labels.equal(a.labels));
    EXPECT_TRUE(b.images.to(torch::kCUDA, /*non_blocking=*/true).cpu().equal(a.images));
  }
}

TEST(TokensLoader, SeekResumesExactlyAndEpochsRollOver) {
  testutil::TempDir dir("tok_seek");
  auto ds = counting_dataset(dir, 2000);
  data::TokenLoaderOptions o;
  o.global_batch = 5;
  o.context = 16;
  o.seed = 11;
  data::TokenLoader straight(ds, o);
  // S = floor(1999 / 16) - 1 = 123 slots: 24 steps, the last 3 slots of each epoch skipped.
  ASSERT_EQ(straight.steps_per_epoch(), 24);
  std::vector<data::Batch> ref;
  std::vector<data::LoaderState> states;
  for (int i = 0; i < 60; ++i) {
    states.push_back(straight.state());
    ref.push_back(straight.next());
  }
  EXPECT_EQ(ref[23].epoch, 0);
  EXPECT_EQ(ref[23].position, 115);
  EXPECT_EQ(ref[24].epoch, 1);
  EXPECT_EQ(ref[24].position, 0);
  EXPECT_EQ(states[24], (data::LoaderState{1, 0}));  // normalized: a finished epoch reads as the next one

  for (int cut : {1, 17, 24, 31}) {
    data::TokenLoader resumed(ds, o);
    resumed.seek(states[cut]);
    for (int i = cut; i < 60; ++i) {
      const auto b = resumed.next();
      ASSERT_TRUE(torch::equal(b.images, ref[i].images)) << "cut " << cut << ", batch " << i;
      ASSERT_TRUE(torch::equal(b.labels, ref[i].labels));
      ASSERT_EQ(b.indices, ref[i].indices);
    }
  }
  // A position where no full batch fits is the next epoch's start.
  data::TokenLoader l(ds, o);
  l.seek(0, 120);
  EXPECT_EQ(l.state(), (data::LoaderState{1, 0}));
  expect_error<std::invalid_argument>([&] { l.seek(0, 124); },
                                      "token loader: seek needs epoch >= 0 and position in [0, 123], got epoch 0, position 124");
}

TEST(TokensLoader, RankSlicesAreDisjointAndFormTheGlobalBatch) {
  testutil::TempDir dir("tok_ranks");
  auto ds = counting_dataset(dir, 5000);
  data::TokenLoaderOptions o;
  o.global_batch = 10;
  o.context = 8;
  o.seed = 3;
  data::TokenLoader whole(ds, o);
  std::vector<std::unique_ptr<data::TokenLoader>> ranks;
  for (int64_t r = 0; r < 3; ++r) {
    auto ro = o;
    ro.rank = r;
    ro.world_size = 3;
    ranks.push_back(std::make_unique<data::TokenLoader>(ds, ro));
  }
  for (int step = 0; step < 70; ++step) {  // crosses an epoch boundary (S = 623, 62 steps)
    const auto g = whole.next();
    std::vector<int64_t> joined;
    std::vector<torch::Tensor> parts;
    for (auto& l : ranks) {
      const auto b = l->next();
      EXPECT_EQ(b.global_size, 10);
      EXPECT_EQ(b.position, g.position);
      joined.insert(joined.end(), b.indices.begin(), b.indices.end());
      parts.push_back(b.images);
    }
    EXPECT_EQ(ranks[0]->state(), whole.state());
    // 10 over 3 ranks: slices [0, 3), [3, 6), [6, 10) in order, so concatenation is the global batch.
    ASSERT_EQ(joined, g.indices) << "step " << step;
    ASSERT_TRUE(torch::equal(torch::cat(parts), g.images));
    EXPECT_EQ(std::set<int64_t>(joined.begin(), joined.end()).size(), joined.size());
  }
  auto bad = o;
  bad.rank = 3;
  bad.world_size = 3;
  expect_error<std::invalid_argument>([&] { data::TokenLoader(ds, bad); },
                                      "token loader: rank must be in [0, world_size) with world_size >= 1, got rank 3, world_size 3");
  bad = o;
  bad.global_batch = 700;
  expect_error<std::invalid_argument>([&] { data::TokenLoader(ds, bad); },
                                      "token loader: global_batch must be in [max(1, world_size), windows per epoch], got 700 "
                                      "with world_size 1 and 623 windows of 8 tokens in '");
  bad = o;
  bad.context = 5000;
  expect_error<std::invalid_argument>([&] { data::TokenLoader(ds, bad); },
                                      "has 5000 tokens, fewer than context + 1 = 5001");
}

TEST(TokensEvalLoader, ConsecutiveWindowsOnceThenNullopt) {
  testutil::TempDir dir("tok_eval");
  auto ds = counting_dataset(dir, 1000);
  data::TokenEvalOptions o;
  o.batch = 7;
  o.context = 30;
  // floor(999 / 30) = 33 windows at 0, 30, ..., 960: 5 batches of 7 and a last one of 5.
  data::TokenEvalLoader ev(ds, o);
  EXPECT_EQ(ev.num_windows(), 33);
  EXPECT_EQ(ev.num_batches(), 5);
  std::vector<int64_t> starts;
  int batches = 0;
  while (auto b = ev.next()) {
    ++batches;
    EXPECT_EQ(b->position, static_cast<int64_t>(starts.size()));
    for (int64_t i = 0; i < b->size(); ++i) {
      const int64_t s = b->indices[i];
      EXPECT_EQ(b->images[i][0].item<int64_t>(), s);  // counting stream: token value = position
      EXPECT_EQ(b->labels[i][29].item<int64_t>(), s + 30);
    }
    starts.insert(starts.end(), b->indices.begin(), b->indices.end());
  }
  EXPECT_EQ(batches, 5);
  std::vector<int64_t> want(33);
  for (int64_t j = 0; j < 33; ++j) want[j] = 30 * j;
  EXPECT_EQ(starts, want);
  EXPECT_FALSE(ev.next().has_value());
  ev.reset();
  EXPECT_EQ(ev.next()->indices.front(), 0);

  // Two ranks: each window exactly once over both, the last batch split 2 + 3.
  std::vector<int64_t> both;
  for (int64_t r = 0; r < 2; ++r) {
    auto ro = o;
    ro.rank = r;
    ro.world_size = 2;
    data::TokenEvalLoader e(ds, ro);
    while (auto b = e.next()) both.insert(both.end(), b->indices.begin(), b->indices.end());
  }
  std::sort(both.begin(), both.end());
  EXPECT_EQ(both, want);
}


// Random access into the synthetic stream equals the same generator run sequentially from token 0.
TEST(TokensSynthetic, RandomAccessEqualsTheSequentialGenerator) {
  const int64_t V = 50257, N = 5000;
  const data::SyntheticTokens tokens(N, V, 7);
  data::SplitMix64 rng(data::mix64(data::hash_key(7, 0x73796e746fULL)));
  std::vector<int64_t> want(N);
  for (auto& t : want) t = static_cast<int64_t>(((rng.next() >> 32) * static_cast<uint64_t>(V)) >> 32);
  std::vector<int64_t> got(N);
  tokens.read(0, N, got.data());
  EXPECT_EQ(got, want);
  // Any window is the same tokens as the whole stream's slice.
  std::vector<int64_t> part(17);
  tokens.read(4321, 17, part.data());
  EXPECT_EQ(part, std::vector<int64_t>(want.begin() + 4321, want.begin() + 4338));
  EXPECT_TRUE(torch::equal(tokens.slice(100, 5), torch::tensor(std::vector<int64_t>(want.begin() + 100, want.begin() + 105))));
  EXPECT_GE(*std::min_element(got.begin(), got.end()), 0);
  EXPECT_LT(*std::max_element(got.begin(), got.end()), V);
  // Another seed, another stream.
  std::vector<int64_t> other(N);
  data::SyntheticTokens(N, V, 8).read(0, N, other.data());
  EXPECT_GT(std::inner_product(got.begin(), got.end(), other.begin(), 0, std::plus<>(), std::not_equal_to<>()), N - 5);
}

TEST(TokensSynthetic, UniformOverTheVocabularyAndErrors) {
  // 8 ids, 80,000 draws: each count is 10,000 with a standard deviation of 94; 5 sigma is 470.
  const data::SyntheticTokens tokens(80000, 8, 0);
  std::vector<int64_t> t(80000), count(8, 0);
  tokens.read(0, 80000, t.data());
  for (int64_t v : t) ++count[v];
  for (int64_t c : count) EXPECT_NEAR(c, 10000, 470);
  expect_error<std::out_of_range>([&] { tokens.read(79990, 11, t.data()); },
                                  "synthetic tokens: tokens [79990, 80001) are outside [0, 80000)");
  expect_error<std::invalid_argument>([] { data::SyntheticTokens(10, 0, 0); },
                                      "synthetic tokens: need size >= 1 and vocab_size in [1, 2^31), got size 10, vocab_size 0");
}

// The loader over synthetic tokens resumes exactly: a stream cut and sought gives the same batches.
TEST(TokensSynthetic, LoaderResumesAcrossAnEpochBoundary) {
  auto tokens = std::make_shared<data::SyntheticTokens>(6 * 16 + 1, 300, 3);  // 5 slots of 16
  data::TokenLoaderOptions o;
  o.global_batch = 2;
  o.context = 16;
  o.seed = 3;
  data::TokenLoader whole(tokens, o);
  std::vector<data::Batch> want;
  for (int i = 0; i < 6; ++i) want.push_back(whole.next());
  data::TokenLoader first(tokens, o);
  for (int i = 0; i < 3; ++i) first.next();
  data::TokenLoader resumed(tokens, o);
  resumed.seek(first.state());
  for (int i = 3; i < 6; ++i) {
    const auto b = resumed.next();
    EXPECT_TRUE(torch::equal(b.images, want[i].images)) << i;
    EXPECT_TRUE(torch::equal(b.labels, want[i].labels)) << i;
    EXPECT_EQ(b.epoch, want[i].epoch);
  }
  EXPECT_EQ(want[2].epoch, 1) << "two batches of 2 per epoch of 5 slots";
}

}  // namespace

}  // namespace test_tokens
