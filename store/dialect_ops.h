#pragma once
// Which store operation each client dialect carries, and with which request: the one table that
// TcpStore asks once per call (docs/tcpstore-protocol.md §12, "Operations per dialect"). Private
// to store/.
//
// Thread safety: constants and pure functions.

#include <cstddef>
#include <cstdint>

#include "store/tcp_store.h"
#include "store/wire.h"

namespace trun::store::dialect {

using wire::Op;

// TcpStore's calls, in the order of the table below.
enum class StoreOp : uint8_t {
  kSet,
  kGet,
  kAdd,
  kCompareSet,
  kCheck,
  kWait,
  kNumKeys,
  kDeleteKey,
  kMultiGet,
  kMultiSet,
  kAppend,
  kQueuePush,
  kQueuePop,
  kQueueLen,
  kListKeys,
  kPing,
  kLeaseArm,
  kLeaseRenew,
  kLeaseRelease,
};
inline constexpr size_t kNumStoreOps = static_cast<size_t>(StoreOp::kLeaseRelease) + 1;

enum class Support : uint8_t {
  kUnsupported,  // fails with StoreError naming the operation and the server
  kNative,       // one request of its own: `query`
  kEmulated,     // built from the basic request `query` (see the rows' comments)
};

// How one dialect's server carries one operation.
struct Way {
  Support support = Support::kUnsupported;
  Op query = Op::kPing;  // unused when unsupported
  // WAIT emulations: at the deadline send CANCEL_WAIT and keep the connection (2.x). Without it
  // (1.13) a late STOP_WAITING could be read as the next reply, so the connection is dropped.
  bool cancel_wait = false;
};

struct OpSupport {
  StoreOp op;
  Way trun, torch2, torch1_13;
};

constexpr Way native(Op query) { return {Support::kNative, query, false}; }
constexpr Way emulated(Op query, bool cancel_wait = false) {
  return {Support::kEmulated, query, cancel_wait};
}
inline constexpr Way kNone{};
// The same request in every dialect (its numbering may differ).
constexpr OpSupport everywhere(StoreOp op, Op query) {
  return {op, native(query), native(query), native(query)};
}
// A trun extension: PyTorch's servers lack it.
constexpr OpSupport trun_only(StoreOp op, Op query) { return {op, native(query), kNone, kNone}; }

// clang-format off
inline constexpr OpSupport kOpSupport[] = {
  // op                 kTrun                   kTorch2                    kTorch1_13
  everywhere(StoreOp::kSet, Op::kSet),
  // Emulated: WAIT (with a client-side deadline), then GET.
  {StoreOp::kGet,       native(Op::kGetWait),   emulated(Op::kWait, true), emulated(Op::kWait)},
  everywhere(StoreOp::kAdd, Op::kAdd),
  everywhere(StoreOp::kCompareSet, Op::kCompareSet),
  everywhere(StoreOp::kCheck, Op::kCheck),
  // Emulated: WAIT with a client-side deadline.
  {StoreOp::kWait,      native(Op::kWaitKeys),  emulated(Op::kWait, true), emulated(Op::kWait)},
  everywhere(StoreOp::kNumKeys, Op::kNumKeys),
  everywhere(StoreOp::kDeleteKey, Op::kDeleteKey),
  // After a wait; emulated: one GET per key, in one write.
  {StoreOp::kMultiGet,  native(Op::kMultiGet),  native(Op::kMultiGet),     emulated(Op::kGet)},
  // Emulated: one SET per pair, in order, in one write (not atomic).
  {StoreOp::kMultiSet,  native(Op::kMultiSet),  native(Op::kMultiSet),     emulated(Op::kSet)},
  // Not emulated on 1.13 with a compare_set loop: compare_set's answer is the same when another
  // client appended the same bytes first, so an append would be lost.
  {StoreOp::kAppend,    native(Op::kAppend),    native(Op::kAppend),       kNone},
  // Queues since PyTorch 2.7, list_keys since 2.9 (an older 2.x server closes the connection).
  {StoreOp::kQueuePush, native(Op::kQueuePush), native(Op::kQueuePush),    kNone},
  {StoreOp::kQueuePop,  native(Op::kQueuePop),  native(Op::kQueuePop),     kNone},
  {StoreOp::kQueueLen,  native(Op::kQueueLen),  native(Op::kQueueLen),     kNone},
  {StoreOp::kListKeys,  native(Op::kListKeys),  native(Op::kListKeys),     kNone},
  // Emulated: a GETNUMKEYS round trip (1.13 has no PING and 2.2/2.3 servers refuse it).
  {StoreOp::kPing,      native(Op::kPing),      emulated(Op::kNumKeys),    emulated(Op::kNumKeys)},
  trun_only(StoreOp::kLeaseArm, Op::kLeaseArm),
  trun_only(StoreOp::kLeaseRenew, Op::kLeaseRenew),
  trun_only(StoreOp::kLeaseRelease, Op::kLeaseRelease),
};
// clang-format on

constexpr bool rows_in_order() {
  if (sizeof(kOpSupport) / sizeof(kOpSupport[0]) != kNumStoreOps) return false;
  for (size_t i = 0; i < kNumStoreOps; ++i) {
    if (static_cast<size_t>(kOpSupport[i].op) != i) return false;
  }
  return true;
}
static_assert(rows_in_order(), "kOpSupport has one row per StoreOp, in the enum's order");

constexpr const OpSupport& row(StoreOp op) { return kOpSupport[static_cast<size_t>(op)]; }

// How `dialect` carries `op`; kAuto (never in use after the first connect) carries nothing.
constexpr const Way& way(StoreOp op, StoreDialect dialect) {
  switch (dialect) {
    case StoreDialect::kTrun:
      return row(op).trun;
    case StoreDialect::kTorch2:
      return row(op).torch2;
    case StoreDialect::kTorch1_13:
      return row(op).torch1_13;
    case StoreDialect::kAuto:
      break;
  }
  return kNone;
}

// The query numbering a dialect's server reads.
constexpr wire::Dialect numbering(StoreDialect dialect) {
  return dialect == StoreDialect::kTorch1_13 ? wire::Dialect::kV1 : wire::Dialect::kV2;
}

// Whether a connection opens with VALIDATE (every dialect but 1.13's).
constexpr bool validates(StoreDialect dialect) { return dialect != StoreDialect::kTorch1_13; }

// "PyTorch 1.13's TCPStore server", as error messages name the server.
const char* server_name(StoreDialect dialect);

}  // namespace trun::store::dialect
