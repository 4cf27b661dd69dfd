// Tests of trainer/state_dict.h (against Python's PyTorch), trainer/checkpoint.h (against real crashes,
// real write failures and hand-made corruption) and trainer/signals.h.
#include "trainer/checkpoint/store.h"
#include "common/compat.h"
#include "common/signals.h"
#include "trainer/checkpoint/state_dict.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <random>
#include <thread>

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_checkpoint {

namespace {

namespace fs = std::filesystem;
using testutil::TempDir;

// ==== StateDict ======================================================================================

/// Mirror of Net in tests/ref/state_dict_ref.py: a ResNet stem's reference names, a nested Sequential,
/// a conv without bias (an undefined tensor in LibTorch, absent from PyTorch's state_dict).
struct TinyNetImpl : torch::nn::Module {
  TinyNetImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3).padding(1).bias(false)))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(4))),
        layer1(register_module("layer1", torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 4, 1))))),
        fc(register_module("fc", torch::nn::Linear(4, 5))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(bn1(conv1(x)));
    x = layer1->forward(x);
    x = torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1);  // (B, 4)
    return fc(x);                                          // (B, 5)
  }
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Sequential layer1;
  torch::nn::Linear fc;
};
TORCH_MODULE(TinyNet);

const std::vector<std::string> kTinyNetKeys = {
    "conv1.weight",  "bn1.weight",     "bn1.bias",     "bn1.running_mean", "bn1.running_var",
    "bn1.num_batches_tracked", "layer1.0.weight", "layer1.0.bias", "fc.weight", "fc.bias"};

torch::Tensor fixed_input() {  // as in state_dict_ref.py
  return torch::arange(2 * 3 * 6 * 6, torch::kFloat32).reshape({2, 3, 6, 6}) / 100 - 1;
}

/// Gives every tensor of `m` distinct deterministic values (sin of a running index).
void fill_deterministic(torch::nn::Module& m) {
  torch::NoGradGuard g;
  double k = 0.5;
  for (auto& [name, t] : trainer::named_state(m)) {
    if (t.is_floating_point()) {
      t.copy_(torch::sin(torch::arange(t.numel(), torch::kDouble) * 0.37 + k).reshape(t.sizes()));
      if (name.find("running_var") != std::string::npos) t.abs_().add_(0.5);
    } else {
      t.fill_(7);
    }
    k += 1;
  }
}

/// A tensor as printed by state_dict_ref.py: dtype, shape and values.
struct PyTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<double> values;
};
struct PyDump {
  std::vector<std::pair<std::string, PyTensor>> tensors;
  std::vector<double> out;
};

PyDump parse_dump(const std::string& text) {
  PyDump d;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string tag;
    ls >> tag;
    std::vector<double>* vals = nullptr;
    if (tag == "T") {
      std::string name, shape;
      PyTensor t;
      ls >> name >> t.dtype >> shape;
      if (shape != "-") {
        std::istringstream ss(shape);
        std::string dim;
        while (std::getline(ss, dim, ',')) t.shape.push_back(std::stoll(dim));
      }
      d.tensors.emplace_back(name, t);
      vals = &d.tensors.back().second.values;
    } else if (tag == "OUT") {
      vals = &d.out;
    } else {
      continue;
    }
    std::string v;
    while (ls >> v) vals->push_back(std::strtod(v.c_str(), nullptr));  // float.hex() parses exactly
  }
  return d;
}

std::string dtype_name(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat: return "float32";
    case torch::kDouble: return "float64";
    case torch::kLong: return "int64";
    case torch::kHalf: return "float16";
    case torch::kBool: return "bool";
    default: return "other";
  }
}

/// Every tensor of `m` equals the Python dump bit for bit (as float32 where `as_float`).
void expect_equals_dump(const torch::nn::Module& m, const PyDump& d) {
  const auto own = trainer::named_state(m);
  ASSERT_EQ(own.size(), d.tensors.size());
  for (size_t i = 0; i < own.size(); ++i) {
    const auto& [name, t] = own[i];
    const auto& [pname, pt] = d.tensors[i];
    EXPECT_EQ(name, pname);
    EXPECT_EQ(t.sizes().vec(), pt.shape) << name;
    const auto flat = t.detach().to(torch::kDouble).reshape({-1});
    ASSERT_EQ(flat.numel(), static_cast<int64_t>(pt.values.size())) << name;
    for (int64_t j = 0; j < flat.numel(); ++j)
      ASSERT_EQ(flat[j].item<double>(), static_cast<double>(static_cast<float>(pt.values[j]))) << name << "[" << j << "]";
  }
}

void expect_output_matches(TinyNet& net, const std::vector<double>& ref) {
  net->eval();
  torch::NoGradGuard g;
  const auto out = net->forward(fixed_input()).reshape({-1}).to(torch::kDouble);
  ASSERT_EQ(out.numel(), static_cast<int64_t>(ref.size()));
  for (int64_t j = 0; j < out.numel(); ++j) EXPECT_NEAR(out[j].item<double>(), ref[j], 1e-5) << "output " << j;
}

std::string ref_script() { return testutil::source_dir() + "/tests/ref/state_dict_ref.py"; }

