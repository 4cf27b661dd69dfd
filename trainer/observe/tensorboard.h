// TensorBoard event files written by hand (log.tensorboard: true): no protobuf or TensorFlow dependency.
//
// A file `<run_dir>/events.out.tfevents.<unix seconds>.<host>.<pid>` is a sequence of TFRecords:
//   uint64 length (little-endian) | uint32 masked CRC32C of those 8 bytes | data | uint32 masked CRC32C of data
// where masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8 and CRC32C is the Castagnoli CRC.
// Each record's data is a serialized tensorflow.Event; the first says file_version "brain.Event:2", the
// others carry a Summary with scalar values. The subset of the protobuf encoding used:
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
// TensorBoard reads simple_value scalars as its scalar plugin's data. Text (its text plugin, the Text tab)
// is a Value with a string tensor and the plugin named in its metadata, as tf.summary.text writes it:
//   Value { string tag = 1; SummaryMetadata metadata = 9; TensorProto tensor = 8; }
//   SummaryMetadata { PluginData plugin_data = 1; }   PluginData { string plugin_name = 1; }  ("text")
//   TensorProto { DataType dtype = 1 (DT_STRING = 7); TensorShapeProto tensor_shape = 2 (empty: a
//                 scalar); repeated bytes string_val = 8; }
// A resumed run starts a new file in the same folder; TensorBoard merges the files of a folder.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace trainer {

namespace tfrecord {
/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of `n` bytes: crc32c("123456789") = 0xE3069283.
uint32_t crc32c(const void* data, size_t n);
/// The TFRecord mask: ((crc >> 15) | (crc << 17)) + 0xa282ead8 (mod 2^32).
uint32_t masked_crc32c(const void* data, size_t n);
/// One framed record around `data`.
std::string frame(const std::string& data);
}  // namespace tfrecord

/// Appends scalar summaries to an event file. Thread-safe.
class TensorboardWriter {
 public:
  /// Creates `run_dir` if needed and a new event file in it, starting with the file_version record.
  /// Throws std::runtime_error naming the path if it cannot be created.
  explicit TensorboardWriter(const std::string& run_dir);
  ~TensorboardWriter();
  TensorboardWriter(const TensorboardWriter&) = delete;
  TensorboardWriter& operator=(const TensorboardWriter&) = delete;

  /// One scalar. `wall_time` in seconds since the Unix epoch (< 0: now). The value is stored as a float
  /// (TensorBoard's simple_value). Buffered: call flush() to make it visible.
  void add_scalar(const std::string& tag, int64_t step, double value, double wall_time = -1);
  /// Several scalars of one step in one event.
  void add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values, double wall_time = -1);
  /// One text (TensorBoard's Text tab, rendered as Markdown) at `step`. Buffered, as add_scalar.
  void add_text(const std::string& tag, int64_t step, const std::string& text, double wall_time = -1);
  /// Writes a metrics.jsonl record as scalars and flushes: a step line gives train/loss, train/lr,
  /// train/samples_per_s, train/step_time_s, train/data_wait_s, train/micro_batch, train/accum_steps,
  /// memory/peak_bytes, memory/limit_bytes (and train/loss_scale, train/grad_norm when present); an
  /// "eval" event gives eval/loss, eval/top1, eval/top5 at its step; a "sample" event (train.sample_every)
  /// its text under the tag samples. Other records are ignored. Never
  /// throws: a write error (disk full) is logged once as a warning and training goes on.
  void observe(const nlohmann::json& record);
  /// Pushes buffered records to the file. Throws std::runtime_error naming the path on a write error.
  void flush();
  /// The event file.
  const std::string& path() const { return path_; }

 private:
  void write_event(const std::string& event);
  std::string path_;
  std::ofstream out_;
  std::mutex mu_;
  bool warned_ = false;
};

}  // namespace trainer
