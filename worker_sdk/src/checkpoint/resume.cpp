// Resuming (Checkpointer::load_latest and Checkpointer::State::choose, checkpointer_state.h):
// rank 0 (or a process alone) chooses the newest checkpoint of this job that verifies (the one
// `latest` names first), quarantines what does not verify, refuses where resuming would lose
// checkpoints, and writes its decision to DIR/.resume for the other ranks, which load it after
// a barrier.

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <thread>
#include <utility>

#include "worker_sdk/src/checkpoint/checkpointer_state.h"
#include "worker_sdk/src/checkpoint/directory.h"
#include "worker_sdk/src/checkpoint/format.h"
#include "worker_sdk/src/progress/progress.h"

namespace trun::worker {

namespace fs = std::filesystem;
using json = nlohmann::json;

using namespace ckpt;

namespace {

// Loads step_dir; an I/O error (EIO, a network filesystem hiccup) gets one more try, so that a
// transient error is not taken for damage.
Checkpoint load_with_retry(const std::string& step_dir) {
  try {
    return Checkpointer::load(step_dir);
  } catch (const CheckpointError& e) {
    if (e.error_number() == 0 || e.error_number() == ENOENT) throw;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    return Checkpointer::load(step_dir);
  }
}

// The checkpoint `latest` names first, then every other step, newest first.
std::vector<std::string> candidates(const std::string& dir, const std::string& latest) {
  std::vector<std::string> out;
  if (!latest.empty()) out.push_back(latest);
  std::vector<uint64_t> steps;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (auto s = parse_step_name(entry.path().filename().string())) steps.push_back(*s);
  std::sort(steps.begin(), steps.end(), std::greater<uint64_t>());
  for (uint64_t s : steps)
    if (step_name(s) != latest) out.push_back(step_name(s));
  return out;
}

// Nothing chosen: another job's checkpoints (unless adopt) or damaged ones (unless
// start_fresh_if_damaged) are a refusal, not a fresh start.
void refuse_without_choice(bool chosen,
                           const std::vector<std::pair<std::string, std::string>>& foreign,
                           const std::vector<std::pair<std::string, std::string>>& damaged,
                           const std::string& dir, const std::string& job_id,
                           const CheckpointerOptions& options) {
  if (!chosen && !foreign.empty() && !options.adopt) {
    std::string list;
    for (const auto& [name, job] : foreign) list += (list.empty() ? "" : ", ") + name;
    throw CheckpointOwnerError(
        "checkpoint: " + dir + " holds checkpoints of another job ('" + foreign.front().second +
        "': " + list + ") and none of this job ('" + job_id +
        "'). To continue that training, run with its job id (TRUN_JOB_ID=" +
        foreign.front().second +
        ", or the same --rdzv-id); to start a new one, use another directory; adopt is off "
        "(CheckpointerOptions::adopt), so another job's checkpoints are not continued");
  }
  if (!chosen && !damaged.empty() && !options.start_fresh_if_damaged) {
    std::string list;
    for (const auto& [name, why] : damaged) list += "\n  " + name + ": " + why;
    throw CheckpointError("checkpoint: " + dir + " holds " + std::to_string(damaged.size()) +
                          " checkpoint(s) and none is readable; refusing to start from scratch, "
                          "which would lose them:" +
                          list +
                          "\nRepair or move them away, or ask for a fresh start "
                          "(start_fresh_if_damaged; train_mlp: --fresh-start), which "
                          "quarantines them");
  }
}

}  // namespace

// Rank 0 (or a process alone) decides; `writer` also quarantines what does not verify.
std::optional<Checkpoint> Checkpointer::State::choose(bool writer) {
  const std::string latest = latest_name();
  std::error_code ec;
  std::vector<std::pair<std::string, std::string>> damaged, foreign;  // name, why / job
  std::optional<Checkpoint> chosen;
  bool latest_gone = false;
  for (const auto& name : candidates(dir, latest)) {
    const std::string path = dir + "/" + name;
    if (!fs::is_directory(path, ec)) {
      std::fprintf(stderr, "[trun.checkpoint] %s/latest names %s, which does not exist\n",
                   dir.c_str(), name.c_str());
      continue;
    }
    const auto owner = job_of(path);
    if (owner && !own_jobs.count(*owner)) {
      if (options.set_aside_other_jobs) {
        if (writer &&
            !detail::quarantine(dirfd.fd, dir, name,
                                "set aside by a fresh start of job '" + job_id +
                                    "' (this checkpoint is job '" + *owner + "''s)",
                                "set-aside")
                 .empty() &&
            name == latest)
          latest_gone = true;
        continue;
      }
      foreign.emplace_back(name, *owner);
      if (!options.adopt) continue;
    }
    try {
      Checkpoint ck = load_with_retry(path);
      if (step_name(ck.step) != name)
        throw CheckpointError("checkpoint " + path + ": its manifest says step " +
                              std::to_string(ck.step));
      if (!own_jobs.count(ck.job_id)) {
        // The lock was free (this writer holds it now), so that job's processes are gone.
        std::fprintf(stderr,
                     "[trun.checkpoint] continuing job '%s' from %s (its owner is gone); this "
                     "is job '%s'. To start over instead: another directory, or a fresh start "
                     "(train_mlp --fresh-start)\n",
                     ck.job_id.c_str(), path.c_str(), job_id.c_str());
        own_jobs.insert(ck.job_id);
      }
      chosen = std::move(ck);
      break;
    } catch (const CheckpointError& e) {
      std::fprintf(stderr, "[trun.checkpoint] not loadable: %s\n", e.what());
      damaged.emplace_back(name, e.what());
    }
  }
  refuse_without_choice(chosen.has_value(), foreign, damaged, dir, job_id, options);
  if (writer) {
    for (const auto& [name, why] : damaged)
      if (!detail::quarantine(dirfd.fd, dir, name, why).empty() && name == latest)
        latest_gone = true;
    if (latest_gone) {
      if (chosen)
        write_small_file("latest", step_name(chosen->step) + "\n");
      else
        ::unlinkat(dirfd.fd, "latest", 0);
    }
  }
  return chosen;
}

std::optional<Checkpoint> Checkpointer::State::load_decided() {
  json d;
  try {
    const auto text = read_small_file(dir, ".resume", kMaxResumeBytes);
    if (text && json_depth(text->data(), text->size(), kMaxJsonDepth) <= kMaxJsonDepth)
      d = json::parse(*text);
  } catch (const CheckpointError& e) {
    std::fprintf(stderr, "[trun.checkpoint] ignoring %s/.resume: %s\n", dir.c_str(), e.what());
  } catch (const json::exception&) {
    d = json();
  }
  if (!d.is_object()) return choose(false);  // rank 0 could not write it (full disk)
  if (d.contains("refused")) {
    const json& refused = d.at("refused");
    const std::string why = "checkpoint: rank 0 refused to resume from " + dir + ": " +
                            (refused.is_string() ? refused.get<std::string>() : json_text(refused));
    const auto owner = d.find("owner");
    if (owner != d.end() && owner->is_boolean() && owner->get<bool>())
      throw CheckpointOwnerError(why);
    throw CheckpointError(why);
  }
  if (!d.contains("load")) return std::nullopt;
  const json& load = d.at("load");
  if (!load.is_string() || !parse_step_name(load.get<std::string>()))
    throw CheckpointError("checkpoint: " + dir + "/.resume names " + json_text(load).substr(0, 80) +
                          ", which is not a step");
  const std::string path = dir + "/" + load.get<std::string>();
  Checkpoint ck = load_with_retry(path);
  own_jobs.insert(ck.job_id);
  return ck;
}

std::optional<Checkpoint> Checkpointer::load_latest() {
  // What the load took and where it resumed go to the progress board (goodput, agent/goodput.h).
  const int64_t began = detail::progress::now_ns();
  std::optional<Checkpoint> ck = [this]() -> std::optional<Checkpoint> {
    State& s = *state_;
    const bool collective = s.options.group && s.options.group->size() > 1;
    if (!s.is_writer()) {
      // Rank 0 decided and wrote its decision before the barrier.
      s.options.group->barrier();
      return s.load_decided();
    }
    try {
      s.wait();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[trun.checkpoint] the last async save failed: %s\n", e.what());
    }
    std::optional<Checkpoint> chosen;
    std::exception_ptr error;
    json d = json::object();
    try {
      chosen = s.choose(true);
      if (chosen) d["load"] = step_name(chosen->step);
    } catch (const CheckpointOwnerError& e) {
      error = std::current_exception();
      d = {{"refused", e.what()}, {"owner", true}};
    } catch (const std::exception& e) {
      error = std::current_exception();
      d = {{"refused", e.what()}};
    }
    if (collective) {
      try {
        s.write_small_file(".resume", json_text(d) + "\n");
      } catch (const CheckpointError& e) {
        // The other ranks then decide alone (read-only): the same choice unless a read differs.
        std::fprintf(stderr, "[trun.checkpoint] cannot record the resume decision: %s\n", e.what());
        ::unlinkat(s.dirfd.fd, ".resume", 0);
      }
      s.options.group->barrier();
    }
    if (error) std::rethrow_exception(error);
    return chosen;
  }();
  detail::progress::resumed(ck ? ck->step : 0, detail::progress::now_ns() - began);
  return ck;
}

}  // namespace trun::worker
