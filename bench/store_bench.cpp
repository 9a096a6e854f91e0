// store_bench: a load generator for TCPStore-compatible servers (trun's StoreServer and PyTorch
// 1.13's TCPStore server alike).
//
// It speaks the PyTorch 1.13 wire dialect over raw sockets (the only dialect the 1.13 server
// knows; trun's server accepts it too), so both servers see byte-for-byte the same load. One
// thread drives every connection from an epoll loop; each connection runs closed-loop: it sends
// one operation, waits for its reply, then sends the next.
//
// Operations, as the 1.13 Python client issues them:
//   add  ADD key 1                              -> i64 (checked: +1 each time)
//   get  WAIT [key] -> STOP_WAITING, GET key    -> value (checked)
//   set  SET key value; SET has no reply, so a connection sends --set-window SETs and then one
//        GETNUMKEYS round trip to learn they were applied. Only the SETs are counted.
// Connect storm: --storm clients connect at once and each does one ADD on a shared key; the
// figure is the time from the first connect() until the last reply (all connections stay open
// until then; every reply value 1..N must be seen exactly once).
//
// Output: one machine-readable line per row on stdout,
//   ROW name=<op>_<n>c ops=<count> seconds=<s> ops_per_s=<x> [server_cpu_us_per_op=<y>]
//   ROW name=connect_storm_<n> seconds=<s> retries=<r>
//   ROW name=<...> error="<why>"
// and progress on stderr. With --server-pid, each op row also reports the CPU time the server
// process spent per operation during the timed phase (less sensitive to other load on the
// machine than ops/s). Exit status 2 on bad arguments, otherwise 0 (failed rows are reported).

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/decimal.h"
#include "store/tcp_store.h"

namespace trun::bench {
namespace {

using Clock = std::chrono::steady_clock;

// PyTorch 1.13 QueryType values.
constexpr uint8_t kQuerySet = 0;
constexpr uint8_t kQueryGet = 2;
constexpr uint8_t kQueryAdd = 3;
constexpr uint8_t kQueryWait = 5;
constexpr uint8_t kQueryNumKeys = 6;

constexpr size_t kValueBytes = 64;
constexpr std::chrono::seconds kConnectTimeout{30};
constexpr std::chrono::seconds kDrainTimeout{15};

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// --- request encoding (1.13 dialect; integers little-endian, strings u64-length-prefixed) ---
void put_u8(std::string* out, uint8_t v) { out->push_back(static_cast<char>(v)); }
void put_u64(std::string* out, uint64_t v) {
  char b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  out->append(b, 8);
}
void put_str(std::string* out, const std::string& s) {
  put_u64(out, s.size());
  out->append(s);
}
uint64_t get_u64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

// Thrown when a server's reply is not what the protocol (or the data) says it must be.
struct BenchError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Conn {
  int fd = -1;
  bool connecting = false;
  int attempts = 0;
  Clock::time_point retry_at{};
  bool retry_pending = false;
  bool busy = false;      // an operation is in flight
  bool finished = false;  // issued its last operation and got the reply
  std::string key;
  std::string out;
  size_t out_off = 0;
  bool want_out = false;
  std::string in;
  int phase = 0;
  int64_t counter = 0;
};

// What a connection does: encode an operation, and recognise its (complete) reply.
class Workload {
 public:
  virtual ~Workload() = default;
  // Appends the request bytes of one operation to c.out.
  virtual void issue(Conn& c) = 0;
  // Looks at c.in. Returns 0 when more bytes are needed, -1 when it appended a follow-up request
  // of the same operation to c.out (get's GET after WAIT), or the number of operations completed
  // (and consumes the reply). Throws BenchError on a wrong reply.
  virtual int on_input(Conn& c) = 0;
  // Operations one issue() counts for (to bound the op count).
  virtual int ops_per_issue() const { return 1; }
};

// Consumes exactly `n` bytes of reply; a longer buffer means the server sent more than asked.
bool take(Conn& c, size_t n, std::string* reply) {
  if (c.in.size() < n) return false;
  if (c.in.size() > n) throw BenchError("server sent more bytes than the reply holds");
  reply->swap(c.in);
  c.in.clear();
  return true;
}

class AddLoad : public Workload {
 public:
  void issue(Conn& c) override {
    put_u8(&c.out, kQueryAdd);
    put_str(&c.out, c.key);
    put_u64(&c.out, 1);
  }
  int on_input(Conn& c) override {
    std::string r;
    if (!take(c, 8, &r)) return 0;
    int64_t v = static_cast<int64_t>(get_u64(r.data()));
    if (v != c.counter + 1) {
      throw BenchError("add returned " + std::to_string(v) + ", expected " +
                       std::to_string(c.counter + 1));
    }
    c.counter = v;
    return 1;
  }
};

class GetLoad : public Workload {
 public:
  explicit GetLoad(std::string value) : value_(std::move(value)) {}
  void issue(Conn& c) override {
    put_u8(&c.out, kQueryWait);
    put_u64(&c.out, 1);
    put_str(&c.out, c.key);
    c.phase = 0;
  }
  int on_input(Conn& c) override {
    std::string r;
    if (c.phase == 0) {
      if (!take(c, 1, &r)) return 0;
      if (r[0] != 0) throw BenchError("WAIT replied " + std::to_string(r[0]) + ", not 0");
      put_u8(&c.out, kQueryGet);
      put_str(&c.out, c.key);
      c.phase = 1;
      return -1;
    }
    if (c.in.size() < 8) return 0;
    uint64_t len = get_u64(c.in.data());
    if (len != value_.size()) throw BenchError("GET returned " + std::to_string(len) + " bytes");
    if (!take(c, 8 + len, &r)) return 0;
    if (r.compare(8, std::string::npos, value_) != 0) throw BenchError("GET returned wrong bytes");
    return 1;
  }

