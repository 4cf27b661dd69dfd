#include "trainer/checkpoint/store.h"

#include "common/clock.h"
#include "common/compat.h"
#include "common/files.h"
#include "common/log.h"
#include "common/versions.h"

#include <spdlog/spdlog.h>
#include <zlib.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <tuple>

namespace trainer {

namespace fs = std::filesystem;

namespace {

const char* kManifest = "manifest.json";
const char* kLatest = "latest";
const char* kTmpPrefix = ".tmp-";          // .tmp-step-00000042-<pid>: a checkpoint being written
const char* kLatestTmpPrefix = ".latest.tmp-";

std::string errno_text(int err) {
  const char* name = nullptr;
  switch (err) {
    case ENOSPC: name = "ENOSPC"; break;
    case EFBIG: name = "EFBIG"; break;
    case EIO: name = "EIO"; break;
    case EDQUOT: name = "EDQUOT"; break;
    case EROFS: name = "EROFS"; break;
    case EACCES: name = "EACCES"; break;
    case EPERM: name = "EPERM"; break;
    case ENOTDIR: name = "ENOTDIR"; break;
    case ENOENT: name = "ENOENT"; break;
    default: break;
  }
  std::string s = std::strerror(err);
  if (name) s += std::string(" (") + name + ")";
  return s;
}

/// A system call failed: the message names the operation, the path and the system's reason.
struct IoError : std::runtime_error {
  IoError(const std::string& what, const std::string& path, int err)
      : std::runtime_error(what + " " + path + ": " + errno_text(err)), code(err) {}
  int code;
};

/// "step-00001200", or "step-00001200-r2" for attempt 2 of that step's save.
std::string step_name(int64_t step, int attempt = 0) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return attempt > 0 ? std::string(buf) + "-r" + std::to_string(attempt) : std::string(buf);
}

struct FolderName {
  int64_t step = 0;
  int attempt = 0;
};

/// Parses "step-00001200" -> {1200, 0} and "step-00001200-r2" -> {1200, 2}; nullopt for any other name.
std::optional<FolderName> parse_folder_name(const std::string& name) {
  static const std::regex re("^step-([0-9]{8,18})(-r([0-9]{1,4}))?$");
  std::smatch m;
  if (!std::regex_match(name, m, re)) return std::nullopt;
  return FolderName{std::stoll(m[1].str()), m[3].matched ? std::stoi(m[3].str()) : 0};
}

std::optional<int64_t> parse_step_name(const std::string& name) {
  const auto f = parse_folder_name(name);
  if (!f) return std::nullopt;
  return f->step;
}

std::string crc32_hex(const std::string& bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const char* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {  // zlib takes a 32-bit length
    const uInt n = static_cast<uInt>(std::min<size_t>(left, 1u << 30));
    crc = crc32(crc, reinterpret_cast<const Bytef*>(p), n);
    p += n;
    left -= n;
  }
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08lx", static_cast<unsigned long>(crc));
  return buf;
}

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) throw IoError("cannot open", path, errno);
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    // Some file systems cannot fsync a directory; the data itself was already synced.
    if (!(directory && (err == EINVAL || err == ENOTSUP))) throw IoError("cannot fsync", path, err);
    return;
  }
  ::close(fd);
}

/// Creates `path` (exclusive), writes all of `bytes`, fsyncs and closes it; any failure throws.
void write_file_synced(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw IoError("cannot create", path, errno);
  const char* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, std::min<size_t>(left, size_t(1) << 26));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      throw IoError("cannot write", path, err);
    }
    if (n == 0) {  // not expected from a regular file; never loop forever on it
      ::close(fd);
      throw IoError("cannot write", path, EIO);
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    throw IoError("cannot fsync", path, err);
  }
  if (::close(fd) != 0) throw IoError("cannot close", path, errno);
}

