// Unmodified PyTorch programs (PyTorch 1.13 for /usr/bin/python3, gloo on CPU) under trun and
// under /usr/bin/torchrun in the same test: same results, same worker environment apart from
// the documented differences, same failure report.
#include <algorithm>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <set>

#include "tests/launcher/free_port.h"
#include "tests/launcher/process_util.h"
#include "tests/skip.h"

using namespace trun::testing;
using nlohmann::json;

namespace {

const char* kPython = "/usr/bin/python3";
const char* kTorchrun = "/usr/bin/torchrun";

std::string script(const std::string& name) {
  return std::string(TRUN_SOURCE_DIR) + "/tests/launcher/py/" + name;
}

bool torch_available(std::string& why) {
  if (access(kTorchrun, X_OK) != 0) {
    why = "/usr/bin/torchrun is not installed";
    return false;
  }
  Child c({kPython, "-c", "import torch.distributed"});
  if (!c.wait(std::chrono::seconds(60)) || c.exit_code() != 0) {
    why = "/usr/bin/python3 cannot import torch.distributed: " + c.err();
    return false;
  }
  return true;
}

// `launcher`: /usr/bin/torchrun, or {python, -m, torch.distributed.launch}.
RunResult run_torchrun(const std::vector<std::string>& args,
                       const std::map<std::string, std::string>& env = {},
                       const std::vector<std::string>& launcher = {kTorchrun}) {
  // torchrun 1.13's --standalone is exactly "--rdzv_backend=c10d
  // --rdzv_endpoint=localhost:29400 --rdzv_id=<uuid4>"; the fixed port collides with any other
  // torchrun on the host, so the test spells it out with a free port. Underscore flags only
  // (1.13); on Python 3.11 it crashes when redirects/tee are 0, and a map naming a rank that
  // does not exist keeps its plain console behaviour.
  std::vector<std::string> argv = launcher;
  argv.insert(argv.end(),
              {"--rdzv_backend=c10d", "--rdzv_endpoint=localhost:" + std::to_string(free_port()),
               "--rdzv_id=compat-" + std::to_string(getpid()), "--nproc_per_node=2",
               "--monitor_interval=0.2", "--redirects", "9:1", "--tee", "9:1"});
  argv.insert(argv.end(), args.begin(), args.end());
  // torchrun leaves its /tmp/torchelastic_* directory behind: give it one of ours to fill.
  TempDir tmp;
  std::map<std::string, std::string> full_env = env;
  full_env["TMPDIR"] = tmp.path();
  Child c(argv, full_env,
          {"TORCHELASTIC_ERROR_FILE", "LOGLEVEL", "OMP_NUM_THREADS", "PET_MASTER_PORT"});
  RunResult r;
  r.finished = c.wait(std::chrono::seconds(180));
  r.exit_code = c.exit_code();
  r.out = c.out();
  r.err = c.err();
  return r;
}

RunResult run_trun_py(const std::vector<std::string>& args,
                      std::map<std::string, std::string> env = {}) {
  env["PYTHON_EXEC"] = kPython;  // the python3 on PATH may lack torch
  std::vector<std::string> a{"--standalone", "--nproc-per-node=2"};
  a.insert(a.end(), args.begin(), args.end());
  return run_trun(a, env, std::chrono::seconds(180));
}

}  // namespace

