// The dynamic rendezvous decisions as pure functions: a fake clock (plain time points), no store,
// no sockets.
#include "rendezvous/dynamic_decisions.h"

#include <algorithm>
#include <array>
#include <catch2/catch.hpp>
#include <map>
#include <numeric>
#include <random>

using namespace trun::rendezvous;
using namespace trun::store;
using namespace trun::rendezvous::dynamic;
using namespace std::chrono_literals;

namespace {

const TimePoint t0 = TimePoint() + 1000h;  // any fixed instant

NodeDesc node(std::string id, int64_t ticket, int64_t prev_round = -1, int prev_rank = -1,
              bool host = false, int hint = -1) {
  NodeDesc n;
  n.id = std::move(id);
  n.addr = "10.0.0." + std::to_string(ticket);
  n.ticket = ticket;
  n.prev_round = prev_round;
  n.prev_rank = prev_rank;
  n.store_host = host;
  n.rank_hint = hint;
  n.master_port = static_cast<uint16_t>(30000 + ticket);
  return n;
}

std::vector<std::string> ids(const std::vector<NodeDesc>& nodes) {
  std::vector<std::string> out;
  for (auto& n : nodes) out.push_back(n.id);
  return out;
}

LeaderState leader(int min, int max) {
  LeaderState s;
  s.min_nodes = min;
  s.max_nodes = max;
  s.last_call = 30s;
  s.join_deadline = t0 + 600s;
  return s;
}

}  // namespace

TEST_CASE("the leader completes at max_nodes at once", "[decisions]") {
  auto s = leader(2, 4);
  observe_joined(&s, 4, t0);
  auto a = decide_leader(s, t0);
  CHECK(a.kind == LeaderAction::Kind::kComplete);
  CHECK(a.target == 4);
}

TEST_CASE("below min_nodes the leader waits for the min-th ticket until the join deadline",
          "[decisions]") {
  auto s = leader(3, 5);
  observe_joined(&s, 1, t0);
  auto a = decide_leader(s, t0);
  CHECK(a.kind == LeaderAction::Kind::kWaitForJoins);
  CHECK(a.target == 3);
  CHECK(a.until == t0 + 600s);
  CHECK(decide_leader(s, t0 + 600s).kind == LeaderAction::Kind::kTimeout);
}

TEST_CASE("at min_nodes the leader completes only after last call", "[decisions]") {
  auto s = leader(2, 4);
  observe_joined(&s, 2, t0 + 5s);  // min reached at t0+5s
  auto a = decide_leader(s, t0 + 10s);
  CHECK(a.kind == LeaderAction::Kind::kWaitForJoins);
  CHECK(a.target == 4);
  CHECK(a.until == t0 + 35s);
  // A third node arrives during last call: the clock does not restart.
  observe_joined(&s, 3, t0 + 20s);
  CHECK(decide_leader(s, t0 + 34s).kind == LeaderAction::Kind::kWaitForJoins);
  a = decide_leader(s, t0 + 35s);
  CHECK(a.kind == LeaderAction::Kind::kComplete);
  CHECK(a.target == 3);
}

TEST_CASE("with a known expected count the leader completes as soon as it is reached",
          "[decisions]") {
  auto s = leader(1, 8);
  s.expected = 3;
  observe_joined(&s, 2, t0);
  auto a = decide_leader(s, t0);
  CHECK(a.kind == LeaderAction::Kind::kWaitForJoins);
  CHECK(a.target == 3);
  CHECK(a.until == t0 + 30s);  // last call still bounds waiting for an expected node
  observe_joined(&s, 3, t0 + 100ms);
  CHECK(decide_leader(s, t0 + 100ms).kind == LeaderAction::Kind::kComplete);
  // An expected node that never comes: last call completes without it.
  auto s2 = leader(1, 8);
  s2.expected = 3;
  observe_joined(&s2, 2, t0);
  auto late = decide_leader(s2, t0 + 30s);
  CHECK(late.kind == LeaderAction::Kind::kComplete);
  CHECK(late.target == 2);
}

TEST_CASE("the leader never completes while the previous round still runs", "[decisions]") {
  auto s = leader(1, 2);
  s.previous_running = true;
  observe_joined(&s, 2, t0);  // even at max: those are waiting nodes, the old group still runs
  auto a = decide_leader(s, t0);
  CHECK(a.kind == LeaderAction::Kind::kWaitPreviousOver);
  CHECK(a.until == t0 + 600s);
  CHECK(decide_leader(s, t0 + 600s).kind == LeaderAction::Kind::kTimeout);
  // Last call did not start while the old group ran: it starts when it ends.
  CHECK_FALSE(s.min_reached_at.has_value());
  s.previous_running = false;
  s.max_nodes = 4;
  observe_joined(&s, 2, t0 + 100s);
  auto w = decide_leader(s, t0 + 101s);
  CHECK(w.kind == LeaderAction::Kind::kWaitForJoins);
  CHECK(w.until == t0 + 130s);
}

TEST_CASE("expected_after counts survivors and announced joiners", "[decisions]") {
  RoundResult prev = decode_result(encode_complete({node("a", 1), node("b", 2), node("c", 3)}));
  std::vector<OverRecord> over = {
      {RoundEvent::Kind::kNodeLeft, "b", "lease lost"},
      {RoundEvent::Kind::kNodeJoined, "d", ""},
      {RoundEvent::Kind::kNodeJoined, "d", ""},          // announced twice: still one node
      {RoundEvent::Kind::kWorkerFailed, "a", "exit 1"},  // a failure does not remove the node
  };
  CHECK(expected_after(prev, over) == 3);  // a, c, d
  // Nodes that waited in the new round while the group was full count too (once).
  CHECK(expected_after(prev, over, {"w", "a"}) == 4);
}

