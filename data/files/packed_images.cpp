#include "data/files/packed_images.h"

#include "common/files.h"
#include "data/files/h5_writing.h"
#include "data/files/hdf5_lock.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <type_traits>

static_assert(std::is_same<hid_t, int64_t>::value, "hid_t must be int64_t (HDF5 >= 1.10)");

namespace data {

namespace {

namespace fs = std::filesystem;

// ---- writing -----------------------------------------------------------------------------------------

void write_attr(hid_t loc, const char* name, hid_t file_type, hid_t mem_type, const void* data, hsize_t n, bool scalar) {
  H5Handle space(scalar ? H5Screate(H5S_SCALAR) : H5Screate_simple(1, &n, nullptr), H5Sclose);
  H5Handle attr(h5_check_id(H5Acreate2(loc, name, file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT),
                            std::string("creating attribute '") + name + "'"),
                H5Aclose);
  h5_check(H5Awrite(attr.get(), mem_type, data), std::string("writing attribute '") + name + "'");
}

// A whole 1-D or 2-D dataset, contiguous, written once.
void write_dataset(hid_t file, const char* name, hid_t file_type, hid_t mem_type, const void* data,
                   std::vector<hsize_t> dims) {
  H5Handle space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
  H5Handle d(h5_check_id(H5Dcreate2(file, name, file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                         std::string("creating dataset '") + name + "'"),
             H5Dclose);
  if (dims[0] > 0) h5_check(H5Dwrite(d.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), std::string("writing '") + name + "'");
}

// ---- reading -----------------------------------------------------------------------------------------

template <typename T>
std::vector<T> read_numbers(hid_t loc, const char* name, hid_t mem_type) {
  H5Handle attr = h5_open_attr(loc, name);
  H5Handle ftype(H5Aget_type(attr.get()), H5Tclose);
  const auto cls = H5Tget_class(ftype.get());
  if (cls != H5T_INTEGER && cls != H5T_FLOAT) throw H5FormatError(std::string("root attribute '") + name + "' is not numeric");
  std::vector<T> out(static_cast<size_t>(h5_attr_points(attr.get())));
  h5_check(H5Aread(attr.get(), mem_type, out.data()), std::string("reading attribute '") + name + "'");
  return out;
}

int64_t read_scalar(hid_t loc, const char* name) {
  const auto v = read_numbers<int64_t>(loc, name, H5T_NATIVE_INT64);
  if (v.size() != 1) throw H5FormatError(std::string("root attribute '") + name + "' must hold one value");
  return v[0];
}

// Opens dataset `name`, checks its rank, integer class and stored size; returns it with its dims.
hid_t open_dataset(hid_t file, const char* name, int rank, std::vector<hsize_t>& dims) {
  if (H5Lexists(file, name, H5P_DEFAULT) <= 0) throw H5FormatError(std::string("missing dataset '") + name + "'");
  H5Handle d(h5_check_id(H5Dopen2(file, name, H5P_DEFAULT), std::string("opening dataset '") + name + "'"), H5Dclose);
  H5Handle space(H5Dget_space(d.get()), H5Sclose);
  H5Handle type(H5Dget_type(d.get()), H5Tclose);
  if (H5Sget_simple_extent_ndims(space.get()) != rank || H5Tget_class(type.get()) != H5T_INTEGER)
    throw H5FormatError(std::string("dataset '") + name + "' must be integers of rank " + std::to_string(rank));
  dims.assign(static_cast<size_t>(rank), 0);
  H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  const std::string problem = dataset_size_problem(file, d.get(), name);
  if (!problem.empty()) throw H5FormatError(problem);
  return d.release();
}

template <typename T>
std::vector<T> read_whole(hid_t d, hid_t mem_type, size_t count, const char* name) {
  std::vector<T> out(count);
  if (count > 0) h5_check(H5Dread(d, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()), std::string("reading '") + name + "'");
  return out;
}

}  // namespace

// ---- writer ----------------------------------------------------------------------------------------------

PackedImageWriter::PackedImageWriter(std::string path) : path_(std::move(path)), tmp_path_(path_ + ".tmp") {
  std::lock_guard<std::mutex> lock(hdf5_lock());
  H5Quiet quiet;
  try {
    H5Handle file(h5_check_id(H5Fcreate(tmp_path_.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT),
                              "cannot create " + tmp_path_ + " (does the folder exist and is it writable?)"),
                  H5Fclose);
    hsize_t dims = 0, maxdims = H5S_UNLIMITED, chunk = hsize_t{1} << 20;
    H5Handle space(H5Screate_simple(1, &dims, &maxdims), H5Sclose);
    H5Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
    h5_check(H5Pset_chunk(dcpl.get(), 1, &chunk), "chunking 'bytes'");
    h5_check(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER), "fill time");
    H5Handle bytes(h5_check_id(H5Dcreate2(file.get(), "bytes", H5T_STD_U8LE, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT),
                               "creating dataset 'bytes'"),
                   H5Dclose);
    file_ = file.release();
    bytes_ = bytes.release();
  } catch (const H5FormatError& e) {
    throw std::runtime_error("packed image file '" + path_ + "': " + e.what());
  }
}

PackedImageWriter::~PackedImageWriter() {
  if (!finished_) h5_abandon_written(file_, {{bytes_, "bytes"}}, tmp_path_);
}

void PackedImageWriter::append(const uint8_t* data, size_t size, int64_t label, int width, int height) {
  const std::string where = "packed image file '" + path_ + "': ";
  if (finished_ || file_ < 0) throw std::logic_error(where + "append() after finish()");
  if (label < 0 || width <= 0 || height <= 0)
    throw std::invalid_argument(where + "label and size must be non-negative and positive");
  if (size > 0) {
    std::lock_guard<std::mutex> lock(hdf5_lock());
    H5Quiet quiet;
    try {
      const hsize_t start = static_cast<hsize_t>(offsets_.back()), count = size, total = start + size;
      h5_check(H5Dset_extent(bytes_, &total), "growing 'bytes'");
      H5Handle fspace(H5Dget_space(bytes_), H5Sclose);
      h5_check(H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, &start, nullptr, &count, nullptr), "selecting");
      H5Handle mspace(H5Screate_simple(1, &count, nullptr), H5Sclose);
      h5_check(H5Dwrite(bytes_, H5T_NATIVE_UINT8, mspace.get(), fspace.get(), H5P_DEFAULT, data), "writing 'bytes'");
    } catch (const H5FormatError& e) {
      throw std::runtime_error(where + e.what());
    }
  }
  offsets_.push_back(offsets_.back() + static_cast<int64_t>(size));
  labels_.push_back(label);
  sizes_.push_back(width);
  sizes_.push_back(height);
}

