// The hostile-input suite (issue 42), area `trun timeline` and `trun status` display: black-box
// cases against the real trun binary. Each one runs trun in a child with a bound on its time (and
// its peak RSS measured by wait4), so a regression shows as a failed case, never a hung suite.
//
// Cases: /dev/zero, a FIFO with no writer, a file over --max-input-size (sparse: no disk), the
// output equal to an input (the same path, a hard link, a symbolic link) or a FIFO, JSON bombs
// (deep nesting, a 10 MB string, a line without end, numbers out of range, a million garbage
// lines, a 900 KB label repeated in thousands of bars), timestamps of -2^63 and 2^64-1, control
// characters in the page and in trun status (a real agent's store, its status record replaced
// by one holding OSC/BEL/CSI sequences and a timestamp of -2^63), and, in builds without a
// sanitizer, the same inputs under an address-space limit (RLIMIT_AS).
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "agent/node_status.h"
#include "store/tcp_store.h"
#include "tests/launcher/free_port.h"
#include "tests/launcher/process_util.h"
#include "tests/rendezvous/test_options.h"
#include "tests/sanitizer.h"

using namespace trun::testing;
using namespace std::chrono_literals;

namespace {

struct Outcome {
  bool finished = false;  // within the time bound (else killed)
  int exit_code = -1;     // 128+N for a signal
  long max_rss_kb = 0;
  std::string out, err;
};

// Runs trun with `args`, at most `limit` (then SIGKILL), with an address-space limit when
// `as_bytes` > 0 (set in the child before exec). Output goes to files in a temporary directory.
Outcome run_bounded(const std::vector<std::string>& args, std::chrono::seconds limit = 30s,
                    uint64_t as_bytes = 0) {
  TempDir d;
  const std::string out_path = d / "out", err_path = d / "err";
  std::vector<std::string> argv{trun_binary()};
  argv.insert(argv.end(), args.begin(), args.end());
  const pid_t pid = fork();
  if (pid == 0) {
    int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int err = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(out, 1);
    dup2(err, 2);
    int devnull = open("/dev/null", O_RDONLY);
    dup2(devnull, 0);
    if (as_bytes > 0) {
      struct rlimit rl {
        as_bytes, as_bytes
      };
      setrlimit(RLIMIT_AS, &rl);
    }
    std::vector<char*> a;
    for (const auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
    a.push_back(nullptr);
    execv(a[0], a.data());
    _exit(127);
  }
  Outcome o;
  int status = 0;
  struct rusage ru {};
  const auto end = std::chrono::steady_clock::now() + limit;
  pid_t r = 0;
  while ((r = wait4(pid, &status, WNOHANG, &ru)) == 0 && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(5ms);
  }
  o.finished = r == pid;
  if (!o.finished) {
    kill(pid, SIGKILL);
    wait4(pid, &status, 0, &ru);
  }
  o.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  o.max_rss_kb = ru.ru_maxrss;
  o.out = read_file(out_path);
  o.err = read_file(err_path);
  return o;
}

// The text when it is exactly one line (with its newline), else "".
std::string one_line(const std::string& text) {
  if (text.empty() || text.back() != '\n') return "";
  return text.find('\n') == text.size() - 1 ? text : "";
}

bool contains(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

// Bytes a terminal or an XML parser would act on: C0 controls but newline and tab, DEL, and the
// C1 controls as UTF-8 (U+0080..U+009F: C2 80..C2 9F), and lone bytes 80..9F.
bool has_control_bytes(const std::string& text) {
  for (size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if ((c < 0x20 && c != '\n' && c != '\t') || c == 0x7F) return true;
    if (c == 0xC2 && i + 1 < text.size()) {
      const auto n = static_cast<unsigned char>(text[i + 1]);
      if (n >= 0x80 && n <= 0x9F) return true;
    }
  }
  return false;
}

std::string event(const std::string& name, int64_t ts, const nlohmann::json& extra = {}) {
  nlohmann::json md = {{"run_id", "job"}, {"hostname", "h"}, {"pid", 7}};
  for (const auto& [k, v] : extra.items()) md[k] = v;
  return nlohmann::json({{"name", name}, {"source", "AGENT"}, {"timestamp", ts}, {"metadata", md}})
      .dump();
}

void write(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// A sparse file of `bytes` (no disk used).
void write_sparse(const std::string& path, off_t bytes) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  REQUIRE(fd >= 0);
  REQUIRE(ftruncate(fd, bytes) == 0);
  close(fd);
}

constexpr long kMaxRssKb = 400 * 1024;  // far above what trun needs here, ASan included

}  // namespace

TEST_CASE("trun timeline refuses /dev/zero at once, in one line", "[hostile][timeline]") {
  TempDir d;
  Outcome o = run_bounded({"timeline", "/dev/zero", "-o", d / "x.html"}, 20s);
  INFO(o.err);
  REQUIRE(o.finished);
  CHECK(o.exit_code == 1);
  CHECK(one_line(o.err) ==
        "trun timeline: error: cannot read the event log /dev/zero: is a character device, not "
        "a regular file\n");
  CHECK(o.max_rss_kb < kMaxRssKb);
  CHECK_FALSE(file_exists(d / "x.html"));
}

TEST_CASE("trun timeline refuses a FIFO with no writer at once, in one line",
          "[hostile][timeline]") {
  TempDir d;
  const std::string fifo = d / "events.jsonl";
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  Outcome o = run_bounded({"timeline", fifo, "-o", d / "x.html"}, 20s);
  INFO(o.err);
  REQUIRE(o.finished);
  CHECK(o.exit_code == 1);
  CHECK(one_line(o.err) == "trun timeline: error: cannot read the event log " + fifo +
                               ": is a FIFO (named pipe), not a regular file\n");
  // A directory too (the same check).
  o = run_bounded({"timeline", d.path(), "-o", d / "x.html"}, 20s);
  CHECK(o.exit_code == 1);
  CHECK(contains(one_line(o.err), "is a directory, not a regular file"));
}

TEST_CASE("trun timeline refuses input over --max-input-size before reading it, in one line",
          "[hostile][timeline]") {
  TempDir d;
  const std::string big = d / "big.jsonl";
  write_sparse(big, off_t{500} << 20);
  Outcome o = run_bounded({"timeline", big, "-o", d / "x.html"}, 30s);
  INFO(o.err);
  REQUIRE(o.finished);
  CHECK(o.exit_code == 1);
  CHECK(one_line(o.err) == "trun timeline: error: the event log " + big +
                               " is 500.0 MiB (524288000 bytes): over --max-input-size 64.0 MiB "
                               "(67108864 bytes) (raise it to draw larger logs)\n");
  CHECK(o.max_rss_kb < kMaxRssKb);

  // The bound holds for all the files together, and can be set.
  const std::string a = d / "a.jsonl", b = d / "b.jsonl";
  std::string lines;
  for (int i = 0; i < 10; ++i) lines += event("trun.agent.start", 1000 + i) + "\n";
  write(a, lines);
  write(b, lines);
  const std::string size = std::to_string(lines.size() + lines.size() / 2);
  o = run_bounded({"timeline", a, b, "--max-input-size", size, "-o", d / "x.html"});
  CHECK(o.exit_code == 1);
  CHECK(contains(one_line(o.err), "the event log " + b + " is "));
  CHECK(contains(o.err, " with the files before it: over --max-input-size"));
  const std::string kib = std::to_string(2 * lines.size() / 1024 + 1) + "K";
  o = run_bounded({"timeline", a, b, "--max-input-size=" + kib, "-o", d / "x.html"});
  CHECK(o.exit_code == 0);
  // 123456789012345G is below 2^64 as a number but wraps past it as bytes.
  for (const char* bad : {"0", "-1", "1T", "x", "", "99999999999999999999", "123456789012345G"}) {
    o = run_bounded({"timeline", a, "--max-input-size=" + std::string(bad), "-o", d / "x.html"});
    INFO(bad << ": " << o.err);
    CHECK(o.exit_code == 2);
    CHECK(contains(o.err, "--max-input-size=" + std::string(bad) + ": expected a positive"));
  }
}

// An address-space limit is only possible without a sanitizer: ASan reserves terabytes of
// shadow memory at start, so under RLIMIT_AS the ASan build of trun cannot even start. The cases
// above and below run in every build; this one only in builds without a sanitizer (not registered
// elsewhere).
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
namespace {

// A valid log of about `bytes`: workers starting and exiting, lines of about 380 bytes.
void write_large_log(const std::string& path, size_t bytes) {
  std::ofstream out(path, std::ios::binary);
  size_t written = 0;
  for (int64_t i = 0; written < bytes; ++i) {
    nlohmann::json md = {{"run_id", "job"},
                         {"hostname", "host-" + std::to_string(i % 4)},
                         {"pid", 1000 + i % 4},
                         {"node_id", "node-" + std::to_string(i % 4)},
                         {"round", i / 1000},
                         {"local_rank", i % 8},
                         {"global_rank", i % 8},
                         {"worker_pid", 100000 + i / 2},
                         {"agent_restarts", i / 1000},
                         {"entrypoint", "/usr/bin/python3"}};
    if (i % 2 == 1) {
      md["exitcode"] = 0;
      md["state"] = "SUCCEEDED";
    }
    const std::string line = nlohmann::json({{"name", i % 2 == 0 ? "trun.agent.worker_started"
                                                                 : "trun.agent.worker_exited"},
                                             {"source", "AGENT"},
                                             {"timestamp", 1700000000000 + i},
                                             {"metadata", md}})
                                 .dump() +
                             "\n";
    out << line;
    written += line.size();
  }
}

}  // namespace

TEST_CASE("trun timeline under an address-space limit: one line, never an abort",
          "[hostile][timeline][rlimit]") {
  TempDir d;
  // A 500 MB file: refused by its size before anything is allocated (it aborted with 134).
  const std::string sparse = d / "sparse.jsonl";
  write_sparse(sparse, off_t{500} << 20);
  Outcome o = run_bounded({"timeline", sparse, "-o", d / "x.html"}, 30s, uint64_t{512} << 20);
  INFO(o.err);
  REQUIRE(o.finished);
  CHECK(o.exit_code == 1);
  CHECK(contains(one_line(o.err), "over --max-input-size"));

  // A valid 38 MB log (within the size bound) needs about 400 MB: under 200 MB trun runs out
  // of memory and says so in one line.
  const std::string log = d / "large.jsonl";
  write_large_log(log, size_t{38} << 20);
  o = run_bounded({"timeline", log, "-o", d / "x.html"}, 120s, uint64_t{200} << 20);
  INFO(o.err);
  REQUIRE(o.finished);
  CHECK(o.exit_code == 1);
  CHECK(contains(one_line(o.err), "trun timeline: error: out of memory after reading "));
  CHECK_FALSE(file_exists(d / "x.html"));
  // Without the limit it is drawn.
  o = run_bounded({"timeline", log, "-o", d / "x.html"}, 120s);
  CHECK(o.exit_code == 0);
  CHECK(file_exists(d / "x.html"));
}
#endif

TEST_CASE("trun timeline never writes its page over an input or through a link or a FIFO",
          "[hostile][timeline]") {
  TempDir d;
  const std::string log = d / "x.jsonl";
  const std::string text = event("trun.agent.start", 1000) + "\n" + event("trun.agent.stop", 2000);
  write(log, text);
  struct Case {
    std::string output;
    std::string message;
  };
  REQUIRE(link(log.c_str(), (d / "hard.jsonl").c_str()) == 0);
  REQUIRE(symlink(log.c_str(), (d / "soft.html").c_str()) == 0);
  REQUIRE(mkfifo((d / "fifo.html").c_str(), 0600) == 0);
  for (const Case& c :
       {Case{log, "-o " + log + " is the event log " + log +
                      " (the same file): refusing to overwrite an input"},
        Case{d / "hard.jsonl", "-o " + d / "hard.jsonl" + " is the event log " + log +
                                   " (the same file): refusing to overwrite an input"},
        Case{d / "soft.html", "-o " + d / "soft.html" +
                                  " is a symbolic link: the page is written only to a new or a "
                                  "regular file"},
        Case{d / "fifo.html", "-o " + d / "fifo.html" +
                                  " is a FIFO (named pipe): the page is written only to a new or "
                                  "a regular file"}}) {
    Outcome o = run_bounded({"timeline", log, "-o", c.output}, 20s);
    INFO(c.output << ": " << o.err);
    REQUIRE(o.finished);
    CHECK(o.exit_code == 2);
    CHECK(one_line(o.err) == "trun timeline: error: " + c.message + "\n");
    CHECK(read_file(log) == text);
  }
  struct stat st {};
  REQUIRE(lstat((d / "fifo.html").c_str(), &st) == 0);
  CHECK(S_ISFIFO(st.st_mode));
  REQUIRE(lstat((d / "soft.html").c_str(), &st) == 0);
  CHECK(S_ISLNK(st.st_mode));
  // An existing regular output is replaced (not written through: the hard link keeps the old).
  write(d / "page.html", "old");
  REQUIRE(link((d / "page.html").c_str(), (d / "page-link.html").c_str()) == 0);
  Outcome o = run_bounded({"timeline", log, "-o", d / "page.html"}, 20s);
  CHECK(o.exit_code == 0);
  CHECK(contains(read_file(d / "page.html"), "<svg"));
  CHECK(read_file(d / "page-link.html") == "old");
  // Nothing but the page is left next to it (its temporary file was renamed).
  int entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(d.path())) {
    (void)e;
    ++entries;
  }
  CHECK(entries == 6);  // x.jsonl hard.jsonl soft.html fifo.html page.html page-link.html
}

TEST_CASE("trun timeline skips JSON bombs line by line with bounded memory",
          "[hostile][timeline]") {
  TempDir d;
  const std::string log = d / "bombs.jsonl";
  {
    std::ofstream out(log, std::ios::binary);
    out << event("trun.agent.start", 1000) << "\n";  // 1
    out << std::string(1000000, '[') << "\n";        // 2
    out << "{\"name\":\"x\",\"timestamp\":1,\"metadata\":{\"s\":\"" << std::string(10 << 20, 'a')
        << "\"}}\n";                                                              // 3
    out << "{\"a\":" << std::string(200, '{') << std::string(200, '}') << "}\n";  // 4
    out << R"({"name":"x","timestamp":1e999999,"metadata":{}})"
        << "\n";  // 5
    out << R"({"name":"x","timestamp":123456789012345678901234567890,"metadata":{}})"
        << "\n";  // 6
    out << R"({"name":"x","timestamp":1,"metadata":{"n":-1e999999}})"
        << "\n";                                    // 7
    out << event("trun.agent.stop", 3000) << "\n";  // 8
    out << std::string(3 << 20, 'x');               // 9: a last line without its end, over 1 MiB
  }
  Outcome o = run_bounded({"timeline", log, "-o", d / "x.html"}, 60s);
  INFO(o.err);
  REQUIRE(o.finished);
  CHECK(o.exit_code == 0);
  CHECK(contains(o.err, "bombs.jsonl:2: not an event (nested deeper than 16 levels); skipped"));
  CHECK(contains(o.err, "bombs.jsonl:3: not an event (longer than 1 MiB); skipped"));
  CHECK(contains(o.err, "bombs.jsonl:4: not an event (nested deeper than 16 levels); skipped"));
  CHECK(contains(o.err, "bombs.jsonl:5: not an event"));
  CHECK(contains(o.err, "bombs.jsonl:6: not an event"));
  CHECK(contains(o.err, "bombs.jsonl: 2 more line(s) skipped"));  // 7 (a number) and 9
  CHECK(o.max_rss_kb < kMaxRssKb);
  CHECK(contains(read_file(d / "x.html"), "spanning 2.000 s"));

  // A million garbage lines: five warnings and a count, not a million lines.
  {
    std::ofstream out(log, std::ios::binary | std::ios::trunc);
    out << event("trun.agent.start", 1000) << "\n";
    for (int i = 0; i < 1000000; ++i) out << "]\n";
  }
  o = run_bounded({"timeline", log, "-o", d / "x.html"}, 60s);
  REQUIRE(o.finished);
  CHECK(o.exit_code == 0);
  CHECK(lines_of(o.err).size() == 6);
  CHECK(contains(o.err, "bombs.jsonl: 999995 more line(s) skipped"));

  // A 900 KB node id, then 5000 workers of that node: the label is cut, so the page stays
  // small (in full it would be repeated three times in each bar: 13 GB).
  {
    std::ofstream out(log, std::ios::binary | std::ios::trunc);
    out << event("trun.rdzv.join", 1000, {{"node_id", std::string(900000, 'n')}}) << "\n";
    for (int i = 0; i < 5000; ++i) {
      out << event("trun.agent.worker_started", 1001 + i, {{"local_rank", i}, {"worker_pid", i}})
          << "\n";
    }
  }
  o = run_bounded({"timeline", log, "-o", d / "x.html"}, 60s);
  INFO(o.err);
  REQUIRE(o.finished);
  CHECK(o.exit_code == 0);
  CHECK(o.max_rss_kb < kMaxRssKb);
  struct stat st {};
  REQUIRE(stat((d / "x.html").c_str(), &st) == 0);
  CHECK(st.st_size < (64 << 20));
}

TEST_CASE("trun timeline refuses timestamps out of range instead of drawing nonsense spans",
          "[hostile][timeline]") {
  TempDir d;
  const std::string log = d / "ts.jsonl";
  write(
      log,
      event("trun.agent.start", 1000) + "\n" +
          R"({"name":"trun.agent.stop","timestamp":-9223372036854775808,"metadata":{"run_id":"job","hostname":"h","pid":7}})"
          "\n" +
          R"({"name":"trun.agent.stop","timestamp":9223372036854775807,"metadata":{"run_id":"job","hostname":"h","pid":7}})"
          "\n" +
          R"({"name":"trun.agent.stop","timestamp":18446744073709551615,"metadata":{"run_id":"job","hostname":"h","pid":7}})"
          "\n" +
          event("trun.agent.stop", -1) + "\n" + event("trun.agent.stop", 3000) + "\n");
  Outcome o = run_bounded({"timeline", log, "-o", d / "x.html"}, 20s);
  INFO(o.err);
  REQUIRE(o.finished);
  CHECK(o.exit_code == 0);
  CHECK(contains(o.err,
                 "ts.jsonl:2: not an event (\"timestamp\" -9223372036854775808 out of range "
                 "(0..253402300799999 ms since the epoch)); skipped"));
  CHECK(
      contains(o.err, "ts.jsonl:3: not an event (\"timestamp\" 9223372036854775807 out of range"));
  CHECK(contains(o.err, "ts.jsonl:4: not an event (\"timestamp\" 18446744073709551615 out of"));
  CHECK(contains(o.err, "ts.jsonl:5: not an event (\"timestamp\" -1 out of range"));
  const std::string page = read_file(d / "x.html");
  CHECK(contains(page, "time 0 is 1970-01-01 00:00:01.000 UTC, spanning 2.000 s"));

  // Only out-of-range timestamps: no event, one error after the warnings.
  write(log, R"({"name":"x","timestamp":-9223372036854775808,"metadata":{}})"
             "\n"
             R"({"name":"x","timestamp":9223372036854775807,"metadata":{}})"
             "\n");
  o = run_bounded({"timeline", log, "-o", d / "y.html"}, 20s);
  CHECK(o.exit_code == 1);
  CHECK(contains(o.err, "trun timeline: error: no event in " + log));
  CHECK_FALSE(file_exists(d / "y.html"));
}

TEST_CASE("trun timeline keeps control characters out of the page and the terminal",
          "[hostile][timeline]") {
  TempDir d;
  // A file name with an escape sequence, and events whose texts hold OSC, BEL, CSI (C1) and DEL.
  const std::string log = d / "evil\x1b]0;owned\x07.jsonl";
  const std::string evil =
      "\x1b]0;owned\x07<script>\xc2\x9b"
      "31m\x7f\xe2\x80\xae";
  write(log,
        event("trun.rdzv.join", 1000, {{"node_id", evil}}) + "\n" +
            event("trun.agent.worker_started", 1100,
                  {{"local_rank", 0}, {"worker_pid", 5}, {"global_rank", 0}}) +
            "\n" +
            event("trun.agent.worker_exited", 1200,
                  {{"local_rank", 0}, {"worker_pid", 5}, {"exitcode", 1}, {"raw_error", evil}}) +
            "\ngarbage\n");
  Outcome o = run_bounded({"timeline", log, "-o", d / "x.html", "--title", evil}, 20s);
  INFO(o.err);
  REQUIRE(o.finished);
  CHECK(o.exit_code == 0);
  CHECK_FALSE(has_control_bytes(o.err));
  CHECK(contains(o.err, "evil\\x1B]0;owned\\x07.jsonl:4: not an event"));
  const std::string page = read_file(d / "x.html");
  CHECK_FALSE(has_control_bytes(page));
  CHECK_FALSE(contains(page, "<script"));
  CHECK_FALSE(contains(page, "\xe2\x80\xae"));  // RIGHT-TO-LEFT OVERRIDE
  CHECK(contains(page, "\\x1B]0;owned\\x07&lt;script&gt;\\u009B31m\\x7F\\u202E"));
}

TEST_CASE("trun status shows a store record's control characters and bad times escaped",
          "[hostile][status]") {
  TempDir d;
  const int port = free_port();
  const std::string ep = "--rdzv-endpoint=127.0.0.1:" + std::to_string(port);
  const std::string run_id = unique_run_id("hostile-status");
  Child agent({trun_binary(), "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=c10d", ep,
               "--rdzv-id=" + run_id, test_worker(), "pidfile", d.path(), "sleep", "60"},
              {}, {"TORCHELASTIC_ERROR_FILE"});
  INFO(agent.err());
  REQUIRE(wait_until([&] { return file_exists(d / "pid_0_0"); }, 60s));
  const std::vector<std::string> args{"status", "--rdzv-backend=c10d", ep, "--rdzv-id=" + run_id};
  std::vector<std::string> json_args = args;
  json_args.push_back("--json");
  nlohmann::json js;
  REQUIRE(wait_until(
      [&] {
        RunResult r = run_trun(json_args, {}, 30s);
        js = nlohmann::json::parse(r.out, nullptr, false);
        return r.exit_code == 0 && js.is_object() && js["nodes"].size() == 1 &&
               js["nodes"][0]["agent_state"] == "running";
      },
      30s));
  const std::string node_id = js["nodes"][0]["node_id"];

  // The agent writes its record when something happens (not while its worker sleeps): replace
  // it with a hostile one, as anyone who can reach the store could.
  trun::agent::NodeStatus rec;
  rec.node_id = node_id;
  rec.hostname = "h\x1b[2J";
  rec.state = "\x1b]0;owned\x07running";
  rec.last_failure =
      "\x1b]52;c;cm0gLXJmIH4=\x07 \xc2\x9b"
      "31mred\x7f";
  rec.last_failure_at = 1e300;
  rec.updated_at = -9223372036854775808.0;
  rec.local_world_size = 1;
  trun::store::TcpStoreOptions so;
  so.port = static_cast<uint16_t>(port);
  so.connect_timeout = 10s;
  {
    trun::store::TcpStore store(so);
    store.set(trun::agent::node_status_key(run_id, node_id), trun::agent::encode_node_status(rec));
  }

  RunResult table = run_trun(args, {}, 30s);
  INFO(table.out << table.err);
  CHECK(table.exit_code == 0);
  CHECK_FALSE(has_control_bytes(table.out));
  CHECK(contains(table.out, "\\x1B]0;owned\\x07running"));
  CHECK(contains(table.out, "last failure: \\x1B]52;c;cm0gLXJmIH4=\\x07 \\u009B31mred\\x7F (node " +
                                node_id + ", invalid time)"));
  CHECK(contains(table.out, "invalid time\n"));  // UPDATED, the last column

  RunResult j = run_trun(json_args, {}, 30s);
  CHECK(j.exit_code == 0);
  CHECK_FALSE(has_control_bytes(j.out));
  CHECK(std::all_of(j.out.begin(), j.out.end(),
                    [](char c) { return static_cast<unsigned char>(c) < 0x80; }));
  js = nlohmann::json::parse(j.out, nullptr, false);
  REQUIRE(js.is_object());
  CHECK(js["nodes"][0]["agent_state"] == rec.state);  // the same text, escaped as JSON
  CHECK(js["last_failure"]["message"] == rec.last_failure);
  CHECK(js["last_failure"]["at"].is_null());
  CHECK(js["nodes"][0]["updated_at"].is_null());

  agent.signal(SIGTERM);
  CHECK(agent.wait(30s));
}
