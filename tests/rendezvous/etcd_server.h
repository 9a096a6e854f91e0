#pragma once
// EtcdServer: a real etcd for tests of the etcd rendezvous backend. /usr/bin/etcd (3.4, Debian's
// etcd-server package, installed by scripts/setup.sh) on 127.0.0.1 with two free ports, a data
// dir in a fresh temporary directory and fast raft timings. Tests that need it and find no etcd
// skip with etcd_unavailable_reason() (see SKIP_WITHOUT_ETCD in the tests).
//
// Lifetime: the constructor starts etcd and blocks until it answers a KV range request on its
// client port (at most 20 s; a port taken in between is retried with new ports), or throws
// std::runtime_error with the tail of etcd's log. stop() (and the destructor) ends it by its pid:
// SIGTERM, at most 10 s, then SIGKILL, then waitpid; and removes the temporary directory. When
// the forking thread is the main thread, etcd also gets SIGKILL as a parent-death signal, so a
// test process killed by ctest's timeout leaves no etcd behind.
//
// EtcdCluster (at the end) runs three members forming one cluster, for failover tests.
//
// EtcdServer::shared() is one process-wide instance, started on first use and stopped at exit;
// tests sharing it keep apart by a unique run id (or etcd prefix). Tests that stop etcd start
// their own instance.
//
// Thread safety: the const helpers (post, keys) may run from any thread; construction, stop()
// and shared()'s first call from one thread (call shared() first from the main thread).
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "rendezvous/etcd/client.h"  // base64, prefix_end
#include "tests/launcher/free_port.h"
#include "tests/skip.h"

namespace trun::testing {

inline constexpr const char* kEtcdBinary = "/usr/bin/etcd";

// In a Catch2 test: skips it (with the reason) where etcd is not installed: a kSetup skip
// (tests/skip.h), a failure under CI=true or TRUN_STRICT_SKIPS=1.
#define SKIP_WITHOUT_ETCD()                                                \
  if (auto why = trun::testing::etcd_unavailable_reason(); !why.empty()) { \
    TRUN_SKIP(why, kSetup);                                                \
  }

// Empty when etcd tests can run here; else why not (the skip's reason).
inline std::string etcd_unavailable_reason() {
  if (::access(kEtcdBinary, X_OK) == 0) return "";
  return std::string(kEtcdBinary) +
         " is missing: the etcd tests need etcd 3.4 (scripts/setup.sh installs it: apt-get "
         "install etcd-server)";
}

struct HttpResponse {
  int status = 0;  // 0: no HTTP answer (refused, timed out, closed early)
  std::string body;
  std::string error;  // why status is 0
};

// One HTTP/1.1 POST of a JSON body to 127.0.0.1:port (Connection: close), the whole exchange
// bounded by `timeout`. Never throws for network errors.
inline HttpResponse http_post(uint16_t port, const std::string& path, const std::string& body,
                              std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
  using Clock = std::chrono::steady_clock;
  HttpResponse r;
  const auto deadline = Clock::now() + timeout;
  auto left_ms = [&] {
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    return static_cast<int>(std::max<int64_t>(0, ms.count()));
  };
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    r.error = std::string("socket: ") + std::strerror(errno);
    return r;
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    if (errno != EINPROGRESS) {
      r.error = std::string("connect: ") + std::strerror(errno);
      return r;
    }
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, left_ms()) <= 0) {
      r.error = "connect: timed out";
      return r;
    }
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      r.error = std::string("connect: ") + std::strerror(err);
      return r;
    }
  }
  const std::string request =
      "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1:" + std::to_string(port) +
      "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
      "\r\nConnection: close\r\n\r\n" + body;
  size_t sent = 0;
  while (sent < request.size()) {
    ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EINTR) {
      r.error = std::string("send: ") + std::strerror(errno);
      return r;
    }
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, left_ms()) <= 0) {
      r.error = "send: timed out";
      return r;
    }
  }
  std::string in;
  for (;;) {
    char buf[4096];
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n > 0) {
      in.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) break;  // the server closed: the whole response is in
    if (errno != EAGAIN && errno != EINTR) {
      r.error = std::string("recv: ") + std::strerror(errno);
      return r;
    }
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, left_ms()) <= 0) {
      r.error = "recv: timed out";
      return r;
    }
  }
  // "HTTP/1.1 200 OK\r\n<headers>\r\n\r\n<body>"; etcd's gateway sends longer bodies chunked.
  if (in.rfind("HTTP/1.", 0) != 0 || in.size() < 12) {
    r.error = "not an HTTP response: " + in.substr(0, 80);
    return r;
  }
  auto head_end = in.find("\r\n\r\n");
  if (head_end == std::string::npos) {
    r.error = "HTTP response without a header end";
    return r;
  }
  std::string head = in.substr(0, head_end);
  for (auto& c : head) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::string payload = in.substr(head_end + 4);
  if (head.find("\r\ntransfer-encoding: chunked") != std::string::npos) {
    std::string joined;
    size_t pos = 0;
    for (;;) {
      auto eol = payload.find("\r\n", pos);
      if (eol == std::string::npos) {
        r.error = "truncated chunked body";
        return r;
      }
      size_t size = std::strtoul(payload.c_str() + pos, nullptr, 16);
      if (size == 0) break;
      if (eol + 2 + size > payload.size()) {
        r.error = "truncated chunked body";
        return r;
      }
      joined.append(payload, eol + 2, size);
      pos = eol + 2 + size + 2;  // the chunk's trailing CRLF
    }
    payload = std::move(joined);
  }
  r.status = std::atoi(in.c_str() + 9);
  r.body = std::move(payload);
  return r;
}

