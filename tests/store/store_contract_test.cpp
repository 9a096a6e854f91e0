// The Store contract, run against every implementation: the TCP client talking to a real server
// over loopback, a PrefixStore over it, the in-memory store used by unit tests, and the etcd store
// (the agent's store with --rdzv-backend=etcd) against a real etcd, and the file store (every
// "client" a FileStore of its own on one file).
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <thread>

#include "rendezvous/etcd/kv.h"
#include "store/file_store.h"
#include "store/in_memory_store.h"
#include "store/prefix_store.h"
#include "store/server.h"
#include "store/tcp_store.h"
#include "tests/rendezvous/etcd_server.h"

using namespace trun::rendezvous;
using namespace trun::store;
using namespace std::chrono_literals;

namespace {

StoreServerOptions loopback() {
  StoreServerOptions o;
  o.host = "127.0.0.1";
  return o;
}

struct TcpFixture {
  std::unique_ptr<StoreServer> server = StoreServer::start(loopback());
  std::shared_ptr<Store> make() {
    TcpStoreOptions o;
    o.port = server->port();
    o.timeout = 5s;
    return std::make_shared<TcpStore>(o);
  }
};

struct PrefixFixture {
  TcpFixture tcp;
  std::shared_ptr<Store> make() { return std::make_shared<PrefixStore>("job/round_3", tcp.make()); }
};

struct MemoryFixture {
  std::shared_ptr<InMemoryStore> mem = std::make_shared<InMemoryStore>();
  MemoryFixture() { mem->set_timeout(5s); }
  // One store shared by every "client": set_timeout on it is not thread-safe (by contract).
  std::shared_ptr<Store> make() { return mem; }
};

// Each instance is a fresh key prefix in the process's shared etcd.
struct EtcdFixture {
  std::string prefix;
  EtcdFixture() {
    static int n = 0;
    auto why = trun::testing::etcd_unavailable_reason();
    if (!why.empty()) throw std::runtime_error(why);
    prefix = "/contract-" + std::to_string(::getpid()) + "-" + std::to_string(++n) + "/";
  }
  std::shared_ptr<Store> make() {
    etcd::KvOptions o;
    o.endpoints = {{"127.0.0.1", trun::testing::EtcdServer::shared().port()}};
    o.prefix = prefix;
    o.timeout = 5s;
    o.connect_timeout = 5s;
    return etcd::make_etcd_store(o);
  }
};

// Each make() is a FileStore of its own on the fixture's file, as separate processes would be.
struct FileFixture {
  std::string dir, path;
  FileFixture() {
    char tmpl[] = "/tmp/trun-filestore-XXXXXX";
    if (!::mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
    dir = tmpl;
    path = dir + "/store";
  }
  ~FileFixture() {
    std::remove(path.c_str());
    ::rmdir(dir.c_str());
  }
  std::shared_ptr<Store> make() {
    auto s = std::make_shared<FileStore>(path, -1);
    s->set_timeout(5s);
    return s;
  }
};

using Clock = std::chrono::steady_clock;

}  // namespace

TEMPLATE_TEST_CASE("set then get returns the value, including empty and binary values",
                   "[store][contract]", TcpFixture, PrefixFixture, MemoryFixture, EtcdFixture,
                   FileFixture) {
  TestType f;
  auto s = f.make();
  s->set("a", "hello");
  CHECK(s->get("a") == "hello");
  s->set("a", "");
  CHECK(s->get("a").empty());
  std::string binary("\0\x01\xff\n", 4);
  s->set("bin", binary);
  CHECK(s->get("bin") == binary);
  std::string big(3 << 20, 'x');
  s->set("big", big);
  CHECK(s->get("big") == big);
}

TEMPLATE_TEST_CASE("get blocks until another client sets the key", "[store][contract]", TcpFixture,
                   PrefixFixture, MemoryFixture, EtcdFixture, FileFixture) {
  TestType f;
  auto reader = f.make();
  auto writer = f.make();
  std::thread t([&] {
    std::this_thread::sleep_for(100ms);
    writer->set("late", "arrived");
  });
  auto start = Clock::now();
  CHECK(reader->get("late") == "arrived");
  CHECK(Clock::now() - start >= 90ms);
  t.join();
}

TEMPLATE_TEST_CASE("get of a key that never appears times out with StoreTimeoutError",
                   "[store][contract]", TcpFixture, PrefixFixture, MemoryFixture, EtcdFixture,
                   FileFixture) {
  TestType f;
  auto s = f.make();
  s->set_timeout(200ms);
  auto start = Clock::now();
  CHECK_THROWS_AS(s->get("never"), StoreTimeoutError);
  CHECK(Clock::now() - start >= 190ms);
  // The store stays usable after a timeout.
  s->set("after", "1");
  CHECK(s->get("after") == "1");
}

TEMPLATE_TEST_CASE("add is atomic across clients and counts from zero", "[store][contract]",
                   TcpFixture, PrefixFixture, MemoryFixture, EtcdFixture, FileFixture) {
  TestType f;
  CHECK(f.make()->add("fresh", 5) == 5);
  CHECK(f.make()->add("fresh", -7) == -2);
  constexpr int kThreads = 8, kAdds = 200;
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&f] {
      auto s = f.make();
      for (int j = 0; j < kAdds; ++j) s->add("counter", 1);
    });
  }
  for (auto& t : threads) t.join();
  auto s = f.make();
  CHECK(s->add("counter", 0) == kThreads * kAdds);
  CHECK(s->get("counter") == std::to_string(kThreads * kAdds));
}

