// The hostile-input suite, command line and guardian (issue 42, cases 6, 7 and the command-line
// items of 8): black-box against the real trun binary and tests/bin's trun_test_worker. Careless
// input (an empty value, a repeated option, a missing value, a zero timeout, a run id of 65 KiB,
// binary garbage) gets one `trun: error:` line and exit 2, or the meaning argparse (torchrun)
// gives it; a SIGKILLed agent's temporary directory is removed by its guardian, without
// following links.
#include <dirent.h>
#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/launcher/process_util.h"

using namespace trun::testing;
using nlohmann::json;

namespace {

std::string joined(const std::vector<std::string>& args) {
  std::string s;
  for (const auto& a : args) s += (a.size() > 80 ? a.substr(0, 80) + "..." : a) + " ";
  return s;
}

// One line on stderr, "trun: error: ...", exit 2, nothing on stdout; returns the line.
std::string usage_error(const std::vector<std::string>& args,
                        const std::map<std::string, std::string>& env = {},
                        const std::vector<std::string>& unset = {}) {
  INFO("args: " << joined(args));
  auto r = run_trun(args, env, std::chrono::seconds(60), unset);
  REQUIRE(r.finished);
  INFO("stderr: " << r.err);
  CHECK(r.exit_code == 2);
  CHECK(r.out.empty());
  const auto lines = lines_of(r.err);
  REQUIRE(lines.size() == 1);
  CHECK(lines[0].rfind("trun: error: ", 0) == 0);
  return lines.empty() ? std::string() : lines[0];
}

// trun --dry-run ARGS: the resolved configuration (exit 0 required).
json dry_run(std::vector<std::string> args) {
  args.insert(args.begin(), "--dry-run");
  INFO("args: " << joined(args));
  auto r = run_trun(args);
  REQUIRE(r.finished);
  INFO("stderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  return json::parse(r.out);
}

// The entries of a directory, "." and ".." left out.
std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    out.push_back(it->path().filename().string());
  }
  return out;
}

// The pid of trun's guardian: its child named trun-guardian (prctl PR_SET_NAME). -1: none.
pid_t guardian_of(pid_t trun) {
  for (const auto& name : entries("/proc")) {
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = read_file("/proc/" + name + "/stat");
    const auto open = stat.find('('), close = stat.rfind(')');
    if (open == std::string::npos || close == std::string::npos || close + 4 >= stat.size()) {
      continue;
    }
    const std::string comm = stat.substr(open + 1, close - open - 1);
    const long ppid = std::atol(stat.c_str() + stat.find(' ', close + 3) + 1);
    if (comm == "trun-guardian" && ppid == trun) return static_cast<pid_t>(std::stol(name));
  }
  return -1;
}

// A job of 2 workers that tee their output into the temporary log directory under `tmpdir` and
// sleep; once both run and the directory holds their logs, returns its path ("" on timeout).
struct SleepingJob {
  SleepingJob(const TempDir& d, const std::string& tmpdir)
      : child({trun_binary(), "--standalone", "--nproc-per-node", "2", "--tee", "3", test_worker(),
               "pidfile", d.path(), "print", "a line for the log", "sleep", "60"},
              {{"TMPDIR", tmpdir}}) {
    const bool up = wait_until(
        [&] {
          if (!file_exists(d / "pid_0_0") || !file_exists(d / "pid_0_1")) return false;
          for (const auto& e : entries(tmpdir)) {
            if (e.rfind("trun-", 0) == 0 &&
                file_exists(tmpdir + "/" + e + "/attempt_0/1/stdout.log")) {
              dir = tmpdir + "/" + e;
              return true;
            }
          }
          return false;
        },
        std::chrono::seconds(30));
    if (up) workers = {read_pid(d / "pid_0_0"), read_pid(d / "pid_0_1")};
    guardian = guardian_of(child.pid());
  }
  Child child;
  std::string dir;
  std::vector<pid_t> workers;
  pid_t guardian = -1;
};

// The guardian cases' scene: TMPDIR is d/tmp, and d/outside holds a file ("keep") that links
// planted in trun's directory point to; the job runs, its directory and guardian found.
struct GuardianScene {
  GuardianScene() {
    REQUIRE(::mkdir(tmpdir.c_str(), 0700) == 0);
    REQUIRE(::mkdir(outside.c_str(), 0700) == 0);
    std::ofstream(outside + "/keep") << "not trun's";
    job = std::make_unique<SleepingJob>(d, tmpdir);
    REQUIRE(!job->dir.empty());
    REQUIRE(job->guardian > 0);
  }
  TempDir d;
  const std::string tmpdir = d / "tmp";
  const std::string outside = d / "outside";
  std::unique_ptr<SleepingJob> job;
};

}  // namespace