 private:
  std::string value_;
};

// SET has no reply: send `window` SETs and one GETNUMKEYS to know they were all applied.
class SetLoad : public Workload {
 public:
  SetLoad(std::string value, int window) : value_(std::move(value)), window_(window) {}
  void issue(Conn& c) override {
    for (int i = 0; i < window_; ++i) {
      put_u8(&c.out, kQuerySet);
      put_str(&c.out, c.key);
      put_str(&c.out, value_);
    }
    put_u8(&c.out, kQueryNumKeys);
  }
  int on_input(Conn& c) override {
    std::string r;
    if (!take(c, 8, &r)) return 0;
    if (static_cast<int64_t>(get_u64(r.data())) < 1) throw BenchError("GETNUMKEYS returned < 1");
    return window_;
  }
  int ops_per_issue() const override { return window_; }

 private:
  std::string value_;
  int window_;
};

// The connect storm: one ADD per connection on one shared key; records the values seen.
class StormLoad : public Workload {
 public:
  explicit StormLoad(size_t n) : seen_(n + 1, false) {}
  void issue(Conn& c) override {
    put_u8(&c.out, kQueryAdd);
    put_str(&c.out, c.key);
    put_u64(&c.out, 1);
  }
  int on_input(Conn& c) override {
    std::string r;
    if (!take(c, 8, &r)) return 0;
    int64_t v = static_cast<int64_t>(get_u64(r.data()));
    if (v < 1 || static_cast<size_t>(v) >= seen_.size() || seen_[v]) {
      throw BenchError("storm add returned " + std::to_string(v) + " (duplicate or out of range)");
    }
    seen_[v] = true;
    return 1;
  }

 private:
  std::vector<bool> seen_;
};

// Warm-up of a freshly connected client: one SET of its key and a GETNUMKEYS round trip, so the
// server has accepted it and (for get) the key exists before the clock starts.
class WarmupLoad : public SetLoad {
 public:
  explicit WarmupLoad(std::string value) : SetLoad(std::move(value), 1) {}
};

struct RunStats {
  uint64_t ops = 0;
  double seconds = 0;
  int retries = 0;
};

// Drives a set of connections over one epoll instance.
class Driver {
 public:
  Driver(sockaddr_in addr, std::vector<Conn>* conns) : addr_(addr), conns_(conns) {
    ep_ = epoll_create1(EPOLL_CLOEXEC);
    if (ep_ < 0) throw BenchError(std::string("epoll_create1: ") + std::strerror(errno));
  }
  ~Driver() { ::close(ep_); }
  Driver(const Driver&) = delete;
  Driver& operator=(const Driver&) = delete;

