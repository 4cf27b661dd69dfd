#include "data/samples/loader.h"

#include "common/log.h"
#include "data/pixels/rng.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <numeric>
#include <stdexcept>
#include <tuple>

namespace data {

namespace {

constexpr uint64_t kAugmentTag = 0x6175676d656e74ULL;  // "augment": keeps these keys apart from the order's

std::string state_str(int64_t epoch, int64_t position) {
  return "epoch " + std::to_string(epoch) + ", position " + std::to_string(position);
}

}  // namespace

// ---- augmentation ----------------------------------------------------------------------------------

AugmentParams draw_augment(uint64_t seed, int64_t epoch, int64_t index, const AugmentOptions& options) {
  SplitMix64 rng(hash_key(hash_key(seed, kAugmentTag, static_cast<uint64_t>(epoch)), static_cast<uint64_t>(index)));
  AugmentParams p;
  if (options.random_crop_padding > 0) {
    const uint64_t span = 2 * static_cast<uint64_t>(options.random_crop_padding) + 1;
    p.dy = static_cast<int64_t>(rng.below(span));
    p.dx = static_cast<int64_t>(rng.below(span));
  }
  if (options.hflip) p.flip = (rng.next() >> 63) != 0;
  return p;
}

std::vector<float> pixel_table(const std::vector<float>& mean, const std::vector<float>& std, bool normalize) {
  TORCH_CHECK(mean.size() == std.size(), "pixel_table: ", mean.size(), " means for ", std.size(), " stds");
  std::vector<float> table(mean.size() * 256);
  for (size_t c = 0; c < mean.size(); ++c) {
    for (int v = 0; v < 256; ++v) {
      const float x = static_cast<float>(v) / 255.0f;
      table[c * 256 + v] = normalize ? (x - mean[c]) / std[c] : x;
    }
  }
  return table;
}

void augment_image(const uint8_t* src, const std::array<int64_t, 3>& shape, const AugmentParams& params,
                   int64_t padding, const float* table, float* dst) {
  const int64_t C = shape[0], H = shape[1], W = shape[2];
  // Output column x reads source column sx = (flip ? W-1-x : x) + dx - padding; [x0, x1) is where that
  // lies inside the image, everything else is padding.
  const int64_t shift = params.dx - padding;
  const int64_t x0 = params.flip ? std::max<int64_t>(0, shift) : std::max<int64_t>(0, -shift);
  const int64_t x1 = params.flip ? std::min<int64_t>(W, W + shift) : std::min<int64_t>(W, W - shift);
  for (int64_t c = 0; c < C; ++c) {
    const float* t = table + c * 256;
    const float pad = t[0];
    for (int64_t y = 0; y < H; ++y) {
      float* out = dst + (c * H + y) * W;
      const int64_t sy = y + params.dy - padding;
      if (sy < 0 || sy >= H || x0 >= x1) {
        std::fill(out, out + W, pad);
        continue;
      }
      const uint8_t* row = src + (c * H + sy) * W;
      std::fill(out, out + x0, pad);
      if (params.flip) {
        for (int64_t x = x0; x < x1; ++x) out[x] = t[row[W - 1 - x + shift]];
      } else {
        for (int64_t x = x0; x < x1; ++x) out[x] = t[row[x + shift]];
      }
      std::fill(out + x1, out + W, pad);
    }
  }
}

void augment_image_hwc(const uint8_t* src, int64_t H, int64_t W, int64_t C, const AugmentParams& params,
                       int64_t padding, uint8_t* dst) {
  // As augment_image: output column x reads source column (flip ? W-1-x : x) + shift, inside [x0, x1).
  const int64_t shift = params.dx - padding;
  const int64_t x0 = params.flip ? std::max<int64_t>(0, shift) : std::max<int64_t>(0, -shift);
  const int64_t x1 = params.flip ? std::min<int64_t>(W, W + shift) : std::min<int64_t>(W, W - shift);
  for (int64_t y = 0; y < H; ++y) {
    uint8_t* out = dst + y * W * C;
    const int64_t sy = y + params.dy - padding;
    if (sy < 0 || sy >= H || x0 >= x1) {
      std::fill(out, out + W * C, uint8_t{0});
      continue;
    }
    const uint8_t* row = src + sy * W * C;
    std::fill(out, out + x0 * C, uint8_t{0});
    for (int64_t x = x0; x < x1; ++x) {
      const int64_t sx = (params.flip ? W - 1 - x : x) + shift;
      std::copy(row + sx * C, row + (sx + 1) * C, out + x * C);
    }
    std::fill(out + x1 * C, out + W * C, uint8_t{0});
  }
}

std::shared_ptr<const AugmentSpace> cached_augment_space(AutoAugmentKind kind, int64_t bins, int64_t height,
                                                         int64_t width) {
  using Key = std::tuple<int, int64_t, int64_t, int64_t>;
  static std::mutex mu;
  static std::map<Key, std::shared_ptr<const AugmentSpace>> cache;
  const Key key{static_cast<int>(kind), bins, height, width};
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = cache[key];
  if (!slot) {
    // torch.linspace's CPU kernel, not its scalar formula: some entries come from vector arithmetic.
    const Linspace torch_linspace = [](double start, double end, int64_t steps) {
      const auto t = torch::linspace(start, end, steps, torch::kFloat32);
      return std::vector<float>(t.data_ptr<float>(), t.data_ptr<float>() + steps);
    };
    slot = std::make_shared<const AugmentSpace>(augmentation_space(kind, bins, height, width, torch_linspace));
  }
  return slot;
}

// ---- loader ----------------------------------------------------------------------------------------

struct Loader::Job {
  Batch batch;
  int64_t parts_left = 0;
  std::exception_ptr error;
  std::mutex failures_mu;  // the parts append here from their workers
  std::vector<std::pair<int64_t, SampleFailure>> failures;  // (row in the batch, failure)

