#include "trainer/memory/plan.h"

#include "trainer/memory/backend.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>

namespace trainer {
namespace {


bool under(int64_t bytes, int64_t cap) { return cap == 0 || bytes <= cap; }

// The sizes a fixed micro-batch m backs off through: m, ceil(m / 2), ... down to the floor.
std::vector<int64_t> halvings(int64_t m, int64_t floor) {
  std::vector<int64_t> sizes{m};
  while (sizes.back() > floor) sizes.push_back(std::max(floor, (sizes.back() + 1) / 2));
  return sizes;
}

// The largest m in [lo, hi] whose planned peak is at most the cap; 0 when not even lo fits. Not a bisection:
// the peak is not monotone in m where the micro-batches per step go from several to one (a step of one
// micro-batch never holds its gradients beside its activations).
int64_t largest_fitting(const PlanJob& job, double per_sample, int64_t lo, int64_t hi) {
  if (job.cap == 0) return hi;
  for (int64_t m = hi; m >= lo; --m)
    if (under(planned_peak(job, per_sample, m), job.cap)) return m;
  return 0;
}

std::string rung_line(int64_t m, int64_t accum, bool checkpointing) {
  std::ostringstream s;
  s << "micro-batch " << m << " (x" << accum << "), " << (checkpointing ? "every block recomputed" : "activations kept");
  return s.str();
}

}  // namespace

int64_t planned_peak(const PlanJob& job, double per_sample, int64_t m) {
  int64_t fixed = 0;
  for (const auto& line : job.fixed) fixed += line.bytes;
  const int64_t activations = static_cast<int64_t>(std::ceil(per_sample * static_cast<double>(m)));
  const bool several = (job.rank_batch + m - 1) / m > 1;
  const int64_t held = several ? job.gradient_bytes + activations : std::max(job.gradient_bytes, activations);
  return fixed + job.largest_gradient_bytes + held;
}

MemoryPlan plan_memory(const PlanJob& job) {
  if (job.rank_batch < 1 || job.min_micro_batch < 1 || job.min_micro_batch > job.rank_batch ||
      job.micro_batch < 0 || job.micro_batch > job.rank_batch ||
      (job.micro_batch > 0 && job.micro_batch < job.min_micro_batch))
    throw std::invalid_argument("plan_memory: expected 1 <= floor <= micro-batch <= batch, got floor " +
                                std::to_string(job.min_micro_batch) + ", micro-batch " +
                                std::to_string(job.micro_batch) + ", batch " + std::to_string(job.rank_batch));
  MemoryPlan plan;
  for (const auto& line : job.fixed) plan.fixed_bytes += line.bytes;
  plan.cap = job.cap;
  const bool may_recompute = job.checkpointing || job.ladder_checkpointing;
  const double kept = job.checkpointing ? job.per_sample_checkpointed_bytes : job.per_sample_bytes;
  auto settle = [&](int64_t m, bool recompute, double per_sample) {
    plan.fits = true;
    plan.micro_batch = m;
    plan.checkpointing = recompute;
    plan.peak_bytes = planned_peak(job, per_sample, m);
  };
  if (job.micro_batch > 0) {
    plan.start_peak_bytes = planned_peak(job, kept, job.micro_batch);
    const auto sizes = halvings(job.micro_batch, job.min_micro_batch);
    for (int64_t m : sizes) {
      if (under(planned_peak(job, kept, m), job.cap)) {
        settle(m, job.checkpointing, kept);
        break;
      }
    }
    if (!plan.fits && may_recompute && !job.checkpointing) {
      for (int64_t m : sizes) {
        if (under(planned_peak(job, job.per_sample_checkpointed_bytes, m), job.cap)) {
          settle(m, true, job.per_sample_checkpointed_bytes);
          break;
        }
      }
    }
  } else {
    if (const int64_t m = largest_fitting(job, kept, job.min_micro_batch, job.rank_batch); m > 0) {
      settle(m, job.checkpointing, kept);
    } else if (may_recompute && !job.checkpointing) {
      const double recomputed = job.per_sample_checkpointed_bytes;
      if (const int64_t r = largest_fitting(job, recomputed, job.min_micro_batch, job.rank_batch); r > 0)
        settle(r, true, recomputed);
    }
  }
  if (!plan.fits) {  // the smallest rung the ladder has, and how far it is over
    const bool recompute = may_recompute;
    const double per_sample = recompute ? job.per_sample_checkpointed_bytes : job.per_sample_bytes;
    plan.micro_batch = job.min_micro_batch;
    plan.checkpointing = recompute;
    plan.peak_bytes = planned_peak(job, per_sample, job.min_micro_batch);
    plan.short_bytes = plan.peak_bytes - job.cap;
  }
  plan.accum_steps = (job.rank_batch + plan.micro_batch - 1) / plan.micro_batch;
  plan.rung = rung_line(plan.micro_batch, plan.accum_steps, plan.checkpointing);
  return plan;
}

std::string render_plan(const PlanJob& job, const MemoryPlan& plan) {
  std::ostringstream s;
  auto row = [&](const std::string& what, const std::string& bytes, const std::string& how) {
    s << "  " << what << std::string(what.size() < 26 ? 26 - what.size() : 1, ' ') << bytes
      << std::string(bytes.size() < 12 ? 12 - bytes.size() : 1, ' ') << how << "\n";
  };
  for (const auto& line : job.fixed) row(line.what, format_bytes(line.bytes), line.how);
  row("gradients", format_bytes(job.gradient_bytes), "held through the step when it has several micro-batches");
  row("largest gradient", format_bytes(job.largest_gradient_bytes), "made by backward before it is added (a tied weight's two)");
  row("per sample", format_bytes(static_cast<int64_t>(job.per_sample_bytes)), "activations kept for backward, and the sample");
  row("per sample, recomputed", format_bytes(static_cast<int64_t>(job.per_sample_checkpointed_bytes)),
      "every block recomputed in backward");
  const std::string cap = plan.cap == 0 ? "no cap" : "cap " + format_bytes(plan.cap);
  if (job.micro_batch > 0 && plan.fits && plan.micro_batch != job.micro_batch)
    s << "starts at micro-batch " << job.micro_batch << " (peak " << format_bytes(plan.start_peak_bytes)
      << ", over the cap); the ladder backs off to:\n";
  if (plan.fits) {
    s << "fits: " << plan.rung << ", peak " << format_bytes(plan.peak_bytes) << " under " << cap;
    if (plan.cap > 0)
      s << " (" << static_cast<int64_t>(std::lround(100.0 * static_cast<double>(plan.peak_bytes) / static_cast<double>(plan.cap)))
        << "%)";
    s << "\n";
  } else {
    s << "does not fit: " << plan.rung << " needs " << format_bytes(plan.peak_bytes) << ", "
      << format_bytes(plan.short_bytes) << " over the cap of " << format_bytes(plan.cap) << "\n";
  }
  return s.str();
}

nlohmann::json plan_to_json(const PlanJob& job, const MemoryPlan& plan) {
  auto fixed = nlohmann::json::array();
  for (const auto& line : job.fixed) fixed.push_back({{"what", line.what}, {"bytes", line.bytes}, {"how", line.how}});
  return {{"fixed", fixed},
          {"fixed_bytes", plan.fixed_bytes},
          {"gradient_bytes", job.gradient_bytes},
          {"largest_gradient_bytes", job.largest_gradient_bytes},
          {"per_sample_bytes", job.per_sample_bytes},
          {"per_sample_checkpointed_bytes", job.per_sample_checkpointed_bytes},
          {"cap", plan.cap},
          {"fits", plan.fits},
          {"micro_batch", plan.micro_batch},
          {"accum_steps", plan.accum_steps},
          {"checkpointing", plan.checkpointing},
          {"peak_bytes", plan.peak_bytes},
          {"start_peak_bytes", plan.start_peak_bytes},
          {"short_bytes", plan.short_bytes},
          {"rung", plan.rung}};
}

}  // namespace trainer
