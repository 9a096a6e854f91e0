// The learned timeouts agreed across nodes through the job's store (agent/hang_agree.h).
#include "agent/hang_agree.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "store/store.h"

namespace trun::agent::hang {

bool class_from_name(const std::string& name, TimeoutClass* out) {
  static const std::string kSectionPrefix = "section ";
  TimeoutClass c;
  if (name == "startup") {
    c.kind = TimeoutClass::kStartup;
  } else if (name == "step") {
    c.kind = TimeoutClass::kStep;
  } else if (name == "checkpoint") {
    c.kind = TimeoutClass::kCheckpoint;
  } else if (name.size() > kSectionPrefix.size() &&
             name.compare(0, kSectionPrefix.size(), kSectionPrefix) == 0) {
    c.kind = TimeoutClass::kSection;
    c.section = name.substr(kSectionPrefix.size());
  } else {
    return false;
  }
  *out = std::move(c);
  return true;
}

std::string encode_learned(const LearnedMap& learned) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [c, l] : learned) {
    j[c.name()] = {{"intervals", l.intervals}, {"longest_s", l.longest_s}};
  }
  // A section name is the worker's text: invalid UTF-8 is replaced rather than thrown.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

namespace {

int count_sections(const LearnedMap& m) {
  return static_cast<int>(std::count_if(
      m.begin(), m.end(), [](const auto& e) { return e.first.kind == TimeoutClass::kSection; }));
}

}  // namespace

LearnedMap decode_learned(const std::string& text) {
  LearnedMap out;
  int sections = 0;
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return out;
  for (const auto& [name, v] : j.items()) {
    TimeoutClass c;
    if (!class_from_name(name, &c) || !v.is_object()) continue;
    const auto intervals = v.find("intervals");
    const auto longest = v.find("longest_s");
    if (intervals == v.end() || longest == v.end() || !intervals->is_number_integer() ||
        !longest->is_number()) {
      continue;
    }
    const int64_t n = intervals->get<int64_t>();
    const double s = longest->get<double>();
    if (n < 0 || n > int64_t{1} << 40 || !std::isfinite(s) || s < 0) continue;
    if (c.kind == TimeoutClass::kSection && ++sections > kMaxLearnedSections) continue;
    out[c] = TimeoutRule::Learned{static_cast<int>(std::min<int64_t>(n, 1 << 30)), s};
  }
  return out;
}

LearnedMap merge_learned(LearnedMap a, const LearnedMap& b) {
  int sections = count_sections(a);
  for (const auto& [c, l] : b) {
    auto it = a.find(c);
    if (it == a.end()) {
      if (c.kind == TimeoutClass::kSection && sections >= kMaxLearnedSections) continue;
      if (c.kind == TimeoutClass::kSection) ++sections;
      it = a.emplace(c, TimeoutRule::Learned{}).first;
    }
    it->second.merge(l);
  }
  return a;
}

std::string learned_key(const std::string& run_id) { return "trun/hang_learned/" + run_id; }

LearnedMap agree_learned(store::Store& store, const std::string& key, const LearnedMap& local,
                         int max_tries) {
  // The record as read (raw: compare_set compares bytes), "" when there is none yet.
  std::string current = store.check({key}) ? store.get(key) : std::string();
  if (local.empty()) return decode_learned(current);  // nothing to add: a read
  for (int i = 0; i < max_tries; ++i) {
    const LearnedMap stored = decode_learned(current);
    const LearnedMap merged = merge_learned(stored, local);
    if (merged == stored && !current.empty()) return merged;  // nothing this node adds
    const std::string desired = encode_learned(merged);
    const std::string now = store.compare_set(key, current, desired);
    if (now == desired) return merged;
    current = now;  // another node wrote first: merge into its record
  }
  return merge_learned(decode_learned(current), local);
}

}  // namespace trun::agent::hang
