// rdzv_scale: up to 100,000 simulated agents run trun's c10d rendezvous against one real
// StoreServer, without a thread per agent.
//
// A simulated agent is one TCP connection and a small state machine on a shared event loop (one
// thread for all of them). It sends what a joining agent sends (rendezvous/dynamic_rendezvous.cpp,
// join_round), in trun's wire protocol: the round key (COMPARE_SET), a ticket (ADD), its lease with
// its descriptor (LEASE_ARM), the result (GET_WAIT), and reads its rank with the real decision code
// (dynamic::decide_after_result). The agent that draws ticket 1 starts the real leader
// (rendezvous/round_leader.h) on a thread of its own, over a real c10d backend. Its lease is bound
// to its connection (ttl 0): a simulated agent sends no keep-alives (docs/rendezvous.md, "Scale").
//
// Connections come from many loopback source addresses (127.X.Y.Z, at most 16000 per address) so
// that 100,000 of them do not run out of ephemeral ports. The descriptor limit is raised to what
// the run needs (root may raise the hard limit too); a run that cannot get it says so and is left
// out.
//
// The store runs in this process; the agents in one forked child. For each N: time from the
// release of the agents until the last has its rank (connecting included), store requests per
// agent (counted by the server, handshakes excluded), and the store process's memory per
// connected agent (RSS and the kernel's TCP memory, after the round, with every agent connected).
// --leave N: the same round of N nodes (--nnodes=1:N), then one agent's connection closes (its
// lease fires: the round is over) and the time until every survivor has its rank in the next
// round is measured.
//
// Usage: rdzv_scale [--nodes 64,256,...] [--leave N] [--connects K] [--peer-file F]
// F: lines "peer nodes=N seconds=S requests_per_agent=R ranks_ok=1" (bench/rdzv_torch_peer.py).
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <spdlog/spdlog.h>

#include "bench/bench_process.h"
#include "rendezvous/c10d/backend.h"
#include "rendezvous/dynamic_decisions.h"
#include "rendezvous/round_leader.h"
#include "store/relay.h"
#include "store/server.h"
#include "store/wire.h"

using namespace trun::rendezvous;
using namespace trun::store;
using namespace trun::rendezvous::dynamic;
namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using wire::Op;

namespace {

using trun::bench::mono_ns;
using trun::bench::read_all;
using trun::bench::write_all;

// What the child reports after each phase (a round every agent is in).
struct PhaseReport {
  int64_t start_ns = 0;  // release (phase 1) or the leave (phase 2)
  int64_t end_ns = 0;    // the last agent had its rank
  int32_t ranked = 0;
  int32_t failures = 0;
  int32_t ranks_ok = 0;  // ranks are exactly 0..ranked-1
  char error[200] = {};
};

struct SimConfig {
  int nodes = 0;  // in the round
  int first = 0;  // this process's agents: first .. first + count - 1
  int count = 0;
  int min_nodes = 0;
  uint16_t port = 0;        // where the agents connect (the store, or their relay)
  uint16_t store_port = 0;  // where a leader connects (the store)
  std::string run_id;
  int addr_block = 1;  // source addresses 127.<addr_block>.x.y
  int max_connecting = 1000;
  bool leave = false;  // phase 2: one agent leaves, the rest re-rendezvous
};

class Sim;

// Reads little-endian wire values from the front of a buffer; false while incomplete.
struct Parser {
  const std::string& in;
  size_t pos = 0;
  bool u8(uint8_t* v) {
    if (in.size() < pos + 1) return false;
    *v = static_cast<uint8_t>(in[pos++]);
    return true;
  }
  bool i64(int64_t* v) {
    if (in.size() < pos + 8) return false;
    std::memcpy(v, in.data() + pos, 8);
    pos += 8;
    return true;
  }
  // A GET_TIMEOUT reply: the status, and the value when it is STOP_WAITING. False while
  // incomplete (nothing consumed then).
  bool wait_reply(uint8_t* status, std::string* v) {
    const size_t start = pos;
    if (!u8(status)) return false;
    if (*status != wire::kWaitStop || bytes(v)) return true;
    pos = start;
    return false;
  }
  bool bytes(std::string* v) {
    int64_t n = 0;
    size_t start = pos;
    if (!i64(&n)) return false;
    if (in.size() < pos + size_t(n)) {
      pos = start;
      return false;
    }
    v->assign(in.data() + pos, size_t(n));
    pos += size_t(n);
    return true;
  }
};

// GET_TIMEOUT of `key` (10 minutes).
std::string get_wait(const std::string& key) {
  std::string req;
  wire::Encoder(&req).query(Op::kGetWait).u64(1).bytes(key).i64(600000);
  return req;
}

class Agent {
 public:
  Agent(Sim* sim, int index, asio::io_context& io) : sim_(sim), index_(index), socket_(io) {}
  void start();
  void leave();   // phase 2's victim: its connection closes
  void rejoin();  // the round it is in ended: join the next one
  int rank() const { return rank_; }
  int64_t round() const { return round_; }