/// Reads the whole file; nullopt with `err` set if it cannot.
std::optional<std::string> read_file(const std::string& path, int& err) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    err = errno;
    return std::nullopt;
  }
  std::string out;
  struct stat st{};
  if (::fstat(fd, &st) == 0 && st.st_size > 0) out.reserve(static_cast<size_t>(st.st_size));
  char buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      err = errno;
      ::close(fd);
      return std::nullopt;
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

void rename_or_throw(const std::string& from, const std::string& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0) throw IoError("cannot rename " + from + " to", to, errno);
}

void remove_quietly(const fs::path& p) {
  std::error_code ec;
  fs::remove_all(p, ec);
  if (ec && ec.value() != ENOENT && ec.value() != ENOTDIR) spdlog::warn("checkpoint: could not remove {}: {}", p.string(), ec.message());
}

void check_file_name(const std::string& name) {
  if (name.empty() || name.find('/') != std::string::npos || name[0] == '.' || name == kManifest || name == kLatest)
    throw std::invalid_argument("CheckpointStore::save: bad file name '" + name +
                                "' (must be non-empty, without '/', not start with '.', not manifest.json)");
}

enum class Verify { Sizes, Checksums };

/// Checks the checkpoint folder `dir` against its manifest. Returns the reason it is unusable, or ""
/// when it is valid; with `out`, also fills in the files' bytes and the manifest.
std::string verify_checkpoint(const fs::path& dir, Verify level, LoadedCheckpoint* out) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return "the folder does not exist";
  if (const auto kind = not_a_regular_file((dir / kManifest).string()); !kind.empty()) return "manifest.json " + kind;
  int err = 0;
  const auto text = read_file((dir / kManifest).string(), err);
  if (!text) return err == ENOENT ? "manifest.json is missing (incomplete save?)" : "cannot read manifest.json: " + errno_text(err);
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(*text);
  } catch (const std::exception& e) {
    return std::string("manifest.json is not valid JSON (") + e.what() + ")";
  }
  if (!m.is_object() || !m.contains("format_version") || !m["format_version"].is_number_integer())
    return "manifest.json has no integer format_version";
  const int64_t version = m["format_version"].get<int64_t>();
  if (version != CheckpointStore::kFormatVersion)
    return "format_version " + std::to_string(version) + " is not supported (this build reads " +
           std::to_string(CheckpointStore::kFormatVersion) + ")";
  if (!m.contains("step") || !m["step"].is_number_integer()) return "manifest.json has no integer step";
  const int64_t step = m["step"].get<int64_t>();
  const auto named = parse_step_name(dir.filename().string());
  if (named && *named != step)
    return "manifest.json says step " + std::to_string(step) + ", the folder name says " + std::to_string(*named);
  if (!m.contains("files") || !m["files"].is_object()) return "manifest.json has no files table";

  for (const auto& [name, entry] : m["files"].items()) {
    if (!entry.is_object() || !entry.contains("size") || !entry["size"].is_number_unsigned() ||
        !entry.contains("crc32") || !entry["crc32"].is_string())
      return "manifest.json entry for " + name + " lacks size or crc32";
    if (name.empty() || name.find('/') != std::string::npos || name[0] == '.')
      return "manifest.json names a bad file '" + name + "'";
    const uint64_t size = entry["size"].get<uint64_t>();
    const fs::path p = dir / name;
    if (const auto kind = not_a_regular_file(p.string()); !kind.empty()) return name + " " + kind;
    if (level == Verify::Sizes) {
      const auto actual = fs::file_size(p, ec);
      if (ec) return name + " is missing";
      if (actual != size)
        return name + " has " + std::to_string(actual) + " bytes, the manifest says " + std::to_string(size) + " (truncated?)";
      continue;
    }
    auto bytes = read_file(p.string(), err);
    if (!bytes) return err == ENOENT ? name + " is missing" : "cannot read " + name + ": " + errno_text(err);
    if (bytes->size() != size)
      return name + " has " + std::to_string(bytes->size()) + " bytes, the manifest says " + std::to_string(size) +
             " (truncated?)";
    const std::string crc = crc32_hex(*bytes);
    if (crc != entry["crc32"].get<std::string>())
      return name + " is corrupt (CRC32 " + crc + ", the manifest says " + entry["crc32"].get<std::string>() + ")";
    if (out) out->files.emplace(name, std::move(*bytes));
  }
  if (out) {
    out->path = dir.string();
    out->step = step;
    out->manifest = std::move(m);
  }
  return "";
}

