// Hang detection's rules (hang_rules.h): the timeout rule and the wavefront verdict.

#include "agent/hang_rules.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <set>
#include <utility>

#include "base/rank_list.h"

namespace trun::agent::hang {

const CollectiveRecord* GroupProgress::find(uint64_t seq) const {
  for (const auto& c : recent)
    if (c.seq == seq) return &c;
  return nullptr;
}

std::string GroupProgress::name() const {
  if (number >= 0) return "group " + std::to_string(number);
  char buf[32];
  std::snprintf(buf, sizeof buf, "group %016" PRIx64, key);
  return buf;
}

const GroupProgress* RankProgress::waiting_group() const {
  for (const auto& g : groups)
    if (g.issued > g.completed) return &g;
  return nullptr;
}

std::string TimeoutClass::name() const {
  switch (kind) {
    case kStartup:
      return "startup";
    case kCheckpoint:
      return "checkpoint";
    case kSection:
      return "section " + section;
    default:
      return "step";
  }
}

TimeoutClass class_of(const RankProgress& r) {
  TimeoutClass c;
  if (r.starting)
    c.kind = TimeoutClass::kStartup;
  else if (r.phase == Phase::kCheckpointSave)
    c.kind = TimeoutClass::kCheckpoint;
  else if (r.phase == Phase::kSection) {
    c.kind = TimeoutClass::kSection;
    c.section = r.section;
  }
  return c;
}

// ---- TimeoutRule ------------------------------------------------------------------------------

TimeoutRule::TimeoutRule(TimeoutOptions options) : options_(std::move(options)) {}

const ClassPolicy& TimeoutRule::policy(const TimeoutClass& c) const {
  switch (c.kind) {
    case TimeoutClass::kStartup:
      return options_.startup;
    case TimeoutClass::kCheckpoint:
      return options_.checkpoint;
    case TimeoutClass::kSection: {
      auto it = options_.sections.find(c.section);
      return it != options_.sections.end() ? it->second : options_.section;
    }
    default:
      return options_.step;
  }
}

void TimeoutRule::observe(const TimeoutClass& c, double seconds) {
  if (!(seconds >= 0)) return;  // NaN or negative: a clock that went back is not an interval
  Learned& l = learned_[c];
  if (l.intervals >= policy(c).warmup_intervals) l.longest_s = std::max(l.longest_s, seconds);
  ++l.intervals;
}

void TimeoutRule::update(const std::vector<RankProgress>& ranks) {
  for (const auto& r : ranks) {
    if (!r.attached) continue;
    auto it = last_.find(r.rank);
    if (it != last_.end() && it->second.pid == r.pid && r.heartbeat != it->second.heartbeat &&
        r.last_progress_ns > it->second.last_progress_ns)
      observe(it->second.cls,
              static_cast<double>(r.last_progress_ns - it->second.last_progress_ns) / 1e9);
    last_[r.rank] = Last{r.pid, r.heartbeat, r.last_progress_ns, class_of(r)};
  }
}

std::optional<double> TimeoutRule::timeout_s(const TimeoutClass& c) const {
  const ClassPolicy& p = policy(c);
  if (!options_.enabled || !p.enabled) return std::nullopt;
  if (p.fixed_s > 0) return p.fixed_s;
  auto it = learned_.find(c);
  const Learned l = it == learned_.end() ? Learned{} : it->second;
  if (l.intervals < p.warmup_intervals) return p.warmup_timeout_s;
  return std::max(p.floor_s, p.factor * l.longest_s);
}

void TimeoutRule::adopt(const TimeoutClass& c, const Learned& other) {
  if (other.intervals <= 0 || !(other.longest_s >= 0)) return;
  learned_[c].merge(other);
}

TimeoutRule::Learned TimeoutRule::learned(const TimeoutClass& c) const {
  auto it = learned_.find(c);
  return it == learned_.end() ? Learned{} : it->second;
}

// ---- The verdict ------------------------------------------------------------------------------

std::string format_ranks(std::vector<int> ranks) {
  return base::format_rank_list(std::move(ranks));
}

namespace {

struct Member {
  const RankProgress* rank;
  const GroupProgress* group;
};

// One group across the ranks that report it, at its wavefront: `seq` is the lowest sequence
// number that some member has not finished while another has issued it.
struct Front {
  const GroupProgress* any = nullptr;  // one member's view (name, size)
  uint64_t seq = 0;
  std::vector<Member> members;
  std::vector<const RankProgress*> waiters;  // issued seq, not finished
  std::vector<const RankProgress*> behind;   // never issued seq
  int missing = 0;                           // members not in the snapshots
};

std::string fmt_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", s);
  return buf;
}

double idle_of(const RankProgress& r, int64_t now_ns) {
  if (r.moving || r.last_progress_ns <= 0 || now_ns <= r.last_progress_ns) return 0;
  return static_cast<double>(now_ns - r.last_progress_ns) / 1e9;
}

bool over(const RankProgress& r, const TimeoutRule& rule, int64_t now_ns) {
  if (!r.attached || r.moving) return false;
  auto t = rule.timeout_s(class_of(r));
  return t && idle_of(r, now_ns) > *t;
}

std::string who(const RankProgress& r) {
  std::string s = "rank " + std::to_string(r.rank) + " (";
  if (!r.node.empty()) s += "node " + r.node + ", ";
  return s + "pid " + std::to_string(r.pid) + ")";
}

// Where a rank is, for the end of a summary ("" when nothing to add).
std::string where(const RankProgress& r) {
  if (r.process == ProcessState::kStopped) return "; it is stopped (SIGSTOP or a debugger)";
  if (r.process == ProcessState::kGone) return "; it has exited";
  if (const GroupProgress* g = r.waiting_group()) {
    const CollectiveRecord* c = g->find(g->completed + 1);
    return std::string("; it waits in ") + (c ? base::progress::op_name(c->op) : "collective") +
           " #" + std::to_string(g->completed + 1) + " of " + g->name();
  }
  switch (r.phase) {
    case Phase::kSection:
      return "; it is in section \"" + r.section + "\"";
    case Phase::kCheckpointSave:
      return "; it is in a checkpoint save";
    case Phase::kStopCheck:
      return "; it is in a stop check";
    case Phase::kInit:
      return "; it is in init()";
    default:
      return "";
  }
}

std::string describe(const CollectiveRecord& c) {
  std::string s = base::progress::dtype_name(c.dtype);
  if (c.op != Op::kBarrier && c.op != Op::kMonitoredBarrier && c.op != Op::kAllToAllV)
    s += " x " + std::to_string(c.count);
  return s;
}

bool same_call(const CollectiveRecord& a, const CollectiveRecord& b) {
  if (a.op != b.op || a.dtype != b.dtype) return false;
  return a.op == Op::kAllToAllV || a.count == b.count;
}

std::vector<int> ranks_of(const std::vector<const RankProgress*>& v) {
  std::vector<int> out;
  for (auto* r : v) out.push_back(r->rank);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<Front> fronts(const std::vector<RankProgress>& ranks) {
  std::map<uint64_t, Front> by_key;
  for (const auto& r : ranks) {
    if (!r.attached) continue;
    for (const auto& g : r.groups) {
      Front& f = by_key[g.key];
      if (!f.any) f.any = &g;
      f.members.push_back(Member{&r, &g});
    }
  }
  std::vector<Front> out;
  for (auto& [key, f] : by_key) {
    uint64_t lowest = UINT64_MAX, highest = 0;
    for (const auto& m : f.members) {
      lowest = std::min(lowest, m.group->completed + 1);
      highest = std::max(highest, m.group->issued);
    }
    if (highest < lowest) continue;  // every member finished everything it issued
    f.seq = lowest;
    for (const auto& m : f.members) {
      if (m.group->issued < f.seq)
        f.behind.push_back(m.rank);
      else if (m.group->completed < m.group->issued)
        f.waiters.push_back(m.rank);
    }
    f.missing = std::max(0, f.any->group_size - static_cast<int>(f.members.size()));
    out.push_back(std::move(f));
  }
  return out;
}

// The record of `f.seq` as the waiters issued it (the first waiter that still has it).
const CollectiveRecord* awaited(const Front& f) {
  for (const auto& m : f.members)
    if (m.group->issued >= f.seq)
      if (auto* c = m.group->find(f.seq)) return c;
  return nullptr;
}

std::string collective_name(const Front& f) {
  const CollectiveRecord* c = awaited(f);
  return std::string(c ? base::progress::op_name(c->op) : "collective") + " #" +
         std::to_string(f.seq) + " of " + f.any->name();
}

Verdict never_issued(const std::vector<Front>& fs, const TimeoutRule& rule, int64_t now_ns) {
  // Waits-for: a waiter of a group waits for that group's ranks behind. The culprits are the
  // ranks waited for that wait for nobody themselves (a cycle: its members).
  std::map<int, std::set<int>> waits_for;
  std::map<int, const RankProgress*> by_rank;
  for (const auto& f : fs)
    for (auto* w : f.waiters) {
      by_rank[w->rank] = w;
      for (auto* b : f.behind) {
        waits_for[w->rank].insert(b->rank);
        by_rank[b->rank] = b;
      }
    }
  std::set<int> waited;
  for (const auto& [w, bs] : waits_for) waited.insert(bs.begin(), bs.end());
  std::vector<int> sinks;
  for (int b : waited)
    if (waits_for.find(b) == waits_for.end()) sinks.push_back(b);
  if (sinks.empty()) sinks.assign(waited.begin(), waited.end());  // a cycle
  if (sinks.empty()) return {};
  // The culprit named first: the one idle longest (then the lowest rank).
  std::stable_sort(sinks.begin(), sinks.end(), [&](int a, int b) {
    return idle_of(*by_rank[a], now_ns) > idle_of(*by_rank[b], now_ns);
  });
  const RankProgress& c = *by_rank[sinks.front()];
  // Its group: where it is behind with the most waiters.
  const Front* best = nullptr;
  for (const auto& f : fs)
    for (auto* b : f.behind)
      if (b == &c && (!best || f.waiters.size() > best->waiters.size())) best = &f;
  Verdict v;
  v.kind = Verdict::kNeverIssued;
  v.culprits = sinks;
  for (int s : sinks) v.hung = v.hung || over(*by_rank[s], rule, now_ns);
  v.waiting = ranks_of(best->waiters);
  v.group = best->any->number;
  v.seq = best->seq;
  v.idle_s = idle_of(c, now_ns);
  v.summary = who(c) + " made no progress for " + fmt_seconds(v.idle_s) + " s: it never issued " +
              collective_name(*best) + ", which " + format_ranks(v.waiting) + " wait" +
              (v.waiting.size() == 1 ? "s" : "") + " in" + where(c);
  return v;
}

Verdict mismatch(const std::vector<Front>& fs, const TimeoutRule& rule, int64_t now_ns) {
  for (const auto& f : fs) {
    // The variants of f.seq among the members that issued it, with who issued each.
    std::vector<std::pair<const CollectiveRecord*, std::vector<const RankProgress*>>> variants;
    for (const auto& m : f.members) {
      if (m.group->issued < f.seq) continue;
      const CollectiveRecord* c = m.group->find(f.seq);
      if (!c) continue;
      auto it = std::find_if(variants.begin(), variants.end(),
                             [&](const auto& v) { return same_call(*v.first, *c); });
      if (it == variants.end())
        variants.push_back({c, {m.rank}});
      else
        it->second.push_back(m.rank);
    }
    if (variants.size() < 2) continue;
    // The reference: the variant most ranks issued (a tie: the one with the lowest rank).
    auto lowest = [](const std::vector<const RankProgress*>& v) {
      int lo = INT32_MAX;
      for (auto* r : v) lo = std::min(lo, r->rank);
      return lo;
    };
    size_t ref = 0;
    for (size_t i = 1; i < variants.size(); ++i) {
      const auto& a = variants[i].second;
      const auto& b = variants[ref].second;
      if (a.size() > b.size() || (a.size() == b.size() && lowest(a) < lowest(b))) ref = i;
    }
    Verdict v;
    v.kind = Verdict::kMismatch;
    std::vector<const RankProgress*> culprits;
    for (size_t i = 0; i < variants.size(); ++i)
      if (i != ref)
        culprits.insert(culprits.end(), variants[i].second.begin(), variants[i].second.end());
    std::sort(culprits.begin(), culprits.end(), [](auto* a, auto* b) { return a->rank < b->rank; });
    const RankProgress& c = *culprits.front();
    const CollectiveRecord* mine = nullptr;
    for (const auto& m : f.members)
      if (m.rank == &c) mine = m.group->find(f.seq);
    const CollectiveRecord& theirs = *variants[ref].first;
    v.culprits = ranks_of(culprits);
    v.waiting = ranks_of(variants[ref].second);
    for (auto* r : culprits) v.hung = v.hung || over(*r, rule, now_ns);
    v.group = f.any->number;
    v.seq = f.seq;
    v.idle_s = idle_of(c, now_ns);
    const std::string n = " #" + std::to_string(f.seq);
    v.summary = who(c) + " made no progress for " + fmt_seconds(v.idle_s) + " s: it issued " +
                base::progress::op_name(mine->op) + n + " of " + f.any->name() + " (" +
                describe(*mine) + ") where " + format_ranks(v.waiting) + " issued " +
                base::progress::op_name(theirs.op) + n + " (" + describe(theirs) + ")";
    return v;
  }
  return {};
}

// Every member that reports the group waits in f.seq: a stopped one is the culprit; otherwise
// nobody is behind (or the one behind is on a node these snapshots do not cover).
Verdict all_waiting(const std::vector<Front>& fs, const TimeoutRule& rule, int64_t now_ns) {
  for (const auto& f : fs) {
    if (f.waiters.empty() || !f.behind.empty()) continue;
    Verdict v;
    v.group = f.any->number;
    v.seq = f.seq;
    std::vector<const RankProgress*> stopped;
    for (auto* w : f.waiters)
      if (w->process == ProcessState::kStopped || w->process == ProcessState::kGone)
        stopped.push_back(w);
    if (!stopped.empty()) {
      const RankProgress& c = *stopped.front();
      v.kind = Verdict::kStopped;
      v.culprits = ranks_of(stopped);
      for (auto* w : f.waiters)
        if (std::find(stopped.begin(), stopped.end(), w) == stopped.end())
          v.waiting.push_back(w->rank);
      for (auto* r : stopped) v.hung = v.hung || over(*r, rule, now_ns);
      v.idle_s = idle_of(c, now_ns);
      v.summary =
          who(c) + " made no progress for " + fmt_seconds(v.idle_s) + " s: it is " +
          (c.process == ProcessState::kGone ? "gone (exited)" : "stopped (SIGSTOP or a debugger)") +
          " in " + collective_name(f) +
          (v.waiting.empty() ? ""
                             : ", which " + format_ranks(v.waiting) + " wait" +
                                   (v.waiting.size() == 1 ? "s" : "") + " in");
      return v;
    }
    v.kind = Verdict::kAllWaiting;
    v.waiting = ranks_of(f.waiters);
    v.hung = true;
    double idle = 1e300;
    for (auto* w : f.waiters) {
      v.hung = v.hung && over(*w, rule, now_ns);
      idle = std::min(idle, idle_of(*w, now_ns));
    }
    v.idle_s = idle;
    v.summary = format_ranks(v.waiting) + " made no progress for " + fmt_seconds(idle) +
                " s: " + (v.waiting.size() == 1 ? "it waits" : "they wait") + " in " +
                collective_name(f);
    if (f.missing > 0)
      v.summary += " for the group's other " + std::to_string(f.missing) +
                   (f.missing == 1 ? " rank" : " ranks") + " (not in these snapshots)";
    else
      v.summary += ", which every rank issued: no rank is behind";
    return v;
  }
  return {};
}

Verdict outside_collective(const std::vector<RankProgress>& ranks, const TimeoutRule& rule,
                           int64_t now_ns) {
  const RankProgress* c = nullptr;
  for (const auto& r : ranks) {
    if (!r.attached || r.moving || r.waiting_group()) continue;
    if (!c || idle_of(r, now_ns) > idle_of(*c, now_ns)) c = &r;
  }
  if (!c) return {};
  Verdict v;
  v.kind = Verdict::kOutsideCollective;
  v.culprits = {c->rank};
  v.hung = over(*c, rule, now_ns);
  v.idle_s = idle_of(*c, now_ns);
  std::string in;
  switch (class_of(*c).kind) {
    case TimeoutClass::kStartup:
      in = "while starting up";
      break;
    case TimeoutClass::kCheckpoint:
      in = "in a checkpoint save";
      break;
    case TimeoutClass::kSection:
      in = "in section \"" + c->section + "\"";
      break;
    default:
      in = "in the training loop";
      break;
  }
  v.summary = who(*c) + " made no progress for " + fmt_seconds(v.idle_s) + " s " + in +
              ", outside any collective";
  if (c->process == ProcessState::kStopped) v.summary += "; it is stopped (SIGSTOP or a debugger)";
  return v;
}

}  // namespace

Verdict judge(const std::vector<RankProgress>& ranks, const TimeoutRule& rule, int64_t now_ns) {
  const std::vector<Front> fs = fronts(ranks);
  Verdict first;  // the first analysis that names something, for a verdict that is not hung
  for (Verdict v : {never_issued(fs, rule, now_ns), mismatch(fs, rule, now_ns),
                    all_waiting(fs, rule, now_ns), outside_collective(ranks, rule, now_ns)}) {
    if (v.kind == Verdict::kNone) continue;
    if (v.hung) return v;
    if (first.kind == Verdict::kNone) first = std::move(v);
  }
  first.hung = false;
  return first;
}

}  // namespace trun::agent::hang
