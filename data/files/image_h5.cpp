#include "data/files/image_h5.h"

#include "common/files.h"
#include "data/files/h5_writing.h"
#include "data/files/hdf5_lock.h"

#include <hdf5.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <tuple>
#include <type_traits>
#include <utility>

// The header keeps hid_t out of its includes by storing handles as int64_t.
static_assert(std::is_same<hid_t, int64_t>::value, "hid_t must be int64_t (HDF5 >= 1.10)");

namespace data {

namespace {

namespace fs = std::filesystem;

// ---- attributes ------------------------------------------------------------------------------------

H5Handle create_attr(hid_t loc, const char* name, hid_t type, hid_t space) {
  return H5Handle(h5_check_id(H5Acreate2(loc, name, type, space, H5P_DEFAULT, H5P_DEFAULT),
                              std::string("creating attribute '") + name + "'"),
                  H5Aclose);
}

void write_floats_attr(hid_t loc, const char* name, const std::vector<float>& values) {
  const hsize_t n = values.size();
  H5Handle space(H5Screate_simple(1, &n, nullptr), H5Sclose);
  H5Handle attr = create_attr(loc, name, H5T_IEEE_F32LE, space.get());
  h5_check(H5Awrite(attr.get(), H5T_NATIVE_FLOAT, values.data()), std::string("writing attribute '") + name + "'");
}

std::vector<int64_t> read_ints_attr(hid_t loc, const char* name) {
  H5Handle attr = h5_open_attr(loc, name);
  H5Handle ftype(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tget_class(ftype.get()) != H5T_INTEGER) {
    throw H5FormatError(std::string("root attribute '") + name + "' is not an integer");
  }
  std::vector<int64_t> out(static_cast<size_t>(h5_attr_points(attr.get())));
  h5_check(H5Aread(attr.get(), H5T_NATIVE_INT64, out.data()), std::string("reading attribute '") + name + "'");
  return out;
}

std::vector<float> read_floats_attr(hid_t loc, const char* name) {
  H5Handle attr = h5_open_attr(loc, name);
  H5Handle ftype(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tget_class(ftype.get()) != H5T_FLOAT && H5Tget_class(ftype.get()) != H5T_INTEGER) {
    throw H5FormatError(std::string("root attribute '") + name + "' is not numeric");
  }
  std::vector<float> out(static_cast<size_t>(h5_attr_points(attr.get())));
  h5_check(H5Aread(attr.get(), H5T_NATIVE_FLOAT, out.data()), std::string("reading attribute '") + name + "'");
  return out;
}

int64_t read_int_scalar(hid_t loc, const char* name) {
  const auto v = read_ints_attr(loc, name);
  if (v.size() != 1) {
    throw H5FormatError(std::string("root attribute '") + name + "' has " + std::to_string(v.size()) +
                      " values, expected one");
  }
  return v[0];
}

std::string shape_str(const std::vector<hsize_t>& dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + ")";
}

// Checks meta against the data it describes; returns the text of the first problem, or "".
std::string meta_problem(const ImageMeta& meta, int64_t channels, int64_t max_label) {
  if (meta.num_classes <= 0) return "num_classes must be positive, got " + std::to_string(meta.num_classes);
  if (max_label >= meta.num_classes) {
    return "label " + std::to_string(max_label) + " is outside [0, num_classes = " +
           std::to_string(meta.num_classes) + ")";
  }
  if (!meta.class_names.empty() && static_cast<int64_t>(meta.class_names.size()) != meta.num_classes) {
    return "class_names has " + std::to_string(meta.class_names.size()) + " names for " +
           std::to_string(meta.num_classes) + " classes";
  }
  if (static_cast<int64_t>(meta.mean.size()) != channels || static_cast<int64_t>(meta.std.size()) != channels) {
    return "mean and std need one value per channel (" + std::to_string(channels) + "), got " +
           std::to_string(meta.mean.size()) + " and " + std::to_string(meta.std.size());
  }
  for (float s : meta.std) {
    if (!(s > 0.0f)) return "std must be positive per channel, got " + std::to_string(s);
  }
  return "";
}

}  // namespace

// ---- writer ----------------------------------------------------------------------------------------

ImageH5Writer::ImageH5Writer(std::string path, std::array<int64_t, 3> sample_shape, const H5WriteOptions& options)
    : path_(std::move(path)), tmp_path_(path_ + ".tmp"), shape_(sample_shape) {
  const std::string where = "image file '" + path_ + "': ";
  for (int64_t d : shape_) {
    if (d <= 0) throw std::invalid_argument(where + "sample shape must be positive, got (" +
                                            std::to_string(shape_[0]) + ", " + std::to_string(shape_[1]) +
                                            ", " + std::to_string(shape_[2]) + ")");
  }
  if (options.gzip_level < 0 || options.gzip_level > 9) {
    throw std::invalid_argument(where + "gzip_level must be 0..9, got " + std::to_string(options.gzip_level));
  }
  if (options.chunk_samples < 0) {
    throw std::invalid_argument(where + "chunk_samples must be >= 0, got " + std::to_string(options.chunk_samples));
  }
  const int64_t bytes = shape_[0] * shape_[1] * shape_[2];
  const int64_t chunk = options.chunk_samples > 0 ? options.chunk_samples
                                                  : std::clamp<int64_t>((int64_t{1} << 20) / bytes, 1, 256);

  std::lock_guard<std::mutex> lock(hdf5_lock());
  H5Quiet quiet;
  try {
    H5Handle file(h5_check_id(H5Fcreate(tmp_path_.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT),
                              "cannot create " + tmp_path_ + " (does the folder exist and is it writable?)"),
                  H5Fclose);
    auto make = [&](const char* name, int rank, const hsize_t* chunk_dims, hid_t type) {
      std::vector<hsize_t> dims(chunk_dims, chunk_dims + rank), maxdims(dims);
      dims[0] = 0;
      maxdims[0] = H5S_UNLIMITED;
      H5Handle space(H5Screate_simple(rank, dims.data(), maxdims.data()), H5Sclose);
      H5Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
      h5_check(H5Pset_chunk(dcpl.get(), rank, chunk_dims), std::string("chunking '") + name + "'");
      // Every element is written by append(), so fill values would only cost a second write.
      h5_check(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER), "fill time");
      if (options.gzip_level > 0) h5_check(H5Pset_deflate(dcpl.get(), options.gzip_level), "gzip filter");
      return H5Handle(h5_check_id(H5Dcreate2(file.get(), name, type, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT),
                                  std::string("creating dataset '") + name + "'"),
                      H5Dclose);
    };
    const hsize_t image_chunk[4] = {static_cast<hsize_t>(chunk), static_cast<hsize_t>(shape_[0]),
                                    static_cast<hsize_t>(shape_[1]), static_cast<hsize_t>(shape_[2])};
    const hsize_t label_chunk[1] = {16384};
    H5Handle images = make("images", 4, image_chunk, H5T_STD_U8LE);
    H5Handle labels = make("labels", 1, label_chunk, H5T_STD_I64LE);
    file_ = file.release();
    images_ = images.release();
    labels_ = labels.release();
  } catch (const H5FormatError& e) {
    throw std::runtime_error(where + e.what());
  }
}

