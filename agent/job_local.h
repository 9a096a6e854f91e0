#pragma once
// What one job has on this host outside its workers: its generated run id, the host's name, its
// log and error-file directory, and shared-memory segments its workers may leave behind.
//
// Thread safety: no shared state. Errors as stated per function.

#include <cstddef>
#include <string>

namespace trun::agent {

// The longest run id (--rdzv-id) trun accepts: one file-name component (NAME_MAX), because
// --log-dir puts a job's logs in DIR/<run id>. Every rendezvous store key holds the run id too,
// and the store refuses keys over 64 KiB (store/wire.h, Limits::max_key_bytes), so
// this leaves every key far inside that.
inline constexpr size_t kMaxRunIdBytes = 255;

// A new run id for --standalone, in UUID version 4 form (torchrun's uuid.uuid4()).
std::string generate_run_id();

// gethostname(), or "localhost" when it fails.
std::string host_name();

// The job's log and error-file directory: `log_dir`/`run_id` (created) when `log_dir` is set,
// else a new temporary directory under $TMPDIR (or /tmp), which *temporary tells the caller to
// remove at the end. Throws std::system_error or std::filesystem::filesystem_error.
std::string make_log_dir(const std::string& log_dir, const std::string& run_id, bool* temporary);

// A new temporary directory $TMPDIR/trun-XXXXXX (or /tmp/trun-XXXXXX), mode 0700. Throws
// std::system_error. The agent makes it before it forks its guardian, which removes it if the
// agent dies without doing so (agent/process_supervisor.h).
std::string make_temporary_dir();

// libtrun_worker shares its segments as unnamed memfds by default; with TRUN_SHM_NAMED=1 (or
// where memfd_create is missing) it names them in /dev/shm (base/shm_names.h) and unlinks
// each as soon as every local rank mapped it. This removes the named ones of `run_id` that a
// local rank 0 left behind when it died between creating and sharing one, logging each. Call it
// once every worker is gone. Never throws.
void remove_worker_shm_segments(const std::string& run_id);

}  // namespace trun::agent
