#pragma once
// One TcpStore call per dialect::StoreOp, and the check that a client in some dialect does what
// the dialect table says: every operation the table gives that dialect works against the server,
// and every other fails with the StoreError naming the call and the server (before sending
// anything: the connection stays usable). Shared by the table's test against trun's server and
// the compatibility test against PyTorch 1.13's.

#include <catch2/catch.hpp>
#include <chrono>
#include <string>
#include <vector>

#include "store/dialect_ops.h"
#include "store/tcp_store.h"

namespace trun::test {

// The name the client's errors give the call that run_store_op(s, op, p) makes.
inline std::string store_op_label(store::dialect::StoreOp op, const std::string& p) {
  using store::dialect::StoreOp;
  auto key = [&](const char* k) { return "('" + p + k + "')"; };
  switch (op) {
    case StoreOp::kSet:
      return "set";
    case StoreOp::kGet:
      return "get" + key("k");
    case StoreOp::kAdd:
      return "add" + key("n");
    case StoreOp::kCompareSet:
      return "compare_set" + key("c");
    case StoreOp::kCheck:
      return "check";
    case StoreOp::kWait:
      return "wait('" + p + "k')";
    case StoreOp::kNumKeys:
      return "num_keys";
    case StoreOp::kDeleteKey:
      return "delete_key" + key("d");
    case StoreOp::kMultiGet:
      return "multi_get";
    case StoreOp::kMultiSet:
      return "multi_set";
    case StoreOp::kAppend:
      return "append" + key("a");
    case StoreOp::kQueuePush:
      return "queue_push" + key("q");
    case StoreOp::kQueuePop:
      return "queue_pop" + key("q");
    case StoreOp::kQueueLen:
      return "queue_len" + key("q");
    case StoreOp::kListKeys:
      return "list_keys";
    case StoreOp::kPing:
      return "ping";
    case StoreOp::kLeaseArm:
      return "lease_arm";
    case StoreOp::kLeaseRenew:
      return "lease_renew";
    case StoreOp::kLeaseRelease:
      return "lease_release";
  }
  return "?";
}

// Makes the call for `op`, under keys prefixed with `p` (a store where p + "k" is set), and says
// whether it answered as expected. Errors pass through (no assertion here catches them).
inline bool run_store_op(store::TcpStore& s, store::dialect::StoreOp op, const std::string& p) {
  using namespace std::chrono_literals;
  using store::dialect::StoreOp;
  switch (op) {
    case StoreOp::kSet:
      s.set(p + "k", "v");
      return true;
    case StoreOp::kGet:
      return s.get(p + "k", 5s) == "v";
    case StoreOp::kAdd:
      return s.add(p + "n", 2) >= 2;
    case StoreOp::kCompareSet:
      return s.compare_set(p + "c", "", "x") == "x";
    case StoreOp::kCheck:
      return s.check({p + "k"});
    case StoreOp::kWait:
      s.wait({p + "k"}, 5s);
      return true;
    case StoreOp::kNumKeys:
      return s.num_keys() >= 1;
    case StoreOp::kDeleteKey:
      return !s.delete_key(p + "d");
    case StoreOp::kMultiGet:
      return s.multi_get({p + "k"}, 5s) == std::vector<std::string>{"v"};
    case StoreOp::kMultiSet:
      s.multi_set({p + "m1", p + "m2"}, {"1", "2"});
      return true;
    case StoreOp::kAppend:
      s.append(p + "a", "x");
      return true;
    case StoreOp::kQueuePush:
      s.queue_push(p + "q", "x");
      return true;
    case StoreOp::kQueuePop:
      return s.queue_pop(p + "q", false, 0ms).has_value();
    case StoreOp::kQueueLen:
      return s.queue_len(p + "q") == 0;
    case StoreOp::kListKeys:
      return !s.list_keys().empty();
    case StoreOp::kPing:
      return s.ping() >= 0ms;
    case StoreOp::kLeaseArm:
      s.lease_arm(store::LeaseSpec{});
      return true;
    case StoreOp::kLeaseRenew:
      return s.lease_renew();
    case StoreOp::kLeaseRelease:
      return s.lease_release();
  }
  return false;
}

// Runs every operation, in the table's order, on `s` (keys under `p`) and checks each against the
// table for s.dialect().
inline void check_dialect_table(store::TcpStore& s, const std::string& p = "") {
  namespace dialect = store::dialect;
  for (size_t i = 0; i < dialect::kNumStoreOps; ++i) {
    const auto op = static_cast<dialect::StoreOp>(i);
    const std::string label = store_op_label(op, p);
    INFO("operation " << label << ", dialect " << store::to_string(s.dialect()));
    if (dialect::way(op, s.dialect()).support != dialect::Support::kUnsupported) {
      CHECK(run_store_op(s, op, p));
    } else {
      CHECK_THROWS_WITH(run_store_op(s, op, p), "store " + s.endpoint() + ": " + label + ": " +
                                                    dialect::server_name(s.dialect()) +
                                                    " lacks this operation (dialect " +
                                                    store::to_string(s.dialect()) + ")");
    }
  }
  CHECK(s.num_keys() >= 1);  // still connected: nothing was sent for what the dialect lacks
}

}  // namespace trun::test
