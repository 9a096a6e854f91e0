#pragma once
// The health gate (issue 37, docs/health.md): checks this node runs before each rendezvous join
// and after each failure of its workers. A node that fails one does not join: the agent says why
// in one line, waits (health_retry_delay) and checks again, and the job never counts it as a
// failure of its own.
//
// The checks, in order (the first that fails is the reason):
//   - built in (HealthOptions::builtin): free space in /dev/shm for the node's segments, the log
//     directory and TMPDIR accept a new file, and with --nproc-per-node=gpu the GPUs are visible
//     (through NVML when libnvidia-ml.so.1 loads; skipped with a note otherwise);
//   - --health-check CMD: `/bin/sh -c CMD` in its own process group, stdin from /dev/null, its
//     stdout and stderr kept (the last kOutputKeep bytes); exit 0 is healthy; killed (the whole
//     process group, SIGKILL) when it runs past its timeout.
//
// Thread safety: check_node_health() is reentrant; it forks one child and reaps only that pid.

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace trun::agent {

struct HealthOptions {
  std::string command;  // --health-check; empty: none
  std::chrono::milliseconds timeout{60000};
  bool builtin = true;  // --health-builtin=on
  // Free bytes /dev/shm (shm_dir) must have; 0: not checked.
  uint64_t shm_bytes_needed = 0;
  std::string shm_dir = "/dev/shm";
  // Directories that must accept a new file (the log directory, TMPDIR); empty entries skipped.
  std::vector<std::string> writable_dirs;
  // GPUs that must be visible (--nproc-per-node=gpu: one per worker); 0: not checked.
  int gpus_needed = 0;
};

struct HealthReport {
  bool healthy = true;
  std::string reason;  // one line: what failed ("/dev/shm has 1.0 MiB free, 36.0 MiB needed")
  std::string output;  // the command's output (its last kOutputKeep bytes); empty without one
  std::vector<std::string> notes;  // checks skipped, and why ("no NVML: GPU check skipped")
  double seconds = 0;              // what the checks took
};

inline constexpr size_t kOutputKeep = 4096;

// Runs every check. Never throws: a check that cannot run is a failed check, with the reason.
HealthReport check_node_health(const HealthOptions& options);

// The wait before the next check after `failures` failed checks in a row (1 or more): 1 s,
// doubling, at most `cap`.
std::chrono::milliseconds health_retry_delay(
    int failures, std::chrono::milliseconds cap = std::chrono::seconds(60));

// The free space the built-in check asks of /dev/shm for `nproc` local workers: the progress board
// and each worker's collective staging (4 MiB a worker, 8 MiB at least).
uint64_t shm_bytes_for(int nproc);

}  // namespace trun::agent
