// The test process's own computations run on one intra-op thread, and so do the Python references it
// starts (OMP_NUM_THREADS=1 in their environment). CTest runs two suites at a time on the 2-core machines
// CI uses: two processes of two OpenMP threads each then share two cores, and a thread that reaches a
// barrier spins while the one it waits for cannot run. LibTorch 2.11's default (a thread per core) made
// TransformerLearning.TinyGptBeatsTheUnigramEntropyOnFortunes take 36.5 s beside a build instead of 2-4 s;
// Debian's LibTorch 1.13 starts with one thread already. The trainer processes a test starts set their own
// count (train.threads), as they do for a user.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <string>

namespace test_environment {

class OneIntraOpThread : public ::testing::Environment {
 public:
  void SetUp() override {
    setenv("OMP_NUM_THREADS", "1", /*overwrite=*/1);  // the Python references the tests start
    at::set_num_threads(1);
  }
};

const ::testing::Environment* const kOneIntraOpThread = ::testing::AddGlobalTestEnvironment(new OneIntraOpThread);

TEST(TestProcess, ComputesOnOneIntraOpThreadAndSoDoItsPythonReferences) {
  EXPECT_EQ(at::get_num_threads(), 1);
  const char* omp = std::getenv("OMP_NUM_THREADS");
  ASSERT_NE(omp, nullptr);
  EXPECT_EQ(std::string(omp), "1");
}

}  // namespace test_environment
