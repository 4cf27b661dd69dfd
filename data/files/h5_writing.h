// The end of an HDF5 file the image writers (image_h5.h, packed_images.h) write under `<path>.tmp`, so
// that no reader ever finds a half-written file under `path`: finish() writes what comes last, closes the
// datasets and the file, and renames it; a writer destroyed unfinished closes them quietly and removes the
// temporary file. Included by their .cpp files only: the headers keep hid_t out (ids are int64_t).
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>

namespace data {

/// One of a writer's open datasets: its id (a hid_t; -1 once closed) and its name in messages.
struct H5OpenDataset {
  int64_t& id;
  const char* name;
};

/// A writer's finish(): under hdf5_lock() and an H5Quiet, `write_last()` (the attributes, the datasets
/// written at the end), then `datasets` closed in order ("closing '<name>'") and `file` ("closing the
/// file"), each id -1 once closed; then `tmp_path` renamed to `path`. An HDF5 failure (H5FormatError)
/// and a failed rename are std::runtime_error, prefixed with `where` (the writer's "<kind> file '<path>': ").
void h5_finish_written(int64_t& file, std::initializer_list<H5OpenDataset> datasets,
                       const std::function<void()>& write_last, const std::string& tmp_path, const std::string& path,
                       const std::string& where);

/// A writer destroyed before finish(): closes `datasets` and `file` quietly (under hdf5_lock(), each id
/// -1 after) and removes `tmp_path`, ignoring errors.
void h5_abandon_written(int64_t& file, std::initializer_list<H5OpenDataset> datasets, const std::string& tmp_path);

}  // namespace data
