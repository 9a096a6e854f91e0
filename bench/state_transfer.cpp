// state_transfer: how fast a ResilientLoop moves its state to the other ranks (issue 38;
// scripts/bench.sh recover). Run under trun with 2 or more ranks:
//
//   trun --standalone --nproc-per-node=2 build/bench/state_transfer --mib 1024
//
// Every rank registers one buffer of --mib MiB with a ResilientLoop and fills it with its own
// pattern; at the first formation no rank holds a state, so restore() runs and rank 0's state is
// broadcast to the others: the transfer a replaced rank gets, measured by the loop itself
// (ResilientLoop::stats()). Every receiver checks that it holds rank 0's bytes. Rank 0 then
// measures the two references on its own: memcpy of the same size into a second buffer (best of
// 3), and a TCP stream of the same size over loopback (a thread sends, rank 0 receives).
// Rank 0 prints one line:
//   transfer ranks=N bytes=B seconds=S gbps=G memcpy_gbps=M tcp_gbps=T via=DESCRIPTION
//
// Without trun, the TCP reference between two network namespaces (or machines): one process
// receives --mib MiB on ADDR:PORT, the other sends them, in the same calls as the loopback stream:
//
//   state_transfer --stream-recv 10.78.0.2:29750 --mib 1024   # prints "listening", then
//                                                             # stream bytes=B seconds=S gbps=G
//   state_transfer --stream-send 10.78.0.2:29750 --mib 1024
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <trun/resilient.h>

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Rank r's pattern: word i is r * 2^40 + i.
void fill(std::vector<uint64_t>& v, int rank) {
  for (size_t i = 0; i < v.size(); ++i) v[i] = (static_cast<uint64_t>(rank) << 40) + i;
}

double memcpy_seconds(const std::vector<uint64_t>& src) {
  std::vector<uint64_t> dst(src.size());
  std::memset(dst.data(), 1, dst.size() * 8);  // faulted in before timing
  double best = 1e9;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(dst.data(), src.data(), src.size() * 8);
    best = std::min(best, since(t0));
  }
  return best;
}

constexpr size_t kCall = size_t{4} << 20;  // bytes per send and recv call

