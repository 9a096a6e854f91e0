#include "agent/elastic_agent.h"

#include <pthread.h>
#include <signal.h>
#include <spdlog/spdlog.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>

#include "agent/agent.h"
#include "agent/job_local.h"
#include "agent/process_supervisor.h"

namespace trun::agent {

namespace fs = std::filesystem;

int ElasticAgent::run() {
  // Blocked first, for the whole process: the real supervisor's threads must start with the
  // agent's signals blocked (its header), and only the agent's signalfd may take them.
  const sigset_t set = agent_signal_set(config_);
  if (pthread_sigmask(SIG_BLOCK, &set, nullptr) != 0) {
    spdlog::error("cannot set up process supervision: pthread_sigmask: {}", std::strerror(errno));
    return kExitAgentError;
  }
  // A parent may have started trun with some of them ignored (a shell's background job ignores
  // SIGINT and SIGQUIT; some programs ignore SIGCHLD), and an ignored disposition survives exec.
  // An ignored SIGCHLD makes the kernel reap the workers itself, so their exits would never be
  // seen; ignored stop signals would be inherited by the workers, which would then ignore what
  // trun forwards. Blocked, the default action cannot run, so the defaults are safe here.
  for (int sig = 1; sig < NSIG; ++sig) {
    struct sigaction old {};
    if (sigismember(&set, sig) == 1 && sigaction(sig, nullptr, &old) == 0 &&
        old.sa_handler == SIG_IGN) {
      signal(sig, SIG_DFL);
    }
  }
  if (spawner_ != nullptr) {
    Agent agent(config_, *clock_, *spawner_);
    return agent.run();
  }
  // Without --log-dir the temporary directory exists before the guardian is forked, so that the
  // guardian can remove it if trun dies without doing so (SIGKILL).
  std::string temp_dir;
  if (config_.log_dir.empty()) {
    try {
      temp_dir = make_temporary_dir();
    } catch (const std::exception& e) {
      spdlog::error("cannot create the log directory: {}", e.what());
      return kExitAgentError;
    }
  }
  std::unique_ptr<ProcessSupervisor> supervisor;
  try {
    if (!ProcessSupervisor::become_subreaper()) {
      spdlog::warn("cannot become a child subreaper: {}", std::strerror(errno));
    }
    supervisor = std::make_unique<ProcessSupervisor>(temp_dir);
  } catch (const std::exception& e) {
    spdlog::error("cannot set up process supervision: {}", e.what());
    std::error_code ec;
    if (!temp_dir.empty()) fs::remove_all(temp_dir, ec);
    return kExitAgentError;
  }
  // Destroyed before the supervisor: the agent removes the directory, then the supervisor tells
  // the guardian to leave it alone.
  Agent agent(config_, steady_clock(), *supervisor, temp_dir);
  return agent.run();
}

}  // namespace trun::agent
