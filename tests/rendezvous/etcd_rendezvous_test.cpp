// What is particular to the etcd backend ("etcd", alias "etcd-v2"), against a real etcd
// (tests/rendezvous/etcd_server.h): the endpoint forms it accepts and refuses, keys under
// --rdzv-conf etcd_prefix (so that runs share one etcd), and the etcd lease ttl derived from the
// keep-alive settings. The protocol itself is tested for both backends in
// dynamic_rendezvous_test.cpp. Timeouts are generous bounds, never speed targets.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <future>
#include <set>

#include "rendezvous/handler.h"
#include "rendezvous/round_rendezvous.h"
#include "tests/rendezvous/etcd_server.h"
#include "tests/rendezvous/test_options.h"

using namespace trun::rendezvous;
using namespace trun::store;
using namespace std::chrono_literals;
using trun::testing::EtcdServer;
using trun::testing::fast_rdzv_options;
using HandlerPtr = std::unique_ptr<RendezvousHandler>;

namespace {

std::string etcd_run_id() { return trun::testing::unique_run_id("etcd"); }

// Runs next_rendezvous on every handler at once.
std::vector<RendezvousInfo> join_handlers(const std::vector<HandlerPtr>& handlers) {
  std::vector<std::future<RendezvousInfo>> futures;
  for (auto& h : handlers) {
    futures.push_back(std::async(std::launch::async, [&h] { return h->next_rendezvous(); }));
  }
  std::vector<RendezvousInfo> out;
  for (auto& f : futures) out.push_back(f.get());
  return out;
}

// True when something accepts connections on 127.0.0.1:port.
bool listening(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

// The keys in etcd that belong to run `run_id` (they contain it), all of them.
std::vector<std::string> keys_of_run(const EtcdServer& etcd, const std::string& run_id) {
  std::vector<std::string> out;
  for (auto& k : etcd.keys()) {
    if (k.find(run_id) != std::string::npos) out.push_back(k);
  }
  return out;
}

}  // namespace

TEST_CASE("etcd: the registry knows etcd and torchrun's alias etcd-v2", "[etcd]") {
  auto names = rendezvous_backend_names();
  CHECK(std::find(names.begin(), names.end(), "etcd") != names.end());
  SKIP_WITHOUT_ETCD();
  auto& etcd = EtcdServer::shared();
  const std::string run = etcd_run_id();
  for (const char* name : {"etcd", "etcd-v2"}) {
    INFO("backend " << name);
    auto h =
        create_rendezvous_handler(name, fast_rdzv_options(etcd.endpoint(), run + name, "a", 1, 1));
    CHECK(h->backend() == "etcd");
    auto info = h->next_rendezvous();
    CHECK(info.group_world_size == 1);
    CHECK(info.group_rank == 0);
    CHECK(static_cast<RoundRendezvous*>(h.get())->hosted_store() == nullptr);
    h->shutdown();
  }
}

TEST_CASE("etcd: endpoints: http:// is accepted, https:// is refused as an option error",
          "[etcd]") {
  SKIP_WITHOUT_ETCD();
  auto& etcd = EtcdServer::shared();
  const std::string run = etcd_run_id();
  auto o = fast_rdzv_options("http://" + etcd.endpoint(), run, "a", 1, 1);
  auto h = create_rendezvous_handler("etcd", o);
  CHECK(h->next_rendezvous().group_world_size == 1);
  h->shutdown();

  o.endpoint = "https://" + etcd.endpoint();
  try {
    create_rendezvous_handler("etcd", o);
    FAIL("https:// was accepted");
  } catch (const RendezvousOptionError& e) {
    INFO(e.what());
    CHECK_THAT(e.what(), Catch::Contains("https://"));
  }
}

TEST_CASE("etcd: without a port the endpoint means etcd's client port 2379", "[etcd]") {
  SKIP_WITHOUT_ETCD();
  if (listening(2379)) {
    TRUN_SKIP("something listens on 127.0.0.1:2379 here", kEnvironment);
  }
  auto o = fast_rdzv_options("127.0.0.1", etcd_run_id(), "a", 1, 1);
  o.read_timeout = 2s;
  o.join_timeout = 10s;
  try {
    auto h = create_rendezvous_handler("etcd", o);
    h->next_rendezvous();
    FAIL("a rendezvous formed without etcd");
  } catch (const RendezvousOptionError& e) {
    FAIL("an option error for a valid endpoint: " << e.what());
  } catch (const RendezvousError& e) {
    INFO(e.what());
    CHECK_THAT(e.what(), Catch::Contains("127.0.0.1:2379"));
  }
}

TEST_CASE(
    "etcd: keys live under /trun/ by default: the protocol's in rdzv/, the backend's in etcd/",
    "[etcd]") {
  SKIP_WITHOUT_ETCD();
  auto& etcd = EtcdServer::shared();
  const std::string run = etcd_run_id();
  std::vector<HandlerPtr> hs;
  for (auto id : {"a", "b"}) {
    hs.push_back(
        create_rendezvous_handler("etcd", fast_rdzv_options(etcd.endpoint(), run, id, 2, 2)));
  }
  join_handlers(hs);
  auto keys = keys_of_run(etcd, run);
  CHECK_FALSE(keys.empty());
  for (auto& k : keys) {
    INFO("key " << k);
    CHECK(
        (k.rfind("/trun/rdzv/" + run + "/", 0) == 0 || k.rfind("/trun/etcd/" + run + "/", 0) == 0));
  }
  for (auto& h : hs) h->shutdown();
}

TEST_CASE("etcd: runs with the same id under different etcd_prefix values do not meet", "[etcd]") {
  SKIP_WITHOUT_ETCD();
  auto& etcd = EtcdServer::shared();
  const std::string run = etcd_run_id();  // the same id for both jobs
  const std::string prefixes[] = {"/jobs-" + run + "/one/", "/jobs-" + run + "/two/"};
  std::vector<HandlerPtr> hs;
  for (const auto& prefix : prefixes) {
    for (auto id : {"a", "b"}) {
      // Through --rdzv-conf, as the command line passes it.
      auto o = fast_rdzv_options(etcd.endpoint(), run, id, 2, 2);
      apply_rdzv_conf(parse_rdzv_conf("etcd_prefix=" + prefix), &o);
      REQUIRE(o.etcd_prefix == prefix);
      o.join_timeout = 30s;  // had they met, two of the four would wait for a round of their own
      hs.push_back(create_rendezvous_handler("etcd", o));
    }
  }
  auto infos = join_handlers(hs);
  for (size_t i = 0; i < infos.size(); ++i) {
    INFO("handler " << i);
    CHECK(infos[i].group_world_size == 2);
    CHECK(infos[i].round == 0);
  }
  // Each job's two nodes are each other's participants.
  for (size_t job = 0; job < 2; ++job) {
    std::set<std::string> members;
    for (size_t i = 2 * job; i < 2 * job + 2; ++i) {
      for (size_t r = 0; r < infos[i].participants.size(); ++r) {
        members.insert(infos[i].participants[r].node_id);
      }
    }
    CHECK(members == std::set<std::string>{"a", "b"});
  }
  auto keys = keys_of_run(etcd, run);
  size_t under[2] = {0, 0};
  for (auto& k : keys) {
    INFO("key " << k);
    bool in_one = k.rfind(prefixes[0], 0) == 0, in_two = k.rfind(prefixes[1], 0) == 0;
    CHECK((in_one || in_two));
    under[0] += in_one;
    under[1] += in_two;
  }
  CHECK(under[0] > 0);
  CHECK(under[1] > 0);
  // Closing one job leaves the other running.
  hs[0]->set_closed();
  CHECK(hs[1]->is_closed());
  CHECK_FALSE(hs[2]->is_closed());
  CHECK_FALSE(hs[3]->wait_round_over(500ms).has_value());
  for (auto& h : hs) h->shutdown();
}

TEST_CASE("etcd: a node's lease ttl is keep_alive_interval x keep_alive_max_attempt, rounded up",
          "[etcd]") {
  SKIP_WITHOUT_ETCD();
  // An etcd of its own: the only leases in it are this test's.
  EtcdServer etcd;
  struct Case {
    std::chrono::milliseconds interval;
    int attempts;
    int64_t ttl_s;
  };
  const Case cases[] = {{100ms, 3, 1}, {700ms, 3, 3}, {2000ms, 2, 4}};
  auto lease_ids = [&] {
    std::set<std::string> ids;
    auto leases = etcd.post("/v3/lease/leases", nlohmann::json::object());
    if (leases.contains("leases")) {
      for (const auto& l : leases["leases"]) ids.insert(l["ID"].get<std::string>());
    }
    return ids;
  };
  for (const auto& c : cases) {
    INFO("keep_alive " << c.interval.count() << " ms x " << c.attempts);
    auto before = lease_ids();
    auto o = fast_rdzv_options(etcd.endpoint(), etcd_run_id(), "a", 1, 1);
    o.keep_alive_interval = c.interval;
    o.keep_alive_max_attempt = c.attempts;
    auto h = create_rendezvous_handler("etcd", o);
    h->next_rendezvous();
    int fresh = 0;
    for (const auto& id : lease_ids()) {
      if (before.count(id)) continue;  // an earlier case's, not yet expired
      ++fresh;
      auto ttl = etcd.post("/v3/lease/timetolive", {{"ID", id}});
      INFO("lease " << ttl.dump());
      // grantedTTL is an int64, which the gateway writes as a JSON string.
      CHECK(ttl.value("grantedTTL", std::string("0")) == std::to_string(c.ttl_s));
    }
    CHECK(fresh >= 1);
    h->shutdown();
  }
}

TEST_CASE("etcd: several endpoints: a member that is down is skipped", "[etcd]") {
  SKIP_WITHOUT_ETCD();
  auto& etcd = EtcdServer::shared();
  const std::string dead = "127.0.0.1:" + std::to_string(trun::testing::free_port());
  const std::string run = etcd_run_id();
  std::vector<HandlerPtr> hs;
  for (auto id : {"a", "b"}) {
    hs.push_back(create_rendezvous_handler(
        "etcd", fast_rdzv_options(dead + ",http://" + etcd.endpoint(), run, id, 2, 2)));
  }
  auto infos = join_handlers(hs);
  CHECK(infos[0].group_world_size == 2);
  CHECK(infos[0].round == infos[1].round);
  auto bad = fast_rdzv_options(dead + ",", run, "c", 1, 1);
  CHECK_THROWS_WITH(create_rendezvous_handler("etcd", bad), Catch::Contains("an empty entry"));
  for (auto& h : hs) h->shutdown();
}

TEST_CASE("etcd: the group outlives the etcd member its agents were talking to", "[etcd]") {
  SKIP_WITHOUT_ETCD();
  trun::testing::EtcdCluster cluster;
  const std::string run = etcd_run_id();
  std::vector<HandlerPtr> hs;
  for (auto id : {"a", "b"}) {
    auto o = fast_rdzv_options(cluster.endpoints(), run, id, 2, 2);
    o.keep_alive_interval = 500ms;  // a 2 s lease: the failover must not cost a node its lease
    hs.push_back(create_rendezvous_handler("etcd", o));
  }
  auto first = join_handlers(hs);
  REQUIRE(first[0].round == first[1].round);
  // Member 0, which every connection went to, dies; the other two keep the quorum.
  cluster.stop(0);
  hs[0]->report_worker_failure("after member 0 died");
  auto e = hs[1]->wait_round_over(30s);
  REQUIRE(e);
  INFO("round over: " << e->describe());
  CHECK(e->kind == RoundEvent::Kind::kWorkerFailed);
  auto second = join_handlers(hs);
  CHECK(second[0].round > first[0].round);
  CHECK(second[0].round == second[1].round);
  CHECK(second[0].group_world_size == 2);
  for (auto& h : hs) h->shutdown();
}