TEST_CASE("ranks: the store host gets rank 0", "[decisions][ranks]") {
  auto r = assign_group_ranks({node("a", 1), node("b", 2), node("host", 3, -1, -1, true)}, 8);
  CHECK(ids(r) == std::vector<std::string>{"host", "a", "b"});
}

TEST_CASE("ranks: survivors keep their relative order, newcomers follow by ticket",
          "[decisions][ranks]") {
  // Round 4 had c(0) a(1) b(2); b died; d and e are new. Tickets are arrival order.
  auto r =
      assign_group_ranks({node("e", 1), node("a", 2, 4, 1), node("d", 3), node("c", 4, 4, 0)}, 8);
  CHECK(ids(r) == std::vector<std::string>{"c", "a", "e", "d"});
}

TEST_CASE("ranks: only the latest previous round counts as survivors", "[decisions][ranks]") {
  auto r = assign_group_ranks({node("old", 1, 2, 0), node("x", 2, 5, 1), node("y", 3, 5, 0)}, 8);
  CHECK(ids(r) == std::vector<std::string>{"y", "x", "old"});
}

TEST_CASE("ranks: hints are honoured when free and inside the world", "[decisions][ranks]") {
  auto r = assign_group_ranks({node("a", 1, -1, -1, false, 2), node("b", 2, -1, -1, false, 0),
                               node("c", 3, -1, -1, false, 2),   // conflict: a has the lower ticket
                               node("d", 4, -1, -1, false, 9)},  // outside the world: ignored
                              8);
  CHECK(ids(r) == std::vector<std::string>{"b", "c", "a", "d"});
  // The host's rank 0 wins over a hint for 0.
  auto h = assign_group_ranks({node("a", 1, -1, -1, false, 0), node("host", 2, -1, -1, true)}, 8);
  CHECK(ids(h) == std::vector<std::string>{"host", "a"});
}

TEST_CASE("ranks: at most max_nodes, lowest tickets first", "[decisions][ranks]") {
  auto r = assign_group_ranks({node("d", 4), node("b", 2), node("a", 1), node("c", 3)}, 3);
  CHECK(ids(r) == std::vector<std::string>{"a", "b", "c"});
}

TEST_CASE("a joiner learns its rank, waits for the next round, or finds the job closed",
          "[decisions]") {
  RoundResult full = decode_result(encode_complete({node("a", 1), node("b", 2)}));
  auto in = decide_after_result(full, "b", 2);
  CHECK(in.kind == JoinOutcome::Kind::kRanked);
  CHECK(in.rank == 1);
  auto out = decide_after_result(full, "z", 2);
  CHECK(out.kind == JoinOutcome::Kind::kNextRound);
  CHECK_FALSE(out.announce_join);  // no room: wait quietly
  auto room = decide_after_result(full, "z", 3);
  CHECK(room.kind == JoinOutcome::Kind::kNextRound);
  CHECK(room.announce_join);  // room: the running group restarts to admit it
  RoundResult aborted;
  aborted.kind = RoundResult::Kind::kAborted;
  CHECK(decide_after_result(aborted, "a", 2).kind == JoinOutcome::Kind::kNextRound);
  CHECK_FALSE(decide_after_result(aborted, "a", 2).announce_join);
  RoundResult closed;
  closed.kind = RoundResult::Kind::kClosed;
  CHECK(decide_after_result(closed, "a", 2).kind == JoinOutcome::Kind::kClosed);
}

TEST_CASE("keep-alive renews every interval and gives up after max attempts", "[decisions]") {
  KeepAliveState k;
  k.interval = 5s;
  k.max_attempts = 3;
  k.last_attempt = t0;
  auto a = decide_keep_alive(k, t0 + 1s);
  CHECK(a.kind == KeepAliveAction::Kind::kSleep);
  CHECK(a.until == t0 + 5s);
  CHECK(decide_keep_alive(k, t0 + 5s).kind == KeepAliveAction::Kind::kRenew);
  k.consecutive_failures = 2;
  CHECK(decide_keep_alive(k, t0 + 5s).kind == KeepAliveAction::Kind::kRenew);
  k.consecutive_failures = 3;
  CHECK(decide_keep_alive(k, t0 + 5s).kind == KeepAliveAction::Kind::kGiveUp);
  CHECK(lease_ttl(5s, 3) == 15s);
  CHECK(lease_ttl(200ms, 0) == 200ms);
}

