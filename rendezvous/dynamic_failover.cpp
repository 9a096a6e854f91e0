// Quorum and store failover (dynamic_decisions.h, docs/rendezvous.md): who may form the round
// after a lost store's, and how a failover store is planned and seeded.
#include "rendezvous/dynamic_decisions.h"

#include <set>

namespace trun::rendezvous::dynamic {

bool planned_leave(const OverRecord& record) {
  return record.kind == RoundEvent::Kind::kNodeLeft &&
         record.detail.rfind("agent shut down", 0) == 0;
}

int store_host_rank(const ParticipantList& members) {
  for (size_t i = 0; i < members.size(); ++i) {
    if (members.field(i, 4) == "1") return static_cast<int>(i);
  }
  return -1;
}

QuorumCheck check_quorum(const RoundResult& previous, int64_t previous_round,
                         const std::vector<OverRecord>& over, const std::vector<NodeDesc>& joined) {
  QuorumCheck q;
  std::set<std::string> electorate;
  for (size_t i = 0; i < previous.members.size(); ++i) {
    electorate.insert(std::string(previous.members.field(i, 0)));
  }
  for (auto& r : over) {
    if (planned_leave(r)) electorate.erase(r.node_id);
  }
  const int host = store_host_rank(previous.members);
  const std::string host_id = host >= 0 ? std::string(previous.members.field(host, 0)) : "";
  bool host_present = false;
  std::set<std::string> present;
  for (auto& n : joined) {
    if (n.prev_round != previous_round || !electorate.count(n.id)) continue;
    present.insert(n.id);
    host_present = host_present || n.id == host_id;
  }
  q.electorate = static_cast<int>(electorate.size());
  q.present = static_cast<int>(present.size());
  q.needed = host_present ? (q.electorate + 1) / 2 : q.electorate / 2 + 1;
  q.ok = q.electorate == 0 || 2 * q.present > q.electorate ||
         (2 * q.present == q.electorate && host_present);
  return q;
}

FailoverPlan plan_failover(const ParticipantList& members, int my_rank, bool host_left) {
  FailoverPlan p;
  const int n = static_cast<int>(members.size());
  p.lost_host_rank = store_host_rank(members);
  for (int r = 0; r < n; ++r) {
    if (r != p.lost_host_rank) p.candidates.push_back(r);
  }
  const int electorate = host_left && p.lost_host_rank >= 0 ? n - 1 : n;
  p.quorum = electorate / 2 + 1;
  const int left = static_cast<int>(p.candidates.size());
  if (my_rank < 0 || my_rank >= n || my_rank == p.lost_host_rank) {
    p.why_not = "this node was not a member of the last round";
  } else if (p.lost_host_rank < 0 && !host_left) {
    // An external store (`trun store`, is_host=false everywhere): whoever runs it restarts it.
    p.why_not = "no node of the job hosted it (an external store is not moved)";
  } else if (left < p.quorum) {
    p.why_not = "the last round had " + std::to_string(n) + " node(s); without its store host " +
                std::to_string(left) + " remain, and a new store needs a majority (" +
                std::to_string(p.quorum) +
                ") of them so that a partition cannot split the job into two groups";
  } else {
    p.possible = true;
  }
  return p;
}

std::vector<std::pair<std::string, std::string>> failover_seed(const Keys& keys, int64_t round,
                                                               const ParticipantList& members,
                                                               const std::string& endpoint,
                                                               bool host_left) {
  RoundResult complete;
  complete.kind = RoundResult::Kind::kComplete;
  complete.members = members;
  const int host = store_host_rank(members);
  OverRecord over;
  if (host >= 0) {
    // planned_leave() reads the prefix.
    over = {RoundEvent::Kind::kNodeLeft, std::string(members.field(host, 0)),
            std::string(host_left ? "agent shut down; " : "") +
                "the store host was lost; the store moved to " + endpoint};
  } else {
    over = {RoundEvent::Kind::kRestart, "", "the store was lost; it moved to " + endpoint};
  }
  return {{keys.round(), std::to_string(round + 1)},
          {keys.result(round), encode_result(complete)},
          {keys.over(round), encode_over(over)},
          {keys.failover(), std::to_string(round) + " " + endpoint}};
}

}  // namespace trun::rendezvous::dynamic
