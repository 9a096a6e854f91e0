#include "agent/process_spawner.h"

#include <sys/wait.h>

namespace trun::agent {

bool ExitStatus::signaled() const { return WIFSIGNALED(status); }

int ExitStatus::exitcode() const {
  if (WIFSIGNALED(status)) return -WTERMSIG(status);
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 0;
}

}  // namespace trun::agent
