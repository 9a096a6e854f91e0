#include "agent/node_status.h"

#include <nlohmann/json.hpp>

namespace trun::agent {

std::string node_status_key(const std::string& run_id, const std::string& node_id) {
  return "trun/status/" + run_id + "/" + node_id;
}

NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(RankStatus, rank, local_rank, steps, step_s,
                                                compute_s, self_score)

// One list of the fields for both directions; a field missing when read keeps NodeStatus's
// default.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(NodeStatus, node_id, hostname, addr, pid, round,
                                                group_rank, group_world_size, local_world_size,
                                                restarts, max_restarts, state, last_failure,
                                                last_failure_at, root_cause, root_cause_node,
                                                root_cause_at, root_cause_round, updated_at,
                                                unhealthy, excluded, excluded_until, ranks,
                                                slow_ranks, goodput_ratio, goodput_wall_s, badput_s)

std::string encode_node_status(const NodeStatus& s) {
  const nlohmann::json j = s;
  // Invalid UTF-8 (a worker's error message) is replaced, never thrown.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::optional<NodeStatus> decode_node_status(const std::string& text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("node_id") || !j["node_id"].is_string()) return std::nullopt;
  try {
    return j.get<NodeStatus>();
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;  // a field of the wrong type
  }
}

std::string outside_count_key(const std::string& run_id) {
  return "trun/outside/" + run_id + "/count";
}

std::string outside_slot_key(const std::string& run_id, int64_t k) {
  return "trun/outside/" + run_id + "/" + std::to_string(k);
}

NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(ExclusionRecord, times, until, reason, node_id)

std::string exclusion_key(const std::string& run_id, const std::string& node_name) {
  return "trun/exclusion/" + run_id + "/" + node_name;
}

std::string blame_key(const std::string& run_id, const std::string& node_id) {
  return "trun/blame/" + run_id + "/" + node_id;
}

std::string encode_exclusion(const ExclusionRecord& record) {
  const nlohmann::json j = record;
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::optional<ExclusionRecord> decode_exclusion(const std::string& text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return std::nullopt;
  try {
    return j.get<ExclusionRecord>();
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
}

}  // namespace trun::agent
