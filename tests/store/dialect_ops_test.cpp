// The table of which dialect carries which store operation: it agrees with the wire numbering (a
// dialect's requests exist in it; what 1.13 lacks has no 1.13 query byte, what PyTorch 2.x lacks
// is a trun extension), with docs/tcpstore-protocol.md §12, and with what the client does against
// trun's server in each of the three dialects (trun's server speaks them all). Against PyTorch
// 1.13's own server: compat/dialect_probe_test.cpp.
#include "store/dialect_ops.h"

#include <catch2/catch.hpp>
#include <chrono>
#include <string>

#include "store/server.h"
#include "store/tcp_store.h"
#include "store/wire.h"
#include "tests/store/store_op_driver.h"

using namespace trun::store;
using namespace std::chrono_literals;
using dialect::StoreOp;
using dialect::Support;

namespace {

constexpr StoreDialect kDialects[] = {StoreDialect::kTrun, StoreDialect::kTorch2,
                                      StoreDialect::kTorch1_13};

}  // namespace

TEST_CASE("every request the dialect table sends exists in that dialect's numbering",
          "[store][client][dialect]") {
  for (auto d : kDialects) {
    for (size_t i = 0; i < dialect::kNumStoreOps; ++i) {
      const auto op = static_cast<StoreOp>(i);
      const auto& way = dialect::way(op, d);
      INFO(trun::test::store_op_label(op, "") << " in " << to_string(d));
      if (way.support != Support::kUnsupported) {
        CHECK(wire::query_byte(way.query, dialect::numbering(d)) >= 0);
      }
      CHECK_FALSE((way.cancel_wait && d == StoreDialect::kTorch1_13));  // 1.13 has no CANCEL_WAIT
      // trun's server carries every operation natively.
      CHECK(dialect::way(op, StoreDialect::kTrun).support == Support::kNative);
      const wire::Op trun_query = dialect::way(op, StoreDialect::kTrun).query;
      if (d == StoreDialect::kTorch1_13 && way.support == Support::kUnsupported) {
        CHECK(wire::query_byte(trun_query, wire::Dialect::kV1) == -1);  // 1.13 lacks the request
      }
      if (d == StoreDialect::kTorch2 && way.support == Support::kUnsupported) {
        CHECK(wire::query_byte(trun_query, wire::Dialect::kV2) >= wire::kExtBase);  // trun's own
      }
    }
  }
  CHECK(dialect::way(StoreOp::kSet, StoreDialect::kAuto).support == Support::kUnsupported);
  CHECK(wire::query_byte(wire::Op::kCancelWait, wire::Dialect::kV1) == -1);
}

TEST_CASE("the dialect table says what docs/tcpstore-protocol.md §12 says",
          "[store][client][dialect]") {
  auto way = [](StoreOp op, StoreDialect d) { return dialect::way(op, d); };
  // append: native on trun and 2.x, absent from 1.13 (not emulated: an append could be lost).
  CHECK(way(StoreOp::kAppend, StoreDialect::kTorch2).query == wire::Op::kAppend);
  CHECK(way(StoreOp::kAppend, StoreDialect::kTorch1_13).support == Support::kUnsupported);
  // get/wait: server-side timeouts on trun; WAIT + CANCEL_WAIT on 2.x; an uncancellable WAIT on
  // 1.13.
  for (auto op : {StoreOp::kGet, StoreOp::kWait}) {
    CHECK(way(op, StoreDialect::kTorch2).query == wire::Op::kWait);
    CHECK(way(op, StoreDialect::kTorch2).cancel_wait);
    CHECK(way(op, StoreDialect::kTorch1_13).query == wire::Op::kWait);
    CHECK_FALSE(way(op, StoreDialect::kTorch1_13).cancel_wait);
  }
  CHECK(way(StoreOp::kGet, StoreDialect::kTrun).query == wire::Op::kGetWait);
  CHECK(way(StoreOp::kWait, StoreDialect::kTrun).query == wire::Op::kWaitKeys);
  // multi_get / multi_set: one GET / SET per key on 1.13.
  CHECK(way(StoreOp::kMultiGet, StoreDialect::kTorch1_13).query == wire::Op::kGet);
  CHECK(way(StoreOp::kMultiSet, StoreDialect::kTorch1_13).query == wire::Op::kSet);
  CHECK(way(StoreOp::kMultiSet, StoreDialect::kTorch2).support == Support::kNative);
  // ping: PING on trun, a GETNUMKEYS round trip elsewhere.
  CHECK(way(StoreOp::kPing, StoreDialect::kTrun).query == wire::Op::kPing);
  for (auto d : {StoreDialect::kTorch2, StoreDialect::kTorch1_13}) {
    CHECK(way(StoreOp::kPing, d).support == Support::kEmulated);
    CHECK(way(StoreOp::kPing, d).query == wire::Op::kNumKeys);
    // Leases are trun's; queues and list_keys are 2.x's too, not 1.13's.
    for (auto op : {StoreOp::kLeaseArm, StoreOp::kLeaseRenew, StoreOp::kLeaseRelease}) {
      CHECK(way(op, d).support == Support::kUnsupported);
    }
    for (auto op :
         {StoreOp::kQueuePush, StoreOp::kQueuePop, StoreOp::kQueueLen, StoreOp::kListKeys}) {
      CHECK((way(op, d).support == Support::kNative) == (d == StoreDialect::kTorch2));
    }
  }
  CHECK(dialect::numbering(StoreDialect::kTorch1_13) == wire::Dialect::kV1);
  CHECK(dialect::numbering(StoreDialect::kTorch2) == wire::Dialect::kV2);
  CHECK_FALSE(dialect::validates(StoreDialect::kTorch1_13));
}

TEST_CASE("the client in each dialect does what the dialect table says, against trun's server",
          "[store][client][dialect]") {
  StoreServerOptions so;
  so.host = "127.0.0.1";
  auto server = StoreServer::start(so);
  for (auto d : kDialects) {
    TcpStoreOptions o;
    o.port = server->port();
    o.timeout = 10s;
    o.dialect = d;
    TcpStore client(o);
    REQUIRE(client.dialect() == d);
    const std::string p = std::string(to_string(d)) + "/";
    client.set(p + "k", "v");
    trun::test::check_dialect_table(client, p);
  }
}
