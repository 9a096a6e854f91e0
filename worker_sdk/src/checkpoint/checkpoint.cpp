#include "trun/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>
#include <thread>

#include "worker_sdk/src/checkpoint/directory.h"
#include "worker_sdk/src/checkpoint/format.h"
#include "worker_sdk/src/reduce.h"

namespace trun::worker {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

using namespace ckpt;

namespace {

// What the writer needs: the manifest without offsets' checksums, and where each tensor's bytes
// are (the caller's memory in sync mode, the staging buffer in async mode).
struct Snapshot {
  struct Piece {
    std::string section, name;
    DataType dtype;
    std::vector<int64_t> shape;
    const unsigned char* data;
    size_t nbytes;
    uint64_t offset;
  };
  uint64_t step = 0;
  int world_size = 1;
  std::vector<Piece> pieces;
  uint64_t data_size = 0;
  std::optional<SamplerState> sampler;
  json metadata;
  // Async staging memory (reused across saves).
  std::unique_ptr<unsigned char[]> staging;
  size_t staging_capacity = 0;
};

std::string default_job_id() {
  for (const char* var : {"TRUN_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"}) {
    const char* v = std::getenv(var);
    if (v && *v) return v;
  }
  return "none";
}

}  // namespace

struct Checkpointer::State {
  std::string dir;
  Fd dirfd;  // DIR, on the writer: every file it writes is opened relative to it
  CheckpointerOptions options;
  std::string job_id;
  std::set<std::string> own_jobs;  // job_id, "" (checkpoints older than job ids), an adopted one
  std::shared_ptr<detail::DirLock> lock;
  std::chrono::nanoseconds last_blocked{0};
  std::chrono::nanoseconds last_write{0};

  // Async writer: one pending snapshot at most.
  std::mutex mu;
  std::condition_variable cv;
  std::unique_ptr<Snapshot> pending;
  std::unique_ptr<Snapshot> spare;  // staging buffer reused by the next snapshot
  bool busy = false;
  bool stopping = false;
  std::exception_ptr error;
  std::thread thread;

