// The dynamic rendezvous decisions as pure functions: a fake clock (plain time points), no store,
// no sockets.
#include "rendezvous/dynamic_decisions.h"

#include <catch2/catch.hpp>
#include <map>

using namespace trun::rendezvous;
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
  auto r = assign_ranks({node("a", 1), node("b", 2), node("host", 3, -1, -1, true)}, 8);
  CHECK(ids(r) == std::vector<std::string>{"host", "a", "b"});
}

TEST_CASE("ranks: survivors keep their relative order, newcomers follow by ticket",
          "[decisions][ranks]") {
  // Round 4 had c(0) a(1) b(2); b died; d and e are new. Tickets are arrival order.
  auto r = assign_ranks({node("e", 1), node("a", 2, 4, 1), node("d", 3), node("c", 4, 4, 0)}, 8);
  CHECK(ids(r) == std::vector<std::string>{"c", "a", "e", "d"});
}

TEST_CASE("ranks: only the latest previous round counts as survivors", "[decisions][ranks]") {
  auto r = assign_ranks({node("old", 1, 2, 0), node("x", 2, 5, 1), node("y", 3, 5, 0)}, 8);
  CHECK(ids(r) == std::vector<std::string>{"y", "x", "old"});
}

TEST_CASE("ranks: hints are honoured when free and inside the world", "[decisions][ranks]") {
  auto r = assign_ranks({node("a", 1, -1, -1, false, 2), node("b", 2, -1, -1, false, 0),
                         node("c", 3, -1, -1, false, 2),   // conflict: a has the lower ticket
                         node("d", 4, -1, -1, false, 9)},  // outside the world: ignored
                        8);
  CHECK(ids(r) == std::vector<std::string>{"b", "c", "a", "d"});
  // The host's rank 0 wins over a hint for 0.
  auto h = assign_ranks({node("a", 1, -1, -1, false, 0), node("host", 2, -1, -1, true)}, 8);
  CHECK(ids(h) == std::vector<std::string>{"host", "a"});
}

TEST_CASE("ranks: at most max_nodes, lowest tickets first", "[decisions][ranks]") {
  auto r = assign_ranks({node("d", 4), node("b", 2), node("a", 1), node("c", 3)}, 3);
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