 private:
  enum class Step { kRound, kTicket, kLease, kResult, kOver, kIdle };
  void send(Step next, std::string request);
  void wait_readable();
  void on_readable(boost::system::error_code ec);
  bool parse();  // true when the current step's reply was complete (and acted on)
  void fail(const std::string& why);
  void request_round();
  void request_ticket();
  NodeDesc me() const;

  Sim* sim_;
  int index_;
  tcp::socket socket_;
  std::string in_, out_;
  Step step_ = Step::kIdle;
  int64_t round_ = -1;  // the round being joined, then the one this agent is in
  int64_t ticket_ = 0;
  int64_t last_round_ = -1;
  int last_rank_ = -1;
  int rank_ = -1;
  bool dead_ = false;
};

class Sim {
 public:
  explicit Sim(SimConfig c) : c_(std::move(c)), keys_(c_.run_id) {
    options_.run_id = c_.run_id;
    options_.min_nodes = c_.min_nodes;
    options_.max_nodes = c_.nodes;
    options_.read_timeout = std::chrono::seconds(120);
    options_.keep_alive_interval = std::chrono::seconds(60);
    // --nnodes=1:N (the leave scenario) waits this long for the rest once one node is in: long
    // enough for every agent to connect, so that round 0 holds all N.
    options_.last_call_timeout = std::chrono::seconds(60);
    options_.progress_interval = std::chrono::milliseconds(0);
    server_ = tcp::endpoint(asio::ip::make_address("127.0.0.1"), c_.port);
    for (int i = 0; i < c_.count; ++i) {
      agents_.push_back(std::make_unique<Agent>(this, c_.first + i, io_));
    }
    expected_ = c_.count;
  }

  // Phase 1: every agent joins round 0, then (leave) phase 2: the parent writes one byte on
  // `go_fd` to the process holding the last agent, which then leaves. Reports each phase on
  // `report_fd`: a PhaseReport, then the ranks.
  void run(int report_fd, int go_fd) {
    report_fd_ = report_fd;
    go_fd_ = go_fd;
    phase_start_ = mono_ns();
    start_more();
    io_.run();
    for (auto& t : leaders_) t.join();
    if (go_thread_.joinable()) go_thread_.join();
  }

  const SimConfig& config() const { return c_; }
  const Keys& keys() const { return keys_; }
  const RendezvousOptions& options() const { return options_; }
  const tcp::endpoint& server() const { return server_; }
  std::array<char, 64 * 1024>& buffer() { return buffer_; }
  int phase() const { return phase_; }

  void connected() {
    --connecting_;
    start_more();
  }
  void start_leader(int64_t round) {
    leaders_.emplace_back([this, round] {
      try {
        StoreBackendOptions bo;
        bo.host = "127.0.0.1";
        bo.port = c_.store_port;
        bo.read_timeout = options_.read_timeout;
        auto backend = connect_store_backend(bo);
        RoundLeader leader(*backend, keys_, options_, "simulated leader");
        leader.lead(round, std::chrono::steady_clock::now() + std::chrono::seconds(600));
      } catch (const std::exception& e) {
        asio::post(io_, [this, what = std::string(e.what())] { failed("leader: " + what); });
      }
    });
  }
  void ranked() {
    if (++ranked_ < expected_) return;
    finish_phase();
  }
  void failed(const std::string& why) {
    if (error_.empty()) {
      error_ = why;
      std::fprintf(stderr, "rdzv_scale: %s\n", why.c_str());  // at once: the phase may not end
    }
    ++failures_;
    if (ranked_ + failures_ >= expected_) finish_phase();
  }

 private:
  void start_more() {
    while (connecting_ < c_.max_connecting && next_to_start_ < c_.count) {
      ++connecting_;
      agents_[next_to_start_++]->start();
    }
  }

  bool holds_victim() const { return c_.first + c_.count == c_.nodes; }

