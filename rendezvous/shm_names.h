#pragma once
// Names of libtrun_worker's shared-memory segments, shared by the worker SDK (which creates them)
// and the agent (which removes the ones a dead worker left in /dev/shm). Header-only; both sides
// must apply the same rule, so it lives here, in a folder both already use.
//
// A segment is "/<stem>-<nonce>" where stem = shm_segment_stem(run id + "-r" + restart + ...):
// "trun-" and the tag with characters outside [A-Za-z0-9._-] replaced by '_', cut at
// kShmStemMaxTag characters. Every segment of a run therefore starts with
// shm_segment_stem(run_id + "-r"), however long the run id is.

#include <string>
#include <string_view>

namespace trun::rendezvous {

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

// What every named segment of a run starts with (no leading '/').
inline std::string shm_run_prefix(std::string_view run_id) {
  return shm_segment_stem(std::string(run_id) + "-r");
}

}  // namespace trun::rendezvous
