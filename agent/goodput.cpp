#include "agent/goodput.h"

#include <algorithm>

namespace trun::agent::goodput {

const char* cause_name(Cause c) {
  switch (c) {
    case Cause::kStartup:
      return "startup";
    case Cause::kDetection:
      return "detection";
    case Cause::kStopping:
      return "stopping";
    case Cause::kRendezvous:
      return "rendezvous";
    case Cause::kRestart:
      return "restart";
    case Cause::kCheckpointLoad:
      return "checkpoint_load";
    case Cause::kRedone:
      return "redone";
    case Cause::kSlow:
      return "slow";
    default:
      return "other";
  }
}

void Account::add(Cause c, double begin, double end, bool interval) {
  if (end <= begin) return;
  time_[static_cast<int>(c)] += end - begin;
  if (interval && pending_.size() < kMaxPending) pending_.push_back({c, begin, end});
}

double Account::reference() const {
  if (samples_.empty()) return 0;
  std::vector<double> v(samples_.begin(), samples_.end());
  auto mid = v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2);
  std::nth_element(v.begin(), mid, v.end());
  return *mid;
}

Progress Account::since_base(const Progress& p) {
  Progress q;
  q.attached = true;
  if (p.steps <= base_->steps) return q;  // none since
  const uint64_t n = p.steps - base_->steps;
  if (!first_new_) {
    // The pace: the reference step time, else (too few samples: an agent without
    // --metrics-port samples rarely) the records' average before the re-formation.
    double pace = reference();
    if (pace <= 0 && base_->steps > 1)
      pace = (base_->last_step - base_->first_step) / static_cast<double>(base_->steps - 1);
    first_new_ = std::max(rebased_at_, p.last_step - static_cast<double>(n - 1) * pace);
  }
  q.steps = n;
  q.first_step = *first_new_;
  q.last_step = p.last_step;
  return q;
}

void Account::progress(const Progress& sample, double now) {
  (void)now;
  if (phase_ != Phase::kRunning || !sample.attached) return;
  sdk_seen_ = true;
  raw_ = sample;
  const Progress p = base_ ? since_base(sample) : sample;
  // One step time sample per call that saw new steps of the same group.
  if (group_.steps >= 1 && p.steps > group_.steps && p.last_step > group_.last_step) {
    samples_.push_back((p.last_step - group_.last_step) /
                       static_cast<double>(p.steps - group_.steps));
    if (samples_.size() > kMaxSamples) samples_.pop_front();
  }
  if (p.resumed_step && !resume_seen_) {
    resume_seen_ = true;
    // The chain went back to the checkpoint: the steps past it are lost.
    group_redone_ = reached_ > *p.resumed_step ? reached_ - *p.resumed_step : 0;
    redone_ += group_redone_;
    reached_ = *p.resumed_step;
  }
  if (p.steps > group_.steps) {
    steps_ += p.steps - group_.steps;
    reached_ += p.steps - group_.steps;
  }
  group_ = p;
}

void Account::close(double now, bool provisional) {
  const double from = since_;
  if (now <= from) return;
  switch (phase_) {
    case Phase::kRendezvous:
      if (!ran_) {
        // Before this node's first group: decided when it runs (startup, or outside).
        pre_job_ += now - from;
        if (pre_job_intervals_.size() < kMaxPending)
          pre_job_intervals_.push_back({Cause::kStartup, from, now});
      } else {
        add(Cause::kRendezvous, from, now, true);
      }
      break;
    case Phase::kRunning: {
      const Cause pre = started_ || joined_late_ ? Cause::kRestart : Cause::kStartup;
      if (!group_.attached && !sdk_seen_) {
        // No board from this program (yet): its running time counts as productive.
        unmeasured_ += now - from;
        break;
      }
      const double first = group_.steps > 0 ? std::clamp(group_.first_step, from, now) : now;
      const double load = std::min(group_.load_seconds, first - from);
      add(pre, from, first - load, true);
      add(Cause::kCheckpointLoad, first - load, first, true);
      if (group_.steps > 0) {
        const double last = std::clamp(group_.last_step, first, now);
        running_ += last - first;
        steps_executed_ += group_.steps - 1;
        if (provisional)
          // The interval under way: since its last step it is presumed to be stepping (a
          // sample comes every second or so); only its end tells detection time.
          unmeasured_ += now - last;
        else
          add(Cause::kDetection, last, now, true);
        started_ = true;
        const double ref = reference();
        if (group_redone_ > 0 && ref > 0 && pending_.size() < kMaxPending)
          pending_.push_back({Cause::kRedone, first,
                              std::min(last, first + static_cast<double>(group_redone_) * ref)});
      }
      break;
    }
    case Phase::kStopping:
      add(Cause::kStopping, from, now, true);
      break;
    case Phase::kOutside:
      outside_ += now - from;
      break;
    case Phase::kOther:
      add(Cause::kOther, from, now, false);
      break;
  }
  since_ = now;
}