  void finish_phase() {
    if (finished_phase_ == phase_) return;
    finished_phase_ = phase_;
    PhaseReport r;
    r.start_ns = phase_start_;
    r.end_ns = mono_ns();
    r.ranked = ranked_;
    r.failures = failures_;
    std::vector<int32_t> ranks;
    for (auto& a : agents_) {
      if (a->rank() >= 0 && a->round() == round_of_phase()) ranks.push_back(a->rank());
    }
    r.ranks_ok = static_cast<int>(ranks.size()) == expected_ && failures_ == 0;
    std::snprintf(r.error, sizeof(r.error), "%s", error_.c_str());
    write_all(report_fd_, &r, sizeof(r));
    const int32_t n = static_cast<int32_t>(ranks.size());
    write_all(report_fd_, &n, sizeof(n));
    write_all(report_fd_, ranks.data(), ranks.size() * sizeof(int32_t));
    if (phase_ == 1 && c_.leave && r.ranks_ok) {
      // Every agent here now waits for round 0 to end; survivors that rank in round 1 count
      // for phase 2 from now on.
      phase_ = 2;
      ranked_ = 0;
      failures_ = 0;
      expected_ = holds_victim() ? c_.count - 1 : c_.count;
      phase_start_ = 0;
      if (holds_victim()) {
        go_thread_ = std::thread([this] {
          char go = 0;
          if (!read_all(go_fd_, &go, 1)) return;
          asio::post(io_, [this] {
            phase_start_ = mono_ns();
            agents_.back()->leave();
            if (expected_ == 0) finish_phase();
          });
        });
      } else if (expected_ == 0) {
        finish_phase();
      }
      return;
    }
    io_.stop();
  }
  int64_t round_of_phase() const { return phase_ == 1 ? 0 : 1; }

