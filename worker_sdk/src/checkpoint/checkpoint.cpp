#include "trun/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>

#include "worker_sdk/src/reduce.h"

namespace trun::worker {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

namespace {

constexpr const char* kFormat = "trun-checkpoint";
constexpr int kVersion = 1;
constexpr size_t kAlign = 64;
constexpr size_t kIoChunk = size_t{64} << 20;
constexpr size_t kMaxManifestBytes = size_t{256} << 20;

std::string errno_text(int err) { return std::strerror(err); }

[[noreturn]] void io_fail(const std::string& what, const std::string& path, int err) {
  throw CheckpointError("checkpoint: " + what + " " + path + ": " + errno_text(err));
}

// RAII file descriptor.
struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

void write_all(int fd, const void* data, size_t n, uint64_t offset, const std::string& path) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, std::min(n, kIoChunk), static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      io_fail("write", path, errno);
    }
    p += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
}

void read_all(int fd, void* data, size_t n, uint64_t offset, const std::string& path) {
  auto* p = static_cast<unsigned char*>(data);
  while (n > 0) {
    ssize_t r = ::pread(fd, p, std::min(n, kIoChunk), static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      io_fail("read", path, errno);
    }
    if (r == 0) throw CheckpointError("checkpoint: " + path + " is shorter than its manifest says");
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
}

void fsync_path(const std::string& path, bool directory) {
  Fd f(::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC));
  if (f.fd < 0) io_fail("open (for fsync)", path, errno);
  if (::fsync(f.fd) != 0) io_fail("fsync", path, errno);
}

const char* dtype_key(DataType d) { return dtype_name(d); }

DataType parse_dtype(const std::string& s) {
  for (DataType d : {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16,
                     DataType::kBFloat16, DataType::kInt32, DataType::kInt64})
    if (s == dtype_name(d)) return d;
  throw CheckpointError("unknown dtype '" + s + "'");
}

size_t numel_of(const std::vector<int64_t>& shape, const std::string& name) {
  size_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) throw std::invalid_argument("tensor '" + name + "' has a negative dimension");
    n *= static_cast<size_t>(d);
  }
  return n;
}

std::string step_name(uint64_t step) { return "step_" + std::to_string(step); }

// "step_<digits>" -> step; nullopt for anything else.
std::optional<uint64_t> parse_step_name(const std::string& name) {
  if (name.size() <= 5 || name.compare(0, 5, "step_") != 0) return std::nullopt;
  uint64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || i - 5 >= 19) return std::nullopt;
    v = v * 10 + static_cast<uint64_t>(name[i] - '0');
  }
  return v;
}

int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

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
                          dtype_name(t->dtype) + " x " + std::to_string(t->numel()) +
                          ", the caller expects " + dtype_name(dtype) + " x " +
                          std::to_string(numel));
  if (!t->bytes.empty()) detail::copy_bytes(dst, t->bytes.data(), t->bytes.size());
}

// What the writer needs: the manifest without offsets' checksums, and where each tensor's bytes
// are (the caller's memory in sync mode, the staging buffer in async mode).
struct Checkpointer::Snapshot {
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

Checkpointer::Checkpointer(std::string dir, CheckpointerOptions options)
    : dir_(std::move(dir)), options_(std::move(options)) {
  if (dir_.empty()) throw std::invalid_argument("Checkpointer: empty directory");
  if (options_.keep_last < 1)
    throw std::invalid_argument("Checkpointer: keep_last must be >= 1, got " +
                                std::to_string(options_.keep_last));
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
  if (is_writer()) {
    std::error_code ec;
    fs::create_directories(dir_, ec);
    if (ec) throw CheckpointError("checkpoint: cannot create " + dir_ + ": " + ec.message());
  }
}

Checkpointer::~Checkpointer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (error_) {
    try {
      std::rethrow_exception(error_);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[trun.checkpoint] the last async save failed: %s\n", e.what());
    }
  }
}

bool Checkpointer::is_writer() const { return !options_.group || options_.group->rank() == 0; }

