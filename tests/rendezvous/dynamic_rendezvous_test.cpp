// The c10d rendezvous executor against a real StoreServer on loopback: N handlers in threads, and
// helper processes (rdzv_test_node) for deaths by SIGKILL (connection closed) and SIGSTOP (missed
// keep-alives). Timeouts here are generous bounds so nothing hangs, never speed targets.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <future>
#include <set>
#include <thread>

#include "rendezvous/dynamic_rendezvous.h"
#include "rendezvous/handler.h"
#include "rendezvous/round_rendezvous.h"
#include "rendezvous/store/server.h"
#include "rendezvous/store/tcp_store.h"

using namespace trun::rendezvous;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using Kind = RoundEvent::Kind;
using HandlerPtr = std::unique_ptr<RendezvousHandler>;

namespace {

std::string unique_run_id() {
  static int n = 0;
  return "test-" + std::to_string(::getpid()) + "-" + std::to_string(++n);
}

struct Cluster {
  std::unique_ptr<StoreServer> server;
  std::string run_id = unique_run_id();
  int min_nodes;
  int max_nodes;

  Cluster(int min, int max) : min_nodes(min), max_nodes(max) {
    StoreServerOptions so;
    so.host = "127.0.0.1";
    server = StoreServer::start(so);
  }

  RendezvousOptions options(const std::string& id) const {
    RendezvousOptions o;
    o.run_id = run_id;
    o.endpoint = "127.0.0.1:" + std::to_string(server->port());
    o.min_nodes = min_nodes;
    o.max_nodes = max_nodes;
    o.node_id = id;
    o.local_addr = "127.0.0.1";
    o.is_host = false;
    o.last_call_timeout = 300ms;
    o.keep_alive_interval = 100ms;
    o.keep_alive_max_attempt = 3;
    o.join_timeout = 60s;
    o.read_timeout = 10s;
    return o;
  }
  HandlerPtr make(const std::string& id) const {
    return create_rendezvous_handler("c10d", options(id));
  }
};

// Runs next_rendezvous on every handler at once.
std::vector<RendezvousInfo> join_all(const std::vector<RendezvousHandler*>& handlers) {
  std::vector<std::future<RendezvousInfo>> futures;
  for (auto* h : handlers) {
    futures.push_back(std::async(std::launch::async, [h] { return h->next_rendezvous(); }));
  }
  std::vector<RendezvousInfo> out;
  for (auto& f : futures) out.push_back(f.get());
  return out;
}

// Every node agrees on the round, the world and the participants; ranks are unique, in the world
// (all of 0..world-1 when every node is in `infos`).
void check_consistent(const std::vector<RendezvousInfo>& infos, int world) {
  std::set<int> ranks;
  for (auto& i : infos) {
    CHECK(i.round == infos[0].round);
    CHECK(i.group_world_size == world);
    REQUIRE(i.participants.size() == static_cast<size_t>(world));
    CHECK(i.participants[0].node_id == infos[0].participants[0].node_id);
    CHECK(i.master_addr == "127.0.0.1");
    CHECK(i.master_port == infos[0].master_port);
    CHECK(i.master_port != 0);
    CHECK(i.store != nullptr);
    ranks.insert(i.group_rank);
  }
  CHECK(ranks.size() == infos.size());  // unique
  CHECK(*ranks.begin() >= 0);
  CHECK(*ranks.rbegin() < world);
  // Ranks index the participants list.
  for (auto& i : infos)
    CHECK(i.participants[i.group_rank].node_id == infos[0].participants[i.group_rank].node_id);
}

std::string rank_holder(const RendezvousInfo& info, int rank) {
  return info.participants.at(rank).node_id;
}

// A helper process (rdzv_test_node), ended by its pid.
class NodeProcess {
 public:
  NodeProcess(const Cluster& c, const std::string& id) {
    int out[2], in[2];
    REQUIRE(::pipe2(out, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(in, O_CLOEXEC) == 0);
    std::string exe = std::string(TRUN_BINARY_DIR) + "/tests/rendezvous/rdzv_test_node";
    std::string port = std::to_string(c.server->port());
    std::string min = std::to_string(c.min_nodes), max = std::to_string(c.max_nodes);
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      ::dup2(out[1], 1);
      ::dup2(in[0], 0);
      ::execl(exe.c_str(), exe.c_str(), port.c_str(), c.run_id.c_str(), min.c_str(), max.c_str(),
              id.c_str(), "100", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(out[1]);
    ::close(in[0]);
    out_ = out[0];
    in_ = in[1];
  }
  ~NodeProcess() {
    if (in_ >= 0) ::close(in_);
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    ::close(out_);
  }
  // The next line it prints, or "" after `timeout`.
  std::string line(std::chrono::milliseconds timeout) {
    auto deadline = Clock::now() + timeout;
    for (;;) {
      auto nl = buf_.find('\n');
      if (nl != std::string::npos) {
        std::string l = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return l;
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return "";
      pollfd p{out_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char b[512];
      ssize_t n = ::read(out_, b, sizeof(b));
      if (n <= 0) return "";
      buf_.append(b, n);
    }
  }
  void signal(int sig) { ::kill(pid_, sig); }
  void kill_and_reap() {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
  int in_ = -1;
  std::string buf_;
};

}  // namespace

TEST_CASE("c10d: completes at max_nodes at once, without waiting for last call", "[c10d]") {
  Cluster c(2, 3);
  auto o = c.options("a");
  std::vector<HandlerPtr> hs;
  for (auto id : {"a", "b", "c"}) {
    auto opt = c.options(id);
    opt.last_call_timeout = 600s;  // completing at all proves it did not wait for last call
    hs.push_back(create_rendezvous_handler("c10d", opt));
  }
  auto infos = join_all({hs[0].get(), hs[1].get(), hs[2].get()});
  check_consistent(infos, 3);
  CHECK(infos[0].round == 0);
  CHECK_FALSE(infos[0].use_agent_store);
  CHECK(hs[0]->num_nodes_waiting() == 0);
}

TEST_CASE("c10d: completes at min_nodes once last call has passed", "[c10d]") {
  Cluster c(2, 4);
  auto a = create_rendezvous_handler("c10d", [&] {
    auto o = c.options("a");
    o.last_call_timeout = 700ms;
    return o;
  }());
  auto b = create_rendezvous_handler("c10d", [&] {
    auto o = c.options("b");
    o.last_call_timeout = 700ms;
    return o;
  }());
  auto start = Clock::now();
  auto infos = join_all({a.get(), b.get()});
  CHECK(Clock::now() - start >= 600ms);  // it did wait for the last call (a correctness bound)
  check_consistent(infos, 2);
}

TEST_CASE("c10d: a lone node below min_nodes times out with a clear error", "[c10d]") {
  Cluster c(2, 2);
  auto o = c.options("alone");
  o.join_timeout = 500ms;
  auto h = create_rendezvous_handler("c10d", o);
  CHECK_THROWS_AS(h->next_rendezvous(), RendezvousTimeoutError);
  h = create_rendezvous_handler("c10d", o);
  CHECK_THROWS_WITH(h->next_rendezvous(),
                    Catch::Contains("join_timeout") && Catch::Contains("at least 2 node"));
}

TEST_CASE("c10d: a late node makes the running group restart to admit it", "[c10d]") {
  Cluster c(2, 3);
  auto a = c.make("a"), b = c.make("b");
  auto first = join_all({a.get(), b.get()});
  check_consistent(first, 2);
  // The running group waits for the end of its round (push, no polling).
  auto ea = std::async(std::launch::async, [&] { return a->wait_round_over(30s); });
  auto eb = std::async(std::launch::async, [&] { return b->wait_round_over(30s); });
  auto late = c.make("late");
  auto late_info = std::async(std::launch::async, [&] { return late->next_rendezvous(); });
  auto event_a = ea.get(), event_b = eb.get();
  REQUIRE(event_a);
  REQUIRE(event_b);
  CHECK(event_a->kind == Kind::kNodeJoined);
  CHECK(event_a->node_id == "late");
  CHECK(event_b->kind == Kind::kNodeJoined);
  CHECK(a->num_nodes_waiting() == 1);
  auto second = join_all({a.get(), b.get()});
  second.push_back(late_info.get());
  check_consistent(second, 3);
  CHECK(second[0].round == first[0].round + 1);
  // Survivors keep their relative order; the newcomer comes after them.
  auto r0 = rank_holder(first[0], 0), r1 = rank_holder(first[0], 1);
  CHECK(rank_holder(second[0], 0) == r0);
  CHECK(rank_holder(second[0], 1) == r1);
  CHECK(rank_holder(second[0], 2) == "late");
}

TEST_CASE("c10d: a node beyond max_nodes waits quietly for the next round", "[c10d]") {
  Cluster c(1, 2);
  auto a = c.make("a"), b = c.make("b");
  auto first = join_all({a.get(), b.get()});
  check_consistent(first, 2);
  auto extra = c.make("extra");
  auto extra_info = std::async(std::launch::async, [&] { return extra->next_rendezvous(); });
  // The full group is not disturbed...
  CHECK_FALSE(a->wait_round_over(1s).has_value());
  CHECK(a->num_nodes_waiting() == 1);
  // ...until it ends its round for another reason; then the waiting node is admitted if a slot
  // is free (b leaves).
  b->shutdown();
  auto ev = a->wait_round_over(30s);
  REQUIRE(ev);
  CHECK(ev->kind == Kind::kNodeLeft);
  CHECK(ev->node_id == "b");
  auto second = join_all({a.get()});
  second.push_back(extra_info.get());
  check_consistent(second, 2);
  CHECK(rank_holder(second[0], 0) == "a");
  CHECK(rank_holder(second[0], 1) == "extra");
}

TEST_CASE("c10d: a worker failure anywhere ends the round on every node", "[c10d]") {
  Cluster c(3, 3);
  auto a = c.make("a"), b = c.make("b"), d = c.make("d");
  auto infos = join_all({a.get(), b.get(), d.get()});
  std::promise<RoundEvent> got_b;
  b->set_round_over_callback([&](const RoundEvent& e) { got_b.set_value(e); });
  auto fut_b = got_b.get_future();
  a->report_worker_failure("local_rank 1 exited with 3");
  REQUIRE(fut_b.wait_for(30s) == std::future_status::ready);
  auto e = fut_b.get();
  CHECK(e.kind == Kind::kWorkerFailed);
  CHECK(e.node_id == "a");
  CHECK(e.detail == "local_rank 1 exited with 3");
  CHECK(e.round == infos[0].round);
  auto ed = d->wait_round_over(30s);
  REQUIRE(ed);
  CHECK(ed->kind == Kind::kWorkerFailed);
  // Everyone re-forms at once: the expected nodes are all there, no last call needed.
  auto again = join_all({a.get(), b.get(), d.get()});
  check_consistent(again, 3);
  CHECK(again[0].round == infos[0].round + 1);
  for (int r = 0; r < 3; ++r) CHECK(rank_holder(again[0], r) == rank_holder(infos[0], r));
  b->set_round_over_callback(nullptr);
}

TEST_CASE("c10d: calling next_rendezvous mid-round restarts the others", "[c10d]") {
  Cluster c(2, 2);
  auto a = c.make("a"), b = c.make("b");
  join_all({a.get(), b.get()});
  auto fut = std::async(std::launch::async, [&] { return a->next_rendezvous(); });
  auto e = b->wait_round_over(30s);
  REQUIRE(e);
  CHECK(e->kind == Kind::kRestart);
  CHECK(e->node_id == "a");
  auto ib = b->next_rendezvous();
  CHECK(fut.get().round == ib.round);
}

TEST_CASE("c10d: a SIGKILLed node is detected by its closed connection and survivors continue",
          "[c10d][process]") {
  Cluster c(2, 3);
  c.min_nodes = 2;
  NodeProcess child(c, "victim");
  auto a = c.make("a"), b = c.make("b");
  auto infos = join_all({a.get(), b.get()});
  auto line = child.line(30s);
  CHECK(line.rfind("ranked 0 ", 0) == 0);
  check_consistent(infos, 3);
  child.kill_and_reap();
  auto e = a->wait_round_over(30s);
  REQUIRE(e);
  CHECK(e->kind == Kind::kNodeLeft);
  CHECK(e->node_id == "victim");
  // The survivors are the expected set: they re-form at once even with a long last call.
  auto again = join_all({a.get(), b.get()});
  check_consistent(again, 2);
}

TEST_CASE("c10d: a silent node (SIGSTOP) is declared dead by missed keep-alives and rejoins",
          "[c10d][process]") {
  Cluster c(2, 3);
  NodeProcess child(c, "sleepy");
  auto a = c.make("a"), b = c.make("b");
  auto infos = join_all({a.get(), b.get()});
  CHECK(child.line(30s).rfind("ranked 0 ", 0) == 0);
  check_consistent(infos, 3);
  child.signal(SIGSTOP);  // its socket stays open; only its keep-alives stop
  auto e = a->wait_round_over(30s);
  REQUIRE(e);
  CHECK(e->kind == Kind::kNodeLeft);
  CHECK(e->node_id == "sleepy");
  auto again = join_all({a.get(), b.get()});
  check_consistent(again, 2);
  // When it wakes up it learns that it was declared dead, and its rejoin restarts the group.
  auto ea = std::async(std::launch::async, [&] { return a->wait_round_over(30s); });
  auto eb = std::async(std::launch::async, [&] { return b->wait_round_over(30s); });
  child.signal(SIGCONT);
  auto ev_line = child.line(30s);
  INFO("helper printed: " << ev_line);
  CHECK(ev_line.rfind("event " + std::to_string(static_cast<int>(Kind::kMembershipLost)), 0) == 0);
  auto ja = ea.get();
  REQUIRE(ja);
  CHECK(ja->kind == Kind::kNodeJoined);
  CHECK(ja->node_id == "sleepy");
  eb.get();
  auto third = join_all({a.get(), b.get()});
  check_consistent(third, 3);
  CHECK(child.line(30s).rfind("ranked " + std::to_string(third[0].round) + " ", 0) == 0);
}

TEST_CASE("c10d: a closed rendezvous tells members and late nodes that the job finished",
          "[c10d]") {
  Cluster c(2, 3);
  auto a = c.make("a"), b = c.make("b");
  join_all({a.get(), b.get()});
  CHECK_FALSE(a->is_closed());
  a->set_closed();
  CHECK(b->is_closed());
  auto e = b->wait_round_over(30s);
  REQUIRE(e);
  CHECK(e->kind == Kind::kClosed);
  CHECK_THROWS_AS(b->next_rendezvous(), RendezvousClosedError);
  auto late = c.make("late");
  CHECK_THROWS_WITH(late->next_rendezvous(), Catch::Contains("job has finished"));
}

TEST_CASE("c10d: closing wakes nodes waiting for the next round", "[c10d]") {
  Cluster c(1, 1);
  auto a = c.make("a");
  a->next_rendezvous();
  auto waiting = c.make("waiting");
  auto fut = std::async(std::launch::async, [&] { return waiting->next_rendezvous(); });
  CHECK(fut.wait_for(500ms) == std::future_status::timeout);  // no room: it waits
  a->set_closed();
  REQUIRE(fut.wait_for(30s) == std::future_status::ready);
  CHECK_THROWS_AS(fut.get(), RendezvousClosedError);
}

TEST_CASE("c10d: the node hosting the store gets group rank 0, even when it joins last", "[c10d]") {
  Cluster c(3, 3);
  uint16_t port = pick_free_port();
  REQUIRE(port != 0);
  auto ho = c.options("host");
  ho.endpoint = "127.0.0.1:" + std::to_string(port);
  ho.is_host = true;
  auto host = create_rendezvous_handler("c10d", ho);  // hosts its own store on `port`
  auto x = [&](const char* id) {
    auto o = c.options(id);
    o.endpoint = ho.endpoint;
    o.is_host = std::nullopt;  // the endpoint is local, but the port is taken: client
    return create_rendezvous_handler("c10d", o);
  };
  auto a = x("a"), b = x("b");
  auto fa = std::async(std::launch::async, [&] { return a->next_rendezvous(); });
  auto fb = std::async(std::launch::async, [&] { return b->next_rendezvous(); });
  std::this_thread::sleep_for(200ms);  // let a and b take the first tickets
  auto ih = host->next_rendezvous();
  std::vector<RendezvousInfo> infos = {ih, fa.get(), fb.get()};
  check_consistent(infos, 3);
  CHECK(ih.group_rank == 0);
  CHECK(rank_holder(ih, 0) == "host");
  a->set_closed();
  a.reset();
  b.reset();
  host.reset();
}

TEST_CASE("c10d: node_rank hints are honoured", "[c10d]") {
  Cluster c(3, 3);
  std::vector<HandlerPtr> hs;
  const char* ids[] = {"x", "y", "z"};
  const int hints[] = {2, 0, 1};
  for (int i = 0; i < 3; ++i) {
    auto o = c.options(ids[i]);
    o.node_rank = hints[i];
    hs.push_back(create_rendezvous_handler("c10d", o));
  }
  auto infos = join_all({hs[0].get(), hs[1].get(), hs[2].get()});
  check_consistent(infos, 3);
  for (int i = 0; i < 3; ++i) CHECK(infos[i].group_rank == hints[i]);
}

TEST_CASE("c10d: store traffic per node and round is constant (O(N) in total)", "[c10d]") {
  auto measure = [](int n) {
    Cluster c(n, n);
    std::vector<HandlerPtr> hs;
    std::vector<RendezvousHandler*> raw;
    for (int i = 0; i < n; ++i) {
      auto o = c.options("n" + std::to_string(i));
      o.keep_alive_interval = 60s;  // keep-alives are per interval, not per round: leave out
      hs.push_back(create_rendezvous_handler("c10d", o));
      raw.push_back(hs.back().get());
    }
    auto before = c.server->num_requests();
    auto infos = join_all(raw);
    check_consistent(infos, n);
    auto total = c.server->num_requests() - before;
    std::vector<uint64_t> sent;
    for (auto& h : hs) sent.push_back(static_cast<RoundRendezvous*>(h.get())->requests_sent());
    std::sort(sent.begin(), sent.end());
    return std::make_tuple(total, sent[sent.size() - 2], sent.back());  // all but the leader; it
  };
  auto [t4, most4, leader4] = measure(4);
  auto [t32, most32, leader32] = measure(32);
  INFO("requests: 4 nodes " << t4 << " (leader " << leader4 << "), 32 nodes " << t32 << " (leader "
                            << leader32 << ")");
  // A node: the round key, a ticket, the lease with its descriptor, the result wait. The leader
  // adds a few reads (one multi-get for every descriptor). Nothing grows with the node count.
  CHECK(most4 == 4);
  CHECK(most32 == 4);
  CHECK(leader32 <= 16);
  CHECK(t32 <= 4 * 32 + 16);
  CHECK(t4 <= 4 * 4 + 16);
}

TEST_CASE("c10d: shutdown leaves the round and unblocks waits", "[c10d]") {
  Cluster c(2, 2);
  auto a = c.make("a"), b = c.make("b");
  join_all({a.get(), b.get()});
  auto fut = std::async(std::launch::async, [&] { return a->wait_round_over(60s); });
  std::this_thread::sleep_for(100ms);
  a->shutdown();
  REQUIRE(fut.wait_for(30s) == std::future_status::ready);
  auto e = fut.get();
  REQUIRE(e);
  CHECK(e->kind == Kind::kShutdown);
  auto eb = b->wait_round_over(30s);
  REQUIRE(eb);
  CHECK(eb->kind == Kind::kNodeLeft);
  CHECK(eb->detail == "agent shut down");
  CHECK_THROWS_AS(a->next_rendezvous(), RendezvousError);
}

TEST_CASE("c10d: losing the store reaches waiting members as kStoreLost", "[c10d]") {
  Cluster c(1, 1);
  auto a = c.make("a");
  a->next_rendezvous();
  auto fut = std::async(std::launch::async, [&] { return a->wait_round_over(60s); });
  std::this_thread::sleep_for(100ms);
  c.server->stop();
  REQUIRE(fut.wait_for(30s) == std::future_status::ready);
  auto e = fut.get();
  REQUIRE(e);
  CHECK(e->kind == Kind::kStoreLost);
  CHECK_THAT(e->detail, Catch::Contains("127.0.0.1:" + std::to_string(c.server->port())));
}