  // Moves the failures into the batch, in batch order.
  void collect_failures() {
    std::sort(failures.begin(), failures.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (auto& f : failures) batch.failures.push_back(std::move(f.second));
    failures.clear();
  }
};

Loader::Loader(std::shared_ptr<const ImageDataset> dataset, LoaderOptions options)
    : dataset_(std::move(dataset)), opt_(options) {
  if (!dataset_) throw std::invalid_argument("image loader: no dataset");
  n_ = dataset_->size();
  shape_ = dataset_->sample_shape();
  decoded_ = dataset_->layout() == PixelLayout::HWC;
  uint8_ = decoded_ || opt_.uint8_batches;
  validate();
  const auto& m = dataset_->meta();
  table_ = pixel_table(m.mean, m.std, opt_.augment.normalize);
  const auto& aa = opt_.augment.auto_augment;
  if (aa.kind != AutoAugmentKind::None) space_ = cached_augment_space(aa.kind, aa.bins, shape_[1], shape_[2]);
  pinned_ = opt_.pin_memory && torch::cuda::is_available();
  for (int64_t w = 0; w < opt_.workers; ++w) threads_.emplace_back([this] { worker_loop(); });
}

void Loader::validate() const {
  auto bad = [](const std::string& what) { throw std::invalid_argument("image loader: " + what); };
  const std::string n_str = std::to_string(n_);
  if (n_ <= 0) bad("the dataset is empty");
  if (opt_.global_batch <= 0) bad("global_batch must be positive, got " + std::to_string(opt_.global_batch));
  if (opt_.world_size <= 0) bad("world_size must be positive, got " + std::to_string(opt_.world_size));
  if (opt_.rank < 0 || opt_.rank >= opt_.world_size) {
    bad("rank " + std::to_string(opt_.rank) + " is outside [0, world_size = " + std::to_string(opt_.world_size) + ")");
  }
  if (opt_.drop_last && opt_.global_batch > n_) {
    bad("global_batch " + std::to_string(opt_.global_batch) + " exceeds the dataset's " + n_str +
        " samples, so an epoch would have no full batch");
  }
  if (opt_.drop_last && opt_.global_batch < opt_.world_size) {
    bad("global_batch " + std::to_string(opt_.global_batch) + " is smaller than world_size " +
        std::to_string(opt_.world_size) + ": some ranks would get no sample");
  }
  if (opt_.workers < 0) bad("workers must be >= 0, got " + std::to_string(opt_.workers));
  if (opt_.prefetch < 0) bad("prefetch must be >= 0, got " + std::to_string(opt_.prefetch));
  if (opt_.augment.random_crop_padding < 0) {
    bad("random_crop_padding must be >= 0, got " + std::to_string(opt_.augment.random_crop_padding));
  }
  if (decoded_ && (opt_.augment.random_crop_padding > 0 || opt_.augment.hflip)) {
    bad("random_crop_padding and hflip apply to stored pixels; a dataset that decodes images crops and flips "
        "with its own transform");
  }
  if (decoded_ && opt_.augment.auto_augment.kind != AutoAugmentKind::None)
    bad("auto_augment applies to stored pixels; a dataset that decodes images augments in its own transform");
  try {
    check_auto_augment(opt_.augment.auto_augment);
  } catch (const std::invalid_argument& e) {
    bad(e.what());
  }
  if (opt_.augment.auto_augment.kind != AutoAugmentKind::None && shape_[0] != 1 && shape_[0] != 3)
    bad("auto_augment needs images of 1 or 3 channels, got " + std::to_string(shape_[0]));
  if (!(opt_.augment.random_erasing >= 0 && opt_.augment.random_erasing <= 1))
    bad("random_erasing must be a probability in [0, 1], got " + std::to_string(opt_.augment.random_erasing));
  const auto& m = dataset_->meta();
  if (static_cast<int64_t>(m.mean.size()) != shape_[0] || static_cast<int64_t>(m.std.size()) != shape_[0]) {
    bad("the dataset's mean/std do not have one value per channel (" + std::to_string(shape_[0]) + ")");
  }
}

Loader::~Loader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    tasks_.clear();
  }
  task_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

int64_t Loader::steps_per_epoch() const {
  return opt_.drop_last ? n_ / opt_.global_batch : (n_ + opt_.global_batch - 1) / opt_.global_batch;
}

std::vector<int64_t> Loader::epoch_order(int64_t epoch) const {
  if (opt_.shuffle) return epoch_permutation(n_, opt_.seed, epoch);
  std::vector<int64_t> order(static_cast<size_t>(n_));
  std::iota(order.begin(), order.end(), int64_t{0});
  return order;
}

LoaderState Loader::normalized(LoaderState s) const {
  const bool epoch_done = opt_.drop_last ? s.position + opt_.global_batch > n_ : s.position >= n_;
  if (epoch_done) return {s.epoch + 1, 0};
  return s;
}

// Describes (without pixels) the batch that starts at `at`, which must be normalized. False past the
// EvalLoader's single epoch.
bool Loader::plan(LoaderState at, Batch& out) {
  if (end_epoch_ >= 0 && at.epoch >= end_epoch_) return false;
  if (order_epoch_ != at.epoch) {
    order_ = epoch_order(at.epoch);
    order_epoch_ = at.epoch;
  }
  const int64_t g = std::min(opt_.global_batch, n_ - at.position);
  const int64_t begin = at.position + opt_.rank * g / opt_.world_size;
  const int64_t end = at.position + (opt_.rank + 1) * g / opt_.world_size;
  out.epoch = at.epoch;
  out.position = at.position;
  out.global_size = g;
  out.indices.assign(order_.begin() + begin, order_.begin() + end);
  return true;
}

// Batch image tensors are recycled. A fresh (64, 3, 224, 224) float tensor is a fresh mmap, and its
// page faults cost more than the augmentation that fills it (measured: 335 against 124 us per sample).
// A pooled tensor is reused only when the pool holds the last reference to it and to its storage, i.e.
// the caller has dropped the batch and every view of it. Pinned tensors are not pooled: the CUDA caching
// host allocator recycles them already and knows when an asynchronous copy still reads one.
torch::Tensor Loader::image_buffer(int64_t rows) {
  // uint8 images (decoded, or stored with uint8_batches) leave as NHWC: (B, C, H, W) sizes in channels_last memory.
  const auto options = torch::TensorOptions()
                           .dtype(uint8_ ? torch::kUInt8 : torch::kFloat32)
                           .pinned_memory(pinned_)
                           .memory_format(uint8_ ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
  const std::vector<int64_t> sizes = {rows, shape_[0], shape_[1], shape_[2]};
  if (pinned_) return torch::empty(sizes, options);
  auto is_free = [](const torch::Tensor& t) { return t.use_count() == 1 && t.storage().use_count() == 1; };
  for (const auto& t : pool_) {
    if (t.size(0) == rows && is_free(t)) return t;
  }
  auto fresh = torch::empty(sizes, options);
  // In flight: up to max(prefetch, 1) batches; held by the caller: the last one or two.
  const size_t capacity = static_cast<size_t>(std::max<int64_t>(opt_.prefetch, 1) + 3);
  if (pool_.size() < capacity) {
    pool_.push_back(fresh);
  } else {
    for (auto& t : pool_) {
      if (is_free(t)) {  // a free tensor of another size (a partial batch): replace it
        t = fresh;
        break;
      }
    }
  }
  return fresh;
}

std::shared_ptr<Loader::Job> Loader::make_job(Batch batch) {
  auto job = std::make_shared<Job>();
  const int64_t b = batch.size();
  batch.images = image_buffer(b);
  batch.labels = torch::empty({b}, torch::TensorOptions().dtype(torch::kInt64).pinned_memory(pinned_));
  if (uint8_ && opt_.augment.random_erasing > 0)
    batch.erase = torch::empty({b, 4}, torch::TensorOptions().dtype(torch::kInt64).pinned_memory(pinned_));
  job->batch = std::move(batch);
  return job;
}

// Reads and augments rows [begin, end) of a job's batch. Runs in a worker without the loader's lock:
// every part writes its own rows.
void Loader::fill(Job& job, int64_t begin, int64_t end) const {
  if (begin >= end) return;
  Batch& b = job.batch;
  const int64_t bytes = shape_[0] * shape_[1] * shape_[2];
  const std::vector<int64_t> indices(b.indices.begin() + begin, b.indices.begin() + end);
  if (decoded_) {
    // The dataset decodes straight into the batch's rows (H, W, C each): no copy, no conversion.
    std::vector<SampleFailure> failures;
    dataset_->read_epoch(indices, b.epoch, b.images.data_ptr<uint8_t>() + begin * bytes,
                         b.labels.data_ptr<int64_t>() + begin, &failures);
    if (!failures.empty()) {
      std::lock_guard<std::mutex> lock(job.failures_mu);
      for (auto& f : failures) {
        const int64_t row = begin + (std::find(indices.begin(), indices.end(), f.index) - indices.begin());
        job.failures.emplace_back(row, std::move(f));
      }
    }
    if (b.erase.defined()) draw_erase_boxes(b, begin, indices);
    return;
  }
  if (opt_.uint8_batches) fill_stored_uint8(job, begin, end, indices);
  else fill_stored(job, begin, end, indices);
}

// The boxes only, for rows [begin, begin + indices.size()): the step erases them once the images are
// normalized on the device. The same boxes fill_stored erases in float batches.
void Loader::draw_erase_boxes(Batch& b, int64_t begin, const std::vector<int64_t>& indices) const {
  EraseOptions eo;
  eo.p = opt_.augment.random_erasing;
  int64_t* box = b.erase.data_ptr<int64_t>() + begin * 4;
  for (size_t k = 0; k < indices.size(); ++k, box += 4) {
    const EraseBox e = draw_erase_box(eo, shape_[1], shape_[2], opt_.seed, b.epoch, indices[k]);
    box[0] = e.top, box[1] = e.left, box[2] = e.height, box[3] = e.width;
  }
}

// The uint8 part of a stored sample's augmentation, src to out, both (C, H, W): the crop and flip (each
// channel plane as a one-channel HWC image; what augment_image does on the way to float), then the
// automatic augmentation if one is configured.
void Loader::augment_u8(const uint8_t* src, const AugmentParams& params, int64_t epoch, int64_t index,
                        uint8_t* out) const {
  const int64_t C = shape_[0], H = shape_[1], W = shape_[2];
  for (int64_t c = 0; c < C; ++c)
    augment_image_hwc(src + c * H * W, H, W, 1, params, opt_.augment.random_crop_padding, out + c * H * W);
  if (space_)
    auto_augment(ImageU8{out, C, H, W, /*hwc=*/false}, opt_.augment.auto_augment, *space_, opt_.seed, epoch, index);
}

// Stored pixels: crop, flip, automatic augmentation (uint8), float and normalization, erasing.
void Loader::fill_stored(Job& job, int64_t begin, int64_t end, const std::vector<int64_t>& indices) const {
  Batch& b = job.batch;
  const int64_t C = shape_[0], H = shape_[1], W = shape_[2], bytes = C * H * W;
  thread_local std::vector<uint8_t> raw, crop;
  raw.resize(static_cast<size_t>((end - begin) * bytes));
  dataset_->read_epoch(indices, b.epoch, raw.data(), b.labels.data_ptr<int64_t>() + begin, nullptr);
  float* images = b.images.data_ptr<float>();
  EraseOptions eo;
  eo.p = opt_.augment.random_erasing;
  for (int64_t k = 0; k < end - begin; ++k) {
    const AugmentParams params = draw_augment(opt_.seed, b.epoch, indices[k], opt_.augment);
    const int64_t padding = opt_.augment.random_crop_padding;
    float* dst = images + (begin + k) * bytes;
    if (space_) {
      crop.resize(static_cast<size_t>(bytes));
      augment_u8(raw.data() + k * bytes, params, b.epoch, indices[k], crop.data());
      augment_image(crop.data(), shape_, AugmentParams{}, 0, table_.data(), dst);
    } else {
      augment_image(raw.data() + k * bytes, shape_, params, padding, table_.data(), dst);
    }
    if (eo.p > 0) erase_chw(dst, C, H, W, draw_erase_box(eo, H, W, opt_.seed, b.epoch, indices[k]));
  }
}

// Stored pixels to uint8 batches: the crop, flip and automatic augmentation of fill_stored, then the
// (C, H, W) planes interleaved into the batch's (H, W, C) row; no table, no erasing (the step does both).
void Loader::fill_stored_uint8(Job& job, int64_t begin, int64_t end, const std::vector<int64_t>& indices) const {
  Batch& b = job.batch;
  const int64_t C = shape_[0], H = shape_[1], W = shape_[2], bytes = C * H * W;
  thread_local std::vector<uint8_t> raw, crop;
  raw.resize(static_cast<size_t>((end - begin) * bytes));
  crop.resize(static_cast<size_t>(bytes));
  dataset_->read_epoch(indices, b.epoch, raw.data(), b.labels.data_ptr<int64_t>() + begin, nullptr);
  uint8_t* images = b.images.data_ptr<uint8_t>();  // channels_last: row k is (H, W, C)
  for (int64_t k = 0; k < end - begin; ++k) {
    const AugmentParams params = draw_augment(opt_.seed, b.epoch, indices[k], opt_.augment);
    augment_u8(raw.data() + k * bytes, params, b.epoch, indices[k], crop.data());
    uint8_t* dst = images + (begin + k) * bytes;
    for (int64_t c = 0; c < C; ++c) {
      const uint8_t* plane = crop.data() + c * H * W;
      for (int64_t p = 0; p < H * W; ++p) dst[p * C + c] = plane[p];
    }
  }
  if (b.erase.defined()) draw_erase_boxes(b, begin, indices);
}

// Splits a job into one part per worker and queues them; without workers, runs it here.
void Loader::run_parts(const std::shared_ptr<Job>& job) {
  const int64_t b = job->batch.size();
  if (threads_.empty()) {
    try {
      fill(*job, 0, b);
    } catch (...) {
      job->error = std::current_exception();
    }
    return;
  }
  const int64_t parts = std::min<int64_t>(static_cast<int64_t>(threads_.size()), b);
  {
    std::lock_guard<std::mutex> lock(mu_);
    job->parts_left = parts;
    for (int64_t p = 0; p < parts; ++p) tasks_.push_back({job, p * b / parts, (p + 1) * b / parts});
  }
  task_cv_.notify_all();
}

void Loader::worker_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    task_cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
    if (stop_) return;
    Task task = std::move(tasks_.front());
    tasks_.pop_front();
    ++running_;
    lock.unlock();
    std::exception_ptr error;
    try {
      fill(*task.job, task.begin, task.end);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    --running_;
    if (error && !task.job->error) task.job->error = error;
    --task.job->parts_left;
    done_cv_.notify_all();
  }
}

// Keeps max(prefetch, 1) batches submitted ahead of the consumer.
void Loader::top_up() {
  const size_t target = static_cast<size_t>(std::max<int64_t>(opt_.prefetch, 1));
  while (in_flight_.size() < target) {
    const LoaderState at = normalized(cursor_);
    Batch batch;
    if (!plan(at, batch)) return;
    const LoaderState after = {at.epoch, at.position + batch.global_size};
    auto job = make_job(std::move(batch));  // allocates: the cursor moves only once it succeeded
    cursor_ = after;
    in_flight_.push_back(job);
    run_parts(job);
  }
}

// Drops queued parts and waits for the running ones, so that no worker touches a discarded batch.
void Loader::discard_in_flight() {
  std::unique_lock<std::mutex> lock(mu_);
  tasks_.clear();
  done_cv_.wait(lock, [&] { return running_ == 0; });
  in_flight_.clear();
}

Batch Loader::next() {
  top_up();
  if (in_flight_.empty()) throw std::logic_error("image loader: next() after the end of the stream");
  std::shared_ptr<Job> job = in_flight_.front();
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return job->parts_left == 0; });
  }
  in_flight_.pop_front();
  if (job->error) {
    // The failed batch stays unconsumed: the stream restarts at it, so a retry reads it again.
    discard_in_flight();
    cursor_ = {job->batch.epoch, job->batch.position};
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(job->error);
    } catch (const std::exception& e) {
      what = trainer::error_message(e);
    } catch (...) {
    }
    throw std::runtime_error("image loader: reading the batch at " + state_str(job->batch.epoch, job->batch.position) +
                             " failed: " + what);
  }
  consumed_ = normalized({job->batch.epoch, job->batch.position + job->batch.global_size});
  job->collect_failures();
  try {
    top_up();  // keep the workers busy while the caller uses this batch
  } catch (const std::exception&) {
    // This batch is consumed and must reach the caller. What failed here (an allocation under a memory
    // cap) is tried again, and reported, by the next call's top_up().
  }
  return std::move(job->batch);
}

