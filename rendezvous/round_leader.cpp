#include "rendezvous/round_leader.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <limits>

namespace trun::rendezvous {

using namespace dynamic;

RoundLeader::RoundLeader(RendezvousBackend& backend, const Keys& keys,
                         const RendezvousOptions& options, std::string prefix)
    : backend_(backend), keys_(keys), options_(options), prefix_(std::move(prefix)) {}

std::vector<std::string> RoundLeader::multi_get(const std::vector<std::string>& keys) {
  if (keys.size() <= kKeysPerRequest) return backend_.multi_get(keys, descriptor_wait());
  std::vector<std::string> values;
  values.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); i += kKeysPerRequest) {
    std::vector<std::string> chunk(keys.begin() + i,
                                   keys.begin() + std::min(keys.size(), i + kKeysPerRequest));
    for (auto& v : backend_.multi_get(chunk, descriptor_wait())) values.push_back(std::move(v));
  }
  return values;
}

RoundResult RoundLeader::whole_result(int64_t round) {
  auto whole = backend_.try_get(keys_.members(round));
  if (!whole) {
    throw RendezvousError(prefix_ + ": round " + std::to_string(round) +
                          " lists only some of its members and its member list (" +
                          keys_.members(round) + ") is missing");
  }
  return decode_result(*whole);
}

// The leader (ticket 1) of round j decides when it completes and writes the result. Returns
// when the result exists (written here or by someone else: an abort, a close) or on timeout;
// the caller then reads the result like every other node.
void RoundLeader::lead(int64_t j, TimePoint deadline) {
  held_ = {};
  const Duration slice = std::min<Duration>(options_.keep_alive_interval, std::chrono::seconds(1));
  LeaderState s;
  s.min_nodes = options_.min_nodes;
  s.max_nodes = options_.max_nodes;
  s.last_call = options_.last_call_timeout;
  s.join_deadline = deadline;

  // The last completed round before j, whose members may still be running.
  int64_t prev = -1;
  RoundResult prev_result;
  for (int64_t i = j - 1; i >= 0 && i >= j - kMaxAbortedRounds; --i) {
    auto v = backend_.try_get(keys_.result(i));
    if (!v) break;
    prev_result = decode_result(*v);
    if (prev_result.kind == RoundResult::Kind::kComplete && prev_result.partial()) {
      prev_result = whole_result(i);
    }
    if (prev_result.kind == RoundResult::Kind::kClosed) {
      backend_.compare_set(keys_.result(j), "", encode_result(prev_result));
      return;
    }
    if (prev_result.kind == RoundResult::Kind::kComplete) {
      prev = i;
      break;
    }
  }
  // Ids holding tickets in round j when the previous round ended: nodes that waited while the
  // group was full count as expected too (read once, one request).
  std::vector<std::string> waiting;
  std::vector<OverRecord> prev_over;
  auto refresh_previous = [&](const std::optional<std::string>& over) {
    if (!over) return;
    prev_over = parse_over(*over);
    if (s.previous_running) {
      s.previous_running = false;
      int n = static_cast<int>(backend_.add(keys_.ticket(j), 0));
      std::vector<std::string> node_keys;
      for (int t = 1; t <= n; ++t) node_keys.push_back(keys_.node(j, t));
      try {
        auto values = multi_get(node_keys);
        for (int t = 1; t <= n; ++t) waiting.push_back(decode_node(values[t - 1], t).id);
      } catch (const store::StoreTimeoutError&) {
        // A ticket without a descriptor: its node died; the result will say so.
      }
      observe_joined(&s, n, Clock::now());
    }
    s.expected = expected_after(prev_result, prev_over, waiting);
  };
  if (prev >= 0) {
    s.previous_running = true;
    refresh_previous(backend_.try_get(keys_.over(prev)));
  }
  observe_joined(&s, static_cast<int>(backend_.add(keys_.ticket(j), 0)), Clock::now());
  // The waiting line, at a steady pace while the leader waits for joins (not while a full
  // group still runs: then nobody is missing).
  const Duration progress = options_.progress_interval;
  TimePoint next_progress = Clock::now() + progress;

  for (;;) {
    auto now = Clock::now();
    LeaderAction a = decide_leader(s, now);
    if (progress.count() > 0 && now >= next_progress) {
      next_progress = now + progress;
      if (a.kind == LeaderAction::Kind::kWaitForJoins && s.hold_at > 0) {
        spdlog::warn("{}: {}", prefix_, quorum_line(j, prev));
      } else if (a.kind == LeaderAction::Kind::kWaitForJoins) {
        std::optional<TimePoint> last_call_ends;
        if (s.min_reached_at) last_call_ends = *s.min_reached_at + s.last_call;
        spdlog::warn("{}: {}", prefix_,
                     waiting_line(j, s.joined, s.min_nodes, s.max_nodes, last_call_ends,
                                  s.join_deadline, now));
      }
    }
    if (a.kind == LeaderAction::Kind::kTimeout) return;
    if (a.kind == LeaderAction::Kind::kComplete) {
      const Quorum quorum{prev, &prev_result, &prev_over};
      const int considered = std::max(s.joined, a.target);
      if (complete(j, considered, a.target, quorum_applies() && prev >= 0 ? &quorum : nullptr)) {
        return;
      }
      // Too few of the previous round's members among all that joined: wait for another node
      // (or the deadline). Every ticket so far was considered, so only a new one can help.
      s.hold_at = considered;
      spdlog::warn("{}: {}", prefix_, quorum_line(j, prev));
      continue;
    }
    TimePoint wake = std::min(a.until, now + slice);
    if (progress.count() > 0) wake = std::min(wake, next_progress);
    auto wait = std::chrono::duration_cast<Duration>(wake - now);
    wait = std::max(wait, Duration(1));
    bool progressed;
    if (a.kind == LeaderAction::Kind::kWaitPreviousOver) {
      auto over = backend_.wait_get(keys_.over(prev), wait);
      progressed = over.has_value();
      refresh_previous(over);
    } else {
      progressed = backend_.wait_get(keys_.node(j, a.target), wait).has_value();
      observe_joined(&s, static_cast<int>(backend_.add(keys_.ticket(j), 0)), Clock::now());
      if (!progressed && prev >= 0) {
        // Expected members that died before rejoining show up as "left" in the old over key.
        refresh_previous(backend_.try_get(keys_.over(prev)));
      }
    }
    // Someone else may have ended this round (a joiner's lease fired, the job was closed).
    if (!progressed && backend_.try_get(keys_.result(j))) return;
  }
}

