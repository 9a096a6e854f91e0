#pragma once
// Checkpointer::State, the Checkpointer's private state (private to libtrun_worker), and the
// Snapshot a save hands to the writer. Its methods are in three files: checkpoint.cpp (the
// public calls, the async writer thread), save.cpp (writing a step directory, `latest`,
// retention) and resume.cpp (choosing the checkpoint to resume from, on rank 0, and telling
// the other ranks).
//
// Thread safety: `mu` guards the async writer's fields (pending .. error); the rest is used by
// the caller's thread, and by the writer thread only while a save is in flight (busy).

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "trun/checkpoint.h"
#include "worker_sdk/src/checkpoint/directory.h"
#include "worker_sdk/src/checkpoint/format.h"

namespace trun::worker {

namespace ckpt {

// What the writer needs: the manifest without offsets' checksums, and where each tensor's bytes
// are (the caller's memory in sync mode, the staging buffer in async mode).
struct Snapshot {
  struct Piece {
    std::string section, name;
    DataType dtype;
    std::vector<int64_t> shape;
    const unsigned char* data;
    size_t nbytes;
    uint64_t offset;
  };
  uint64_t step = 0;
  int world_size = 1;
  std::vector<Piece> pieces;
  uint64_t data_size = 0;
  std::optional<SamplerState> sampler;
  json metadata;
  // Async staging memory (reused across saves).
  std::unique_ptr<unsigned char[]> staging;
  size_t staging_capacity = 0;
};

}  // namespace ckpt

struct Checkpointer::State {
  std::string dir;
  ckpt::Fd dirfd;  // DIR, on the writer: every file it writes is opened relative to it
  CheckpointerOptions options;
  std::string job_id;
  std::set<std::string> own_jobs;  // job_id, "" (checkpoints older than job ids), an adopted one
  std::shared_ptr<detail::DirLock> lock;
  std::chrono::nanoseconds last_blocked{0};
  std::chrono::nanoseconds last_write{0};

  // Async writer: one pending snapshot at most.
  std::mutex mu;
  std::condition_variable cv;
  std::unique_ptr<ckpt::Snapshot> pending;
  std::unique_ptr<ckpt::Snapshot> spare;  // staging buffer reused by the next snapshot
  bool busy = false;
  bool stopping = false;
  std::exception_ptr error;
  std::thread thread;

  bool is_writer() const { return !options.group || options.group->rank() == 0; }

  // ---- checkpoint.cpp
  // `req`'s tensors in a snapshot (copied into its staging memory when async), with `metadata`
  // (parsed) and `total` staging bytes.
  std::unique_ptr<ckpt::Snapshot> take_snapshot(const SaveRequest& req, ckpt::json metadata,
                                                size_t total);
  void writer_loop();
  void wait();

  // ---- save.cpp
  // Writes the snapshot's step directory into place, then `latest`, then retention.
  void write(const ckpt::Snapshot& snap);
  // Removes this job's checkpoints beyond `limit` older than `step` (never the one `latest`
  // names), and with `drop_future` those after `step`.
  void retain(uint64_t step, int limit, bool drop_future);
  // The job that saved step_dir; nullopt when its manifest does not verify.
  std::optional<std::string> job_of(const std::string& step_dir) const;
  std::string latest_name() const;
  void write_small_file(const std::string& name, const std::string& text);

  // ---- resume.cpp
  std::optional<Checkpoint> choose(bool writer);
  // A rank other than the writer: what rank 0 decided (DIR/.resume), loaded.
  std::optional<Checkpoint> load_decided();
};

}  // namespace trun::worker
