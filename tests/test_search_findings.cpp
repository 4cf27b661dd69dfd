// auto_search.json (trainer/step/search_findings.h): what the auto search found, kept as it goes and
// read back by the restart; only under the same conditions, and a file that is not what it writes is
// set aside with one line, never an error.
#include <gtest/gtest.h>

#include "test_util.h"
#include "trainer/step/search_findings.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_search_findings {

using nlohmann::json;
using testutil::TempDir;

namespace {

json conditions(int64_t limit, bool checkpointing) {
  return {{"config", "model:\n  name: resnet20\n"}, {"limit", limit}, {"checkpointing", checkpointing}};
}

}  // namespace

TEST(SearchFindings, WhatIsRecordedIsReadBackUnderTheSameConditionsOnly) {
  TempDir dir;
  const std::string path = (dir / "auto_search.json").string();
  {
    trainer::SearchFindings f(path);
    EXPECT_TRUE(f.problem().empty());
    EXPECT_TRUE(f.known(conditions(100, false)).empty());
    f.record(conditions(100, false), 1, {true, 10});
    f.record(conditions(100, false), 8, {false, 0});
    f.record(conditions(100, true), 8, {true, 60});  // the second search of checkpointing auto
  }
  trainer::SearchFindings back(path);
  EXPECT_TRUE(back.problem().empty());
  const auto off = back.known(conditions(100, false));
  ASSERT_EQ(off.size(), 2u);
  EXPECT_TRUE(off.at(1).fits);
  EXPECT_EQ(off.at(1).peak_bytes, 10);
  EXPECT_FALSE(off.at(8).fits);
  const auto on = back.known(conditions(100, true));
  ASSERT_EQ(on.size(), 1u);
  EXPECT_EQ(on.at(8).peak_bytes, 60);
  EXPECT_TRUE(back.known(conditions(200, false)).empty());
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

  // A search under other conditions replaces every search of the old ones.
  back.record(conditions(200, false), 4, {true, 40});
  trainer::SearchFindings again(path);
  EXPECT_TRUE(again.known(conditions(100, false)).empty());
  EXPECT_TRUE(again.known(conditions(100, true)).empty());
  EXPECT_EQ(again.known(conditions(200, false)).size(), 1u);
  EXPECT_EQ(again.json()["searches"].size(), 1u);
}

TEST(SearchFindings, AFileThatIsNotItsOwnIsSetAsideWithOneLine) {
  TempDir dir;
  const std::string path = (dir / "auto_search.json").string();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"searches\": [", "parse error"},
      {"[1, 2]", "not an object with a \"searches\" list"},
      {"{\"searches\": [{\"probes\": []}]}", "a search without \"conditions\" and a \"probes\" list"},
      {"{\"searches\": [{\"conditions\": {}, \"probes\": [{\"micro_batch\": 0, \"fits\": true, \"peak_bytes\": 1}]}]}",
       "a probe without a micro_batch >= 1, fits and peak_bytes >= 0"},
      {"{\"searches\": [{\"conditions\": {}, \"probes\": [{\"micro_batch\": 2, \"fits\": \"yes\", \"peak_bytes\": 1}]}]}",
       "a probe without a micro_batch >= 1, fits and peak_bytes >= 0"},
      {"{\"searches\": [{\"conditions\": {}, \"probes\": [{\"micro_batch\": 2, \"fits\": true, \"peak_bytes\": -5}]}]}",
       "a probe without a micro_batch >= 1, fits and peak_bytes >= 0"},
  };
  for (const auto& [text, why] : cases) {
    SCOPED_TRACE(text);
    testutil::write_file(path, text);
    trainer::SearchFindings f(path);
    EXPECT_EQ(f.problem().rfind(path + ": set aside, the search starts afresh (", 0), 0u) << f.problem();
    EXPECT_NE(f.problem().find(why), std::string::npos) << f.problem();
    EXPECT_EQ(f.problem().find('\n'), std::string::npos);
    EXPECT_TRUE(f.known(json::object()).empty());
    f.record(conditions(1, false), 2, {true, 3});  // and the next probe replaces it
    EXPECT_TRUE(f.problem().empty());
    EXPECT_EQ(trainer::SearchFindings(path).known(conditions(1, false)).size(), 1u);
  }
}

TEST(SearchFindings, AFileThatCannotBeWrittenIsOneErrorNamingIt) {
  TempDir dir;
  testutil::write_file(dir / "not_a_folder", "x");  // unwritable for root too: its "folder" is a file
  const std::string path = (dir / "not_a_folder" / "auto_search.json").string();
  trainer::SearchFindings f(path);
  EXPECT_TRUE(f.problem().empty());
  const std::string e = testutil::error_text([&] { f.record(conditions(1, false), 1, {true, 1}); });
  EXPECT_EQ(e.rfind(path + ": cannot write the auto search's findings: ", 0), 0u) << e;
}

}  // namespace test_search_findings