// How long a ticket may stay without its descriptor: a live node publishes right after taking
// its ticket; one that died in between never will (and has no lease to report it).
Duration RoundLeader::descriptor_wait() const {
  return std::min(options_.read_timeout,
                  lease_ttl(options_.keep_alive_interval, options_.keep_alive_max_attempt));
}

// The quorum rule guards against two groups after a store failover (c10d only: etcd is no
// single point of failure).
bool RoundLeader::quorum_applies() const { return options_.failover && backend_.name() == "c10d"; }
std::string RoundLeader::quorum_line(int64_t j, int64_t prev) const {
  return "round " + std::to_string(j) + " waits for a majority of round " + std::to_string(prev) +
         "'s nodes: " + std::to_string(held_.present) + " of " + std::to_string(held_.electorate) +
         " here, " + std::to_string(held_.needed) +
         " needed (a smaller side of a partition never forms a group; docs/rendezvous.md)";
}

// Writes the result with `count` of the first `available` tickets (pick_members: with a quorum,
// the previous round's members first); false (nothing written) when `quorum` is given and they do
// not hold it.
bool RoundLeader::complete(int64_t j, int available, int count, const Quorum* quorum) {
  // Without a quorum the first `count` tickets are the members: nothing more to read.
  if (!quorum) available = count;
  std::vector<std::string> keys;
  keys.reserve(available);
  for (int t = 1; t <= available; ++t) keys.push_back(keys_.node(j, t));
  std::vector<std::string> values;
  try {
    values = multi_get(keys);
  } catch (const store::StoreTimeoutError&) {
    // A node took a ticket and died before publishing (its lease never armed).
    backend_.compare_set(keys_.result(j), "",
                         abort_record("a node took a ticket but never published itself"));
    return true;
  }
  std::vector<NodeDesc> joined;
  joined.reserve(available);
  for (int t = 1; t <= available; ++t) joined.push_back(decode_node(values[t - 1], t));
  joined = pick_members(std::move(joined), count, quorum ? quorum->round : -1);
  if (quorum) {
    held_ = check_quorum(*quorum->result, quorum->round, *quorum->over, joined);
    if (!held_.ok) return false;
  }
  const std::vector<NodeDesc> ranked = assign_group_ranks(std::move(joined), options_.max_nodes);
  std::string record = encode_complete(ranked, options_.max_inline_members);
  // A large round's result lists a few members and a rank map; the whole list goes under its
  // own key first, for the next round's leader and `trun status` (one reader each, not N).
  if (static_cast<int>(ranked.size()) > options_.max_inline_members) {
    backend_.set(keys_.members(j), encode_complete(ranked, std::numeric_limits<int>::max()));
  }
  if (backend_.compare_set(keys_.result(j), "", record) == record) {
    backend_.compare_set(keys_.round(), std::to_string(j), std::to_string(j + 1));
  }
  return true;
}

}  // namespace trun::rendezvous
