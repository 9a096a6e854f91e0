// The memfd hand-over of ShmComm's segment over an abstract Unix socket (shm_handover.h).

#include "worker_sdk/src/cpu/shm_handover.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <random>
#include <string_view>

#include "store/auth.h"

namespace trun::worker::detail {

std::string errno_text(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

namespace {

constexpr size_t kSecretHex = 32;

sockaddr_un abstract_address(const std::string& name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof a.sun_path - 1);
  std::memcpy(a.sun_path + 1, name.data(), n);  // sun_path[0] == 0: abstract namespace
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  return a;
}

void set_socket_timeout(int fd, Deadline deadline, std::chrono::milliseconds cap) {
  auto left = std::min<Clock::duration>(remaining(deadline), cap);
  auto us =
      std::max<int64_t>(std::chrono::duration_cast<std::chrono::microseconds>(left).count(), 1000);
  timeval tv{static_cast<time_t>(us / 1000000), static_cast<suseconds_t>(us % 1000000)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

// A one-byte message with room for one descriptor (SCM_RIGHTS). Not copyable: msg points into it.
struct FdMessage {
  explicit FdMessage(char b) : byte(b) {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
  }
  FdMessage(const FdMessage&) = delete;
  FdMessage& operator=(const FdMessage&) = delete;
  char byte;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
};

}  // namespace

std::string random_hex(int bytes) {
  std::random_device rd;
  std::string out;
  char b[3];
  for (int i = 0; i < bytes; ++i) {
    std::snprintf(b, sizeof b, "%02x", static_cast<unsigned>(rd() & 0xff));
    out += b;
  }
  return out;
}

FdServer::FdServer(int backlog) : secret_(random_hex(kSecretHex / 2)) {
  address_ = "trun-shm-" + std::to_string(::getpid()) + "-" + random_hex(8);
  fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) throw CollectiveError(errno_text("shared memory hand-over: socket"));
  socklen_t len = 0;
  sockaddr_un a = abstract_address(address_, &len);
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(fd_, backlog) != 0) {
    std::string err = errno_text(("shared memory hand-over: bind/listen @" + address_).c_str());
    ::close(fd_);
    throw CollectiveError(err);
  }
}

FdServer::~FdServer() { ::close(fd_); }

void FdServer::serve(int segment_fd, int peers, Deadline deadline) {
  int served = 0;
  // Bounded by the deadline: each pass waits at most a second or serves one connection.
  while (served < peers) {
    if (Clock::now() >= deadline)
      throw CollectiveTimeoutError(
          "shared memory setup timed out on local rank 0: " + std::to_string(served) + " of " +
          std::to_string(peers) + " local ranks fetched the segment (a local rank exited early?)");
    pollfd p{fd_, POLLIN, 0};
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(remaining(deadline));
    if (::poll(&p, 1, static_cast<int>(std::clamp<int64_t>(left.count(), 1, 1000))) <= 0) continue;
    int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    if (hand_over(c, segment_fd, deadline)) ++served;
    ::close(c);
  }
}

bool FdServer::hand_over(int c, int segment_fd, Deadline deadline) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != ::geteuid())
    return false;
  set_socket_timeout(c, deadline, std::chrono::seconds(5));
  char got[kSecretHex];
  if (::recv(c, got, sizeof got, MSG_WAITALL) != static_cast<ssize_t>(sizeof got) ||
      !store::auth::constant_time_equal(std::string_view(got, sizeof got), secret_))
    return false;
  FdMessage m('F');
  cmsghdr* cm = CMSG_FIRSTHDR(&m.msg);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(cm), &segment_fd, sizeof(int));
  return ::sendmsg(c, &m.msg, MSG_NOSIGNAL) == 1;
}

int fetch_segment_fd(const std::string& published, int local_rank, Deadline deadline) {
  const std::string who = "local rank " + std::to_string(local_rank) + ": shared memory hand-over";
  size_t space = published.find(' ');
  if (space == std::string::npos || published.size() - space - 1 != kSecretHex)
    throw CollectiveError(who + ": malformed store entry 'shm_name'");
  const std::string address = published.substr(0, space);
  const std::string secret = published.substr(space + 1);
  int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) throw CollectiveError(errno_text((who + ": socket").c_str()));
  set_socket_timeout(s, deadline, std::chrono::hours(1));
  socklen_t len = 0;
  sockaddr_un a = abstract_address(address, &len);
  auto fail = [&](const std::string& what) {
    std::string err = errno_text((who + ": " + what).c_str());
    ::close(s);
    throw CollectiveError(err);
  };
  if (::connect(s, reinterpret_cast<sockaddr*>(&a), len) != 0)
    fail("connect to local rank 0 at @" + address +
         " (the ranks of a node must share a network namespace for this; TRUN_SHM_NAMED=1 "
         "shares the segment through /dev/shm instead)");
  if (::send(s, secret.data(), secret.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(secret.size()))
    fail("send");
  FdMessage m(0);
  ssize_t got = ::recvmsg(s, &m.msg, MSG_CMSG_CLOEXEC);
  cmsghdr* cm = got == 1 ? CMSG_FIRSTHDR(&m.msg) : nullptr;
  if (!cm || cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) {
    if (got >= 0) errno = EPROTO;
    fail("receive the segment from local rank 0");
  }
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(cm), sizeof fd);
  ::close(s);
  return fd;
}

}  // namespace trun::worker::detail
