// The dynamic protocol's record formats (dynamic_decisions.h): the round store prefix, node
// records, round results and their rank map (rank_of), the round key and the over-log
// (encode_over, parse_over, failure_reports, round_event). The decisions over them are in
// dynamic_decisions.cpp, quorum and store failover in dynamic_failover.cpp.
#include "rendezvous/dynamic_decisions.h"

#include <algorithm>
#include <limits>
#include <map>
#include <memory>

#include "base/decimal.h"

namespace trun::rendezvous::dynamic {
namespace {

using base::parse_decimal;

// Splits on single spaces; `max_fields` > 0 keeps the rest of the line in the last field.
std::vector<std::string_view> split(std::string_view s, char sep, size_t max_fields = 0) {
  std::vector<std::string_view> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    if (max_fields && out.size() + 1 == max_fields) {
      out.push_back(s.substr(pos));
      break;
    }
    size_t next = s.find(sep, pos);
    if (next == std::string_view::npos) next = s.size();
    out.push_back(s.substr(pos, next - pos));
    pos = next + 1;
  }
  return out;
}

struct KindName {
  RoundEvent::Kind kind;
  const char* name;
};
constexpr KindName kOverKinds[] = {
    {RoundEvent::Kind::kWorkerFailed, "failed"}, {RoundEvent::Kind::kNodeJoined, "joined"},
    {RoundEvent::Kind::kNodeLeft, "left"},       {RoundEvent::Kind::kRestart, "restart"},
    {RoundEvent::Kind::kClosed, "closed"},
};

std::string one_line(std::string s) {
  for (char& c : s) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return s;
}

}  // namespace

std::string round_store_prefix(const std::string& run_id, int64_t round) {
  return "trun/run/" + run_id + "/" + std::to_string(round);
}

std::string encode_node(const NodeDesc& n) {
  return n.id + " " + n.addr + " " + (n.store_host ? "1" : "0") + " " +
         std::to_string(n.rank_hint) + " " + std::to_string(n.prev_round) + " " +
         std::to_string(n.prev_rank) + " " + std::to_string(n.master_port);
}

NodeDesc decode_node(std::string_view text, int64_t ticket) {
  auto f = split(text, ' ');
  NodeDesc n;
  n.ticket = ticket;
  int host = 0;
  if (f.size() != 7 || f[0].empty() || f[1].empty() || !parse_decimal(f[2], &host) ||
      !parse_decimal(f[3], &n.rank_hint) || !parse_decimal(f[4], &n.prev_round) ||
      !parse_decimal(f[5], &n.prev_rank) || !parse_decimal(f[6], &n.master_port)) {
    throw RendezvousError("rendezvous: malformed node record for ticket " + std::to_string(ticket) +
                          ": '" + std::string(text.substr(0, 200)) + "'");
  }
  n.id = std::string(f[0]);
  n.addr = std::string(f[1]);
  n.store_host = host != 0;
  return n;
}

namespace {

std::string member_line(const NodeDesc& m) {
  return m.id + " " + m.addr + " " + std::to_string(m.ticket) + " " +
         std::to_string(m.master_port) + (m.store_host ? " 1" : " 0");
}

// A member's coordinate in a partial result's rank map (rank_of).
std::pair<char, int64_t> coordinate(const NodeDesc& m, int64_t latest) {
  if (m.rank_hint >= 0) return {'h', m.rank_hint};
  if (latest >= 0 && m.prev_round == latest) return {'p', m.prev_rank};
  return {'t', m.ticket};
}

// "complete N" for a whole list; "complete N K L <runs> <exceptions>" for a partial one.
std::string encode_header(const RoundResult& r, size_t listed) {
  std::string s = "complete " + std::to_string(r.world_size);
  if (static_cast<int>(listed) == r.world_size) return s;
  s += " " + std::to_string(listed) + " " + std::to_string(r.latest);
  for (auto& run : r.runs) {
    s += " ";
    s += run.cls;
    s += std::to_string(run.first) + "=" + std::to_string(run.rank) + "+" +
         std::to_string(run.count);
  }
  for (auto& [ticket, rank] : r.exceptions) {
    s += " x" + std::to_string(ticket) + "=" + std::to_string(rank);
  }
  return s;
}

}  // namespace