TEST_CASE("an empty --log-dir= keeps the next option: two workers and no stray directory",
          "[hostile][cli]") {
  TempDir d;
  const std::string cwd = d / "cwd";
  REQUIRE(::mkdir(cwd.c_str(), 0700) == 0);
  // Run from `cwd`, where the old parser made a directory named --nproc-per-node=2.
  Child c({"/bin/sh", "-c", "cd \"$0\" && exec \"$@\"", cwd, trun_binary(),
           "--log-dir=", "--nproc-per-node=2", "--standalone", test_worker(), "pidfile", d.path()});
  REQUIRE(c.wait(std::chrono::seconds(60)));
  INFO("stderr: " << c.err());
  CHECK(c.exit_code() == 0);
  CHECK(file_exists(d / "pid_0_0"));
  CHECK(file_exists(d / "pid_0_1"));  // --nproc-per-node=2 was read as such
  CHECK(entries(cwd).empty());

  // The empty value as a separate argument is the same.
  auto j = dry_run({"--log-dir", "", "--nproc_per_node=3", test_worker()});
  CHECK(j["nproc_per_node"] == 3);
  CHECK(j["logs"]["log_dir"] == "");
}

TEST_CASE("an empty value is an error naming the option where one is required", "[hostile][cli]") {
  const std::string w = test_worker();
  for (const char* option :
       {"--nnodes", "--nproc-per-node", "--nproc_per_node", "--max-restarts", "--master-port",
        "--node-rank", "--rdzv-backend", "--monitor-interval", "--start-method", "--redirects",
        "--tee", "--signals-to-handle", "--shutdown-timeout", "--exit-barrier-timeout",
        "--numa-binding", "--role", "--master-addr", "--rdzv-id"}) {
    INFO(option);
    // The old parser took the worker's path as the value and then missed TRAINING_SCRIPT.
    const std::string line = usage_error({std::string(option) + "=", w});
    std::string dashed = option;
    for (auto& ch : dashed) ch = ch == '_' ? '-' : ch;
    CHECK(line.find(dashed + "=") != std::string::npos);
  }
  // A flag takes no empty value (argparse refuses any value for one).
  CHECK(usage_error({"--standalone=", w}).find("--standalone=") != std::string::npos);
  CHECK(usage_error({"-r=", w}).find("--redirects=") != std::string::npos);
}

TEST_CASE("an empty value means the default where empty is meaningful, as in torchrun",
          "[hostile][cli]") {
  const std::string w = test_worker();
  // argparse gives '' and torchrun reads it as "none given".
  auto j = dry_run({"--log-dir=", "--rdzv-endpoint=", "--rdzv-conf=", "--local-ranks-filter=",
                    "--duplicate-stdout-filters=", "--log-line-prefix-template=", "--local-addr=",
                    "--event-log=", "--metrics-port=", "--nproc-per-node=2", w});
  CHECK(j["nproc_per_node"] == 2);
  CHECK(j["entrypoint_name"] == w);
  CHECK(j["logs"]["log_dir"] == "");
  CHECK(j["rendezvous"]["conf"].empty());
  CHECK(j["logs"]["local_ranks_filter"].is_null());
  CHECK(j["logs"]["event_log"] == "");
  CHECK(j["logs"]["metrics_port"] == -1);  // no endpoint
}

TEST_CASE("an empty --rdzv-id= keeps --standalone after it", "[hostile][cli]") {
  auto j = dry_run({"--rdzv-id=", "--standalone", test_worker()});
  CHECK(j["rendezvous"]["standalone"] == true);
  CHECK(j["rendezvous"]["run_id"].is_null());  // generated when the job starts
  // Alone, an empty id is an error: torchrun would make up one that other nodes cannot know.
  CHECK(usage_error({"--rdzv-id=", test_worker()}).find("--rdzv-id=: an empty job id") !=
        std::string::npos);
}

