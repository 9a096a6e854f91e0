// The hostile-input suite, store area (issue 42): black-box cases against the real `trun store`
// (and the store `trun --standalone` embeds), each asserting the outcome, the store process's RSS
// and descriptor count (/proc/PID/status, /proc/PID/fd), and that a well-behaved client is served
// throughout (its PING answered within 100 ms, measured again and again during the abuse).
//
// RSS under ASan: the store is started with ASAN_OPTIONS=quarantine_size_mb=0, so that freed
// blocks go back to the allocator at once instead of into ASan's 256 MiB quarantine (which would
// make RSS grow with every reply sent, fixed or not). With that, RSS measures what the store
// holds, in the plain and the sanitizer build alike, and these cases need no no_sanitize label.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <dirent.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "store/tcp_store.h"
#include "store/wire.h"
#include "tests/launcher/process_util.h"
#include "tests/store/raw_socket.h"

using namespace std::chrono_literals;
using trun::store::StoreError;
using trun::store::StoreTimeoutError;
using trun::store::TcpStore;
using trun::store::TcpStoreOptions;
namespace wire = trun::store::wire;
using trun::testing::Child;
using trun::testing::wait_until;
using wire::Encoder;
using wire::Op;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint64_t kMiB = 1024 * 1024;

// The resident set of `pid`, in bytes (VmRSS); 0 when it cannot be read.
uint64_t rss_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

// Open descriptors of `pid`.
int fds_of(pid_t pid) {
  std::string path = "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = opendir(path.c_str());
  if (!d) return -1;
  int n = 0;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(d);
  return n;
}

// The TCP port `pid` listens on (IPv4 loopback or any), or 0: its socket descriptors matched
// against /proc/net/tcp's listening entries. For a store whose port a test cannot choose.
uint16_t listening_port_of(pid_t pid) {
  std::vector<std::string> inodes;
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      char target[256];
      ssize_t n = readlink((dir + "/" + e->d_name).c_str(), target, sizeof(target) - 1);
      if (n <= 0) continue;
      std::string t(target, size_t(n));
      if (t.rfind("socket:[", 0) == 0) inodes.push_back(t.substr(8, t.size() - 9));
    }
    closedir(d);
  }
  std::ifstream tcp("/proc/net/tcp");
  std::string line;
  std::getline(tcp, line);  // header
  while (std::getline(tcp, line)) {
    std::istringstream f(line);
    std::string sl, local, remote, st, queues, tr, retr, uid, timeout, inode;
    f >> sl >> local >> remote >> st >> queues >> tr >> retr >> uid >> timeout >> inode;
    if (st != "0A") continue;  // TCP_LISTEN
    if (std::find(inodes.begin(), inodes.end(), inode) == inodes.end()) continue;
    return static_cast<uint16_t>(std::stoul(local.substr(local.find(':') + 1), nullptr, 16));
  }
  return 0;
}

std::string env_with_quiet_asan() {
  const char* old = std::getenv("ASAN_OPTIONS");
  std::string v = old ? std::string(old) + ":" : std::string();
  return v + "quarantine_size_mb=0";
}

// `trun store` on a free loopback port, stopped by pid (SIGTERM, then SIGKILL) at the end.
class StoreProcess {
 public:
  explicit StoreProcess(std::vector<std::string> args, std::string token = "") {
    std::vector<std::string> argv{
        trun::testing::trun_binary(), "store", "--host", "127.0.0.1", "--port", "0"};
    argv.insert(argv.end(), args.begin(), args.end());
    std::map<std::string, std::string> env{{"ASAN_OPTIONS", env_with_quiet_asan()}};
    std::vector<std::string> unset{"TRUN_STORE_TOKEN"};
    if (!token.empty()) {
      env["TRUN_STORE_TOKEN"] = token;
      unset.clear();
    }
    child_ = std::make_unique<Child>(argv, env, unset);
    std::string out;
    REQUIRE(wait_until(
        [&] {
          out = child_->out();
          return out.find('\n') != std::string::npos || !child_->running();
        },
        30s));
    // "trun store listening on HOST:PORT[ (token required)]", or for a relay "trun store
    // relaying HOST:PORT to UPSTREAM".
    INFO("trun store said: " << out << child_->err());
    const bool relay = out.find("relaying ") != std::string::npos;
    REQUIRE((relay || out.find("listening on") != std::string::npos));
    size_t end =
        relay ? out.find(" to ") : out.find_first_of(" \n", out.find("listening on ") + 13);
    auto colon = out.rfind(':', end);
    port_ = static_cast<uint16_t>(std::stoi(out.substr(colon + 1)));
  }
  ~StoreProcess() {
    if (child_->running()) {
      child_->signal(SIGTERM);
      if (!child_->wait(10s)) child_->signal(SIGKILL);
      child_->wait(10s);
    }
  }
  pid_t pid() const { return child_->pid(); }
  uint16_t port() const { return port_; }
  std::string err() const { return child_->err(); }
  bool running() { return child_->running(); }

