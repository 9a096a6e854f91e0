// Writing a checkpoint (Checkpointer::State, checkpointer_state.h): a step directory built
// under a temporary name (data file, manifest), moved into place, then `latest`; retention of
// this job's older steps; and the `latest` file itself.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <functional>

#include "worker_sdk/src/checkpoint/checkpointer_state.h"
#include "worker_sdk/src/checkpoint/directory.h"
#include "worker_sdk/src/checkpoint/format.h"

namespace trun::worker {

namespace fs = std::filesystem;
using json = nlohmann::json;

using namespace ckpt;

namespace {

// The data file of a new step directory (`tmpfd` is it open, `tmp_dir` names it), checksumming
// each tensor as it goes out; the manifest's "tensors".
json write_data_file(const Snapshot& snap, int tmpfd, const std::string& tmp_dir, bool fsync) {
  json tensors = json::array();
  const std::string path = tmp_dir + "/data";
  Fd f(create_exclusive_at(tmpfd, "data", path, false));
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
  if (::ftruncate(f.fd, static_cast<off_t>(snap.data_size)) != 0) io_fail("truncate", path, errno);
  if (fsync) fsync_fd(f.fd, path);
  return tensors;
}

// The manifest of a new step directory: its body and the body's checksum.
void write_manifest_file(const Snapshot& snap, json tensors, const std::string& job_id, int tmpfd,
                         const std::string& tmp_dir, const std::string& final_name, bool fsync) {
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
  const std::string text = json_text(manifest, 1) + "\n";
  const std::string path = tmp_dir + "/manifest.json";
  if (text.size() > kMaxManifestBytes)
    throw CheckpointError("checkpoint: the manifest of " + final_name + " would be " +
                          std::to_string(text.size()) + " bytes, more than the " +
                          std::to_string(kMaxManifestBytes) +
                          " a reader accepts (fewer tensors or less metadata)");
  Fd f(create_exclusive_at(tmpfd, "manifest.json", path, false));
  write_all(f.fd, text.data(), text.size(), 0, path);
  if (fsync) fsync_fd(f.fd, path);
}

// Renames DIR/<tmp_name> to DIR/<final_name>. An existing step_<n> (the same step saved again
// after a restart) is swapped out atomically, so some version of the step is always visible.
// Something else under that name (a symbolic link, a file) is not replaced: it is named instead.
void move_into_place(int dirfd, const std::string& tmp_name, const std::string& final_name,
                     const std::string& final_dir) {
  struct stat fst {};
  if (::fstatat(dirfd, final_name.c_str(), &fst, AT_SYMLINK_NOFOLLOW) == 0 && !S_ISDIR(fst.st_mode))
    throw CheckpointError("checkpoint: " + final_dir + " is " +
                          (S_ISLNK(fst.st_mode) ? "a symbolic link" : "not a directory") +
                          ", where this save puts its step directory; trun does not replace "
                          "it. Remove it");
  if (::renameat(dirfd, tmp_name.c_str(), dirfd, final_name.c_str()) != 0) {
    if (errno != ENOTEMPTY && errno != EEXIST) io_fail("rename into place", final_dir, errno);
    if (::renameat2(dirfd, tmp_name.c_str(), dirfd, final_name.c_str(), RENAME_EXCHANGE) != 0)
      io_fail("exchange with the existing", final_dir, errno);
  }
  remove_tree_at(dirfd, tmp_name);  // the old version, after an exchange
}

}  // namespace

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
    json tensors = write_data_file(snap, tmpfd.fd, tmp_dir, options.fsync);
    phase("data_written");
    write_manifest_file(snap, std::move(tensors), job_id, tmpfd.fd, tmp_dir, final_name,
                        options.fsync);
    phase("manifest_written");
    if (options.fsync) fsync_fd(tmpfd.fd, tmp_dir);
    phase("synced");
    move_into_place(dirfd.fd, tmp_name, final_name, final_dir);
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

}  // namespace trun::worker