  // Runs `load`: when `connect_first`, each connection is opened first (with retries) and starts
  // as soon as it is connected. Operations are issued until `issue_until` or until `max_ops` were
  // issued; when `once`, every connection does exactly one. Returns when every connection is idle
  // again; throws BenchError when `hard_deadline` passes first.
  RunStats run(Workload& load, bool connect_first, bool once, Clock::time_point issue_until,
               uint64_t max_ops, Clock::time_point hard_deadline) {
    load_ = &load;
    once_ = once;
    max_ops_ = max_ops;
    issue_until_ = issue_until;
    issued_ = 0;
    stats_ = RunStats{};
    busy_ = 0;
    start_ = Clock::now();
    last_done_ = start_;
    stop_issuing_ = false;
    for (size_t i = 0; i < conns_->size(); ++i) {
      Conn& c = (*conns_)[i];
      c.finished = false;
      if (connect_first) {
        start_connect(i);
      } else {
        begin(i);
      }
    }
    std::vector<epoll_event> events(1024);
    while (busy_ > 0) {
      Clock::time_point now = Clock::now();
      if (now > hard_deadline) {
        throw BenchError(std::to_string(busy_) + " of " + std::to_string(conns_->size()) +
                         " clients still unfinished after " +
                         std::to_string(static_cast<int>(seconds_between(start_, now))) + " s");
      }
      stop_issuing_ = now >= issue_until_;
      int timeout_ms = 100;
      if (pending_retries_ > 0) timeout_ms = 5;
      int n = epoll_wait(ep_, events.data(), static_cast<int>(events.size()), timeout_ms);
      if (n < 0) {
        if (errno == EINTR) continue;
        throw BenchError(std::string("epoll_wait: ") + std::strerror(errno));
      }
      for (int k = 0; k < n; ++k) handle(events[k].data.u64, events[k].events);
      if (pending_retries_ > 0) run_retries();
    }
    stats_.seconds = seconds_between(start_, last_done_);
    return stats_;
  }

 private:
  void start_connect(size_t i) {
    Conn& c = (*conns_)[i];
    c.fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (c.fd < 0) throw BenchError(std::string("socket: ") + std::strerror(errno));
    int one = 1;
    setsockopt(c.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    ++busy_;
    c.busy = true;
    c.connecting = true;
    ++c.attempts;
    int rc = ::connect(c.fd, reinterpret_cast<const sockaddr*>(&addr_), sizeof(addr_));
    if (rc < 0 && errno != EINPROGRESS) {
      connect_failed(i, errno);
      return;
    }
    epoll_event ev{};
    ev.events = EPOLLOUT;
    ev.data.u64 = i;
    if (epoll_ctl(ep_, EPOLL_CTL_ADD, c.fd, &ev) < 0) {
      throw BenchError(std::string("epoll_ctl: ") + std::strerror(errno));
    }
  }

  // Refused or reset while connecting (a full accept queue): retry with a growing pause, as
  // PyTorch's client does.
  void connect_failed(size_t i, int err) {
    Conn& c = (*conns_)[i];
    ::close(c.fd);
    c.fd = -1;
    --busy_;
    c.busy = false;
    if (Clock::now() - start_ > kConnectTimeout) {
      throw BenchError(std::string("connect failed: ") + std::strerror(err) + " after " +
                       std::to_string(c.attempts) + " attempts");
    }
    ++stats_.retries;
    c.retry_pending = true;
    c.retry_at = Clock::now() + std::chrono::milliseconds(std::min(10 * c.attempts, 200));
    ++pending_retries_;
    ++busy_;  // still owes its operation
  }

  void run_retries() {
    Clock::time_point now = Clock::now();
    for (size_t i = 0; i < conns_->size(); ++i) {
      Conn& c = (*conns_)[i];
      if (c.retry_pending && c.retry_at <= now) {
        c.retry_pending = false;
        --pending_retries_;
        --busy_;
        start_connect(i);
      }
    }
  }

  // A connected connection starts its first operation.
  void begin(size_t i) {
    Conn& c = (*conns_)[i];
    if (c.connecting) {
      c.connecting = false;  // already counted as busy by start_connect
    } else {
      // Connected by an earlier run() of this driver: still registered for EPOLLIN.
      ++busy_;
      c.busy = true;
    }
    issue(i);
  }

  void issue(size_t i) {
    Conn& c = (*conns_)[i];
    load_->issue(c);
    issued_ += static_cast<uint64_t>(load_->ops_per_issue());
    flush(i);
  }

  void set_interest(size_t i, bool want_out) {
    Conn& c = (*conns_)[i];
    if (c.want_out == want_out) return;
    c.want_out = want_out;
    epoll_event ev{};
    ev.events = EPOLLIN | (want_out ? EPOLLOUT : 0u);
    ev.data.u64 = i;
    if (epoll_ctl(ep_, EPOLL_CTL_MOD, c.fd, &ev) < 0) {
      throw BenchError(std::string("epoll_ctl: ") + std::strerror(errno));
    }
  }

  void flush(size_t i) {
    Conn& c = (*conns_)[i];
    while (c.out_off < c.out.size()) {
      ssize_t n = ::send(c.fd, c.out.data() + c.out_off, c.out.size() - c.out_off, MSG_NOSIGNAL);
      if (n > 0) {
        c.out_off += static_cast<size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        set_interest(i, true);
        return;
      } else {
        throw BenchError(std::string("send: ") + std::strerror(errno));
      }
    }
    c.out.clear();
    c.out_off = 0;
    set_interest(i, false);
  }

  void handle(size_t i, uint32_t events) {
    Conn& c = (*conns_)[i];
    if (c.connecting) {
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(c.fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        epoll_ctl(ep_, EPOLL_CTL_DEL, c.fd, nullptr);
        connect_failed(i, err);
        return;
      }
      c.want_out = true;  // registered for EPOLLOUT; flush() narrows it to EPOLLIN
      begin(i);
      return;
    }
    if (events & EPOLLOUT) flush(i);
    if (!(events & (EPOLLIN | EPOLLERR | EPOLLHUP))) return;
    char buf[64 * 1024];
    ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
    if (n == 0) throw BenchError("server closed a connection");
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) return;
      throw BenchError(std::string("recv: ") + std::strerror(errno));
    }
    if (!c.busy) throw BenchError("server sent bytes nobody asked for");
    c.in.append(buf, static_cast<size_t>(n));
    for (;;) {
      int r = load_->on_input(c);
      if (r == 0) return;
      if (r < 0) {
        flush(i);
        continue;
      }
      stats_.ops += static_cast<uint64_t>(r);
      last_done_ = Clock::now();
      if (!once_ && !stop_issuing_ && issued_ < max_ops_) {
        issue(i);
      } else {
        c.busy = false;
        c.finished = true;
        --busy_;
      }
      return;
    }
  }