ImageH5Writer::~ImageH5Writer() {
  if (!finished_) h5_abandon_written(file_, {{images_, "images"}, {labels_, "labels"}}, tmp_path_);
}

void ImageH5Writer::append(const uint8_t* images, const int64_t* labels, int64_t n) {
  const std::string where = "image file '" + path_ + "': ";
  if (finished_ || file_ < 0) throw std::logic_error(where + "append() after finish()");
  if (n < 0) throw std::invalid_argument(where + "append() of a negative count");
  if (n == 0) return;
  for (int64_t k = 0; k < n; ++k) {
    if (labels[k] < 0) {
      throw std::invalid_argument(where + "label " + std::to_string(labels[k]) + " of sample " +
                                  std::to_string(size_ + k) + " is negative");
    }
    max_label_ = std::max(max_label_, labels[k]);
  }
  std::lock_guard<std::mutex> lock(hdf5_lock());
  H5Quiet quiet;
  try {
    const hsize_t start[4] = {static_cast<hsize_t>(size_), 0, 0, 0};
    const hsize_t count[4] = {static_cast<hsize_t>(n), static_cast<hsize_t>(shape_[0]),
                              static_cast<hsize_t>(shape_[1]), static_cast<hsize_t>(shape_[2])};
    const hsize_t extent[4] = {static_cast<hsize_t>(size_ + n), count[1], count[2], count[3]};
    auto write = [&](hid_t dset, int rank, hid_t memtype, const void* buf, const char* name) {
      h5_check(H5Dset_extent(dset, extent), std::string("extending '") + name + "'");
      H5Handle fspace(H5Dget_space(dset), H5Sclose);
      h5_check(H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start, nullptr, count, nullptr), "selection");
      H5Handle mspace(H5Screate_simple(rank, count, nullptr), H5Sclose);
      h5_check(H5Dwrite(dset, memtype, mspace.get(), fspace.get(), H5P_DEFAULT, buf),
               std::string("writing '") + name + "'");
    };
    write(images_, 4, H5T_NATIVE_UINT8, images, "images");
    write(labels_, 1, H5T_NATIVE_INT64, labels, "labels");
  } catch (const H5FormatError& e) {
    throw std::runtime_error(where + e.what());
  }
  size_ += n;
}

