// progress_board_hold NAME SLOTS: creates the progress board NAME for SLOTS local ranks (as the
// agent will: agent/progress_monitor.h), prints "/NAME" on stdout, and holds it until stdin
// closes (or a line is read), then unlinks it. For measuring the hooks' cost in a benchmark that
// spawns its own ranks: TRUN_PROGRESS_SHM=/NAME in the benchmark's environment.
// With a third argument "dump", prints each slot's heartbeat and collective counts at the end.

#include <cstdio>
#include <iostream>
#include <string>

#include "agent/progress_monitor.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: progress_board_hold NAME SLOTS [dump]\n");
    return 2;
  }
  auto m = trun::agent::ProgressMonitor::create(argv[1], std::stoi(argv[2]));
  std::printf("%s\n", m->shm_name().c_str());
  std::fflush(stdout);
  std::string line;
  std::getline(std::cin, line);
  if (argc > 3) {
    for (int i = 0; i < m->slots(); ++i) {
      auto r = m->snapshot(i);
      std::printf("slot %d: attached=%d heartbeat=%llu steps=%llu", i, r.attached,
                  static_cast<unsigned long long>(r.heartbeat),
                  static_cast<unsigned long long>(r.steps));
      for (const auto& g : r.groups)
        std::printf(" %s issued=%llu", g.name().c_str(), static_cast<unsigned long long>(g.issued));
      std::printf("\n");
    }
  }
  return 0;
}
