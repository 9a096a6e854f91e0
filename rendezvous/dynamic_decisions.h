#pragma once
// The dynamic rendezvous protocol's decisions and record formats, as pure functions: no I/O, no
// clock reads (callers pass `now`), no threads. dynamic_rendezvous.cpp is the executor that reads
// and writes the backend and acts on these decisions. docs/rendezvous.md describes the protocol.
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

// What the round's leader writes under Keys::result(k) (compare-and-set on an absent key), or what
// ends the round without completing it.
struct RoundResult {
  enum class Kind { kComplete, kAborted, kClosed };
  Kind kind = Kind::kAborted;
  std::string reason;  // kAborted
  // kComplete: in group-rank order; fields: id, addr, ticket, master_port.
  ParticipantList members;
};
std::string encode_complete(const std::vector<NodeDesc>& members);
std::string encode_result(const RoundResult& result);
RoundResult decode_result(std::string_view text);  // throws RendezvousError when malformed
// What the lease fires into Keys::result(k) when a node dies before the round completes.
std::string abort_record(const std::string& reason);

// The round key: "<k>" or "closed".
struct RoundKey {
  bool closed = false;
  int64_t round = 0;
};
RoundKey parse_round_key(std::string_view text);  // throws RendezvousError when malformed

// One line of Keys::over(k): "<kind> <node> <detail>\n". The first line is the cause.
struct OverRecord {
  RoundEvent::Kind kind = RoundEvent::Kind::kRestart;
  std::string node_id;
  std::string detail;
};
std::string encode_over(const OverRecord& record);  // one line, newline-terminated
// Parses every well-formed line (unknown kinds are skipped, so newer writers stay readable).
std::vector<OverRecord> parse_over(std::string_view log);
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
std::vector<NodeDesc> assign_ranks(std::vector<NodeDesc> joined, int max_nodes);

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
JoinOutcome decide_after_result(const RoundResult& result, const std::string& my_id, int max_nodes);

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
