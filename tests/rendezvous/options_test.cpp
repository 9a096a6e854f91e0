// --rdzv-conf parsing, option validation and the backend registry: every bad input gets an error
// that names what was wrong.
#include <catch2/catch.hpp>

#include "rendezvous/handler.h"

using namespace trun::rendezvous;
using namespace trun::store;
using namespace std::chrono_literals;
using Catch::Contains;

namespace {
RendezvousOptions valid() {
  RendezvousOptions o;
  o.run_id = "job1";
  o.endpoint = "127.0.0.1:1";  // never reached: these tests fail before connecting
  o.min_nodes = 1;
  o.max_nodes = 2;
  o.is_host = false;
  o.read_timeout = 200ms;
  return o;
}
}  // namespace

TEST_CASE("rdzv-conf parses key=value lists", "[options]") {
  auto conf = parse_rdzv_conf(" join_timeout=10, last_call_timeout=0.5,is_host=true ");
  CHECK(conf.size() == 3);
  CHECK(conf.at("last_call_timeout") == "0.5");
  CHECK(parse_rdzv_conf("").empty());
  RendezvousOptions o;
  apply_rdzv_conf(conf, &o);
  CHECK(o.join_timeout == 10s);
  CHECK(o.last_call_timeout == 500ms);
  REQUIRE(o.is_host.has_value());
  CHECK(*o.is_host);
  apply_rdzv_conf({{"keep_alive_max_attempt", "7"},
                   {"keep_alive_interval", "2"},
                   {"read_timeout", "9"},
                   {"close_timeout", "4"},
                   {"progress_interval", "0.25"},
                   {"is_host", "0"}},
                  &o);
  CHECK(o.progress_interval == 250ms);
  CHECK(o.keep_alive_max_attempt == 7);
  CHECK(o.keep_alive_interval == 2s);
  CHECK(o.read_timeout == 9s);
  CHECK(o.close_timeout == 4s);
  CHECK_FALSE(*o.is_host);
}

TEST_CASE("rdzv-conf errors name the entry", "[options]") {
  CHECK_THROWS_WITH(parse_rdzv_conf("join_timeout"), Contains("malformed entry 'join_timeout'"));
  CHECK_THROWS_WITH(parse_rdzv_conf("a=1,,b=2"), Contains("empty entry"));
  CHECK_THROWS_WITH(parse_rdzv_conf("=3"), Contains("malformed entry"));
  CHECK_THROWS_WITH(parse_rdzv_conf("a=1,a=2"), Contains("'a' given twice"));
  RendezvousOptions o;
  CHECK_THROWS_WITH(apply_rdzv_conf({{"join_timout", "5"}}, &o),
                    Contains("unknown key 'join_timout'") && Contains("join_timeout"));
  CHECK_THROWS_WITH(apply_rdzv_conf({{"join_timeout", "ten"}}, &o),
                    Contains("join_timeout=ten") && Contains("seconds"));
  CHECK_THROWS_WITH(apply_rdzv_conf({{"last_call_timeout", "-1"}}, &o),
                    Contains("last_call_timeout=-1"));
  CHECK_THROWS_WITH(apply_rdzv_conf({{"keep_alive_max_attempt", "2.5"}}, &o),
                    Contains("keep_alive_max_attempt=2.5") && Contains("whole number"));
  CHECK_THROWS_WITH(apply_rdzv_conf({{"keep_alive_max_attempt", "0"}}, &o),
                    Contains("whole number >= 1"));
  CHECK_THROWS_WITH(apply_rdzv_conf({{"is_host", "maybe"}}, &o), Contains("is_host=maybe"));
  CHECK_THROWS_AS(apply_rdzv_conf({{"read_timeout", "nan"}}, &o), RendezvousOptionError);
}

TEST_CASE("the registry rejects unknown backends and lists the known ones", "[options]") {
  CHECK_THROWS_WITH(create_rendezvous_handler("zookeeper", valid()),
                    Contains("unknown rendezvous backend") && Contains("c10d, etcd, static"));
  CHECK(rendezvous_backend_names() == std::vector<std::string>{"c10d", "etcd", "static"});
}

