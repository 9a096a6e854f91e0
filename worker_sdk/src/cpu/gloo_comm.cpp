#include "worker_sdk/src/cpu/gloo_comm.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include "worker_sdk/src/reduce.h"

namespace trun::worker::detail {
namespace {

// Gloo's rendezvous store interface over trun's Store.
class StoreAdapter : public gloo::rendezvous::Store {
 public:
  StoreAdapter(rendezvous::Store& store, Deadline deadline) : store_(store), deadline_(deadline) {}
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
  rendezvous::Store& store_;
  Deadline deadline_;
};

template <typename Fn>
void run_gloo(const char* what, int rank, Deadline deadline, Fn&& fn) {
  if (Clock::now() >= deadline)
    throw CollectiveTimeoutError(std::string(what) + " timed out on node rank " +
                                 std::to_string(rank) + " before it started (gloo)");
  try {
    fn();
  } catch (const std::exception& e) {
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

struct GlooComm::State {
  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<gloo::rendezvous::Context> context;
};

GlooComm::GlooComm(rendezvous::Store& store, int rank, int size, const std::string& host,
                   Deadline deadline)
    : state_(std::make_unique<State>()), rank_(rank), size_(size) {
  // Gloo writes to its sockets without MSG_NOSIGNAL: a peer that died would kill this process
  // with SIGPIPE instead of raising an error. Ignore SIGPIPE unless the program handles it.
  struct sigaction old {};
  if (::sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL &&
      !(old.sa_flags & SA_SIGINFO))
    ::signal(SIGPIPE, SIG_IGN);
  run_gloo("gloo connect", rank, deadline, [&] {
    gloo::transport::tcp::attr attr;
    attr.hostname = host;
    state_->device = gloo::transport::tcp::CreateDevice(attr);
    state_->context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    state_->context->setTimeout(remaining(deadline));
    StoreAdapter adapter(store, deadline);
    state_->context->connectFullMesh(adapter, state_->device);
  });
}

GlooComm::~GlooComm() = default;

void GlooComm::allreduce(void* data, size_t count, DataType dtype, ReduceOp op, Deadline deadline) {
  if (count == 0 || size_ == 1) return;
  run_gloo("allreduce", rank_, deadline, [&] {
    gloo::AllreduceOptions opts(state_->context);
    opts.setTimeout(remaining(deadline));
    switch (dtype_size(dtype)) {
      case 2:
        opts.setOutput(static_cast<Bytes<2>*>(data), count);
        break;
      case 4:
        opts.setOutput(static_cast<Bytes<4>*>(data), count);
        break;
      default:
        opts.setOutput(static_cast<Bytes<8>*>(data), count);
        break;
    }
    opts.setReduceFunction([dtype, op](void* dst, const void* a, const void* b, size_t n) {
      reduce3(dst, a, b, n, dtype, op);
    });
    gloo::allreduce(opts);
  });
}

void GlooComm::broadcast(void* data, size_t bytes, int root, Deadline deadline) {
  if (bytes == 0 || size_ == 1) return;
  run_gloo("broadcast", rank_, deadline, [&] {
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
    std::memcpy(recv, send, bytes);
    return;
  }
  run_gloo("allgather", rank_, deadline, [&] {
    gloo::AllgatherOptions opts(state_->context);
    opts.setTimeout(remaining(deadline));
    opts.setInput(const_cast<char*>(static_cast<const char*>(send)), bytes);
    opts.setOutput(static_cast<char*>(recv), bytes * size_);
    gloo::allgather(opts);
  });
}

void GlooComm::barrier(Deadline deadline) {
  if (size_ == 1) return;
  run_gloo("barrier", rank_, deadline, [&] {
    gloo::BarrierOptions opts(state_->context);
    opts.setTimeout(remaining(deadline));
    gloo::barrier(opts);
  });
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
