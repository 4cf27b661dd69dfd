// Readers of files that come from outside (issue 16): a header that claims more data than the file holds
// is refused before anything that size is allocated, naming the file and both sizes; a text file that
// yields more bytes than its size said (procfs, a file growing while read) converts without a crash.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <zlib.h>

#include "data/files/hdf5_lock.h"
#include "data/files/idx.h"
#include "data/files/image_h5.h"
#include "data/files/token_h5.h"
#include "test_util.h"

#include <atomic>
#include <fstream>
#include <thread>
#include <unistd.h>

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_readers {

namespace {

using testutil::TempDir;
namespace fs = std::filesystem;

// Expects `f` to throw E whose message contains `text`.
template <typename E, typename F>
void expect_error(F&& f, const std::string& text) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected one containing: " << text;
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << "message: " << e.what() << "\nexpected: " << text;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "unexpected exception: " << e.what() << "\nexpected one containing: " << text;
  }
}

using testutil::write_bytes;

std::string write_gzip(const fs::path& p, const std::vector<uint8_t>& bytes) {
  gzFile f = gzopen(p.c_str(), "wb");
  gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(f);
  return p.string();
}

// An IDX image header (magic 0x00000803) with the given dimensions, followed by `payload` bytes.
std::vector<uint8_t> idx_images(uint32_t n, uint32_t h, uint32_t w, size_t payload) {
  std::vector<uint8_t> b = {0, 0, 8, 3};
  for (uint32_t d : {n, h, w}) {
    for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<uint8_t>(d >> s));
  }
  for (size_t i = 0; i < payload; ++i) b.push_back(static_cast<uint8_t>(i));
  return b;
}

// The kernel's "VmHWM" (peak resident set) of this process in bytes, after `reset` set it to the current
// RSS (writing 5 to /proc/self/clear_refs, Linux >= 4.0). -1 if either is unavailable.
int64_t peak_rss_bytes() {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}
bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

// ---- IDX -------------------------------------------------------------------------------------------

TEST(ReadersIdx, HeaderClaimingAGigabyteCostsNoMemoryBeforeTheTruncationCheck) {
  TempDir dir("readers_idx");
  // 1 x 32768 x 32768 = 1 GiB promised, 4 bytes present; plain and gzipped.
  const auto plain = write_bytes(dir / "plain", idx_images(1, 32768, 32768, 4));
  const auto gz = write_gzip(dir / "gz", idx_images(1, 32768, 32768, 4));
  if (!reset_peak_rss() || peak_rss_bytes() < 0) GTEST_SKIP() << "/proc/self/clear_refs or VmHWM unavailable";
  for (const auto& path : {plain, gz}) {
    ASSERT_TRUE(reset_peak_rss());
    const int64_t before = peak_rss_bytes();
    expect_error<std::runtime_error>([&] { data::read_idx_images(path); },
                                     "read_idx: " + path +
                                         ": truncated: the header promises 1073741824 bytes of data, the file has 4");
    const int64_t grew = peak_rss_bytes() - before;
    EXPECT_LT(grew, int64_t{64} << 20) << path << ": the peak resident set grew by " << grew << " bytes";
  }
}

TEST(ReadersIdx, SizeProductThatOverflowsIsNamed) {
  TempDir dir("readers_idx_ovf");
  const auto path = write_bytes(dir / "huge", idx_images(0xffffffffu, 0xffffffffu, 0xffffffffu, 4));
  expect_error<std::runtime_error>([&] { data::read_idx_images(path); },
                                   "read_idx: " + path + ": the header claims 4294967295 x 4294967295 x 4294967295 "
                                   "bytes of data, more than any file holds");
  // Still exact for a valid file, gzipped or not.
  const auto ok = write_gzip(dir / "ok.gz", idx_images(2, 2, 3, 12));
  EXPECT_TRUE(torch::equal(data::read_idx_images(ok), torch::arange(0, 12, torch::kUInt8).reshape({2, 1, 2, 3})));
}

// ---- HDF5 ------------------------------------------------------------------------------------------

// Replaces dataset `name` of the HDF5 file at `path` by a chunked one of extent `dims` with no data
// written: a header that claims samples the file does not hold.
void replace_with_empty_chunked(const std::string& path, const char* name, const std::vector<hsize_t>& dims,
                                hid_t type) {
  std::lock_guard<std::mutex> lock(data::hdf5_lock());
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0) << path;
  H5Ldelete(f, name, H5P_DEFAULT);
  std::vector<hsize_t> chunk(dims.size(), 1);
  const hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
  const hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
  H5Pset_chunk(dcpl, static_cast<int>(chunk.size()), chunk.data());
  const hid_t d = H5Dcreate2(f, name, type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT);
  EXPECT_GE(d, 0) << name;
  H5Dclose(d);
  H5Pclose(dcpl);
  H5Sclose(space);
  H5Fclose(f);
}

TEST(ReadersH5, ImageHeaderClaimingTwoToTheFortySamplesIsRefusedNamingTheFile) {
  TempDir dir("readers_h5");
  const auto path = (dir / "lying.h5").string();
  data::ImageMeta meta;
  meta.num_classes = 2;
  meta.mean = {0.5f};
  meta.std = {0.25f};
  data::write_image_h5(path, torch::zeros({4, 1, 2, 2}, torch::kUInt8), torch::zeros({4}, torch::kInt64), meta);
  const hsize_t n = hsize_t{1} << 40;
  replace_with_empty_chunked(path, "images", {n, 1, 2, 2}, H5T_STD_U8LE);
  replace_with_empty_chunked(path, "labels", {n}, H5T_STD_I64LE);
  for (bool in_memory : {false, true}) {
    expect_error<std::runtime_error>([&] { data::ImageH5Dataset(path, in_memory); },
                                     "image file '" + path + "': dataset 'images' claims (1099511627776, 1, 2, 2) = "
                                     "4398046511104 bytes, but the file holds 0 bytes of it");
  }
}