TEST_CASE("records round-trip and malformed ones are rejected with the text", "[decisions]") {
  auto n = node("host-1", 7, 3, 2, true, 1);
  auto back = decode_node(encode_node(n), 7);
  CHECK(back.id == n.id);
  CHECK(back.addr == n.addr);
  CHECK(back.store_host);
  CHECK(back.rank_hint == 1);
  CHECK(back.prev_round == 3);
  CHECK(back.prev_rank == 2);
  CHECK(back.master_port == n.master_port);
  CHECK_THROWS_WITH(decode_node("garbage", 4),
                    Catch::Contains("ticket 4") && Catch::Contains("garbage"));

  auto rr = decode_result(encode_complete({node("a", 2), node("b", 1)}));
  REQUIRE(rr.kind == RoundResult::Kind::kComplete);
  REQUIRE(rr.members.size() == 2);
  CHECK(rr.members[0].node_id == "a");
  CHECK(rr.members[0].addr == "10.0.0.2");
  CHECK(rr.members.field(0, 2) == "2");
  CHECK(rr.members.field(1, 3) == "30001");
  CHECK(rr.members.find("b") == 1);
  CHECK(rr.members.find("zz") == -1);
  CHECK(decode_result(encode_result(rr)).members.to_vector().size() == 2);
  CHECK_THROWS_AS(rr.members.at(2), std::out_of_range);
  CHECK_THROWS_AS(decode_result("complete 2\na b 1 1"), RendezvousError);
  CHECK_THROWS_AS(decode_result("complete 1\na b 1 1\nextra"), RendezvousError);
  auto ab = decode_result(abort_record("node x left\nsecond line"));
  CHECK(ab.kind == RoundResult::Kind::kAborted);
  CHECK(ab.reason == "node x left second line");
  CHECK(decode_result("closed").kind == RoundResult::Kind::kClosed);
  CHECK_THROWS_AS(decode_result("complete 3\n1 a b 1"), RendezvousError);

  CHECK(parse_round_key("12").round == 12);
  CHECK(parse_round_key("closed").closed);
  CHECK_THROWS_AS(parse_round_key("-1"), RendezvousError);
}

TEST_CASE("the over log: the first record is the cause, our own loss is membership lost",
          "[decisions]") {
  std::string log = encode_over({RoundEvent::Kind::kWorkerFailed, "b", "local_rank 1 exited 3"}) +
                    "bogus line\n" + encode_over({RoundEvent::Kind::kNodeJoined, "z", ""});
  auto records = parse_over(log);
  REQUIRE(records.size() == 2);
  auto e = round_event(5, log, "a");
  CHECK(e.kind == RoundEvent::Kind::kWorkerFailed);
  CHECK(e.node_id == "b");
  CHECK(e.detail == "local_rank 1 exited 3");
  CHECK(e.describe() == "round 5 over: worker failure (node b): local_rank 1 exited 3");
  auto lost = round_event(2, encode_over({RoundEvent::Kind::kNodeLeft, "me", "lease"}), "me");
  CHECK(lost.kind == RoundEvent::Kind::kMembershipLost);
  auto other = round_event(2, encode_over({RoundEvent::Kind::kNodeLeft, "x", "lease"}), "me");
  CHECK(other.kind == RoundEvent::Kind::kNodeLeft);
}

TEST_CASE("a worker-failure record carries its failure time, and one without a time still parses",
          "[decisions][root-cause]") {
  OverRecord timed{RoundEvent::Kind::kWorkerFailed, "b", "rank 1 (local_rank 0) exited with 9"};
  timed.failed_at_ms = 1733470000123;
  const std::string line = encode_over(timed);
  CHECK(line == "failed b t=1733470000123 rank 1 (local_rank 0) exited with 9\n");
  // An older writer's record (no t=), a record with an empty detail, and a detail that only
  // looks like a time.
  OverRecord bare{RoundEvent::Kind::kWorkerFailed, "c", ""};
  bare.failed_at_ms = 5;
  const std::string log =
      line + "failed a rank 0 exited with 1\n" + encode_over(bare) + "failed d t=12x odd\n";
  auto records = parse_over(log);
  REQUIRE(records.size() == 4);
  CHECK(records[0].failed_at_ms == 1733470000123);
  CHECK(records[0].detail == "rank 1 (local_rank 0) exited with 9");
  CHECK(records[1].failed_at_ms == -1);
  CHECK(records[1].detail == "rank 0 exited with 1");
  CHECK(records[2].failed_at_ms == 5);
  CHECK(records[2].detail.empty());
  CHECK(records[3].failed_at_ms == -1);
  CHECK(records[3].detail == "t=12x odd");
  // The round's event shows the detail without the time.
  CHECK(round_event(3, log, "a").detail == "rank 1 (local_rank 0) exited with 9");
  // Other kinds never carry one.
  OverRecord left{RoundEvent::Kind::kNodeLeft, "x", "t=7 lease"};
  left.failed_at_ms = 7;
  CHECK(encode_over(left) == "left x t=7 lease\n");
  CHECK(parse_over(encode_over(left))[0].failed_at_ms == -1);
}

TEST_CASE("the root cause of a round is the earliest failure, not the first report",
          "[decisions][root-cause]") {
  auto rec = [](std::string node, int64_t at) {
    OverRecord r{RoundEvent::Kind::kWorkerFailed, std::move(node), "d"};
    r.failed_at_ms = at;
    return encode_over(r);
  };
  // a (exit 1 after its peer died) reported first; b (SIGKILL, 150 ms earlier) after it.
  const std::string log = rec("a", 1000) + encode_over({RoundEvent::Kind::kNodeLeft, "z", "x"}) +
                          rec("b", 850) + rec("c", 2000);
  auto reports = failure_reports(parse_over(log));
  REQUIRE(reports.size() == 3);
  CHECK(reports[0].node_id == "a");
  auto root = root_cause(reports);
  REQUIRE(root);
  CHECK(root->node_id == "b");
  CHECK(root->failed_at_ms == 850);
  // The first report wins a tie, and a report with a time wins over one without.
  CHECK(root_cause(failure_reports(parse_over(rec("a", 5) + rec("b", 5))))->node_id == "a");
  CHECK(root_cause(failure_reports(parse_over("failed a old\n" + rec("b", 9))))->node_id == "b");
  CHECK(root_cause(failure_reports(parse_over("failed a old\nfailed b old\n")))->node_id == "a");
  CHECK_FALSE(root_cause({}));
}