void ImageH5Writer::append(const torch::Tensor& images, const torch::Tensor& labels) {
  const std::string where = "image file '" + path_ + "': ";
  if (images.scalar_type() != torch::kUInt8 || images.dim() != 4 || images.size(1) != shape_[0] ||
      images.size(2) != shape_[1] || images.size(3) != shape_[2]) {
    throw std::invalid_argument(where + "expected uint8 images (N, " + std::to_string(shape_[0]) + ", " +
                                std::to_string(shape_[1]) + ", " + std::to_string(shape_[2]) + "), got " +
                                std::string(c10::toString(images.scalar_type())) + " " +
                                c10::str(images.sizes()));
  }
  if (labels.dim() != 1 || labels.size(0) != images.size(0) || !c10::isIntegralType(labels.scalar_type(), false)) {
    throw std::invalid_argument(where + "expected integer labels (" + std::to_string(images.size(0)) + "), got " +
                                std::string(c10::toString(labels.scalar_type())) + " " + c10::str(labels.sizes()));
  }
  const auto x = images.cpu().contiguous();
  const auto y = labels.cpu().to(torch::kInt64).contiguous();
  append(x.data_ptr<uint8_t>(), y.data_ptr<int64_t>(), x.size(0));
}

void ImageH5Writer::finish(const ImageMeta& meta) {
  const std::string where = "image file '" + path_ + "': ";
  if (finished_ || file_ < 0) throw std::logic_error(where + "finish() called twice");
  const std::string problem = meta_problem(meta, shape_[0], max_label_);
  if (!problem.empty()) throw std::invalid_argument(where + problem);
  std::vector<std::string> names = meta.class_names;
  for (int64_t k = static_cast<int64_t>(names.size()); k < meta.num_classes; ++k) names.push_back(std::to_string(k));
  const auto write_attributes = [&] {
    h5_write_strings(file_, "format", {kImageH5Format}, /*scalar=*/true);
    h5_write_int64(file_, "format_version", kImageH5Version);
    h5_write_int64(file_, "num_classes", meta.num_classes);
    h5_write_strings(file_, "class_names", names, /*scalar=*/false);
    write_floats_attr(file_, "mean", meta.mean);
    write_floats_attr(file_, "std", meta.std);
  };
  h5_finish_written(file_, {{images_, "images"}, {labels_, "labels"}}, write_attributes, tmp_path_, path_, where);
  finished_ = true;
}

void write_image_h5(const std::string& path, const torch::Tensor& images, const torch::Tensor& labels,
                    const ImageMeta& meta, const H5WriteOptions& options) {
  if (images.dim() != 4) {
    throw std::invalid_argument("image file '" + path + "': expected images (N, C, H, W), got shape " +
                                c10::str(images.sizes()));
  }
  ImageH5Writer writer(path, {images.size(1), images.size(2), images.size(3)}, options);
  writer.append(images, labels);
  writer.finish(meta);
}