void Loader::seek(int64_t epoch, int64_t position) {
  if (epoch < 0 || position < 0 || position > n_) {
    throw std::invalid_argument("image loader: seek to " + state_str(epoch, position) +
                                " is outside the stream (epoch >= 0, 0 <= position <= " + std::to_string(n_) + ")");
  }
  discard_in_flight();
  cursor_ = {epoch, position};
  consumed_ = normalized(cursor_);
}

void Loader::set_global_batch(int64_t global_batch) {
  const int64_t old = opt_.global_batch;
  opt_.global_batch = global_batch;
  try {
    validate();
  } catch (...) {
    opt_.global_batch = old;
    throw;
  }
  discard_in_flight();
  // consumed_ was normalized for the old size; the raw position is the same sample either way, except
  // at an epoch's end, where {epoch + 1, 0} stays right.
  cursor_ = consumed_;
  consumed_ = normalized(cursor_);
}

Batch Loader::batch_at(int64_t epoch, int64_t position) {
  if (epoch < 0 || position < 0 || position > n_) {
    throw std::invalid_argument("image loader: batch at " + state_str(epoch, position) +
                                " is outside the stream (epoch >= 0, 0 <= position <= " + std::to_string(n_) + ")");
  }
  Batch batch;
  if (!plan(normalized({epoch, position}), batch)) {
    throw std::invalid_argument("image loader: batch at " + state_str(epoch, position) + " is past the end");
  }
  auto job = make_job(std::move(batch));
  fill(*job, 0, job->batch.size());
  job->collect_failures();
  return std::move(job->batch);
}