TEST_CASE("the waiting line shows joined/min/max and the join timeout, then the last call",
          "[decisions]") {
  // Below min_nodes: the join timeout, in whole seconds rounded up.
  CHECK(waiting_line(3, 1, 2, 4, std::nullopt, t0 + 600s, t0 + 1500ms) ==
        "waiting for nodes in round 3: 1 joined (min 2, max 4); join timeout in 599 s");
  // min_nodes reached: the last call's end, which the leader knows.
  CHECK(waiting_line(3, 2, 2, 4, t0 + 30s, t0 + 600s, t0 + 10s) ==
        "waiting for nodes in round 3: 2 joined (min 2, max 4); last call ends in 20 s");
  // Past a deadline it says 0, never a negative time.
  CHECK(waiting_line(0, 0, 1, 1, std::nullopt, t0, t0 + 5s) ==
        "waiting for nodes in round 0: 0 joined (min 1, max 1); join timeout in 0 s");
}

// --- quorum and failover (split-brain protection) ------------------------------------------

namespace {

// Round 4 of nodes a (store host, rank 0), b, c.
RoundResult round4() {
  return decode_result(encode_complete({node("a", 1, -1, -1, true), node("b", 2), node("c", 3)}));
}

}  // namespace

TEST_CASE("quorum: a majority of the previous round forms the next one, a minority never",
          "[decisions][quorum]") {
  const RoundResult prev = round4();
  // b and c without the store host: 2 of 3.
  auto q = check_quorum(prev, 4, {}, {node("b", 1, 4, 1), node("c", 2, 4, 2)});
  CHECK(q.ok);
  CHECK(q.present == 2);
  CHECK(q.electorate == 3);
  // The store host alone: 1 of 3, not enough even with the tie-break.
  q = check_quorum(prev, 4, {}, {node("a", 1, 4, 0, true)});
  CHECK_FALSE(q.ok);
  CHECK(q.needed == 2);
  // Newcomers (no previous round) and members of an older round do not count.
  q = check_quorum(prev, 4, {}, {node("a", 1, 4, 0, true), node("x", 2), node("b", 3, 2, 1)});
  CHECK_FALSE(q.ok);
  CHECK(q.present == 1);
}

TEST_CASE("quorum: half is enough only together with the previous round's store host",
          "[decisions][quorum]") {
  const RoundResult two =
      decode_result(encode_complete({node("a", 1, -1, -1, true), node("b", 2)}));
  CHECK(check_quorum(two, 7, {}, {node("a", 1, 7, 0, true)}).ok);  // b died: a carries on
  auto q = check_quorum(two, 7, {}, {node("b", 1, 7, 1, true)});   // a died: b hosts a new store
  CHECK_FALSE(q.ok);
  CHECK(q.needed == 2);
}

TEST_CASE("quorum: nodes that left on purpose leave the electorate", "[decisions][quorum]") {
  const RoundResult prev = round4();
  std::vector<OverRecord> over = {{RoundEvent::Kind::kNodeLeft, "b", "agent shut down"},
                                  {RoundEvent::Kind::kNodeLeft, "c", "agent shut down"}};
  auto q = check_quorum(prev, 4, over, {node("a", 1, 4, 0, true)});
  CHECK(q.ok);
  CHECK(q.electorate == 1);
  // A lapsed lease is not a planned leave.
  over = {
      {RoundEvent::Kind::kNodeLeft, "b", "connection to the store closed or keep-alives stopped"},
      {RoundEvent::Kind::kNodeLeft, "c", "agent shut down while joining"}};
  q = check_quorum(prev, 4, over, {node("a", 1, 4, 0, true)});
  CHECK(q.ok);  // electorate {a, b}: half with the store host
  CHECK(q.electorate == 2);
  CHECK(check_quorum(prev, 4, over, {node("b", 1, 4, 1)}).ok == false);  // b alone, no host
}

TEST_CASE("the leader holds a round that lacks a quorum until more nodes join",
          "[decisions][quorum]") {
  auto s = leader(1, 3);
  s.expected = 2;
  observe_joined(&s, 1, t0);
  s.hold_at = 1;
  auto a = decide_leader(s, t0 + 100s);  // past the last call: still held
  CHECK(a.kind == LeaderAction::Kind::kWaitForJoins);
  CHECK(a.target == 2);
  CHECK(a.until == s.join_deadline);
  observe_joined(&s, 2, t0 + 101s);
  CHECK(decide_leader(s, t0 + 101s).kind == LeaderAction::Kind::kComplete);
  s.joined = 1;
  CHECK(decide_leader(s, s.join_deadline).kind == LeaderAction::Kind::kTimeout);
}

TEST_CASE("a full round keeps the previous round's members ahead of a spare that joined first",
          "[decisions][quorum]") {
  // Round 7 was {a, b}; spare x took ticket 1 while it ran, a ticket 2, b (back late) ticket 3.
  const std::vector<NodeDesc> joined = {node("x", 1), node("a", 2, 7, 0, true), node("b", 3, 7, 1)};
  auto picked = pick_members(joined, 2, 7);
  REQUIRE(picked.size() == 2);
  CHECK(picked[0].id == "a");
  CHECK(picked[1].id == "b");
  const RoundResult two =
      decode_result(encode_complete({node("a", 1, -1, -1, true), node("b", 2)}));
  CHECK(check_quorum(two, 7, {}, picked).ok);
  // Room for all, or no quorum to keep: ticket order.
  CHECK(pick_members(joined, 3, 7).front().id == "x");
  CHECK(pick_members(joined, 2, -1).front().id == "x");
  CHECK(pick_members(joined, 2, -1).back().id == "a");
}

