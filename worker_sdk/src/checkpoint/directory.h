#pragma once
// The checkpoint directory's housekeeping, private to the Checkpointer: the ownership lock,
// temporary files of writers that are gone, and quarantine of damaged checkpoints.

#include <chrono>
#include <memory>
#include <string>

namespace trun::worker::detail {

// This host's name ("?" when it cannot be read).
std::string host_name();

// "-<pid>@<host>": the suffix of this process's temporary files in a checkpoint directory.
std::string temp_suffix();

// The exclusive lock on DIR/.lock, held while a Checkpointer that writes exists. One lock per
// directory and process: Checkpointers of one process share it. Released on destruction or when
// the process dies. DIR/.lock is opened with O_NOFOLLOW relative to DIR and must be a regular
// file with one link: a symbolic link, a hard link to another file, a FIFO or a directory in its
// place is refused (CheckpointError naming it), never written through.
class DirLock {
 public:
  // Takes the lock for `job_id`: fails at once when another job holds it, waits up to `wait`
  // while a process of the same job does. Throws CheckpointError (not writable, with errno),
  // CheckpointOwnerError (the owner is named).
  static std::shared_ptr<DirLock> acquire(const std::string& dir, const std::string& job_id,
                                          std::chrono::milliseconds wait);
  ~DirLock();
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

 private:
  explicit DirLock(int fd) : fd_(fd) {}
  int fd_;
};

// Removes DIR's temporary entries (`dirfd` is DIR open; `dir` names it in messages) (.tmp-*,
// .latest.tmp-*) whose writers are gone: those of other hosts (the caller holds the lock, so they
// no longer write) and those of dead processes of this host; with `include_own`, this process's
// too. Entries of live processes are kept (and named on stderr). Nothing is followed: a symbolic
// link is removed itself.
void remove_stale_temporaries(int dirfd, const std::string& dir, bool include_own);

// Renames DIR/<name> to DIR/<name>.<suffix>-<unix ms> ("damaged": a checkpoint that did not
// verify; "set-aside": another job's, put away by a fresh start) and writes `reason` into its
// REASON file (best effort; a new file, never written through a link, nor into a step that is a
// link). Returns the new name, or "" when the rename failed (said on stderr).
std::string quarantine(int dirfd, const std::string& dir, const std::string& name,
                       const std::string& reason, const std::string& suffix = "damaged");

}  // namespace trun::worker::detail
