#pragma once
// The dynamic ("c10d") rendezvous: nodes join and leave between rounds; a round completes with
// max_nodes at once, with the expected nodes (the previous round's survivors plus announced
// joiners) at once, or with at least min_nodes once last_call_timeout has passed. The protocol
// (keys, who writes what) is in docs/rendezvous.md; its decisions are pure functions in
// dynamic_decisions.h; this executor does the I/O over a RendezvousBackend.
//
// Store traffic per node and round is constant (a ticket, one descriptor with the lease, one
// blocking read of the result, one blocking read of the round's over key); only the round's leader
// reads every descriptor, once.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "rendezvous/backend.h"
#include "rendezvous/handler.h"
#include "store/server.h"

namespace trun::rendezvous {

// The "c10d" backend of the registry: hosts the store when the endpoint is this machine (or
// is_host=true forces it; a second agent on the same host finds the port taken and connects as a
// client), then connects. Throws RendezvousOptionError / RendezvousError.
std::unique_ptr<RendezvousHandler> create_c10d_rendezvous(const RendezvousOptions& options);

// The "etcd" backend of the registry: the same protocol with its state in an etcd cluster at the
// endpoint (HOST[:PORT], default port 2379, an "http://" prefix allowed; nobody hosts a store).
// See etcd/backend.h for how leases work there. Throws RendezvousOptionError / RendezvousError.
std::unique_ptr<RendezvousHandler> create_etcd_rendezvous(const RendezvousOptions& options);

// The same protocol over any backend (tests, future backends). `hosted` is the store this node
// hosts, if any (its node gets group rank 0; stopped at shutdown). Validates `options`.
std::unique_ptr<RendezvousHandler> create_dynamic_rendezvous(
    const RendezvousOptions& options, std::unique_ptr<RendezvousBackend> backend,
    std::unique_ptr<store::StoreServer> hosted);

}  // namespace trun::rendezvous