TEMPLATE_TEST_CASE("compare_set follows c10d's rules", "[store][contract]", TcpFixture,
                   PrefixFixture, MemoryFixture, EtcdFixture, FileFixture) {
  TestType f;
  auto s = f.make();
  // Missing key, empty expected: set.
  CHECK(s->compare_set("k", "", "first") == "first");
  CHECK(s->get("k") == "first");
  // Missing key, non-empty expected: returns expected, does not set.
  CHECK(s->compare_set("absent", "x", "y") == "x");
  CHECK_FALSE(s->check({"absent"}));
  // Match: swap.
  CHECK(s->compare_set("k", "first", "second") == "second");
  // Mismatch: current value back, unchanged.
  CHECK(s->compare_set("k", "first", "third") == "second");
  CHECK(s->get("k") == "second");
}

TEMPLATE_TEST_CASE("compare_set wakes a waiter on the key", "[store][contract]", TcpFixture,
                   PrefixFixture, MemoryFixture, EtcdFixture, FileFixture) {
  TestType f;
  auto waiter = f.make();
  auto writer = f.make();
  std::thread t([&] {
    std::this_thread::sleep_for(50ms);
    writer->compare_set("cas", "", "v");
  });
  waiter->wait({"cas"}, 5s);
  t.join();
  CHECK(waiter->get("cas") == "v");
}

TEMPLATE_TEST_CASE("check reports whether all keys exist without blocking", "[store][contract]",
                   TcpFixture, PrefixFixture, MemoryFixture, EtcdFixture, FileFixture) {
  TestType f;
  auto s = f.make();
  CHECK(s->check({}));
  CHECK_FALSE(s->check({"x"}));
  s->set("x", "1");
  CHECK(s->check({"x"}));
  CHECK_FALSE(s->check({"x", "y"}));
  s->set("y", "2");
  CHECK(s->check({"x", "y"}));
}

TEMPLATE_TEST_CASE("wait returns once every key exists and times out otherwise",
                   "[store][contract]", TcpFixture, PrefixFixture, MemoryFixture, EtcdFixture,
                   FileFixture) {
  TestType f;
  auto s = f.make();
  auto writer = f.make();
  s->set("w1", "1");
  s->wait({"w1"}, 1s);  // already there
  std::thread t([&] {
    std::this_thread::sleep_for(50ms);
    writer->set("w2", "2");
    std::this_thread::sleep_for(50ms);
    writer->set("w3", "3");
  });
  auto start = Clock::now();
  s->wait({"w1", "w2", "w3", "w2"}, 5s);
  CHECK(Clock::now() - start >= 90ms);
  t.join();

  start = Clock::now();
  CHECK_THROWS_AS(s->wait({"w1", "missing"}, 300ms), StoreTimeoutError);
  auto took = Clock::now() - start;
  CHECK(took >= 290ms);
  CHECK(took < 5s);
  // A key that arrives after the timeout does not confuse the next call on the same client.
  writer->set("missing", "now");
  CHECK(s->add("after_timeout", 1) == 1);
  CHECK(s->get("missing") == "now");
}

TEMPLATE_TEST_CASE("num_keys and delete_key", "[store][contract]", TcpFixture, PrefixFixture,
                   MemoryFixture, EtcdFixture, FileFixture) {
  TestType f;
  auto s = f.make();
  int64_t base = s->num_keys();
  s->set("n1", "1");
  s->set("n2", "2");
  s->add("n3", 1);
  CHECK(s->num_keys() == base + 3);
  CHECK(s->delete_key("n1"));
  CHECK_FALSE(s->delete_key("n1"));
  CHECK(s->num_keys() == base + 2);
  CHECK_FALSE(s->check({"n1"}));
}

TEMPLATE_TEST_CASE("multi_set and multi_get keep the order of keys", "[store][contract]",
                   TcpFixture, PrefixFixture, MemoryFixture, EtcdFixture, FileFixture) {
  TestType f;
  auto s = f.make();
  s->multi_set({"m1", "m2", "m3"}, {"one", "", "three"});
  CHECK(s->multi_get({"m3", "m1", "m2"}) == std::vector<std::string>{"three", "one", ""});
  CHECK(s->multi_get({}).empty());
  s->set_timeout(200ms);
  CHECK_THROWS_AS(s->multi_get({"m1", "nope"}), StoreTimeoutError);
}

