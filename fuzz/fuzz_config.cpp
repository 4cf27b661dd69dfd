// YAML configs (trainer/config/config.h): apply_yaml_text and validate throw ConfigError for anything they do not
// accept. What is accepted must survive the round trip through to_yaml (resolved_config.yaml and a
// checkpoint's config.yaml are read back on resume): reading it again gives the same tree.
#include "fuzz_util.h"
#include "trainer/config/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  trainer::Config cfg;
  bool applied = false;
  fuzz::expect_only<trainer::ConfigError>("apply_yaml_text", [&] {
    trainer::apply_yaml_text(cfg, text, "<fuzz>");
    applied = true;
  });
  if (!applied) return 0;
  fuzz::expect_only<trainer::ConfigError>("validate", [&] { trainer::validate(cfg); });
  const std::string yaml = trainer::to_yaml(cfg);
  trainer::Config again;
  fuzz::expect_only<trainer::ConfigError>("apply_yaml_text(to_yaml(cfg))", [&] {
    trainer::apply_yaml_text(again, yaml, "<round trip>");
    if (trainer::to_yaml(again) != yaml) {
      std::fprintf(stderr, "FINDING: to_yaml does not read back the same:\n%s\n---\n%s\n", yaml.c_str(),
                   trainer::to_yaml(again).c_str());
      std::abort();
    }
  });
  return 0;
}