TEST_CASE("the last of a repeated option wins, in either spelling, over PET_* too",
          "[hostile][cli]") {
  const std::string w = test_worker();
  auto j = dry_run({"--nproc-per-node=1", "--nproc_per_node=2", "--max-restarts", "1",
                    "--max_restarts=3", "--tee", "1", "-t", "2", "--rdzv-conf", "join_timeout=5",
                    "--rdzv-conf=join_timeout=7", "--standalone", "--standalone", "--role=a",
                    "--role", "b", w});
  CHECK(j["nproc_per_node"] == 2);
  CHECK(j["max_restarts"] == 3);
  CHECK(j["logs"]["tee"] == 2);
  CHECK(j["rendezvous"]["conf"]["join_timeout"] == "7");
  CHECK(j["role"] == "b");

  auto r = run_trun({"--dry-run", "--nproc-per-node=1", "--nproc-per-node=3", w},
                    {{"PET_NPROC_PER_NODE", "4"}});
  REQUIRE(r.exit_code == 0);
  CHECK(json::parse(r.out)["nproc_per_node"] == 3);

  // And a real run starts the last count of workers.
  TempDir d;
  auto run = run_trun(
      {"--standalone", "--nproc-per-node=1", "--nproc-per-node=2", w, "pidfile", d.path()});
  CHECK(run.exit_code == 0);
  CHECK(file_exists(d / "pid_0_1"));
}

TEST_CASE("an option's missing value is an error, not the next option", "[hostile][cli]") {
  const std::string w = test_worker();
  // argparse: "expected one argument" when the next argument looks like an option.
  CHECK(usage_error({"--log-dir", "--nproc-per-node=2", w}).find("--log-dir: expected a value") !=
        std::string::npos);
  CHECK(usage_error({"--log-dir", "-x", w}).find("--log-dir=-x") != std::string::npos);
  CHECK(usage_error({"--rdzv-id", "--standalone", w}).find("--rdzv-id: expected a value") !=
        std::string::npos);
  CHECK(usage_error({"-r", "--tee=3", w}).find("-r: expected a value") != std::string::npos);
  CHECK(usage_error({"--log-dir"}).find("--log-dir: expected a value") != std::string::npos);
  // A negative number is a value (and then checked), as in argparse.
  CHECK(usage_error({"--max-restarts", "-1", w}).find("--max-restarts=-1") != std::string::npos);
  // A value that starts with '-' can be given after '='.
  auto j = dry_run({"--role=-x", w});
  CHECK(j["role"] == "-x");
}

TEST_CASE("rdzv-conf durations of zero, below a millisecond, negative, nan or inf fail --dry-run",
          "[hostile][cli]") {
  const std::string w = test_worker();
  for (const char* key :
       {"keep_alive_interval", "read_timeout", "join_timeout", "timeout", "close_timeout"}) {
    for (const char* value : {"0", "1e-9", "0.0004", "-1", "nan", "inf", "1e8", "", "-0"}) {
      const std::string entry = std::string(key) + "=" + value;
      INFO(entry);
      // Both backends read --rdzv-conf through the same step, so the static backend gets one key
      // (every value) and c10d all of them: the 90 sanitized trun runs of both took 38 s of CI.
      std::vector<const char*> backends = {"c10d"};
      if (std::string(key) == "join_timeout") backends.push_back("static");
      for (const char* backend : backends) {
        const std::string line =
            usage_error({"--dry-run", std::string("--rdzv-backend=") + backend,
                         "--rdzv-endpoint=127.0.0.1:29400", "--rdzv-conf", entry, w});
        CHECK(line.find("--rdzv-conf " + entry + ": expected") != std::string::npos);
        CHECK(line.find("0.001") != std::string::npos);  // the accepted range
      }
    }
  }
  for (const char* key : {"last_call_timeout", "progress_interval"}) {
    const std::string line =
        usage_error({"--dry-run", "--rdzv-conf", std::string(key) + "=1e-9", w});
    CHECK(line.find("or 0 (") != std::string::npos);
    // 0 is meaningful here (no last call; no progress lines).
    dry_run({"--rdzv-conf", std::string(key) + "=0", w});
  }
  CHECK(usage_error({"--dry-run", "--rdzv-conf", "keep_alive_max_attempt=0", w})
            .find("keep_alive_max_attempt=0") != std::string::npos);
  auto j = dry_run({"--rdzv-conf", "read_timeout=0.001,keep_alive_interval=1e7", w});
  CHECK(j["rendezvous"]["conf"]["read_timeout"] == "0.001");
}