  sockaddr_in addr_;
  std::vector<Conn>* conns_;
  int ep_ = -1;
  Workload* load_ = nullptr;
  bool once_ = false;
  bool stop_issuing_ = false;
  uint64_t max_ops_ = 0;
  uint64_t issued_ = 0;
  size_t busy_ = 0;
  int pending_retries_ = 0;
  Clock::time_point issue_until_{};
  Clock::time_point start_{};
  Clock::time_point last_done_{};
  RunStats stats_;
};

void close_all(std::vector<Conn>* conns) {
  for (auto& c : *conns) {
    if (c.fd >= 0) ::close(c.fd);
    c.fd = -1;
  }
}

struct Options {
  std::string host = "127.0.0.1";
  int port = 0;
  std::vector<int> clients = {1, 64, 1024};
  std::vector<std::string> ops = {"set", "get", "add"};
  double seconds = 2.0;
  uint64_t max_ops = 5'000'000;
  int storm = 4096;
  int set_window = 16;
  std::string label = "run";
  bool trun_client = false;
  int server_pid = 0;
};

// CPU time consumed so far by process `pid` (all its threads), or -1 when it cannot be read.
double process_cpu_seconds(int pid) {
  clockid_t clock;
  timespec ts{};
  if (pid <= 0 || clock_getcpuclockid(pid, &clock) != 0 || clock_gettime(clock, &ts) != 0) {
    return -1;
  }
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "store_bench: %s\n"
               "usage: store_bench --port P [--host 127.0.0.1] [--clients 1,64,1024]\n"
               "         [--ops set,get,add] [--seconds 2] [--max-ops 5000000] [--storm 4096]\n"
               "         [--set-window 16] [--label NAME] [--trun-client] [--server-pid PID]\n"
               "  --storm 0 skips the connect storm; --clients '' skips the op rows.\n"
               "  --trun-client adds rows for trun's own TcpStore client (1 client; needs a trun\n"
               "    server, since it speaks the 2.x dialect with trun's extensions).\n",
               why);
  std::exit(2);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= s.size() && !s.empty()) {
    size_t comma = s.find(',', pos);
    if (comma == std::string::npos) comma = s.size();
    if (comma > pos) out.push_back(s.substr(pos, comma - pos));
    pos = comma + 1;
  }
  return out;
}

