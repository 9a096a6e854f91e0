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
// Ownership. A checkpoint directory belongs to one job at a time. The writer (rank 0) takes an
// exclusive lock on DIR/.lock when the Checkpointer is created (flock(2): the kernel releases it
// when the process dies) and records its owner there (job id, host, pid, start time). A second
// job on the same directory is refused at once with CheckpointOwnerError naming the owner; a
// process of the same job (an earlier incarnation that is being stopped) is waited for up to
// `lock_wait`. Every checkpoint records the job id that saved it. When DIR holds another job's
// checkpoints, that job is gone (its lock was free): load_latest() continues it and says so
// (`adopt`, the default), or sets them aside (`set_aside_other_jobs`: a fresh start). Limits: the
// lock is as good as the filesystem's flock (local filesystems; NFSv4 maps it to a byte-range lock;
// some network filesystems ignore it): see docs/checkpoints.md.
//
// Writing (rank 0 only; other ranks' save() returns at once: the state is replicated). A
// checkpoint is written into DIR/.tmp-step_<n>-<pid>@<host>, its files and the directory are
// fsynced, and it is renamed to DIR/step_<n> atomically; `latest` is replaced the same way
// (temporary file, fsync, rename, fsync DIR). A crash at any moment leaves either the old or the
// new checkpoint visible, never a partial one under a step_<n> name that load_latest() accepts.
// A save that fails (ENOSPC, EIO, ...) removes its partial files before it throws, so the next
// save can succeed once space is back. Retention (only this job's checkpoints, never damaged
// ones): before a save, checkpoints beyond `keep_last` - 1 are removed when keep_last >= 2, so a
// full disk has room for the new one; after it, only the newest `keep_last` are kept, and
// checkpoints of steps > n are removed (a run history that was abandoned when the job resumed from
// an older checkpoint). Temporary files of writers that are provably gone (this job holds the
// lock, and a writer on this host is no longer alive) are removed when the Checkpointer is created
// and after each save.
//
// Async mode: save() copies every tensor into a host staging buffer (that copy is the only time
// training is blocked) and a background thread writes it; the next save(), wait(), load_latest()
// and the destructor wait for it. A background failure is rethrown by the next save() or wait();
// load_latest() and the destructor log it on stderr instead.
//
// Loading: load_latest() is collective when a process group is given: rank 0 finishes its
// pending write, verifies the checkpoints (manifest CRC, data size, every tensor's CRC32C; a read
// error is retried once), decides, and tells every rank which checkpoint to load (it writes its
// decision to DIR/.resume before a barrier of the group; NCCL groups cannot broadcast host
// memory); each rank then reads that one. When rank 0 cannot write DIR/.resume (a full disk),
// the other ranks decide on their own, reading only. The newest valid checkpoint of this job wins
// (the one `latest` names first). Damage is never silent and never destructive: a checkpoint that
// does not verify is quarantined (renamed to DIR/step_<n>.damaged-<unix ms>, with a REASON file,
// and kept; no retention ever removes it), with a line on stderr. When checkpoints exist but none
// is readable, load_latest() throws CheckpointError listing each one and why, unless
// `start_fresh_if_damaged` is set (then they are quarantined and it returns std::nullopt).
// Loading does not depend on the world size that saved: tensors are the replicated state, and
// the sampler state is a global offset (trun/sampler.h).
//
// Hostile directories: every file the checkpoint code creates or overwrites is opened relative
// to the directory with O_NOFOLLOW (new ones with O_EXCL), so a symbolic link, a hard link (.lock)
// or a FIFO planted in DIR is never written through: the Checkpointer or save fails naming it, or
// (a step's files when loading) the step counts as damaged. A manifest's sizes and offsets are
// checked against the data file's real size and this process's memory, and every count, name,
// dimension and nesting level is bounded, before anything is allocated; a manifest that disagrees
// is damage (quarantined, the previous step used). Details and bounds: docs/checkpoints.md.
//
// Tensors are host memory only: copy device tensors to the host before saving.
//
// Thread safety: a Checkpointer is used by one thread (the training loop); its background writer
// is internal. Errors: CheckpointError (I/O, with the path and errno text, error_number() = the
// errno; a damaged checkpoint when one is loaded by path; none readable), CheckpointOwnerError
// (the directory belongs to another job), std::invalid_argument (bad arguments), CollectiveError
// from the load barrier.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <trun/export.h>
#include <trun/process_group.h>
#include <trun/sampler.h>

