#pragma once
// Rendezvous options for tests on one machine: loopback addresses and short timings (last call
// 300 ms, keep-alives every 100 ms, a node dead after 3 missed ones), generous bounds elsewhere.
#include <unistd.h>

#include <chrono>
#include <string>

#include "rendezvous/handler.h"

namespace trun::testing {

// A run id no other test of this process (or of a concurrent test process) uses: PREFIX-PID-N.
inline std::string unique_run_id(const std::string& prefix) {
  static int n = 0;
  return prefix + "-" + std::to_string(::getpid()) + "-" + std::to_string(++n);
}

inline rendezvous::RendezvousOptions fast_rdzv_options(const std::string& endpoint,
                                                       const std::string& run_id,
                                                       const std::string& node_id, int min_nodes,
                                                       int max_nodes) {
  using namespace std::chrono_literals;
  rendezvous::RendezvousOptions o;
  o.run_id = run_id;
  o.endpoint = endpoint;
  o.min_nodes = min_nodes;
  o.max_nodes = max_nodes;
  o.node_id = node_id;
  o.local_addr = "127.0.0.1";
  o.last_call_timeout = 300ms;
  o.keep_alive_interval = 100ms;
  o.keep_alive_max_attempt = 3;
  o.join_timeout = 60s;
  o.read_timeout = 10s;
  return o;
}

}  // namespace trun::testing
