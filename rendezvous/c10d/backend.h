#pragma once
// The c10d backend: RendezvousBackend over the trun store (a StoreServer, reached with TcpStore).
// Two connections: one for quick operations and the lease (so keep-alives never queue behind a
// wait), one for blocking waits; a third, for the agent's own keys, on first use.
//
// Needs a trun StoreServer: leases are a trun extension, and PyTorch's TCPStore server closes the
// connection on them.

#include <memory>
#include <string>

#include "rendezvous/backend.h"

namespace trun::rendezvous {

struct StoreBackendOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 29400;
  std::string token;
  std::chrono::milliseconds read_timeout{std::chrono::seconds(60)};     // each quick operation
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(60)};  // retrying included
};

// Connects both channels before returning. Throws StoreError / StoreTimeoutError.
std::unique_ptr<RendezvousBackend> connect_store_backend(const StoreBackendOptions& options);

}  // namespace trun::rendezvous