TEMPLATE_TEST_CASE("append creates and extends a value", "[store][contract]", TcpFixture,
                   PrefixFixture, MemoryFixture, EtcdFixture, FileFixture) {
  TestType f;
  auto s = f.make();
  s->append("log", "a");
  s->append("log", "bc");
  CHECK(s->get("log") == "abc");
}

TEST_CASE("a prefix view sees only its own keys but counts the whole store", "[store]") {
  TcpFixture f;
  auto base = f.make();
  PrefixStore one("one", base);
  PrefixStore two("two", base);
  one.set("k", "1");
  two.set("k", "2");
  CHECK(one.get("k") == "1");
  CHECK(two.get("k") == "2");
  CHECK(base->get("one/k") == "1");
  CHECK(one.num_keys() == base->num_keys());
  PrefixStore nested("inner", std::make_shared<PrefixStore>("outer", base));
  nested.set("x", "y");
  CHECK(base->get("outer/inner/x") == "y");
}

TEMPLATE_TEST_CASE("queues are first-in first-out and apart from the keys", "[store][contract]",
                   TcpFixture, PrefixFixture, MemoryFixture) {
  TestType f;
  auto s = f.make();
  const int64_t keys_before = s->num_keys();
  CHECK(s->queue_len("q") == 0);
  CHECK_FALSE(s->queue_pop("q", false).has_value());
  s->queue_push("q", "first");
  s->queue_push("q", std::string("\0second", 7));
  s->queue_push("q", "");
  CHECK(s->queue_len("q") == 3);
  CHECK(s->num_keys() == keys_before);  // a queue is not a key...
  CHECK(s->check({"q"}));               // ...but check and wait see a non-empty one
  s->wait({"q"}, 1s);
  CHECK_FALSE(s->check({"no-such-key"}));
  CHECK(s->queue_pop("q", false) == std::optional<std::string>("first"));
  CHECK(s->queue_pop("q", true) == std::optional<std::string>(std::string("\0second", 7)));
  CHECK(s->queue_pop("q", false) == std::optional<std::string>(""));
  CHECK(s->queue_len("q") == 0);
  CHECK_FALSE(s->queue_pop("q", false).has_value());
}

TEMPLATE_TEST_CASE("a blocking queue_pop waits for a push, or times out", "[store][contract]",
                   TcpFixture, PrefixFixture, MemoryFixture) {
  TestType f;
  auto consumer = f.make(), producer = f.make();
  std::thread push([&] {
    std::this_thread::sleep_for(200ms);
    producer->queue_push("jobs", "job-1");
  });
  auto t0 = Clock::now();
  auto got = consumer->queue_pop("jobs", true, 10s);
  push.join();
  CHECK(got == std::optional<std::string>("job-1"));
  CHECK(Clock::now() - t0 >= 150ms);
  t0 = Clock::now();
  CHECK_THROWS_AS(consumer->queue_pop("jobs", true, 300ms), StoreTimeoutError);
  CHECK(Clock::now() - t0 >= 250ms);
}

TEMPLATE_TEST_CASE("list_keys lists the keys, not the queues", "[store][contract]", TcpFixture,
                   MemoryFixture) {
  TestType f;
  auto s = f.make();
  s->set("a", "1");
  s->add("b", 2);
  s->queue_push("q", "x");
  auto keys = s->list_keys();
  std::sort(keys.begin(), keys.end());
  CHECK(keys == std::vector<std::string>{"a", "b"});
}

TEST_CASE("list_keys through a prefix view lists its own keys without the prefix", "[store]") {
  TcpFixture f;
  auto base = f.make();
  PrefixStore one("one", base);
  PrefixStore two("two", base);
  one.set("k", "1");
  one.set("sub/j", "2");
  two.set("other", "3");
  auto keys = one.list_keys();
  std::sort(keys.begin(), keys.end());
  CHECK(keys == std::vector<std::string>{"k", "sub/j"});
  CHECK(two.list_keys() == std::vector<std::string>{"other"});
}

TEST_CASE("the etcd store has no queues or list_keys and says so", "[store]") {
  SKIP_WITHOUT_ETCD();
  EtcdFixture f;
  auto s = f.make();
  CHECK_THROWS_WITH(s->queue_push("q", "x"),
                    Catch::Contains("queue_push") && Catch::Contains("no such operation"));
  CHECK_THROWS_AS(s->queue_pop("q", false), StoreError);
  CHECK_THROWS_AS(s->queue_len("q"), StoreError);
  CHECK_THROWS_AS(s->list_keys(), StoreError);
}
