#pragma once
// What a hang dump says of one rank (issue 36, docs/hangs.md, "Reading a dump"): its progress as
// the board held it at the verdict, every tracked group with its recent collectives (PyTorch's
// flight recorder, from the board's rings), in plain text. Pure: no I/O.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "agent/hang_rules.h"

namespace trun::agent {

// The dump's head: the verdict, the timeouts that applied, then format_progress(rank).
std::string format_hang_dump(const hang::Verdict& verdict,
                             const std::vector<std::pair<std::string, double>>& timeouts,
                             const hang::RankProgress& rank, int64_t now_ns);

// One rank: "rank 1 (local_rank 1, pid 4711, node n0): stopped, phase running, 123 steps, no
// progress for 12.4 s" and a block per group: "group 0 (rank 1 of 2): issued #58, finished #57",
// then its ring, newest last: "  #58 allreduce float32 x 1024: started, 12.1 s ago".
std::string format_progress(const hang::RankProgress& rank, int64_t now_ns);

}  // namespace trun::agent