void PackedImageWriter::finish(const ImageMeta& meta, int64_t mean_std_images) {
  const std::string where = "packed image file '" + path_ + "': ";
  if (finished_ || file_ < 0) throw std::logic_error(where + "finish() called twice");
  const int64_t max_label = labels_.empty() ? -1 : *std::max_element(labels_.begin(), labels_.end());
  if (meta.num_classes < 1 || max_label >= meta.num_classes)
    throw std::invalid_argument(where + "num_classes must be positive and above every label");
  if (static_cast<int64_t>(meta.class_names.size()) != meta.num_classes)
    throw std::invalid_argument(where + "class_names needs one name per class");
  if (meta.mean.size() != 3 || meta.std.size() != 3 || !std::all_of(meta.std.begin(), meta.std.end(), [](float s) { return s > 0; }))
    throw std::invalid_argument(where + "mean and std need 3 values, std positive");
  const auto write_index_and_attributes = [&] {
    const hsize_t n = labels_.size();
    write_dataset(file_, "offsets", H5T_STD_I64LE, H5T_NATIVE_INT64, offsets_.data(), {n + 1});
    write_dataset(file_, "labels", H5T_STD_I64LE, H5T_NATIVE_INT64, labels_.data(), {n});
    write_dataset(file_, "sizes", H5T_STD_I32LE, H5T_NATIVE_INT32, sizes_.data(), {n, 2});
    h5_write_strings(file_, "format", {kPackedImagesFormat}, /*scalar=*/true);
    write_attr(file_, "format_version", H5T_STD_I64LE, H5T_NATIVE_INT64, &kPackedImagesVersion, 1, true);
    write_attr(file_, "num_classes", H5T_STD_I64LE, H5T_NATIVE_INT64, &meta.num_classes, 1, true);
    h5_write_strings(file_, "class_names", meta.class_names, /*scalar=*/false);
    write_attr(file_, "mean", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, meta.mean.data(), 3, false);
    write_attr(file_, "std", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, meta.std.data(), 3, false);
    write_attr(file_, "mean_std_images", H5T_STD_I64LE, H5T_NATIVE_INT64, &mean_std_images, 1, true);
  };
  h5_finish_written(file_, {{bytes_, "bytes"}}, write_index_and_attributes, tmp_path_, path_, where);
  finished_ = true;
}