 private:
  std::unique_ptr<Child> child_;
  uint16_t port_ = 0;
};

// A raw TCP client, for sending exactly the bytes a test wants.
using Raw = trun::testing::RawSocket;

std::string hello() {
  std::string s;
  Encoder(&s).query(Op::kValidate).u32(wire::kValidationMagic);
  return s;
}

uint64_t read_len(const std::string& reply) {
  uint64_t len = 0;
  if (reply.size() >= 8) std::memcpy(&len, reply.data(), 8);
  return len;
}

// A well-behaved client that PINGs and times the answer.
class Pinger {
 public:
  explicit Pinger(uint16_t port) : raw_(port) { raw_.send(hello()); }
  // The round trip of one PING, or 10 s when it was not answered (correctly) within that.
  std::chrono::milliseconds ping() {
    std::string msg;
    Encoder(&msg).query(Op::kPing).u32(++nonce_);
    auto t0 = Clock::now();
    raw_.send(msg);
    std::string reply;
    if (!raw_.recv_exact(&reply, 4, 10s)) return 10s;
    uint32_t echo = 0;
    std::memcpy(&echo, reply.data(), 4);
    if (echo != nonce_) return 10s;
    return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  }

 private:
  Raw raw_;
  uint32_t nonce_ = 0;
};

TcpStoreOptions client_options(uint16_t port, std::string token = "") {
  TcpStoreOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.timeout = 10s;
  o.connect_timeout = 10s;
  o.token = std::move(token);
  return o;
}

// Every PING round trip of a well-behaved client while something abuses the store. "Served
// throughout" is judged on the 90th percentile (kServed) and a ceiling on the worst
// (kNeverStalled): a store that a flood stalls fails both, as every PING during the stall waits,
// while one late answer on a loaded 2-core machine under ASan (one of 112 ms, beside two other
// flood tests, failed a CI run when the worst alone was held to 100 ms) is scheduling, not the
// store.
constexpr std::chrono::milliseconds kServed{100};
constexpr std::chrono::milliseconds kNeverStalled{1000};
struct PingLog {
  std::vector<std::chrono::milliseconds> all;
  void add(std::chrono::milliseconds rtt) { all.push_back(rtt); }
  std::chrono::milliseconds worst() const {
    return all.empty() ? std::chrono::milliseconds{0} : *std::max_element(all.begin(), all.end());
  }
  std::chrono::milliseconds p90() const {
    if (all.empty()) return std::chrono::milliseconds{0};
    std::vector<std::chrono::milliseconds> sorted = all;
    std::sort(sorted.begin(), sorted.end());
    return sorted[(sorted.size() - 1) * 9 / 10];
  }
  std::string summary() const {
    std::ostringstream out;
    out << all.size() << " PINGs, 90th percentile " << p90().count() << " ms, worst "
        << worst().count() << " ms";
    return out.str();
  }
};

// Checks that the PINGs in `log` were served throughout (see PingLog).
void check_served(const PingLog& log) {
  INFO(log.summary());
  CHECK(log.p90() < kServed);
  CHECK(log.worst() < kNeverStalled);
}

