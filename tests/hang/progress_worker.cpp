// A libtrun_worker program for the hang tests (tests/hang/progress_board_test.cpp): init(), then
// forever an allreduce of 16 floats followed by 20 ms of "user code". With argument "section",
// rank 1 enters trun::worker::Section("eval") after 20 iterations and stays in it (sleeping),
// while the other ranks wait for it in the next allreduce. Prints "ready" once init() returned.
// The test ends it by its pid.

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include <trun/progress.h>
#include <trun/worker.h>

int main(int argc, char** argv) {
  const bool section = argc > 1 && std::strcmp(argv[1], "section") == 0;
  auto worker = trun::worker::init();
  auto& pg = worker.process_group();
  std::printf("ready rank=%d progress=%d\n", worker.rank(), trun::worker::progress_reported());
  std::fflush(stdout);
  std::vector<float> buf(16, 1.0f);
  for (int i = 0;; ++i) {
    if (section && i == 20 && worker.rank() == 1) {
      trun::worker::Section eval("eval");
      for (;;) ::usleep(100000);
    }
    pg.allreduce(buf.data(), buf.size(), trun::worker::DataType::kFloat32);
    ::usleep(20000);
  }
}
