#pragma once
// Whether `sig` is pending for process `pid` (its /proc status: SigPnd or ShdPnd), so that a test
// can wait for one signal to be delivered before it sends the next (two pending standard signals
// of one kind merge into one).

#include <sys/types.h>

#include <fstream>
#include <string>

namespace trun::worker::test {

inline bool signal_pending(pid_t pid, int sig) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("SigPnd:", 0) != 0 && line.rfind("ShdPnd:", 0) != 0) continue;
    const unsigned long long mask = std::stoull(line.substr(7), nullptr, 16);
    if (mask & (1ULL << (sig - 1))) return true;
  }
  return false;
}

}  // namespace trun::worker::test