// Watches a store process while something abuses it: every PING round trip of a well-behaved
// client and the highest RSS seen, sampled every `every`.
struct Watch {
  PingLog pings;
  uint64_t peak_rss = 0;
  int samples = 0;
  void sample(pid_t pid, Pinger& pinger) {
    pings.add(pinger.ping());
    peak_rss = std::max(peak_rss, rss_of(pid));
    ++samples;
  }
  // Samples every 10 ms for `how_long` (200 samples at most), calling `before_each` first.
  void sample_for(pid_t pid, Pinger& pinger, std::chrono::milliseconds how_long,
                  const std::function<void()>& before_each = {}) {
    const auto end = Clock::now() + how_long;
    while (Clock::now() < end && samples < 200) {
      if (before_each) before_each();
      sample(pid, pinger);
      std::this_thread::sleep_for(10ms);
    }
  }
};

}  // namespace

TEST_CASE(
    "a client that floods GETs of a 1 MiB value and reads nothing costs the store "
    "its output limit, and others are served within 100 ms throughout",
    "[hostile][store][flood]") {
  constexpr uint64_t kLimit = 1 * kMiB;  // --max-pending-output
  constexpr uint64_t kValue = 1 * kMiB;
  // Allocator and buffer slack over "limit + one reply": the 64 KiB read buffer, a partly
  // processed input buffer, heap fragmentation, ASan's shadow of what is touched.
  constexpr uint64_t kSlack = 48 * kMiB;
  StoreProcess store({"--max-pending-output", std::to_string(kLimit)});
  {
    TcpStore setter(client_options(store.port()));
    setter.set("big", std::string(kValue, 'x'));
  }
  Pinger pinger(store.port());
  REQUIRE(pinger.ping() < 10s);  // accepted: its descriptor is in the baseline
  const int fds_before = fds_of(store.pid());
  std::this_thread::sleep_for(100ms);
  const uint64_t baseline = rss_of(store.pid());
  REQUIRE(baseline > 0);

  // 1000 GETs (13 KB of requests: one read) that would answer 1 GB, never read; then more for as
  // long as the store takes them.
  constexpr int kGets = 1000;
  std::string gets = hello();
  for (int i = 0; i < kGets; ++i) Encoder(&gets).query(Op::kGet).bytes("big");
  Raw flooder(store.port());
  flooder.send(gets);
  std::string more;
  for (int i = 0; i < 1000; ++i) Encoder(&more).query(Op::kGet).bytes("big");
  int extra_batches = 0;

  Watch watch;
  watch.sample_for(store.pid(), pinger, 2s, [&] {
    if (extra_batches < 20 && flooder.send_some(more) == ssize_t(more.size())) ++extra_batches;
  });
  INFO("baseline RSS " << baseline / kMiB << " MiB, peak " << watch.peak_rss / kMiB << " MiB over "
                       << watch.samples << " samples");
  CHECK(watch.samples >= 20);
  CHECK(watch.peak_rss < baseline + kLimit + kValue + kSlack);
  check_served(watch.pings);

  // The flooder is still served, every reply intact and in order, once it reads: a paused
  // connection resumes when its output drains (first the 1000, then whatever else it sent).
  std::string reply;
  int intact = 0;
  for (int i = 0; i < kGets; ++i) {
    if (!flooder.recv_exact(&reply, 8 + kValue, 20s)) break;
    if (read_len(reply) != kValue || reply[8] != 'x' || reply.back() != 'x') break;
    ++intact;
    if (i % 100 == 0) watch.sample(store.pid(), pinger);
  }
  CHECK(intact == kGets);
  CHECK(watch.peak_rss < baseline + kLimit + kValue + kSlack);
  check_served(watch.pings);
  flooder.close();
  CHECK(wait_until([&] { return fds_of(store.pid()) == fds_before; }, 10s));
  CHECK(pinger.ping() < kNeverStalled);
}

