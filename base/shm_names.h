#pragma once
// Names of libtrun_worker's shared-memory segments, shared by the worker SDK (which creates them)
// and the agent (which removes the ones a dead worker left in /dev/shm). Header-only; both sides
// must apply the same rule, so it lives here, in a folder both already use.
//
// A segment is "/<stem>-<nonce>" where stem = shm_segment_stem(tag + ...) and the tag of a
// Worker's group is shm_group_tag(run id, restart, group) = "<run id>-r<restart>-pg<group>"
// (the CPU backend appends "-n<node>"). shm_segment_stem is "trun-" and the tag with characters
// outside [A-Za-z0-9._-] replaced by '_', cut at kShmStemMaxTag characters. Every segment of a
// run therefore starts with shm_run_prefix(run id) = shm_segment_stem(run id + "-r"), however
// long the run id is. (A ProcessGroup built directly with another ProcessGroupOptions::tag is
// outside this rule, and the agent does not clean up after it.)

#include <string>
#include <string_view>

namespace trun::base {

inline constexpr size_t kShmStemMaxTag = 200;  // + "/trun-" + "-" + nonce stays under NAME_MAX

inline std::string shm_segment_stem(std::string_view tag) {
  std::string out = "trun-";
  for (char c : tag) {
    if (out.size() >= 5 + kShmStemMaxTag) break;
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_' || c == '.';
    out.push_back(ok ? c : '_');
  }
  return out;
}

// The ProcessGroupOptions::tag of group `group` (Worker::new_group's count) of restart
// `restart` of run `run_id`.
inline std::string shm_group_tag(std::string_view run_id, int restart, int group) {
  return std::string(run_id) + "-r" + std::to_string(restart) + "-pg" + std::to_string(group);
}

// What every named segment of a run starts with (no leading '/').
inline std::string shm_run_prefix(std::string_view run_id) {
  return shm_segment_stem(std::string(run_id) + "-r");
}

}  // namespace trun::base
