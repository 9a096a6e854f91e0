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

// The number n of a tag made by shm_group_tag (its "-pg<n>" suffix), or -1 for another tag.
inline int shm_group_number(std::string_view tag) {
  const size_t at = tag.rfind("-pg");
  if (at == std::string_view::npos || at + 3 == tag.size() || tag.size() - at - 3 > 9) return -1;
  int n = 0;
  for (size_t i = at + 3; i < tag.size(); ++i) {
    if (tag[i] < '0' || tag[i] > '9') return -1;
    n = n * 10 + (tag[i] - '0');
  }
  return n;
}

// The progress board of one agent (base/progress_board.h, agent/progress_monitor.h), without
// the leading '/': shm_segment_stem("progress-<agent pid>-<run id>"). It is outside
// shm_run_prefix's rule on purpose: the agent creates and unlinks it itself, and removing what
// dead workers left must not remove it.
inline std::string shm_progress_name(std::string_view run_id, long agent_pid) {
  return shm_segment_stem("progress-" + std::to_string(agent_pid) + "-" + std::string(run_id));
}

// What every named segment of a run starts with (no leading '/').
inline std::string shm_run_prefix(std::string_view run_id) {
  return shm_segment_stem(std::string(run_id) + "-r");
}

}  // namespace trun::base