TEST_CASE("a leader held with more nodes than fit waits for another join instead of retrying",
          "[decisions][quorum]") {
  // Full (max 2) with 3 tickets whose every pick lacked a quorum: only a 4th node can change it.
  auto s = leader(1, 2);
  observe_joined(&s, 3, t0);
  s.hold_at = 3;
  auto a = decide_leader(s, t0 + 1s);
  CHECK(a.kind == LeaderAction::Kind::kWaitForJoins);
  CHECK(a.target == 4);
  observe_joined(&s, 4, t0 + 2s);
  CHECK(decide_leader(s, t0 + 2s).kind == LeaderAction::Kind::kComplete);
}

TEST_CASE("failover: candidates are the members without the lost store host, in rank order",
          "[decisions][failover]") {
  const RoundResult prev = round4();
  auto p = plan_failover(prev.members, 2);
  CHECK(p.possible);
  CHECK(p.lost_host_rank == 0);
  CHECK(p.candidates == std::vector<int>{1, 2});
  CHECK(p.quorum == 2);
  // Two nodes: the survivor alone is no majority of two.
  const RoundResult two =
      decode_result(encode_complete({node("a", 1, -1, -1, true), node("b", 2)}));
  p = plan_failover(two.members, 1);
  CHECK_FALSE(p.possible);
  CHECK_THAT(p.why_not, Catch::Contains("majority (2)"));
  // ... unless the host left on purpose: then the survivor is the whole electorate.
  p = plan_failover(two.members, 1, true);
  CHECK(p.possible);
  CHECK(p.quorum == 1);
  auto seed = failover_seed(Keys("job"), 3, two.members, "10.0.0.2:1", true);
  auto over = parse_over(seed[2].second);
  REQUIRE(over.size() == 1);
  CHECK(planned_leave(over[0]));
  CHECK(check_quorum(two, 3, over, {node("b", 1, 3, 1, true)}).ok);
  // An external store (no member hosted it) is left to whoever runs it.
  const RoundResult ext = decode_result(encode_complete({node("a", 1), node("b", 2)}));
  p = plan_failover(ext.members, 0);
  CHECK_FALSE(p.possible);
  CHECK(p.lost_host_rank == -1);
  CHECK_THAT(p.why_not, Catch::Contains("external store"));
}

TEST_CASE("failover: the new store starts where the lost one stopped", "[decisions][failover]") {
  const Keys keys("job");
  const RoundResult prev = round4();
  auto seed = failover_seed(keys, 4, prev.members, "10.0.0.2:29400");
  std::map<std::string, std::string> kv(seed.begin(), seed.end());
  CHECK(kv.at(keys.round()) == "5");
  CHECK(kv.at(keys.failover()) == "4 10.0.0.2:29400");
  RoundResult copy = decode_result(kv.at(keys.result(4)));
  REQUIRE(copy.kind == RoundResult::Kind::kComplete);
  CHECK(copy.members.to_vector().size() == 3);
  CHECK(store_host_rank(copy.members) == 0);
  auto over = parse_over(kv.at(keys.over(4)));
  REQUIRE(over.size() == 1);
  CHECK(over[0].kind == RoundEvent::Kind::kNodeLeft);
  CHECK(over[0].node_id == "a");
  CHECK_FALSE(planned_leave(over[0]));
  // The next round expects the two survivors and needs both of them.
  CHECK(expected_after(copy, over) == 2);
  CHECK(check_quorum(copy, 4, over, {node("b", 1, 4, 1, true), node("c", 2, 4, 2)}).ok);
  CHECK_FALSE(check_quorum(copy, 4, over, {node("b", 1, 4, 1, true)}).ok);
}

// --- large rounds: partial results (a few members and a rank map) ---------------------------

namespace {

std::string header_line(const std::string& record) { return record.substr(0, record.find('\n')); }

// A round of random make-up: tickets 1..n (+ `extra` beyond max_nodes), with a random mix of no
// hints, valid, conflicting and out-of-range hints, nodes of the latest and of older rounds (old
// ranks with holes: nodes that left), duplicate claims of one old rank, and maybe a store host.
struct RandomRound {
  std::vector<NodeDesc> joined;
  int max_nodes = 0;
  std::string what;  // the mix, for failure messages
};

RandomRound random_round(std::mt19937& rng, int n) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  auto coin = [&](double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; };
  const double p_hint = std::array<double, 5>{0.0, 0.0, 0.05, 0.5, 1.0}[pick(0, 4)];
  const double p_prev = std::array<double, 4>{0.0, 0.5, 0.9, 1.0}[pick(0, 3)];
  const bool conflicting = coin(0.4);   // hints from a narrow range: many claim one rank
  const bool out_of_range = coin(0.4);  // some hints beyond the world
  const bool dup_prev = coin(0.3);      // some nodes claim an old rank another node claims
  const bool older = coin(0.3);         // some nodes come from an older round than the latest
  const int64_t latest = pick(0, 5);
  const int extra = coin(0.3) ? pick(1, 5) : 0;
  const int total = n + extra;
  const int host = coin(0.5) ? pick(1, total) : 0;  // the store host's ticket, 0: none
  std::vector<int> old_ranks(total + pick(0, n / 4 + 1));
  std::iota(old_ranks.begin(), old_ranks.end(), 0);
  std::shuffle(old_ranks.begin(), old_ranks.end(), rng);
  std::vector<int> hints(total);
  std::iota(hints.begin(), hints.end(), 0);
  std::shuffle(hints.begin(), hints.end(), rng);