// strtol's syntax as always (a leading '+' or spaces are taken), the whole value, in [lo, hi].
long parse_int(const std::string& flag, const std::string& v, long lo, long hi) {
  long x = 0;
  if (!trun::base::parse_decimal(v, &x, trun::base::DecimalSyntax{true, true}) || x < lo ||
      x > hi) {
    usage((flag + ": '" + v + "' is not an integer in [" + std::to_string(lo) + ", " +
           std::to_string(hi) + "]")
              .c_str());
  }
  return x;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--trun-client") {
      o.trun_client = true;
      continue;
    }
    if (a == "-h" || a == "--help") usage("help");
    if (i + 1 >= argc) usage((a + " needs a value (or is unknown)").c_str());
    std::string v = argv[++i];
    if (a == "--host") {
      o.host = v;
    } else if (a == "--port") {
      o.port = static_cast<int>(parse_int(a, v, 1, 65535));
    } else if (a == "--clients") {
      o.clients.clear();
      for (auto& s : split(v)) o.clients.push_back(static_cast<int>(parse_int(a, s, 1, 16384)));
    } else if (a == "--ops") {
      o.ops = split(v);
      for (auto& op : o.ops) {
        if (op != "set" && op != "get" && op != "add") usage(("unknown op '" + op + "'").c_str());
      }
    } else if (a == "--seconds") {
      char* end = nullptr;
      o.seconds = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0' || !(o.seconds > 0 && o.seconds <= 60)) {
        usage("--seconds must be in (0, 60]");
      }
    } else if (a == "--max-ops") {
      o.max_ops = static_cast<uint64_t>(parse_int(a, v, 1, 1'000'000'000));
    } else if (a == "--storm") {
      o.storm = static_cast<int>(parse_int(a, v, 0, 16384));
    } else if (a == "--set-window") {
      o.set_window = static_cast<int>(parse_int(a, v, 1, 1024));
    } else if (a == "--server-pid") {
      o.server_pid = static_cast<int>(parse_int(a, v, 1, 1 << 30));
    } else if (a == "--label") {
      o.label = v;
    } else {
      usage(("unknown flag " + a).c_str());
    }
  }
  if (o.port == 0) usage("--port is required");
  return o;
}

void raise_fd_limit(size_t needed) {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
  if (rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  if (rl.rlim_cur < needed + 64) {
    std::fprintf(stderr, "store_bench: warning: RLIMIT_NOFILE is %llu, %zu sockets are needed\n",
                 static_cast<unsigned long long>(rl.rlim_cur), needed);
  }
}

// Keys of this run: unique per process, so that runs against one server do not share counters.
std::string key_root(const Options& o) {
  return "/bench/" + o.label + "." + std::to_string(getpid());
}

void print_error_row(const std::string& name, const std::string& why) {
  std::string clean = why;
  std::replace(clean.begin(), clean.end(), '"', '\'');
  std::printf("ROW name=%s error=\"%s\"\n", name.c_str(), clean.c_str());
  std::fflush(stdout);
}

void op_row(const Options& o, const sockaddr_in& addr, const std::string& op, int n) {
  std::string name = op + "_" + std::to_string(n) + "c";
  std::string value(kValueBytes, 'v');
  std::vector<Conn> conns(static_cast<size_t>(n));
  auto key_of = [&](int i) { return key_root(o) + "/" + name + "/" + std::to_string(i); };
  // The warm-up writes a (non-integer) value; add rows count on a key of their own.
  for (int i = 0; i < n; ++i) conns[i].key = key_of(i) + (op == "add" ? "/warmup" : "");
  try {
    Driver driver(addr, &conns);
    WarmupLoad warmup(value);
    auto far = Clock::now() + std::chrono::hours(1);
    driver.run(warmup, /*connect_first=*/true, /*once=*/true, far, UINT64_MAX,
               Clock::now() + kConnectTimeout);
    for (int i = 0; i < n; ++i) conns[i].key = key_of(i);
    std::unique_ptr<Workload> load;
    if (op == "add") {
      load = std::make_unique<AddLoad>();
    } else if (op == "get") {
      load = std::make_unique<GetLoad>(value);
    } else {
      load = std::make_unique<SetLoad>(value, o.set_window);
    }
    auto issue_until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>(o.seconds));
    double cpu_before = process_cpu_seconds(o.server_pid);
    RunStats s = driver.run(*load, /*connect_first=*/false, /*once=*/false, issue_until, o.max_ops,
                            issue_until + kDrainTimeout);
    double cpu_after = process_cpu_seconds(o.server_pid);
    std::string cpu;
    if (cpu_before >= 0 && cpu_after >= 0 && s.ops > 0) {
      cpu = " server_cpu_us_per_op=" + std::to_string((cpu_after - cpu_before) * 1e6 / s.ops);
    }
    std::printf("ROW name=%s ops=%" PRIu64 " seconds=%.4f ops_per_s=%.1f%s\n", name.c_str(), s.ops,
                s.seconds, s.seconds > 0 ? s.ops / s.seconds : 0.0, cpu.c_str());
    std::fflush(stdout);
    std::fprintf(stderr, "[%s] %-9s %10.0f ops/s\n", o.label.c_str(), name.c_str(),
                 s.seconds > 0 ? s.ops / s.seconds : 0.0);
  } catch (const BenchError& e) {
    print_error_row(name, e.what());
    std::fprintf(stderr, "[%s] %s failed: %s\n", o.label.c_str(), name.c_str(), e.what());
  }
  close_all(&conns);
}

