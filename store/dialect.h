#pragma once
// StoreDialect on its own, apart from TcpStore (store/tcp_store.h), because it is part of
// libtrun_worker's public API (WorkerEnv::store_dialect): installed as <trun/store/dialect.h>,
// self-contained (standard headers only). to_string and parse_store_dialect stay in
// tcp_store.h with the client that implements them.

#include <cstdint>

namespace trun::store {

// Which server the client talks to, hence which wire dialect it speaks.
enum class StoreDialect : uint8_t {
  // Probe on the first connect (skipped when a token is set: only trun's server authenticates);
  // later reconnects keep the answer.
  kAuto,
  // trun's StoreServer: PyTorch 2.x's protocol plus trun's extensions (server-side timeouts,
  // leases, authentication). Every operation is native.
  kTrun,
  // PyTorch >= 2.2's server: VALIDATE handshake, 2.x numbering, no extensions. get/wait use
  // WAIT with a client-side deadline and CANCEL_WAIT; leases are unavailable.
  kTorch2,
  // PyTorch 1.13's server: no handshake, 1.13 numbering, no APPEND/MULTI_*/CANCEL_WAIT/PING.
  // get/wait use WAIT bounded by the client's deadline; a wait that times out leaves the
  // connection out of step, so it is dropped (the next call reconnects). multi_get and
  // multi_set are emulated with WAIT + GETs and SETs (not atomic: another client may see part
  // of a multi_set); append and leases fail with StoreError.
  kTorch1_13,
};

}  // namespace trun::store
