#include "worker_sdk/src/cpu/gloo_comm.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include "base/decimal.h"
#include "worker_sdk/src/reduce.h"

namespace trun::worker::detail {
namespace {

// Gloo's rendezvous store interface over trun's Store.
class StoreAdapter : public gloo::rendezvous::Store {
 public:
  StoreAdapter(store::Store& store, Deadline deadline) : store_(store), deadline_(deadline) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(key, std::string_view(data.data(), data.size()));
  }
  std::vector<char> get(const std::string& key) override {
    store_.wait({key}, remaining(deadline_));
    std::string v = store_.get(key);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override {
    store_.wait(keys, remaining(deadline_));
  }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    store_.wait(keys, std::min(timeout, remaining(deadline_)));
  }

 private:
  store::Store& store_;
  Deadline deadline_;
};

}  // namespace

struct GlooComm::State {
  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<gloo::rendezvous::Context> context;
  // This side's address of each connection (getsockname), recorded once connected; abort()
  // finds the sockets by it and touches no Gloo object.
  std::vector<sockaddr_storage> local_addrs;
  std::mutex abort_mu;
  std::string abort_reason;  // non-empty once abort() was called; guarded by abort_mu
};

namespace {

bool same_endpoint(const sockaddr_storage& a, const sockaddr_storage& b) {
  if (a.ss_family != b.ss_family) return false;
  if (a.ss_family == AF_INET) {
    auto& x = reinterpret_cast<const sockaddr_in&>(a);
    auto& y = reinterpret_cast<const sockaddr_in&>(b);
    return x.sin_port == y.sin_port && x.sin_addr.s_addr == y.sin_addr.s_addr;
  }
  if (a.ss_family == AF_INET6) {
    auto& x = reinterpret_cast<const sockaddr_in6&>(a);
    auto& y = reinterpret_cast<const sockaddr_in6&>(b);
    return x.sin6_port == y.sin6_port &&
           std::memcmp(&x.sin6_addr, &y.sin6_addr, sizeof x.sin6_addr) == 0;
  }
  return false;
}

// Shuts down (both directions) every connected TCP socket of this process whose local address is
// one of `locals`. Each candidate is dup'ed first and checked on the duplicate, so a descriptor
// number that another thread closes and reuses meanwhile is never shut down by mistake. Gloo's
// event loop then reads end-of-stream on each connection and fails what is pending on it, exactly
// as when a peer closes; the peers read end-of-stream as well. Returns how many were shut down.
int shutdown_sockets(const std::vector<sockaddr_storage>& locals) {
  DIR* dir = ::opendir("/proc/self/fd");
  if (!dir) return 0;
  int done = 0;
  const int dir_fd = ::dirfd(dir);
  while (dirent* e = ::readdir(dir)) {
    int fd = -1;  // "." and ".." are not numbers
    if (!base::parse_decimal(e->d_name, &fd) || fd == dir_fd) continue;
    int dup = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dup < 0) continue;
    sockaddr_storage self{}, peer{};
    socklen_t self_len = sizeof self, peer_len = sizeof peer;
    int type = 0;
    socklen_t type_len = sizeof type;
    if (::getsockopt(dup, SOL_SOCKET, SO_TYPE, &type, &type_len) == 0 && type == SOCK_STREAM &&
        ::getsockname(dup, reinterpret_cast<sockaddr*>(&self), &self_len) == 0 &&
        ::getpeername(dup, reinterpret_cast<sockaddr*>(&peer), &peer_len) == 0) {
      for (const auto& l : locals) {
        if (same_endpoint(self, l)) {
          if (::shutdown(dup, SHUT_RDWR) == 0) ++done;
          break;
        }
      }
    }
    ::close(dup);
  }
  ::closedir(dir);
  return done;
}

std::string abort_reason(GlooComm::State& st) {
  std::lock_guard<std::mutex> lock(st.abort_mu);
  return st.abort_reason;
}

template <typename Fn>
void run_gloo(const char* what, int rank, GlooComm::State* st, Deadline deadline, Fn&& fn) {
  auto throw_if_aborted = [&] {
    if (!st) return;
    if (std::string reason = abort_reason(*st); !reason.empty())
      throw CollectiveError(std::string(what) + " failed on node rank " + std::to_string(rank) +
                            " (gloo): aborted: " + reason);
  };
  throw_if_aborted();
  if (Clock::now() >= deadline)
    throw CollectiveTimeoutError(std::string(what) + " timed out on node rank " +
                                 std::to_string(rank) + " before it started (gloo)");
  try {
    fn();
  } catch (const std::exception& e) {
    throw_if_aborted();  // the failure is the abort's doing: say so
    std::string msg =
        std::string(what) + " failed on node rank " + std::to_string(rank) + " (gloo): " + e.what();
    // Gloo reports its own deadline as an I/O error; tell the two apart by the clock.
    if (Clock::now() + std::chrono::milliseconds(50) >= deadline) throw CollectiveTimeoutError(msg);
    throw CollectiveError(msg);
  }
}