/// `f` throws std::runtime_error whose message contains every string in `parts`.
template <typename F>
void expect_throw_with(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected one containing '" << parts.front() << "'";
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

TEST(StateDict, NamedStateFollowsPyTorchOrder) {
  TinyNet net;
  std::vector<std::string> names;
  for (const auto& [k, t] : trainer::named_state(*net)) names.push_back(k);
  EXPECT_EQ(names, kTinyNetKeys);  // PyTorch's order for the same module, see state_dict_ref.py output
  // The tensors alias the module's: no copy.
  EXPECT_TRUE(trainer::named_state(*net)[0].second.is_same(net->conv1->weight));
}

TEST(StateDict, CppSavesPythonLoads) {
  TempDir tmp("sd_cpp2py");
  TinyNet net;
  fill_deterministic(*net);
  const std::string path = (tmp / "tiny.pt").string();
  trainer::save_state_dict(*net, path);
  const auto r = testutil::run(testutil::python() + " " + ref_script() + " check " + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const PyDump d = parse_dump(r.output);
  // Python strictly loaded it into its own Net (names, shapes), saw the same values and dtypes...
  expect_equals_dump(*net, d);
  for (size_t i = 0; i < d.tensors.size(); ++i)
    EXPECT_EQ(d.tensors[i].second.dtype, dtype_name(trainer::named_state(*net)[i].second)) << d.tensors[i].first;
  // ...and its forward pass equals ours.
  expect_output_matches(net, d.out);
  EXPECT_EQ(trainer::state_dict_bytes(*net).size(), fs::file_size(path));
}

/// Files written once by Python's torch.save for the tests below, and the values it printed.
class StateDictFromPython : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir("sd_py2cpp");
    const auto r = testutil::run(testutil::python() + " " + ref_script() + " write " + dir_->str());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    ref_ = new PyDump(parse_dump(r.output));
    ASSERT_EQ(ref_->tensors.size(), kTinyNetKeys.size());
  }
  static void TearDownTestSuite() {
    delete dir_;
    delete ref_;
  }
  static std::string file(const std::string& name) { return (*dir_ / name).string(); }
  static TempDir* dir_;
  static PyDump* ref_;
};
TempDir* StateDictFromPython::dir_ = nullptr;
PyDump* StateDictFromPython::ref_ = nullptr;

TEST_F(StateDictFromPython, LoadsModelStateDictExactly) {
  // torch.save(model.state_dict()): an OrderedDict, which LibTorch 1.13's pickle_load cannot read.
  TinyNet net;
  const auto res = trainer::load_state_dict(*net, file("net.pt"));
  EXPECT_TRUE(res.missing_keys.empty());
  EXPECT_TRUE(res.unexpected_keys.empty());
  expect_equals_dump(*net, *ref_);
  expect_output_matches(net, ref_->out);
  // The file's order is Python's; reading keeps it.
  const auto t = trainer::read_tensors(file("net.pt"));
  ASSERT_EQ(t.size(), kTinyNetKeys.size());
  for (size_t i = 0; i < t.size(); ++i) EXPECT_EQ(t[i].first, kTinyNetKeys[i]);
  EXPECT_EQ(t[5].second.scalar_type(), torch::kLong);
  EXPECT_EQ(t[5].second.dim(), 0);
}

TEST_F(StateDictFromPython, ConvertsDtypeToTheModules) {
  TinyNet net;
  const auto t = trainer::read_tensors(file("net_double.pt"));
  EXPECT_EQ(t[0].second.scalar_type(), torch::kDouble);
  trainer::load_state_dict(*net, file("net_double.pt"));
  EXPECT_EQ(net->conv1->weight.scalar_type(), torch::kFloat);
  expect_equals_dump(*net, *ref_);  // the doubles were floats to begin with: exact
}

TEST_F(StateDictFromPython, ParametersOnlyLoadNonStrictly) {
  TinyNet net;
  expect_throw_with([&] { trainer::load_state_dict(*net, file("params_only.pt")); },
                    {"load_state_dict: " + file("params_only.pt") + " does not match the module:",
                     "missing keys (in the module, not in the file): bn1.running_mean, bn1.running_var, "
                     "bn1.num_batches_tracked;",
                     "load non-strictly"});
  const auto res = trainer::load_state_dict(*net, file("params_only.pt"), /*strict=*/false);
  EXPECT_EQ(res.missing_keys, (std::vector<std::string>{"bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"}));
  EXPECT_TRUE(res.unexpected_keys.empty());
  EXPECT_TRUE(torch::equal(net->fc->weight, trainer::read_tensors(file("net.pt"))[8].second));
}

