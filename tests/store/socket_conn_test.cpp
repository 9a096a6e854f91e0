// The client's socket layer on its own: a refused port is retried with backoff until the
// deadline and no later, a name that does not resolve fails at once and for good, reads and
// writes end at their deadline, and EOF reads as the server closing. Loopback and socketpairs.
#include "store/socket_conn.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>

#include "store/tcp_store.h"
#include "store/wire.h"
#include "tests/skip.h"

using namespace trun::store;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

// A loopback port bound but not listening: connecting is refused, and no one else can take the
// port while the test runs.
struct RefusingPort {
  RefusingPort() {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
    socklen_t len = sizeof(addr);
    REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
    port = ntohs(addr.sin_port);
  }
  ~RefusingPort() { ::close(fd); }
  int fd = -1;
  uint16_t port = 0;
};

// A connected pair of non-blocking stream sockets, closed on destruction.
struct SocketPair {
  SocketPair() { REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, fds) == 0); }
  ~SocketPair() {
    for (int fd : fds) {
      if (fd >= 0) ::close(fd);
    }
  }
  void close_peer() {
    ::close(fds[1]);
    fds[1] = -1;
  }
  int fds[2] = {-1, -1};
};

}  // namespace

TEST_CASE("a refused port is retried until the deadline, then reported with its attempts",
          "[store][client][socket]") {
  RefusingPort refusing;
  const uint16_t port = refusing.port;
  const auto start = Clock::now();
  const auto deadline = start + 800ms;
  auto result = net::connect_retrying(deadline, [&](net::OpenError* error) {
    return net::open_socket("127.0.0.1", port, deadline, error);
  });
  const auto waited = Clock::now() - start;
  CHECK(result.fd == -1);
  CHECK(result.attempts >= 3);  // 10, 20, 40, ... ms apart, +-50%
  CHECK_FALSE(result.last.permanent);
  CHECK(result.last.what == std::strerror(ECONNREFUSED));
  CHECK(result.detail() == std::to_string(result.attempts) +
                               " attempts; last error: Connection refused: nothing listens there");
  CHECK(waited >= 790ms);      // the last attempt comes at the deadline, not a pause before it
  CHECK(waited < 800ms + 3s);  // stopped at the deadline, not hung (a sanitizer build is slow)

  // At the client's boundary the failure names the endpoint.
  TcpStoreOptions o;
  o.port = port;
  o.connect_timeout = 300ms;
  CHECK_THROWS_WITH(TcpStore(o),
                    Catch::StartsWith("store 127.0.0.1:" + std::to_string(port) +
                                      ": connect: could not connect within 300 ms (") &&
                        Catch::Contains("nothing listens there"));
}

TEST_CASE("a name that does not resolve fails at once and is not retried",
          "[store][client][socket]") {
  const std::string host = "no-such-host.invalid";
  TRUN_SKIP_UNLESS_NONAME(host);
  const auto start = Clock::now();
  const auto deadline = start + 20s;
  auto result = net::connect_retrying(deadline, [&](net::OpenError* error) {
    return net::open_socket(host, 29500, deadline, error);
  });
  CHECK(result.fd == -1);
  CHECK(result.attempts == 1);
  CHECK(result.last.permanent);
  CHECK_THAT(result.last.what, Catch::StartsWith("cannot resolve host '" + host + "': "));
  CHECK(Clock::now() - start < 5s);
}

TEST_CASE("retrying stops at the first connection or permanent failure, and exceptions pass",
          "[store][client][socket]") {
  const auto deadline = Clock::now() + 10s;
  int calls = 0;
  auto result = net::connect_retrying(deadline, [&](net::OpenError* error) {
    if (++calls < 3) {
      error->what = "not yet";
      return -1;
    }
    return 42;  // stands for a descriptor; never used as one
  });
  CHECK(result.fd == 42);
  CHECK(result.attempts == 3);

  calls = 0;
  result = net::connect_retrying(deadline, [&](net::OpenError* error) {
    CHECK_FALSE(error->permanent);  // reset before each attempt
    error->what = "gone";
    error->permanent = ++calls == 2;
    return -1;
  });
  CHECK(result.attempts == 2);
  CHECK(result.last.what == "gone");
  CHECK(result.detail() == "2 attempts; last error: gone");

  CHECK_THROWS_AS(
      net::connect_retrying(
          deadline, [](net::OpenError*) -> int { throw std::runtime_error("auth failed"); }),
      std::runtime_error);
}

TEST_CASE("an endpoint is named host:port, an IPv6 literal in brackets",
          "[store][client][socket]") {
  CHECK(net::endpoint_name("127.0.0.1", 29500) == "127.0.0.1:29500");
  CHECK(net::endpoint_name("node-3.cluster", 1) == "node-3.cluster:1");
  CHECK(net::endpoint_name("::1", 29500) == "[::1]:29500");
}

TEST_CASE("values round-trip, and a read ends at its deadline, at EOF, at an implausible length",
          "[store][client][socket]") {
  SocketPair pair;
  const int a = pair.fds[0];
  const int b = pair.fds[1];
  std::string out;
  wire::Encoder(&out).u8(7).u32(0x01020304).i64(-5).bytes("hi").bytes("");
  net::write_all(b, out, Clock::now() + 1s);
  net::Reader r(a, Clock::now() + 1s);
  CHECK(r.u8() == 7);
  CHECK(r.u32() == 0x01020304);
  CHECK(r.i64() == -5);
  CHECK(r.bytes() == "hi");
  CHECK(r.bytes().empty());

  // Nothing more arrives: the read ends at the deadline, as a timeout.
  r.set_deadline(Clock::now() + 200ms);
  const auto start = Clock::now();
  try {
    r.u8();
    FAIL("read a byte nobody sent");
  } catch (const net::IoError& e) {
    CHECK(e.timed_out);
    CHECK(e.what == "timed out");
  }
  CHECK(Clock::now() - start >= 190ms);
  CHECK(Clock::now() - start < 3s);  // stopped at the deadline, not hung

  out.clear();
  wire::Encoder(&out).u64(1ull << 41);
  net::write_all(b, out, Clock::now() + 1s);
  r.set_deadline(Clock::now() + 1s);
  try {
    r.bytes();
    FAIL("accepted a 2 TiB length");
  } catch (const net::IoError& e) {
    CHECK_FALSE(e.timed_out);
    CHECK(e.what == "implausible response length");
  }

  pair.close_peer();
  try {
    r.u8();
    FAIL("read past EOF");
  } catch (const net::IoError& e) {
    CHECK_FALSE(e.timed_out);
    CHECK(e.what == "connection closed by the server");
  }
  try {
    net::write_all(a, "x", Clock::now() + 1s);  // MSG_NOSIGNAL: an error, not SIGPIPE
    FAIL("sent to a closed peer");
  } catch (const net::IoError& e) {
    CHECK_FALSE(e.timed_out);
    CHECK_THAT(e.what, Catch::StartsWith("send: "));
  }
}

TEST_CASE("a write that cannot proceed ends at its deadline", "[store][client][socket]") {
  SocketPair pair;
  const std::string big(8 << 20, 'x');  // far more than the socket buffers hold
  const auto start = Clock::now();
  try {
    net::write_all(pair.fds[0], big, start + 200ms);
    FAIL("8 MiB went into an unread socket");
  } catch (const net::IoError& e) {
    CHECK(e.timed_out);
  }
  CHECK(Clock::now() - start >= 190ms);
  CHECK(Clock::now() - start < 3s);  // stopped at the deadline, not hung
}