// Gloo wants a typed buffer; only the element size matters to it.
template <size_t N>
struct Bytes {
  char b[N];
};

}  // namespace

GlooComm::GlooComm(store::Store& store, int rank, int size, const std::string& host,
                   Deadline deadline)
    : state_(std::make_unique<State>()), rank_(rank), size_(size) {
  // Gloo writes to its sockets without MSG_NOSIGNAL: a peer that died would kill this process
  // with SIGPIPE instead of raising an error. Ignore SIGPIPE unless the program handles it.
  struct sigaction old {};
  if (::sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL &&
      !(old.sa_flags & SA_SIGINFO))
    ::signal(SIGPIPE, SIG_IGN);
  run_gloo("gloo connect", rank, nullptr, deadline, [&] {
    gloo::transport::tcp::attr attr;
    attr.hostname = host;
    state_->device = gloo::transport::tcp::CreateDevice(attr);
    state_->context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    state_->context->setTimeout(remaining(deadline));
    StoreAdapter adapter(store, deadline);
    state_->context->connectFullMesh(adapter, state_->device);
    for (int i = 0; i < size; ++i) {
      if (i == rank) continue;
      auto& address = state_->context->getPair(i)->address();
      if (auto* tcp = dynamic_cast<const gloo::transport::tcp::Address*>(&address))
        state_->local_addrs.push_back(tcp->getSockaddr());
    }
  });
}

GlooComm::~GlooComm() = default;

std::string GlooComm::abort_reason() const { return detail::abort_reason(*state_); }

void GlooComm::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(state_->abort_mu);
    if (!state_->abort_reason.empty()) return;
    state_->abort_reason = reason.empty() ? "aborted" : reason;
  }
  // Not Context::closeConnections(): it closes the sockets without waking a collective that
  // waits on them, which then runs on to its deadline.
  shutdown_sockets(state_->local_addrs);
}

void GlooComm::allreduce(void* data, size_t count, DataType dtype, ReduceOp op, Deadline deadline) {
  if (count == 0 || size_ == 1) return;
  run_gloo("allreduce", rank_, state_.get(), deadline, [&] {
    gloo::AllreduceOptions opts(state_->context);
    opts.setTimeout(remaining(deadline));
    switch (dtype_size(dtype)) {
      case 1:
        opts.setOutput(static_cast<Bytes<1>*>(data), count);
        break;
      case 2:
        opts.setOutput(static_cast<Bytes<2>*>(data), count);
        break;
      case 4:
        opts.setOutput(static_cast<Bytes<4>*>(data), count);
        break;
      case 8:
        opts.setOutput(static_cast<Bytes<8>*>(data), count);
        break;
      default:
        throw std::invalid_argument(std::string("gloo allreduce: no element size ") +
                                    std::to_string(dtype_size(dtype)));
    }
    opts.setReduceFunction([dtype, op](void* dst, const void* a, const void* b, size_t n) {
      reduce3(dst, a, b, n, dtype, op);
    });
    gloo::allreduce(opts);
  });
}

void GlooComm::broadcast(void* data, size_t bytes, int root, Deadline deadline) {
  if (bytes == 0 || size_ == 1) return;
  run_gloo("broadcast", rank_, state_.get(), deadline, [&] {
    gloo::BroadcastOptions opts(state_->context);
    opts.setTimeout(remaining(deadline));
    opts.setOutput(static_cast<char*>(data), bytes);
    opts.setRoot(root);
    gloo::broadcast(opts);
  });
}

void GlooComm::allgather(const void* send, void* recv, size_t bytes, Deadline deadline) {
  if (bytes == 0) return;
  if (size_ == 1) {
    copy_bytes(recv, send, bytes);
    return;
  }
  run_gloo("allgather", rank_, state_.get(), deadline, [&] {
    gloo::AllgatherOptions opts(state_->context);
    opts.setTimeout(remaining(deadline));
    opts.setInput(const_cast<char*>(static_cast<const char*>(send)), bytes);
    opts.setOutput(static_cast<char*>(recv), bytes * size_);
    gloo::allgather(opts);
  });
}

void GlooComm::barrier(Deadline deadline) {
  if (size_ == 1) return;
  run_gloo("barrier", rank_, state_.get(), deadline, [&] {
    gloo::BarrierOptions opts(state_->context);
    opts.setTimeout(remaining(deadline));
    gloo::barrier(opts);
  });
}

