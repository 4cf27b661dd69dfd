#include "common/rng.h"

#include <ATen/Context.h>
#include <ATen/CPUGeneratorImpl.h>

#include <mutex>

namespace trainer {

at::Tensor generator_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_generator_state(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

GeneratorStates GeneratorStates::capture(const c10::Device& device) {
  GeneratorStates s;
  s.cpu = generator_state(at::detail::getDefaultCPUGenerator());
  if (device.is_cuda()) {
    s.cuda_device = device;
    s.cuda = generator_state(at::globalContext().defaultGenerator(device));
  }
  return s;
}

void GeneratorStates::restore() const {
  set_generator_state(at::detail::getDefaultCPUGenerator(), cpu);
  if (cuda.defined()) set_generator_state(at::globalContext().defaultGenerator(cuda_device), cuda);
}

}  // namespace trainer
