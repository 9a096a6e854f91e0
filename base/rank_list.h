#pragma once
// Ranks in messages: "rank 3", "ranks 0-2 and 4-7", "ranks 0, 2 and 5" (sorted, each once), with
// another noun where the ranks are local ones ("local ranks 0-1"). Header-only: the agent's hang
// verdicts and libtrun_worker's collective errors both name ranks this way.

#include <algorithm>
#include <string>
#include <vector>

namespace trun::base {

inline std::string format_rank_list(std::vector<int> ranks, const std::string& noun = "rank") {
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  std::vector<std::string> parts;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    parts.push_back(j == i ? std::to_string(ranks[i])
                           : std::to_string(ranks[i]) + "-" + std::to_string(ranks[j]));
    i = j + 1;
  }
  std::string out = noun + (ranks.size() == 1 ? " " : "s ");
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i) out += i + 1 == parts.size() ? " and " : ", ";
    out += parts[i];
  }
  return out;
}

}  // namespace trun::base
