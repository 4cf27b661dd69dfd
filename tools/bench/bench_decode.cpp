#include "tools/bench/bench_decode.h"
#include "tools/bench/host_info.h"

#include "data/pixels/jpeg.h"
#include "data/pixels/resize.h"
#include "data/pixels/transforms.h"

#include <cxxopts.hpp>
#include <nlohmann/json.hpp>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>
#include <vector>

namespace trainer::bench {
namespace {

namespace fs = std::filesystem;

bool read_whole(const std::string& path, std::vector<uint8_t>& buf) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) return false;
  const auto n = static_cast<size_t>(f.tellg());
  buf.resize(n);
  f.seekg(0);
  return static_cast<bool>(f.read(reinterpret_cast<char*>(buf.data()), static_cast<std::streamsize>(n)));
}

int64_t peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

struct Pass {
  int64_t images = 0, failures = 0;
  double seconds = 0;
};

/// Decodes files [0, count) once on `threads` threads; pass number `epoch` seeds the train boxes.
Pass run_pass(const std::vector<std::string>& files, int64_t count, int threads, bool train, int size, uint64_t seed,
              int64_t epoch) {
  std::atomic<int64_t> next{0}, failures{0};
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      std::vector<uint8_t> bytes;
      std::vector<uint8_t> out(static_cast<size_t>(size) * size * 3);
      for (int64_t i = next++; i < count; i = next++) {
        const std::string& path = files[static_cast<size_t>(i % static_cast<int64_t>(files.size()))];
        try {
          if (!read_whole(path, bytes)) throw data::DecodeError("cannot read the file");
          const data::ImageHeader h = data::read_header(bytes.data(), bytes.size());
          bool flip = false;
          const data::CropBox box = train ? data::random_resized_crop(h.width, h.height, 0.08, 1.0, 3.0 / 4, 4.0 / 3, seed,
                                                                      epoch, i, &flip)
                                          : data::eval_center_crop(h.width, h.height, size);
          data::decode_crop_resize(bytes.data(), bytes.size(), box, size, size, flip, out.data());
        } catch (const data::DecodeError& e) {
          if (failures++ < 5) std::cerr << "bench --decode-only: " << path << ": " << e.what() << std::endl;
        }
      }
    });
  for (auto& th : pool) th.join();
  Pass p;
  p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  p.images = count;
  p.failures = failures;
  return p;
}

// The command line of bench --decode-only, checked.
struct DecodeArgs {
  std::string src, resize_kernel, out;
  bool train = true;
  int cores = 1;  // the cores this process may use
  int threads = 1, size = 224, passes = 1;
  int64_t limit = 0;
  uint64_t seed = 0;
};

cxxopts::Options decode_options() {
  cxxopts::Options o("trainer bench --decode-only",
                     "Measure the JPEG decoder and the train or eval transform alone over an image folder");
  o.add_options()("decode-only", "this mode")("src", "folder of images (searched recursively)",
                                               cxxopts::value<std::string>()->default_value(""))(
      "train", "the train transform (RandomResizedCrop + flip; the default)")(
      "eval", "the eval transform (Resize(size / 0.875) + CenterCrop(size))")(
      "threads", "decoding threads (default: the cores this process may use)",
      cxxopts::value<int>()->default_value("0"))("size", "output side in pixels", cxxopts::value<int>()->default_value("224"))(
      "passes", "timed passes over all files", cxxopts::value<int>()->default_value("1"))(
      "limit", "use only the first N files (0: all)", cxxopts::value<int64_t>()->default_value("0"))(
      "seed", "seed of the train boxes", cxxopts::value<uint64_t>()->default_value("0"))(
      "resize-kernel", "auto (the CPU's best), plain or avx2 (data/pixels/resize.h)",
      cxxopts::value<std::string>()->default_value("auto"))(
      "out", "write the JSON here (default: stdout)", cxxopts::value<std::string>()->default_value(""))(
      "h,help", "this help");
  return o;
}

DecodeArgs check_decode_args(const cxxopts::ParseResult& a) {
  DecodeArgs d;
  d.src = a["src"].as<std::string>();
  if (d.src.empty()) throw std::runtime_error("command line: bench --decode-only needs --src DIR");
  if (a.count("train") && a.count("eval")) throw std::runtime_error("command line: --train and --eval exclude each other");
  d.train = !a.count("eval");
  cpu_set_t cpus;
  d.cores = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus)
                                                          : static_cast<int>(std::thread::hardware_concurrency());
  d.threads = a["threads"].as<int>() > 0 ? a["threads"].as<int>() : std::max(1, d.cores);
  d.size = a["size"].as<int>();
  d.passes = a["passes"].as<int>();
  if (d.size < 1 || d.passes < 1) throw std::runtime_error("command line: --size and --passes must be at least 1");
  d.limit = a["limit"].as<int64_t>();
  d.seed = a["seed"].as<uint64_t>();
  d.resize_kernel = a["resize-kernel"].as<std::string>();
  d.out = a["out"].as<std::string>();
  return d;
}