void Account::set_phase(Phase p, double now, bool joined_late) {
  if (p == phase_) return;
  close(now);
  if (p == Phase::kRunning) {
    if (!ran_) {
      ran_ = true;
      joined_late_ = joined_late;
      if (joined_late) {
        outside_ += pre_job_;
      } else {
        for (const auto& i : pre_job_intervals_) add(i.cause, i.begin, i.end, true);
      }
      pre_job_ = 0;
      pre_job_intervals_.clear();
    }
    group_ = Progress{};
    raw_ = Progress{};
    base_.reset();
    resume_seen_ = false;
    group_redone_ = 0;
  }
  phase_ = p;
  since_ = now;
}

void Account::replaced(double now) {
  if (phase_ != Phase::kRunning) return;
  close(now);
  group_ = Progress{};
  raw_ = Progress{};
  base_.reset();  // the replacements' records are fresh
  resume_seen_ = true;
  group_redone_ = 0;
}

void Account::reformed(double now, std::optional<double> round_since) {
  if (phase_ != Phase::kRunning) return;
  // Steps taken after the round began (the ranks kept stepping while a node joined) were not a
  // wait: the rendezvous time starts after the last of them.
  const double split =
      round_since ? std::clamp(std::max(*round_since, group_.last_step), since_, now) : now;
  close(split);
  add(Cause::kRendezvous, split, now, true);
  since_ = now;
  group_ = Progress{};
  base_ = raw_;
  rebased_at_ = now;
  first_new_.reset();
  resume_seen_ = true;
  group_redone_ = 0;
}

Totals Account::totals(double now) const {
  Account a = *this;
  a.close(now, /*provisional=*/true);
  Totals t;
  t.badput = a.time_;
  t.outside = a.outside_ + a.pre_job_;  // before the first group: not yet known to be startup
  t.steps = a.steps_;
  t.steps_redone = a.redone_;
  t.step_seconds = a.reference();
  // The running time splits into productive, redone and slow at the reference step time.
  const double run = a.running_;
  const uint64_t executed = a.steps_executed_;
  const uint64_t redone = std::min<uint64_t>(a.redone_, executed);
  double at_ref = static_cast<double>(executed) * t.step_seconds;
  if (t.step_seconds <= 0 || executed == 0) at_ref = 0;
  if (at_ref > run || (at_ref == 0 && executed > 0)) {
    // The reference overestimates this node's steps (or none was measured): no slow time.
    const double share = executed ? static_cast<double>(redone) / executed : 0;
    t.badput[static_cast<int>(Cause::kRedone)] += run * share;
    t.productive = run * (1 - share);
  } else {
    t.badput[static_cast<int>(Cause::kRedone)] += static_cast<double>(redone) * t.step_seconds;
    t.productive = static_cast<double>(executed - redone) * t.step_seconds;
    t.badput[static_cast<int>(Cause::kSlow)] += run - at_ref;
  }
  t.productive += a.unmeasured_;
  t.wall = t.productive;
  for (double b : t.badput) t.wall += b;
  return t;
}

std::vector<Interval> Account::take_intervals() {
  std::vector<Interval> out;
  out.swap(pending_);
  return out;
}

}  // namespace trun::agent::goodput
