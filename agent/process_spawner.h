#pragma once
// ProcessSpawner: what the agent needs of the operating system to run worker processes: start
// them, signal their process groups, and collect their exits. A seam (STYLE 8): the agent reaches
// processes only through it, so unit tests drive restart policy with a fake and no real process.
// The real one is ProcessSupervisor (agent/process_supervisor.h).
//
// Exits are announced by SIGCHLD, which the agent receives through its signalfd; reap() then
// returns them. An implementation that has exits to report must therefore make SIGCHLD pending
// for the agent's thread (the kernel does it for real children; a fake calls raise(SIGCHLD)).
//
// Worker process groups: each worker leads its own group, whose id is the worker's pid.
//
// Thread safety: every method is called from the agent's thread only. Errors: spawn() reports a
// program that cannot be started in its SpawnResult; the other methods do not throw.

#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

namespace trun::agent {

struct SpawnRequest {
  std::vector<std::string> argv;  // argv[0]: a path, or a name looked up in PATH
  std::vector<std::string> env;   // complete environment, "KEY=VALUE"
  int stdout_fd = -1;             // -1: inherit trun's stdout
  int stderr_fd = -1;             // -1: inherit trun's stderr
  // NUMA binding (agent/numa_binding.h), applied in the child before exec: the CPUs it may run
  // on (empty: trun's own) and its preferred memory node (-1: the default policy).
  std::vector<int> cpus;
  int memory_node = -1;
};

struct SpawnResult {
  pid_t pid = -1;  // -1 when the program could not be started
  int error = 0;   // errno of the failed exec/fork
  std::string error_message;
};

struct ExitStatus {
  pid_t pid = -1;
  int status = 0;  // raw wait status
  bool signaled() const;
  // torchrun's convention: the exit code, or minus the signal number.
  int exitcode() const;
};

class ProcessSpawner {
 public:
  virtual ~ProcessSpawner() = default;

  // Starts the programs in order, blocking until each has exec'd (or failed to). Returns one
  // result per request, in order.
  virtual std::vector<SpawnResult> spawn(const std::vector<SpawnRequest>& requests) = 0;
  // Sends `sig` to every process of the group. Returns false when no process of it is left.
  virtual bool signal_group(pid_t pgid, int sig) = 0;
  // True while any process (zombies included) belongs to the group.
  virtual bool group_alive(pid_t pgid) = 0;
  // The group is gone (called once, when it is empty); the spawner may forget it.
  virtual void forget_group(pid_t pgid) = 0;
  // Collects every child that has exited, without blocking. Exits of children for which
  // is_worker(pid) is true are returned; all others are collected silently.
  virtual std::vector<ExitStatus> reap(const std::function<bool(pid_t)>& is_worker) = 0;
};

}  // namespace trun::agent
