#pragma once
// The dynamic rendezvous protocol's decisions and record formats, as pure functions: no I/O, no
// clock reads (callers pass `now`), no threads. dynamic_rendezvous.cpp is the executor that reads
// and writes the backend and acts on these decisions. docs/rendezvous.md describes the protocol.
//
// Three files implement it: dynamic_records.cpp (the records: nodes, round results and their rank
// map, the round key, the over-log), dynamic_decisions.cpp (ranks, the leader, a joining node,
// keep-alive, the waiting line) and dynamic_failover.cpp (quorum and store failover).
//
// Thread safety: everything here is a pure function or a plain value.

#include <chrono>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "rendezvous/handler.h"

namespace trun::rendezvous::dynamic {

using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;
using Duration = std::chrono::milliseconds;

// How far back the last completed round is looked for across aborted ones (a leader; trun
// status, for the static backend's rounds too).
inline constexpr int kMaxAbortedRounds = 64;

// --- keys -----------------------------------------------------------------------------------
// Every key of one run lives under "trun/rdzv/<run_id>/".
struct Keys {
  std::string base;  // "trun/rdzv/<run_id>"
  explicit Keys(const std::string& run_id) : base("trun/rdzv/" + run_id) {}
  std::string round() const { return base + "/round"; }  // "<k>" (gathering) or "closed"
  std::string ticket(int64_t k) const { return base + "/" + std::to_string(k) + "/ticket"; }
  std::string node(int64_t k, int64_t ticket) const {
    return base + "/" + std::to_string(k) + "/node/" + std::to_string(ticket);
  }
  std::string result(int64_t k) const { return base + "/" + std::to_string(k) + "/result"; }
  std::string over(int64_t k) const { return base + "/" + std::to_string(k) + "/over"; }
  // A round too large to list its members in the result (RoundResult::partial): the whole list,
  // in the format of a small round's result, written by the leader before the result.
  std::string members(int64_t k) const { return base + "/" + std::to_string(k) + "/members"; }
  // On a store started by a failover: "<round> <endpoint>", the last round of the lost store and
  // where this store listens (seeded before it accepts connections).
  std::string failover() const { return base + "/failover"; }
};
// The prefix of a round's store view handed to the agent.
std::string round_store_prefix(const std::string& run_id, int64_t round);

// --- records --------------------------------------------------------------------------------
// What a node publishes when it joins a round (under Keys::node(k, ticket)).
struct NodeDesc {
  std::string id;
  std::string addr;
  bool store_host = false;   // this node hosts the store (gets group rank 0)
  int rank_hint = -1;        // --node-rank, or -1
  int64_t prev_round = -1;   // the last round this node completed, or -1
  int prev_rank = -1;        // its group rank there
  uint16_t master_port = 0;  // a free port on this node, used when it becomes group rank 0
  int64_t ticket = 0;        // order of arrival in the round (not encoded: it is in the key)
};
std::string encode_node(const NodeDesc& node);
// Throws RendezvousError naming the ticket when the record is malformed.
NodeDesc decode_node(std::string_view text, int64_t ticket);

// Rounds of up to this many nodes list every member in their result; larger ones list only the
// first kListedMembers (the store failover candidates) and carry a compact rank map instead, so
// that the result every node reads stays small: N nodes x a whole list would be O(N^2) bytes.
inline constexpr int kInlineMembers = 256;
inline constexpr int kListedMembers = 8;

// One run of the rank map of a partial result: the members whose coordinate (rank_of) is
// (`cls`, `first` .. `first` + `count` - 1) have ranks `rank` .. `rank` + `count` - 1.
struct RankRun {
  char cls = 't';  // 'h': their --node-rank hint; 'p': their rank in round `latest`; 't': ticket
  int64_t first = 0;
  int64_t rank = 0;
  int64_t count = 1;
};

// What the round's leader writes under Keys::result(k) (compare-and-set on an absent key), or what
// ends the round without completing it.
struct RoundResult {
  enum class Kind { kComplete, kAborted, kClosed };
  Kind kind = Kind::kAborted;
  std::string reason;  // kAborted
  // kComplete: in group-rank order; fields: id, addr, ticket, master_port, store host ("1" for
  // the node that hosted the store of that round, "0" or missing otherwise). Every member, or for
  // a partial result the first kListedMembers of them.
  ParticipantList members;
  int world_size = 0;  // kComplete: the number of members
  // A partial result (more than kInlineMembers members): how a member finds its rank (rank_of).
  int64_t latest = -1;  // the round the 'p' coordinates refer to
  std::vector<RankRun> runs;
  std::vector<std::pair<int64_t, int>> exceptions;  // (ticket, rank), sorted: checked first
  bool partial() const { return static_cast<int>(members.size()) < world_size; }
};
// `inline_limit`: rounds larger than this are written partial (tests pass small limits).
std::string encode_complete(const std::vector<NodeDesc>& members,
                            int inline_limit = kInlineMembers);
std::string encode_result(const RoundResult& result);
RoundResult decode_result(std::string_view text);  // throws RendezvousError when malformed
// The group rank of the node `me` (its id, ticket, hint and previous round as it published them)
// in the complete round `result`, or -1 when it is not a member. A partial result is read through
// its rank map: a member's coordinate is ('h', hint) when it has a hint, else ('p', prev_rank) when
// it was in round `latest`, else ('t', ticket); the exceptions (by ticket) come first.
int rank_of(const RoundResult& result, const NodeDesc& me);
// What the lease fires into Keys::result(k) when a node dies before the round completes.
std::string abort_record(const std::string& reason);

// The round key: "<k>" or "closed".
struct RoundKey {
  bool closed = false;
  int64_t round = 0;
};
RoundKey parse_round_key(std::string_view text);  // throws RendezvousError when malformed

// One line of Keys::over(k): "<kind> <node> <detail>\n". The first line ends the round; a
// worker-failure line is "failed <node> t=<ms> <detail>" (t=: FailureReport::failed_at_ms; a
// line without it, from an older writer, still parses, with failed_at_ms -1). Every node of the
// round appends its own failure report, also after the round ended (docs/rendezvous.md).
struct OverRecord {
  RoundEvent::Kind kind = RoundEvent::Kind::kRestart;
  std::string node_id;
  std::string detail;
  int64_t failed_at_ms = -1;  // kWorkerFailed: when that node's root-cause worker exited
};
std::string encode_over(const OverRecord& record);  // one line, newline-terminated
// Parses every well-formed line (unknown kinds are skipped, so newer writers stay readable).
std::vector<OverRecord> parse_over(std::string_view log);
// The worker-failure reports of an over-log, in the order they were appended.
std::vector<FailureReport> failure_reports(const std::vector<OverRecord>& records);
// The key each member of round k adds 1 to once its workers of that round have stopped (and it
// appended its own failure report, if any): RoundRendezvous::round_failures waits on it.
std::string stopped_key(const std::string& over_key);
// The event a member of round `round` reports for the over-log `log`: its first record, with
// kNodeLeft about this very node turned into kMembershipLost.
RoundEvent round_event(int64_t round, std::string_view log, const std::string& my_id);

// --- ranks ----------------------------------------------------------------------------------
// Chooses at most `max_nodes` of `joined` (lowest tickets win) and orders them by group rank:
//  1. the store host gets rank 0;
//  2. hinted nodes take their hinted rank when it is inside the world and still free (the lower
//     ticket wins a conflict);
//  3. nodes of the latest previous round fill the free ranks in their old relative order;
//  4. the remaining nodes fill the rest by ticket.
std::vector<NodeDesc> assign_group_ranks(std::vector<NodeDesc> joined, int max_nodes);

// --- the leader (ticket 1 of a round) --------------------------------------------------------
struct LeaderState {
  int min_nodes = 1;
  int max_nodes = 1;
  Duration last_call{std::chrono::seconds(30)};
  TimePoint join_deadline;
  // Whether the previous completed round must end first (its members are still running).
  bool previous_running = false;
  // Nodes expected in this round: the previous round's members that did not leave, plus nodes
  // that announced themselves as joining; 0 when unknown (the first round).
  int expected = 0;
  int joined = 0;                           // tickets taken so far in this round
  std::optional<TimePoint> min_reached_at;  // when the leader first saw joined >= min_nodes
  // The first `hold_at` tickets could not form the round (no quorum, check_quorum): wait for
  // more until join_deadline. 0: no hold.
  int hold_at = 0;
};
struct LeaderAction {
  enum class Kind {
    kWaitPreviousOver,  // wait for the previous round's over key, until `until`
    kWaitForJoins,      // wait until ticket `target` has published, until `until`
    kComplete,          // write the result now with the first min(joined, max) tickets
    kTimeout,           // join_timeout passed with fewer than min_nodes
  };
  Kind kind = Kind::kTimeout;
  int target = 0;
  TimePoint until;
};
// Completes at max_nodes at once; at the expected count (>= min_nodes) at once; otherwise at
// min_nodes once last_call has passed since min_nodes was first seen.
LeaderAction decide_leader(const LeaderState& state, TimePoint now);
// Records `joined` in `state`, starting the last-call clock when min_nodes is first reached
// (and the previous round is over: call again after clearing previous_running).
void observe_joined(LeaderState* state, int joined, TimePoint now);
// The number of nodes expected in the round after `previous` given its over-log records:
// previous members minus those that left, plus announced joiners, plus `waiting` (ids already
// holding a ticket in the new round, e.g. nodes that waited while the group was full).
int expected_after(const RoundResult& previous, const std::vector<OverRecord>& over,
                   const std::vector<std::string>& waiting = {});

// The progress line of a node waiting for round `round`: "waiting for nodes in round 2: 1
// joined (min 2, max 3); join timeout in 598 s", with "last call ends in N s" instead once
// min_nodes have joined and the last call runs. `last_call_ends`: when the leader's last call
// ends, if one runs (only the leader knows it).
std::string waiting_line(int64_t round, int joined, int min_nodes, int max_nodes,
                         std::optional<TimePoint> last_call_ends, TimePoint join_deadline,
                         TimePoint now);

// --- a joining node -------------------------------------------------------------------------
struct JoinOutcome {
  enum class Kind {
    kRanked,     // this node is a member: `rank`
    kNextRound,  // not a member (aborted round, or no room): join the next round
    kClosed,     // the job has finished
  };
  Kind kind = Kind::kNextRound;
  int rank = -1;
  // kNextRound after a completed round with room: tell its members that a node waits.
  bool announce_join = false;
};
JoinOutcome decide_after_result(const RoundResult& result, const NodeDesc& me, int max_nodes);
// The same for a node known by its id alone (a result that lists every member).
JoinOutcome decide_after_result(const RoundResult& result, const std::string& my_id, int max_nodes);

// --- quorum and store failover (c10d, docs/rendezvous.md) -------------------------------------
// A kNodeLeft that the node announced itself (its agent shut down) rather than a lease that
// lapsed: planned leaves shrink the electorate instead of counting against the quorum.
bool planned_leave(const OverRecord& record);
// The rank of the member of `result` that hosted the store of that round, or -1.
int store_host_rank(const ParticipantList& members);
struct QuorumCheck {
  bool ok = true;
  int electorate = 0;  // the previous round's members minus those that left on purpose
  int present = 0;     // of them, joined here (as members of that round: prev_round matches)
  int needed = 0;      // a strict majority of the electorate (half with that round's store host)
};
// Whether the nodes `joined` may form the round after `previous_round` (`previous`, its over-log
// `over`): more than half of its electorate must be among them, or exactly half including the
// node that hosted that round's store. A store started by a failover never holds that node, so
// at most one side of a partition can form a round. No electorate (everybody left on purpose):
// ok.
QuorumCheck check_quorum(const RoundResult& previous, int64_t previous_round,
                         const std::vector<OverRecord>& over, const std::vector<NodeDesc>& joined);
// The `count` members of a round from `joined` (ticket order) when more joined than fit: with
// `previous_round` >= 0 (the quorum applies), that round's members first, then the others, each
// in ticket order, so that a spare that joined early never takes the place of a returning member
// that the quorum needs. Otherwise the first `count` tickets.
std::vector<NodeDesc> pick_members(std::vector<NodeDesc> joined, int count, int64_t previous_round);

// What a node of round k does when that round's store is lost.
struct FailoverPlan {
  bool possible = false;
  std::string why_not;      // !possible: one line for the error message
  int lost_host_rank = -1;  // the member that hosted the lost store (-1: an external store)
  // The members that may host the next store, best first: every rank except the lost host's, in
  // rank order. Each node tries those before itself and hosts when none of them answers. A store
  // no member hosted (an external one) is not moved unless it stopped on purpose (`host_left`:
  // its host left the job after the last round formed there without it): possible is false.
  std::vector<int> candidates;
  int quorum = 0;  // members needed to form the next round (a strict majority of the round)
};
// `host_left`: the lost host announced its leave (an agent that shut down): it leaves the
// electorate, so a majority of the others suffices (a 2-node job carries on with one node).
FailoverPlan plan_failover(const ParticipantList& members, int my_rank, bool host_left = false);
// The keys a failover store starts with, so that round k+1 forms on it as if on the old store:
// the round key (k+1), round k's result, its over-log naming the lost host (an unplanned leave, or
// a restart record when the store was external) and the failover record.
// `host_left`: as for plan_failover (the over-log then records a planned leave).
std::vector<std::pair<std::string, std::string>> failover_seed(const Keys& keys, int64_t round,
                                                               const ParticipantList& members,
                                                               const std::string& endpoint,
                                                               bool host_left = false);

// --- keep-alive -----------------------------------------------------------------------------
struct KeepAliveState {
  Duration interval{std::chrono::seconds(5)};
  int max_attempts = 3;
  TimePoint last_attempt;
  int consecutive_failures = 0;  // renewals that could not reach the store
};
struct KeepAliveAction {
  enum class Kind { kSleep, kRenew, kGiveUp };
  Kind kind = Kind::kSleep;
  TimePoint until;  // kSleep
};
// Renew every `interval`; after `max_attempts` consecutive failures to reach the store, give up
// (the store is lost). A renewal the store refuses (the lease lapsed) is handled by the caller.
KeepAliveAction decide_keep_alive(const KeepAliveState& state, TimePoint now);
// The lease ttl the server enforces: interval x max_attempts (what torchrun calls missing
// keep_alive_max_attempt heartbeats).
Duration lease_ttl(Duration interval, int max_attempts);

}  // namespace trun::rendezvous::dynamic