TEST_CASE("a store relay bounds a GET flood that reads nothing the same way",
          "[hostile][store][flood][relay]") {
  constexpr uint64_t kLimit = 1 * kMiB;
  constexpr uint64_t kValue = 1 * kMiB;
  constexpr uint64_t kSlack = 48 * kMiB;
  StoreProcess store({});
  StoreProcess relay({"--relay-to", "127.0.0.1:" + std::to_string(store.port()),
                      "--max-pending-output", std::to_string(kLimit)});
  {
    TcpStore setter(client_options(store.port()));
    setter.set("big", std::string(kValue, 'x'));
  }
  Pinger pinger(relay.port());
  REQUIRE(pinger.ping() < 10s);
  std::this_thread::sleep_for(100ms);
  const uint64_t baseline = rss_of(relay.pid());
  std::string gets = hello();
  for (int i = 0; i < 1000; ++i) Encoder(&gets).query(Op::kGet).bytes("big");
  Raw flooder(relay.port());
  flooder.send(gets);
  Watch watch;
  watch.sample_for(relay.pid(), pinger, 2s);
  INFO("relay baseline RSS " << baseline / kMiB << " MiB, peak " << watch.peak_rss / kMiB
                             << " MiB");
  CHECK(watch.peak_rss < baseline + kLimit + kValue + kSlack);
  check_served(watch.pings);
  // Resumes when the flooder reads.
  std::string reply;
  int intact = 0;
  for (int i = 0; i < 1000; ++i) {
    if (!flooder.recv_exact(&reply, 8 + kValue, 20s) || read_len(reply) != kValue) break;
    ++intact;
  }
  CHECK(intact == 1000);
}

TEST_CASE("the store that trun --standalone embeds bounds a GET flood the same way",
          "[hostile][store][flood][standalone]") {
  constexpr uint64_t kLimit = 64 * kMiB;  // the embedded store's default max_pending_output
  constexpr uint64_t kValue = 1 * kMiB;
  constexpr uint64_t kSlack = 64 * kMiB;
  // --standalone picks the store's port itself (as torchrun: localhost:0); find it.
  Child agent({trun::testing::trun_binary(), "--standalone", "--nproc-per-node=1", "--no-python",
               "/bin/sleep", "60"},
              {{"ASAN_OPTIONS", env_with_quiet_asan()}}, {"TRUN_STORE_TOKEN"});
  uint16_t port = 0;
  REQUIRE(wait_until(
      [&] {
        port = listening_port_of(agent.pid());
        return port != 0 || !agent.running();
      },
      30s));
  INFO("agent stderr: " << agent.err());
  REQUIRE(agent.running());
  auto setter = std::make_unique<TcpStore>(client_options(port));
  setter->set("hostile/big", std::string(kValue, 'x'));
  Pinger pinger(port);
  std::this_thread::sleep_for(100ms);
  const uint64_t baseline = rss_of(agent.pid());

  std::string gets = hello();
  for (int i = 0; i < 1000; ++i) Encoder(&gets).query(Op::kGet).bytes("hostile/big");
  Raw flooder(port);
  flooder.send(gets);
  Watch watch;
  watch.sample_for(agent.pid(), pinger, 2s);
  INFO("baseline RSS " << baseline / kMiB << " MiB, peak " << watch.peak_rss / kMiB << " MiB");
  CHECK(watch.peak_rss < baseline + kLimit + kValue + kSlack);
  check_served(watch.pings);
  flooder.close();
  agent.signal(SIGTERM);
  CHECK(agent.wait(30s));
}