void GlooComm::p2p(const std::vector<Transfer>& transfers, Deadline deadline, const char* what,
                   const std::function<void()>& between) {
  // Per message, on slots 4*tag + 0..2: the sender's header (its length), the receiver's
  // answer (send it), then the data. Gloo would otherwise treat a message longer than the
  // posted receive as a fatal invariant violation.
  struct Posted {
    const Transfer* t = nullptr;
    uint64_t header = 0;  // send: what we announce; recv: what the sender announced
    uint64_t answer = 1;
    std::unique_ptr<gloo::transport::UnboundBuffer> header_buf, answer_buf, body;
  };
  std::vector<Posted> posted(transfers.size());
  auto describe = [&](const Transfer& t) {
    return std::string(what) + ": " + (t.send ? "send to " : "recv from ") + t.peer_name;
  };
  auto wait_one = [&](const Transfer& t, gloo::transport::UnboundBuffer& buf, bool send) {
    bool ok = false;
    try {
      ok = send ? buf.waitSend(remaining(deadline)) : buf.waitRecv(remaining(deadline));
    } catch (const std::exception& e) {
      if (std::string reason = t.comm->abort_reason(); !reason.empty())
        throw CollectiveError(describe(t) + " failed: aborted: " + reason);
      if (Clock::now() + std::chrono::milliseconds(50) >= deadline)
        throw CollectiveTimeoutError(describe(t) + " timed out: " + e.what());
      throw CollectiveError(describe(t) + " failed: " + e.what());
    }
    if (!ok) throw CollectiveError(describe(t) + " failed: aborted");
  };
  auto slot = [](const Transfer& t, int k) { return 4 * static_cast<uint64_t>(t.tag) + k; };
  // A failure shuts the connections down before the posted buffers go away, so that Gloo fails
  // what is still pending on them instead of touching freed buffers.
  try {
    for (size_t i = 0; i < transfers.size(); ++i) {
      Posted& p = posted[i];
      p.t = &transfers[i];
      const Transfer& t = *p.t;
      State& st = *t.comm->state_;
      if (std::string reason = t.comm->abort_reason(); !reason.empty())
        throw CollectiveError(describe(t) + " failed: aborted: " + reason);
      try {
        p.header_buf = st.context->createUnboundBuffer(&p.header, sizeof p.header);
        p.answer_buf = st.context->createUnboundBuffer(&p.answer, sizeof p.answer);
        if (t.send) {
          p.header = t.bytes;
          p.header_buf->send(t.peer, slot(t, 0));
          p.answer_buf->recv(t.peer, slot(t, 1));
        } else {
          p.header_buf->recv(t.peer, slot(t, 0));
        }
      } catch (const std::exception& e) {
        throw CollectiveError(describe(t) + " failed: " + e.what());
      }
    }
    // Receives: the header, then the answer and the receive of the data.
    for (Posted& p : posted) {
      const Transfer& t = *p.t;
      if (t.send) continue;
      wait_one(t, *p.header_buf, false);
      if (p.header != t.bytes)
        throw CollectiveError(describe(t) + " failed: the sender sent " + std::to_string(p.header) +
                              " bytes, this receive expects " + std::to_string(t.bytes));
      p.answer_buf->send(t.peer, slot(t, 1));
      if (t.bytes) {
        p.body = t.comm->state_->context->createUnboundBuffer(t.data, t.bytes);
        p.body->recv(t.peer, slot(t, 2));
      }
    }
    if (between) between();
    // Sends: the answer, then the data.
    for (Posted& p : posted) {
      const Transfer& t = *p.t;
      if (!t.send) continue;
      wait_one(t, *p.answer_buf, false);
      if (t.bytes) {
        p.body = t.comm->state_->context->createUnboundBuffer(t.data, t.bytes);
        p.body->send(t.peer, slot(t, 2));
      }
    }
    for (Posted& p : posted) {
      const Transfer& t = *p.t;
      if (t.send) wait_one(t, *p.header_buf, true);
      if (!t.send) wait_one(t, *p.answer_buf, true);
      if (p.body) wait_one(t, *p.body, t.send);
    }
  } catch (const std::exception& e) {
    for (const Transfer& t : transfers) t.comm->abort(e.what());
    throw;
  }
}

std::string local_address_towards(const std::string& peer_host) {
  if (peer_host.empty() || peer_host == "localhost") return "127.0.0.1";
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(peer_host.c_str(), "9", &hints, &res) != 0 || !res) return "127.0.0.1";
  std::string out = "127.0.0.1";
  int fd = ::socket(res->ai_family, SOCK_DGRAM, 0);
  if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    char buf[INET6_ADDRSTRLEN] = {};
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0) {
      if (ss.ss_family == AF_INET) {
        ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&ss)->sin_addr, buf, sizeof buf);
        out = buf;
      } else if (ss.ss_family == AF_INET6) {
        ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr, buf, sizeof buf);
        out = buf;
      }
    }
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(res);
  return out;
}

}  // namespace trun::worker::detail