// ---- reader ----------------------------------------------------------------------------------------------

void PackedImageDataset::fail(const std::string& what) const {
  throw std::runtime_error("packed image file '" + path_ + "': " + what);
}

PackedImageDataset::PackedImageDataset(std::string path, ImageTransform transform, bool in_memory)
    : path_(std::move(path)), transform_(transform), in_memory_(in_memory) {
  check_transform(transform_);
  std::error_code ec;
  if (!fs::exists(path_, ec)) fail("file not found (make one with trainer convert-images)");
  if (const auto kind = trainer::not_a_regular_file(path_); !kind.empty()) fail(kind);
  std::lock_guard<std::mutex> lock(hdf5_lock());
  H5Quiet quiet;
  try {
    if (H5Fis_hdf5(path_.c_str()) <= 0) throw H5FormatError("not an HDF5 file");
    H5Handle file(h5_check_id(H5Fopen(path_.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), "cannot open"), H5Fclose);
    const auto format = h5_read_strings(file.get(), "format");
    if (format.size() != 1 || format[0] != kPackedImagesFormat)
      throw H5FormatError("format is '" + (format.empty() ? std::string() : format[0]) + "', expected '" +
                        kPackedImagesFormat + "' (a file of trainer convert-images)");
    const int64_t version = read_scalar(file.get(), "format_version");
    if (version != kPackedImagesVersion)
      throw H5FormatError("format_version " + std::to_string(version) + " is not supported (this build reads " +
                        std::to_string(kPackedImagesVersion) + ")");
    meta_.num_classes = read_scalar(file.get(), "num_classes");
    meta_.class_names = h5_read_strings(file.get(), "class_names");
    meta_.mean = read_numbers<float>(file.get(), "mean", H5T_NATIVE_FLOAT);
    meta_.std = read_numbers<float>(file.get(), "std", H5T_NATIVE_FLOAT);
    mean_std_images_ = read_scalar(file.get(), "mean_std_images");
    if (meta_.num_classes < 1) throw H5FormatError("num_classes must be positive");
    if (static_cast<int64_t>(meta_.class_names.size()) != meta_.num_classes)
      throw H5FormatError("class_names has " + std::to_string(meta_.class_names.size()) + " names for " +
                        std::to_string(meta_.num_classes) + " classes");
    if (meta_.mean.size() != 3 || meta_.std.size() != 3) throw H5FormatError("mean and std need 3 values (RGB)");
    for (float s : meta_.std)
      if (!(s > 0)) throw H5FormatError("std must be positive per channel");

    std::vector<hsize_t> dl, doff, ds, db;
    H5Handle labels(open_dataset(file.get(), "labels", 1, dl), H5Dclose);
    H5Handle offsets(open_dataset(file.get(), "offsets", 1, doff), H5Dclose);
    H5Handle sizes(open_dataset(file.get(), "sizes", 2, ds), H5Dclose);
    H5Handle bytes(open_dataset(file.get(), "bytes", 1, db), H5Dclose);
    const hsize_t n = dl[0];
    if (doff[0] != n + 1 || ds[0] != n || ds[1] != 2)
      throw H5FormatError("offsets must have N + 1 entries and sizes (N, 2) for N = " + std::to_string(n) + " labels");
    labels_ = read_whole<int64_t>(labels.get(), H5T_NATIVE_INT64, n, "labels");
    offsets_ = read_whole<int64_t>(offsets.get(), H5T_NATIVE_INT64, n + 1, "offsets");
    sizes_ = read_whole<int32_t>(sizes.get(), H5T_NATIVE_INT32, 2 * n, "sizes");
    if (offsets_[0] != 0 || offsets_[n] != static_cast<int64_t>(db[0]))
      throw H5FormatError("offsets must start at 0 and end at the " + std::to_string(db[0]) + " bytes of 'bytes'");
    for (hsize_t i = 0; i < n; ++i) {
      if (offsets_[i + 1] < offsets_[i]) throw H5FormatError("offsets decrease at image " + std::to_string(i));
      if (labels_[i] < 0 || labels_[i] >= meta_.num_classes)
        throw H5FormatError("label " + std::to_string(labels_[i]) + " of image " + std::to_string(i) +
                          " is outside [0, num_classes = " + std::to_string(meta_.num_classes) + ")");
      if (sizes_[2 * i] <= 0 || sizes_[2 * i + 1] <= 0) throw H5FormatError("image " + std::to_string(i) + " has a size <= 0");
    }
    if (in_memory_) {
      bytes_ = read_whole<uint8_t>(bytes.get(), H5T_NATIVE_UINT8, db[0], "bytes");
    } else {
      dset_ = bytes.release();
      file_ = file.release();
    }
  } catch (const H5FormatError& e) {
    fail(e.what());
  }
}