/// Step folders in `dir`, newest (highest step, then highest attempt) first.
std::vector<std::pair<int64_t, fs::path>> step_folders(const fs::path& dir) {
  std::vector<std::tuple<int64_t, int, fs::path>> found;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const auto name = parse_folder_name(it->path().filename().string());
    if (name && it->is_directory(ec)) found.emplace_back(name->step, name->attempt, it->path());
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a > b; });
  std::vector<std::pair<int64_t, fs::path>> out;
  for (auto& [step, attempt, path] : found) out.emplace_back(step, std::move(path));
  return out;
}

/// The folder name in `<dir>/latest`: nullopt if the file is absent; "" with `problem` set if unreadable.
std::optional<std::string> read_latest(const fs::path& dir, std::string& problem) {
  if (const auto kind = not_a_regular_file((dir / kLatest).string()); !kind.empty()) {
    problem = (dir / kLatest).string() + " " + kind;
    return "";
  }
  int err = 0;
  const auto text = read_file((dir / kLatest).string(), err);
  if (!text) {
    if (err == ENOENT || err == ENOTDIR) return std::nullopt;
    problem = "cannot read " + (dir / kLatest).string() + ": " + errno_text(err);
    return "";
  }
  std::string name = *text;
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' ')) name.pop_back();
  if (!parse_step_name(name)) {
    problem = (dir / kLatest).string() + " does not name a checkpoint ('" + name.substr(0, 40) + "')";
    return "";
  }
  return name;
}

}  // namespace

const std::string& LoadedCheckpoint::file(const std::string& name) const {
  auto it = files.find(name);
  if (it == files.end()) throw std::runtime_error("checkpoint " + path + " has no file " + name);
  return it->second;
}

CheckpointStore::CheckpointStore(std::string run_dir, int keep_last, std::string device)
    : run_dir_(std::move(run_dir)),
      dir_((fs::path(run_dir_) / "checkpoints").string()),
      keep_last_(keep_last),
      device_(std::move(device)) {
  if (keep_last < 0)
    throw std::invalid_argument("CheckpointStore: keep_last must be >= 0 (0 keeps all), got " + std::to_string(keep_last));
  // A crash mid-save leaves a temporary folder (or a temporary `latest`); never a partial step-* folder.
  std::error_code ec;
  for (fs::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(kTmpPrefix, 0) == 0 || name.rfind(kLatestTmpPrefix, 0) == 0) {
      spdlog::info("checkpoint: removing {} left by an interrupted save", it->path().string());
      remove_quietly(it->path());
    }
  }
}

CheckpointStore::~CheckpointStore() {
  wait();
  for (const auto& o : outcomes_)
    if (!o.ok()) spdlog::error("checkpoint: a background save failed: {}", o.error);
}

void CheckpointStore::check_writable() const {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec)
    throw std::runtime_error("checkpoint folder " + dir_ + " cannot be created: " + errno_text(ec.value()) +
                             "; choose a writable run folder");
  const std::string probe = (fs::path(dir_) / (".probe-" + std::to_string(::getpid()))).string();
  try {
    ::unlink(probe.c_str());  // a probe left by an earlier crash of a process with our pid
    write_file_synced(probe, "probe");
  } catch (const IoError& e) {
    ::unlink(probe.c_str());
    throw std::runtime_error("checkpoint folder " + dir_ + " is not writable: " + errno_text(e.code) +
                             "; choose a writable run folder or free space on it");
  }
  if (::unlink(probe.c_str()) != 0)
    throw std::runtime_error("checkpoint folder " + dir_ + ": cannot remove the probe file " + probe + ": " +
                             errno_text(errno));
}

