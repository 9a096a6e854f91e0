#include "launcher/status_read.h"

#include <algorithm>
#include <chrono>
#include <utility>

namespace trun::launcher::status {
namespace {

// How long a record of a node outside the rounds stays shown without news: an unhealthy node
// writes at each retry (at most a minute apart), an excluded one when its exclusion begins and
// again when it ends; a node whose agent died stops being shown after this.
constexpr double kOutsideStaleSeconds = 180;

double now_unix() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The nodes that listed themselves as outside the rounds, still unhealthy or excluded, and not
// already among js->nodes.
void read_outside(rendezvous::JobReader& reader, JobStatus* js) {
  const int64_t count = reader.counter(agent::outside_count_key(js->run_id));
  const double now = now_unix();
  for (int64_t k = std::max<int64_t>(1, count - agent::kMaxOutsideSlots + 1); k <= count; ++k) {
    const auto id = reader.get(agent::outside_slot_key(js->run_id, k));
    if (!id) continue;
    bool listed = false;
    for (const auto& n : js->nodes) listed = listed || n.node_id == *id;
    if (listed) continue;
    const auto v = reader.get(agent::node_status_key(js->run_id, *id));
    std::optional<agent::NodeStatus> record = v ? agent::decode_node_status(*v) : std::nullopt;
    if (!record) continue;
    const bool unhealthy =
        record->state == "unhealthy" && now - record->updated_at < kOutsideStaleSeconds;
    const bool excluded =
        record->state == "excluded" && now - record->excluded_until < kOutsideStaleSeconds;
    if (!unhealthy && !excluded) continue;
    NodeRow row;
    row.node_id = *id;
    row.addr = record->addr;
    row.state = "outside";
    row.record = std::move(record);
    js->nodes.push_back(std::move(row));
    ++js->outside;
  }
}

}  // namespace

void read_job(rendezvous::BackendKind backend, rendezvous::JobReader& reader, JobStatus* js) {
  rendezvous::JobState state;
  try {
    state = rendezvous::read_job_status(backend, reader, js->run_id);
  } catch (const rendezvous::NoSuchJobError&) {
    // No node joined yet: a job whose only nodes are kept out (unhealthy) still has them.
    if (reader.counter(agent::outside_count_key(js->run_id)) <= 0) throw;
    state.round_state = "forming";
  }
  js->closed = state.closed;
  js->round = state.round;
  js->next_round = state.next_round;
  js->round_state = std::move(state.round_state);
  js->over_cause = std::move(state.over_cause);
  js->waiting = state.waiting;
  js->nodes.clear();
  for (auto& n : state.nodes) {
    NodeRow row;
    row.node_id = std::move(n.node_id);
    row.addr = std::move(n.addr);
    row.group_rank = n.group_rank;
    row.state = std::move(n.state);
    if (auto v = reader.get(agent::node_status_key(js->run_id, row.node_id))) {
      row.record = agent::decode_node_status(*v);
    }
    js->nodes.push_back(std::move(row));
  }
  read_outside(reader, js);
}

}  // namespace trun::launcher::status