void Checkpointer::save(const SaveRequest& req) {
  const auto t0 = Clock::now();
  // Validate on every rank, so that a bad request fails everywhere alike.
  json metadata;
  try {
    metadata = json::parse(req.metadata.empty() ? "{}" : req.metadata);
  } catch (const json::exception& e) {
    throw std::invalid_argument(std::string("Checkpointer::save: metadata is not JSON: ") +
                                e.what());
  }
  std::set<std::string> seen;
  size_t total = 0;
  auto check = [&](const std::vector<TensorRef>& list, const char* section) {
    for (const auto& t : list) {
      if (t.name.empty())
        throw std::invalid_argument(std::string("Checkpointer::save: a ") + section +
                                    " tensor has an empty name");
      if (!seen.insert(std::string(section) + "/" + t.name).second)
        throw std::invalid_argument(std::string("Checkpointer::save: duplicate ") + section +
                                    " tensor '" + t.name + "'");
      const size_t bytes = numel_of(t.shape, t.name) * dtype_size(t.dtype);
      if (bytes > 0 && !t.data)
        throw std::invalid_argument("Checkpointer::save: tensor '" + t.name + "' has no data");
      total = (total + kAlign - 1) / kAlign * kAlign + bytes;
    }
  };
  check(req.model, "model");
  check(req.optimizer, "optimizer");
  if (!is_writer()) {
    last_blocked_ = Clock::now() - t0;
    return;
  }

  // One save in flight: wait for the previous one (and surface its failure).
  wait();

  std::unique_ptr<Snapshot> snap;
  {
    std::lock_guard<std::mutex> lock(mu_);
    snap = spare_ ? std::move(spare_) : std::make_unique<Snapshot>();
  }
  snap->step = req.step;
  snap->world_size = options_.group ? options_.group->size() : 1;
  snap->pieces.clear();
  snap->sampler = req.sampler;
  snap->metadata = std::move(metadata);
  if (options_.async && snap->staging_capacity < total) {
    snap->staging.reset(new unsigned char[total]);
    snap->staging_capacity = total;
  }
  uint64_t offset = 0;
  auto add = [&](const std::vector<TensorRef>& list, const char* section) {
    for (const auto& t : list) {
      offset = (offset + kAlign - 1) / kAlign * kAlign;
      const size_t bytes = numel_of(t.shape, t.name) * dtype_size(t.dtype);
      const auto* src = static_cast<const unsigned char*>(t.data);
      if (options_.async && bytes > 0) {
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

  if (!options_.async) {
    const auto w0 = Clock::now();
    try {
      write(*snap);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      spare_ = std::move(snap);
      throw;
    }
    last_write_ = Clock::now() - w0;
    last_blocked_ = Clock::now() - t0;
    std::lock_guard<std::mutex> lock(mu_);
    spare_ = std::move(snap);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_ = std::move(snap);
    busy_ = true;
    if (!thread_.joinable()) thread_ = std::thread([this] { writer_loop(); });
  }
  cv_.notify_all();
  last_blocked_ = Clock::now() - t0;
}

void Checkpointer::writer_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || pending_; });
    if (!pending_) return;
    std::unique_ptr<Snapshot> snap = std::move(pending_);
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
    last_write_ = took;
    error_ = err;
    spare_ = std::move(snap);
    busy_ = false;
    cv_.notify_all();
  }
}