namespace trun::worker {

class TRUN_API CheckpointError : public std::runtime_error {
 public:
  explicit CheckpointError(const std::string& what, int error_number = 0)
      : std::runtime_error(what), error_number_(error_number) {}
  // The errno of the failed system call (ENOSPC, EROFS, EIO, ...); 0 when the error is not one.
  int error_number() const { return error_number_; }

 private:
  int error_number_ = 0;
};

// The checkpoint directory belongs to another job: its lock is held by a live process of another
// job, or it holds only another job's checkpoints. The message names the owner.
class TRUN_API CheckpointOwnerError : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
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

struct TRUN_API LoadedTensor {
  std::string name;
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;
  size_t numel() const;
};

struct TRUN_API Checkpoint {
  uint64_t step = 0;
  int world_size = 1;  // of the job that saved it
  std::string path;    // DIR/step_<n>
  std::vector<LoadedTensor> model;
  std::vector<LoadedTensor> optimizer;
  std::optional<SamplerState> sampler;
  std::string metadata = "{}";
  std::string job_id;  // of the job that saved it; empty for checkpoints of trun before 0.3

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
  // The training job's identity, recorded in every checkpoint. Empty: $TRUN_JOB_ID, else
  // $SLURM_JOB_ID (kept across a requeue), else $TORCHELASTIC_RUN_ID (trun's --rdzv-id), else
  // "none". Every rank must use the same value.
  std::string job_id;
  // load_latest() when DIR holds another job's checkpoints. That job is gone (the writer holds
  // DIR's lock, so none of its processes does): true (the default) continues from the newest
  // valid checkpoint, whichever job saved it, and says so in one line on stderr ("continuing job
  // 'A' from DIR/step_40 ..."), so that running a training again resumes it even under a new job
  // id (a new SLURM job, a new --standalone run id); false refuses with CheckpointOwnerError
  // naming that job and its steps.
  bool adopt = true;
  // load_latest() sets aside every checkpoint of another job (renamed step_<n>.set-aside-<ms>,
  // kept, with a REASON file) before choosing, so this job starts over in a directory that holds
  // an earlier training (train_mlp --fresh-start). This job's own checkpoints are still resumed:
  // a restart of the same job does not lose its progress.
  bool set_aside_other_jobs = false;
  // load_latest() when checkpoints exist and none is readable: false throws CheckpointError
  // listing each one and why; true quarantines them and returns std::nullopt (a fresh start).
  bool start_fresh_if_damaged = false;
  // How long the constructor waits for DIR's lock while a process of the same job holds it (an
  // earlier incarnation of rank 0 that is still being stopped). Another job's lock: no wait.
  std::chrono::milliseconds lock_wait{30000};
  // Test seam: called by the writer at each step of a save ("data_written", "manifest_written",
  // "synced", "renamed", "latest_written", "done"), so a test can crash it at a chosen moment.
  std::function<void(const char* phase)> on_phase;
};

class TRUN_API Checkpointer {
 public:
  // Rank 0: creates DIR (and parents), takes its lock, checks that it is writable and removes
  // temporary files of writers that are gone. Throws CheckpointError (e.g. a read-only
  // directory), CheckpointOwnerError (another job owns DIR), std::invalid_argument.
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
  const std::string& dir() const;
  const std::string& job_id() const;

  // How long the last save() blocked the caller, and how long its write took (async: measured
  // on the background thread; valid after wait()).
  std::chrono::nanoseconds last_blocked() const;
  std::chrono::nanoseconds last_write() const;

 private:
  struct TRUN_HIDDEN State;
  std::unique_ptr<State> state_;
};

// CRC32C (Castagnoli) of `n` bytes, continuing from `crc` (0 to start). Uses SSE4.2 when the CPU
// has it.
TRUN_API uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

}  // namespace trun::worker