  SimConfig c_;
  Keys keys_;
  RendezvousOptions options_;
  asio::io_context io_{1};
  tcp::endpoint server_;
  std::vector<std::unique_ptr<Agent>> agents_;
  std::vector<std::thread> leaders_;
  std::thread go_thread_;
  std::array<char, 64 * 1024> buffer_;
  int connecting_ = 0;
  int next_to_start_ = 0;
  int ranked_ = 0;
  int failures_ = 0;
  int expected_ = 0;
  int phase_ = 1;
  int finished_phase_ = 0;
  int64_t phase_start_ = 0;
  int report_fd_ = -1;
  int go_fd_ = -1;
  std::string error_;
};

NodeDesc Agent::me() const {
  NodeDesc d;
  d.id = "sim-" + std::to_string(index_);
  d.addr = "127.0.0.1";
  d.prev_round = last_round_;
  d.prev_rank = last_rank_;
  d.master_port = static_cast<uint16_t>(20000 + index_ % 40000);
  d.ticket = ticket_;
  return d;
}

void Agent::start() {
  boost::system::error_code ec;
  socket_.open(tcp::v4(), ec);
  int one = 1;
  if (!ec) ::setsockopt(socket_.native_handle(), IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, 4);
  // 127.<block>.<hi>.<lo>: at most 10000 agents share a source address.
  const int a = 1 + index_ / 10000;
  const std::string source = "127." + std::to_string(sim_->config().addr_block) + "." +
                             std::to_string(a / 256) + "." + std::to_string(a % 256);
  if (!ec) socket_.bind(tcp::endpoint(asio::ip::make_address(source), 0), ec);
  if (ec) {
    sim_->connected();
    fail("socket: " + ec.message());
    return;
  }
  socket_.async_connect(sim_->server(), [this](const boost::system::error_code& ec) {
    sim_->connected();
    if (ec) {
      fail("connect: " + ec.message());
      return;
    }
    boost::system::error_code ignored;
    socket_.set_option(tcp::no_delay(true), ignored);
    socket_.non_blocking(true, ignored);
    wire::Encoder(&out_).query(Op::kValidate).u32(wire::kValidationMagic);
    request_round();
  });
}

void Agent::request_round() {
  std::string req;
  wire::Encoder(&req).query(Op::kCompareSet).bytes(sim_->keys().round()).bytes("").bytes("0");
  send(Step::kRound, std::move(req));
}

void Agent::request_ticket() {
  std::string req;
  wire::Encoder(&req).query(Op::kAdd).bytes(sim_->keys().ticket(round_)).i64(1);
  send(Step::kTicket, std::move(req));
}

void Agent::send(Step next, std::string request) {
  step_ = next;
  out_ += request;
  auto buffer = std::make_shared<std::string>(std::move(out_));
  out_.clear();
  asio::async_write(socket_, asio::buffer(*buffer),
                    [this, buffer](const boost::system::error_code& ec, size_t) {
                      if (ec && !dead_) fail("write: " + ec.message());
                    });
  wait_readable();
}

void Agent::wait_readable() {
  socket_.async_wait(tcp::socket::wait_read,
                     [this](const boost::system::error_code& ec) { on_readable(ec); });
}

void Agent::on_readable(boost::system::error_code ec) {
  if (dead_) return;
  if (!ec) {
    auto& buffer = sim_->buffer();
    size_t n = socket_.read_some(asio::buffer(buffer), ec);
    if (ec == asio::error::would_block) {
      wait_readable();
      return;
    }
    if (!ec) in_.append(buffer.data(), n);
  }
  if (ec) {
    fail("read: " + ec.message());
    return;
  }
  while (!dead_ && parse()) {
  }
  if (!dead_ && step_ != Step::kIdle) wait_readable();
}

bool Agent::parse() {
  Parser p{in_};
  switch (step_) {
    case Step::kIdle:
      return false;
    case Step::kRound: {
      std::string v;
      if (!p.bytes(&v)) return false;
      in_.erase(0, p.pos);
      RoundKey rk = parse_round_key(v);
      if (rk.closed) {
        fail("the rendezvous is closed");
        return false;
      }
      round_ = std::max(rk.round, last_round_ + 1);
      request_ticket();
      return true;
    }
    case Step::kTicket: {
      if (!p.i64(&ticket_)) return false;
      in_.erase(0, p.pos);
      if (ticket_ == 1) sim_->start_leader(round_);
      const NodeDesc d = me();
      std::string req;
      wire::Encoder(&req)
          .query(Op::kLeaseArm)
          .bytes(sim_->keys().node(round_, ticket_))
          .bytes(encode_node(d))
          .bytes(sim_->keys().result(round_))
          .bytes(abort_record("node " + d.id + " left before the round completed"))
          .bytes(sim_->keys().over(round_))
          .bytes(encode_over({RoundEvent::Kind::kNodeLeft, d.id, "connection to the store closed"}))
          .i64(0);  // bound to the connection: no keep-alives
      send(Step::kLease, std::move(req));
      return true;
    }
    case Step::kLease: {
      uint8_t ok = 0;
      if (!p.u8(&ok)) return false;
      in_.erase(0, p.pos);
      send(Step::kResult, get_wait(sim_->keys().result(round_)));
      return true;
    }
    case Step::kResult: {
      uint8_t status = 0;
      std::string v;
      if (!p.wait_reply(&status, &v)) return false;
      in_.erase(0, p.pos);
      if (status != wire::kWaitStop) {
        fail("no result for round " + std::to_string(round_));
        return false;
      }
      RoundResult result = decode_result(v);
      JoinOutcome o = decide_after_result(result, me(), sim_->options().max_nodes);
      if (o.kind == JoinOutcome::Kind::kRanked) {
        rank_ = o.rank;
        step_ = Step::kIdle;
        // The wait for the round's end goes out before ranked(): the last agent's ranked() ends
        // phase 1, and that agent must wait for the leave like the others.
        if (sim_->config().leave && sim_->phase() == 1) {
          send(Step::kOver, get_wait(sim_->keys().over(round_)));
        }
        sim_->ranked();
        return true;
      }
      if (o.kind == JoinOutcome::Kind::kClosed) {
        fail("closed");
        return false;
      }
      if (o.announce_join) {  // a round with room formed without this node: tell its members
        std::string req;
        wire::Encoder(&req)
            .query(Op::kAppend)
            .bytes(sim_->keys().over(round_))
            .bytes(encode_over({RoundEvent::Kind::kNodeJoined, me().id, "waits to join"}));
        out_ += req;
      }
      ++round_;  // aborted, or no room: the next round
      request_ticket();
      return true;
    }
    case Step::kOver: {
      uint8_t status = 0;
      std::string v;
      if (!p.wait_reply(&status, &v)) return false;
      in_.erase(0, p.pos);
      if (status != wire::kWaitStop) {
        fail("round " + std::to_string(round_) + " never ended");
        return false;
      }
      rejoin();
      return true;
    }
  }
  return false;
}

void Agent::rejoin() {
  last_round_ = round_;
  last_rank_ = rank_;
  rank_ = -1;
  request_round();
}

void Agent::leave() {
  dead_ = true;
  boost::system::error_code ec;
  socket_.close(ec);
}

void Agent::fail(const std::string& why) {
  if (dead_) return;
  dead_ = true;
  step_ = Step::kIdle;
  sim_->failed("agent " + std::to_string(index_) + ": " + why);
}

// --- the parent: the store, the measurements ----------------------------------------------------

long rss_kb() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  }
  return 0;
}

long tcp_mem_pages() {  // /proc/net/sockstat: "TCP: inuse A orphan B tw C alloc D mem E"
  std::ifstream in("/proc/net/sockstat");
  std::string line;
  while (std::getline(in, line)) {
    auto pos = line.find(" mem ");
    if (line.rfind("TCP:", 0) == 0 && pos != std::string::npos) {
      return std::stol(line.substr(pos + 5));
    }
  }
  return 0;
}