std::string encode_complete(const std::vector<NodeDesc>& members, int inline_limit) {
  const int n = static_cast<int>(members.size());
  // Membership in a partial result is "ticket in 1..N" (the leader ranks the first N tickets);
  // anything else is written whole.
  bool dense = true;
  {
    std::vector<bool> seen(n + 1, false);
    for (auto& m : members) {
      if (m.ticket < 1 || m.ticket > n || seen[m.ticket]) dense = false;
      if (dense) seen[m.ticket] = true;
    }
  }
  RoundResult r;
  r.kind = RoundResult::Kind::kComplete;
  r.world_size = n;
  size_t listed = static_cast<size_t>(n);
  if (n > inline_limit && dense) {
    listed = static_cast<size_t>(std::min(n, kListedMembers));
    for (auto& m : members) r.latest = std::max(r.latest, m.prev_round);
    std::map<std::pair<char, int64_t>, int> uses;
    for (auto& m : members) ++uses[coordinate(m, r.latest)];
    for (int rank = 0; rank < n; ++rank) {
      const NodeDesc& m = members[rank];
      auto c = coordinate(m, r.latest);
      if (uses[c] > 1) {  // two members claim one coordinate: list them by ticket
        r.exceptions.emplace_back(m.ticket, rank);
        continue;
      }
      if (!r.runs.empty()) {
        RankRun& last = r.runs.back();
        if (last.cls == c.first && last.first + last.count == c.second &&
            last.rank + last.count == rank) {
          ++last.count;
          continue;
        }
      }
      r.runs.push_back({c.first, c.second, rank, 1});
    }
    std::sort(r.exceptions.begin(), r.exceptions.end());
    // In the order decode_result keeps them (for its lookups), so that a result re-encodes as
    // written.
    std::sort(r.runs.begin(), r.runs.end(), [](const RankRun& a, const RankRun& b) {
      return std::make_pair(a.cls, a.first) < std::make_pair(b.cls, b.first);
    });
  }
  std::string s = encode_header(r, listed);
  for (size_t i = 0; i < listed; ++i) s += "\n" + member_line(members[i]);
  return s;
}

std::string encode_result(const RoundResult& r) {
  switch (r.kind) {
    case RoundResult::Kind::kClosed:
      return "closed";
    case RoundResult::Kind::kAborted:
      return abort_record(r.reason);
    case RoundResult::Kind::kComplete:
      break;
  }
  RoundResult header = r;
  if (header.world_size < static_cast<int>(r.members.size())) {
    header.world_size = static_cast<int>(r.members.size());
  }
  std::string s = encode_header(header, r.members.size());
  for (size_t i = 0; i < r.members.size(); ++i) {
    NodeDesc m;
    m.id = std::string(r.members.field(i, 0));
    m.addr = std::string(r.members.field(i, 1));
    parse_decimal(r.members.field(i, 2), &m.ticket);
    parse_decimal(r.members.field(i, 3), &m.master_port);
    m.store_host = r.members.field(i, 4) == "1";
    s += "\n" + member_line(m);
  }
  return s;
}

std::string abort_record(const std::string& reason) { return "aborted " + one_line(reason); }

RoundResult decode_result(std::string_view text) {
  RoundResult r;
  auto bad = [&](const char* why) {
    return RendezvousError(std::string("rendezvous: malformed round result (") + why + "): '" +
                           std::string(text.substr(0, 200)) + "'");
  };
  if (text == "closed") {
    r.kind = RoundResult::Kind::kClosed;
    return r;
  }
  if (text.rfind("aborted", 0) == 0) {
    r.kind = RoundResult::Kind::kAborted;
    r.reason = std::string(text.size() > 8 ? text.substr(8) : std::string_view());
    return r;
  }
  if (text.rfind("complete ", 0) != 0) throw bad("unknown kind");
  size_t nl = text.find('\n');
  if (nl == std::string_view::npos) throw bad("member count");
  auto head = split(text.substr(0, nl), ' ');
  size_t n = 0;
  if (!parse_decimal(head[1], &n) || n == 0 || n > (1u << 30)) throw bad("member count");
  size_t listed = n;
  r.kind = RoundResult::Kind::kComplete;
  r.world_size = static_cast<int>(n);
  if (head.size() > 2) {  // partial: K L <runs> <exceptions>
    if (head.size() < 4 || !parse_decimal(head[2], &listed) || listed == 0 || listed >= n ||
        !parse_decimal(head[3], &r.latest)) {
      throw bad("partial header");
    }
    for (size_t i = 4; i < head.size(); ++i) {
      std::string_view tok = head[i];
      size_t eq = tok.find('=');
      if (tok.size() < 4 || eq == std::string_view::npos) throw bad("rank map");
      const char cls = tok[0];
      int64_t first = 0;
      if (!parse_decimal(tok.substr(1, eq - 1), &first)) throw bad("rank map");
      std::string_view rest = tok.substr(eq + 1);
      if (cls == 'x') {
        int rank = 0;
        if (!parse_decimal(rest, &rank) || rank < 0 || rank >= r.world_size) throw bad("rank map");
        r.exceptions.emplace_back(first, rank);
        continue;
      }
      size_t plus = rest.find('+');
      RankRun run{cls, first, 0, 0};
      if ((cls != 'h' && cls != 'p' && cls != 't') || plus == std::string_view::npos ||
          !parse_decimal(rest.substr(0, plus), &run.rank) ||
          !parse_decimal(rest.substr(plus + 1), &run.count) || run.count < 1 || run.rank < 0 ||
          run.rank + run.count > r.world_size) {
        throw bad("rank map");
      }
      r.runs.push_back(run);
    }
    std::sort(r.exceptions.begin(), r.exceptions.end());
    std::sort(r.runs.begin(), r.runs.end(), [](const RankRun& a, const RankRun& b) {
      return std::make_pair(a.cls, a.first) < std::make_pair(b.cls, b.first);
    });
  }
  try {
    r.members = ParticipantList(std::make_shared<const std::string>(text), nl + 1, listed);
  } catch (const RendezvousError&) {
    throw bad("member count");
  }
  for (size_t i = 0; i < listed; i += std::max<size_t>(1, listed - 1)) {  // first and last
    int64_t ticket = 0;
    uint16_t port = 0;
    if (r.members.field(i, 1).empty() || !parse_decimal(r.members.field(i, 2), &ticket) ||
        !parse_decimal(r.members.field(i, 3), &port)) {
      throw bad("member line");
    }
  }
  return r;
}

