// The dynamic protocol's decisions (dynamic_decisions.h) that form a round: group ranks, the
// leader's next step, a joining node's outcome, keep-alives and the waiting line. The record
// formats they read are in dynamic_records.cpp, quorum and store failover in
// dynamic_failover.cpp.
#include "rendezvous/dynamic_decisions.h"

#include <algorithm>
#include <set>

#include "base/check.h"

namespace trun::rendezvous::dynamic {

std::vector<NodeDesc> assign_group_ranks(std::vector<NodeDesc> joined, int max_nodes) {
  std::sort(joined.begin(), joined.end(),
            [](const NodeDesc& a, const NodeDesc& b) { return a.ticket < b.ticket; });
  if (max_nodes >= 0 && joined.size() > static_cast<size_t>(max_nodes)) joined.resize(max_nodes);
  const int n = static_cast<int>(joined.size());
  std::vector<int> slot_of(n, -1);  // index into joined -> rank
  std::vector<int> at(n, -1);       // rank -> index into joined
  auto place = [&](int i, int rank) {
    slot_of[i] = rank;
    at[rank] = i;
  };
  for (int i = 0; i < n; ++i) {
    if (joined[i].store_host) {
      place(i, 0);
      break;
    }
  }
  for (int i = 0; i < n; ++i) {
    int h = joined[i].rank_hint;
    if (slot_of[i] < 0 && h >= 0 && h < n && at[h] < 0) place(i, h);
  }
  int64_t latest = -1;
  for (int i = 0; i < n; ++i) {
    if (slot_of[i] < 0) latest = std::max(latest, joined[i].prev_round);
  }
  std::vector<int> rest;
  for (int i = 0; i < n; ++i) {
    if (slot_of[i] < 0) rest.push_back(i);
  }
  // Survivors of the latest round first, in their old order; then everyone else by ticket.
  std::stable_sort(rest.begin(), rest.end(), [&](int a, int b) {
    bool sa = latest >= 0 && joined[a].prev_round == latest;
    bool sb = latest >= 0 && joined[b].prev_round == latest;
    if (sa != sb) return sa;
    if (sa) return joined[a].prev_rank < joined[b].prev_rank;
    return false;  // keep ticket order
  });
  // The nodes without a rank take the free ranks in order: as many free ranks as such nodes.
  int next = 0;
  for (int i : rest) {
    while (next < n && at[next] >= 0) ++next;
    TRUN_CHECK_LT(next, n,
                  "no free rank left for node " << joined[i].id << " (" << rest.size()
                                                << " nodes without a rank)");
    place(i, next);
  }
  std::vector<NodeDesc> out(n);
  for (int r = 0; r < n; ++r) {
    TRUN_CHECK_GE(at[r], 0, "rank " << r << " of " << n << " was given to no node");
    out[r] = std::move(joined[at[r]]);
  }
  return out;
}

void observe_joined(LeaderState* state, int joined, TimePoint now) {
  state->joined = joined;
  // Last call starts once the previous group has ended: waiting behind a running group is not
  // part of it.
  if (joined >= state->min_nodes && !state->min_reached_at && !state->previous_running) {
    state->min_reached_at = now;
  }
}

std::vector<NodeDesc> pick_members(std::vector<NodeDesc> joined, int count,
                                   int64_t previous_round) {
  if (static_cast<int>(joined.size()) > count && previous_round >= 0) {
    std::stable_partition(joined.begin(), joined.end(), [previous_round](const NodeDesc& d) {
      return d.prev_round == previous_round;
    });
  }
  if (static_cast<int>(joined.size()) > count) joined.resize(static_cast<size_t>(count));
  return joined;
}

LeaderAction decide_leader(const LeaderState& s, TimePoint now) {
  LeaderAction a;
  // Never form a second group while the previous one still runs.
  if (s.previous_running) {
    if (now >= s.join_deadline) return a;  // kTimeout
    a.kind = LeaderAction::Kind::kWaitPreviousOver;
    a.until = s.join_deadline;
    return a;
  }
  // The nodes so far could not form it (no quorum): only more of them can.
  if (s.hold_at > 0 && s.joined <= s.hold_at) {
    if (now >= s.join_deadline) return a;  // kTimeout
    a.kind = LeaderAction::Kind::kWaitForJoins;
    a.target = s.hold_at + 1;
    a.until = s.join_deadline;
    return a;
  }
  if (s.joined >= s.max_nodes) {
    a.kind = LeaderAction::Kind::kComplete;
    a.target = s.max_nodes;
    return a;
  }
  if (s.joined >= s.min_nodes) {
    int expected = std::min(s.expected, s.max_nodes);
    TimePoint last_call_end = (s.min_reached_at ? *s.min_reached_at : now) + s.last_call;
    if ((expected > 0 && s.joined >= expected) || now >= last_call_end) {
      a.kind = LeaderAction::Kind::kComplete;
      a.target = s.joined;
      return a;
    }
    a.kind = LeaderAction::Kind::kWaitForJoins;
    a.target = expected > s.joined ? expected : s.max_nodes;
    a.until = last_call_end;
    return a;
  }
  if (now >= s.join_deadline) return a;  // kTimeout
  a.kind = LeaderAction::Kind::kWaitForJoins;
  a.target = s.min_nodes;
  a.until = s.join_deadline;
  return a;
}

int expected_after(const RoundResult& previous, const std::vector<OverRecord>& over,
                   const std::vector<std::string>& waiting) {
  std::set<std::string> ids;
  for (size_t i = 0; i < previous.members.size(); ++i) {
    ids.insert(std::string(previous.members.field(i, 0)));
  }
  ids.insert(waiting.begin(), waiting.end());
  for (auto& r : over) {
    if (r.kind == RoundEvent::Kind::kNodeLeft) ids.erase(r.node_id);
    if (r.kind == RoundEvent::Kind::kNodeJoined && !r.node_id.empty()) ids.insert(r.node_id);
  }
  return static_cast<int>(ids.size());
}

JoinOutcome decide_after_result(const RoundResult& result, const NodeDesc& me, int max_nodes) {
  JoinOutcome o;
  switch (result.kind) {
    case RoundResult::Kind::kClosed:
      o.kind = JoinOutcome::Kind::kClosed;
      return o;
    case RoundResult::Kind::kAborted:
      return o;
    case RoundResult::Kind::kComplete:
      break;
  }
  int rank = rank_of(result, me);
  if (rank >= 0) {
    o.kind = JoinOutcome::Kind::kRanked;
    o.rank = rank;
    return o;
  }
  o.announce_join = result.world_size < max_nodes;
  return o;
}

JoinOutcome decide_after_result(const RoundResult& result, const std::string& my_id,
                                int max_nodes) {
  NodeDesc me;
  me.id = my_id;
  return decide_after_result(result, me, max_nodes);
}

KeepAliveAction decide_keep_alive(const KeepAliveState& s, TimePoint now) {
  KeepAliveAction a;
  if (s.consecutive_failures >= s.max_attempts) {
    a.kind = KeepAliveAction::Kind::kGiveUp;
    return a;
  }
  TimePoint due = s.last_attempt + s.interval;
  if (now >= due) {
    a.kind = KeepAliveAction::Kind::kRenew;
    return a;
  }
  a.kind = KeepAliveAction::Kind::kSleep;
  a.until = due;
  return a;
}

Duration lease_ttl(Duration interval, int max_attempts) {
  return interval * std::max(1, max_attempts);
}

std::string waiting_line(int64_t round, int joined, int min_nodes, int max_nodes,
                         std::optional<TimePoint> last_call_ends, TimePoint join_deadline,
                         TimePoint now) {
  auto seconds_left = [now](TimePoint t) {
    auto ms = std::chrono::duration_cast<Duration>(t - now).count();
    return std::to_string(ms <= 0 ? 0 : (ms + 999) / 1000);
  };
  std::string line = "waiting for nodes in round " + std::to_string(round) + ": " +
                     std::to_string(joined) + " joined (min " + std::to_string(min_nodes) +
                     ", max " + std::to_string(max_nodes) + "); ";
  if (last_call_ends && joined >= min_nodes) {
    line += "last call ends in " + seconds_left(*last_call_ends) + " s";
  } else {
    line += "join timeout in " + seconds_left(join_deadline) + " s";
  }
  return line;
}

}  // namespace trun::rendezvous::dynamic