// Raises the soft descriptor limit as far as the hard one allows (and the hard one too where the
// process may: root with CAP_SYS_RESOURCE). Returns the soft limit now in force.
rlim_t raise_fd_limit(rlim_t wanted) {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return 1024;
  if (rl.rlim_cur >= wanted) return rl.rlim_cur;
  rlimit want{wanted, std::max(rl.rlim_max, wanted)};
  if (setrlimit(RLIMIT_NOFILE, &want) == 0) return wanted;
  rl.rlim_cur = rl.rlim_max;
  setrlimit(RLIMIT_NOFILE, &rl);
  getrlimit(RLIMIT_NOFILE, &rl);
  return rl.rlim_cur;
}

struct Measurement {
  int nodes = 0;
  int relays = 0;  // 0: every agent connected to the store itself
  bool ok = false;
  double seconds = 0;
  double requests_per_agent = 0;        // what the agents sent (to the store, or their relay)
  double store_requests_per_agent = 0;  // what reached the store
  double store_rss_per_agent_kb = 0;
  double relay_rss_per_client_kb = 0;
  double kernel_per_agent_kb = 0;  // the kernel's TCP memory, both ends of every connection
  double leave_seconds = -1;
  double leave_requests_per_agent = 0;
  std::string error;
};

// A forked helper process answering one-byte commands on a pipe: 'm' (measure: three int64:
// RSS growth in kB since it started, requests served, requests sent upstream) and 's' (stop).
struct Helper {
  pid_t pid = -1;
  int to = -1, from = -1;
  uint16_t port = 0;
  std::array<int64_t, 3> ask() {
    std::array<int64_t, 3> v{};
    char c = 'm';
    if (!write_all(to, &c, 1) || !read_all(from, v.data(), sizeof(v))) v.fill(-1);
    return v;
  }
  void stop() {
    char c = 's';
    write_all(to, &c, 1);
    char done;
    read_all(from, &done, 1);
    ::close(to);
    ::close(from);
    int status = 0;
    ::waitpid(pid, &status, 0);
  }
};

// Forks a helper that runs `serve` (returns the port and a counter function) and then answers
// commands until 's'.
template <typename Start>
Helper fork_helper(Start start) {
  int down[2], up[2];
  if (::pipe(down) != 0 || ::pipe(up) != 0) throw std::runtime_error("pipe failed");
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    ::close(down[1]);
    ::close(up[0]);
    spdlog::set_level(spdlog::level::off);  // a failure shows in the agents' reports
    const long rss0 = rss_kb();
    uint16_t port = 0;
    std::function<std::pair<uint64_t, uint64_t>()> counts;
    std::function<void()> stop;
    try {
      start(&port, &counts, &stop);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rdzv_scale: %s\n", e.what());
    }
    write_all(up[1], &port, sizeof(port));
    char c;
    while (read_all(down[0], &c, 1)) {
      if (c == 's') break;
      auto [served, sent] = counts ? counts() : std::make_pair(uint64_t(0), uint64_t(0));
      std::array<int64_t, 3> v{rss_kb() - rss0, int64_t(served), int64_t(sent)};
      write_all(up[1], v.data(), sizeof(v));
    }
    if (stop) stop();
    write_all(up[1], &c, 1);
    ::_exit(0);
  }
  ::close(down[0]);
  ::close(up[1]);
  Helper h{pid, down[1], up[0], 0};
  read_all(h.from, &h.port, sizeof(h.port));
  return h;
}

int g_run = 0;