TEST_F(StateDictFromPython, RejectsWhatIsNotADictOfTensors) {
  TinyNet net;
  expect_throw_with([&] { trainer::load_state_dict(*net, file("list.pt")); },
                    {file("list.pt") + " holds a list, not a dict of tensors", "torch.save(model.state_dict(), path)"});
  expect_throw_with([&] { trainer::load_state_dict(*net, file("training_ckpt.pt")); },
                    {file("training_ckpt.pt") + " holds a dict whose value for 'epoch' is a int, not a tensor"});
  expect_throw_with([&] { trainer::load_state_dict(*net, file("legacy.pt")); },
                    {file("legacy.pt") + " is in the legacy (pre-1.6) torch.save format"});
  testutil::write_file(*dir_ / "text.pt", "hello");
  expect_throw_with([&] { trainer::read_tensors(file("text.pt")); }, {file("text.pt") + " is not a torch.save archive"});
  expect_throw_with([&] { trainer::read_tensors(file("absent.pt")); },
                    {"read_tensors: cannot open " + file("absent.pt") + ": No such file"});
  // A truncated archive is reported, not crashed on.
  const std::string bytes = testutil::read_file(*dir_ / "net.pt");
  expect_throw_with([&] { trainer::tensors_from_bytes(bytes.substr(0, bytes.size() / 2), "half.pt"); },
                    {"half.pt: cannot read the torch.save zip archive"});
}

TEST(StateDict, OneErrorListsEveryMismatchAndCopiesNothing) {
  TinyNet src, dst;
  fill_deterministic(*src);
  const auto before = dst->fc->weight.clone();
  trainer::NamedTensors t = trainer::named_state(*src);
  t.erase(t.end() - 1);                                       // fc.bias missing
  t.emplace_back("fc.extra", torch::zeros({3}));              // unexpected
  t[0].second = torch::zeros({4, 3, 5, 5});                   // conv1.weight mis-shaped
  t[8].second = torch::zeros({5, 2});                         // fc.weight mis-shaped
  expect_throw_with([&] { trainer::load_state_dict(*dst, t, true, "w.pt"); },
                    {"load_state_dict: w.pt does not match the module:",
                     "missing keys (in the module, not in the file): fc.bias;",
                     "unexpected keys (in the file, not in the module): fc.extra;",
                     "wrong shapes: conv1.weight (module [4, 3, 3, 3], file [4, 3, 5, 5]), "
                     "fc.weight (module [5, 4], file [5, 2]);"});
  EXPECT_TRUE(torch::equal(dst->fc->weight, before));
  // Non-strict skips missing and unexpected keys, but a wrong shape is still an error.
  expect_throw_with([&] { trainer::load_state_dict(*dst, t, false, "w.pt"); }, {"wrong shapes: conv1.weight"});
  t[0].second = src->conv1->weight.detach().clone();
  t[8].second = src->fc->weight.detach().clone();
  const auto res = trainer::load_state_dict(*dst, t, false, "w.pt");
  EXPECT_EQ(res.missing_keys, std::vector<std::string>{"fc.bias"});
  EXPECT_EQ(res.unexpected_keys, std::vector<std::string>{"fc.extra"});
  EXPECT_TRUE(torch::equal(dst->fc->weight, src->fc->weight));
  EXPECT_TRUE(torch::equal(dst->bn1->running_var, src->bn1->running_var));
}

TEST(StateDict, BytesRoundTripKeepsDtypesShapesAndViews) {
  auto big = torch::arange(1000, torch::kFloat32).reshape({10, 100});
  trainer::NamedTensors in = {
      {"transposed", torch::arange(6, torch::kFloat64).reshape({2, 3}).t()},
      {"slice", big.slice(1, 10, 12)},  // a small view of a large storage
      {"half", torch::tensor({1.5, -2.25}).to(torch::kHalf)},
      {"mask", torch::tensor({true, false, true})},
      {"count", torch::tensor(int64_t(42))},
      {"empty", torch::zeros({0, 3})}};
  const std::string bytes = trainer::tensors_to_bytes(in);
  // The slice is saved as its own 80 bytes, not the whole 4000-byte storage: same size as a copy.
  trainer::NamedTensors copied = in;
  copied[1].second = copied[1].second.clone();
  EXPECT_EQ(bytes.size(), trainer::tensors_to_bytes(copied).size());
  const auto out = trainer::tensors_from_bytes(bytes);
  ASSERT_EQ(out.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(out[i].first, in[i].first);
    EXPECT_EQ(out[i].second.scalar_type(), in[i].second.scalar_type()) << in[i].first;
    EXPECT_TRUE(torch::equal(out[i].second, in[i].second)) << in[i].first;
  }
  // Python reads the same names, dtypes, shapes and values.
  TempDir tmp("sd_dtypes");
  testutil::write_file(tmp / "t.pt", bytes);
  const auto r = testutil::run(testutil::python() + " " + ref_script() + " dump " + (tmp / "t.pt").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const PyDump d = parse_dump(r.output);
  ASSERT_EQ(d.tensors.size(), in.size()) << r.output;
  for (size_t i = 0; i < in.size(); ++i) {
    const auto& [name, pt] = d.tensors[i];
    EXPECT_EQ(name, in[i].first);
    EXPECT_EQ(pt.dtype, dtype_name(in[i].second)) << name;
    EXPECT_EQ(pt.shape, in[i].second.sizes().vec()) << name;
    const auto flat = in[i].second.to(torch::kDouble).reshape({-1});
    ASSERT_EQ(static_cast<int64_t>(pt.values.size()), flat.numel()) << name;
    for (int64_t j = 0; j < flat.numel(); ++j) EXPECT_EQ(pt.values[j], flat[j].item<double>()) << name << j;
  }
}

TEST(StateDict, OptimizerBytesResumeExactly) {
  // Two identical runs; one is "checkpointed" after 3 steps and resumed in a fresh optimizer.
  torch::manual_seed(1);
  torch::nn::Linear a(4, 3), b(4, 3);
  trainer::load_state_dict(*b, trainer::named_state(*a));
  torch::optim::Adam oa(a->parameters(), torch::optim::AdamOptions(0.1));
  torch::optim::Adam ob(b->parameters(), torch::optim::AdamOptions(0.1));
  auto x = torch::randn({8, 4});
  auto step = [&](torch::nn::Linear& m, torch::optim::Optimizer& o) {
    o.zero_grad();
    m(x).pow(2).sum().backward();
    o.step();
  };
  for (int i = 0; i < 3; ++i) step(a, oa), step(b, ob);
  const std::string saved = trainer::optimizer_bytes(ob);
  torch::optim::Adam ob2(b->parameters(), torch::optim::AdamOptions(0.1));
  trainer::load_optimizer_bytes(ob2, saved);
  for (int i = 0; i < 3; ++i) step(a, oa), step(b, ob2);
  EXPECT_TRUE(torch::equal(a->weight, b->weight));  // bit-identical: the Adam moments and step came back
  EXPECT_TRUE(torch::equal(a->bias, b->bias));
  expect_throw_with([&] { trainer::load_optimizer_bytes(ob2, "junk", "optim.pt"); },
                    {"load_optimizer_bytes: optim.pt does not fit this optimizer"});
}

// ==== Checkpoint store ===============================================================================

/// Deterministic pseudo-random bytes (splitmix64 of `seed`), so any process can recompute what a step
/// should contain.
std::string pattern(uint64_t seed, size_t n) {
  std::string s(n, '\0');
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; i += 8) {
    uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    std::memcpy(&s[i], &z, std::min<size_t>(8, n - i));
  }
  return s;
}