  RandomRound r;
  r.max_nodes = extra > 0 ? n : n + pick(0, 3);
  r.what = "n=" + std::to_string(n) + " extra=" + std::to_string(extra) +
           " max=" + std::to_string(r.max_nodes) + " p_hint=" + std::to_string(p_hint) +
           " p_prev=" + std::to_string(p_prev) + " conflicting=" + std::to_string(conflicting) +
           " out_of_range=" + std::to_string(out_of_range) +
           " dup_prev=" + std::to_string(dup_prev) + " older=" + std::to_string(older) +
           " latest=" + std::to_string(latest) + " host=" + std::to_string(host);
  for (int t = 1; t <= total; ++t) {
    NodeDesc d = node("n" + std::to_string(t), t);
    d.store_host = t == host;
    if (coin(p_prev)) {
      d.prev_round =
          older && latest > 0 && coin(0.2) ? pick(0, static_cast<int>(latest) - 1) : latest;
      d.prev_rank = old_ranks[t - 1];
      if (dup_prev && t > 1 && coin(0.1)) d.prev_rank = old_ranks[pick(0, t - 2)];
    }
    if (coin(p_hint)) {
      if (out_of_range && coin(0.2)) {
        d.rank_hint = total + pick(0, 100);
      } else if (conflicting) {
        d.rank_hint = pick(0, std::max(1, n / 10));
      } else {
        d.rank_hint = hints[t - 1];
      }
    }
    r.joined.push_back(d);
  }
  std::shuffle(r.joined.begin(), r.joined.end(), rng);  // arrival order is in the tickets only
  return r;
}

bool is_exception(const RoundResult& r, int64_t ticket) {
  for (auto& [t, rank] : r.exceptions) {
    if (t == ticket) return true;
  }
  return false;
}

// Every member of `ranked` (in rank order) finds its own rank in `result`, through rank_of and
// decide_after_result. Returns the first few mismatches.
std::vector<std::string> rank_mismatches(const RoundResult& result,
                                         const std::vector<NodeDesc>& ranked, int max_nodes) {
  std::vector<std::string> bad;
  for (size_t i = 0; i < ranked.size() && bad.size() < 5; ++i) {
    const NodeDesc& m = ranked[i];
    const int got = rank_of(result, m);
    const JoinOutcome o = decide_after_result(result, m, max_nodes);
    if (got != static_cast<int>(i) || o.kind != JoinOutcome::Kind::kRanked ||
        o.rank != static_cast<int>(i)) {
      bad.push_back(m.id + " (ticket " + std::to_string(m.ticket) + " hint " +
                    std::to_string(m.rank_hint) + " prev " + std::to_string(m.prev_round) + "/" +
                    std::to_string(m.prev_rank) + " host " + std::to_string(m.store_host) +
                    "): expected rank " + std::to_string(i) + ", rank_of " + std::to_string(got) +
                    ", decide_after_result rank " + std::to_string(o.rank));
    }
  }
  return bad;
}

}  // namespace

TEST_CASE("partial results: every member of a random large round finds its rank, others none",
          "[decisions][partial]") {
  for (uint32_t seed = 1; seed <= 300; ++seed) {
    std::mt19937 rng(seed);
    const int n = std::uniform_int_distribution<int>(9, 700)(rng);
    const int limit = seed % 2 ? 4 : 8;
    RandomRound round = random_round(rng, n);
    INFO("seed " << seed << ": " << round.what << " inline_limit=" << limit);
    const std::vector<NodeDesc> ranked = assign_group_ranks(round.joined, round.max_nodes);
    REQUIRE(ranked.size() == static_cast<size_t>(n));
    const std::string text = encode_complete(ranked, limit);
    INFO("header: " << header_line(text).substr(0, 300));
    const RoundResult r = decode_result(text);
    REQUIRE(r.kind == RoundResult::Kind::kComplete);
    CHECK(r.world_size == n);
    CHECK(r.partial());
    REQUIRE(r.members.size() == static_cast<size_t>(kListedMembers));
    for (int i = 0; i < kListedMembers; ++i) CHECK(r.members.field(i, 0) == ranked[i].id);
    auto bad = rank_mismatches(r, ranked, round.max_nodes);
    INFO("mismatches: " << bad.size() << (bad.empty() ? "" : ", first: " + bad[0]));
    CHECK(bad.empty());

    // Not members: tickets outside 1..n (the extra joiners beyond max_nodes among them), and a
    // member's ticket with a coordinate nobody has.
    NodeDesc outside = ranked[0];
    outside.ticket = 0;
    CHECK(rank_of(r, outside) == -1);
    outside.ticket = n + 1;
    CHECK(rank_of(r, outside) == -1);
    auto o = decide_after_result(r, outside, round.max_nodes);
    CHECK(o.kind == JoinOutcome::Kind::kNextRound);
    CHECK(o.announce_join == (n < round.max_nodes));
    for (auto& j : round.joined) {
      if (j.ticket > n) CHECK(rank_of(r, j) == -1);
    }
    for (auto& m : ranked) {
      if (is_exception(r, m.ticket)) continue;
      NodeDesc unknown = m;
      unknown.rank_hint = 1 << 29;  // ('h', 2^29): no member has that hint
      CHECK(rank_of(r, unknown) == -1);
      unknown.rank_hint = -1;
      unknown.prev_round = r.latest;
      unknown.prev_rank = 1 << 29;  // ('p', 2^29) when latest >= 0, else ('t', its ticket)
      if (r.latest >= 0) CHECK(rank_of(r, unknown) == -1);
      break;
    }

    // Written again, it reads the same (encode_result == text: the next test case).
    const std::string rewritten = encode_result(r);
    const RoundResult again = decode_result(rewritten);
    CHECK(again.world_size == n);
    CHECK(again.latest == r.latest);
    CHECK(again.members.size() == r.members.size());
    CHECK(encode_result(again) == rewritten);
    CHECK(rank_mismatches(again, ranked, round.max_nodes).empty());
  }
}

