#pragma once
// Private to rendezvous/: c10d store failover (docs/rendezvous.md). When the store of a round is
// gone, its survivors move it to the first reachable member of that round
// (dynamic::plan_failover): each node waits for the candidates before it to host a store for the
// job, and hosts one itself, seeded with the round's records (dynamic::failover_seed), when none
// of them does. The handler's RendezvousHandler::recover_lost_store starts it; the agent forms
// the next round at each target in turn.

#include <memory>

#include "rendezvous/handler.h"

namespace trun::rendezvous {

// `options`: the lost handler's (run_id, store_token, failover, keep-alive, read_timeout,
// max_inline_members); `lost_endpoint`: the store it used (HOST:PORT). nullptr (having logged
// why when a move is impossible) as RendezvousHandler::recover_lost_store says.
std::unique_ptr<StoreFailover> start_c10d_failover(const RendezvousOptions& options,
                                                   const std::string& lost_endpoint,
                                                   const LostStore& lost);

}  // namespace trun::rendezvous