TEST_CASE(
    "a DDP ToyModel trains to the same result, with the same environment, as under "
    "torchrun",
    "[torch]") {
  std::string why;
  if (!torch_available(why)) TRUN_SKIP(why, kSetup);
  TempDir mine, theirs;
  auto a = run_trun_py({script("ddp_toy.py"), mine.path()});
  INFO("trun stderr:\n" << a.err);
  REQUIRE(a.exit_code == 0);
  auto b = run_torchrun({script("ddp_toy.py"), theirs.path()});
  INFO("torchrun stderr:\n" << b.err);
  REQUIRE(b.exit_code == 0);

  // Variables that legitimately differ between two runs or two launchers (docs/launcher.md):
  // ports, run ids and temporary paths; MASTER_ADDR (torchrun: this host's name, trun: the
  // loopback address of its own store); TORCHELASTIC_USE_AGENT_STORE (trun's workers use the
  // agent's store, torchrun 1.13's standalone workers host their own); "_" and PYTHON_EXEC
  // and PET_MASTER_PORT (set by the shell / this test harness); TMPDIR (the harness gives
  // torchrun a temporary directory of its own, which it would otherwise leave in /tmp).
  const std::set<std::string> differ{"MASTER_PORT",
                                     "MASTER_ADDR",
                                     "TORCHELASTIC_RUN_ID",
                                     "TORCHELASTIC_ERROR_FILE",
                                     "TORCHELASTIC_USE_AGENT_STORE",
                                     "_",
                                     "PYTHON_EXEC",
                                     "PET_MASTER_PORT",
                                     "TMPDIR"};
  // Set by trun and by torchrun 2.x, not by 1.13.
  const std::set<std::string> newer{"TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                    "TORCHELASTIC_SIGNALS_TO_HANDLE"};
  for (int rank = 0; rank < 2; ++rank) {
    json ra = json::parse(read_file(mine / ("result_" + std::to_string(rank) + ".json")));
    json rb = json::parse(read_file(theirs / ("result_" + std::to_string(rank) + ".json")));
    CHECK(ra["world_size"] == 2);
    CHECK(ra["checksum"].get<double>() == Approx(rb["checksum"].get<double>()).epsilon(1e-12));
    const json& ea = ra["env"];
    const json& eb = rb["env"];
    for (auto it = eb.begin(); it != eb.end(); ++it) {
      INFO("rank " << rank << " variable " << it.key());
      if (it.key() == "TMPDIR") continue;  // only torchrun's run has it (see above)
      REQUIRE(ea.contains(it.key()));
      if (!differ.count(it.key())) CHECK(ea[it.key()] == it.value());
    }
    for (auto it = ea.begin(); it != ea.end(); ++it) {
      INFO("rank " << rank << " variable only trun sets: " << it.key());
      CHECK((eb.contains(it.key()) || newer.count(it.key()) || differ.count(it.key())));
    }
    CHECK(ea["TORCHELASTIC_USE_AGENT_STORE"] == "True");
    CHECK(ea["MASTER_ADDR"] == "127.0.0.1");
  }
  // Both ranks agree (DDP kept the replicas in sync).
  json r0 = json::parse(read_file(mine / "result_0.json"));
  json r1 = json::parse(read_file(mine / "result_1.json"));
  CHECK(r0["checksum"].get<double>() == Approx(r1["checksum"].get<double>()).epsilon(1e-12));
}

TEST_CASE("an exception inside @record is the root cause, as under torchrun", "[torch]") {
  std::string why;
  if (!torch_available(why)) TRUN_SKIP(why, kSetup);
  TempDir d;
  auto a = run_trun_py({script("record_raise.py")}, {{"TORCHELASTIC_ERROR_FILE", d / "mine.json"}});
  auto b =
      run_torchrun({script("record_raise.py")}, {{"TORCHELASTIC_ERROR_FILE", d / "theirs.json"}});
  INFO("trun stderr:\n" << a.err << "\ntorchrun stderr:\n" << b.err);
  CHECK(a.exit_code == 1);
  CHECK(b.exit_code == 1);
  for (const RunResult* r : {&a, &b}) {
    const std::string& err = r->err;
    auto root = err.find("Root Cause (first observed failure):");
    REQUIRE(root != std::string::npos);
    CHECK(err.find("record_raise.py FAILED") != std::string::npos);
    CHECK(err.find("rank      : 1 (local_rank: 1)", root) != std::string::npos);
    CHECK(err.find("exitcode  : 1 (pid: ", root) != std::string::npos);
    CHECK(err.find("traceback : Traceback (most recent call last):", root) != std::string::npos);
    CHECK(err.find("ValueError: boom from rank 1", root) != std::string::npos);
    CHECK(err.find("/attempt_0/1/error.json", root) != std::string::npos);
  }
  json mine = json::parse(read_file(d / "mine.json"));
  json theirs = json::parse(read_file(d / "theirs.json"));
  CHECK(mine["message"]["message"] == theirs["message"]["message"]);
  CHECK(mine["message"]["errorCode"] == theirs["message"]["errorCode"]);
  CHECK(mine["message"]["extraInfo"]["py_callstack"] ==
        theirs["message"]["extraInfo"]["py_callstack"]);
}

TEST_CASE(
    "a torch.distributed.launch script gets the same --local_rank and macros under trun "
    "--legacy-launch and abbreviated options",
    "[torch]") {
  std::string why;
  if (!torch_available(why)) TRUN_SKIP(why, kSetup);
  // Abbreviations as argparse takes them (--nproc_per, --nnode), before the script only.
  const std::vector<std::string> args{"--nnode=1", script("legacy_local_rank.py"), "a",
                                      "${local_rank}", "$$"};
  auto printed = [](const std::string& out) {
    std::vector<std::string> lines;
    for (const auto& l : lines_of(out)) {
      if (l.rfind("local_rank=", 0) == 0) lines.push_back(l);
    }
    std::sort(lines.begin(), lines.end());
    return lines;
  };
  std::vector<std::string> mine_args{"--legacy-launch", "--nproc_per=2"};
  mine_args.insert(mine_args.end(), args.begin(), args.end());
  auto a = run_trun(mine_args, {{"PYTHON_EXEC", kPython}}, std::chrono::seconds(180));
  INFO("trun stderr:\n" << a.err);
  REQUIRE(a.exit_code == 0);
  auto b = run_torchrun(args, {}, {kPython, "-m", "torch.distributed.launch"});
  INFO("torch.distributed.launch stderr:\n" << b.err);
  REQUIRE(b.exit_code == 0);
  CHECK(printed(a.out) ==
        std::vector<std::string>{"local_rank=0 LOCAL_RANK=0 rest=['a', '0', '$']",
                                 "local_rank=1 LOCAL_RANK=1 rest=['a', '1', '$']"});
  CHECK(printed(a.out) == printed(b.out));
}

TEST_CASE("torchelastic's Event.deserialize reads every line of trun's --event-log", "[torch]") {
  std::string why;
  if (!torch_available(why)) TRUN_SKIP(why, kSetup);
  TempDir d;
  const std::string log = d / "events.jsonl";
  auto r = run_trun({"--standalone", "--nproc-per-node=2", "--max-restarts=1", "--event-log", log,
                     test_worker(), "on-attempt", "0", "on-rank", "1", "exit", "3"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  Child py({kPython, script("read_events.py"), log});
  REQUIRE(py.wait(std::chrono::seconds(120)));
  INFO(py.err());
  REQUIRE(py.exit_code() == 0);
  const auto lines = lines_of(py.out());
  REQUIRE(lines.size() == lines_of(read_file(log)).size());
  REQUIRE(lines.size() >= 10);
  CHECK_THAT(lines.front(), Catch::StartsWith("trun.agent.start AGENT True "));
  CHECK_THAT(lines.back(), Catch::StartsWith("trun.agent.stop AGENT True "));
  int restarts = 0;
  for (const auto& l : lines) restarts += l.rfind("trun.agent.restart ", 0) == 0 ? 1 : 0;
  CHECK(restarts == 1);
}