// ---- reader ----------------------------------------------------------------------------------------

void ImageH5Dataset::fail(const std::string& what) const {
  throw std::runtime_error("image file '" + path_ + "': " + what);
}

namespace {

// The checks of ImageH5Dataset's constructor, in the order it makes them. Each throws H5FormatError.

void check_image_format(hid_t f) {
  const std::string hint = " (make trainer.images files with `trainer convert-idx`, or as docs/DATA.md describes)";
  if (!h5_has_attr(f, "format")) throw H5FormatError("missing root attribute 'format'" + hint);
  const auto format = h5_read_strings(f, "format");
  if (format.size() != 1 || format[0] != kImageH5Format) {
    throw H5FormatError("root attribute 'format' is \"" + (format.empty() ? "" : format[0]) + "\", expected \"" +
                      kImageH5Format + "\"" + hint);
  }
  const int64_t version = read_int_scalar(f, "format_version");
  if (version != kImageH5Version) {
    throw H5FormatError("format_version " + std::to_string(version) + " is not supported (this build reads " +
                      std::to_string(kImageH5Version) + ")");
  }
}

H5Handle open_dataset(hid_t f, const char* name, hid_t dapl) {
  if (H5Lexists(f, name, H5P_DEFAULT) <= 0) throw H5FormatError(std::string("missing dataset '") + name + "'");
  return H5Handle(h5_check_id(H5Dopen2(f, name, dapl), std::string("opening dataset '") + name + "'"), H5Dclose);
}

std::vector<hsize_t> dims_of(hid_t dset) {
  H5Handle space(H5Dget_space(dset), H5Sclose);
  std::vector<hsize_t> dims(static_cast<size_t>(std::max(0, H5Sget_simple_extent_ndims(space.get()))));
  H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  return dims;
}

// /images: uint8, rank 4, a non-empty sample shape, and stored as large as its extent says (checked
// before anything of the claimed size is allocated: the labels, the in-memory copy, the loader's order).
std::vector<hsize_t> check_images_dataset(hid_t f, hid_t images) {
  {
    H5Handle type(H5Dget_type(images), H5Tclose);
    if (H5Tget_class(type.get()) != H5T_INTEGER || H5Tget_size(type.get()) != 1 ||
        H5Tget_sign(type.get()) != H5T_SGN_NONE) {
      throw H5FormatError("dataset 'images' must hold uint8 pixels");
    }
  }
  const auto idims = dims_of(images);
  if (idims.size() != 4) {
    throw H5FormatError("dataset 'images' has rank " + std::to_string(idims.size()) + " " + shape_str(idims) +
                      ", expected rank 4 (N, C, H, W)");
  }
  for (size_t d = 1; d < 4; ++d) {
    if (idims[d] == 0) throw H5FormatError("dataset 'images' has an empty sample shape " + shape_str(idims));
  }
  if (auto problem = dataset_size_problem(f, images, "images"); !problem.empty()) throw H5FormatError(problem);
  return idims;
}

// /labels: integers, rank 1, one per sample, stored as large as its extent says.
void check_labels_dataset(hid_t f, hid_t labels, int64_t n) {
  {
    H5Handle type(H5Dget_type(labels), H5Tclose);
    if (H5Tget_class(type.get()) != H5T_INTEGER) throw H5FormatError("dataset 'labels' must hold integers");
  }
  const auto ldims = dims_of(labels);
  if (ldims.size() != 1) {
    throw H5FormatError("dataset 'labels' has rank " + std::to_string(ldims.size()) + " " + shape_str(ldims) +
                      ", expected rank 1 (N)");
  }
  if (static_cast<int64_t>(ldims[0]) != n) {
    throw H5FormatError("dataset 'images' has " + std::to_string(n) + " samples but 'labels' has " +
                      std::to_string(ldims[0]));
  }
  if (auto problem = dataset_size_problem(f, labels, "labels"); !problem.empty()) throw H5FormatError(problem);
}

// What the size checks cannot bound (filters other than deflate) may still not fit.
template <typename V>
void allocate(V& v, int64_t count, int64_t n, const char* what) {
  try {
    v.resize(static_cast<size_t>(count));
  } catch (const std::bad_alloc&) {
    throw H5FormatError("cannot hold the " + std::to_string(n) + " samples' " + what + " in memory (" +
                      std::to_string(count * static_cast<int64_t>(sizeof(v[0]))) + " bytes)");
  }
}

std::vector<int64_t> read_labels(hid_t labels, int64_t n, int64_t num_classes) {
  std::vector<int64_t> out;
  allocate(out, n, n, "labels");
  if (n > 0) h5_check(H5Dread(labels, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()), "reading 'labels'");
  for (int64_t i = 0; i < n; ++i) {
    if (out[i] < 0 || out[i] >= num_classes) {
      throw H5FormatError("label " + std::to_string(out[i]) + " of sample " + std::to_string(i) +
                        " is outside [0, num_classes = " + std::to_string(num_classes) + ")");
    }
  }
  return out;
}

// The chunk's samples and the deflate level of /images (0 when not chunked or not compressed).
std::pair<int64_t, int> storage_layout(hid_t images) {
  std::pair<int64_t, int> layout{0, 0};
  H5Handle dcpl(H5Dget_create_plist(images), H5Pclose);
  if (H5Pget_layout(dcpl.get()) == H5D_CHUNKED) {
    hsize_t chunk[4] = {0, 0, 0, 0};
    H5Pget_chunk(dcpl.get(), 4, chunk);
    layout.first = static_cast<int64_t>(chunk[0]);
  }
  for (int k = 0, nf = H5Pget_nfilters(dcpl.get()); k < nf; ++k) {
    unsigned flags = 0, cd[8] = {};
    size_t ncd = 8;
    if (H5Pget_filter2(dcpl.get(), static_cast<unsigned>(k), &flags, &ncd, cd, 0, nullptr, nullptr) ==
            H5Z_FILTER_DEFLATE &&
        ncd > 0) {
      layout.second = static_cast<int>(cd[0]);
    }
  }
  return layout;
}

}  // namespace