// Every regular file under `src`, sorted by path, the first `limit` of them when limit > 0.
std::vector<std::string> list_files(const std::string& src, int64_t limit) {
  std::error_code ec;
  if (!fs::is_directory(src, ec)) throw std::runtime_error(src + ": not a folder (bench --decode-only --src)");
  std::vector<std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(src, ec))
    if (e.is_regular_file()) files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  if (limit > 0 && static_cast<int64_t>(files.size()) > limit) files.resize(static_cast<size_t>(limit));
  if (files.empty()) throw std::runtime_error(src + ": no files to decode");
  return files;
}

void select_resize_kernel(const std::string& kernel) {
  if (kernel == "plain") {
    data::force_resize_kernel(data::ResizeKernel::Plain);
  } else if (kernel == "avx2") {
    if (data::resize_kernel_auto() != data::ResizeKernel::Avx2)
      throw std::runtime_error("command line: --resize-kernel avx2: this CPU has no AVX2");
  } else if (kernel != "auto") {
    throw std::runtime_error("command line: --resize-kernel must be auto, plain or avx2, got '" + kernel + "'");
  }
}

// An untimed warm-up pass, then the timed passes; `cpu_seconds` gets the process's CPU time of the latter.
Pass timed_passes(const std::vector<std::string>& files, const DecodeArgs& d, double& cpu_seconds) {
  // Warm-up: the page cache, the allocator, the threads' first pages (not timed).
  run_pass(files, std::min<int64_t>(static_cast<int64_t>(files.size()), 64 * d.threads), d.threads, d.train, d.size,
           d.seed, -1);
  Pass total;
  const double cpu0 = process_cpu_seconds();
  for (int p = 0; p < d.passes; ++p) {
    const Pass r = run_pass(files, static_cast<int64_t>(files.size()), d.threads, d.train, d.size, d.seed, p);
    total.images += r.images;
    total.failures += r.failures;
    total.seconds += r.seconds;
  }
  cpu_seconds = process_cpu_seconds() - cpu0;  // all threads, user + system
  return total;
}

nlohmann::json decode_result(const DecodeArgs& d, size_t files, const Pass& total, double cpu_seconds, int argc,
                             char** argv) {
  nlohmann::json j;
  j["mode"] = "decode";
  j["transform"] = d.train ? "train" : "eval";
  j["src"] = d.src;
  j["files"] = files;
  j["size"] = d.size;
  j["resize_kernel"] = data::resize_kernel_name(data::ResizeKernel::Auto);
  j["threads"] = d.threads;
  j["cores_available"] = d.cores;
  j["passes"] = d.passes;
  j["images"] = total.images;
  j["decode_failures"] = total.failures;
  j["seconds"] = total.seconds;
  j["cpu_seconds"] = cpu_seconds;
  j["images_per_cpu_s"] = total.images / cpu_seconds;
  j["images_per_s"] = total.images / total.seconds;
  j["images_per_s_per_thread"] = total.images / total.seconds / d.threads;
  j["rss_peak_bytes"] = peak_rss_bytes();
  std::string command_line = "trainer";
  for (int i = 0; i < argc; ++i) command_line += std::string(" ") + argv[i];
  j["command_line"] = command_line;
  return j;
}

// The JSON to --out (or stdout), and one summary line to stderr.
void write_decode_result(const nlohmann::json& j, const DecodeArgs& d) {
  if (d.out.empty()) {
    std::cout << j.dump(2) << std::endl;
  } else {
    std::ofstream f(d.out);
    f << j.dump(2) << '\n';
    if (!f.flush()) throw std::runtime_error(d.out + ": cannot write the bench result");
  }
  std::cerr << "bench --decode-only: " << (d.train ? "train" : "eval") << " " << j["images_per_s"].get<double>()
            << " images/s on " << d.threads << " threads (" << j["images_per_s_per_thread"].get<double>()
            << " per thread, resize " << data::resize_kernel_name(data::ResizeKernel::Auto) << "), peak RSS "
            << (peak_rss_bytes() >> 20) << " MiB"
            << (d.out.empty() ? "" : " -> " + d.out) << std::endl;
}

}  // namespace

int bench_decode_main(int argc, char** argv) {
  cxxopts::Options o = decode_options();
  cxxopts::ParseResult a;
  try {
    a = o.parse(argc, argv);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("command line: ") + e.what() + " (see trainer bench --decode-only --help)");
  }
  if (a.count("help")) {
    std::cout << o.help() << std::endl;
    return 0;
  }
  if (!a.unmatched().empty())
    throw std::runtime_error("command line: unexpected argument '" + a.unmatched()[0] +
                             "' (see trainer bench --decode-only --help)");
  const DecodeArgs d = check_decode_args(a);
  const std::vector<std::string> files = list_files(d.src, d.limit);
  select_resize_kernel(d.resize_kernel);
  double cpu_seconds = 0;
  const Pass total = timed_passes(files, d, cpu_seconds);
  write_decode_result(decode_result(d, files.size(), total, cpu_seconds, argc, argv), d);
  return 0;
}

}  // namespace trainer::bench
