// Writes the binary seeds of fuzz/corpus/ (HDF5, IDX, torch.save archives, safetensors, checkpoint manifests): a few
// valid files per reader and a few that break one rule each. The text seeds (YAML) are kept by hand.
//
//   build-fuzz/fuzz/fuzz_make_corpus fuzz/corpus
//
// The HDF5 files are written with the C API and small chunks (the project's writers chunk /labels and
// /tokens by 16384 and 65536 values, which makes files of 128 KiB and more); one comes from the writer.
#include "data/files/image_h5.h"
#include "data/pixels/jpeg.h"
#include "data/files/token_h5.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/checkpoint/state_dict.h"
// After LibTorch's headers: c10/util/variant.h calls an unqualified data(), which clang would otherwise
// take for the namespace.
#include "data/files/hdf5_lock.h"

#include <hdf5.h>
#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

void write(const fs::path& p, const std::string& bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw std::runtime_error("cannot write " + p.string());
}

// ---- HDF5 ----------------------------------------------------------------------------------------------

struct H5File {
  hid_t f;
  explicit H5File(const fs::path& p) : f(H5Fcreate(p.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT)) {
    if (f < 0) throw std::runtime_error("cannot create " + p.string());
  }
  ~H5File() { H5Fclose(f); }

  // A dataset of `dims` (chunked by `chunk`, or contiguous if chunk is empty), `values` written if given.
  void dataset(const char* name, std::vector<hsize_t> dims, std::vector<hsize_t> chunk, hid_t file_type,
               hid_t mem_type, const void* values, int gzip = 0) {
    const hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
    const hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    if (!chunk.empty()) H5Pset_chunk(dcpl, static_cast<int>(chunk.size()), chunk.data());
    if (gzip) H5Pset_deflate(dcpl, gzip);
    const hid_t d = H5Dcreate2(f, name, file_type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    if (d < 0 || (values && H5Dwrite(d, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values) < 0))
      throw std::runtime_error(std::string("cannot write dataset ") + name);
    H5Dclose(d);
    H5Pclose(dcpl);
    H5Sclose(space);
  }
  void string_attr(const char* name, const std::vector<std::string>& values, bool fixed = false, bool scalar = true) {
    const hid_t type = H5Tcopy(H5T_C_S1);
    size_t longest = 1;
    for (const auto& v : values) longest = std::max(longest, v.size() + 1);
    H5Tset_size(type, fixed ? longest : H5T_VARIABLE);
    H5Tset_cset(type, H5T_CSET_UTF8);
    const hsize_t n = values.size();
    const hid_t space = scalar ? H5Screate(H5S_SCALAR) : H5Screate_simple(1, &n, nullptr);
    const hid_t a = H5Acreate2(f, name, type, space, H5P_DEFAULT, H5P_DEFAULT);
    if (fixed) {
      std::string buf(values.size() * longest, '\0');
      for (size_t i = 0; i < values.size(); ++i) buf.replace(i * longest, values[i].size(), values[i]);
      H5Awrite(a, type, buf.data());
    } else {
      std::vector<const char*> p;
      for (const auto& v : values) p.push_back(v.c_str());
      H5Awrite(a, type, p.data());
    }
    H5Aclose(a);
    H5Sclose(space);
    H5Tclose(type);
  }
  void int_attr(const char* name, int64_t v) {
    const hid_t space = H5Screate(H5S_SCALAR);
    const hid_t a = H5Acreate2(f, name, H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(a, H5T_NATIVE_INT64, &v);
    H5Aclose(a);
    H5Sclose(space);
  }
  void float_attr(const char* name, const std::vector<float>& v) {
    const hsize_t n = v.size();
    const hid_t space = H5Screate_simple(1, &n, nullptr);
    const hid_t a = H5Acreate2(f, name, H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(a, H5T_NATIVE_FLOAT, v.data());
    H5Aclose(a);
    H5Sclose(space);
  }
};

enum class ImageFlaw { None, LyingExtent, LabelOutOfRange, FloatPixels, WrongFormat, FixedStrings, Int32Labels };

void image_h5(const fs::path& p, ImageFlaw flaw) {
  H5File h(p);
  const hsize_t n = 3;
  std::vector<uint8_t> pixels(n * 1 * 2 * 2);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>(i * 17);
  std::vector<int64_t> labels = {0, 1, flaw == ImageFlaw::LabelOutOfRange ? 7 : 1};
  std::vector<int32_t> labels32(labels.begin(), labels.end());
  const hsize_t claimed = flaw == ImageFlaw::LyingExtent ? hsize_t{1} << 40 : n;
  if (flaw == ImageFlaw::FloatPixels) {
    std::vector<float> f(pixels.begin(), pixels.end());
    h.dataset("images", {n, 1, 2, 2}, {2, 1, 2, 2}, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, f.data());
  } else {
    h.dataset("images", {claimed, 1, 2, 2}, {2, 1, 2, 2}, H5T_STD_U8LE, H5T_NATIVE_UINT8,
              flaw == ImageFlaw::LyingExtent ? nullptr : pixels.data());
  }
  if (flaw == ImageFlaw::Int32Labels) {
    h.dataset("labels", {n}, {2}, H5T_STD_I32LE, H5T_NATIVE_INT32, labels32.data());
  } else {
    h.dataset("labels", {claimed}, {2}, H5T_STD_I64LE, H5T_NATIVE_INT64,
              flaw == ImageFlaw::LyingExtent ? nullptr : labels.data());
  }
  const bool fixed = flaw == ImageFlaw::FixedStrings;
  h.string_attr("format", {flaw == ImageFlaw::WrongFormat ? "trainer.tokens" : data::kImageH5Format}, fixed);
  h.int_attr("format_version", data::kImageH5Version);
  h.int_attr("num_classes", 2);
  h.string_attr("class_names", {"zero", "one"}, fixed, /*scalar=*/false);
  h.float_attr("mean", {0.5f});
  h.float_attr("std", {0.25f});
}

enum class TokenFlaw { None, LyingExtent, TokenOutOfRange, Int32Contiguous, FixedStrings, NoVocab };

void tokens_h5(const fs::path& p, TokenFlaw flaw) {
  H5File h(p);
  std::vector<uint16_t> t(20);
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<uint16_t>("hello, fuzzing world"[i]);
  if (flaw == TokenFlaw::TokenOutOfRange) t[5] = 300;
  int64_t vocab = 256;
  if (flaw == TokenFlaw::Int32Contiguous) {
    std::vector<int32_t> w(t.begin(), t.end());
    w[3] = 69999;
    vocab = 70000;
    h.dataset("tokens", {w.size()}, {}, H5T_STD_I32LE, H5T_NATIVE_INT32, w.data());
  } else if (flaw == TokenFlaw::LyingExtent) {
    h.dataset("tokens", {hsize_t{1} << 40}, {16}, H5T_STD_U16LE, H5T_NATIVE_UINT16, nullptr);
  } else {
    h.dataset("tokens", {t.size()}, {16}, H5T_STD_U16LE, H5T_NATIVE_UINT16, t.data());
  }
  h.string_attr("format", {data::kTokensFormat}, flaw == TokenFlaw::FixedStrings);
  h.int_attr("format_version", data::kTokensVersion);
  if (flaw != TokenFlaw::NoVocab) h.int_attr("vocab_size", vocab);
  h.string_attr("source", {"make_corpus"}, flaw == TokenFlaw::FixedStrings);
}

// ---- IDX -----------------------------------------------------------------------------------------------

std::string idx(uint8_t ndims, std::vector<uint32_t> dims, size_t payload) {
  std::string b = {0, 0, 8, static_cast<char>(ndims)};
  for (uint32_t d : dims) {
    for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<char>(d >> s));
  }
  for (size_t i = 0; i < payload; ++i) b.push_back(static_cast<char>(i % 10));
  return b;
}

std::string gzip(const std::string& raw) {
  uLongf n = compressBound(raw.size()) + 32;
  std::string out(n, '\0');
  z_stream z{};
  deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);  // 15 + 16: a gzip header
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(raw.data()));
  z.avail_in = static_cast<uInt>(raw.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

// ---- manifests -----------------------------------------------------------------------------------------

std::string crc_hex(const std::string& s) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08lx", crc32(0, reinterpret_cast<const Bytef*>(s.data()), static_cast<uInt>(s.size())));
  return buf;
}

std::string manifest(const std::string& files, const std::string& step = "1", const std::string& version = "1") {
  return "{\n  \"format_version\": " + version + ",\n  \"step\": " + step +
         ",\n  \"created\": \"2026-11-22T03:35:28Z\",\n  \"checksum\": \"crc32\",\n  \"files\": {" + files +
         "},\n  \"extra\": {\"reason\": \"every_steps\"}\n}\n";
}

// ---- safetensors ---------------------------------------------------------------------------------------

// A safetensors file from its header text and data, as a hand-written (or hostile) file would be.
std::string safetensors(const std::string& header, const std::string& data, uint64_t claimed_length = 0) {
  const uint64_t n = claimed_length ? claimed_length : header.size();
  std::string b;
  for (int k = 0; k < 8; ++k) b.push_back(static_cast<char>(n >> (8 * k)));
  return b + header + data;
}

// ---- the seeds, one function per family ---------------------------------------------------------------

// image_h5/ and tokens/: one valid file of each format and one per flaw, and one from the project's writer.
void write_h5_seeds(const fs::path& out) {
  {
    std::lock_guard<std::mutex> lock(data::hdf5_lock());
    image_h5(out / "image_h5" / "valid.h5", ImageFlaw::None);
    image_h5(out / "image_h5" / "int32_labels.h5", ImageFlaw::Int32Labels);
    image_h5(out / "image_h5" / "fixed_strings.h5", ImageFlaw::FixedStrings);
    image_h5(out / "image_h5" / "lying_extent.h5", ImageFlaw::LyingExtent);
    image_h5(out / "image_h5" / "label_out_of_range.h5", ImageFlaw::LabelOutOfRange);
    image_h5(out / "image_h5" / "float_pixels.h5", ImageFlaw::FloatPixels);
    image_h5(out / "image_h5" / "wrong_format.h5", ImageFlaw::WrongFormat);
    tokens_h5(out / "tokens" / "valid.h5", TokenFlaw::None);
    tokens_h5(out / "tokens" / "int32_contiguous.h5", TokenFlaw::Int32Contiguous);
    tokens_h5(out / "tokens" / "fixed_strings.h5", TokenFlaw::FixedStrings);
    tokens_h5(out / "tokens" / "lying_extent.h5", TokenFlaw::LyingExtent);
    tokens_h5(out / "tokens" / "token_out_of_range.h5", TokenFlaw::TokenOutOfRange);
    tokens_h5(out / "tokens" / "no_vocab.h5", TokenFlaw::NoVocab);
  }
  // One file as the project's writer lays it out, compressed (uncompressed it is 128 KiB of labels chunk).
  {
    data::ImageMeta meta;
    meta.num_classes = 3;
    meta.class_names = {"a", "b", "c"};
    meta.mean = {0.5f, 0.5f};
    meta.std = {0.2f, 0.3f};
    data::H5WriteOptions opt;
    opt.gzip_level = 9;
    opt.chunk_samples = 2;
    data::write_image_h5((out / "image_h5" / "writer_gzip.h5").string(),
                         torch::arange(2 * 2 * 3 * 3, torch::kUInt8).reshape({2, 2, 3, 3}),
                         torch::tensor({2, 0}, torch::kInt64), meta, opt);
  }
}

// idx/: small image and label files, plain and gzipped, and headers that claim more or less than the file holds.
void write_idx_seeds(const fs::path& out) {
  write(out / "idx" / "images_2x2x3", idx(3, {2, 2, 3}, 12));
  write(out / "idx" / "images_2x2x3.gz", gzip(idx(3, {2, 2, 3}, 12)));
  write(out / "idx" / "labels_5", idx(1, {5}, 5));
  write(out / "idx" / "labels_5.gz", gzip(idx(1, {5}, 5)));
  write(out / "idx" / "truncated_gigabyte", idx(3, {1, 32768, 32768}, 4));
  write(out / "idx" / "truncated_gigabyte.gz", gzip(idx(3, {1, 32768, 32768}, 4)));
  write(out / "idx" / "overflowing_dims", idx(3, {0xffffffffu, 0xffffffffu, 0xffffffffu}, 4));
  write(out / "idx" / "trailing_bytes", idx(1, {2}, 3));
  write(out / "idx" / "empty_images", idx(3, {0, 28, 28}, 0));
}

// state_dict/: torch.save archives of two tensors, of every dtype written, and of none.
void write_state_dict_seeds(const fs::path& out) {
  write(out / "state_dict" / "two_tensors.pt",
        trainer::tensors_to_bytes({{"conv.weight", torch::arange(6, torch::kFloat32).reshape({2, 3})},
                                   {"bn.num_batches_tracked", torch::tensor(int64_t{7})}}));
  write(out / "state_dict" / "dtypes.pt",
        trainer::tensors_to_bytes({{"h", torch::ones({2}, torch::kHalf)},
                                   {"b", torch::ones({3}, torch::kBFloat16)},
                                   {"u", torch::ones({1, 1}, torch::kUInt8)},
                                   {"t", torch::ones({2}, torch::kBool)}}));
  write(out / "state_dict" / "empty.pt", trainer::tensors_to_bytes({}));
}

// safetensors/: files of our writer, one of another writer's layout, and hostile files.
void write_safetensors_seeds(const fs::path& out) {
  const fs::path st = out / "safetensors";
  write(st / "two_tensors.safetensors",
        trainer::safetensors_bytes({{"conv.weight", torch::arange(6, torch::kFloat32).reshape({2, 3})},
                                    {"bn.num_batches_tracked", torch::tensor(int64_t{7})}},
                                   {{"format", "pt"}}));
  write(st / "dtypes.safetensors",
        trainer::safetensors_bytes({{"d", torch::ones({1}, torch::kDouble)}, {"f", torch::ones({2}, torch::kFloat)},
                                    {"h", torch::ones({2}, torch::kHalf)}, {"b", torch::ones({3}, torch::kBFloat16)},
                                    {"l", torch::ones({1}, torch::kLong)}, {"i", torch::ones({1}, torch::kInt)},
                                    {"s", torch::ones({2}, torch::kShort)}, {"c", torch::ones({1}, torch::kChar)},
                                    {"u", torch::ones({1, 1}, torch::kUInt8)}, {"t", torch::ones({2}, torch::kBool)}}));
  write(st / "empty.safetensors", trainer::safetensors_bytes({}));
  write(st / "zero_size_and_scalar.safetensors",
        trainer::safetensors_bytes({{"z", torch::ones({0, 4})}, {"s", torch::tensor(2.5)}}));
  // Another writer's layout: no padding, a float at an odd offset (read through one aligned copy).
  write(st / "misaligned.safetensors",
        safetensors(R"({"u":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"f":{"dtype":"F32","shape":[1],"data_offsets":[1,5]}})",
                    std::string("\x07\x00\x00\x80\x3f", 5)));
  // Hostile files, one broken rule each (tests/test_safetensors.cpp checks each one's error line).
  const std::string f32 = R"("dtype":"F32","shape":[2],"data_offsets":)";
  write(st / "header_past_end.safetensors", safetensors("{}", "", 1000));
  write(st / "header_over_limit.safetensors", safetensors("{}", "", 200000000));
  write(st / "overlap.safetensors", safetensors("{\"a\":{" + f32 + "[0,8]},\"b\":{" + f32 + "[4,12]}}", std::string(12, '\0')));
  write(st / "gap.safetensors", safetensors("{\"a\":{" + f32 + "[0,8]},\"b\":{" + f32 + "[12,20]}}", std::string(20, '\0')));
  write(st / "past_end.safetensors", safetensors("{\"a\":{" + f32 + "[0,8]}}", std::string(4, '\0')));
  write(st / "overflowing_shape.safetensors",
        safetensors(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", ""));
  write(st / "unknown_dtype.safetensors", safetensors(R"({"a":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", "abcd"));
  write(st / "duplicate_names.safetensors", safetensors("{\"a\":{" + f32 + "[0,8]},\"a\":{" + f32 + "[8,16]}}", std::string(16, '\0')));
  write(st / "not_an_object.safetensors", safetensors("[1, 2, 3]", ""));
  write(st / "bool_byte_2.safetensors", safetensors(R"({"t":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", std::string("\x01\x02", 2)));
}

// manifest/: a checkpoint manifest that fits fuzz_manifest.cpp's folder, and ones that break a rule.
void write_manifest_seeds(const fs::path& out) {
  const std::string model = "model bytes\n", state = "{\"step\": 1}";  // as fuzz_manifest.cpp's folder
  auto entry = [](const std::string& name, const std::string& bytes) {
    return "\"" + name + "\": {\"size\": " + std::to_string(bytes.size()) + ", \"crc32\": \"" + crc_hex(bytes) + "\"}";
  };
  write(out / "manifest" / "valid.json", manifest(entry("model.pt", model) + ", " + entry("state.json", state)));
  write(out / "manifest" / "no_files.json", manifest(""));
  write(out / "manifest" / "wrong_crc.json",
        manifest("\"model.pt\": {\"size\": 12, \"crc32\": \"00000000\"}"));
  write(out / "manifest" / "wrong_step.json", manifest(entry("model.pt", model), "2"));
  write(out / "manifest" / "bad_name.json", manifest("\"../model.pt\": {\"size\": 12, \"crc32\": \"0\"}"));
  write(out / "manifest" / "huge_numbers.json",
        manifest("\"model.pt\": {\"size\": 18446744073709551615, \"crc32\": \"x\"}", "-9223372036854775808",
                 "1e999"));
}

// Images (fuzz_jpeg): small JPEGs of each kind the decoder branches on, a PNG, and three that break a rule.
void write_jpeg_seeds(const fs::path& out) {
  fs::create_directories(out / "jpeg");
  const int w = 40, h = 24;
  std::vector<uint8_t> px(w * h * 4);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>((i * 37) ^ (i / 160 * 11));
  auto str = [](const std::vector<uint8_t>& b) { return std::string(b.begin(), b.end()); };
  const std::string baseline = str(data::encode_jpeg(px.data(), w, h, 90));
  write(out / "jpeg" / "rgb_420.jpg", baseline);
  write(out / "jpeg" / "rgb_444_progressive.jpg", str(data::encode_jpeg(px.data(), w, h, 80, 3, 444, true)));
  write(out / "jpeg" / "rgb_422.jpg", str(data::encode_jpeg(px.data(), w, h, 70, 3, 422)));
  write(out / "jpeg" / "gray.jpg", str(data::encode_jpeg(px.data(), w, h, 90, 1)));
  write(out / "jpeg" / "cmyk.jpg", str(data::encode_jpeg(px.data(), w, h, 90, 4)));
  write(out / "jpeg" / "rgba.png", str(data::encode_png(px.data(), w, h, 4)));
  write(out / "jpeg" / "truncated.jpg", baseline.substr(0, baseline.size() / 2));
  std::string huge = baseline;  // SOF0 claims 65,500 x 65,500
  const size_t sof = huge.find("\xFF\xC0");
  huge.replace(sof + 5, 4, "\xFF\xDC\xFF\xDC");
  write(out / "jpeg" / "huge_header.jpg", huge);
  write(out / "jpeg" / "empty", "");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: fuzz_make_corpus CORPUS_DIR (fuzz/corpus)\n";
    return 2;
  }
  const fs::path out(argv[1]);
  for (const char* t : {"idx", "image_h5", "tokens", "state_dict", "safetensors", "manifest"}) fs::create_directories(out / t);
  write_h5_seeds(out);
  write_idx_seeds(out);
  write_state_dict_seeds(out);
  write_safetensors_seeds(out);
  write_manifest_seeds(out);
  write_jpeg_seeds(out);
  std::cout << "wrote the binary seeds under " << out.string() << "\n";
  return 0;
}