void storm_row(const Options& o, const sockaddr_in& addr) {
  std::string name = "connect_storm_" + std::to_string(o.storm);
  std::vector<Conn> conns(static_cast<size_t>(o.storm));
  for (auto& c : conns) c.key = key_root(o) + "/storm";
  try {
    Driver driver(addr, &conns);
    StormLoad load(conns.size());
    auto far = Clock::now() + std::chrono::hours(1);
    RunStats s = driver.run(load, /*connect_first=*/true, /*once=*/true, far, UINT64_MAX,
                            Clock::now() + kConnectTimeout);
    if (s.ops != conns.size()) throw BenchError("only " + std::to_string(s.ops) + " adds done");
    std::printf("ROW name=%s seconds=%.4f retries=%d\n", name.c_str(), s.seconds, s.retries);
    std::fflush(stdout);
    std::fprintf(stderr, "[%s] %s %.3f s (%d connect retries)\n", o.label.c_str(), name.c_str(),
                 s.seconds, s.retries);
  } catch (const BenchError& e) {
    print_error_row(name, e.what());
    std::fprintf(stderr, "[%s] %s failed: %s\n", o.label.c_str(), name.c_str(), e.what());
  }
  close_all(&conns);
}

// trun's own synchronous client, one connection, for reference.
void trun_client_rows(const Options& o) {
  using store::TcpStore;
  store::TcpStoreOptions to;
  to.host = o.host;
  to.port = static_cast<uint16_t>(o.port);
  to.timeout = std::chrono::seconds(30);
  to.connect_timeout = std::chrono::seconds(10);
  to.dialect = store::StoreDialect::kTrun;  // measured against trun's server only
  std::string value(kValueBytes, 'v');
  for (const auto& op : o.ops) {
    std::string name = "tcpstore_" + op + "_1c";
    try {
      TcpStore store(to);
      store::Store& s = store;
      std::string key = key_root(o) + "/" + name;
      s.set(key, value);
      auto start = Clock::now();
      auto until = start + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(o.seconds));
      uint64_t ops = 0;
      int64_t expect = 0;
      while (ops < o.max_ops && (ops % 64 != 0 || Clock::now() < until)) {
        if (op == "set") {
          s.set(key, value);
        } else if (op == "get") {
          if (s.get(key) != value) throw BenchError("get returned the wrong value");
        } else {
          if (s.add(key + "/n", 1) != ++expect) throw BenchError("add returned a wrong value");
        }
        ++ops;
      }
      if (op == "set") s.num_keys();  // every SET applied
      double secs = seconds_between(start, Clock::now());
      std::printf("ROW name=%s ops=%" PRIu64 " seconds=%.4f ops_per_s=%.1f\n", name.c_str(), ops,
                  secs, ops / secs);
      std::fflush(stdout);
      std::fprintf(stderr, "[%s] %-9s %10.0f ops/s\n", o.label.c_str(), name.c_str(), ops / secs);
    } catch (const std::exception& e) {
      print_error_row(name, e.what());
    }
  }
}

int run(int argc, char** argv) {
  Options o = parse(argc, argv);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(o.port));
  if (inet_pton(AF_INET, o.host.c_str(), &addr.sin_addr) != 1) {
    usage(("--host must be an IPv4 address, got '" + o.host + "'").c_str());
  }
  size_t most = static_cast<size_t>(o.storm);
  for (int n : o.clients) most = std::max(most, static_cast<size_t>(n));
  raise_fd_limit(most);

  for (const auto& op : o.ops) {
    for (int n : o.clients) op_row(o, addr, op, n);
  }
  if (o.trun_client) trun_client_rows(o);
  if (o.storm > 0) storm_row(o, addr);
  return 0;
}

}  // namespace
}  // namespace trun::bench

int main(int argc, char** argv) { return trun::bench::run(argc, argv); }