ImageH5Dataset::ImageH5Dataset(std::string path, bool in_memory) : path_(std::move(path)), in_memory_(in_memory) {
  std::error_code ec;
  if (!fs::exists(path_, ec)) fail("file not found");
  if (const auto kind = trainer::not_a_regular_file(path_); !kind.empty()) fail(kind + ", expected a trainer.images HDF5 file");

  std::lock_guard<std::mutex> lock(hdf5_lock());
  H5Quiet quiet;
  try {
    if (H5Fis_hdf5(path_.c_str()) <= 0) {
      throw H5FormatError("not an HDF5 file (make one with `trainer convert-idx`, or as docs/DATA.md describes)");
    }
    H5Handle file(h5_check_id(H5Fopen(path_.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), "cannot open"), H5Fclose);
    const hid_t f = file.get();
    check_image_format(f);

    H5Handle images = open_dataset(f, "images", H5P_DEFAULT);
    const auto idims = check_images_dataset(f, images.get());
    shape_ = {static_cast<int64_t>(idims[1]), static_cast<int64_t>(idims[2]), static_cast<int64_t>(idims[3])};
    const int64_t n = static_cast<int64_t>(idims[0]);
    H5Handle labels = open_dataset(f, "labels", H5P_DEFAULT);
    check_labels_dataset(f, labels.get(), n);

    meta_.num_classes = read_int_scalar(f, "num_classes");
    if (h5_has_attr(f, "class_names")) meta_.class_names = h5_read_strings(f, "class_names");
    meta_.mean = read_floats_attr(f, "mean");
    meta_.std = read_floats_attr(f, "std");
    const std::string problem = meta_problem(meta_, shape_[0], -1);
    if (!problem.empty()) throw H5FormatError(problem);
    labels_ = read_labels(labels.get(), n, meta_.num_classes);
    std::tie(chunk_samples_, gzip_level_) = storage_layout(images.get());

    if (in_memory_) {
      allocate(images_, n * sample_bytes(), n, "images");
      if (n > 0) h5_check(H5Dread(images.get(), H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, images_.data()),
                          "reading 'images'");
    } else {
      // Random reads of an uncompressed file go straight to the requested bytes when the chunk cache is
      // off; with the cache on, HDF5 would pull whole chunks (256 samples) into it for one sample each.
      // A compressed chunk must be inflated whole anyway, so there the cache keeps inflated chunks.
      images.reset();
      H5Handle dapl(H5Pcreate(H5P_DATASET_ACCESS), H5Pclose);
      const size_t cache = gzip_level_ > 0 ? (size_t{64} << 20) : 0;
      h5_check(H5Pset_chunk_cache(dapl.get(), gzip_level_ > 0 ? 12421 : 0, cache, 1.0), "chunk cache");
      H5Handle reopened = open_dataset(f, "images", dapl.get());
      dset_ = reopened.release();
      file_ = file.release();
    }
  } catch (const H5FormatError& e) {
    fail(e.what());
  }
}