// `per_process`: agents per agent process, and clients per relay (each holds a descriptor per
// connection); more than that many nodes go through relays.
Measurement measure(int n, bool leave, int max_connecting, int per_process) {
  Measurement m;
  m.nodes = n;
  ++g_run;
  const std::string run_id =
      "scale-" + std::to_string(n) + "-" + std::to_string(::getpid()) + "-" + std::to_string(g_run);
  const long tcp_before = tcp_mem_pages();
  Helper store = fork_helper([](uint16_t* port, auto* counts, auto* stop) {
    StoreServerOptions so;
    so.host = "127.0.0.1";
    auto server = std::shared_ptr<StoreServer>(StoreServer::start(so));
    *port = server->port();
    *counts = [server] { return std::make_pair(server->num_requests(), uint64_t(0)); };
    *stop = [server] { server->stop(); };
  });
  if (store.port == 0) {
    m.error = "the store did not start";
    store.stop();
    return m;
  }
  const int processes = (n + per_process - 1) / per_process;
  std::vector<Helper> relays;
  if (processes > 1) {
    for (int i = 0; i < processes; ++i) {
      relays.push_back(fork_helper([&store](uint16_t* port, auto* counts, auto* stop) {
        StoreRelayOptions ro;
        ro.upstream_port = store.port;
        auto relay = std::shared_ptr<StoreRelay>(StoreRelay::start(ro));
        *port = relay->port();
        *counts = [relay] {
          return std::make_pair(relay->num_requests(), relay->upstream_requests());
        };
        *stop = [relay] { relay->stop(); };
      }));
    }
  }
  m.relays = static_cast<int>(relays.size());
  auto base_store = store.ask();
  std::vector<std::array<int64_t, 3>> base_relays;
  for (auto& r : relays) base_relays.push_back(r.ask());

  struct Child {
    pid_t pid;
    int to, from, count;
  };
  std::vector<Child> children;
  for (int p = 0; p < processes; ++p) {
    SimConfig c;
    c.nodes = n;
    c.first = p * per_process;
    c.count = std::min(per_process, n - c.first);
    c.min_nodes = leave ? 1 : n;
    c.port = relays.empty() ? store.port : relays[p].port;
    c.store_port = store.port;
    c.run_id = run_id;
    c.addr_block = 1 + (g_run % 250);  // a fresh block per run: the last run's TIME_WAITs stay
    c.max_connecting = max_connecting;
    c.leave = leave;
    int down[2], up[2];
    if (::pipe(down) != 0 || ::pipe(up) != 0) throw std::runtime_error("pipe failed");
    std::fflush(nullptr);
    pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      ::close(down[1]);
      ::close(up[0]);
      char go;
      if (!read_all(down[0], &go, 1)) ::_exit(3);
      Sim sim(c);
      sim.run(up[1], down[0]);
      char finish;
      read_all(down[0], &finish, 1);  // stay connected until the parent has measured
      ::_exit(0);
    }
    ::close(down[0]);
    ::close(up[1]);
    children.push_back({pid, down[1], up[0], c.count});
  }
  // Reads one phase's reports; the ranks of all processes together must be 0..expected-1.
  auto read_phase = [&](int expected, int64_t* start, int64_t* end, std::string* error) {
    std::vector<int32_t> all;
    bool ok = true;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(300);
    for (auto& ch : children) {
      PhaseReport r;
      int32_t count = 0;
      // Bounded: a phase that never ends is a failure, not a hang.
      pollfd pfd{ch.from, POLLIN, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (::poll(&pfd, 1, static_cast<int>(std::max<int64_t>(0, left.count()))) <= 0) {
        *error = "the round did not complete within 300 s";
        return false;
      }
      if (!read_all(ch.from, &r, sizeof(r)) || !read_all(ch.from, &count, sizeof(count))) {
        *error = "an agent process ended early";
        return false;
      }
      std::vector<int32_t> ranks(count);
      read_all(ch.from, ranks.data(), ranks.size() * sizeof(int32_t));
      all.insert(all.end(), ranks.begin(), ranks.end());
      if (r.start_ns != 0) *start = *start == 0 ? r.start_ns : std::min(*start, r.start_ns);
      *end = std::max(*end, r.end_ns);
      if (!r.ranks_ok) {
        ok = false;
        if (error->empty()) *error = r.error[0] ? r.error : "an agent process lost agents";
      }
    }
    std::sort(all.begin(), all.end());
    ok = ok && static_cast<int>(all.size()) == expected;
    for (int i = 0; ok && i < expected; ++i) ok = all[i] == i;
    if (!ok && error->empty()) *error = "the ranks are not 0..N-1";
    return ok;
  };
  int64_t t0 = mono_ns(), end = 0;
  for (auto& ch : children) write_all(ch.to, "g", 1);
  m.ok = read_phase(n, &t0, &end, &m.error);
  m.seconds = double(end - t0) / 1e9;
  auto after_store = store.ask();
  int64_t sent = 0, relay_rss = 0;
  for (size_t i = 0; i < relays.size(); ++i) {
    auto v = relays[i].ask();
    sent += v[1] - base_relays[i][1];
    relay_rss += v[0] - base_relays[i][0];
  }
  const int64_t at_store = after_store[1] - base_store[1];
  m.store_requests_per_agent = double(at_store) / n;
  m.requests_per_agent = relays.empty() ? m.store_requests_per_agent : double(sent) / n;
  m.store_rss_per_agent_kb = double(after_store[0] - base_store[0]) / n;
  m.relay_rss_per_client_kb = relays.empty() ? 0 : double(relay_rss) / n;
  m.kernel_per_agent_kb = double(tcp_mem_pages() - tcp_before) * 4.0 / n;
  if (leave && m.ok) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));  // every over-wait parks
    write_all(children.back().to, "g", 1);
    int64_t start = 0, end2 = 0;
    m.ok = read_phase(n - 1, &start, &end2, &m.error);
    m.leave_seconds = double(end2 - start) / 1e9;
    int64_t sent2 = 0;
    for (size_t i = 0; i < relays.size(); ++i) sent2 += relays[i].ask()[1] - base_relays[i][1];
    m.leave_requests_per_agent = relays.empty() ? double(store.ask()[1] - after_store[1]) / (n - 1)
                                                : double(sent2 - sent) / (n - 1);
  }
  // The store stops first (it fires no leases then), then the relays and the agents.
  store.stop();
  for (auto& r : relays) r.stop();
  for (auto& ch : children) {
    ::kill(ch.pid, SIGKILL);
    ::close(ch.to);
    ::close(ch.from);
    int status = 0;
    ::waitpid(ch.pid, &status, 0);
  }
  return m;
}

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoi(item));
  return out;
}

