#pragma once
// The client's socket layer (private to store/; TcpStore is its user): opening a TCP
// connection within a deadline, retrying with backoff, and sending and receiving with deadlines.
//
// Blocking: every function blocks the calling thread, never past the deadline it is given (a
// connect attempt gets at least 1 ms of poll), except name resolution: getaddrinfo(3) takes the
// resolver's own time. Sockets are non-blocking underneath; waits use poll(2), and EINTR is
// retried.
//
// Errors: transport failures throw IoError (timed_out tells a deadline from anything else: a
// closed connection, a send or recv error). Opening reports through OpenError instead of
// throwing, with `permanent` set when retrying cannot help: a host name that does not resolve
// (EAI_NONAME, EAI_SERVICE, EAI_NODATA, EAI_ADDRFAMILY; not the transient EAI_AGAIN) or no route
// to any of its addresses (ENETUNREACH, EHOSTUNREACH). A refused port is not permanent: the
// server may be starting. Messages name no endpoint (only a resolution error names the host);
// the caller adds it.
//
// Thread safety: no shared state. A descriptor and a Reader belong to one thread at a time; the
// caller owns (and closes) every descriptor these functions return.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace trun::store::net {

using Clock = std::chrono::steady_clock;

// Transport failure inside one call.
struct IoError {
  bool timed_out;
  std::string what;
  bool gone = false;  // the server said it is stopping on purpose (wire::kWaitGoingAway)
};

// Why one connection attempt failed, and whether trying again can help (see above).
struct OpenError {
  std::string what;
  bool permanent = false;
};

// now + `timeout`, saturating: a timeout over about 31.7 years (1e12 ms, wire::kMaxWaitTimeoutMs)
// counts as that much, so a huge one (milliseconds::max(), 1e13 ms) cannot overflow the clock's
// nanoseconds into a deadline in the past.
Clock::time_point deadline_after(std::chrono::milliseconds timeout);

// "host:port", with an IPv6 literal in brackets: "[::1]:29500".
std::string endpoint_name(const std::string& host, uint16_t port);

// Opens a non-blocking TCP connection (TCP_NODELAY, SO_KEEPALIVE, close-on-exec) to the first of
// host's addresses that accepts within `deadline`. -1 with *error set when none did.
int open_socket(const std::string& host, uint16_t port, Clock::time_point deadline,
                OpenError* error);

// What connect_retrying ended with.
struct RetryResult {
  int fd = -1;       // the connection, or -1
  int attempts = 0;  // attempts made
  OpenError last;    // fd < 0: why the last attempt failed
  // "3 attempts; last error: Connection refused: nothing listens there" (the suffix only for a
  // refused port).
  std::string detail() const;
};

// Calls `attempt` (which sets *error when it fails) until it returns a descriptor, fails
// permanently, or `deadline` passes. Between attempts it sleeps with exponential backoff (10 ms,
// doubling up to 1 s) and +-50% jitter, so that a storm of clients does not retry in lockstep;
// the last pause is cut short so that the final attempt comes at the deadline. Exceptions from
// `attempt` pass through.
RetryResult connect_retrying(Clock::time_point deadline,
                             const std::function<int(OpenError* error)>& attempt);
// Makes every connect_retrying in this process, now and later, stop before its next attempt (with
// a permanent "abandoned" error): for a process that is stopping (an agent that got a stop signal
// while it waited for a store to come up). One-way; any thread.
void abandon_connect_retries();

// Sends all of `data` (MSG_NOSIGNAL). Throws IoError.
void write_all(int fd, std::string_view data, Clock::time_point deadline);

// Reads fixed-size values and length-prefixed bytes (native byte order) until a deadline that the
// caller may move between reads. Throws IoError ("connection closed by the server" on EOF).
class Reader {
 public:
  Reader(int fd, Clock::time_point deadline) : fd_(fd), deadline_(deadline) {}

  int fd() const { return fd_; }
  Clock::time_point deadline() const { return deadline_; }
  void set_deadline(Clock::time_point deadline) { deadline_ = deadline; }

  void exact(void* buf, size_t len);
  uint8_t u8();
  uint32_t u32();
  int64_t i64();
  std::string bytes();  // a uint64 length (at most 2^40), then that many bytes

 private:
  int fd_;
  Clock::time_point deadline_;
};

}  // namespace trun::store::net
