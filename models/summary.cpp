#include "models/summary.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <sstream>

namespace models {
namespace {

// "torch::nn::Conv2dImpl" -> "Conv2d", "models::BottleneckImpl" -> "Bottleneck".
std::string short_type(const torch::nn::Module& m) {
  std::string name = m.name();
  const auto colon = name.rfind("::");
  if (colon != std::string::npos) name = name.substr(colon + 2);
  const std::string impl = "Impl";
  if (name.size() > impl.size() && name.compare(name.size() - impl.size(), impl.size(), impl) == 0) {
    name.resize(name.size() - impl.size());
  }
  return name;
}

// A container whose children all share one type reads as "3 x Bottleneck"; anything else by its type.
std::string describe(const torch::nn::Module& m) {
  const auto children = m.children();
  const std::string type = short_type(m);
  if ((type == "ModuleList" || type == "Sequential") && !children.empty()) {
    const std::string first = short_type(*children.front());
    for (const auto& c : children) {
      if (short_type(*c) != first) return type + " (" + std::to_string(children.size()) + ")";
    }
    return std::to_string(children.size()) + " x " + first;
  }
  return type;
}

// 11689512 -> "11,689,512".
std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return (n < 0 ? "-" : "") + out;
}

// At least 4 significant digits and at least 3 decimals, so a CIFAR ResNet's 0.06164 GFLOPs does not
// read as 0.062: 8.178, 23.027, 0.06164.
std::string four_digits(double v) {
  int decimals = 3;
  if (v > 0 && v < 1) decimals = std::min(9, 3 - static_cast<int>(std::floor(std::log10(v))));
  std::ostringstream s;
  s << std::fixed << std::setprecision(decimals) << v;
  return s.str();
}

}  // namespace

int64_t count_parameters(const torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters(/*recurse=*/true)) n += p.numel();
  return n;
}

std::string summarize(const ModelImpl& model, const std::vector<int64_t>& sample_shape) {
  std::ostringstream shape;
  for (size_t i = 0; i < sample_shape.size(); ++i) shape << (i ? "x" : "") << sample_shape[i];

  int64_t total = 0, trainable = 0;
  for (const auto& p : model.parameters(/*recurse=*/true)) {
    total += p.numel();
    if (p.requires_grad()) trainable += p.numel();
  }
  const double gflops = model.forward_flops(sample_shape) / 1e9;

  std::ostringstream s;
  s << short_type(model) << ", " << model.num_blocks() << " blocks, sample " << shape.str() << "\n";
  s << std::left << std::setw(12) << "  child" << std::setw(24) << "type" << std::right << std::setw(14)
    << "parameters" << "\n";
  for (const auto& child : model.named_children()) {
    s << "  " << std::left << std::setw(10) << child.key() << std::setw(24) << describe(*child.value())
      << std::right << std::setw(14) << with_commas(count_parameters(*child.value())) << "\n";
  }
  s << std::left << std::setw(36) << "total parameters" << std::right << std::setw(14) << with_commas(total)
    << "\n";
  s << std::left << std::setw(36) << "trainable parameters" << std::right << std::setw(14)
    << with_commas(trainable) << "\n";
  s << std::left << std::setw(36) << "forward GFLOPs per sample" << std::right << std::setw(14)
    << four_digits(gflops) << "\n";
  s << std::left << std::setw(36) << "training GFLOPs per sample (3x)" << std::right << std::setw(14)
    << four_digits(3.0 * gflops) << "\n";
  return s.str();
}

}  // namespace models
