#include "base/slurm.h"

#include <stdexcept>

namespace trun::base {
namespace {

[[noreturn]] void count_error(const std::string& text, const std::string& why) {
  throw std::invalid_argument("tasks per node '" + text + "': " + why);
}

// A positive decimal number of at most 7 digits (SLURM counts tasks and nodes far below that).
int parse_count(const std::string& text, const std::string& digits) {
  if (digits.empty()) count_error(text, "empty count");
  if (digits.size() > 7) count_error(text, "count '" + digits + "' is too large");
  int v = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') count_error(text, "'" + digits + "' is not a number");
    v = v * 10 + (c - '0');
  }
  if (v == 0) count_error(text, "a count of 0");
  return v;
}

}  // namespace

std::vector<int> expand_tasks_per_node(const std::string& text) {
  constexpr size_t kMaxNodes = 1'000'000;
  if (text.empty()) count_error(text, "empty");
  std::vector<int> out;
  size_t start = 0;
  for (;;) {
    const size_t comma = text.find(',', start);
    const std::string item =
        text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const size_t open = item.find('(');
    int tasks = 0;
    int repeat = 1;
    if (open == std::string::npos) {
      tasks = parse_count(text, item);
    } else {
      if (item.size() < open + 4 || item.compare(open, 2, "(x") != 0 || item.back() != ')')
        count_error(text, "'" + item + "' is not N or N(xM)");
      tasks = parse_count(text, item.substr(0, open));
      repeat = parse_count(text, item.substr(open + 2, item.size() - open - 3));
    }
    if (out.size() + static_cast<size_t>(repeat) > kMaxNodes)
      count_error(text, "more than " + std::to_string(kMaxNodes) + " nodes");
    out.insert(out.end(), static_cast<size_t>(repeat), tasks);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

bool is_srun_step_id(const std::string& text) {
  if (text.empty() || text.size() > 19) return true;
  unsigned long long v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return true;
    v = v * 10 + static_cast<unsigned long long>(c - '0');
  }
  return v < kFirstSpecialStepId;
}

uint16_t slurm_port(unsigned long long job_id, unsigned long long step_id) {
  return static_cast<uint16_t>(kSlurmPortBase + (job_id % kSlurmPortJobs) * kSlurmPortSteps +
                               step_id % kSlurmPortSteps);
}

}  // namespace trun::base
