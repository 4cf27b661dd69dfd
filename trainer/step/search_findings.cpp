#include "trainer/step/search_findings.h"

#include "common/files.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace trainer {

namespace {

namespace fs = std::filesystem;

nlohmann::json empty_doc() { return {{"searches", nlohmann::json::array()}}; }

// Throws std::runtime_error saying what is wrong with the document's shape.
void check_shape(const nlohmann::json& doc) {
  if (!doc.is_object() || !doc.contains("searches") || !doc["searches"].is_array())
    throw std::runtime_error("not an object with a \"searches\" list");
  for (const auto& s : doc["searches"]) {
    if (!s.is_object() || !s.contains("conditions") || !s.contains("probes") || !s["probes"].is_array())
      throw std::runtime_error("a search without \"conditions\" and a \"probes\" list");
    for (const auto& p : s["probes"])
      if (!p.is_object() || !p.value("micro_batch", nlohmann::json()).is_number_integer() ||
          p["micro_batch"].get<int64_t>() < 1 || !p.value("fits", nlohmann::json()).is_boolean() ||
          !p.value("peak_bytes", nlohmann::json()).is_number_integer() || p["peak_bytes"].get<int64_t>() < 0)
        throw std::runtime_error("a probe without a micro_batch >= 1, fits and peak_bytes >= 0");
  }
}

}  // namespace

SearchFindings::SearchFindings(std::string path) : path_(std::move(path)), doc_(empty_doc()) {
  std::error_code ec;
  if (!fs::exists(path_, ec)) return;
  try {
    if (const auto kind = not_a_regular_file(path_); !kind.empty()) throw std::runtime_error(kind);
    std::ifstream in(path_);
    if (!in) throw std::runtime_error(std::string("cannot be read: ") + std::strerror(errno));
    nlohmann::json doc = nlohmann::json::parse(in);
    check_shape(doc);
    doc_ = std::move(doc);
  } catch (const std::exception& e) {
    problem_ = path_ + ": set aside, the search starts afresh (" + e.what() + ")";
    doc_ = empty_doc();
  }
}

std::map<int64_t, ProbeOutcome> SearchFindings::known(const nlohmann::json& conditions) const {
  std::map<int64_t, ProbeOutcome> out;
  for (const auto& s : doc_["searches"])
    if (s["conditions"] == conditions)
      for (const auto& p : s["probes"])
        out[p["micro_batch"].get<int64_t>()] = {p["fits"].get<bool>(), p["peak_bytes"].get<int64_t>()};
  return out;
}

void SearchFindings::record(const nlohmann::json& conditions, int64_t micro_batch, const ProbeOutcome& outcome) {
  // The searches of this run: those under the conditions of another run (another limit, another config)
  // cannot be resumed any more. A run searches up to twice (memory.activation_checkpointing: auto), so a
  // search under the same config but the other checkpointing stays.
  nlohmann::json kept = nlohmann::json::array();
  nlohmann::json* mine = nullptr;
  for (auto& s : doc_["searches"]) {
    nlohmann::json a = s["conditions"], b = conditions;
    if (a.is_object() && b.is_object()) {
      a.erase("checkpointing");
      b.erase("checkpointing");
    }
    if (a == b) kept.push_back(s);
  }
  for (auto& s : kept)
    if (s["conditions"] == conditions) mine = &s;
  if (!mine) {
    kept.push_back({{"conditions", conditions}, {"probes", nlohmann::json::array()}});
    mine = &kept.back();
  }
  (*mine)["probes"].push_back({{"micro_batch", micro_batch}, {"fits", outcome.fits}, {"peak_bytes", outcome.peak_bytes}});
  doc_ = {{"searches", kept}};
  problem_.clear();

  const std::string tmp = path_ + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << doc_.dump(1) << '\n';
    out.flush();
    if (!out) throw std::runtime_error(path_ + ": cannot write the auto search's findings: " + std::strerror(errno));
  }
  std::error_code ec;
  fs::rename(tmp, path_, ec);
  if (ec) throw std::runtime_error(path_ + ": cannot write the auto search's findings: " + ec.message());
}

}  // namespace trainer
