// ShmComm's segment hand-over (memfd over an abstract Unix socket): local rank 0 gives the
// descriptor only to a connection that shows the secret from the store, and a stranger that
// connects first does not stop the real peer from getting it. Real sockets, one process (rank 0
// on a thread, the in-process store standing in for the job's store).

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>

#include "store/in_memory_store.h"
#include "worker_sdk/src/cpu/shm_comm.h"

using namespace trun::worker;
using namespace trun::worker::detail;
using namespace std::chrono_literals;

namespace {

// Connects to the abstract address, sends `hello`, and reports whether a descriptor came back
// (closing it if so).
bool ask_for_fd(const std::string& address, const std::string& hello) {
  int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(s >= 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path + 1, address.data(), address.size());
  auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + address.size());
  REQUIRE(::connect(s, reinterpret_cast<sockaddr*>(&a), len) == 0);
  timeval tv{10, 0};
  ::setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (!hello.empty()) REQUIRE(::send(s, hello.data(), hello.size(), MSG_NOSIGNAL) > 0);
  char byte = 0;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t got = ::recvmsg(s, &msg, MSG_CMSG_CLOEXEC);
  cmsghdr* cm = got > 0 ? CMSG_FIRSTHDR(&msg) : nullptr;
  bool have_fd = cm && cm->cmsg_type == SCM_RIGHTS;
  if (have_fd) {
    int fd = -1;
    std::memcpy(&fd, CMSG_DATA(cm), sizeof fd);
    ::close(fd);
  }
  ::close(s);
  return have_fd;
}

// Two local ranks sharing `store`; rank and tag as given.
ShmOptions pair_options(trun::store::Store& store, int local_rank, const std::string& tag) {
  ShmOptions o;
  o.store = &store;
  o.local_size = 2;
  o.local_rank = local_rank;
  o.tag = tag;
  return o;
}

}  // namespace

TEST_CASE("the shared-memory segment goes only to a peer that shows the store's secret",
          "[worker_sdk][shm]") {
  trun::store::InMemoryStore store;
  const Deadline deadline = Clock::now() + 60s;

  std::unique_ptr<ShmComm> rank0;
  std::exception_ptr rank0_error;
  std::thread creator([&] {
    try {
      rank0 = std::make_unique<ShmComm>(pair_options(store, 0, "handover-test"), deadline);
    } catch (...) {
      rank0_error = std::current_exception();
    }
  });

  store.wait({"shm_name"}, 30s);
  const std::string published = store.get("shm_name");
  REQUIRE(published.size() > 1);
  REQUIRE(published[0] == '@');
  const size_t space = published.find(' ');
  REQUIRE(space != std::string::npos);
  const std::string address = published.substr(1, space - 1);
  const std::string secret = published.substr(space + 1);
  CHECK(secret.size() == 32);

  // Strangers: a wrong secret, and one that sends nothing and hangs up. Neither gets the fd.
  CHECK_FALSE(ask_for_fd(address, std::string(secret.size(), '0')));
  CHECK_FALSE(ask_for_fd(address, ""));

  // The real peer still gets it, and the two ranks then work as a group.
  std::unique_ptr<ShmComm> rank1;
  REQUIRE_NOTHROW(rank1 =
                      std::make_unique<ShmComm>(pair_options(store, 1, "handover-test"), deadline));
  creator.join();
  if (rank0_error) std::rethrow_exception(rank0_error);
  REQUIRE(rank0);
  CHECK(rank0->segment_name() == rank1->segment_name());
  CHECK(rank1->segment_name().rfind("memfd:trun-handover-test", 0) == 0);

  float a[3] = {1, 2, 3}, b[3] = {10, 20, 30};
  std::thread t([&] { rank0->allreduce(a, 3, DataType::kFloat32, ReduceOp::kSum, deadline); });
  rank1->allreduce(b, 3, DataType::kFloat32, ReduceOp::kSum, deadline);
  t.join();
  for (int i = 0; i < 3; ++i) {
    CHECK(a[i] == 11.0f * (i + 1));
    CHECK(b[i] == 11.0f * (i + 1));
  }
}

TEST_CASE("local rank 0 gives up at the deadline when a peer never fetches the segment",
          "[worker_sdk][shm]") {
  trun::store::InMemoryStore store;
  auto start = Clock::now();
  CHECK_THROWS_AS(ShmComm(pair_options(store, 0, "handover-timeout"), Clock::now() + 1s),
                  CollectiveTimeoutError);
  CHECK(Clock::now() - start < 30s);
}