TEST_CASE("a run id over 255 bytes exits 2 at once without echoing it, 65 KiB included",
          "[hostile][cli]") {
  const std::string w = test_worker();
  for (size_t n : {size_t{256}, size_t{65 * 1024}}) {
    const std::string line = usage_error({"--rdzv-id=" + std::string(n, 'a'), w});
    CHECK(line.find("--rdzv-id: " + std::to_string(n) + " bytes; a job id has at most 255") !=
          std::string::npos);
    CHECK(line.size() < 400);
    // --dry-run and the dynamic backend refuse it the same way, before any store is involved.
    usage_error({"--dry-run", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:1",
                 "--rdzv-id=" + std::string(n, 'a'), w});
  }
  auto j = dry_run({"--rdzv-id=" + std::string(255, 'a'), w});
  CHECK(j["rendezvous"]["run_id"] == std::string(255, 'a'));
  // trun status too: one line, exit 2, before it connects to anything.
  auto r = run_trun({"status", "--rdzv-id=" + std::string(65 * 1024, 'a')}, {},
                    std::chrono::seconds(60));
  REQUIRE(r.finished);
  CHECK(r.exit_code == 2);
  CHECK(r.err == "trun status: error: --rdzv-id: 66560 bytes; a job id has at most 255\n");
}

TEST_CASE("an empty SLURM_STEP_NODELIST is reported as what it is", "[hostile][cli]") {
  const std::map<std::string, std::string> step = {
      {"SLURM_JOB_ID", "12"},       {"SLURM_STEP_ID", "0"},        {"SLURM_STEP_NODELIST", ""},
      {"SLURM_JOB_NODELIST", "n1"}, {"SLURM_STEP_NUM_NODES", "1"}, {"SLURM_NODEID", "0"}};
  const std::vector<std::string> unset = {"TRUN_SLURM", "SLURM_NODELIST"};
  INFO("the old message was a missing --rdzv-endpoint");
  auto r = run_trun({"--dry-run", test_worker()}, step, std::chrono::seconds(60), unset);
  REQUIRE(r.finished);
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("trun: error: SLURM_STEP_NODELIST is set but empty") != std::string::npos);
  CHECK(r.err.find("needs --rdzv-endpoint") == std::string::npos);
  // Given the endpoint, nothing needs the list.
  auto ok = run_trun({"--dry-run", "--rdzv-endpoint=127.0.0.1:29400", test_worker()}, step,
                     std::chrono::seconds(60), unset);
  CHECK(ok.exit_code == 0);
}

TEST_CASE("trun --help says the --numa-binding modes are applied", "[hostile][cli]") {
  auto r = run_trun({"--help"});
  REQUIRE(r.exit_code == 0);
  const auto at = r.out.find("--numa-binding,--numa_binding");
  REQUIRE(at != std::string::npos);
  const std::string entry = r.out.substr(at, r.out.find("\n  --", at + 1) - at);
  INFO(entry);
  CHECK(entry.find("refused") == std::string::npos);
  CHECK(entry.find("Bind each worker") != std::string::npos);
  CHECK(entry.find("core-complex") != std::string::npos);
}

TEST_CASE("unknown options, non-numeric and huge values, and binary garbage get one line and 2",
          "[hostile][cli]") {
  const std::string w = test_worker();
  usage_error({"--definitely-not-an-option", w});
  usage_error({"--nproc-per-nodes=2", w});
  usage_error({"-z", w});
  usage_error({"--master=1", w});  // ambiguous prefix
  for (const char* arg :
       {"--nnodes=x", "--max-restarts=1.5", "--master-port=port", "--node-rank=one",
        "--nproc-per-node=99999999999999999999", "--max-restarts=1e100",
        "--master-port=18446744073709551616", "--shutdown-timeout=1e400",
        "--monitor-interval=1e308", "--nnodes=1:99999999999999999999",
        "--local-ranks-filter=99999999999", "--tee=99999999999:1", "--metrics-port=-1",
        "--exit-barrier-timeout=-5", "--rdzv-conf=join_timeout=1e999"}) {
    usage_error({arg, w});
  }
  // Every byte but NUL, control characters and invalid UTF-8 included: one line, and nothing a
  // terminal would act on reaches it (a newline, ESC, BEL are escaped as \xNN).
  std::string garbage;
  for (int b = 1; b < 256; ++b) garbage.push_back(static_cast<char>(b));
  garbage += "\x1b]0;pwned\x07\n\r";
  for (const char* option :
       {"--rdzv-id", "--rdzv-backend", "--nnodes", "--tee", "--signals-to-handle", "--rdzv-conf",
        "--nproc-per-node", "--start-method", "--numa-binding", "--rdzv-endpoint"}) {
    INFO(option);
    std::vector<std::string> args{std::string(option) + "=" + garbage};
    if (std::string(option) == "--rdzv-endpoint") args.insert(args.begin(), "--rdzv-backend=c10d");
    args.push_back(w);
    const std::string line = usage_error(args);
    for (char ch : line) {
      const auto u = static_cast<unsigned char>(ch);
      CHECK((u >= 0x20 && u != 0x7f));
    }
    // Echoed escaped (a run id this long is not echoed at all).
    if (std::string(option) != "--rdzv-id") CHECK(line.find("\\x1b") != std::string::npos);
  }
}

