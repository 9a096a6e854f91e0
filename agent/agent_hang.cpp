// The agent's hang detection (agent/agent.h, docs/hangs.md): the watch's start, and what a hung
// verdict does: the dumps (each rank's progress and recent collectives, the native stacks of
// every local worker), the failure naming the culprit, the event, the metric and the stop.
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <set>

#include "agent/agent.h"
#include "agent/hang_agree.h"
#include "agent/hang_dump.h"
#include "agent/stack_dump.h"
#include "base/shm_names.h"
#include "store/store.h"

namespace trun::agent {
namespace {

// The whole dump of one worker's threads may take this long (the group is hung: a second more
// before the restart buys the stacks that say why).
constexpr auto kStackBudget = std::chrono::milliseconds(2000);
// Frames of the culprit's stack in the failure summary (the whole stack is in its dump file).
constexpr size_t kSummaryStackLines = 24;

std::string first_lines(const std::string& text, size_t n) {
  size_t pos = 0;
  for (size_t i = 0; i < n && pos != std::string::npos; ++i) {
    pos = text.find('\n', pos);
    if (pos != std::string::npos) ++pos;
  }
  return pos == std::string::npos ? text : text.substr(0, pos) + "  ...\n";
}

}  // namespace

void Agent::start_hang_watch() {
  // A Python entry point reports no progress (PyTorch's watchdog covers it: file_timer_server.h),
  // and its workers' environment stays exactly torchrun's: no board, no TRUN_PROGRESS_SHM.
  if (!config_.python_interpreter.empty()) return;
  HangWatchOptions options;
  options.timeouts = config_.hang_timeouts;
  options.node = hostname_;
  options.straggler = config_.straggler;
  if (const int stale = ProgressMonitor::remove_stale_boards(); stale > 0) {
    spdlog::info("removed {} progress board(s) of agents that are gone", stale);
  }
  try {
    auto board = ProgressMonitor::create(
        base::shm_progress_name(run_id_, static_cast<long>(getpid())), config_.nproc_per_node);
    hang_ = std::make_unique<HangWatch>(std::move(board), std::move(options));
  } catch (const std::exception& e) {
    spdlog::warn("hang detection is off: cannot create the progress board: {}", e.what());
    return;
  }
  loop_.add(hang_->notify_fd(), EPOLLIN, [this](uint32_t) { on_hang(); });
  start_straggler_reports();
}

void Agent::agree_hang_timeouts() {
  if (!hang_ || !session_ || !session_->multi_node()) return;
  const std::shared_ptr<store::Store> store = session_->info().run_store;
  if (!store) return;
  hang::LearnedMap agreed;
  try {
    agreed = hang::agree_learned(*store, hang::learned_key(run_id_), hang_->learned());
  } catch (const std::exception& e) {
    spdlog::warn(
        "hang detection: cannot agree on the learned timeouts through the store ({}); "
        "this node keeps its own",
        e.what());
    return;
  }
  for (const std::string& line : hang_->adopt(agreed)) {
    spdlog::info("hang detection: timeout agreed with the other nodes: {}", line);
  }
}

void Agent::on_hang() {
  std::optional<HangWatch::Finding> found = hang_->take_verdict();
  if (!found || phase_ != GroupPhase::kRunning || outcome_) return;
  const hang::Verdict& v = found->verdict;
  spdlog::error("hang detected: {}", v.summary);

  // The culprits on this node (the verdict may name ranks of other nodes only when they are in
  // its snapshots, which hold this node's ranks).
  std::vector<int> local_culprits;
  for (int rank : v.culprits) {
    for (const auto& w : workers_) {
      if (w.rank == rank && w.running) local_culprits.push_back(w.local_rank);
    }
  }
  const std::string culprit_stacks = write_hang_dumps(*found, local_culprits);

  // The failure that the summary, the root cause across nodes and the restart count see: the
  // culprit's, else (nobody behind on this node) the first waiting rank's.
  int blamed = local_culprits.empty() ? -1 : local_culprits.front();
  for (size_t i = 0; blamed < 0 && i < workers_.size(); ++i) {
    if (std::count(v.waiting.begin(), v.waiting.end(), workers_[i].rank)) blamed = int(i);
  }
  if (blamed < 0) blamed = 0;
  const WorkerProcess& w = workers_[static_cast<size_t>(blamed)];
  if (!local_culprits.empty()) hang_blamed_rank_ = w.rank;
  WorkerFailure f;
  f.local_rank = w.local_rank;
  f.rank = w.rank;
  f.pid = w.pid;
  f.exitcode = -SIGKILL;
  f.error_file = "<N/A>";
  f.message = v.summary;
  if (!culprit_stacks.empty()) {
    f.message += "\n" + first_lines(culprit_stacks, kSummaryStackLines);
  }
  if (!config_.log_dir.empty()) {
    f.message += "\n(dumps of every local rank: " + attempt_dir_ + "/<local rank>/hang_dump.txt)";
  }
  f.timestamp = static_cast<int64_t>(unix_seconds());
  f.exited_at_ms = unix_ms();
  f.sequence = failure_seq_++;
  failures_.push_back(std::move(f));

  std::string culprits;
  for (int r : v.culprits) culprits += (culprits.empty() ? "" : ",") + std::to_string(r);
  event("trun.hang",
        {{"summary", v.summary},
         {"culprits", culprits},
         {"rank", v.culprits.empty() ? EventValue{} : EventValue{int64_t{v.culprits[0]}}},
         {"group", int64_t{v.group}},
         {"seq", static_cast<int64_t>(v.seq)},
         {"idle_s", v.idle_s},
         {"dump_dir", config_.log_dir.empty() ? std::string() : attempt_dir_}});
  ++snap_.hangs;

  // A hung culprit cannot stop gracefully (it may be stopped or spinning): SIGKILL now. The
  // others get the usual stop, and SIGCONT so that a stopped one can take it.
  outcome_ = GroupOutcome::kFailed;
  for (int lr : local_culprits) {
    if (workers_[static_cast<size_t>(lr)].group_live)
      sup_.signal_group(workers_[static_cast<size_t>(lr)].pid, SIGKILL);
  }
  begin_stop(SIGTERM);
  for (auto& wp : workers_) {
    if (wp.group_live) sup_.signal_group(wp.pid, SIGCONT);
  }
  publish();
}

std::string Agent::write_hang_dumps(const HangWatch::Finding& f, const std::vector<int>& culprits) {
  const int64_t now = base::progress::monotonic_ns();
  std::string culprit_stacks;
  for (const auto& w : workers_) {
    if (!w.running) continue;
    const hang::RankProgress* progress = nullptr;
    for (const auto& r : f.ranks) {
      if (r.attached && r.pid == w.pid) progress = &r;
    }
    hang::RankProgress fallback;
    if (!progress) {
      fallback.rank = w.rank;
      fallback.local_rank = w.local_rank;
      fallback.pid = w.pid;
      fallback.node = hostname_;
      progress = &fallback;
    }
    std::string text = format_hang_dump(f.verdict, f.timeouts, *progress, now);
    // On this thread, which also reaps the workers (stack_dump.h).
    StackDumpOptions so;
    so.budget = kStackBudget;
    const std::string stacks = format_stacks(dump_native_stacks(w.pid, so));
    text += "\nnative stacks:\n" + stacks;
    if (std::count(culprits.begin(), culprits.end(), w.local_rank) && culprit_stacks.empty()) {
      culprit_stacks = stacks;
    }
    // Its own directory: a worker replaced alone logs under the attempt of its generation.
    const std::string path = w.dir + "/hang_dump.txt";
    std::ofstream out(path, std::ios::trunc);
    out << text;
    if (!out) spdlog::warn("cannot write the hang dump {}", path);
  }
  return culprit_stacks;
}

}  // namespace trun::agent