int rank_of(const RoundResult& r, const NodeDesc& me) {
  if (r.kind != RoundResult::Kind::kComplete) return -1;
  if (!r.partial()) return r.members.find(me.id);
  if (me.ticket < 1 || me.ticket > r.world_size) return -1;
  auto x = std::lower_bound(r.exceptions.begin(), r.exceptions.end(),
                            std::make_pair(me.ticket, std::numeric_limits<int>::min()));
  if (x != r.exceptions.end() && x->first == me.ticket) return x->second;
  auto c = coordinate(me, r.latest);
  // The last run starting at or before the coordinate.
  auto it = std::upper_bound(r.runs.begin(), r.runs.end(), c, [](auto& v, const RankRun& run) {
    return v < std::make_pair(run.cls, run.first);
  });
  if (it == r.runs.begin()) return -1;
  --it;
  if (it->cls != c.first || c.second >= it->first + it->count) return -1;
  return static_cast<int>(it->rank + (c.second - it->first));
}

RoundKey parse_round_key(std::string_view text) {
  RoundKey k;
  if (text == "closed") {
    k.closed = true;
    return k;
  }
  if (!parse_decimal(text, &k.round) || k.round < 0) {
    throw RendezvousError("rendezvous: malformed round key '" + std::string(text.substr(0, 100)) +
                          "'");
  }
  return k;
}

std::string encode_over(const OverRecord& r) {
  const char* name = "restart";
  for (auto& k : kOverKinds) {
    if (k.kind == r.kind) name = k.name;
  }
  std::string detail = one_line(r.detail);
  if (r.kind == RoundEvent::Kind::kWorkerFailed && r.failed_at_ms >= 0) {
    detail = "t=" + std::to_string(r.failed_at_ms) + (detail.empty() ? "" : " " + detail);
  }
  return std::string(name) + " " + (r.node_id.empty() ? "-" : r.node_id) + " " + detail + "\n";
}

namespace {

// "t=<ms>" at the start of a worker-failure record's detail (encode_over): moves the time into
// the record. A detail without it (an older writer) stays as it is.
void take_failure_time(OverRecord* r) {
  const std::string& d = r->detail;
  if (d.size() < 3 || d.compare(0, 2, "t=") != 0) return;
  const size_t end = std::min(d.find(' '), d.size());
  int64_t ms = 0;
  if (!parse_decimal(std::string_view(d).substr(2, end - 2), &ms) || ms < 0) return;
  r->failed_at_ms = ms;
  r->detail = end < d.size() ? d.substr(end + 1) : std::string();
}

}  // namespace

std::vector<OverRecord> parse_over(std::string_view log) {
  std::vector<OverRecord> out;
  for (auto line : split(log, '\n')) {
    if (line.empty()) continue;
    auto f = split(line, ' ', 3);
    if (f.size() < 2) continue;
    const KindName* kind = nullptr;
    for (auto& k : kOverKinds) {
      if (f[0] == k.name) kind = &k;
    }
    if (!kind) continue;
    OverRecord r;
    r.kind = kind->kind;
    r.node_id = f[1] == "-" ? std::string() : std::string(f[1]);
    if (f.size() == 3) r.detail = std::string(f[2]);
    if (r.kind == RoundEvent::Kind::kWorkerFailed) take_failure_time(&r);
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<FailureReport> failure_reports(const std::vector<OverRecord>& records) {
  std::vector<FailureReport> out;
  for (const auto& r : records) {
    if (r.kind == RoundEvent::Kind::kWorkerFailed) {
      out.push_back({r.node_id, r.detail, r.failed_at_ms});
    }
  }
  return out;
}

std::string stopped_key(const std::string& over_key) { return over_key + "/stopped"; }

RoundEvent round_event(int64_t round, std::string_view log, const std::string& my_id) {
  RoundEvent e;
  e.round = round;
  auto records = parse_over(log);
  if (records.empty()) {
    e.kind = RoundEvent::Kind::kRestart;
    e.detail = "unreadable round-over record '" + one_line(std::string(log.substr(0, 100))) + "'";
    return e;
  }
  e.kind = records[0].kind;
  e.node_id = records[0].node_id;
  e.detail = records[0].detail;
  if (e.kind == RoundEvent::Kind::kNodeLeft && e.node_id == my_id) {
    e.kind = RoundEvent::Kind::kMembershipLost;
  }
  return e;
}

}  // namespace trun::rendezvous::dynamic
