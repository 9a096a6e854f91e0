#pragma once
// ProcessSupervisor: the real ProcessSpawner (agent/process_spawner.h). It starts worker
// processes, signals their process groups, and is the one place in trun that reaps children.
//
// Spawning: workers are started with Boost.Process from one long-lived thread owned by the
// supervisor (PR_SET_PDEATHSIG fires when the thread that forked exits, so that thread lives as
// long as the supervisor). Each worker leads its own process group, gets SIGKILL as its
// parent-death signal, starts with an empty signal mask and default SIGPIPE, and inherits no file
// descriptor but 0, 1, 2.
//
// Guardian: the supervisor forks a tiny guardian process that holds the read end of a pipe and
// the list of worker process groups. If trun dies in any way (even SIGKILL) the pipe reaches EOF
// and the guardian SIGKILLs every listed group, so grandchildren die with the workers. Given the
// agent's temporary directory, the guardian then also removes it (once the groups are gone, at
// most ~5 s later), unless the supervisor was destroyed in order first: then trun removed it
// itself. The removal never follows a symbolic link and removes nothing outside the directory.
//
// Reaping: reap() is the only code that waits for children. It peeks with
// waitid(P_ALL, WNOWAIT), reaps workers by pid (returning their status) and reaps everything
// else (orphans re-parented to trun as child subreaper) silently. (The one exception: when exec
// fails, Boost.Process itself collects that child while reporting the error.)
//
// Thread safety: every method must be called from the agent's thread (the one that created the
// supervisor); the spawn thread is internal. Construct it after blocking the signals the agent
// handles, so that no thread of trun ever receives them asynchronously.

#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "agent/process_spawner.h"

namespace trun::agent {

class ProcessSupervisor final : public ProcessSpawner {
 public:
  // Starts the spawn thread and the guardian. `temporary_dir` (empty: none) is an existing
  // directory the guardian removes if trun dies without destroying this supervisor. Throws
  // std::system_error when it cannot.
  explicit ProcessSupervisor(const std::string& temporary_dir = {});
  // Stops the spawn thread and lets the guardian exit (without killing anything or removing the
  // temporary directory: call it after every worker was reaped and the directory removed).
  ~ProcessSupervisor() override;
  ProcessSupervisor(const ProcessSupervisor&) = delete;
  ProcessSupervisor& operator=(const ProcessSupervisor&) = delete;

  // Starts the programs in order, blocking until each has exec'd (or failed to). Each worker
  // registers its process group with the guardian before it execs.
  std::vector<SpawnResult> spawn(const std::vector<SpawnRequest>& requests) override;

  // kill(-pgid, sig). Returns false when no process of the group is left (ESRCH).
  bool signal_group(pid_t pgid, int sig) override;
  // True while any process (zombies included) belongs to the group: kill(-pgid, 0).
  bool group_alive(pid_t pgid) override;
  // Tells the guardian the group is gone (call when it is empty).
  void forget_group(pid_t pgid) override;

  // Reaps every child that has exited, without blocking. Children for which is_worker(pid) is
  // true are returned; all others are reaped and logged at debug level.
  std::vector<ExitStatus> reap(const std::function<bool(pid_t)>& is_worker) override;

  // prctl(PR_SET_CHILD_SUBREAPER) for the calling process. Returns false on failure.
  static bool become_subreaper();

 private:
  class SpawnThread;
  std::unique_ptr<SpawnThread> spawner_;
  pid_t guardian_pid_ = -1;
  int guardian_fd_ = -1;      // write end
  std::string guarded_name_;  // the temporary directory's name in its parent (the guardian's copy)
};

}  // namespace trun::agent