void Checkpointer::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !busy_; });
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void Checkpointer::write(const Snapshot& snap) {
  auto phase = [&](const char* p) {
    if (options_.on_phase) options_.on_phase(p);
  };
  const std::string final_name = step_name(snap.step);
  const std::string final_dir = dir_ + "/" + final_name;
  const std::string tmp_dir = dir_ + "/.tmp-" + final_name + "-" + std::to_string(::getpid());
  std::error_code ec;
  fs::remove_all(tmp_dir, ec);
  if (::mkdir(tmp_dir.c_str(), 0755) != 0) io_fail("mkdir", tmp_dir, errno);

  // Data file, checksumming each tensor as it goes out.
  json tensors = json::array();
  {
    const std::string path = tmp_dir + "/data";
    Fd f(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (f.fd < 0) io_fail("create", path, errno);
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
    if (options_.fsync && ::fsync(f.fd) != 0) io_fail("fsync", path, errno);
  }
  phase("data_written");

  json body = {{"format", kFormat},
               {"version", kVersion},
               {"step", snap.step},
               {"world_size", snap.world_size},
               {"created_unix_ms", unix_ms()},
               {"data_file", "data"},
               {"data_size", snap.data_size},
               {"tensors", std::move(tensors)},
               {"metadata", snap.metadata}};
  body["sampler"] = snap.sampler ? json::parse(sampler_state_to_json(*snap.sampler)) : json();
  const std::string body_text = body.dump();
  json manifest = {{"manifest", std::move(body)},
                   {"crc32c", crc32c(body_text.data(), body_text.size())}};
  {
    const std::string text = manifest.dump(1) + "\n";
    const std::string path = tmp_dir + "/manifest.json";
    Fd f(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (f.fd < 0) io_fail("create", path, errno);
    write_all(f.fd, text.data(), text.size(), 0, path);
    if (options_.fsync && ::fsync(f.fd) != 0) io_fail("fsync", path, errno);
  }
  phase("manifest_written");
  if (options_.fsync) fsync_path(tmp_dir, true);
  phase("synced");

  // Into place. An existing step_<n> (the same step saved again after a restart) is swapped out
  // atomically, so some version of the step is always visible.
  if (::rename(tmp_dir.c_str(), final_dir.c_str()) != 0) {
    if (errno != ENOTEMPTY && errno != EEXIST) io_fail("rename into place", final_dir, errno);
    if (::renameat2(AT_FDCWD, tmp_dir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) != 0)
      io_fail("exchange with the existing", final_dir, errno);
    fs::remove_all(tmp_dir, ec);  // now holds the old version
  }
  if (options_.fsync) fsync_path(dir_, true);
  phase("renamed");

  {
    const std::string tmp = dir_ + "/.latest.tmp-" + std::to_string(::getpid());
    const std::string text = final_name + "\n";
    {
      Fd f(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
      if (f.fd < 0) io_fail("create", tmp, errno);
      write_all(f.fd, text.data(), text.size(), 0, tmp);
      if (options_.fsync && ::fsync(f.fd) != 0) io_fail("fsync", tmp, errno);
    }
    const std::string latest = dir_ + "/latest";
    if (::rename(tmp.c_str(), latest.c_str()) != 0) io_fail("rename", latest, errno);
    if (options_.fsync) fsync_path(dir_, true);
  }
  phase("latest_written");

  // Retention: steps after this one are an abandoned history; keep the newest keep_last of the
  // rest; temporary leftovers of crashed writers go too.
  std::vector<uint64_t> steps;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(".tmp-", 0) == 0 || name.rfind(".latest.tmp-", 0) == 0) {
      fs::remove_all(entry.path(), ec);
      continue;
    }
    if (auto s = parse_step_name(name)) steps.push_back(*s);
  }
  std::sort(steps.begin(), steps.end(), std::greater<uint64_t>());
  int kept = 0;
  for (uint64_t s : steps) {
    if (s > snap.step || (s < snap.step && kept >= options_.keep_last)) {
      fs::remove_all(dir_ + "/" + step_name(s), ec);
      continue;
    }
    if (s <= snap.step) ++kept;
  }
  phase("done");
}

std::vector<uint64_t> Checkpointer::list_steps() const {
  std::vector<uint64_t> steps;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec))
    if (auto s = parse_step_name(entry.path().filename().string())) steps.push_back(*s);
  std::sort(steps.begin(), steps.end());
  return steps;
}