trainer::CheckpointFiles files_for(int64_t step, size_t size = 4096) {
  return {{"model.pt", pattern(step, size)},
          {"optim.pt", pattern(step + 1000000, size / 2)},
          {"state.json", "{\"step\": " + std::to_string(step) + "}\n"}};
}

std::string folder(const TempDir& run, int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return (run / "checkpoints" / buf).string();
}

std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

void flip_byte(const std::string& path, size_t at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  char c;
  f.get(c);
  f.seekp(static_cast<std::streamoff>(at));
  f.put(static_cast<char>(c ^ 0x01));
}

TEST(CheckpointStore, SaveLoadRoundTripWithManifest) {
  TempDir run("ck_roundtrip");
  trainer::CheckpointStore store(run.str(), 3, "cpu");
  EXPECT_FALSE(store.load_latest().has_value());  // a fresh run
  store.check_writable();
  auto files = files_for(10);
  files["check.bin"] = "123456789";  // CRC-32's published check value is cbf43926
  const std::string path = store.save(10, files, {{"epoch", 2}, {"rng", "abc"}});
  EXPECT_EQ(path, folder(run, 10));
  EXPECT_EQ(testutil::read_file(run / "checkpoints" / "latest"), "step-00000010\n");
  EXPECT_EQ(entries(run / "checkpoints"), (std::vector<std::string>{"latest", "step-00000010"}));
  EXPECT_EQ(entries(path), (std::vector<std::string>{"check.bin", "manifest.json", "model.pt", "optim.pt", "state.json"}));

  const auto c = store.load_latest();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->step, 10);
  EXPECT_EQ(c->path, path);
  EXPECT_EQ(c->files, files);
  EXPECT_TRUE(c->warnings.empty());
  const auto& m = c->manifest;
  EXPECT_EQ(m["format_version"], trainer::CheckpointStore::kFormatVersion);
  EXPECT_EQ(m["step"], 10);
  EXPECT_EQ(m["libtorch_version"], trainer::compat::torch_version());
  EXPECT_EQ(m["device"], "cpu");
  EXPECT_EQ(m["checksum"], "crc32");
  EXPECT_EQ(m["extra"]["epoch"], 2);
  EXPECT_EQ(m["files"]["check.bin"]["crc32"], "cbf43926");
  EXPECT_EQ(m["files"]["model.pt"]["size"], 4096);
  char crc[16];
  std::snprintf(crc, sizeof crc, "%08lx",
                crc32(0, reinterpret_cast<const Bytef*>(files["model.pt"].data()), files["model.pt"].size()));
  EXPECT_EQ(m["files"]["model.pt"]["crc32"], crc);
  EXPECT_EQ(c->file("state.json"), "{\"step\": 10}\n");
  expect_throw_with([&] { c->file("nope.pt"); }, {"checkpoint " + path + " has no file nope.pt"});

  const auto l = store.list();
  ASSERT_EQ(l.size(), 1u);
  EXPECT_EQ(l[0].step, 10);
  EXPECT_EQ(l[0].bytes, 4096u + 2048u + files["state.json"].size() + 9u);
}

