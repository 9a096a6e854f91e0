#include "agent/straggler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace trun::agent::straggler {

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// The median compute of every measured rank but `self`.
double reference(const std::vector<RankStats>& ranks, size_t self) {
  std::vector<double> others;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i != self && ranks[i].step_s > 0) others.push_back(ranks[i].compute_s);
  }
  return median(std::move(others));
}

}  // namespace

void score(std::vector<RankStats>& ranks) {
  size_t measured = 0;
  for (const auto& r : ranks) measured += r.step_s > 0 ? 1 : 0;
  for (size_t i = 0; i < ranks.size(); ++i) {
    RankStats& r = ranks[i];
    r.slower = 0;
    r.score = 1;
    if (measured < 2 || r.step_s <= 0) continue;
    const double ref = reference(ranks, i);
    if (ref <= 0) continue;
    r.slower = r.compute_s / ref - 1;
    r.score = 1 / (1 + std::max(r.slower, 0.0));
  }
}

std::optional<size_t> slowest(const std::vector<RankStats>& ranks, double threshold) {
  std::optional<size_t> best;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i].slower > threshold && (!best || ranks[i].slower > ranks[*best].slower)) best = i;
  }
  return best;
}

void Tracker::observe(const std::vector<hang::RankProgress>& ranks, int64_t now_ns) {
  const auto every = static_cast<int64_t>(options_.sample_every_s * 1e9);
  const auto keep = static_cast<int64_t>(options_.measure_s * 1e9);
  for (const auto& p : ranks) {
    if (!p.attached) continue;
    Rank& r = ranks_[p.local_rank];
    if (r.pid != p.pid) r = Rank{p.pid, p.rank, p.local_rank, p.node, {}, 0};  // a new worker
    if (!r.samples.empty() && now_ns - r.samples.back().t_ns < every) continue;
    r.samples.push_back({now_ns, p.steps, p.collective_ns});
    // Keep one sample older than the interval, so that the interval is covered whole.
    while (r.samples.size() > 2 && now_ns - r.samples[1].t_ns >= keep) r.samples.pop_front();
    double step = 0, compute = 0;
    if (measure(r.samples.front(), r.samples.back(), &step, &compute) &&
        (r.best_compute_s <= 0 || compute < r.best_compute_s)) {
      r.best_compute_s = compute;
    }
  }
}

bool Tracker::measure(const Sample& a, const Sample& b, double* step_s, double* compute_s) const {
  if (b.steps <= a.steps || static_cast<double>(b.t_ns - a.t_ns) < options_.measure_s * 0.5e9) {
    return false;
  }
  const double n = static_cast<double>(b.steps - a.steps);
  const double wall = static_cast<double>(b.t_ns - a.t_ns) / 1e9;
  const double coll =
      static_cast<double>(std::max<int64_t>(0, b.collective_ns - a.collective_ns)) / 1e9;
  *step_s = wall / n;
  *compute_s = (wall - std::min(coll, wall)) / n;
  return true;
}

std::vector<RankStats> Tracker::stats() const {
  std::vector<RankStats> out;
  for (const auto& [local_rank, r] : ranks_) {
    RankStats s;
    s.rank = r.rank;
    s.local_rank = r.local_rank;
    s.node = r.node;
    if (!r.samples.empty()) {
      s.steps = r.samples.back().steps;
      measure(r.samples.front(), r.samples.back(), &s.step_s, &s.compute_s);
    }
    s.best_compute_s = r.best_compute_s;
    s.self_score = s.compute_s > 0 && r.best_compute_s > 0 ? r.best_compute_s / s.compute_s : 1;
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<Judge::Change> Judge::update(const std::vector<RankStats>& scored, double now_s) {
  std::vector<Change> changes;
  for (const auto& r : scored) {
    State& st = state_[r.rank];
    const bool slow = r.step_s > 0 && r.slower > options_.threshold;
    if (!slow) {
      if (st.flagged && r.step_s > 0) changes.push_back({Change::kRecovered, r, 0});
      if (r.step_s > 0) st = State{};
      continue;
    }
    if (!st.slow_since) st.slow_since = now_s;
    const double slow_for = now_s - *st.slow_since;
    if (!st.flagged && slow_for >= options_.window_s) {
      st.flagged = true;
      changes.push_back({Change::kFlagged, r, slow_for});
    }
  }
  return changes;
}

std::vector<int> Judge::flagged() const {
  std::vector<int> out;
  for (const auto& [rank, st] : state_) {
    if (st.flagged) out.push_back(rank);
  }
  return out;
}

std::string describe(const RankStats& r, double reference_compute_s) {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "rank %d (local_rank %d) on %s is %.0f%% slower than the others (step %.3f s, "
                "%.3f s of it outside collectives against %.3f s for the others)",
                r.rank, r.local_rank, r.node.c_str(), r.slower * 100, r.step_s, r.compute_s,
                reference_compute_s);
  return buf;
}

}  // namespace trun::agent::straggler