TEST_CASE("etcd options: prefix, protocol, TLS refused, endpoint checked before connecting",
          "[options][etcd]") {
  RendezvousOptions o;
  apply_rdzv_conf({{"etcd_prefix", "/jobs/"}, {"protocol", "HTTP"}}, &o);
  CHECK(o.etcd_prefix == "/jobs/");
  CHECK_THROWS_WITH(apply_rdzv_conf({{"protocol", "https"}}, &o),
                    Contains("protocol=https") && Contains("plain HTTP"));
  for (const char* key : {"cacert", "cert", "key", "ssl_cert"}) {
    CHECK_THROWS_WITH(apply_rdzv_conf({{key, "/etc/x.pem"}}, &o),
                      Contains(key) && Contains("TLS to etcd is not supported"));
  }
  CHECK_THROWS_WITH(apply_rdzv_conf({{"etcd_prefix", ""}}, &o), Contains("must not be empty"));

  // The prefix belongs to etcd alone.
  auto c10d = valid();
  c10d.etcd_prefix = "/x/";
  CHECK_THROWS_WITH(create_rendezvous_handler("c10d", c10d),
                    Contains("etcd_prefix is only for --rdzv-backend=etcd"));

  for (const char* name : {"etcd", "etcd-v2"}) {
    auto e = valid();
    e.endpoint = "https://127.0.0.1:2379";
    CHECK_THROWS_WITH(create_rendezvous_handler(name, e), Contains("plain HTTP only"));
    e = valid();
    e.endpoint = "";
    CHECK_THROWS_WITH(create_rendezvous_handler(name, e), Contains("--rdzv-endpoint is required"));
    e = valid();
    e.min_nodes = 3;
    CHECK_THROWS_WITH(create_rendezvous_handler(name, e),
                      Contains("--rdzv-backend=etcd") && Contains("below the minimum"));
    // Nothing listens on port 1: the error names the endpoint after read_timeout of retries.
    e = valid();
    e.endpoint = "http://127.0.0.1:1/";
    CHECK_THROWS_WITH(create_rendezvous_handler(name, e),
                      Contains("cannot reach etcd") && Contains("127.0.0.1:1"));
  }
}

TEST_CASE("c10d options are validated before any connection", "[options]") {
  auto expect = [](RendezvousOptions o, const char* text) {
    CHECK_THROWS_WITH(create_rendezvous_handler("c10d", o), Contains(text));
  };
  auto o = valid();
  o.run_id = "";
  expect(o, "--rdzv-id is required");
  o = valid();
  o.run_id = "a/b";
  expect(o, "--rdzv-id=a/b");
  o = valid();
  o.min_nodes = 0;
  expect(o, "must be at least 1");
  o = valid();
  o.min_nodes = 3;
  o.max_nodes = 2;
  expect(o, "below the minimum");
  o = valid();
  o.endpoint = "";
  expect(o, "--rdzv-endpoint");
  o = valid();
  o.endpoint = "host:99999";
  expect(o, "port '99999'");
  o = valid();
  o.endpoint = "[::1";
  expect(o, "unterminated");
  o = valid();
  o.keep_alive_interval = 0ms;
  expect(o, "keep_alive_interval");
  o = valid();
  o.keep_alive_max_attempt = 0;
  expect(o, "keep_alive_max_attempt");
  o = valid();
  o.node_id = "has space";
  expect(o, "node id 'has space'");
  o = valid();
  o.node_rank = 5;
  expect(o, "--node-rank=5");
}

TEST_CASE("c10d names the endpoint it cannot reach", "[options]") {
  auto o = valid();
  o.endpoint = "127.0.0.1:1";  // nothing listens on port 1
  CHECK_THROWS_WITH(create_rendezvous_handler("c10d", o),
                    Contains("cannot reach the store") && Contains("127.0.0.1:1"));
}

