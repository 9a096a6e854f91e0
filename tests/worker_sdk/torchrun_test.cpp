// A libtrun_worker program launched by PyTorch 1.13's own torchrun: with the static backend the
// workers use the agent's store, which is PyTorch 1.13's TCPStore server (the SDK's client must
// speak its dialect); with the c10d backend (what --standalone is) rank 0 hosts trun's store.
// Either way init() and the collectives must work and give the right results.
//
// no_sanitize: runs /usr/bin/torchrun (Python with torch).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "tests/launcher/free_port.h"
#include "tests/launcher/process_util.h"
#include "tests/skip.h"
#include "tests/torchrun_tools.h"

using namespace trun::testing;

namespace {

// Runs `torchrun <launch args> --no_python pg_worker matrix ...` to completion.
RunResult run_torchrun(const std::vector<std::string>& launch) {
  // Underscore flags only (1.13). On Python 3.11 torchrun 1.13 crashes when redirects/tee are 0;
  // a map naming a rank that does not exist keeps the plain console behaviour.
  std::vector<std::string> argv{
      kPython, kTorchrun, "--nproc_per_node=2", "--monitor_interval=0.2", "--redirects", "9:1",
      "--tee", "9:1",     "--max_restarts=0"};
  argv.insert(argv.end(), launch.begin(), launch.end());
  for (const char* a : {"--no_python", TRUN_BINARY_DIR "/tests/worker_sdk/pg_worker", "matrix", "0",
                        "7", "1000", "65537"}) {
    argv.push_back(a);
  }
  // torchrun leaves its /tmp/torchelastic_* directory behind: give it one that is removed.
  TempDir tmp;
  Child c(argv, {{"TMPDIR", tmp.path()}, {"PG_WORKER_TIMEOUT_MS", "60000"}},
          {"TORCHELASTIC_ERROR_FILE", "LOGLEVEL", "OMP_NUM_THREADS", "PET_MASTER_PORT",
           "TRUN_STORE_DIALECT", "TRUN_STORE_TOKEN"});
  RunResult r;
  r.finished = c.wait(std::chrono::seconds(240));
  if (!r.finished) {
    // torchrun passes SIGTERM on to its workers and waits for them; SIGKILL (the Child's
    // destructor) only if that does not end it.
    c.signal(SIGTERM);
    c.wait(std::chrono::seconds(30));
  }
  r.exit_code = c.exit_code();
  r.out = c.out();
  r.err = c.err();
  return r;
}

void check_both_ranks_passed(const RunResult& r, const std::string& store) {
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.finished);
  CHECK(r.exit_code == 0);
  for (int rank = 0; rank < 2; ++rank) {
    CHECK(r.out.find("rank " + std::to_string(rank) + "/2 backend") != std::string::npos);
    CHECK(r.out.find("rank " + std::to_string(rank) + " store " + store) != std::string::npos);
  }
  size_t passes = 0;
  for (size_t at = r.out.find("PASS"); at != std::string::npos; at = r.out.find("PASS", at + 1)) {
    ++passes;
  }
  CHECK(passes == 2);
}

}  // namespace

TEST_CASE("a libtrun_worker program runs under torchrun 1.13 on its agent's store (static)",
          "[worker_sdk][torch]") {
  if (auto why = torch_missing(); !why.empty()) TRUN_SKIP(why, kSetup);
  auto r = run_torchrun({"--nnodes=1", "--node_rank=0", "--master_addr=127.0.0.1",
                         "--master_port=" + std::to_string(free_port())});
  check_both_ranks_passed(r, "agent");
}

TEST_CASE("a libtrun_worker program runs under torchrun 1.13 --standalone (c10d)",
          "[worker_sdk][torch]") {
  if (auto why = torch_missing(); !why.empty()) TRUN_SKIP(why, kSetup);
  // --standalone is exactly "--rdzv_backend=c10d --rdzv_endpoint=localhost:29400 --rdzv_id=<uuid>"
  // in 1.13; a fixed port would collide with other tests, so it is spelled out with a free one.
  auto r = run_torchrun({"--rdzv_backend=c10d",
                         "--rdzv_endpoint=localhost:" + std::to_string(free_port()),
                         "--rdzv_id=sdk-" + std::to_string(getpid())});
  check_both_ranks_passed(r, "hosted by rank 0");
}