// Starts etcd with `args` (argv[0] included), its output to `log_path`; returns its pid. When
// the calling thread is the main thread, etcd also gets SIGKILL as a parent-death signal (it fires
// when the forking *thread* ends: only the main thread lives as long as the process).
inline pid_t spawn_etcd(const std::vector<std::string>& args, const std::string& log_path) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const bool main_thread = ::getpid() == static_cast<pid_t>(::syscall(SYS_gettid));
  const pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(std::string("etcd: fork: ") + std::strerror(errno));
  if (pid == 0) {
    // Only async-signal-safe calls between fork and exec.
    if (main_thread) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(126);
    }
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    int null = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (log < 0 || null < 0) ::_exit(126);
    ::dup2(null, 0);
    ::dup2(log, 1);
    ::dup2(log, 2);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

// A fresh directory under $TMPDIR (or /tmp) named trun-etcd-XXXXXX.
inline std::string make_etcd_dir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/trun-etcd-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) {
    throw std::runtime_error("etcd: mkdtemp " + tmpl + ": " + std::strerror(errno));
  }
  return buf.data();
}

// Ends etcd `pid`: SIGTERM, at most 10 s, then SIGKILL; reaps it.
inline void end_etcd(pid_t pid) {
  ::kill(pid, SIGTERM);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    pid_t r = ::waitpid(pid, nullptr, WNOHANG);
    if (r == pid || (r < 0 && errno == ECHILD)) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
}

class EtcdServer {
 public:
  EtcdServer() {
    std::string last_error;
    for (int attempt = 0; attempt < 5; ++attempt) {
      if (try_start(&last_error)) return;
    }
    throw std::runtime_error("etcd did not start: " + last_error);
  }
  ~EtcdServer() { stop(); }
  EtcdServer(const EtcdServer&) = delete;
  EtcdServer& operator=(const EtcdServer&) = delete;