TEST(CheckpointStore, BadFileNamesAreRejected) {
  TempDir run("ck_names");
  trainer::CheckpointStore store(run.str(), 3);
  expect_throw_with([&] { store.save(1, {{"manifest.json", "x"}}); }, {"bad file name 'manifest.json'"});
  expect_throw_with([&] { store.save(1, {{"a/b", "x"}}); }, {"bad file name 'a/b'"});
  expect_throw_with([&] { store.save(-1, {}); }, {"step must be >= 0, got -1"});
  expect_throw_with([] { trainer::CheckpointStore("x", -1); }, {"keep_last must be >= 0"});
}

/// Two checkpoints (steps 1 and 2), then `damage` applied to step 2: load_latest must return step 1 with a
/// warning that names step 2 and contains `reason`.
void expect_fallback(const std::function<void(const std::string&)>& damage, const std::string& reason) {
  TempDir run("ck_fallback");
  trainer::CheckpointStore store(run.str(), 5);
  store.save(1, files_for(1));
  store.save(2, files_for(2));
  damage(folder(run, 2));
  const auto c = store.load_latest();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->step, 1);
  EXPECT_EQ(c->files, files_for(1));
  ASSERT_EQ(c->warnings.size(), 1u);
  EXPECT_NE(c->warnings[0].find("checkpoint " + folder(run, 2) + " is unusable: " + reason), std::string::npos)
      << c->warnings[0];
  // --resume of that exact checkpoint fails instead of falling back, with the same reason.
  expect_throw_with([&] { trainer::CheckpointStore::load(folder(run, 2)); },
                    {"cannot resume from checkpoint " + folder(run, 2) + ": " + reason});
  // So does --resume of the run folder, which follows `latest`.
  expect_throw_with([&] { trainer::CheckpointStore::load(run.str()); }, {folder(run, 2) + ": " + reason});
  EXPECT_EQ(trainer::CheckpointStore::load(folder(run, 1)).files, files_for(1));
  EXPECT_EQ(store.list().size(), 1u);
}

TEST(CheckpointStore, FlippedByteFallsBackToPrevious) {
  expect_fallback([](const std::string& d) { flip_byte(d + "/model.pt", 1234); }, "model.pt is corrupt (CRC32 ");
}

TEST(CheckpointStore, TruncatedFileFallsBackToPrevious) {
  expect_fallback([](const std::string& d) { fs::resize_file(d + "/optim.pt", 1000); },
                  "optim.pt has 1000 bytes, the manifest says 2048 (truncated?)");
}

TEST(CheckpointStore, MissingFileFallsBackToPrevious) {
  expect_fallback([](const std::string& d) { fs::remove(d + "/state.json"); }, "state.json is missing");
  expect_fallback([](const std::string& d) { fs::remove(d + "/manifest.json"); }, "manifest.json is missing");
}

TEST(CheckpointStore, OtherFormatVersionFallsBackToPrevious) {
  expect_fallback(
      [](const std::string& d) {
        auto m = nlohmann::json::parse(testutil::read_file(d + "/manifest.json"));
        m["format_version"] = 2;
        testutil::write_file(d + "/manifest.json", m.dump());
      },
      "format_version 2 is not supported (this build reads 1)");
}

TEST(CheckpointStore, CheckpointTheCallerRejectsFallsBackToPrevious) {
  // CRC-valid files the caller cannot use (a file it needs is not there): the same fallback as for a
  // corrupt checkpoint, and the same refusal for --resume of exactly that one.
  TempDir run("ck_check");
  trainer::CheckpointStore store(run.str(), 5);
  store.save(1, files_for(1));
  auto incomplete = files_for(2);
  incomplete.erase("state.json");
  store.save(2, incomplete);
  const trainer::CheckpointCheck check = [](const trainer::LoadedCheckpoint& c) {
    return c.files.count("state.json") ? std::string() : std::string("state.json is missing (an incomplete checkpoint)");
  };
  EXPECT_EQ(store.load_latest()->step, 2) << "without a check, the store has no reason to skip it";
  const auto c = store.load_latest(check);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->step, 1);
  EXPECT_EQ(c->files, files_for(1));
  ASSERT_EQ(c->warnings.size(), 1u);
  EXPECT_NE(c->warnings[0].find("checkpoint " + folder(run, 2) + " is unusable: state.json is missing (an incomplete "
                                "checkpoint); falling back"),
            std::string::npos)
      << c->warnings[0];
  expect_throw_with([&] { trainer::CheckpointStore::load(folder(run, 2), check); },
                    {"cannot resume from checkpoint " + folder(run, 2) + ": state.json is missing"});
  EXPECT_EQ(trainer::CheckpointStore::load(folder(run, 1), check).step, 1);
  // When the check rejects every checkpoint, that is an error naming each, not a fresh start.
  expect_throw_with([&] { store.load_latest([](const trainer::LoadedCheckpoint&) { return std::string("no"); }); },
                    {"no valid checkpoint in ", "step-00000002: no", "step-00000001: no"});
}