void CheckpointStore::write_folder(const fs::path& tmp_dir, int64_t step, const CheckpointFiles& files,
                                   const nlohmann::json& extra) const {
  std::error_code ec;
  if (!fs::is_directory(dir_, ec)) {
    fs::create_directories(dir_, ec);
    if (ec) throw IoError("cannot create", dir_, ec.value());
    fsync_path(run_dir_, true);  // make the new checkpoints/ entry itself durable
  }
  remove_quietly(tmp_dir);
  if (::mkdir(tmp_dir.c_str(), 0755) != 0) throw IoError("cannot create", tmp_dir.string(), errno);
  const std::string cuda = cuda_runtime_version();
  nlohmann::json manifest = {
      {"format_version", kFormatVersion},
      {"step", step},
      {"created", utc_now_iso()},
      {"created_unix", static_cast<int64_t>(std::time(nullptr))},
      {"libtorch_version", compat::torch_version()},
      {"cuda_version", cuda.empty() ? nlohmann::json(nullptr) : nlohmann::json(cuda)},
      {"device", device_},
      // CRC32 (zlib): it catches the accidents this guards against (torn writes, truncation, bit rot)
      // at several GB/s, and zlib is already linked. SHA-256 would only add tamper resistance.
      {"checksum", "crc32"},
      {"files", nlohmann::json::object()},
      {"extra", extra.is_null() ? nlohmann::json::object() : extra}};
  for (const auto& [fname, bytes] : files) {
    write_file_synced((tmp_dir / fname).string(), bytes);
    manifest["files"][fname] = {{"size", static_cast<uint64_t>(bytes.size())}, {"crc32", crc32_hex(bytes)}};
  }
  // The manifest goes last: a folder with a valid manifest has all its files.
  write_file_synced((tmp_dir / kManifest).string(), json_text(manifest, 2) + "\n");
  fsync_path(tmp_dir.string(), true);
}

void CheckpointStore::publish_folder(const fs::path& tmp_dir, const fs::path& final_dir, const std::string& name) const {
  // A same-step checkpoint is swapped atomically (RENAME_EXCHANGE) and the old one, now under the
  // temporary name, deleted.
  std::error_code ec;
  if (fs::exists(final_dir, ec)) {
    if (::renameat2(AT_FDCWD, tmp_dir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) != 0) {
      const int err = errno;
      if (err != EINVAL && err != ENOSYS && err != ENOTSUP) throw IoError("cannot replace", final_dir.string(), err);
      // No atomic exchange on this file system: for a moment there is no folder of this step, and a
      // crash then falls back to the previous checkpoint.
      const fs::path aside = fs::path(dir_) / (kTmpPrefix + name + "-old-" + std::to_string(::getpid()));
      remove_quietly(aside);
      rename_or_throw(final_dir.string(), aside.string());
      rename_or_throw(tmp_dir.string(), final_dir.string());
      remove_quietly(aside);
    } else {
      remove_quietly(tmp_dir);
    }
  } else {
    rename_or_throw(tmp_dir.string(), final_dir.string());
  }
  fsync_path(dir_, true);
}

void CheckpointStore::commit_latest(const std::string& name, int64_t step, const fs::path& final_dir) const {
  // `latest` names the new folder: the same pattern, one small file.
  const fs::path latest_tmp = fs::path(dir_) / (kLatestTmpPrefix + std::to_string(::getpid()));
  try {
    ::unlink(latest_tmp.c_str());
    write_file_synced(latest_tmp.string(), name + "\n");
    rename_or_throw(latest_tmp.string(), (fs::path(dir_) / kLatest).string());
    fsync_path(dir_, true);
  } catch (const std::exception& e) {
    ::unlink(latest_tmp.c_str());
    throw std::runtime_error("checkpoint step " + std::to_string(step) + " was written to " + final_dir.string() +
                             " but `latest` could not be updated: " + e.what() +
                             "; `latest` still names the previous checkpoint");
  }
}

