#include "agent/node_status.h"

#include <nlohmann/json.hpp>

namespace trun::agent {

std::string node_status_key(const std::string& run_id, const std::string& node_id) {
  return "trun/status/" + run_id + "/" + node_id;
}

std::string encode_node_status(const NodeStatus& s) {
  nlohmann::json j = {{"node_id", s.node_id},
                      {"hostname", s.hostname},
                      {"addr", s.addr},
                      {"pid", s.pid},
                      {"round", s.round},
                      {"group_rank", s.group_rank},
                      {"group_world_size", s.group_world_size},
                      {"local_world_size", s.local_world_size},
                      {"restarts", s.restarts},
                      {"max_restarts", s.max_restarts},
                      {"state", s.state},
                      {"last_failure", s.last_failure},
                      {"last_failure_at", s.last_failure_at},
                      {"updated_at", s.updated_at}};
  // Invalid UTF-8 (a worker's error message) is replaced, never thrown.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::optional<NodeStatus> decode_node_status(const std::string& text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("node_id") || !j["node_id"].is_string()) return std::nullopt;
  NodeStatus s;
  try {
    s.node_id = j.value("node_id", "");
    s.hostname = j.value("hostname", "");
    s.addr = j.value("addr", "");
    s.pid = j.value("pid", int64_t{0});
    s.round = j.value("round", int64_t{-1});
    s.group_rank = j.value("group_rank", -1);
    s.group_world_size = j.value("group_world_size", 0);
    s.local_world_size = j.value("local_world_size", 0);
    s.restarts = j.value("restarts", 0);
    s.max_restarts = j.value("max_restarts", 0);
    s.state = j.value("state", "");
    s.last_failure = j.value("last_failure", "");
    s.last_failure_at = j.value("last_failure_at", 0.0);
    s.updated_at = j.value("updated_at", 0.0);
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;  // a field of the wrong type
  }
  return s;
}

}  // namespace trun::agent