  uint16_t port() const { return client_port_; }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(client_port_); }
  pid_t pid() const { return pid_; }

  // Ends etcd (SIGTERM, at most 10 s, SIGKILL, waitpid) and removes its directory. Idempotent.
  void stop() {
    if (pid_ > 0) {
      end_etcd(pid_);
      pid_ = -1;
    }
    if (!dir_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(dir_, ec);
      dir_.clear();
    }
  }

  // POSTs a JSON body to etcd's v3 gateway (e.g. "/v3/kv/range") and returns the parsed answer;
  // std::runtime_error when etcd does not answer 200.
  nlohmann::json post(const std::string& path, const nlohmann::json& body) const {
    auto r = http_post(client_port_, path, body.dump(), std::chrono::seconds(10));
    if (r.status != 200) {
      throw std::runtime_error(
          "etcd " + endpoint() + " " + path + ": " +
          (r.status ? "HTTP " + std::to_string(r.status) + " " + r.body : r.error));
    }
    return nlohmann::json::parse(r.body);
  }

  // Every key (decoded) that starts with `prefix`; every key at all for "".
  std::vector<std::string> keys(const std::string& prefix = "") const {
    nlohmann::json req = {{"keys_only", true}};
    if (prefix.empty()) {
      req["key"] = trun::rendezvous::etcd::base64(std::string(1, '\0'));
      req["range_end"] = trun::rendezvous::etcd::base64(std::string(1, '\0'));
    } else {
      req["key"] = trun::rendezvous::etcd::base64(prefix);
      req["range_end"] = trun::rendezvous::etcd::base64(trun::rendezvous::etcd::prefix_end(prefix));
    }
    auto answer = post("/v3/kv/range", req);
    std::vector<std::string> out;
    if (answer.contains("kvs")) {
      for (const auto& kv : answer["kvs"])
        out.push_back(trun::rendezvous::etcd::unbase64(kv.value("key", "")));
    }
    return out;
  }

  // The last `lines` lines of etcd's log (empty once stopped).
  std::string log_tail(size_t lines = 30) const { return tail_of(dir_ + "/etcd.log", lines); }

  // The process-wide instance: started on first use, stopped at exit.
  static EtcdServer& shared() {
    static std::mutex mu;
    static std::unique_ptr<EtcdServer> instance;
    std::lock_guard<std::mutex> lock(mu);
    if (!instance) instance = std::make_unique<EtcdServer>();
    return *instance;
  }

 private:
  static std::string tail_of(const std::string& path, size_t lines) {
    std::ifstream in(path);
    std::vector<std::string> all;
    for (std::string l; std::getline(in, l);) all.push_back(l);
    std::string out;
    for (size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i) {
      out += all[i] + "\n";
    }
    return out;
  }

  // One start on two new free ports. False (with `error`) when etcd did not come up; the
  // process and the directory are gone again then.
  bool try_start(std::string* error) {
    dir_ = make_etcd_dir();
    client_port_ = static_cast<uint16_t>(free_port());
    uint16_t peer_port = static_cast<uint16_t>(free_port());
    for (int i = 0; i < 10 && peer_port == client_port_; ++i) {
      peer_port = static_cast<uint16_t>(free_port());
    }
    const std::string client = "http://127.0.0.1:" + std::to_string(client_port_);
    const std::string peer = "http://127.0.0.1:" + std::to_string(peer_port);
    const std::vector<std::string> args = {
        kEtcdBinary, "--name", "trun-test", "--data-dir", dir_ + "/data", "--listen-client-urls",
        client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
        "--initial-advertise-peer-urls", peer, "--initial-cluster", "trun-test=" + peer,
        "--initial-cluster-state", "new", "--heartbeat-interval", "10", "--election-timeout", "50",
        // the store contract stores a 3 MiB value
        "--max-request-bytes", "8388608"};
    const std::string log_path = dir_ + "/etcd.log";
    pid_ = spawn_etcd(args, log_path);

    // Ready: etcd says it serves on our port (so the answer below is not another process's)
    // and answers a range request.
    const std::string serving =
        "serving insecure client requests on 127.0.0.1:" + std::to_string(client_port_);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    std::string why = "no answer within 20 s";
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        std::string log = tail_of(log_path, 30);
        *error = "etcd exited (status " + std::to_string(status) + ") on ports " +
                 std::to_string(client_port_) + "/" + std::to_string(peer_port) +
                 "; its log ends:\n" + log;
        std::error_code ec;
        std::filesystem::remove_all(dir_, ec);
        dir_.clear();
        // A port taken between free_port() and etcd's bind: try new ports. Else give up.
        if (log.find("address already in use") == std::string::npos) {
          throw std::runtime_error(*error);
        }
        return false;
      }
      std::ifstream log_in(log_path);
      std::stringstream log;
      log << log_in.rdbuf();
      if (log.str().find(serving) != std::string::npos) {
        auto answer =
            http_post(client_port_, "/v3/kv/range",
                      "{\"key\":\"" + trun::rendezvous::etcd::base64("trun-ready") + "\"}",
                      std::chrono::seconds(2));
        if (answer.status == 200) return true;
        why = answer.status ? "HTTP " + std::to_string(answer.status) + " " + answer.body
                            : answer.error;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::string log = log_tail();
    *error = "etcd on 127.0.0.1:" + std::to_string(client_port_) + " was not ready (" + why +
             "); its log ends:\n" + log;
    stop();
    throw std::runtime_error(*error);
  }

  pid_t pid_ = -1;
  std::string dir_;
  uint16_t client_port_ = 0;
};