TEST_CASE("a SIGKILLed agent's temporary directory is removed by its guardian", "[hostile][kill]") {
  // Outside the directory: a file and a directory that links inside it point to.
  GuardianScene scene;
  const std::string& tmpdir = scene.tmpdir;
  const std::string& outside = scene.outside;
  SleepingJob& job = *scene.job;
  REQUIRE(::symlink(outside.c_str(), (job.dir + "/dir_link").c_str()) == 0);
  REQUIRE(::symlink((outside + "/keep").c_str(), (job.dir + "/attempt_0/file_link").c_str()) == 0);
  REQUIRE(::mkdir((job.dir + "/deep").c_str(), 0700) == 0);
  REQUIRE(::mkdir((job.dir + "/deep/er").c_str(), 0700) == 0);
  std::ofstream(job.dir + "/deep/er/f") << "x";

  job.child.signal(SIGKILL);
  REQUIRE(job.child.wait(std::chrono::seconds(10)));
  for (pid_t p : job.workers) {
    CHECK(wait_until([&] { return !pid_alive(p); }, std::chrono::seconds(10)));
  }
  // The guardian removes the directory once the workers are dead, then exits.
  CHECK(wait_until([&] { return !pid_alive(job.guardian); }, std::chrono::seconds(20)));
  INFO("left in TMPDIR: " << joined(entries(tmpdir)));
  CHECK(wait_until([&] { return entries(tmpdir).empty(); }, std::chrono::seconds(5)));
  // The links went, not what they point to.
  CHECK(read_file(outside + "/keep") == "not trun's");
  CHECK(entries(outside).size() == 1);
}

TEST_CASE("the guardian does not follow a link put in place of the temporary directory",
          "[hostile][kill]") {
  GuardianScene scene;
  const std::string& outside = scene.outside;
  SleepingJob& job = *scene.job;
  // trun's directory moves away and a link to `outside` takes its name.
  const std::string moved = scene.d / "moved";
  REQUIRE(std::rename(job.dir.c_str(), moved.c_str()) == 0);
  REQUIRE(::symlink(outside.c_str(), job.dir.c_str()) == 0);

  job.child.signal(SIGKILL);
  REQUIRE(job.child.wait(std::chrono::seconds(10)));
  CHECK(wait_until([&] { return !pid_alive(job.guardian); }, std::chrono::seconds(20)));
  CHECK(read_file(outside + "/keep") == "not trun's");
  struct stat st;
  CHECK(::lstat(job.dir.c_str(), &st) == 0);              // the link itself is not trun's directory
  CHECK(file_exists(moved + "/attempt_0/0/stdout.log"));  // nor is the moved directory
}

TEST_CASE("a job that ends in order leaves no temporary directory, and the guardian goes too",
          "[hostile][kill]") {
  TempDir d;
  const std::string tmpdir = d / "tmp";
  REQUIRE(::mkdir(tmpdir.c_str(), 0700) == 0);
  Child c({trun_binary(), "--standalone", "--nproc-per-node", "2", "--tee", "3", test_worker(),
           "pidfile", d.path(), "wait-file", d / "go"},
          {{"TMPDIR", tmpdir}});
  REQUIRE(wait_until([&] { return file_exists(d / "pid_0_1"); }, std::chrono::seconds(30)));
  const pid_t guardian = guardian_of(c.pid());
  REQUIRE(guardian > 0);
  std::ofstream(d / "go") << "";
  REQUIRE(c.wait(std::chrono::seconds(30)));
  CHECK(c.exit_code() == 0);
  CHECK(entries(tmpdir).empty());
  CHECK(wait_until([&] { return !pid_alive(guardian); }, std::chrono::seconds(10)));
}