  bool is_writer() const { return !options.group || options.group->rank() == 0; }
  void write(const Snapshot& snap);
  void writer_loop();
  void wait();
  // Removes this job's checkpoints beyond `limit` older than `step` (never the one `latest`
  // names), and with `drop_future` those after `step`.
  void retain(uint64_t step, int limit, bool drop_future);
  // The job that saved step_dir; nullopt when its manifest does not verify.
  std::optional<std::string> job_of(const std::string& step_dir) const;
  std::string latest_name() const;
  std::optional<Checkpoint> choose(bool writer);
  void write_small_file(const std::string& name, const std::string& text);
};

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
  const auto t0 = Clock::now();
  // Validate on every rank, so that a bad request fails everywhere alike.
  // Within the bounds the reader enforces (format.h), so that every checkpoint saved loads.
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
  size_t total = 0;
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
      total = (total + kAlign - 1) / kAlign * kAlign + bytes;
    }
  };
  check(req.model, "model");
  check(req.optimizer, "optimizer");
  if (!s.is_writer()) {
    s.last_blocked = Clock::now() - t0;
    return;
  }

  // One save in flight: wait for the previous one (and surface its failure).
  s.wait();

  std::unique_ptr<Snapshot> snap;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    snap = s.spare ? std::move(s.spare) : std::make_unique<Snapshot>();
  }
  snap->step = req.step;
  snap->world_size = s.options.group ? s.options.group->size() : 1;
  snap->pieces.clear();
  snap->sampler = req.sampler;
  snap->metadata = std::move(metadata);
  if (s.options.async && snap->staging_capacity < total) {
    snap->staging.reset(new unsigned char[total]);
    snap->staging_capacity = total;
  }
  uint64_t offset = 0;
  auto add = [&](const std::vector<TensorRef>& list, const char* section) {
    for (const auto& t : list) {
      offset = (offset + kAlign - 1) / kAlign * kAlign;
      const size_t bytes = nbytes_of(t.shape, t.dtype, t.name);
      const auto* src = static_cast<const unsigned char*>(t.data);
      if (s.options.async && bytes > 0) {
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

std::string Checkpointer::State::latest_name() const {
  std::string latest;
  try {
    latest = read_small_file(dir, "latest", kMaxSmallFileBytes).value_or("");
  } catch (const CheckpointError& e) {
    std::fprintf(stderr, "[trun.checkpoint] ignoring %s/latest: %s\n", dir.c_str(), e.what());
  }
  while (!latest.empty() && (latest.back() == '\n' || latest.back() == ' ')) latest.pop_back();
  return parse_step_name(latest) ? latest : "";
}

// Writes DIR/<name> atomically (a new temporary file, fsync, rename, fsync DIR). The rename
// replaces whatever is at DIR/<name>, a symbolic link included, without following it.
void Checkpointer::State::write_small_file(const std::string& name, const std::string& text) {
  const std::string tmp_name = "." + name + ".tmp" + detail::temp_suffix();
  const std::string tmp = dir + "/" + tmp_name;
  try {
    {
      // A leftover of this process's name (pid reuse, or planted) is unlinked, never followed.
      Fd f(create_exclusive_at(dirfd.fd, tmp_name, tmp, true));
      write_all(f.fd, text.data(), text.size(), 0, tmp);
      if (options.fsync) fsync_fd(f.fd, tmp);
    }
    if (::renameat(dirfd.fd, tmp_name.c_str(), dirfd.fd, name.c_str()) != 0)
      io_fail("rename", dir + "/" + name, errno);
    if (options.fsync) fsync_fd(dirfd.fd, dir);
  } catch (...) {
    ::unlinkat(dirfd.fd, tmp_name.c_str(), 0);
    throw;
  }
}

void Checkpointer::State::write(const Snapshot& snap) {
  auto phase = [&](const char* p) {
    if (options.on_phase) options.on_phase(p);
  };
  const std::string final_name = step_name(snap.step);
  const std::string final_dir = dir + "/" + final_name;
  const std::string tmp_name = ".tmp-" + final_name + detail::temp_suffix();
  const std::string tmp_dir = dir + "/" + tmp_name;
  {
    // Another job's step of the same number is never replaced.
    const auto owner = job_of(final_dir);
    if (owner && !own_jobs.count(*owner))
      throw CheckpointOwnerError("checkpoint: " + final_dir + " belongs to job '" + *owner +
                                 "', not to this job ('" + job_id + "'); not replacing it");
  }
  // Make room first where keep_last allows (a full disk then still takes the new checkpoint).
  if (options.keep_last >= 2) retain(snap.step, options.keep_last - 1, false);
  // Every file of the new checkpoint is created new (O_EXCL, O_NOFOLLOW) in a directory this
  // save creates and opens without following a link.
  remove_tree_at(dirfd.fd, tmp_name);
  if (::mkdirat(dirfd.fd, tmp_name.c_str(), 0755) != 0) io_fail("mkdir", tmp_dir, errno);
  try {
    Fd tmpfd(::openat(dirfd.fd, tmp_name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (tmpfd.fd < 0) io_fail("open", tmp_dir, errno);
    // Data file, checksumming each tensor as it goes out.
    json tensors = json::array();
    {
      const std::string path = tmp_dir + "/data";
      Fd f(create_exclusive_at(tmpfd.fd, "data", path, false));
      for (const auto& p : snap.pieces) {
        const uint32_t crc = crc32c(p.data, p.nbytes);
        if (p.nbytes > 0) write_all(f.fd, p.data, p.nbytes, p.offset, path);
        tensors.push_back({{"section", p.section},
                           {"name", p.name},
                           {"dtype", dtype_key(p.dtype)},
                           {"shape", p.shape},
                           {"offset", p.offset},
                           {"nbytes", p.nbytes},
                           {"crc32c", crc}});
      }
      if (::ftruncate(f.fd, static_cast<off_t>(snap.data_size)) != 0)
        io_fail("truncate", path, errno);
      if (options.fsync) fsync_fd(f.fd, path);
    }
    phase("data_written");

    json body = {{"format", kFormat},
                 {"version", kVersion},
                 {"step", snap.step},
                 {"world_size", snap.world_size},
                 {"job", job_id},
                 {"host", detail::host_name()},
                 {"created_unix_ms", unix_ms()},
                 {"data_file", "data"},
                 {"data_size", snap.data_size},
                 {"tensors", std::move(tensors)},
                 {"metadata", snap.metadata}};
    body["sampler"] = snap.sampler ? json::parse(sampler_state_to_json(*snap.sampler)) : json();
    const std::string body_text = json_text(body);
    json manifest = {{"manifest", std::move(body)},
                     {"crc32c", crc32c(body_text.data(), body_text.size())}};
    {
      const std::string text = json_text(manifest, 1) + "\n";
      const std::string path = tmp_dir + "/manifest.json";
      if (text.size() > kMaxManifestBytes)
        throw CheckpointError("checkpoint: the manifest of " + final_name + " would be " +
                              std::to_string(text.size()) + " bytes, more than the " +
                              std::to_string(kMaxManifestBytes) +
                              " a reader accepts (fewer tensors or less metadata)");
      Fd f(create_exclusive_at(tmpfd.fd, "manifest.json", path, false));
      write_all(f.fd, text.data(), text.size(), 0, path);
      if (options.fsync) fsync_fd(f.fd, path);
    }
    phase("manifest_written");
    if (options.fsync) fsync_fd(tmpfd.fd, tmp_dir);
    phase("synced");

    // Into place. An existing step_<n> (the same step saved again after a restart) is swapped
    // out atomically, so some version of the step is always visible. Something else under that
    // name (a symbolic link, a file) is not replaced: it is named instead.
    struct stat fst {};
    if (::fstatat(dirfd.fd, final_name.c_str(), &fst, AT_SYMLINK_NOFOLLOW) == 0 &&
        !S_ISDIR(fst.st_mode))
      throw CheckpointError("checkpoint: " + final_dir + " is " +
                            (S_ISLNK(fst.st_mode) ? "a symbolic link" : "not a directory") +
                            ", where this save puts its step directory; trun does not replace "
                            "it. Remove it");
    if (::renameat(dirfd.fd, tmp_name.c_str(), dirfd.fd, final_name.c_str()) != 0) {
      if (errno != ENOTEMPTY && errno != EEXIST) io_fail("rename into place", final_dir, errno);
      if (::renameat2(dirfd.fd, tmp_name.c_str(), dirfd.fd, final_name.c_str(), RENAME_EXCHANGE) !=
          0)
        io_fail("exchange with the existing", final_dir, errno);
    }
    remove_tree_at(dirfd.fd, tmp_name);  // the old version, after an exchange
    if (options.fsync) fsync_fd(dirfd.fd, dir);
    phase("renamed");

    write_small_file("latest", final_name + "\n");
    phase("latest_written");
  } catch (...) {
    // A failed save leaves nothing behind (ENOSPC: the partial files would keep the disk full).
    remove_tree_at(dirfd.fd, tmp_name);
    throw;
  }

  // Retention: steps after this one are an abandoned history; keep the newest keep_last.
  retain(snap.step, options.keep_last - 1, true);
  detail::remove_stale_temporaries(dirfd.fd, dir, true);
  phase("done");
}

std::optional<std::string> Checkpointer::State::job_of(const std::string& step_dir) const {
  try {
    return read_manifest(step_dir).value("job", "");
  } catch (const CheckpointError&) {
    return std::nullopt;
  }
}

void Checkpointer::State::retain(uint64_t step, int limit, bool drop_future) {
  const std::string latest = latest_name();
  std::vector<uint64_t> older;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const auto s = parse_step_name(name);
    if (!s || *s == step || name == latest) continue;
    if (*s > step && !drop_future) continue;
    // Only this job's, and only what verifies as a manifest: damaged ones are never removed.
    const auto owner = job_of(entry.path().string());
    if (!owner || !own_jobs.count(*owner)) continue;
    if (*s > step)
      remove_tree_at(dirfd.fd, name);
    else
      older.push_back(*s);
  }
  std::sort(older.begin(), older.end(), std::greater<uint64_t>());
  // `latest` (when older than `step`) counts towards the limit.
  const auto l = parse_step_name(latest);
  int kept = (l && *l < step) ? 1 : 0;
  for (uint64_t s : older) {
    if (kept < limit) {
      ++kept;
      continue;
    }
    remove_tree_at(dirfd.fd, step_name(s));
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

}  // namespace

// Rank 0 (or a process alone) decides; `writer` also quarantines what does not verify.
std::optional<Checkpoint> Checkpointer::State::choose(bool writer) {
  // The checkpoint `latest` names first, then every other step, newest first.
  const std::string latest = latest_name();
  std::vector<std::string> candidates;
  if (!latest.empty()) candidates.push_back(latest);
  std::vector<uint64_t> steps;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (auto s = parse_step_name(entry.path().filename().string())) steps.push_back(*s);
  std::sort(steps.begin(), steps.end(), std::greater<uint64_t>());
  for (uint64_t s : steps)
    if (step_name(s) != latest) candidates.push_back(step_name(s));

  std::vector<std::pair<std::string, std::string>> damaged, foreign;  // name, why / job
  std::optional<Checkpoint> chosen;
  bool latest_gone = false;
  for (const auto& name : candidates) {
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

std::optional<Checkpoint> Checkpointer::load_latest() {
  State& s = *state_;
  const bool collective = s.options.group && s.options.group->size() > 1;
  if (!s.is_writer()) {
    // Rank 0 decided and wrote its decision before the barrier.
    s.options.group->barrier();
    json d;
    try {
      const auto text = read_small_file(s.dir, ".resume", kMaxResumeBytes);
      if (text && json_depth(text->data(), text->size(), kMaxJsonDepth) <= kMaxJsonDepth)
        d = json::parse(*text);
    } catch (const CheckpointError& e) {
      std::fprintf(stderr, "[trun.checkpoint] ignoring %s/.resume: %s\n", s.dir.c_str(), e.what());
    } catch (const json::exception&) {
      d = json();
    }
    if (!d.is_object()) return s.choose(false);  // rank 0 could not write it (full disk)
    if (d.contains("refused")) {
      const json& refused = d.at("refused");
      const std::string why =
          "checkpoint: rank 0 refused to resume from " + s.dir + ": " +
          (refused.is_string() ? refused.get<std::string>() : json_text(refused));
      const auto owner = d.find("owner");
      if (owner != d.end() && owner->is_boolean() && owner->get<bool>())
        throw CheckpointOwnerError(why);
      throw CheckpointError(why);
    }
    if (!d.contains("load")) return std::nullopt;
    const json& load = d.at("load");
    if (!load.is_string() || !parse_step_name(load.get<std::string>()))
      throw CheckpointError("checkpoint: " + s.dir + "/.resume names " +
                            json_text(load).substr(0, 80) + ", which is not a step");
    const std::string path = s.dir + "/" + load.get<std::string>();
    Checkpoint ck = load_with_retry(path);
    s.own_jobs.insert(ck.job_id);
    return ck;
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
}

}  // namespace trun::worker
