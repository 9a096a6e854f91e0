#include "agent/rank_assignment.h"

#include "base/decimal.h"
#include "store/store.h"

namespace trun::agent {

Ranks compute_ranks(const std::vector<NodeRoleInfo>& nodes, int group_rank, const std::string& role,
                    int nproc) {
  Ranks out;
  int offset = 0, role_offset = 0;
  for (const auto& n : nodes) {
    out.world_size += n.nproc;
    if (n.role == role) out.role_world_size += n.nproc;
    if (n.group_rank < group_rank) {
      offset += n.nproc;
      if (n.role == role) role_offset += n.nproc;
    }
  }
  for (int l = 0; l < nproc; ++l) {
    out.global.push_back(offset + l);
    out.role.push_back(role_offset + l);
  }
  return out;
}

std::string format_role_info(const std::string& role, int nproc) {
  return role + "\n" + std::to_string(nproc);
}

NodeRoleInfo parse_role_info(int group_rank, const std::string& value) {
  const auto nl = value.find('\n');
  const std::string count = nl == std::string::npos ? std::string() : value.substr(nl + 1);
  // strtol's syntax as always: a leading '+' or spaces are taken.
  long n = -1;
  if (nl == std::string::npos || !base::parse_decimal(count, &n, base::DecimalSyntax{true, true}) ||
      n < 1 || n > 1 << 20) {
    throw rendezvous::RendezvousError("malformed role info from node " +
                                      std::to_string(group_rank) + ": '" + value + "'");
  }
  return {group_rank, value.substr(0, nl), static_cast<int>(n)};
}

Ranks assign_ranks(const rendezvous::RendezvousInfo& info, const std::string& role, int nproc,
                   std::chrono::milliseconds timeout) {
  std::vector<NodeRoleInfo> nodes;
  if (info.group_world_size == 1 || !info.store) {
    nodes.push_back({info.group_rank, role, nproc});
  } else {
    auto& store = *info.store;
    store.set("role_info/" + std::to_string(info.group_rank), format_role_info(role, nproc));
    std::vector<std::string> keys;
    for (int r = 0; r < info.group_world_size; ++r)
      keys.push_back("role_info/" + std::to_string(r));
    store.wait(keys, timeout);
    const auto values = store.multi_get(keys);
    for (int r = 0; r < info.group_world_size; ++r) {
      nodes.push_back(parse_role_info(r, values[static_cast<size_t>(r)]));
    }
  }
  return compute_ranks(nodes, info.group_rank, role, nproc);
}

}  // namespace trun::agent