TEST_CASE("static options are validated", "[options]") {
  auto o = valid();
  o.node_rank = 0;
  CHECK_THROWS_WITH(create_rendezvous_handler("static", o), Contains("fixed node count"));
  o.min_nodes = o.max_nodes = 2;
  o.node_rank = -1;
  CHECK_THROWS_WITH(create_rendezvous_handler("static", o), Contains("--node-rank=-1 is required"));
  o.node_rank = 2;
  CHECK_THROWS_WITH(create_rendezvous_handler("static", o), Contains("outside"));
  o.node_rank = 1;
  o.master_addr = "127.0.0.1";
  o.master_port = 0;
  CHECK_THROWS_WITH(create_rendezvous_handler("static", o), Contains("single node"));
}

TEST_CASE("rdzv-conf reads into its types and leaves what was not given unset", "[options]") {
  const RdzvConf c = read_rdzv_conf({{"timeout", "7"},
                                     {"join_timeout", "3"},
                                     {"failover", "no"},
                                     {"keep_alive_max_attempt", "4"}});
  CHECK(c.join_timeout == std::optional<std::chrono::milliseconds>(7s));  // timeout comes last
  CHECK(c.failover == std::optional<bool>(false));
  CHECK(c.keep_alive_max_attempt == std::optional<int>(4));
  CHECK_FALSE(c.read_timeout);
  CHECK_FALSE(c.is_host);
  CHECK_FALSE(c.etcd_prefix);
  CHECK_THROWS_WITH(read_rdzv_conf({{"read_timeout", "0"}}), Contains("read_timeout=0"));
}

TEST_CASE("backend kinds: torchrun's names, etcd-v2 is etcd", "[options]") {
  CHECK(parse_backend_kind("static") == BackendKind::kStatic);
  CHECK(parse_backend_kind("c10d") == BackendKind::kC10d);
  CHECK(parse_backend_kind("etcd-v2") == BackendKind::kEtcd);
  CHECK_FALSE(parse_backend_kind("zookeeper"));
  CHECK(std::string(backend_name(BackendKind::kEtcd)) == "etcd");
}

TEST_CASE("handler options follow the backend", "[options]") {
  RendezvousConfig c;
  c.backend = BackendKind::kC10d;
  c.endpoint = "h:1";
  c.node_rank = 3;
  c.local_addr = "10.0.0.1";
  c.store_token = "secret";
  c.conf = read_rdzv_conf({{"join_timeout", "9"}, {"read_timeout", "2"}, {"is_host", "1"}});
  RendezvousOptions d = handler_options(c, "job", 1, 4);
  CHECK(d.run_id == "job");
  CHECK(d.endpoint == "h:1");
  CHECK((d.min_nodes == 1 && d.max_nodes == 4));
  CHECK(d.node_rank == -1);  // not a rank hint: as torchrun's c10d, --node-rank is not used
  CHECK(d.local_addr == "10.0.0.1");
  CHECK(d.store_token == "secret");
  CHECK(d.join_timeout == 9s);
  CHECK(d.read_timeout == 2s);
  CHECK(d.is_host == std::optional<bool>(true));

  c.backend = BackendKind::kStatic;
  c.master_addr = "n0";
  c.master_port = 7;
  RendezvousOptions s = handler_options(c, "job", 4, 4);
  CHECK(s.node_rank == 3);
  CHECK((s.master_addr == "n0" && s.master_port == 7));
  CHECK(s.join_timeout == 9s);
  CHECK(s.read_timeout == 9s);  // static's one timeout
  CHECK(s.store_token.empty());
  CHECK(s.local_addr.empty());
  CHECK_FALSE(s.is_host);
  c.conf = {};
  CHECK(handler_options(c, "job", 4, 4).join_timeout == 300s);

  const RendezvousOptions alone = handler_options(standalone_config(c), "gen", 1, 1);
  CHECK((alone.master_addr == "127.0.0.1" && alone.master_port == 0 && alone.node_rank == 0));
}