// Three etcd members forming one cluster on loopback (fast raft timings), for failover tests.
// The constructor returns once every member answers a range request (at most 30 s); stop(i) ends
// member i by its pid; the destructor ends the rest and removes the directory.
class EtcdCluster {
 public:
  static constexpr int kMembers = 3;
  EtcdCluster() : dir_(make_etcd_dir()) {
    std::string initial;
    for (int i = 0; i < kMembers; ++i) {
      client_[i] = static_cast<uint16_t>(free_port());
      peer_[i] = static_cast<uint16_t>(free_port());
      initial += std::string(i ? "," : "") + "m" + std::to_string(i) +
                 "=http://127.0.0.1:" + std::to_string(peer_[i]);
    }
    for (int i = 0; i < kMembers; ++i) {
      const std::string client = "http://127.0.0.1:" + std::to_string(client_[i]);
      const std::string peer = "http://127.0.0.1:" + std::to_string(peer_[i]);
      pid_[i] = spawn_etcd({kEtcdBinary,
                            "--name",
                            "m" + std::to_string(i),
                            "--data-dir",
                            dir_ + "/m" + std::to_string(i),
                            "--listen-client-urls",
                            client,
                            "--advertise-client-urls",
                            client,
                            "--listen-peer-urls",
                            peer,
                            "--initial-advertise-peer-urls",
                            peer,
                            "--initial-cluster",
                            initial,
                            "--initial-cluster-state",
                            "new",
                            "--heartbeat-interval",
                            "10",
                            "--election-timeout",
                            "100"},
                           dir_ + "/m" + std::to_string(i) + ".log");
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    for (int i = 0; i < kMembers; ++i) {
      while (http_post(client_[i], "/v3/kv/range", "{\"key\":\"eA==\"}", std::chrono::seconds(1))
                 .status != 200) {
        if (std::chrono::steady_clock::now() >= deadline) {
          stop_all();
          throw std::runtime_error("etcd cluster member " + std::to_string(i) +
                                   " did not answer within 30 s (ports taken?)");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
  }
  ~EtcdCluster() { stop_all(); }
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  // "127.0.0.1:p0,127.0.0.1:p1,127.0.0.1:p2": every member's client URL, member 0 first.
  std::string endpoints() const {
    std::string out;
    for (int i = 0; i < kMembers; ++i) {
      out += std::string(i ? "," : "") + "127.0.0.1:" + std::to_string(client_[i]);
    }
    return out;
  }
  void stop(int i) {
    if (pid_[i] > 0) end_etcd(pid_[i]);
    pid_[i] = -1;
  }

 private:
  void stop_all() {
    for (int i = 0; i < kMembers; ++i) stop(i);
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  std::string dir_;
  uint16_t client_[kMembers] = {};
  uint16_t peer_[kMembers] = {};
  pid_t pid_[kMembers] = {-1, -1, -1};
};

}  // namespace trun::testing