struct Peer {
  double seconds = 0;
  double requests = 0;
  bool ok = false;
};

std::map<int, Peer> read_peer(const std::string& path) {
  std::map<int, Peer> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    int nodes = 0, ok = 0;
    Peer p;
    if (std::sscanf(line.c_str(), "peer nodes=%d seconds=%lf requests_per_agent=%lf ranks_ok=%d",
                    &nodes, &p.seconds, &p.requests, &ok) == 4 &&
        ok == 1) {
      p.ok = true;
      out[nodes] = p;
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> nodes = {64, 128, 256, 1024, 2048, 4096, 16384, 32768, 65536, 100000};
  int leave_nodes = 10000;
  int connects = 1000;
  int per_process = 0;
  std::string peer_file;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--nodes" && i + 1 < argc) {
      nodes = parse_list(argv[++i]);
    } else if (a == "--leave" && i + 1 < argc) {
      leave_nodes = std::stoi(argv[++i]);
    } else if (a == "--connects" && i + 1 < argc) {
      connects = std::stoi(argv[++i]);
    } else if (a == "--per-process" && i + 1 < argc) {
      per_process = std::stoi(argv[++i]);
    } else if (a == "--peer-file" && i + 1 < argc) {
      peer_file = argv[++i];
    } else {
      std::fprintf(stderr,
                   "usage: rdzv_scale [--nodes 64,256,...] [--leave N (0: none)] [--connects K] "
                   "[--per-process P] [--peer-file F]\n");
      return 2;
    }
  }
  ::signal(SIGPIPE, SIG_IGN);
  spdlog::set_level(spdlog::level::err);
  auto peer = peer_file.empty() ? std::map<int, Peer>() : read_peer(peer_file);

  // One descriptor per connection: what one process may hold decides how many agents one store
  // (or relay, or agent process) takes.
  int largest_n = leave_nodes;
  for (int n : nodes) largest_n = std::max(largest_n, n);
  const rlim_t limit = raise_fd_limit(rlim_t(largest_n) + 4096);
  const int fits = static_cast<int>(std::min<rlim_t>(limit, 1 << 30)) - 2048;
  if (per_process <= 0) per_process = std::max(1000, fits);
  if (per_process > fits) {
    std::fprintf(stderr,
                 "rdzv_scale: --per-process %d needs more descriptors than the %lu allowed\n",
                 per_process, static_cast<unsigned long>(limit));
    return 2;
  }
  std::printf(
      "descriptors: %lu per process%s; up to %d agents connect to the store itself, more "
      "through relays of up to %d clients each (store/relay.h)\n\n",
      static_cast<unsigned long>(limit),
      limit < rlim_t(largest_n) + 4096
          ? " (the hard limit; raising it needs CAP_SYS_RESOURCE, which this process lacks)"
          : "",
      per_process, per_process);

  std::printf("%-7s %-8s | %-9s %-8s %-9s | %-9s %-9s %-9s | %-9s %-8s | %s\n", "nodes", "path",
              "time", "req/node", "at store", "store RSS", "relay RSS", "TCP kB", "torch",
              "req/node", "ratio");
  std::printf("%-7s %-8s | %-9s %-8s %-9s | %-9s %-9s %-9s | %-9s %-8s |\n", "", "", "", "sent",
              "req/node", "kB/agent", "kB/client", "buffers", "time", "");
  std::map<int, Measurement> results;
  bool all_ok = true;
  for (int n : nodes) {
    Measurement m = measure(n, false, connects, per_process);
    results[n] = m;
    char path[16];
    std::snprintf(path, sizeof(path), "%s",
                  m.relays ? (std::to_string(m.relays) + " relays").c_str() : "direct");
    if (!m.ok) {
      all_ok = false;
      std::printf("%-7d %-8s | FAILED: %s\n", n, path, m.error.c_str());
      std::fflush(stdout);
      continue;
    }
    auto p = peer.find(n);
    char peer_cols[64] = "-         -       ";
    char ratio[32] = "-";
    if (p != peer.end()) {
      std::snprintf(peer_cols, sizeof(peer_cols), "%-7.3f s %-8.1f", p->second.seconds,
                    p->second.requests);
      std::snprintf(ratio, sizeof(ratio), "%.0fx", p->second.seconds / m.seconds);
    }
    char relay_rss[16] = "-";
    if (m.relays) std::snprintf(relay_rss, sizeof(relay_rss), "%.2f", m.relay_rss_per_client_kb);
    std::printf("%-7d %-8s | %-7.3f s %-8.2f %-9.2f | %-9.2f %-9s %-9.2f | %s | %s\n", n, path,
                m.seconds, m.requests_per_agent, m.store_requests_per_agent,
                m.store_rss_per_agent_kb, relay_rss, m.kernel_per_agent_kb, peer_cols, ratio);
    std::fflush(stdout);
  }
  Measurement leave;
  if (leave_nodes > 1) {
    leave = measure(leave_nodes, true, connects, per_process);
    if (leave.ok) {
      std::printf(
          "\nleave: %d nodes (--nnodes=1:%d, %s) formed in %.3f s; one left (its connection "
          "closed); every survivor had its rank in the next round %.3f s later (%.2f requests "
          "per survivor)\n",
          leave_nodes, leave_nodes,
          leave.relays ? (std::to_string(leave.relays) + " relays").c_str() : "direct",
          leave.seconds, leave.leave_seconds, leave.leave_requests_per_agent);
    } else {
      all_ok = false;
      std::printf("\nleave: %d nodes: FAILED: %s\n", leave_nodes, leave.error.c_str());
    }
  }

  // Headline figures; ratio: bigger is better (the peer's time over ours where the peer ran at
  // that N; else the target over ours).
  std::printf("\n");
  int largest_peer = 0;
  for (auto& [n, p] : peer) {
    if (results.count(n) && results[n].ok) largest_peer = n;
  }
  if (largest_peer) {
    auto& m = results[largest_peer];
    auto& p = peer[largest_peer];
    std::printf("RESULT name=rdzv_time_%d_nodes value=%.4f unit=s peer=%.4f ratio=%.1f\n",
                largest_peer, m.seconds, p.seconds, p.seconds / m.seconds);
    std::printf(
        "RESULT name=rdzv_requests_per_node_%d value=%.2f unit=requests peer=%.2f ratio=%.2f\n",
        largest_peer, m.requests_per_agent, p.requests, p.requests / m.requests_per_agent);
  }
  auto target = [&](int n, double limit) {
    auto it = results.find(n);
    if (it == results.end() || !it->second.ok) return;
    std::printf("RESULT name=rdzv_time_%d_nodes value=%.4f unit=s peer=none ratio=%.2f\n", n,
                it->second.seconds, limit / it->second.seconds);
  };
  target(2048, 1.0);
  target(100000, 30.0);
  int largest = 0, largest_direct = 0;
  for (auto& [n, m] : results) {
    if (!m.ok) continue;
    largest = n;
    if (m.relays == 0) largest_direct = n;
  }
  if (largest) {
    auto& m = results[largest];
    std::printf(
        "RESULT name=rdzv_requests_per_node_%d value=%.3f unit=requests peer=none ratio=%.2f\n",
        largest, m.requests_per_agent, 5.0 / m.requests_per_agent);
  }
  if (largest_direct) {
    std::printf("RESULT name=rdzv_store_rss_per_agent_%d value=%.2f unit=kB peer=none ratio=none\n",
                largest_direct, results[largest_direct].store_rss_per_agent_kb);
  }
  if (largest && results[largest].relays) {
    std::printf(
        "RESULT name=rdzv_relay_rss_per_client_%d value=%.2f unit=kB peer=none ratio=none\n",
        largest, results[largest].relay_rss_per_client_kb);
  }
  if (leave.ok) {
    std::printf("RESULT name=rdzv_leave_%d_nodes value=%.4f unit=s peer=none ratio=none\n",
                leave_nodes, leave.leave_seconds);
  }
  return all_ok ? 0 : 1;
}
