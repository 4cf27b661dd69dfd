#include "data/files/h5_writing.h"

#include "data/files/hdf5_lock.h"

#include <filesystem>
#include <stdexcept>

namespace data {

void h5_finish_written(int64_t& file, std::initializer_list<H5OpenDataset> datasets,
                       const std::function<void()>& write_last, const std::string& tmp_path, const std::string& path,
                       const std::string& where) {
  {
    std::lock_guard<std::mutex> lock(hdf5_lock());
    H5Quiet quiet;
    try {
      write_last();
      for (const H5OpenDataset& d : datasets) {
        h5_check(H5Dclose(d.id), std::string("closing '") + d.name + "'");
        d.id = -1;
      }
      h5_check(H5Fclose(file), "closing the file");
      file = -1;
    } catch (const H5FormatError& e) {
      throw std::runtime_error(where + e.what());
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp_path, path, ec);
  if (ec) throw std::runtime_error(where + "cannot rename " + tmp_path + " to " + path + ": " + ec.message());
}

void h5_abandon_written(int64_t& file, std::initializer_list<H5OpenDataset> datasets, const std::string& tmp_path) {
  {
    std::lock_guard<std::mutex> lock(hdf5_lock());
    H5Quiet quiet;
    for (const H5OpenDataset& d : datasets) {
      if (d.id >= 0) H5Dclose(d.id);
      d.id = -1;
    }
    if (file >= 0) H5Fclose(file);
    file = -1;
  }
  std::error_code ec;
  std::filesystem::remove(tmp_path, ec);
}

}  // namespace data
