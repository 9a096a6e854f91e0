// launch_probe: the worker that launch_bench starts under trun and torchrun (--no-python).
// It stamps CLOCK_MONOTONIC (system-wide, so comparable across processes) the moment it runs:
//   launch_probe DIR launch        stamp DIR/start_<attempt>_<rank>, exit 0
//   launch_probe DIR restart N     attempt 0: stamp; rank 0 waits for all N stamps, writes
//                                  DIR/death, exits 1; other ranks sleep until stopped.
//                                  attempt 1: stamp, exit 0
//   launch_probe DIR idle SECONDS  stamp, sleep SECONDS, exit 0
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

long long now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

void stamp(const std::string& path, long long t) {
  std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) return;
  std::fprintf(f, "%lld\n", t);
  std::fclose(f);
  std::rename(tmp.c_str(), path.c_str());
}

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

}  // namespace

int main(int argc, char** argv) {
  long long t = now_ns();
  if (argc < 3) {
    std::fprintf(stderr, "usage: launch_probe DIR launch|restart N|idle SECONDS\n");
    return 2;
  }
  std::string dir = argv[1], mode = argv[2];
  std::string rank = env_or("LOCAL_RANK", "0"), attempt = env_or("TORCHELASTIC_RESTART_COUNT", "0");
  stamp(dir + "/start_" + attempt + "_" + rank, t);
  if (mode == "launch") return 0;
  if (mode == "idle") {
    double s = argc > 3 ? std::atof(argv[3]) : 10;
    usleep(static_cast<useconds_t>(s * 1e6));
    return 0;
  }
  if (mode == "restart") {
    if (attempt != "0") return 0;
    if (rank != "0") {
      for (int i = 0; i < 600; ++i) sleep(1);  // stopped by the launcher long before
      return 0;
    }
    int n = argc > 3 ? std::atoi(argv[3]) : 1;
    for (int i = 0; i < 20000; ++i) {  // at most 20 s
      int seen = 0;
      struct stat st;
      for (int r = 0; r < n; ++r) {
        seen += stat((dir + "/start_0_" + std::to_string(r)).c_str(), &st) == 0 ? 1 : 0;
      }
      if (seen == n) break;
      usleep(1000);
    }
    usleep(20000);  // let every worker settle into its sleep
    stamp(dir + "/death", now_ns());
    return 1;
  }
  return 2;
}
