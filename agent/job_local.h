#pragma once
// What one job has on this host outside its workers: its generated run id, the host's name, its
// log and error-file directory, and shared-memory segments its workers may leave behind.
//
// Thread safety: no shared state. Errors as stated per function.

#include <string>

namespace trun::agent {

// A new run id for --standalone, in UUID version 4 form (torchrun's uuid.uuid4()).
std::string generate_run_id();

// gethostname(), or "localhost" when it fails.
std::string host_name();

// The job's log and error-file directory: `log_dir`/`run_id` (created) when `log_dir` is set,
// else a new temporary directory under $TMPDIR (or /tmp), which *temporary tells the caller to
// remove at the end. Throws std::system_error or std::filesystem::filesystem_error.
std::string make_log_dir(const std::string& log_dir, const std::string& run_id, bool* temporary);

// libtrun_worker shares its segments as unnamed memfds by default; with TRUN_SHM_NAMED=1 (or
// where memfd_create is missing) it names them in /dev/shm (rendezvous/shm_names.h) and unlinks
// each as soon as every local rank mapped it. This removes the named ones of `run_id` that a
// local rank 0 left behind when it died between creating and sharing one, logging each. Call it
// once every worker is gone. Never throws.
void remove_worker_shm_segments(const std::string& run_id);

}  // namespace trun::agent
