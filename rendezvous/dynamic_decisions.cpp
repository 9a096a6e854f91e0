#include "rendezvous/dynamic_decisions.h"

#include <algorithm>
#include <map>

#include "base/check.h"
#include "base/decimal.h"

namespace trun::rendezvous {

const char* to_string(RoundEvent::Kind kind) {
  switch (kind) {
    case RoundEvent::Kind::kWorkerFailed:
      return "worker failure";
    case RoundEvent::Kind::kNodeJoined:
      return "node joined";
    case RoundEvent::Kind::kNodeLeft:
      return "node left";
    case RoundEvent::Kind::kRestart:
      return "restart requested";
    case RoundEvent::Kind::kClosed:
      return "rendezvous closed";
    case RoundEvent::Kind::kMembershipLost:
      return "this node was declared dead";
    case RoundEvent::Kind::kStoreLost:
      return "store lost";
    case RoundEvent::Kind::kShutdown:
      return "shut down";
  }
  return "?";
}

std::string RoundEvent::describe() const {
  std::string s = "round " + std::to_string(round) + " over: " + to_string(kind);
  if (!node_id.empty()) s += " (node " + node_id + ")";
  if (!detail.empty()) s += ": " + detail;
  return s;
}

std::optional<FailureReport> root_cause(const std::vector<FailureReport>& reports) {
  const FailureReport* best = nullptr;
  for (const auto& r : reports) {
    if (!best) {
      best = &r;
    } else if (r.failed_at_ms >= 0 &&
               (best->failed_at_ms < 0 || r.failed_at_ms < best->failed_at_ms)) {
      best = &r;
    }
  }
  if (!best) return std::nullopt;
  return *best;
}

ParticipantList::ParticipantList(const std::vector<Participant>& list) {
  auto text = std::make_shared<std::string>();
  for (auto& p : list) {
    starts_.push_back(static_cast<uint32_t>(text->size()));
    *text += p.node_id + " " + p.addr + "\n";
  }
  text_ = std::move(text);
}

ParticipantList::ParticipantList(std::shared_ptr<const std::string> text, size_t begin,
                                 size_t count)
    : text_(std::move(text)) {
  starts_.reserve(count);
  size_t pos = begin;
  const std::string& t = *text_;
  while (pos < t.size() && starts_.size() < count) {
    starts_.push_back(static_cast<uint32_t>(pos));
    size_t nl = t.find('\n', pos);
    if (nl == std::string::npos) {
      pos = t.size();
      break;
    }
    pos = nl + 1;
  }
  if (starts_.size() != count || pos < t.size()) {
    throw RendezvousError("rendezvous: participant list holds " + std::to_string(starts_.size()) +
                          " entries (or more text), expected " + std::to_string(count));
  }
}

std::string_view ParticipantList::line(size_t rank) const {
  if (rank >= starts_.size()) {
    throw std::out_of_range("participant " + std::to_string(rank) + " of " +
                            std::to_string(starts_.size()));
  }
  std::string_view t(*text_);
  size_t b = starts_[rank];
  size_t e = t.find('\n', b);
  return t.substr(b, e == std::string_view::npos ? std::string_view::npos : e - b);
}

std::string_view ParticipantList::field(size_t rank, int f) const {
  std::string_view l = line(rank);
  for (int i = 0; i < f; ++i) {
    size_t sp = l.find(' ');
    if (sp == std::string_view::npos) return {};
    l.remove_prefix(sp + 1);
  }
  return l.substr(0, l.find(' '));
}

Participant ParticipantList::at(size_t rank) const {
  return {std::string(field(rank, 0)), std::string(field(rank, 1))};
}

int ParticipantList::find(std::string_view node_id) const {
  for (size_t i = 0; i < starts_.size(); ++i) {
    if (field(i, 0) == node_id) return static_cast<int>(i);
  }
  return -1;
}

std::vector<Participant> ParticipantList::to_vector() const {
  std::vector<Participant> out;
  for (size_t i = 0; i < size(); ++i) out.push_back(at(i));
  return out;
}

namespace dynamic {
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

}  // namespace dynamic
}  // namespace trun::rendezvous
