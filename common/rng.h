// The state of every random generator a computation on one device draws from, taken and put back as a
// whole: the CPU generator (CPU dropout, anything sampled on the host) and, for a CUDA device, that
// device's own generator (CUDA dropout). Used wherever work is redone and must draw the same numbers:
// activation checkpointing's recomputation, a retried optimizer step, a checkpoint and its resume.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace trainer {

struct GeneratorStates {
  at::Tensor cpu;                                 ///< the default CPU generator's state
  at::Tensor cuda;                                ///< the device's CUDA generator state (undefined for CPU)
  c10::Device cuda_device{c10::DeviceType::CPU};  ///< whose generator `cuda` is

  /// The generators a computation on `device` draws from. Asks for a CUDA generator only when `device`
  /// is CUDA, so a CPU-only build or run makes no CUDA call.
  static GeneratorStates capture(const c10::Device& device);
  /// Puts every captured state back.
  void restore() const;
};

/// The state of `gen`, read under its lock.
at::Tensor generator_state(at::Generator gen);
/// Sets the state of `gen` under its lock (a copy of an at::Generator is a handle to the same one).
void set_generator_state(at::Generator gen, const at::Tensor& state);

}  // namespace trainer