void CheckpointStore::prune(int64_t step) const {
  // Only once the new checkpoint is committed: the newest valid ones older than it are kept. Newer
  // folders (from a run resumed at an earlier step) are left alone.
  if (keep_last_ <= 0) return;
  int kept = 1;  // the one just written
  for (const auto& [s, path] : step_folders(dir_)) {
    if (s >= step) continue;
    if (kept < keep_last_ && verify_checkpoint(path, Verify::Sizes, nullptr).empty()) {
      ++kept;
      continue;
    }
    remove_quietly(path);
  }
}

std::string CheckpointStore::write_checkpoint(int64_t step, int attempt, const CheckpointFiles& files,
                                              const nlohmann::json& extra) const {
  if (step < 0) throw std::invalid_argument("CheckpointStore::save: step must be >= 0, got " + std::to_string(step));
  if (attempt < 0 || attempt > 9999)
    throw std::invalid_argument("CheckpointStore::save: attempt must be in [0, 9999], got " + std::to_string(attempt));
  for (const auto& f : files) check_file_name(f.first);
  if (!extra.is_object() && !extra.is_null()) throw std::invalid_argument("CheckpointStore::save: extra manifest fields must be a JSON object");
  const std::string name = step_name(step, attempt);
  const fs::path final_dir = fs::path(dir_) / name;
  const fs::path tmp_dir = fs::path(dir_) / (kTmpPrefix + name + "-" + std::to_string(::getpid()));
  try {
    write_folder(tmp_dir, step, files, extra);
    publish_folder(tmp_dir, final_dir, name);
  } catch (const std::exception& e) {
    remove_quietly(tmp_dir);
    throw std::runtime_error("checkpoint save of step " + std::to_string(step) + " failed: " + error_message(e) +
                             "; the previous checkpoints and `latest` are untouched");
  }
  commit_latest(name, step, final_dir);
  prune(step);
  return final_dir.string();
}

std::string CheckpointStore::save(int64_t step, const CheckpointFiles& files, const nlohmann::json& extra,
                                  int attempt) {
  wait();
  return write_checkpoint(step, attempt, files, extra);
}

void CheckpointStore::save_async(int64_t step, CheckpointFiles files, nlohmann::json extra) {
  wait();
  in_flight_ = true;
  worker_ = std::thread([this, step, files = std::move(files), extra = std::move(extra)]() {
    SaveOutcome o;
    o.step = step;
    try {
      o.path = write_checkpoint(step, 0, files, extra);
    } catch (const std::exception& e) {
      o.error = e.what();
    } catch (...) {
      o.error = "checkpoint save of step " + std::to_string(step) + " failed with an unknown exception";
    }
    {
      std::lock_guard<std::mutex> lock(outcomes_mu_);
      outcomes_.push_back(std::move(o));
    }
    in_flight_ = false;
  });
}

void CheckpointStore::wait() {
  if (worker_.joinable()) worker_.join();
}

std::optional<SaveOutcome> CheckpointStore::take_outcome() {
  std::lock_guard<std::mutex> lock(outcomes_mu_);
  if (outcomes_.empty()) return std::nullopt;
  SaveOutcome o = std::move(outcomes_.front());
  outcomes_.pop_front();
  return o;
}