TEST(CheckpointStore, DanglingOrGarbledLatestFallsBack) {
  TempDir run("ck_latest");
  trainer::CheckpointStore store(run.str(), 5);
  store.save(1, files_for(1));
  store.save(2, files_for(2));
  fs::remove_all(folder(run, 2));
  auto c = store.load_latest();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->step, 1);
  ASSERT_EQ(c->warnings.size(), 1u);
  EXPECT_NE(c->warnings[0].find("`latest` names " + folder(run, 2) + ", which does not exist"), std::string::npos);

  testutil::write_file(run / "checkpoints" / "latest", "garbage");
  c = store.load_latest();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->step, 1);
  EXPECT_NE(c->warnings.at(0).find("does not name a checkpoint ('garbage')"), std::string::npos);
}

TEST(CheckpointStore, NoValidCheckpointIsAnErrorNotAFreshStart) {
  TempDir run("ck_allbad");
  trainer::CheckpointStore store(run.str(), 5);
  store.save(7, files_for(7));
  flip_byte(folder(run, 7) + "/optim.pt", 3);
  expect_throw_with([&] { store.load_latest(); },
                    {"no valid checkpoint in " + (run / "checkpoints").string(), "step-00000007: optim.pt is corrupt",
                     "move the folder away to start from scratch"});
  expect_throw_with([&] { trainer::CheckpointStore::load((run / "nothing").string()); },
                    {"cannot resume from " + (run / "nothing").string() + ": it does not exist"});
  expect_throw_with([&] { trainer::CheckpointStore::load(run.str() + "/checkpoints/step-00000007/model.pt"); },
                    {"not a checkpoint folder (no manifest.json)"});
}

TEST(CheckpointStore, KeepLastKeepsExactlyTheNewestValid) {
  TempDir run("ck_keep");
  trainer::CheckpointStore store(run.str(), 3);
  for (int s = 1; s <= 6; ++s) store.save(s * 100, files_for(s));
  EXPECT_EQ(entries(run / "checkpoints"),
            (std::vector<std::string>{"latest", "step-00000400", "step-00000500", "step-00000600"}));
  // A damaged checkpoint does not count as one of the kept ones.
  fs::resize_file(folder(run, 500) + "/model.pt", 10);
  store.save(700, files_for(7));
  EXPECT_EQ(entries(run / "checkpoints"),
            (std::vector<std::string>{"latest", "step-00000400", "step-00000600", "step-00000700"}));
  // keep_last 0 keeps everything.
  trainer::CheckpointStore all(run.str(), 0);
  all.save(800, files_for(8));
  all.save(900, files_for(9));
  EXPECT_EQ(entries(run / "checkpoints").size(), 6u);
}

TEST(CheckpointStore, SavingTheSameStepAgainReplacesIt) {
  TempDir run("ck_same");
  trainer::CheckpointStore store(run.str(), 2);
  store.save(5, files_for(1));
  store.save(5, files_for(2));
  EXPECT_EQ(store.load_latest()->files, files_for(2));
  EXPECT_EQ(entries(run / "checkpoints"), (std::vector<std::string>{"latest", "step-00000005"}));
}

TEST(CheckpointStore, StaleTemporariesAreCleanedAtStartup) {
  TempDir run("ck_stale");
  {
    trainer::CheckpointStore store(run.str(), 2);
    store.save(3, files_for(3));
  }
  fs::create_directories(run / "checkpoints" / ".tmp-step-00000004-12345");
  testutil::write_file(run / "checkpoints" / ".tmp-step-00000004-12345" / "model.pt", "partial");
  testutil::write_file(run / "checkpoints" / ".latest.tmp-777", "step-00000004");
  trainer::CheckpointStore store(run.str(), 2);
  EXPECT_EQ(entries(run / "checkpoints"), (std::vector<std::string>{"latest", "step-00000003"}));
  EXPECT_EQ(store.load_latest()->step, 3);
}

TEST(CheckpointStore, UnwritableRunFolderFailsBeforeTraining) {
  // chmod does not stop root; a path under a regular file fails for everyone.
  TempDir tmp("ck_unwritable");
  testutil::write_file(tmp / "afile", "x");
  const std::string run = (tmp / "afile" / "run").string();
  trainer::CheckpointStore store(run, 2);
  expect_throw_with([&] { store.check_writable(); },
                    {"checkpoint folder " + run + "/checkpoints cannot be created: Not a directory (ENOTDIR)",
                     "choose a writable run folder"});
  expect_throw_with([&] { store.save(1, files_for(1)); },
                    {"checkpoint save of step 1 failed: cannot create " + run + "/checkpoints: Not a directory (ENOTDIR)"});
}

/// Runs `child` in a forked process; returns what it wrote to the pipe and its wait status.
std::pair<std::string, int> in_child(const std::function<void(int fd)>& child) {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    child(fds[1]);
    _exit(0);
  }
  close(fds[1]);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return {out, status};
}

