#pragma once
// The etcd backend: RendezvousBackend over an etcd cluster (v3 API over its HTTP/JSON gateway,
// plain HTTP). The same dynamic protocol as c10d runs on it; nobody hosts a store.
//
// Leases. etcd leases expire after a ttl in whole seconds and only delete the keys attached to
// them; trun's lease must instead fire an action (set a result, or append to an over key). So a
// node's lease is one record key attached to an etcd lease, holding the action. Every node's
// backend watches the run's records: when one is deleted by expiry, the watchers carry out its
// action, exactly once (a claim key in the same transaction). A release first empties the record,
// so revoking it fires nothing. Unlike c10d there is no connection to close: a SIGKILLed node is
// noticed when its ttl lapses (keep_alive_interval x keep_alive_max_attempt, rounded up to whole
// seconds), not in milliseconds. The watch starts at the run's first revision, so a lease that
// expired while no other node was up still fires when one comes.
//
// Keys: `<prefix><key>` for the protocol's keys, `<prefix>trun/etcd/<run_id>/` for the records,
// claims and the run marker. They stay in etcd after the job.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "rendezvous/backend.h"

namespace trun::rendezvous {

struct EtcdBackendOptions {
  // Members of the etcd cluster (client URLs as host and port), tried in order.
  std::vector<std::pair<std::string, uint16_t>> endpoints{{"127.0.0.1", 2379}};
  std::string prefix = "/";  // every key starts with it (--rdzv-conf etcd_prefix)
  std::string run_id;
  std::chrono::milliseconds read_timeout{std::chrono::seconds(60)};     // each request
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(60)};  // retrying included
};

// The backend's counters (add()) are one key per arrival under this prefix of the counter's full
// key: their count is the counter's value (read by `trun status` too).
inline std::string etcd_counter_arrivals(const std::string& full_key) { return full_key + "/+/"; }

// Connects before returning. Throws StoreError / StoreTimeoutError.
std::unique_ptr<RendezvousBackend> connect_etcd_backend(const EtcdBackendOptions& options);

}  // namespace trun::rendezvous
