#pragma once
// Checkpointer: saves and restores training state so that a job survives restarts and resizes.
//
// Layout on disk (DIR must be shared by every rank that loads, e.g. one machine or a shared
// filesystem):
//   DIR/step_<n>/manifest.json   names, sections, dtypes, shapes, offsets and CRC32C of every
//                                tensor, the step, the world size at save time, the sampler state
//                                and the user's metadata; itself protected by a CRC32C
//   DIR/step_<n>/data            the tensors' bytes, each at a 64-byte aligned offset
//   DIR/latest                   "step_<n>\n": the newest complete checkpoint
//
// Writing (rank 0 only; other ranks' save() returns at once: the state is replicated). A
// checkpoint is written into DIR/.tmp-step_<n>-<pid>, its files and the directory are fsynced,
// and it is renamed to DIR/step_<n> atomically; `latest` is replaced the same way (temporary
// file, fsync, rename, fsync DIR). A crash at any moment leaves either the old or the new
// checkpoint visible, never a partial one under a step_<n> name that load_latest() accepts.
// After a save, only the newest `keep_last` checkpoints are kept. A save of step n also removes
// checkpoints of steps > n: they belong to a run history that was abandoned (the job resumed
// from an older checkpoint). Temporary directories left by crashed writers are removed.
//
// Async mode: save() copies every tensor into a host staging buffer (that copy is the only time
// training is blocked) and a background thread writes it; the next save(), wait(), load_latest()
// and the destructor wait for it. A background failure is rethrown by the next of those calls.
//
// Loading: load_latest() is collective when a process group is given: rank 0 finishes its
// pending write, then every rank waits at a barrier, then each rank reads the newest checkpoint
// that verifies (manifest CRC, data size, every tensor's CRC32C), falling back to older ones
// when the newest is damaged or incomplete (with a line on stderr saying why). Loading does not
// depend on the world size that saved: tensors are the replicated state, and the sampler state
// is a global offset (trun/sampler.h).
//
// Tensors are host memory only: copy device tensors to the host before saving.
//
// Thread safety: a Checkpointer is used by one thread (the training loop); its background writer
// is internal. Errors: CheckpointError (I/O, with the path and errno text; a damaged checkpoint
// when one is loaded by path), std::invalid_argument (bad arguments), CollectiveError from the
// barrier.

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "trun/process_group.h"
#include "trun/sampler.h"

namespace trun::worker {

class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A tensor to save: borrowed memory, read during save() (async mode: only during the snapshot).
struct TensorRef {
  std::string name;
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;  // product = element count; empty = scalar (1 element)
  const void* data = nullptr;
};

struct SaveRequest {
  uint64_t step = 0;
  std::vector<TensorRef> model;      // parameters and buffers
  std::vector<TensorRef> optimizer;  // e.g. momentum buffers
  std::optional<SamplerState> sampler;
  std::string metadata = "{}";  // user metadata: JSON text (validated)
};

struct LoadedTensor {
  std::string name;
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;
  size_t numel() const;
};

struct Checkpoint {
  uint64_t step = 0;
  int world_size = 1;  // of the job that saved it
  std::string path;    // DIR/step_<n>
  std::vector<LoadedTensor> model;
  std::vector<LoadedTensor> optimizer;
  std::optional<SamplerState> sampler;
  std::string metadata = "{}";

  // nullptr when absent. `section` is "model" or "optimizer".
  const LoadedTensor* find(const std::string& section, const std::string& name) const;
  // Copies tensor `name` of `section` into `dst`; CheckpointError when it is missing or its
  // dtype or element count differ from what the caller expects.
  void copy_to(const std::string& section, const std::string& name, void* dst, size_t numel,
               DataType dtype) const;
};

struct CheckpointerOptions {
  // Group for the load barrier and for deciding who writes (rank 0). nullptr: this process is
  // the only one (it writes, and loads without a barrier). Not owned; must outlive the
  // Checkpointer.
  ProcessGroup* group = nullptr;
  int keep_last = 3;  // >= 1
  bool async = false;
  bool fsync = true;  // false only for tests and benchmarks that measure without it
  // Test seam: called by the writer at each step of a save ("data_written", "manifest_written",
  // "synced", "renamed", "latest_written", "done"), so a test can crash it at a chosen moment.
  std::function<void(const char* phase)> on_phase;
};

class Checkpointer {
 public:
  // Creates DIR (and parents) on rank 0. Throws CheckpointError, std::invalid_argument.
  explicit Checkpointer(std::string dir, CheckpointerOptions options = {});
  ~Checkpointer();  // waits for a pending async save (errors are logged, not thrown)
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Saves (rank 0). Sync mode: returns when the checkpoint is durable and `latest` points at it.
  // Async mode: returns after the snapshot; waits first for the previous save.
  void save(const SaveRequest& request);
  // Waits for the pending async save; rethrows its failure. No-op otherwise.
  void wait();
  // See the header comment. std::nullopt when no valid checkpoint exists.
  std::optional<Checkpoint> load_latest();

  // Reads and verifies one checkpoint directory. Throws CheckpointError saying what is wrong.
  static Checkpoint load(const std::string& step_dir);
  // Steps of the step_<n> directories present (valid or not), ascending.
  std::vector<uint64_t> list_steps() const;
  const std::string& dir() const { return dir_; }

  // How long the last save() blocked the caller, and how long its write took (async: measured
  // on the background thread; valid after wait()).
  std::chrono::nanoseconds last_blocked() const { return last_blocked_; }
  std::chrono::nanoseconds last_write() const { return last_write_; }

 private:
  struct Snapshot;
  void write(const Snapshot& snap);
  void writer_loop();
  bool is_writer() const;

  std::string dir_;
  CheckpointerOptions options_;
  std::chrono::nanoseconds last_blocked_{0};
  std::chrono::nanoseconds last_write_{0};

  // Async writer: one pending snapshot at most.
  std::mutex mu_;
  std::condition_variable cv_;
  std::unique_ptr<Snapshot> pending_;
  std::unique_ptr<Snapshot> spare_;  // staging buffer reused by the next snapshot
  bool busy_ = false;
  bool stopping_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

// CRC32C (Castagnoli) of `n` bytes, continuing from `crc` (0 to start). Uses SSE4.2 when the CPU
// has it.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

}  // namespace trun::worker
