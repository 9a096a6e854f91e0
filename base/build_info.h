#pragma once
// What this build of trun is: the version (CMakeLists.txt's project() is its one place), the git
// commit it was built from, and the features compiled in. `trun --version`, libtrun_worker's
// trun::worker::version(), the agent's event log and /metrics (trun_build_info) all read it here.

#include <string>

namespace trun::base {

struct BuildInfo {
  const char* version;     // "0.1.0"
  const char* commit;      // 12 hex digits; "unknown" outside a git checkout (TRUN_GIT_COMMIT)
  bool modified;           // tracked files differed from that commit when it was built
  bool nccl;               // the NCCL backend (CUDA and NCCL found at build time)
  bool libtorch;           // the libtorch adapter (trun::torch) was built
  const char* build_type;  // CMAKE_BUILD_TYPE
  const char* sanitizers;  // TRUN_SANITIZE, "" for none
  const char* compiler;    // e.g. "GCC 12.2.0"
};

const BuildInfo& build_info();

// "<commit>" or "<commit>-modified".
std::string commit_text();

// The text `trun --version` prints, several lines, ending in a newline:
//   trun 0.1.0 (torchrun-compatible)
//   commit: 149adfc1a2b3
//   features: rendezvous c10d etcd static; CPU backend gloo + shared memory; NCCL yes; libtorch
//             adapter no
//   build: RelWithDebInfo, GCC 12.2.0
std::string version_text();

}  // namespace trun::base