TEST(CheckpointStore, WriteFailureLeavesPreviousIntact) {
  TempDir run("ck_efbig");
  trainer::CheckpointStore store(run.str(), 2);
  store.save(1, files_for(1));
  // A real write failure: the child may not write files over 1 MiB, so write() returns EFBIG.
  const auto [msg, status] = in_child([&](int fd) {
    struct rlimit lim = {1 << 20, 1 << 20};
    setrlimit(RLIMIT_FSIZE, &lim);
    signal(SIGXFSZ, SIG_IGN);
    trainer::CheckpointStore child_store(run.str(), 2);
    try {
      child_store.save(2, files_for(2, 4 << 20));
      (void)!write(fd, "saved", 5);
    } catch (const std::exception& e) {
      (void)!write(fd, e.what(), strlen(e.what()));
    }
  });
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_NE(msg.find("checkpoint save of step 2 failed: cannot write "), std::string::npos) << msg;
  EXPECT_NE(msg.find("model.pt: File too large (EFBIG); the previous checkpoints and `latest` are untouched"),
            std::string::npos)
      << msg;
  EXPECT_EQ(entries(run / "checkpoints"), (std::vector<std::string>{"latest", "step-00000001"}));  // temp removed
  const auto c = store.load_latest();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->step, 1);
  EXPECT_TRUE(c->warnings.empty());
  EXPECT_EQ(c->files, files_for(1));
}

TEST(CheckpointStore, SigkillAtAnyMomentLeavesAValidCheckpoint) {
  // A child saves 3 MiB checkpoints in a loop, resuming where the last valid one left off, and is
  // SIGKILLed at random moments; after every kill the parent must load a complete checkpoint with the
  // exact bytes of its step. (A kill leaves the page cache intact: power loss is not simulated.)
  TempDir run("ck_sigkill");
  {
    trainer::CheckpointStore store(run.str(), 2);
    store.save(0, files_for(0, 2 << 20));
  }
  std::mt19937 rng(1234);
  int64_t step = 0;
  int killed_mid_write = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (int round = 0; round < 12 && std::chrono::steady_clock::now() < deadline; ++round) {
    const int64_t start = step + 1;
    const pid_t pid = fork();
    if (pid == 0) {
      try {
        trainer::CheckpointStore store(run.str(), 2);
        for (int64_t s = start;; ++s) store.save(s, files_for(s, 2 << 20));
      } catch (...) {
        _exit(3);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(5, 120)(rng)));
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "the child died on its own: " << status;
    for (const auto& e : fs::directory_iterator(run / "checkpoints"))
      if (e.path().filename().string().rfind(".tmp-", 0) == 0) ++killed_mid_write;

    trainer::CheckpointStore store(run.str(), 2);  // cleans the temporaries
    const auto c = store.load_latest();
    ASSERT_TRUE(c.has_value());
    EXPECT_TRUE(c->warnings.empty()) << c->warnings.front();
    EXPECT_GE(c->step, step);
    EXPECT_TRUE(c->files == files_for(c->step, 2 << 20)) << "round " << round << " step " << c->step;
    for (const auto& e : fs::directory_iterator(run / "checkpoints"))
      EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u) << e.path();
    step = c->step;
  }
  EXPECT_GT(step, 0) << "the child never completed a save";
  EXPECT_GT(killed_mid_write, 0) << "no kill landed during a write; the test proved little";
}

TEST(CheckpointStore, BackgroundSaveEqualsForegroundByteForByte) {
  TempDir a("ck_fg"), b("ck_bg");
  trainer::CheckpointStore fg(a.str(), 2), bg(b.str(), 2);
  const auto files = files_for(42, 1 << 20);
  fg.save(42, files, {{"epoch", 1}});
  bg.save_async(42, files, {{"epoch", 1}});
  bg.save_async(43, files_for(43), {});  // waits for the first, then runs in the background
  bg.wait();
  EXPECT_FALSE(bg.in_flight());
  for (const auto& [name, bytes] : files) {
    EXPECT_EQ(testutil::read_file(fs::path(folder(b, 42)) / name), testutil::read_file(fs::path(folder(a, 42)) / name));
  }
  auto ma = nlohmann::json::parse(testutil::read_file(fs::path(folder(a, 42)) / "manifest.json"));
  auto mb = nlohmann::json::parse(testutil::read_file(fs::path(folder(b, 42)) / "manifest.json"));
  for (auto* m : {&ma, &mb}) m->erase("created"), m->erase("created_unix");
  EXPECT_EQ(ma, mb);
  EXPECT_EQ(bg.load_latest()->step, 43);
}

