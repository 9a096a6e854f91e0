#include "agent/hang_dump.h"

#include <cstdio>
#include <sstream>

namespace trun::agent {
namespace {

namespace board = base::progress;

std::string seconds_ago(int64_t then_ns, int64_t now_ns) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s ago", static_cast<double>(now_ns - then_ns) / 1e9);
  return buf;
}

const char* process_word(hang::ProcessState s) {
  switch (s) {
    case hang::ProcessState::kRunning:
      return "running";
    case hang::ProcessState::kStopped:
      return "stopped (SIGSTOP or a debugger)";
    case hang::ProcessState::kGone:
      return "gone";
    default:
      return "state unknown";
  }
}

const char* phase_word(hang::Phase p) {
  switch (p) {
    case hang::Phase::kInit:
      return "init";
    case hang::Phase::kRunning:
      return "running";
    case hang::Phase::kStopCheck:
      return "stop check";
    case hang::Phase::kCheckpointSave:
      return "checkpoint save";
    case hang::Phase::kSection:
      return "section";
    default:
      return "none";
  }
}

}  // namespace

std::string format_progress(const hang::RankProgress& r, int64_t now_ns) {
  std::ostringstream out;
  out << "rank " << r.rank << " (local_rank " << r.local_rank << ", pid " << r.pid;
  if (!r.node.empty()) out << ", node " << r.node;
  out << "): ";
  if (!r.attached) {
    out << "not reporting (no libtrun_worker, or not started)\n";
    return out.str();
  }
  out << process_word(r.process) << ", phase " << phase_word(r.phase);
  if (r.phase == hang::Phase::kSection) out << " \"" << r.section << "\"";
  if (r.starting) out << " (starting up)";
  out << ", " << r.steps << " steps, " << r.heartbeat << " progress events, ";
  if (r.moving) {
    out << "making progress\n";
  } else {
    char buf[48];
    std::snprintf(buf, sizeof buf, "no progress for %.1f s\n",
                  static_cast<double>(now_ns - r.last_progress_ns) / 1e9);
    out << buf;
  }
  for (const auto& g : r.groups) {
    out << "  " << g.name() << " (rank " << g.group_rank << " of " << g.group_size << "): issued #"
        << g.issued << ", finished #" << g.completed << "\n";
    for (const auto& c : g.recent) {
      out << "    #" << c.seq << " " << board::op_name(c.op);
      if (c.dtype != 0) out << " " << board::dtype_name(c.dtype) << " x " << c.count;
      out << ": " << board::state_name(c.state) << ", issued " << seconds_ago(c.issued_ns, now_ns);
      if (c.finished_ns > 0) {
        char buf[32];
        std::snprintf(buf, sizeof buf, ", took %.3f s",
                      static_cast<double>(c.finished_ns - c.issued_ns) / 1e9);
        out << buf;
      }
      out << "\n";
    }
  }
  return out.str();
}

std::string format_hang_dump(const hang::Verdict& v,
                             const std::vector<std::pair<std::string, double>>& timeouts,
                             const hang::RankProgress& rank, int64_t now_ns) {
  std::ostringstream out;
  out << "trun hang dump\nverdict: " << v.summary << "\ntimeouts:";
  if (timeouts.empty()) out << " none";
  for (size_t i = 0; i < timeouts.size(); ++i) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%s %s %.1f s", i ? "," : "", timeouts[i].first.c_str(),
                  timeouts[i].second);
    out << buf;
  }
  out << "\n\n" << format_progress(rank, now_ns);
  return out.str();
}

}  // namespace trun::agent