// ---- evaluation ------------------------------------------------------------------------------------

LoaderOptions EvalLoader::loader_options(const EvalOptions& o) {
  LoaderOptions l;
  l.global_batch = o.batch;
  l.workers = o.workers;
  l.prefetch = o.prefetch;
  l.shuffle = false;
  l.drop_last = false;
  l.augment = AugmentOptions{};
  l.augment.normalize = o.normalize;
  l.pin_memory = o.pin_memory;
  l.rank = o.rank;
  l.world_size = o.world_size;
  return l;
}

EvalLoader::EvalLoader(std::shared_ptr<const ImageDataset> dataset, EvalOptions options)
    : loader_(std::move(dataset), loader_options(options)) {
  loader_.end_epoch_ = 1;
}

std::optional<Batch> EvalLoader::next() {
  if (loader_.state().epoch >= 1) return std::nullopt;
  return loader_.next();
}

// ---- measurement -----------------------------------------------------------------------------------

double measure_loader_throughput(Loader& loader, int batches) {
  if (batches <= 0) throw std::invalid_argument("measure_loader_throughput: batches must be positive");
  loader.next();  // starts the workers and fills the prefetch queue
  int64_t samples = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < batches; ++i) samples += loader.next().size();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(samples) / seconds;
}

}  // namespace data