TEST_CASE("partial results: encode_result gives back the text a partial result was read from",
          "[decisions][partial]") {
  auto first_round = [](int n, int host) {
    std::vector<NodeDesc> joined;
    for (int t = 1; t <= n; ++t) {
      joined.push_back(node("n" + std::to_string(t), t, -1, -1, t == host));
    }
    return assign_group_ranks(joined, n);
  };
  SECTION("one run") {
    const std::string x = encode_complete(first_round(20, 0), 4);
    CHECK(header_line(x) == "complete 20 8 -1 t1=0+20");
    CHECK(encode_result(decode_result(x)) == x);
  }
  SECTION("runs out of rank order: the store host at ticket 5") {
    const std::string x = encode_complete(first_round(20, 5), 4);
    // Written in coordinate order (the order decode_result looks them up in).
    CHECK(header_line(x) == "complete 20 8 -1 t1=1+4 t5=0+1 t6=5+15");
    CHECK(encode_result(decode_result(x)) == x);
  }
  SECTION("hints, survivors, newcomers and exceptions") {
    std::vector<NodeDesc> joined;
    for (int t = 1; t <= 30; ++t) {
      // tickets 1-3 claim old rank 0 (exceptions), 4-20 survivors, 21-25 newcomers, 26-30 hinted
      joined.push_back(node("n" + std::to_string(t), t, t <= 20 ? 6 : -1, t <= 3 ? 0 : 40 - t,
                            false, t > 25 ? t - 26 : -1));
    }
    const std::string x = encode_complete(assign_group_ranks(joined, 30), 8);
    INFO(header_line(x));
    CHECK(encode_result(decode_result(x)) == x);
  }
}

TEST_CASE("partial results: a first round without hints is at most 3 runs and no exceptions",
          "[decisions][partial]") {
  for (int n : {9, 1000, 100000}) {
    for (int host : {0, 1, 2, n / 2, n}) {  // the store host's ticket, 0: none
      INFO("n " << n << ", store host at ticket " << host);
      std::vector<NodeDesc> joined;
      for (int t = 1; t <= n; ++t)
        joined.push_back(node("n" + std::to_string(t), t, -1, -1, t == host));
      auto ranked = assign_group_ranks(joined, n);
      const std::string text = encode_complete(ranked, 8);
      INFO("header: " << header_line(text));
      auto r = decode_result(text);
      REQUIRE(r.partial());
      CHECK(r.runs.size() <= 3);
      CHECK(r.exceptions.empty());
      CHECK(header_line(text).size() < 200);
      CHECK(rank_mismatches(r, ranked, n).empty());
    }
  }
}

TEST_CASE("partial results: the round after one node left is 2 or 3 runs", "[decisions][partial]") {
  std::mt19937 rng(7);
  for (int n : {1000, 100000}) {
    for (int gone : {0, 1, n / 3, n - 1}) {  // the old rank of the node that left
      for (bool host : {false, true}) {      // old rank 0 hosts the store
        INFO("n " << n << ", old rank " << gone << " left, host " << host);
        std::vector<int> order;  // arrival order of the survivors: random
        for (int old = 0; old < n; ++old) {
          if (old != gone) order.push_back(old);
        }
        std::shuffle(order.begin(), order.end(), rng);
        std::vector<NodeDesc> joined;
        for (size_t i = 0; i < order.size(); ++i) {
          const int old = order[i];
          joined.push_back(node("n" + std::to_string(old), static_cast<int64_t>(i) + 1, 41, old,
                                host && old == 0));
        }
        auto ranked = assign_group_ranks(joined, n);
        REQUIRE(ranked.size() == static_cast<size_t>(n - 1));
        const std::string text = encode_complete(ranked, kInlineMembers);
        INFO("header: " << header_line(text));
        auto r = decode_result(text);
        REQUIRE(r.partial());
        CHECK(r.latest == 41);
        CHECK(r.runs.size() <= 3);
        CHECK(r.exceptions.empty());
        CHECK(header_line(text).size() < 200);
        CHECK(rank_mismatches(r, ranked, n).empty());
        // The survivors keep their relative order.
        for (size_t i = 1; i < ranked.size(); ++i) {
          if (ranked[i - 1].prev_rank > ranked[i].prev_rank) FAIL_CHECK("order changed at " << i);
        }
      }
    }
  }
}

TEST_CASE("partial results: a round hinted 0..N-1 is one run", "[decisions][partial]") {
  std::mt19937 rng(11);
  for (int n : {9, 1000, 100000}) {
    INFO("n " << n);
    std::vector<int> hints(n);
    std::iota(hints.begin(), hints.end(), 0);
    std::shuffle(hints.begin(), hints.end(), rng);
    std::vector<NodeDesc> joined;
    for (int t = 1; t <= n; ++t) {
      // The store host hints 0 (as a host given --node-rank=0 does).
      const int hint = hints[t - 1];
      joined.push_back(node("n" + std::to_string(t), t, 3, t - 1, hint == 0, hint));
    }
    auto ranked = assign_group_ranks(joined, n);
    const std::string text = encode_complete(ranked, 8);
    INFO("header: " << header_line(text));
    auto r = decode_result(text);
    REQUIRE(r.partial());
    REQUIRE(r.runs.size() == 1);
    CHECK(r.runs[0].cls == 'h');
    CHECK(r.runs[0].first == 0);
    CHECK(r.runs[0].rank == 0);
    CHECK(r.runs[0].count == n);
    CHECK(r.exceptions.empty());
    CHECK(header_line(text).size() < 100);
    CHECK(rank_mismatches(r, ranked, n).empty());
  }
}