Checkpoint Checkpointer::load(const std::string& step_dir) {
  const std::string where = "checkpoint " + step_dir;
  auto bad = [&](const std::string& why) { return CheckpointError(where + ": " + why); };

  const std::string mpath = step_dir + "/manifest.json";
  std::string text;
  {
    Fd f(::open(mpath.c_str(), O_RDONLY | O_CLOEXEC));
    if (f.fd < 0) throw bad("cannot open manifest.json: " + errno_text(errno));
    struct stat st {};
    if (::fstat(f.fd, &st) != 0) throw bad("cannot stat manifest.json: " + errno_text(errno));
    if (static_cast<size_t>(st.st_size) > kMaxManifestBytes)
      throw bad("manifest.json is implausibly large");
    text.resize(static_cast<size_t>(st.st_size));
    read_all(f.fd, text.data(), text.size(), 0, mpath);
  }
  json body;
  try {
    json m = json::parse(text);
    body = m.at("manifest");
    const uint32_t want = m.at("crc32c").get<uint32_t>();
    const std::string canon = body.dump();
    const uint32_t got = crc32c(canon.data(), canon.size());
    if (want != got)
      throw bad("manifest CRC32C mismatch (stored " + std::to_string(want) + ", computed " +
                std::to_string(got) + ")");
    if (body.at("format").get<std::string>() != kFormat)
      throw bad("not a trun checkpoint (format '" + body.at("format").get<std::string>() + "')");
    if (body.at("version").get<int>() != kVersion)
      throw bad("unsupported version " + std::to_string(body.at("version").get<int>()));
  } catch (const json::exception& e) {
    throw bad(std::string("manifest.json is malformed: ") + e.what());
  }

  Checkpoint ck;
  ck.path = step_dir;
  uint64_t data_size = 0;
  std::string data_file;
  try {
    ck.step = body.at("step").get<uint64_t>();
    ck.world_size = body.at("world_size").get<int>();
    data_size = body.at("data_size").get<uint64_t>();
    data_file = body.at("data_file").get<std::string>();
    ck.metadata = body.at("metadata").dump();
    if (!body.at("sampler").is_null())
      ck.sampler = sampler_state_from_json(body.at("sampler").dump());
  } catch (const json::exception& e) {
    throw bad(std::string("manifest.json has a bad field: ") + e.what());
  } catch (const std::invalid_argument& e) {
    throw bad(e.what());
  }
  if (data_file.empty() || data_file.find('/') != std::string::npos || data_file[0] == '.')
    throw bad("bad data file name '" + data_file + "'");
  const std::string dpath = step_dir + "/" + data_file;
  Fd f(::open(dpath.c_str(), O_RDONLY | O_CLOEXEC));
  if (f.fd < 0) throw bad("cannot open " + data_file + ": " + errno_text(errno));
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) throw bad("cannot stat " + data_file + ": " + errno_text(errno));
  if (static_cast<uint64_t>(st.st_size) != data_size)
    throw bad(data_file + " has " + std::to_string(st.st_size) + " bytes, the manifest says " +
              std::to_string(data_size));
  try {
    for (const auto& t : body.at("tensors")) {
      LoadedTensor lt;
      const std::string section = t.at("section").get<std::string>();
      lt.name = t.at("name").get<std::string>();
      lt.dtype = parse_dtype(t.at("dtype").get<std::string>());
      lt.shape = t.at("shape").get<std::vector<int64_t>>();
      const uint64_t off = t.at("offset").get<uint64_t>();
      const uint64_t nbytes = t.at("nbytes").get<uint64_t>();
      const uint32_t want = t.at("crc32c").get<uint32_t>();
      const std::string label = section + " tensor '" + lt.name + "'";
      for (int64_t d : lt.shape)
        if (d < 0) throw bad(label + " has a negative dimension");
      if (lt.numel() * dtype_size(lt.dtype) != nbytes)
        throw bad(label + ": shape and dtype do not match its byte count");
      if (off > data_size || nbytes > data_size - off)
        throw bad(label + " lies outside the data file");
      lt.bytes.resize(nbytes);
      if (nbytes > 0) read_all(f.fd, lt.bytes.data(), nbytes, off, dpath);
      const uint32_t got = crc32c(lt.bytes.data(), nbytes);
      if (got != want)
        throw bad(label + ": CRC32C mismatch (manifest " + std::to_string(want) + ", data " +
                  std::to_string(got) + ")");
      if (section == "model")
        ck.model.push_back(std::move(lt));
      else if (section == "optimizer")
        ck.optimizer.push_back(std::move(lt));
      else
        throw bad("unknown section '" + section + "'");
    }
  } catch (const json::exception& e) {
    throw bad(std::string("manifest.json has a bad tensor entry: ") + e.what());
  }
  return ck;
}

std::optional<Checkpoint> Checkpointer::load_latest() {
  if (is_writer()) {
    try {
      wait();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[trun.checkpoint] the last async save failed: %s\n", e.what());
    }
  }
  if (options_.group && options_.group->size() > 1) options_.group->barrier();

  // The checkpoint `latest` names first, then every other step, newest first.
  std::vector<std::string> candidates;
  {
    std::string latest;
    if (FILE* f = std::fopen((dir_ + "/latest").c_str(), "r")) {
      char buf[64] = {};
      if (std::fgets(buf, sizeof buf, f)) latest = buf;
      std::fclose(f);
    }
    while (!latest.empty() && (latest.back() == '\n' || latest.back() == ' ')) latest.pop_back();
    if (parse_step_name(latest)) candidates.push_back(latest);
  }
  std::vector<uint64_t> steps = list_steps();
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    std::string name = step_name(*it);
    if (std::find(candidates.begin(), candidates.end(), name) == candidates.end())
      candidates.push_back(name);
  }
  for (const auto& name : candidates) {
    const std::string path = dir_ + "/" + name;
    std::error_code ec;
    if (!fs::is_directory(path, ec)) {
      std::fprintf(stderr,
                   "[trun.checkpoint] %s/latest names %s, which does not exist; "
                   "falling back\n",
                   dir_.c_str(), name.c_str());
      continue;
    }
    try {
      Checkpoint ck = load(path);
      if (step_name(ck.step) != name)
        throw CheckpointError("checkpoint " + path + ": its manifest says step " +
                              std::to_string(ck.step));
      return ck;
    } catch (const CheckpointError& e) {
      std::fprintf(stderr, "[trun.checkpoint] skipping a damaged or incomplete checkpoint: %s\n",
                   e.what());
    }
  }
  return std::nullopt;
}

}  // namespace trun::worker
