#include "trainer/observe/tensorboard.h"

#include <unistd.h>

#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace fs = std::filesystem;

namespace trainer {
namespace tfrecord {
namespace {

std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  static const std::array<uint32_t, 256> table = make_table();
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

namespace {
void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
}  // namespace

std::string frame(const std::string& data) {
  std::string len;
  put_le(len, data.size(), 8);
  std::string out = len;
  put_le(out, masked_crc32c(len.data(), len.size()), 4);
  out += data;
  put_le(out, masked_crc32c(data.data(), data.size()), 4);
  return out;
}

}  // namespace tfrecord

namespace {

// The few protobuf wire types needed: varint (0), 64-bit (1), length-delimited (2), 32-bit (5).
void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void key(std::string& out, int field, int wire_type) { varint(out, (static_cast<uint64_t>(field) << 3) | wire_type); }
void fixed(std::string& out, const void* p, size_t n) {
  // x86 and ARM are little-endian, as the wire format; the values are copied byte by byte.
  out.append(static_cast<const char*>(p), n);
}
void bytes_field(std::string& out, int field, const std::string& s) {
  key(out, field, 2);
  varint(out, s.size());
  out += s;
}

std::string event(double wall_time, int64_t step, const std::string& file_version, const std::string& summary) {
  std::string e;
  key(e, 1, 1);
  fixed(e, &wall_time, 8);
  if (step != 0) {  // proto3 leaves default values out
    key(e, 2, 0);
    varint(e, static_cast<uint64_t>(step));  // negative int64 as ten-byte two's complement, per the spec
  }
  if (!file_version.empty()) bytes_field(e, 3, file_version);
  if (!summary.empty()) bytes_field(e, 5, summary);
  return e;
}

double now_unix() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

TensorboardWriter::TensorboardWriter(const std::string& run_dir) {
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  const auto secs = static_cast<int64_t>(now_unix());
  path_ = (fs::path(run_dir) / fmt::format("events.out.tfevents.{}.{}.{}", secs, host, getpid())).string();
  out_.open(path_, std::ios::binary | std::ios::app);
  if (!out_) throw std::runtime_error("tensorboard: cannot create " + path_ + " (log.tensorboard; is the run folder writable?)");
  write_event(event(now_unix(), 0, "brain.Event:2", ""));
  flush();
}

TensorboardWriter::~TensorboardWriter() {
  std::lock_guard<std::mutex> lock(mu_);
  out_.flush();
}

void TensorboardWriter::write_event(const std::string& e) { out_ << tfrecord::frame(e); }

void TensorboardWriter::add_scalar(const std::string& tag, int64_t step, double value, double wall_time) {
  add_scalars(step, {{tag, value}}, wall_time);
}

void TensorboardWriter::add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values,
                                    double wall_time) {
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;
    bytes_field(value, 1, tag);
    const float f = static_cast<float>(v);
    key(value, 2, 5);
    fixed(value, &f, 4);
    bytes_field(summary, 1, value);
  }
  const std::string e = event(wall_time < 0 ? now_unix() : wall_time, step, "", summary);
  std::lock_guard<std::mutex> lock(mu_);
  write_event(e);
}

void TensorboardWriter::add_text(const std::string& tag, int64_t step, const std::string& text, double wall_time) {
  std::string plugin_data, metadata, tensor, value, summary;
  bytes_field(plugin_data, 1, "text");           // PluginData.plugin_name
  bytes_field(metadata, 1, plugin_data);         // SummaryMetadata.plugin_data
  key(tensor, 1, 0);                             // TensorProto.dtype
  varint(tensor, 7);                             // DT_STRING
  bytes_field(tensor, 2, "");                    // tensor_shape: no dimensions, a scalar
  bytes_field(tensor, 8, text);                  // string_val
  bytes_field(value, 1, tag);                    // Value.tag
  bytes_field(value, 9, metadata);               // Value.metadata
  bytes_field(value, 8, tensor);                 // Value.tensor
  bytes_field(summary, 1, value);
  const std::string e = event(wall_time < 0 ? now_unix() : wall_time, step, "", summary);
  std::lock_guard<std::mutex> lock(mu_);
  write_event(e);
}

void TensorboardWriter::observe(const nlohmann::json& r) {
  if (!r.is_object()) return;
  auto num = [&](const char* k, double& out) {
    auto it = r.find(k);
    if (it == r.end() || !it->is_number()) return false;
    out = it->get<double>();
    return true;
  };
  double step_d = 0;
  if (!num("step", step_d)) return;
  const int64_t step = static_cast<int64_t>(step_d);
  std::vector<std::pair<std::string, double>> values;
  auto take = [&](const char* k, const char* tag) {
    double v;
    if (num(k, v)) values.emplace_back(tag, v);
  };
  auto ev = r.find("event");
  if (ev == r.end()) {
    take("loss", "train/loss");
    take("lr", "train/lr");
    take("samples_per_s", "train/samples_per_s");
    take("step_time_s", "train/step_time_s");
    take("data_wait_s", "train/data_wait_s");
    take("micro_batch", "train/micro_batch");
    take("accum_steps", "train/accum_steps");
    take("grad_norm", "train/grad_norm");
    take("loss_scale", "train/loss_scale");
    take("mem_peak_bytes", "memory/peak_bytes");
    take("mem_limit_bytes", "memory/limit_bytes");
  } else if (ev->is_string() && ev->get<std::string>() == "eval") {
    take("loss", "eval/loss");
    take("top1", "eval/top1");
    take("top5", "eval/top5");
  }
  auto text = r.find("text");
  const bool sample = ev != r.end() && ev->is_string() && ev->get<std::string>() == "sample" && text != r.end() &&
                      text->is_string();
  if (values.empty() && !sample) return;
  try {
    if (sample) add_text("samples", step, text->get<std::string>());
    else add_scalars(step, values);
    flush();
  } catch (const std::exception& e) {
    // TensorBoard is a view of metrics.jsonl: losing it must not stop the run.
    if (!warned_) spdlog::warn("{} (TensorBoard scalars are lost from here; metrics.jsonl has them)", e.what());
    warned_ = true;
  }
}

void TensorboardWriter::flush() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!out_.flush()) throw std::runtime_error("tensorboard: cannot write " + path_ + " (disk full?)");
}

}  // namespace trainer