TEST_CASE("partial results: rounds up to the inline limit (or 8) keep the whole list",
          "[decisions][partial]") {
  std::mt19937 rng(3);
  for (auto [n, limit] :
       {std::pair{4, 4}, {8, 4}, {6, 5}, {9, 9}, {20, 20}, {256, kInlineMembers}}) {
    INFO("n " << n << ", inline_limit " << limit);
    std::vector<NodeDesc> joined;
    for (int t = 1; t <= n; ++t) {
      joined.push_back(node("n" + std::to_string(t), t, t % 2 ? 2 : -1, n - t, t == 2));
    }
    std::shuffle(joined.begin(), joined.end(), rng);
    auto ranked = assign_group_ranks(joined, n);
    const std::string text = encode_complete(ranked, limit);
    CHECK(header_line(text) == "complete " + std::to_string(n));
    auto r = decode_result(text);
    CHECK_FALSE(r.partial());
    CHECK(r.world_size == n);
    REQUIRE(r.members.size() == static_cast<size_t>(n));
    CHECK(r.runs.empty());
    CHECK(r.exceptions.empty());
    for (int i = 0; i < n; ++i) {
      NodeDesc by_id;  // a whole list is read by id alone
      by_id.id = ranked[i].id;
      CHECK(rank_of(r, by_id) == i);
      CHECK(decide_after_result(r, ranked[i].id, n).rank == i);
    }
    NodeDesc stranger;
    stranger.id = "stranger";
    stranger.ticket = 1;
    CHECK(rank_of(r, stranger) == -1);
    CHECK(encode_result(r) == text);
  }
  // The default limit: 257 members are partial.
  std::vector<NodeDesc> joined;
  for (int t = 1; t <= kInlineMembers + 1; ++t) joined.push_back(node("n" + std::to_string(t), t));
  CHECK(decode_result(encode_complete(assign_group_ranks(joined, 1000))).partial());
}

TEST_CASE("partial results: malformed headers are rejected", "[decisions][partial]") {
  std::vector<NodeDesc> joined;
  for (int t = 1; t <= 20; ++t) joined.push_back(node("n" + std::to_string(t), t));
  const std::string good = encode_complete(assign_group_ranks(joined, 20), 4);
  REQUIRE(header_line(good) == "complete 20 8 -1 t1=0+20");
  const std::string lines = good.substr(good.find('\n'));  // "\n" + the 8 member lines
  CHECK(decode_result("complete 20 8 -1 t1=0+20" + lines).partial());
  CHECK(decode_result("complete 20 8 4 h3=0+1 p0=1+9 t1=10+10 x5=19" + lines).partial());
  for (const char* header : {
           // a bad run token
           "complete 20 8 -1 q1=0+20",
           "complete 20 8 -1 t1=0",
           "complete 20 8 -1 t1=0+0",
           "complete 20 8 -1 t1=0+-1",
           "complete 20 8 -1 t=0+20",
           "complete 20 8 -1 ta=0+20",
           "complete 20 8 -1 t1=0+20x",
           "complete 20 8 -1 t1+0=20",
           "complete 20 8 -1 t1",
           "complete 20 8 -1 x1",
           "complete 20 8 -1 x1=a",
           "complete 20 8 -1 t1=0+20 ",
           // a rank out of range
           "complete 20 8 -1 t1=5+16",
           "complete 20 8 -1 t1=-1+20",
           "complete 20 8 -1 t1=20+1",
           "complete 20 8 -1 t1=0+20 x3=20",
           "complete 20 8 -1 t1=0+20 x3=-1",
           // K >= N, or no K
           "complete 20 20 -1 t1=0+20",
           "complete 20 21 -1 t1=0+20",
           "complete 20 0 -1 t1=0+20",
           "complete 20 x -1 t1=0+20",
           // no L
           "complete 20 8",
           "complete 20 8 ",
           "complete 20 8 x t1=0+20",
       }) {
    INFO(header);
    CHECK_THROWS_AS(decode_result(header + lines), RendezvousError);
  }
  // K says 8, the text holds 7 or 9 member lines.
  const std::string seven = lines.substr(0, lines.rfind('\n'));
  CHECK_THROWS_AS(decode_result("complete 20 8 -1 t1=0+20" + seven), RendezvousError);
  CHECK_THROWS_AS(decode_result("complete 20 8 -1 t1=0+20" + lines + "\nz 10.0.0.9 9 1 0"),
                  RendezvousError);
  CHECK_THROWS_WITH(decode_result(std::string("complete 20 8 -1 q1=0+20") + lines),
                    Catch::Contains("q1=0+20"));
}

TEST_CASE("partial results: membership is ticket 1..N, a non-dense list is written whole",
          "[decisions][partial]") {
  std::vector<NodeDesc> members;
  for (int t = 1; t <= 20; ++t) members.push_back(node("n" + std::to_string(t), t == 20 ? 25 : t));
  auto r = decode_result(encode_complete(members, 4));
  CHECK_FALSE(r.partial());
  CHECK(r.members.size() == 20);
  NodeDesc last;
  last.id = "n20";
  last.ticket = 25;
  CHECK(rank_of(r, last) == 19);
}
