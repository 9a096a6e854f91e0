#include "launcher/status_read.h"

#include <utility>

namespace trun::launcher::status {

void read_job(rendezvous::BackendKind backend, rendezvous::JobReader& reader, JobStatus* js) {
  rendezvous::JobState state = rendezvous::read_job_status(backend, reader, js->run_id);
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
}

}  // namespace trun::launcher::status