TEST(ReadersH5, TokenHeaderClaimingTwoToTheFortyTokensIsRefusedNamingTheFile) {
  TempDir dir("readers_tok");
  const auto path = (dir / "lying.h5").string();
  data::write_tokens(path, {1, 2, 3}, 256, "test");
  replace_with_empty_chunked(path, "tokens", {hsize_t{1} << 40}, H5T_STD_U16LE);
  for (bool in_memory : {false, true}) {
    expect_error<std::runtime_error>([&] { data::TokenDataset(path, in_memory); },
                                     "token file '" + path + "': dataset 'tokens' claims (1099511627776) = "
                                     "2199023255552 bytes, but the file holds 0 bytes of it");
  }
}

TEST(ReadersH5, TokenFileWithFixedLengthUtf8StringsOpens) {
  // h5py writes fixed-length strings as h5py.string_dtype('utf-8', length=n); the reader converted them
  // into an ASCII memory type, which HDF5 refuses ("reading attribute 'format' failed").
  TempDir dir("readers_tok_utf8");
  const auto path = (dir / "fixed.h5").string();
  data::write_tokens(path, {104, 105}, 256, "test");
  {
    std::lock_guard<std::mutex> lock(data::hdf5_lock());
    const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    for (const char* name : {"format", "source"}) {
      const std::string value = name == std::string("format") ? data::kTokensFormat : "caf\xc3\xa9";
      H5Adelete(f, name);
      const hid_t type = H5Tcopy(H5T_C_S1);
      H5Tset_size(type, value.size() + 3);
      H5Tset_cset(type, H5T_CSET_UTF8);
      H5Tset_strpad(type, H5T_STR_NULLPAD);
      const hid_t space = H5Screate(H5S_SCALAR);
      const hid_t a = H5Acreate2(f, name, type, space, H5P_DEFAULT, H5P_DEFAULT);
      std::string buf = value + std::string(3, '\0');
      EXPECT_GE(H5Awrite(a, type, buf.data()), 0);
      H5Aclose(a);
      H5Sclose(space);
      H5Tclose(type);
    }
    H5Fclose(f);
  }
  data::TokenDataset ds(path, true);
  EXPECT_EQ(ds.source(), "caf\xc3\xa9");
  std::vector<int64_t> t(2);
  ds.read(0, 2, t.data());
  EXPECT_EQ(t, (std::vector<int64_t>{104, 105}));
}

// ---- convert-text ----------------------------------------------------------------------------------

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

std::string tokens_text(const std::string& path) {
  data::TokenDataset ds(path, true);
  std::vector<int64_t> t(ds.size());
  ds.read(0, ds.size(), t.data());
  return std::string(t.begin(), t.end());
}

TEST(ReadersConvertText, ProcFileWhoseSizeSaysZero) {
  TempDir dir("readers_proc");
  testutil::write_file(dir / "a.txt", "abc\n");
  // /proc/self/status reports size 0 and yields about a kilobyte.
  const auto r = data::convert_text({(dir / "a.txt").string(), "/proc/self/status"}, (dir / "out").string(), 0.0);
  const std::string got = tokens_text(r.train_path);
  EXPECT_EQ(r.train_tokens, static_cast<int64_t>(got.size()));
  ASSERT_GT(got.size(), 100u) << got;
  EXPECT_EQ(got.substr(0, 10), "abc\nName:\t") << got;
  EXPECT_NE(got.find("\nPid:\t" + std::to_string(::getpid()) + "\n"), std::string::npos) << got;
  EXPECT_EQ(got.back(), '\n');

  // Alone, and split: the split is taken from the bytes the file really yielded.
  const auto s = data::convert_text({"/proc/self/status"}, (dir / "split").string(), 0.5);
  const std::string all = tokens_text(s.train_path) + tokens_text(s.val_path);
  EXPECT_EQ(s.train_tokens + s.val_tokens, static_cast<int64_t>(all.size()));
  EXPECT_LE(std::abs(s.train_tokens - s.val_tokens), 1);
  EXPECT_EQ(all.substr(0, 6), "Name:\t");
}

TEST(ReadersConvertText, FileGrowingWhileReadGivesThePrefixPlanned) {
  TempDir dir("readers_grow");
  const auto path = (dir / "growing.txt").string();
  std::string text;
  for (int i = 0; text.size() < (8u << 20); ++i) text += "line " + std::to_string(i) + "\n";
  testutil::write_file(path, text);
  // Appends until the conversion is over (at most 64 MiB more), so the file grows while being read.
  std::atomic<bool> done{false};
  std::thread appender([&] {
    std::ofstream out(path, std::ios::app | std::ios::binary);
    const std::string more(4096, 'x');
    for (size_t added = 0; !done && added < (64u << 20); added += more.size()) {
      out << more << std::flush;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  });
  data::TokenConversion r;
  try {
    r = data::convert_text({path}, (dir / "out").string(), 0.0);
  } catch (...) {
    done = true;
    appender.join();
    throw;
  }
  done = true;
  appender.join();
  const std::string final_text = read_all(path);
  const std::string got = tokens_text(r.train_path);
  EXPECT_EQ(r.train_tokens, static_cast<int64_t>(got.size()));
  ASSERT_GE(got.size(), text.size());
  EXPECT_LT(got.size(), final_text.size()) << "the file did not grow during the conversion";
  EXPECT_TRUE(final_text.compare(0, got.size(), got) == 0) << "the tokens are not a prefix of the file";
}

}  // namespace

}  // namespace test_readers
