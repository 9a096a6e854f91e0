#pragma once
// SLURM hostlist expressions (SLURM_JOB_NODELIST, SLURM_STEP_NODELIST), expanded by trun itself:
// no `scontrol show hostnames`, which may not exist where trun runs.
//
//   n[01-04,07]          -> n01 n02 n03 n04 n07   (a bound's leading zeros set the width)
//   gpu-[1-2]-ib,login3  -> gpu-1-ib gpu-2-ib login3
//   r[1-2]n[8-10]        -> r1n8 r1n9 r1n10 r2n8 r2n9 r2n10   (several groups: in order, the
//                                                              rightmost group varying fastest)
//
// Top-level commas separate host expressions; commas inside brackets separate ranges. Duplicates
// are kept, in order, as SLURM lists them.
//
// Pure functions: thread-safe, no I/O. Errors: std::invalid_argument whose message quotes the
// expression and says what is wrong (an unbalanced bracket, an empty or reversed range, a
// non-digit in a range, more than kMaxHosts hosts).

#include <cstddef>
#include <string>
#include <vector>

namespace trun::base {

inline constexpr size_t kMaxHosts = 1'000'000;

std::vector<std::string> expand_hostlist(const std::string& expression);

// The first host of `expression` (what trun uses as the rendezvous host), without expanding the
// rest. Same errors as expand_hostlist for the first host expression.
std::string first_host(const std::string& expression);

}  // namespace trun::base
