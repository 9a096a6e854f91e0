// The dialect probe (docs/tcpstore-protocol.md §12) against trun's server, against scripted
// servers that answer as each PyTorch version does, and against PyTorch 1.13's own server; and
// the dialect table's 1.13 column against that server. (No PyTorch 2.x server is installed here:
// the scripted ones stand in for 2.2/2.3 and >= 2.4.)
#include "store/dialect_probe.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include "store/server.h"
#include "store/socket_conn.h"
#include "store/tcp_store.h"
#include "store/wire.h"
#include "tests/store/compat/raw_socket.h"
#include "tests/store/compat/torch_server.h"
#include "tests/store/store_op_driver.h"

namespace {

using namespace std::chrono_literals;
using namespace trun::store;
using Clock = std::chrono::steady_clock;

// Listens on loopback and hands each accepted connection, with its index (0, 1, ...), to
// `script` on its own thread; closes the connection when the script returns.
class ScriptedServer {
 public:
  explicit ScriptedServer(std::function<void(int index, int fd)> script)
      : script_(std::move(script)) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(listen_fd_ >= 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
    REQUIRE(::listen(listen_fd_, 8) == 0);
    socklen_t len = sizeof(addr);
    REQUIRE(::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
    port = ntohs(addr.sin_port);
    thread_ = std::thread([this] {
      for (int index = 0;; ++index) {
        int fd = ::accept(listen_fd_, nullptr, nullptr);
        if (fd < 0) return;  // shut down
        script_(index, fd);
        ::close(fd);
        accepted.store(index + 1);
      }
    });
  }
  ~ScriptedServer() {
    ::shutdown(listen_fd_, SHUT_RDWR);
    thread_.join();
    ::close(listen_fd_);
  }

  uint16_t port = 0;
  std::atomic<int> accepted{0};

 private:
  std::function<void(int, int)> script_;
  int listen_fd_ = -1;
  std::thread thread_;
};

// Reads exactly `n` bytes (blocking; the scripted server's side).
std::string read_n(int fd, size_t n) {
  std::string out(n, '\0');
  size_t off = 0;
  while (off < n) {
    ssize_t got = ::recv(fd, out.data() + off, n - off, 0);
    if (got <= 0) break;
    off += static_cast<size_t>(got);
  }
  out.resize(off);
  return out;
}

// Sends `bytes` (the scripted server's side; no assertions on its thread: the client sees a short
// write as a wrong answer).
void write_bytes(int fd, const std::string& bytes) {
  (void)::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
}

std::string le32(uint32_t v) { return std::string(reinterpret_cast<const char*>(&v), sizeof(v)); }
std::string le64(int64_t v) { return std::string(reinterpret_cast<const char*>(&v), sizeof(v)); }

const std::string kProbeBytes = trun::test::hex("00 ce f7 85 3c 0d 4e 55 a5 54 e6");

struct Probe {
  ProbeResult result;
  int reopened = 0;
};

// Probes the server at `port` (127.0.0.1) within `budget`.
Probe probe(uint16_t port, Clock::duration budget = 5s) {
  const auto deadline = Clock::now() + budget;
  auto open = [&]() {
    net::OpenError error;
    int fd = net::open_socket("127.0.0.1", port, deadline, &error);
    INFO(error.what);
    REQUIRE(fd >= 0);
    return fd;
  };
  Probe p;
  p.result = probe_dialect(open(), deadline, [&] {
    ++p.reopened;
    return open();
  });
  return p;
}

// A kept connection still answers: 1.13's GETNUMKEYS, or PING in the 2.x numbering.
void check_answers(int fd, StoreDialect dialect) {
  std::string req;
  net::Reader r(fd, Clock::now() + 5s);
  if (dialect == StoreDialect::kTorch1_13) {
    wire::Encoder(&req).query(wire::Op::kNumKeys, wire::Dialect::kV1);
    net::write_all(fd, req, r.deadline());
    CHECK(r.i64() >= 0);
  } else {
    wire::Encoder(&req).query(wire::Op::kPing).u32(77);
    net::write_all(fd, req, r.deadline());
    CHECK(r.u32() == 77);
  }
}

}  // namespace

TEST_CASE("the probe finds trun's server and keeps the probe's connection", "[store][probe]") {
  StoreServerOptions so;
  so.host = "127.0.0.1";
  auto server = StoreServer::start(so);
  auto p = probe(server->port());
  CHECK(p.result.dialect == StoreDialect::kTrun);
  CHECK(p.reopened == 0);
  REQUIRE(p.result.fd >= 0);
  check_answers(p.result.fd, StoreDialect::kTrun);
  ::close(p.result.fd);
}

TEST_CASE("the probe tells PyTorch 2.x from 1.13 by how a server answers it", "[store][probe]") {
  std::string first_request_of_second;
  SECTION("PyTorch >= 2.4: the echo, then a close; the caller opens a VALIDATE connection") {
    ScriptedServer server([](int, int fd) {
      if (read_n(fd, kProbeBytes.size()) == kProbeBytes) write_bytes(fd, le32(0x54A5554E));
    });
    auto p = probe(server.port);
    CHECK(p.result.dialect == StoreDialect::kTorch2);
    CHECK(p.result.fd == -1);
    CHECK(p.reopened == 0);
  }
  SECTION("PyTorch 2.2/2.3: a close on PING, and a close on 1.13's GETNUMKEYS") {
    ScriptedServer server([&](int index, int fd) {
      if (index == 1) first_request_of_second = read_n(fd, 1);
    });
    auto p = probe(server.port);
    CHECK(p.result.dialect == StoreDialect::kTorch2);
    CHECK(p.result.fd == -1);
    CHECK(p.reopened == 1);
    for (int i = 0; i < 500 && server.accepted < 2; ++i) std::this_thread::sleep_for(10ms);
    CHECK(first_request_of_second == trun::test::hex("06"));
  }
  SECTION("PyTorch 1.13 (scripted): a close, then GETNUMKEYS answered on a new connection") {
    ScriptedServer server([&](int index, int fd) {
      if (index != 1) return;
      first_request_of_second = read_n(fd, 1);
      write_bytes(fd, le64(3));
      read_n(fd, 1);  // keep the connection until the client closes it
    });
    auto p = probe(server.port);
    CHECK(p.result.dialect == StoreDialect::kTorch1_13);
    CHECK(p.reopened == 1);
    CHECK(p.result.fd >= 0);
    ::close(p.result.fd);
    for (int i = 0; i < 500 && server.accepted < 2; ++i) std::this_thread::sleep_for(10ms);
    CHECK(first_request_of_second == trun::test::hex("06"));  // read once the script ended
  }
  SECTION("a wrong echo is an error") {
    ScriptedServer server([](int, int fd) {
      read_n(fd, kProbeBytes.size());
      write_bytes(fd, le32(1));
    });
    CHECK_THROWS_MATCHES(probe(server.port), net::IoError,
                         Catch::Predicate<net::IoError>([](const net::IoError& e) {
                           return !e.timed_out && e.what == "unexpected answer to the probe";
                         }));
  }
}

TEST_CASE("a probe that gets no answer ends at its deadline, and a failed reopen is undecided",
          "[store][probe]") {
  SECTION("silence") {
    ScriptedServer server([](int, int fd) { read_n(fd, 1 << 20); });  // reads until closed
    const auto start = Clock::now();
    CHECK_THROWS_MATCHES(
        probe(server.port, 300ms), net::IoError,
        Catch::Predicate<net::IoError>([](const net::IoError& e) { return e.timed_out; }));
    CHECK(Clock::now() - start >= 290ms);
    CHECK(Clock::now() - start < 2s);
  }
  SECTION("the second connection cannot be opened") {
    ScriptedServer server([](int, int) {});
    net::OpenError error;
    int fd = net::open_socket("127.0.0.1", server.port, Clock::now() + 5s, &error);
    REQUIRE(fd >= 0);
    auto result = probe_dialect(fd, Clock::now() + 5s, [] { return -1; });
    CHECK(result.dialect == StoreDialect::kAuto);
    CHECK(result.fd == -1);
  }
}

TEST_CASE("the probe finds PyTorch 1.13's own server, which keeps serving",
          "[store][probe][torch]") {
  if (auto why = trun::test::torch_missing(); !why.empty()) {
    WARN("skipped: " << why);
    return;
  }
  trun::test::TorchServer server;
  auto p = probe(server.port, 30s);
  CHECK(p.result.dialect == StoreDialect::kTorch1_13);
  CHECK(p.reopened == 1);
  REQUIRE(p.result.fd >= 0);
  check_answers(p.result.fd, StoreDialect::kTorch1_13);
  ::close(p.result.fd);

  // The dialect table's 1.13 column is what this server accepts.
  TcpStoreOptions o;
  o.port = server.port;
  o.timeout = 10s;
  o.dialect = StoreDialect::kTorch1_13;
  TcpStore client(o);
  client.set("/table/k", "v");
  trun::test::check_dialect_table(client, "/table/");
}
