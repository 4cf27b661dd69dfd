#include "data/files/idx.h"

#include "common/files.h"

#include <zlib.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <stdexcept>

namespace data {

namespace {

namespace fs = std::filesystem;

// An open gzip stream; gzopen also reads uncompressed files, so both spellings of the files work.
struct GzFile {
  gzFile f = nullptr;
  std::string path;
  explicit GzFile(std::string p) : path(std::move(p)) {
    std::error_code ec;
    if (const auto kind = trainer::not_a_regular_file(path); !kind.empty())
      throw std::runtime_error("read_idx: " + path + " " + kind);
    if (!fs::is_regular_file(path, ec)) throw std::runtime_error("read_idx: " + path + ": file not found");
    f = gzopen(path.c_str(), "rb");
    if (!f) throw std::runtime_error("read_idx: " + path + ": cannot open");
    gzbuffer(f, 1 << 17);
  }
  ~GzFile() {
    if (f) gzclose(f);
  }
  [[noreturn]] void fail(const std::string& what) const { throw std::runtime_error("read_idx: " + path + ": " + what); }

  // Reads up to n bytes; returns how many were read (fewer only at the end of the stream).
  int64_t read(void* dst, int64_t n) {
    int64_t done = 0;
    while (done < n) {
      const unsigned step = static_cast<unsigned>(std::min<int64_t>(n - done, 1 << 30));
      const int got = gzread(f, static_cast<char*>(dst) + done, step);
      if (got < 0) {
        int err = 0;
        const char* msg = gzerror(f, &err);
        fail(std::string("corrupt gzip stream: ") + (msg ? msg : "unknown zlib error"));
      }
      if (got == 0) break;
      done += got;
    }
    return done;
  }
};

// Reads the header and the payload of an IDX file of unsigned bytes with `ndims` dimensions. The header
// is not trusted with memory: a plain file must hold the bytes it promises before any is allocated, and a
// gzip stream is read in blocks that grow with what it really inflates to.
std::vector<int64_t> read_idx(const std::string& path, int ndims, std::vector<uint8_t>& payload) {
  GzFile file(path);
  uint8_t head[4];
  if (file.read(head, 4) != 4) file.fail("too short for an IDX header");
  const uint32_t magic = (uint32_t{head[0]} << 24) | (uint32_t{head[1]} << 16) | (uint32_t{head[2]} << 8) | head[3];
  const uint32_t expected = 0x00000800u | static_cast<uint32_t>(ndims);
  if (magic != expected) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "bad magic number 0x%08x, expected 0x%08x (unsigned bytes, %d dimension%s)", magic,
                  expected, ndims, ndims == 1 ? "" : "s");
    file.fail(buf);
  }
  std::vector<int64_t> dims(ndims);
  std::string dims_text;
  int64_t total = 1;
  bool overflow = false;
  for (int d = 0; d < ndims; ++d) {
    uint8_t b[4];
    if (file.read(b, 4) != 4) file.fail("truncated header");
    dims[d] = (int64_t{b[0]} << 24) | (int64_t{b[1]} << 16) | (int64_t{b[2]} << 8) | b[3];
    if (dims[d] == 0 && d > 0) file.fail("dimension " + std::to_string(d) + " is zero");
    dims_text += (d ? " x " : "") + std::to_string(dims[d]);
    overflow = overflow || __builtin_mul_overflow(total, dims[d], &total);
  }
  if (overflow) file.fail("the header claims " + dims_text + " bytes of data, more than any file holds");
  auto truncated = [&](int64_t has) {
    file.fail("truncated: the header promises " + std::to_string(total) + " bytes of data, the file has " +
              std::to_string(has));
  };

  const int64_t header_bytes = 4 + 4 * int64_t{ndims};
  int64_t got = 0;
  if (gzdirect(file.f)) {
    std::error_code ec;
    const auto size = fs::file_size(path, ec);
    if (!ec && static_cast<int64_t>(size) - header_bytes < total) truncated(static_cast<int64_t>(size) - header_bytes);
    payload.resize(static_cast<size_t>(total));
    got = file.read(payload.data(), total);
  } else {
    payload.clear();
    while (got < total) {
      // Doubling blocks: a stream shorter than its header says stops at its end, having used memory
      // within a small multiple of what it really held.
      const int64_t step = std::min(total - got, std::max<int64_t>(got, int64_t{1} << 20));
      payload.resize(static_cast<size_t>(got + step));
      const int64_t n = file.read(payload.data() + got, step);
      got += n;
      if (n < step) break;
    }
  }
  if (got != total) truncated(got);
  uint8_t extra;
  if (file.read(&extra, 1) != 0) file.fail("has trailing bytes after the " + std::to_string(total) + " bytes of data");
  return dims;
}