TEST_CASE("with a token, ten unauthenticated 50 MiB SETs are refused at their first bytes",
          "[hostile][store][auth]") {
  constexpr uint64_t kSlack = 24 * kMiB;
  StoreProcess store({}, "s3cret");
  TcpStore good(client_options(store.port(), "s3cret"));
  good.set("k", "v");
  // The well-behaved client here is trun's own, authenticated (a raw PING would be refused).
  const int fds_before = fds_of(store.pid());
  std::this_thread::sleep_for(100ms);
  const uint64_t baseline = rss_of(store.pid());

  constexpr uint64_t kValue = 50 * kMiB;
  std::string head = hello();
  Encoder(&head).query(Op::kSet).bytes("/intruder").u64(kValue);
  const std::string chunk(1 * kMiB, 'z');
  std::vector<std::unique_ptr<Raw>> intruders;
  std::vector<uint64_t> sent(10, 0);
  for (int i = 0; i < 10; ++i) {
    intruders.push_back(std::make_unique<Raw>(store.port()));
    intruders.back()->send(head);
  }
  uint64_t peak = baseline;
  PingLog pings;
  auto end = Clock::now() + 5s;
  std::vector<bool> gone(10, false);
  int rounds = 0;
  while (Clock::now() < end && rounds < 2000) {
    ++rounds;
    int active = 0;
    for (int i = 0; i < 10; ++i) {
      if (gone[i] || sent[i] >= kValue) continue;
      ssize_t n = intruders[i]->send_some(
          std::string_view(chunk).substr(0, std::min<uint64_t>(chunk.size(), kValue - sent[i])));
      if (n < 0) {
        gone[i] = true;  // EPIPE / ECONNRESET: the store closed it
      } else {
        sent[i] += uint64_t(n);
        ++active;
      }
    }
    peak = std::max(peak, rss_of(store.pid()));
    auto t0 = Clock::now();
    good.ping();
    pings.add(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0));
    if (active == 0) break;
    std::this_thread::sleep_for(5ms);
  }
  int closed = 0;
  for (auto& r : intruders) closed += r->closed_by_peer(5s) ? 1 : 0;
  uint64_t most_sent = *std::max_element(sent.begin(), sent.end());
  INFO("baseline RSS " << baseline / kMiB << " MiB, peak " << peak / kMiB
                       << " MiB; most bytes one intruder got in: " << most_sent);
  CHECK(closed == 10);
  CHECK(peak < baseline + kSlack);
  check_served(pings);
  CHECK_FALSE(good.check({"/intruder"}));
  CHECK(good.get("k") == "v");
  intruders.clear();
  CHECK(wait_until([&] { return fds_of(store.pid()) == fds_before; }, 10s));
  CHECK_THAT(store.err(), Catch::Contains("SET before authenticating"));
}

TEST_CASE("a wait or get timeout of 1e13 ms or more waits instead of timing out at once",
          "[hostile][store][timeout]") {
  StoreProcess store({});
  TcpStore setter(client_options(store.port()));
  for (int64_t ms : {int64_t(10'000'000'000'000), INT64_MAX}) {
    for (Op op : {Op::kWaitKeys, Op::kGetWait}) {
      INFO(wire::op_name(op) << " with " << ms << " ms");
      const std::string key = "late/" + std::to_string(ms) + wire::op_name(op);
      Raw raw(store.port());
      std::string msg = hello();
      Encoder(&msg).query(op).u64(1).bytes(key).i64(ms);
      raw.send(msg);
      CHECK(raw.silent_for(300ms));  // before the fix: TIMED_OUT (2) at once
      setter.set(key, "v");
      std::string reply;
      REQUIRE(raw.recv_exact(&reply, 1, 10s));
      CHECK(uint8_t(reply[0]) == wire::kWaitStop);
    }
  }
  SECTION("the client too: TcpStore::wait and get with a huge timeout") {
    TcpStore waiter(client_options(store.port()));
    std::thread later([&] {
      std::this_thread::sleep_for(300ms);
      setter.set("late/client", "v");
    });
    CHECK_NOTHROW(waiter.wait({"late/client"}, std::chrono::milliseconds(10'000'000'000'000)));
    later.join();
    CHECK(waiter.get("late/client", std::chrono::milliseconds::max()) == "v");
  }
}

TEST_CASE("trun store refuses a negative, zero or unreadable size option with exit 2",
          "[hostile][store][cli]") {
  for (std::string opt : {"--max-key-bytes", "--max-value-bytes", "--max-pending-output"}) {
    for (std::string value : {"-1", "0", "abc", "99999999999999999999", "1.5"}) {
      INFO(opt << "=" << value);
      auto r = trun::testing::run_trun({"store", "--port", "0", opt + "=" + value}, {}, 10s);
      CHECK(r.finished);
      CHECK(r.exit_code == 2);
      CHECK_THAT(r.err, Catch::Contains(opt) && Catch::Contains(value));
      CHECK(r.out.find("listening") == std::string::npos);
    }
  }
}