ImageH5Dataset::~ImageH5Dataset() {
  if (dset_ < 0 && file_ < 0) return;
  std::lock_guard<std::mutex> lock(hdf5_lock());
  H5Quiet quiet;
  if (dset_ >= 0) H5Dclose(dset_);
  if (file_ >= 0) H5Fclose(file_);
}

void ImageH5Dataset::read(const std::vector<int64_t>& indices, uint8_t* images_out, int64_t* labels_out) const {
  check_indices(indices, size(), "image file '" + path_ + "'");
  const int64_t bytes = sample_bytes();
  for (size_t k = 0; k < indices.size(); ++k) labels_out[k] = labels_[indices[k]];
  if (indices.empty()) return;
  if (in_memory_) {
    for (size_t k = 0; k < indices.size(); ++k) {
      std::memcpy(images_out + k * bytes, images_.data() + indices[k] * bytes, static_cast<size_t>(bytes));
    }
    return;
  }

  // Sorted distinct indices are read run by run (a run = consecutive samples) into a staging buffer and
  // scattered. One H5Dread per run with a memory space of the run's own shape measured about 15 times
  // faster for random batches than one read of the union of all runs, whose irregular selection HDF5
  // walks in small pieces.
  std::vector<int64_t> sorted(indices);
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  const bool in_order = sorted == indices;
  std::vector<uint8_t> staging(in_order ? 0 : sorted.size() * static_cast<size_t>(bytes));
  uint8_t* dst = in_order ? images_out : staging.data();
  {
    std::lock_guard<std::mutex> lock(hdf5_lock());
    H5Quiet quiet;
    try {
      H5Handle fspace(h5_check_id(H5Dget_space(dset_), "dataspace of 'images'"), H5Sclose);
      hsize_t start[4] = {0, 0, 0, 0};
      hsize_t count[4] = {0, static_cast<hsize_t>(shape_[0]), static_cast<hsize_t>(shape_[1]),
                          static_cast<hsize_t>(shape_[2])};
      for (size_t a = 0; a < sorted.size();) {
        size_t b = a + 1;
        while (b < sorted.size() && sorted[b] == sorted[b - 1] + 1) ++b;
        start[0] = static_cast<hsize_t>(sorted[a]);
        count[0] = static_cast<hsize_t>(b - a);
        h5_check(H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start, nullptr, count, nullptr), "selecting samples");
        H5Handle mspace(H5Screate_simple(4, count, nullptr), H5Sclose);
        h5_check(H5Dread(dset_, H5T_NATIVE_UINT8, mspace.get(), fspace.get(), H5P_DEFAULT, dst + a * bytes),
                 "reading samples " + std::to_string(sorted[a]) + ".." + std::to_string(sorted[b - 1]) + " of 'images'");
        a = b;
      }
    } catch (const H5FormatError& e) {
      fail(e.what());
    }
  }
  if (!in_order) {
    for (size_t k = 0; k < indices.size(); ++k) {
      const size_t pos = std::lower_bound(sorted.begin(), sorted.end(), indices[k]) - sorted.begin();
      std::memcpy(images_out + k * bytes, staging.data() + pos * bytes, static_cast<size_t>(bytes));
    }
  }
}

}  // namespace data
