// Checkpointer (trun/checkpoint.h): construction, save() (validation, the snapshot, the sync
// write or the hand-off to the async writer thread), and the loaded Checkpoint's accessors.
// Writing a step is save.cpp's, resuming resume.cpp's; the state is checkpointer_state.h's.

#include "trun/checkpoint.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <set>
#include <thread>

#include "worker_sdk/src/checkpoint/checkpointer_state.h"
#include "worker_sdk/src/checkpoint/directory.h"
#include "worker_sdk/src/checkpoint/format.h"
#include "worker_sdk/src/progress/progress.h"
#include "worker_sdk/src/reduce.h"

namespace trun::worker {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

using namespace ckpt;

namespace {

std::string default_job_id() {
  for (const char* var : {"TRUN_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"}) {
    const char* v = std::getenv(var);
    if (v && *v) return v;
  }
  return "none";
}

// Validates `req` on every rank, so that a bad request fails everywhere alike, within the
// bounds the reader enforces (format.h), so that every checkpoint saved loads. Returns the
// metadata parsed; `total`: the staging bytes its tensors take.
json check_save_request(const SaveRequest& req, size_t* total) {
  json metadata;
  if (req.metadata.size() > kMaxMetadataBytes)
    throw std::invalid_argument("Checkpointer::save: metadata is " +
                                std::to_string(req.metadata.size()) + " bytes, more than " +
                                std::to_string(kMaxMetadataBytes));
  if (json_depth(req.metadata.data(), req.metadata.size(), kMaxMetadataDepth) > kMaxMetadataDepth)
    throw std::invalid_argument("Checkpointer::save: metadata nests deeper than " +
                                std::to_string(kMaxMetadataDepth) + " levels");
  try {
    metadata = json::parse(req.metadata.empty() ? "{}" : req.metadata);
  } catch (const json::exception& e) {
    throw std::invalid_argument(std::string("Checkpointer::save: metadata is not JSON: ") +
                                e.what());
  }
  if (req.model.size() + req.optimizer.size() > kMaxTensors)
    throw std::invalid_argument(
        "Checkpointer::save: " + std::to_string(req.model.size() + req.optimizer.size()) +
        " tensors, more than " + std::to_string(kMaxTensors));
  std::set<std::string> seen;
  *total = 0;
  auto check = [&](const std::vector<TensorRef>& list, const char* section) {
    for (const auto& t : list) {
      if (t.name.empty())
        throw std::invalid_argument(std::string("Checkpointer::save: a ") + section +
                                    " tensor has an empty name");
      if (t.name.size() > kMaxNameBytes)
        throw std::invalid_argument(std::string("Checkpointer::save: a ") + section +
                                    " tensor's name is " + std::to_string(t.name.size()) +
                                    " bytes, more than " + std::to_string(kMaxNameBytes));
      if (!seen.insert(std::string(section) + "/" + t.name).second)
        throw std::invalid_argument(std::string("Checkpointer::save: duplicate ") + section +
                                    " tensor '" + t.name + "'");
      const uint64_t bytes = nbytes_of(t.shape, t.dtype, t.name);
      if (bytes > 0 && !t.data)
        throw std::invalid_argument("Checkpointer::save: tensor '" + t.name + "' has no data");
      *total = (*total + kAlign - 1) / kAlign * kAlign + bytes;
    }
  };
  check(req.model, "model");
  check(req.optimizer, "optimizer");
  return metadata;
}

}  // namespace

Checkpointer::Checkpointer(std::string dir, CheckpointerOptions options)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.dir = std::move(dir);
  s.options = std::move(options);
  if (s.dir.empty()) throw std::invalid_argument("Checkpointer: empty directory");
  if (s.options.keep_last < 1)
    throw std::invalid_argument("Checkpointer: keep_last must be >= 1, got " +
                                std::to_string(s.options.keep_last));
  while (s.dir.size() > 1 && s.dir.back() == '/') s.dir.pop_back();
  s.job_id = s.options.job_id.empty() ? default_job_id() : s.options.job_id;
  if (s.job_id.size() > kMaxNameBytes)
    throw std::invalid_argument("Checkpointer: the job id is " + std::to_string(s.job_id.size()) +
                                " bytes, more than " + std::to_string(kMaxNameBytes));
  s.own_jobs = {s.job_id, ""};
  if (s.is_writer()) {
    std::error_code ec;
    fs::create_directories(s.dir, ec);
    if (ec)
      throw CheckpointError("checkpoint: cannot create " + s.dir + ": " + ec.message(), ec.value());
    s.dirfd.fd = open_directory(s.dir);
    s.lock = detail::DirLock::acquire(s.dir, s.job_id, s.options.lock_wait);
    detail::remove_stale_temporaries(s.dirfd.fd, s.dir, false);
  }
}

Checkpointer::~Checkpointer() {
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.stopping = true;
  }
  s.cv.notify_all();
  if (s.thread.joinable()) s.thread.join();
  if (s.error) {
    try {
      std::rethrow_exception(s.error);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[trun.checkpoint] the last async save failed: %s\n", e.what());
    }
  }
}