TEST(CheckpointStore, BackgroundFailureIsReportedOnceAndDoesNotBlockTheNextSave) {
  TempDir run("ck_bgerr");
  trainer::CheckpointStore store(run.str(), 2);
  store.save(1, files_for(1));
  fs::create_directories(folder(run, 2));
  testutil::Immutable stuck(folder(run, 2));  // a real EPERM: the save of step 2 cannot replace it
  if (!stuck.ok()) GTEST_SKIP() << "chattr +i is not available here";
  EXPECT_FALSE(store.take_outcome());  // foreground saves report by throwing
  store.save_async(2, files_for(2));  // returns at once; the failure happens on the worker
  store.wait();
  auto o = store.take_outcome();
  ASSERT_TRUE(o.has_value());
  EXPECT_FALSE(o->ok());
  EXPECT_EQ(o->step, 2);
  EXPECT_EQ(o->path, "");
  EXPECT_NE(o->error.find("checkpoint save of step 2 failed: cannot replace " + folder(run, 2)), std::string::npos)
      << o->error;
  EXPECT_NE(o->error.find("(EPERM)"), std::string::npos) << o->error;
  EXPECT_FALSE(store.take_outcome());  // reported once
  // The next save is tried (it used to rethrow the failure instead of saving) and succeeds.
  store.save_async(3, files_for(3));
  store.wait();
  o = store.take_outcome();
  ASSERT_TRUE(o.has_value());
  EXPECT_TRUE(o->ok()) << o->error;
  EXPECT_EQ(o->path, folder(run, 3));
  EXPECT_EQ(store.load_latest()->step, 3);
}

TEST(CheckpointStore, RetryOfAStepWritesAFreshFolder) {
  TempDir run("ck_retry");
  trainer::CheckpointStore store(run.str(), 2);
  store.save(1, files_for(1));
  fs::create_directories(folder(run, 2));
  testutil::Immutable stuck(folder(run, 2));
  if (!stuck.ok()) GTEST_SKIP() << "chattr +i is not available here";
  expect_throw_with([&] { store.save(2, files_for(2)); }, {"cannot replace " + folder(run, 2), "(EPERM)"});
  EXPECT_EQ(store.save(2, files_for(2), {}, 1), folder(run, 2) + "-r1");
  EXPECT_EQ(testutil::read_file(run / "checkpoints" / "latest"), "step-00000002-r1\n");
  auto c = store.load_latest();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->step, 2);
  EXPECT_EQ(c->path, folder(run, 2) + "-r1");
  EXPECT_EQ(c->files, files_for(2));
  // Without `latest`, a retry folder counts as the newest of its step.
  fs::remove(run / "checkpoints" / "latest");
  EXPECT_EQ(store.load_latest()->path, folder(run, 2) + "-r1");
  // The next step prunes around the folder it cannot remove, keeping the retry.
  store.save(3, files_for(3));
  std::vector<int64_t> steps;
  for (const auto& i : store.list()) steps.push_back(i.step);
  EXPECT_EQ(steps, (std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(fs::exists(folder(run, 2) + "-r1"));
  EXPECT_FALSE(fs::exists(folder(run, 1)));
}

// ==== Signals ========================================================================================

TEST(CheckpointSignals, HandlersOnlySetFlags) {
  trainer::install_signal_handlers();
  EXPECT_FALSE(trainer::stop_requested());
  EXPECT_FALSE(trainer::take_checkpoint_request());
  raise(SIGUSR1);
  EXPECT_TRUE(trainer::take_checkpoint_request());
  EXPECT_FALSE(trainer::take_checkpoint_request());  // taking clears it
  EXPECT_FALSE(trainer::stop_requested());
  raise(SIGUSR2);
  EXPECT_TRUE(trainer::take_memory_report_request());
  EXPECT_FALSE(trainer::take_memory_report_request());
  raise(SIGTERM);
  EXPECT_TRUE(trainer::stop_requested());
  EXPECT_EQ(trainer::stop_signal(), SIGTERM);
  EXPECT_EQ(trainer::exit_code_for_signal(trainer::stop_signal()), trainer::kExitStoppedBySigterm);
  EXPECT_EQ(trainer::kExitStoppedBySigterm, 143);  // what `kill` and shells report for SIGTERM
  EXPECT_EQ(trainer::kExitStoppedBySigint, 130);
  raise(SIGINT);  // a later stop signal does not replace the first
  EXPECT_EQ(trainer::stop_signal(), SIGTERM);
  struct sigaction now;
  sigaction(SIGINT, nullptr, &now);
  EXPECT_EQ(now.sa_handler, SIG_DFL);  // the next Ctrl-C force-quits
  trainer::restore_signal_handlers();
  EXPECT_FALSE(trainer::stop_requested());
  sigaction(SIGTERM, nullptr, &now);
  EXPECT_EQ(now.sa_handler, SIG_DFL);  // gtest's own (default) action is back
}

TEST(CheckpointSignals, SecondSigintKills) {
  const auto [out, status] = in_child([](int fd) {
    trainer::install_signal_handlers();
    raise(SIGINT);
    (void)!write(fd, trainer::stop_signal() == SIGINT ? "stop" : "none", 4);
    raise(SIGINT);
    (void)!write(fd, "survived", 8);
  });
  EXPECT_EQ(out, "stop");
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGINT) << status;
}

TEST(CheckpointSignals, ExitCodesAreDistinct) {
  const std::vector<int> codes = {trainer::kExitOk, trainer::kExitError, trainer::kExitBadInput,
                                  trainer::kExitOomGaveUp, trainer::kExitCheckpointFailed,
                                  trainer::kExitStoppedBySigint, trainer::kExitStoppedBySigterm};
  EXPECT_EQ(std::set<int>(codes.begin(), codes.end()).size(), codes.size());
  EXPECT_EQ(trainer::kExitBadInput, 2);
}

}  // namespace

}  // namespace test_checkpoint