std::string find_idx(const fs::path& dir, const std::string& name) {
  for (const std::string& candidate : {name + ".gz", name}) {
    std::error_code ec;
    if (fs::exists(dir / candidate, ec)) return (dir / candidate).string();  // read_idx refuses a non-file
  }
  throw std::runtime_error("convert_idx: " + dir.string() + ": missing " + name + ".gz (expected the IDX files "
                           "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
                           "t10k-labels-idx1-ubyte, gzipped or not)");
}

}  // namespace

const std::vector<std::string>& fashion_mnist_class_names() {
  static const std::vector<std::string> names = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                                 "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};
  return names;
}

torch::Tensor read_idx_images(const std::string& path) {
  std::vector<uint8_t> payload;
  const auto dims = read_idx(path, 3, payload);
  auto out = torch::empty({dims[0], 1, dims[1], dims[2]}, torch::kUInt8);
  if (!payload.empty()) std::memcpy(out.data_ptr<uint8_t>(), payload.data(), payload.size());
  return out;
}

torch::Tensor read_idx_labels(const std::string& path) {
  std::vector<uint8_t> payload;
  const auto dims = read_idx(path, 1, payload);
  auto out = torch::empty({dims[0]}, torch::kInt64);
  int64_t* p = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < dims[0]; ++i) p[i] = payload[i];
  return out;
}

std::string convert_idx(const std::string& src_dir, const std::string& out_dir, const IdxConvertOptions& options) {
  const fs::path src(src_dir), out(out_dir);
  std::error_code ec;
  if (!fs::is_directory(src, ec)) throw std::runtime_error("convert_idx: " + src_dir + ": not a folder");
  const int64_t num_classes = static_cast<int64_t>(options.class_names.size());
  if (num_classes == 0) throw std::invalid_argument("convert_idx: class_names is empty");

  struct Split {
    const char* prefix;
    const char* file;
    torch::Tensor images, labels;
  };
  Split splits[2] = {{"train", "train.h5", {}, {}}, {"t10k", "test.h5", {}, {}}};
  for (auto& s : splits) {
    const std::string images_path = find_idx(src, std::string(s.prefix) + "-images-idx3-ubyte");
    const std::string labels_path = find_idx(src, std::string(s.prefix) + "-labels-idx1-ubyte");
    s.images = read_idx_images(images_path);
    s.labels = read_idx_labels(labels_path);
    if (s.images.size(0) != s.labels.size(0)) {
      throw std::runtime_error("convert_idx: " + images_path + " has " + std::to_string(s.images.size(0)) +
                               " images but " + labels_path + " has " + std::to_string(s.labels.size(0)) + " labels");
    }
    const int64_t max_label = s.labels.numel() ? s.labels.max().item<int64_t>() : 0;
    if (max_label >= num_classes) {
      throw std::runtime_error("convert_idx: " + labels_path + ": label " + std::to_string(max_label) +
                               " is outside [0, " + std::to_string(num_classes) + ") (" +
                               std::to_string(num_classes) + " class names given)");
    }
  }
  if (splits[0].images.size(0) == 0) throw std::runtime_error("convert_idx: " + src_dir + ": the training set is empty");
  if (splits[0].images.sizes().slice(1) != splits[1].images.sizes().slice(1)) {
    throw std::runtime_error("convert_idx: " + src_dir + ": train images are " + c10::str(splits[0].images.sizes()) +
                             " but test images are " + c10::str(splits[1].images.sizes()));
  }

  ImageMeta meta;
  meta.num_classes = num_classes;
  meta.class_names = options.class_names;
  std::tie(meta.mean, meta.std) = compute_mean_std(splits[0].images);

  fs::create_directories(out, ec);
  if (ec) throw std::runtime_error("convert_idx: cannot create " + out_dir + ": " + ec.message());
  for (auto& s : splits) write_image_h5((out / s.file).string(), s.images, s.labels, meta, options.h5);

  const auto& x = splits[0].images;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "converted %s -> %s: train.h5 %lld samples, test.h5 %lld samples, each %lldx%lldx%lld uint8, "
                "%lld classes, mean %.4f std %.4f",
                src_dir.c_str(), out_dir.c_str(), static_cast<long long>(x.size(0)),
                static_cast<long long>(splits[1].images.size(0)), static_cast<long long>(x.size(1)),
                static_cast<long long>(x.size(2)), static_cast<long long>(x.size(3)),
                static_cast<long long>(num_classes), meta.mean[0], meta.std[0]);
  return buf;
}

}  // namespace data