size_t LoadedTensor::numel() const {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

const LoadedTensor* Checkpoint::find(const std::string& section, const std::string& name) const {
  const auto* list = section == "model" ? &model : section == "optimizer" ? &optimizer : nullptr;
  if (!list) return nullptr;
  for (const auto& t : *list)
    if (t.name == name) return &t;
  return nullptr;
}

void Checkpoint::copy_to(const std::string& section, const std::string& name, void* dst,
                         size_t numel, DataType dtype) const {
  const LoadedTensor* t = find(section, name);
  if (!t)
    throw CheckpointError("checkpoint " + path + " has no " + section + " tensor '" + name + "'");
  if (t->dtype != dtype || t->numel() != numel)
    throw CheckpointError("checkpoint " + path + ": " + section + " tensor '" + name + "' is " +
                          dtype_key(t->dtype) + " x " + std::to_string(t->numel()) +
                          ", the caller expects " + dtype_key(dtype) + " x " +
                          std::to_string(numel));
  if (!t->bytes.empty()) detail::copy_bytes(dst, t->bytes.data(), t->bytes.size());
}

const std::string& Checkpointer::dir() const { return state_->dir; }
const std::string& Checkpointer::job_id() const { return state_->job_id; }
std::chrono::nanoseconds Checkpointer::last_blocked() const { return state_->last_blocked; }
std::chrono::nanoseconds Checkpointer::last_write() const { return state_->last_write; }

void Checkpointer::save(const SaveRequest& req) {
  State& s = *state_;
  detail::progress::PhaseScope phase(base::progress::Phase::kCheckpointSave);
  const auto t0 = Clock::now();
  size_t total = 0;
  json metadata = check_save_request(req, &total);
  if (!s.is_writer()) {
    s.last_blocked = Clock::now() - t0;
    return;
  }

  // One save in flight: wait for the previous one (and surface its failure).
  s.wait();
  std::unique_ptr<Snapshot> snap = s.take_snapshot(req, std::move(metadata), total);

  if (!s.options.async) {
    const auto w0 = Clock::now();
    try {
      s.write(*snap);
    } catch (...) {
      std::lock_guard<std::mutex> lock(s.mu);
      s.spare = std::move(snap);
      throw;
    }
    s.last_write = Clock::now() - w0;
    s.last_blocked = Clock::now() - t0;
    std::lock_guard<std::mutex> lock(s.mu);
    s.spare = std::move(snap);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.pending = std::move(snap);
    s.busy = true;
    if (!s.thread.joinable()) s.thread = std::thread([&s] { s.writer_loop(); });
  }
  s.cv.notify_all();
  s.last_blocked = Clock::now() - t0;
}

std::unique_ptr<Snapshot> Checkpointer::State::take_snapshot(const SaveRequest& req, json metadata,
                                                             size_t total) {
  std::unique_ptr<Snapshot> snap;
  {
    std::lock_guard<std::mutex> lock(mu);
    snap = spare ? std::move(spare) : std::make_unique<Snapshot>();
  }
  snap->step = req.step;
  snap->world_size = options.group ? options.group->size() : 1;
  snap->pieces.clear();
  snap->sampler = req.sampler;
  snap->metadata = std::move(metadata);
  if (options.async && snap->staging_capacity < total) {
    snap->staging.reset(new unsigned char[total]);
    snap->staging_capacity = total;
  }
  uint64_t offset = 0;
  auto add = [&](const std::vector<TensorRef>& list, const char* section) {
    for (const auto& t : list) {
      offset = (offset + kAlign - 1) / kAlign * kAlign;
      const size_t bytes = nbytes_of(t.shape, t.dtype, t.name);
      const auto* src = static_cast<const unsigned char*>(t.data);
      if (options.async && bytes > 0) {
        detail::copy_bytes(snap->staging.get() + offset, src, bytes);
        src = snap->staging.get() + offset;
      }
      snap->pieces.push_back({section, t.name, t.dtype, t.shape, src, bytes, offset});
      offset += bytes;
    }
  };
  add(req.model, "model");
  add(req.optimizer, "optimizer");
  snap->data_size = offset;
  return snap;
}

void Checkpointer::State::writer_loop() {
  std::unique_lock<std::mutex> lock(mu);
  for (;;) {
    cv.wait(lock, [&] { return stopping || pending; });
    if (!pending) return;
    std::unique_ptr<Snapshot> snap = std::move(pending);
    lock.unlock();
    std::exception_ptr err;
    const auto w0 = Clock::now();
    try {
      write(*snap);
    } catch (...) {
      err = std::current_exception();
    }
    const auto took = Clock::now() - w0;
    lock.lock();
    last_write = took;
    error = err;
    spare = std::move(snap);
    busy = false;
    cv.notify_all();
  }
}

void Checkpointer::wait() { state_->wait(); }

void Checkpointer::State::wait() {
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return !busy; });
  if (error) {
    std::exception_ptr e = error;
    error = nullptr;
    std::rethrow_exception(e);
  }
}

std::vector<uint64_t> Checkpointer::list_steps() const {
  std::vector<uint64_t> steps;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(state_->dir, ec))
    if (auto s = parse_step_name(entry.path().filename().string())) steps.push_back(*s);
  std::sort(steps.begin(), steps.end());
  return steps;
}

}  // namespace trun::worker
