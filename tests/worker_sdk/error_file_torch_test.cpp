// PyTorch's own reader (torch.distributed.elastic ProcessFailure) accepts the error file a C++
// worker writes. Runs /usr/bin/python3 with torch, hence its own executable, labelled
// no_sanitize.

#include <catch2/catch.hpp>
#include <cstdio>
#include <string>

#include "tests/skip.h"
#include "tests/worker_sdk/error_file_helpers.h"

using namespace trun::worker::test;

TEST_CASE("PyTorch's own error-file reader accepts the file", "[worker_sdk][error_file][torch]") {
  if (::access("/usr/bin/python3", X_OK) != 0) {
    TRUN_SKIP("/usr/bin/python3 not found", kSetup);
  }
  Tmp f;
  run_worker("throw", f.path);
  std::string cmd =
      "/usr/bin/python3 -c \"import sys\n"
      "try:\n"
      "    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure\n"
      "except Exception as e:\n"
      "    print('NO_TORCH', e); sys.exit(3)\n"
      "pf = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file='" +
      f.path +
      "')\n"
      "print(pf.message); print(pf.timestamp)\" 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  REQUIRE(p);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  int rc = ::pclose(p);
  if (WIFEXITED(rc) && WEXITSTATUS(rc) == 3) {
    TRUN_SKIP("torch is not importable by /usr/bin/python3: " << out, kSetup);
  }
  INFO(out);
  REQUIRE(WIFEXITED(rc));
  REQUIRE(WEXITSTATUS(rc) == 0);
  CHECK(out.find("std::runtime_error: model diverged at step 42") != std::string::npos);
}