TEST_CASE(
    "garbage, truncated messages, huge lengths, slowloris and a connect storm each close "
    "or wait as they should, and the store's descriptors return to baseline",
    "[hostile][store][probes]") {
  StoreProcess store({});
  Pinger pinger(store.port());
  REQUIRE(pinger.ping() < 10s);  // accepted: its descriptor is in the baseline
  const int fds_before = fds_of(store.pid());
  const uint64_t rss_before = rss_of(store.pid());
  PingLog pings;
  auto ping = [&] { pings.add(pinger.ping()); };

  SECTION("garbage bytes close the connection") {
    std::mt19937 rng(42);
    for (int i = 0; i < 20; ++i) {
      Raw raw(store.port());
      std::string junk = hello();
      junk.push_back(char(0xff));  // no query has this byte in either dialect
      for (int j = 0; j < 64; ++j) junk.push_back(char(rng()));
      raw.send(junk);
      CHECK(raw.closed_by_peer(5s));
      ping();
    }
  }
  SECTION("a GET_TIMEOUT naming no key closes that connection (it crashed the store)") {
    Raw raw(store.port());
    std::string msg = hello();
    Encoder(&msg).query(Op::kGetWait).u64(0).i64(0);
    raw.send(msg);
    CHECK(raw.closed_by_peer(5s));
    ping();
    CHECK(store.running());
  }
  SECTION("a truncated message waits for the rest; the connection closing ends it") {
    for (int i = 0; i < 20; ++i) {
      Raw raw(store.port());
      std::string msg = hello();
      Encoder(&msg).query(Op::kSet).bytes("half").bytes(std::string(1000, 'h'));
      raw.send(msg.substr(0, msg.size() / 2));
      CHECK(raw.silent_for(50ms));
      ping();
    }
    TcpStore c(client_options(store.port()));
    CHECK_FALSE(c.check({"half"}));
  }
  SECTION("huge length prefixes are refused as soon as they arrive") {
    for (uint64_t len : {uint64_t(1) << 40, ~uint64_t(0), uint64_t(64 * 1024 + 1)}) {
      Raw raw(store.port());
      std::string msg = hello();
      Encoder(&msg).query(Op::kGet).u64(len);
      raw.send(msg);
      CHECK(raw.closed_by_peer(5s));
      Raw many(store.port());
      std::string keys = hello();
      Encoder(&keys).query(Op::kMultiGet).u64(len);
      many.send(keys);
      CHECK(many.closed_by_peer(5s));
      ping();
    }
    CHECK(rss_of(store.pid()) < rss_before + 16 * kMiB);
  }
  SECTION("a slowloris client sending a byte at a time delays nobody and is served") {
    Raw slow(store.port());
    std::string msg = hello();
    Encoder(&msg).query(Op::kSet).bytes("slow").bytes("loris");
    Encoder(&msg).query(Op::kGet).bytes("slow");
    for (char c : msg) {
      slow.send(std::string(1, c));
      ping();
      std::this_thread::sleep_for(5ms);
    }
    std::string reply;
    REQUIRE(slow.recv_exact(&reply, 8 + 5, 5s));
    CHECK(reply.substr(8) == "loris");
  }
  SECTION("a storm of 500 connections, opened and dropped, leaves nothing behind") {
    std::vector<std::unique_ptr<Raw>> storm;
    for (int i = 0; i < 500; ++i) {
      storm.push_back(std::make_unique<Raw>(store.port()));
      if (i % 2 == 0) storm.back()->send(hello());
      if (i % 50 == 0) ping();
    }
    CHECK(wait_until([&] { return fds_of(store.pid()) >= fds_before + 400; }, 10s));
    ping();
    storm.clear();
  }
  INFO("descriptors before " << fds_before << ", now " << fds_of(store.pid()));
  CHECK(wait_until([&] { return fds_of(store.pid()) == fds_before; }, 10s));
  ping();
  check_served(pings);
  CHECK(store.running());
}