PackedImageDataset::~PackedImageDataset() {
  std::lock_guard<std::mutex> lock(hdf5_lock());
  if (dset_ >= 0) H5Dclose(dset_);
  if (file_ >= 0) H5Fclose(file_);
}

std::vector<uint8_t> PackedImageDataset::encoded(int64_t i) const {
  check_indices({i}, size(), "packed image file '" + path_ + "'");
  const int64_t begin = offsets_[i], n = offsets_[i + 1] - begin;
  std::vector<uint8_t> out(static_cast<size_t>(n));
  if (n == 0) return out;
  if (in_memory_) {
    std::memcpy(out.data(), bytes_.data() + begin, static_cast<size_t>(n));
    return out;
  }
  std::lock_guard<std::mutex> lock(hdf5_lock());
  H5Quiet quiet;
  const hsize_t start = static_cast<hsize_t>(begin), count = static_cast<hsize_t>(n);
  H5Handle fspace(H5Dget_space(dset_), H5Sclose);
  H5Handle mspace(H5Screate_simple(1, &count, nullptr), H5Sclose);
  if (H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, &start, nullptr, &count, nullptr) < 0 ||
      H5Dread(dset_, H5T_NATIVE_UINT8, mspace.get(), fspace.get(), H5P_DEFAULT, out.data()) < 0)
    throw std::runtime_error("packed image file '" + path_ + "': reading image " + std::to_string(i) + ": " + h5_error());
  return out;
}

void PackedImageDataset::read_epoch(const std::vector<int64_t>& indices, int64_t epoch, uint8_t* images_out,
                                    int64_t* labels_out, std::vector<SampleFailure>* failures) const {
  check_indices(indices, size(), "packed image file '" + path_ + "'");
  const int64_t bytes_per_sample = int64_t{3} * transform_.size * transform_.size;
  thread_local std::vector<uint8_t> buf;
  for (size_t k = 0; k < indices.size(); ++k) {
    const int64_t i = indices[k];
    const uint8_t* data;
    size_t n = static_cast<size_t>(offsets_[i + 1] - offsets_[i]);
    if (in_memory_) {
      data = bytes_.data() + offsets_[i];
    } else {
      buf = encoded(i);
      data = buf.data();
    }
    uint8_t* out = images_out + static_cast<int64_t>(k) * bytes_per_sample;
    const std::string error = decode_sample(data, n, sizes_[2 * i], sizes_[2 * i + 1], i, epoch, transform_, out);
    labels_out[k] = labels_[i];
    if (!error.empty()) {
      labels_out[k] = kIgnoreLabel;
      SampleFailure f{i, path_ + " image " + std::to_string(i) + ": " + error};
      // Once per epoch that draws it (the prefetch may read the next epoch's first batches while this
      // one still trains): the line says which pass over the data it is, counted from 1.
      spdlog::warn("data: {}, read for epoch {}; a zero image with its label ignored takes its place", f.what, epoch + 1);
      if (failures) failures->push_back(std::move(f));
    }
  }
}

}  // namespace data