// A listening socket on `a` (port 0: any), with its address written back to `a`.
int listen_on(sockaddr_in& a) {
  const int ls = ::socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  socklen_t len = sizeof a;
  if (ls < 0 || ::setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
      ::bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(ls, 1) != 0 ||
      ::getsockname(ls, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    std::perror("state_transfer: listening socket");
    std::exit(1);
  }
  return ls;
}

// Connects to `a` and sends `bytes` in kCall calls; exits the process on an error.
void send_stream(const sockaddr_in& a, size_t bytes) {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  if (s < 0 || ::connect(s, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {
    std::perror("state_transfer: connect");
    std::exit(1);
  }
  std::vector<char> buf(kCall, 7);
  for (size_t sent = 0; sent < bytes;) {
    const ssize_t n = ::send(s, buf.data(), std::min(kCall, bytes - sent), 0);
    if (n <= 0) std::exit(1);
    sent += static_cast<size_t>(n);
  }
  ::close(s);
}

// Accepts one connection on `ls` and receives `bytes` from it: the seconds from the accept to
// the last byte. Exits the process if the stream ends early.
double receive_stream(int ls, size_t bytes) {
  const int c = ::accept(ls, nullptr, nullptr);
  if (c < 0) {
    std::perror("state_transfer: accept");
    std::exit(1);
  }
  std::vector<char> buf(kCall);
  const auto t0 = Clock::now();
  size_t got = 0;
  while (got < bytes) {
    const ssize_t n = ::recv(c, buf.data(), kCall, 0);
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  const double s = since(t0);
  ::close(c);
  if (got != bytes) {
    std::fprintf(stderr, "state_transfer: the stream ended after %zu bytes\n", got);
    std::exit(1);
  }
  return s;
}

// Seconds to stream `bytes` over a loopback TCP connection (a thread sends).
double tcp_seconds(size_t bytes) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const int ls = listen_on(a);
  std::thread sender([&] { send_stream(a, bytes); });
  const double s = receive_stream(ls, bytes);
  sender.join();
  ::close(ls);
  return s;
}

// ADDR:PORT (IPv4) as a socket address; false if it is not one.
bool parse_addr(const std::string& text, sockaddr_in& a) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos) return false;
  a = sockaddr_in{};
  a.sin_family = AF_INET;
  const long port = std::strtol(text.c_str() + colon + 1, nullptr, 10);
  if (port < 0 || port > 65535) return false;
  a.sin_port = htons(static_cast<uint16_t>(port));
  return ::inet_pton(AF_INET, text.substr(0, colon).c_str(), &a.sin_addr) == 1;
}

// --stream-recv / --stream-send (no trun): the TCP reference between two machines or network
// namespaces. The receiver prints "listening" once it listens, then, after the stream, one line:
//   stream bytes=B seconds=S gbps=G
int stream_mode(bool receive, const std::string& where, size_t bytes) {
  sockaddr_in a{};
  if (!parse_addr(where, a)) {
    std::fprintf(stderr, "state_transfer: '%s' is not IPV4:PORT\n", where.c_str());
    return 2;
  }
  if (!receive) {
    send_stream(a, bytes);
    return 0;
  }
  const int ls = listen_on(a);
  std::printf("listening\n");
  std::fflush(stdout);
  const double s = receive_stream(ls, bytes);
  ::close(ls);
  std::printf("stream bytes=%zu seconds=%.6f gbps=%.3f\n", bytes, s,
              static_cast<double>(bytes) / s / 1e9);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  size_t mib = 1024;
  std::string stream_recv, stream_send;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--mib" && i + 1 < argc) {
      mib = std::strtoull(argv[++i], nullptr, 10);
    } else if (arg == "--stream-recv" && i + 1 < argc) {
      stream_recv = argv[++i];
    } else if (arg == "--stream-send" && i + 1 < argc) {
      stream_send = argv[++i];
    } else {
      std::fprintf(stderr,
                   "usage: state_transfer [--mib N (1024)] [--stream-recv ADDR:PORT | "
                   "--stream-send ADDR:PORT]\n");
      return 2;
    }
  }
  if (mib == 0) {
    std::fprintf(stderr, "state_transfer: --mib must be positive\n");
    return 2;
  }
  if (!stream_recv.empty()) return stream_mode(true, stream_recv, mib << 20);
  if (!stream_send.empty()) return stream_mode(false, stream_send, mib << 20);
  try {
    std::vector<uint64_t> data((mib << 20) / 8);
    uint64_t step = 0;
    trun::worker::ResilientState state;
    state.set_step(&step);
    state.add("state", data.data(), data.size() * 8);
    trun::worker::ResilientOptions ro;
    ro.init.backend = trun::worker::Backend::kCpu;
    ro.verbose = false;
    trun::worker::ResilientLoop loop(state, ro);
    const int rank = loop.worker().rank();
    fill(data, rank);  // every page faulted in before the transfer
    trun::worker::ResilientProgram program;
    program.on_group = [](trun::worker::Worker&, const trun::worker::Formation&) {};
    program.step = [](trun::worker::Worker&) { return false; };
    loop.run(program);
    const auto& st = loop.stats();
    std::vector<uint64_t> expected(data.size());
    fill(expected, 0);
    if (data != expected) {
      std::fprintf(stderr, "state_transfer: rank %d does not hold rank 0's state\n", rank);
      return 1;
    }
    if (rank != 0) return 0;
    const double bytes = static_cast<double>(st.last_bytes);
    const double m = memcpy_seconds(data);
    const double t = tcp_seconds(data.size() * 8);
    std::printf(
        "transfer ranks=%d bytes=%zu seconds=%.6f gbps=%.3f memcpy_gbps=%.3f tcp_gbps=%.3f "
        "via=%s\n",
        loop.worker().world_size(), st.last_bytes, st.last_transfer_s,
        bytes / st.last_transfer_s / 1e9, bytes / m / 1e9, bytes / t / 1e9,
        loop.worker().process_group().backend_description().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "state_transfer: %s\n", e.what());
    return 1;
  }
}
