#pragma once
// The dialect probe (docs/tcpstore-protocol.md §12): how the client finds out whether it talks to
// trun's server, a PyTorch 2.x server or a PyTorch 1.13 one, harming none of them. Private to
// store/; TcpStore runs it on its first connect when the dialect is kAuto.
//
// In one write: VALIDATE magic | PING kProbeNonce | LEASE_RELEASE. trun's server answers the echo
// and then 0 (no lease armed); PyTorch >= 2.4 answers the echo and closes on the unknown
// LEASE_RELEASE; PyTorch 2.2/2.3 close on PING. PyTorch 1.13 reads VALIDATE as a SET whose key
// length spans bytes 1-8: the nonce's third byte (0xA5) makes that length over 2^63, so its
// server fails the allocation at once and closes this connection (a shorter message would leave
// its single thread blocked reading the rest of a key). When the probe gets nothing back, 1.13
// and 2.2/2.3 are told apart on a new connection by 1.13's GETNUMKEYS (0x06), which a 2.x server
// refuses as a first message.
//
// Blocking, never past `deadline`. Thread safety: no shared state.

#include <cstdint>
#include <functional>

#include "store/socket_conn.h"
#include "store/tcp_store.h"

namespace trun::store {

inline constexpr uint32_t kProbeNonce = 0x54A5554E;
static_assert(((kProbeNonce >> 16) & 0xFF) >= 0x80, "the 1.13 key length must exceed 2^63");

struct ProbeResult {
  // kTrun, kTorch2 or kTorch1_13; kAuto when the second connection could not be opened (a failed
  // connect attempt: `reopen` knows why).
  StoreDialect dialect = StoreDialect::kAuto;
  // A connection to keep, ready for requests in `dialect` (kTrun: the probe's own, validated,
  // nothing pending; kTorch1_13: the second one, its answer read). -1 for kTorch2: the caller
  // opens a new connection, which must start with VALIDATE.
  int fd = -1;
};

// Probes over `fd`, a new connection on which nothing was sent; `reopen` opens another
// connection to the same server (or returns -1). Owns `fd` and what `reopen` returns: closes
// each unless it is the result's. Throws net::IoError, having closed them, when an answer did
// not come by `deadline` (a failed connect attempt, to be retried) or the echo was wrong.
ProbeResult probe_dialect(int fd, net::Clock::time_point deadline,
                          const std::function<int()>& reopen);

}  // namespace trun::store