std::optional<LoadedCheckpoint> CheckpointStore::load_latest(const CheckpointCheck& check) const {
  std::error_code ec;
  if (!fs::is_directory(dir_, ec)) return std::nullopt;
  std::vector<std::string> warnings;
  auto warn = [&warnings](std::string w) {
    spdlog::warn("checkpoint: {}", w);
    warnings.push_back(std::move(w));
  };

  std::string problem;
  const auto latest = read_latest(dir_, problem);
  const auto all = step_folders(dir_);
  // Candidates, best first: the folder `latest` names, then the older ones, newest first. Folders newer
  // than `latest` were never committed (a crash before `latest` moved) or belong to a run that was
  // resumed from an earlier step: neither is the run's state.
  std::vector<std::pair<int64_t, fs::path>> folders;
  if (latest && !latest->empty()) {
    const int64_t latest_step = *parse_step_name(*latest);
    const fs::path target = fs::path(dir_) / *latest;
    if (fs::is_directory(target, ec)) folders.emplace_back(latest_step, target);
    else warn("`latest` names " + target.string() + ", which does not exist; falling back to an earlier checkpoint");
    for (const auto& f : all)
      if (f.first < latest_step) folders.push_back(f);
  } else {
    if (!problem.empty()) warn(problem + "; using the newest valid checkpoint");
    else if (!all.empty()) warn("no `latest` pointer in " + dir_ + "; using the newest valid checkpoint");
    folders = all;
  }
  if (folders.empty()) {
    if (warnings.empty()) return std::nullopt;
    std::string all;
    for (const auto& w : warnings) all += (all.empty() ? "" : " | ") + w;
    throw std::runtime_error("no valid checkpoint in " + dir_ + ": " + all +
                             "; move the folder away to start from scratch");
  }

  std::string reasons;
  for (const auto& [s, path] : folders) {
    LoadedCheckpoint c;
    std::string why = verify_checkpoint(path, Verify::Checksums, &c);
    // Intact files can still make an unusable checkpoint (one written incompletely by an older build,
    // or edited): that is no reason to lose the older ones either.
    if (why.empty() && check) why = check(c);
    if (why.empty()) {
      c.warnings = std::move(warnings);
      if (!c.warnings.empty()) spdlog::warn("checkpoint: resuming from {} (step {})", c.path, c.step);
      return c;
    }
    warn("checkpoint " + path.string() + " is unusable: " + why + "; falling back to an earlier one");
    reasons += (reasons.empty() ? "" : " | ") + path.filename().string() + ": " + why;
  }
  throw std::runtime_error("no valid checkpoint in " + dir_ + " (" + reasons +
                           "); move the folder away to start from scratch, or fix the files");
}

LoadedCheckpoint CheckpointStore::load(const std::string& path, const CheckpointCheck& check) {
  std::error_code ec;
  fs::path dir(path);
  if (!fs::exists(dir, ec)) throw std::runtime_error("cannot resume from " + path + ": it does not exist");
  if (!fs::is_directory(dir, ec))
    throw std::runtime_error("cannot resume from " + path + ": not a checkpoint folder (no manifest.json), nor a "
                             "run or checkpoints folder with a `latest` pointer");
  if (!fs::exists(dir / kManifest, ec) && !parse_step_name(dir.filename().string())) {
    // A checkpoints folder or a run folder: follow its `latest`, but do not fall back.
    fs::path ckdir = fs::exists(dir / kLatest, ec) ? dir : dir / "checkpoints";
    std::string problem;
    const auto latest = read_latest(ckdir, problem);
    if (!latest)
      throw std::runtime_error("cannot resume from " + path + ": not a checkpoint folder (no manifest.json), nor a "
                               "run or checkpoints folder with a `latest` pointer");
    if (latest->empty()) throw std::runtime_error("cannot resume from " + path + ": " + problem);
    dir = ckdir / *latest;
  }
  LoadedCheckpoint c;
  std::string why = verify_checkpoint(dir, Verify::Checksums, &c);
  if (why.empty() && check) why = check(c);
  if (!why.empty()) throw std::runtime_error("cannot resume from checkpoint " + dir.string() + ": " + why);
  return c;
}

std::vector<CheckpointInfo> CheckpointStore::list() const {
  std::vector<CheckpointInfo> out;
  auto folders = step_folders(dir_);
  std::reverse(folders.begin(), folders.end());
  for (const auto& [s, path] : folders) {
    LoadedCheckpoint c;
    if (!verify_checkpoint(path, Verify::Checksums, &c).empty()) continue;
    CheckpointInfo info;
    info.path = c.path;
    info.step = c.step;
    for (const auto& f : c.files) info.bytes += f.second.size();
    info.created = c.manifest.value("created", "");
    out.push_back(std::move(info));
  }
  return out;
}

}  // namespace trainer
