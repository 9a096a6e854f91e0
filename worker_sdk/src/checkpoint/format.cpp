#include "worker_sdk/src/checkpoint/format.h"

#include <dirent.h>
#include <sys/resource.h>

#include <climits>
#include <fstream>
#include <new>
#include <set>
#include <utility>

namespace trun::worker {

using namespace ckpt;

namespace ckpt {

namespace {

const char* kind_of(mode_t mode) {
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  if (S_ISREG(mode)) return "a regular file";
  return "not a regular file";
}

// "<shown> is a symbolic link (to T)..." or "<shown> is a FIFO...": what is at `name` instead of
// a regular file.
CheckpointError not_regular(int dirfd, const std::string& name, const std::string& shown,
                            mode_t mode) {
  std::string what = shown + " is " + kind_of(mode);
  if (S_ISLNK(mode)) {
    char target[512];
    const ssize_t n = ::readlinkat(dirfd, name.c_str(), target, sizeof target - 1);
    if (n > 0) what += " (to " + std::string(target, static_cast<size_t>(n)) + ")";
  }
  return CheckpointError("checkpoint: " + what +
                         ", where a regular file is expected; trun never reads or writes through "
                         "it. Remove it (a checkpoint directory's files are regular files)");
}

}  // namespace

int json_depth(const char* text, size_t n, int limit) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < n; ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > deepest) deepest = depth;
      if (deepest > limit) return deepest;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

int open_directory(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) io_fail("open directory", path, errno);
  return fd;
}

int open_regular_at(int dirfd, const std::string& name, const std::string& shown, int flags) {
  const int fd = ::openat(dirfd, name.c_str(), flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    struct stat st {};
    if (err != ENOENT && ::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
        !S_ISREG(st.st_mode))
      throw not_regular(dirfd, name, shown, st.st_mode);
    io_fail("open", shown, err);
  }
  Fd f(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) io_fail("stat", shown, errno);
  if (!S_ISREG(st.st_mode)) throw not_regular(dirfd, name, shown, st.st_mode);
  f.fd = -1;
  return fd;
}

int create_exclusive_at(int dirfd, const std::string& name, const std::string& shown,
                        bool replace_stale) {
  for (int attempt = 0;; ++attempt) {
    // O_EXCL: an existing entry, a symbolic link included, is never opened.
    const int fd =
        ::openat(dirfd, name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0) return fd;
    const int err = errno;
    if (err != EEXIST) io_fail("create", shown, err);
    struct stat st {};
    const bool known = ::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
    const std::string kind = known ? kind_of(st.st_mode) : "an entry";
    if (!replace_stale || attempt > 0)
      throw CheckpointError("checkpoint: cannot create " + shown + ": " + kind +
                                " is already there (a checkpoint's files are created new, never "
                                "written through what is in their place)",
                            EEXIST);
    std::fprintf(stderr, "[trun.checkpoint] removing the leftover %s (%s) before writing it\n",
                 shown.c_str(), kind.c_str());
    if (::unlinkat(dirfd, name.c_str(), 0) != 0 && errno != ENOENT)
      io_fail("remove the leftover", shown, errno);
  }
}

std::optional<std::string> read_small_file(const std::string& dir, const std::string& name,
                                           size_t max_bytes) {
  Fd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NONBLOCK | O_CLOEXEC));
  if (d.fd < 0) {
    if (errno == ENOENT) return std::nullopt;
    io_fail("open directory", dir, errno);
  }
  const std::string shown = dir + "/" + name;
  Fd f;
  try {
    f.fd = open_regular_at(d.fd, name, shown, O_RDONLY);
  } catch (const CheckpointError& e) {
    if (e.error_number() == ENOENT) return std::nullopt;
    throw;
  }
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) io_fail("stat", shown, errno);
  if (static_cast<uint64_t>(st.st_size) > max_bytes)
    throw CheckpointError("checkpoint: " + shown + " is " + std::to_string(st.st_size) +
                          " bytes, more than the " + std::to_string(max_bytes) +
                          " such a file ever holds");
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t r = ::pread(f.fd, text.data() + got, text.size() - got, static_cast<off_t>(got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) io_fail("read", shown, errno);
    if (r == 0) break;  // shrank meanwhile
    got += static_cast<size_t>(r);
  }
  text.resize(got);
  return text;
}

namespace {

int remove_tree_at(int dirfd, const std::string& name, int depth) {
  struct stat st {};
  if (::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0)
    return errno == ENOENT ? 0 : errno;
  if (!S_ISDIR(st.st_mode))
    return ::unlinkat(dirfd, name.c_str(), 0) == 0 || errno == ENOENT ? 0 : errno;
  if (depth >= 16) return ENOTEMPTY;  // a checkpoint's tree is one level deep
  const int sub = ::openat(dirfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (sub < 0) {
    if (errno == ENOTDIR || errno == ELOOP)  // replaced meanwhile: remove what is there now
      return ::unlinkat(dirfd, name.c_str(), 0) == 0 || errno == ENOENT ? 0 : errno;
    return errno == ENOENT ? 0 : errno;
  }
  DIR* d = ::fdopendir(sub);
  if (!d) {
    const int err = errno;
    ::close(sub);
    return err;
  }
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  int first = 0;
  for (const auto& n : names)
    if (const int r = remove_tree_at(::dirfd(d), n, depth + 1); r != 0 && first == 0) first = r;
  ::closedir(d);
  if (::unlinkat(dirfd, name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT && first == 0)
    first = errno;
  return first;
}

}  // namespace

int remove_tree_at(int dirfd, const std::string& name) { return remove_tree_at(dirfd, name, 0); }

uint64_t memory_limit() {
  uint64_t limit = UINT64_MAX;
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0)
    limit = mul_checked(static_cast<uint64_t>(pages), static_cast<uint64_t>(page)).value_or(limit);
  for (int resource : {RLIMIT_AS, RLIMIT_DATA}) {
    struct rlimit rl {};
    if (::getrlimit(resource, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
      limit = std::min<uint64_t>(limit, rl.rlim_cur);
  }
  // cgroup v2: "0::/path" in /proc/self/cgroup, the limit in /sys/fs/cgroup/path/memory.max.
  std::ifstream cg("/proc/self/cgroup");
  for (std::string line; std::getline(cg, line);) {
    if (line.rfind("0::", 0) != 0) continue;
    std::ifstream max("/sys/fs/cgroup" + line.substr(3) + "/memory.max");
    std::string v;
    if (max >> v && !v.empty() && v.find_first_not_of("0123456789") == std::string::npos &&
        v.size() < 20)
      limit = std::min<uint64_t>(limit, std::stoull(v));
    break;
  }
  return limit;
}

json parse_manifest_text(const std::string& text, const std::string& where) {
  auto bad = [&](const std::string& why) { return CheckpointError(where + ": " + why); };
  if (text.size() > kMaxManifestBytes)
    throw bad("manifest.json is " + std::to_string(text.size()) +
              " bytes, more than the limit of " + std::to_string(kMaxManifestBytes));
  if (json_depth(text.data(), text.size(), kMaxJsonDepth) > kMaxJsonDepth)
    throw bad("manifest.json nests arrays and objects deeper than " +
              std::to_string(kMaxJsonDepth) + " levels");
  json body;
  try {
    json m = json::parse(text);
    if (!m.is_object()) throw bad("manifest.json is not a JSON object");
    body = std::move(m.at("manifest"));
    if (!body.is_object()) throw bad("manifest field 'manifest' is not an object");
    const json& crc = m.at("crc32c");
    if (!crc.is_number_unsigned() || crc.get<uint64_t>() > UINT32_MAX)
      throw bad("manifest field 'crc32c' is not a 32-bit unsigned integer");
    const auto want = static_cast<uint32_t>(crc.get<uint64_t>());
    const std::string canon = json_text(body);
    const uint32_t got = crc32c(canon.data(), canon.size());
    if (want != got)
      throw bad("manifest CRC32C mismatch (stored " + std::to_string(want) + ", computed " +
                std::to_string(got) + ")");
    const json& format = body.at("format");
    if (!format.is_string() || format.get<std::string>() != kFormat)
      throw bad("not a trun checkpoint (format " + json_text(format).substr(0, 80) + ")");
    const json& version = body.at("version");
    if (!version.is_number_integer() || version.get<int64_t>() < 1 ||
        version.get<int64_t>() > kVersion)
      throw bad("unsupported version " + json_text(version).substr(0, 80));
  } catch (const json::exception& e) {
    throw bad(std::string("manifest.json is malformed: ") + e.what());
  }
  return body;
}

Manifest check_manifest(const json& body, const std::string& where) {
  auto bad = [&](const std::string& field, const std::string& why) {
    return CheckpointError(where + ": manifest field '" + field + "' " + why);
  };
  auto field = [&](const json& obj, const std::string& key,
                   const std::string& path) -> const json& {
    if (!obj.is_object()) throw bad(path, "is not inside an object");
    const auto it = obj.find(key);
    if (it == obj.end()) throw bad(path, "is missing");
    return *it;
  };
  auto u64 = [&](const json& obj, const std::string& key, const std::string& path) {
    const json& v = field(obj, key, path);
    if (!v.is_number_unsigned())
      throw bad(path, "is not an unsigned integer: " + json_text(v).substr(0, 80));
    return v.get<uint64_t>();
  };
  auto str = [&](const json& obj, const std::string& key, const std::string& path,
                 size_t max) -> const std::string& {
    const json& v = field(obj, key, path);
    if (!v.is_string()) throw bad(path, "is not a string");
    const auto& s = v.get_ref<const std::string&>();
    if (s.size() > max)
      throw bad(path,
                "is " + std::to_string(s.size()) + " bytes long, more than " + std::to_string(max));
    return s;
  };

  Manifest m;
  m.step = u64(body, "step", "step");
  const uint64_t world = u64(body, "world_size", "world_size");
  if (world < 1 || world > INT_MAX) throw bad("world_size", "is " + std::to_string(world));
  m.world_size = static_cast<int>(world);
  if (body.contains("job")) m.job = str(body, "job", "job", kMaxNameBytes);
  m.data_file = str(body, "data_file", "data_file", 255);
  if (m.data_file.empty() || m.data_file.find('/') != std::string::npos || m.data_file[0] == '.')
    throw bad("data_file", "is not a file name of the step's directory: '" + m.data_file + "'");
  m.data_size = u64(body, "data_size", "data_size");
  m.metadata = json_text(field(body, "metadata", "metadata"));
  const json& sampler = field(body, "sampler", "sampler");
  if (!sampler.is_null()) {
    try {
      m.sampler = sampler_state_from_json(json_text(sampler));
    } catch (const std::invalid_argument& e) {
      throw bad("sampler", std::string("is not a sampler state: ") + e.what());
    }
  }

  const json& tensors = field(body, "tensors", "tensors");
  if (!tensors.is_array()) throw bad("tensors", "is not an array");
  if (tensors.size() > kMaxTensors)
    throw bad("tensors", "lists " + std::to_string(tensors.size()) + " tensors, more than " +
                             std::to_string(kMaxTensors));
  m.tensors.reserve(tensors.size());
  std::set<std::pair<std::string, std::string>> names;
  std::vector<std::pair<uint64_t, size_t>> extents;  // offset, index: tensors with bytes
  for (size_t i = 0; i < tensors.size(); ++i) {
    const json& t = tensors[i];
    const std::string at = "tensors[" + std::to_string(i) + "]";
    TensorEntry e;
    e.section = str(t, "section", at + ".section", 16);
    if (e.section != "model" && e.section != "optimizer")
      throw bad(at + ".section", "is '" + e.section + "', not \"model\" or \"optimizer\"");
    e.name = str(t, "name", at + ".name", kMaxNameBytes);
    if (e.name.empty()) throw bad(at + ".name", "is empty");
    const std::string label = at + " (" + e.section + " tensor '" + e.name + "')";
    if (!names.insert({e.section, e.name}).second) throw bad(label, "names a tensor twice");
    const std::string& dtype = str(t, "dtype", at + ".dtype", 16);
    const DtypeInfo* info = nullptr;
    for (const auto& d : kDtypes)
      if (dtype == d.name) info = &d;
    if (!info) throw bad(label + ".dtype", "is unknown: '" + dtype + "'");
    e.dtype = info->dtype;
    const json& shape = field(t, "shape", label + ".shape");
    if (!shape.is_array()) throw bad(label + ".shape", "is not an array");
    if (shape.size() > kMaxDims)
      throw bad(label + ".shape", "has " + std::to_string(shape.size()) +
                                      " dimensions, more than " + std::to_string(kMaxDims));
    for (const json& d : shape) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
        throw bad(label + ".shape", "has a dimension that is not a size: " + json_text(d));
      e.shape.push_back(d.get<int64_t>());
    }
    e.offset = u64(t, "offset", label + ".offset");
    e.nbytes = u64(t, "nbytes", label + ".nbytes");
    const uint64_t crc = u64(t, "crc32c", label + ".crc32c");
    if (crc > UINT32_MAX) throw bad(label + ".crc32c", "is over 32 bits");
    e.crc = static_cast<uint32_t>(crc);
    uint64_t want = 0;
    try {
      want = nbytes_of(e.shape, e.dtype, e.name);
    } catch (const std::invalid_argument& x) {
      throw bad(label + ".shape", std::string("is impossible: ") + x.what());
    }
    if (want != e.nbytes)
      throw bad(label + ".nbytes", "is " + std::to_string(e.nbytes) +
                                       ", its shape and dtype make " + std::to_string(want));
    if (e.offset > m.data_size || e.nbytes > m.data_size - e.offset)
      throw bad(label + ".offset", "and nbytes (" + std::to_string(e.offset) + " + " +
                                       std::to_string(e.nbytes) + ") lie outside data_size (" +
                                       std::to_string(m.data_size) + ")");
    if (e.nbytes > 0) extents.emplace_back(e.offset, i);
    m.tensors.push_back(std::move(e));
  }
  // Tensors do not overlap, so that together they need at most data_size bytes of memory.
  std::sort(extents.begin(), extents.end());
  for (size_t k = 1; k < extents.size(); ++k) {
    const TensorEntry& prev = m.tensors[extents[k - 1].second];
    if (extents[k].first < prev.offset + prev.nbytes)
      throw bad("tensors[" + std::to_string(extents[k].second) + "].offset",
                "is " + std::to_string(extents[k].first) + ", inside tensors[" +
                    std::to_string(extents[k - 1].second) + "] (bytes " +
                    std::to_string(prev.offset) + " to " +
                    std::to_string(prev.offset + prev.nbytes) + "): tensors overlap");
  }
  return m;
}

void check_data_size(const Manifest& m, uint64_t file_size, const std::string& where) {
  if (m.data_size != file_size)
    throw CheckpointError(where + ": " + m.data_file + " has " + std::to_string(file_size) +
                          " bytes, the manifest says " + std::to_string(m.data_size) +
                          " (manifest field 'data_size')");
  const uint64_t limit = memory_limit();
  if (m.data_size > limit)
    throw CheckpointError(where + ": manifest field 'data_size' says " +
                          std::to_string(m.data_size) + " bytes (and " + m.data_file + " has " +
                          std::to_string(file_size) + "), more than the " + std::to_string(limit) +
                          " bytes of memory this process may have: it cannot be loaded here");
}

namespace {

std::string without_prefix(const std::string& what) {
  const std::string p = "checkpoint: ";
  return what.rfind(p, 0) == 0 ? what.substr(p.size()) : what;
}

json read_manifest_at(int stepfd, const std::string& step_dir) {
  const std::string where = "checkpoint " + step_dir;
  const std::string mpath = step_dir + "/manifest.json";
  std::string text;
  {
    Fd f;
    try {
      f.fd = open_regular_at(stepfd, "manifest.json", mpath, O_RDONLY);
    } catch (const CheckpointError& e) {
      throw CheckpointError(where + ": cannot open manifest.json: " + without_prefix(e.what()),
                            e.error_number());
    }
    struct stat st {};
    if (::fstat(f.fd, &st) != 0)
      throw CheckpointError(where + ": cannot stat manifest.json: " + errno_text(errno), errno);
    if (static_cast<uint64_t>(st.st_size) > kMaxManifestBytes)
      throw CheckpointError(where + ": manifest.json is " + std::to_string(st.st_size) +
                            " bytes, more than the limit of " + std::to_string(kMaxManifestBytes));
    text.resize(static_cast<size_t>(st.st_size));
    read_all(f.fd, text.data(), text.size(), 0, mpath);
  }
  return parse_manifest_text(text, where);
}

Fd open_step_dir(const std::string& step_dir) {
  Fd d(::open(step_dir.c_str(), O_RDONLY | O_DIRECTORY | O_NONBLOCK | O_CLOEXEC));
  if (d.fd < 0)
    throw CheckpointError("checkpoint " + step_dir + ": cannot open: " + errno_text(errno), errno);
  return d;
}

Checkpoint load_checked(const std::string& step_dir) {
  const std::string where = "checkpoint " + step_dir;
  const Fd sfd = open_step_dir(step_dir);
  const Manifest m = check_manifest(read_manifest_at(sfd.fd, step_dir), where);
  const std::string dpath = step_dir + "/" + m.data_file;
  Fd f;
  try {
    f.fd = open_regular_at(sfd.fd, m.data_file, dpath, O_RDONLY);
  } catch (const CheckpointError& e) {
    throw CheckpointError(where + ": cannot open " + m.data_file + ": " + without_prefix(e.what()),
                          e.error_number());
  }
  struct stat st {};
  if (::fstat(f.fd, &st) != 0)
    throw CheckpointError(where + ": cannot stat " + m.data_file + ": " + errno_text(errno), errno);
  // Everything the manifest claims is checked against the file before a byte is allocated.
  check_data_size(m, static_cast<uint64_t>(st.st_size), where);

  Checkpoint ck;
  ck.path = step_dir;
  ck.step = m.step;
  ck.world_size = m.world_size;
  ck.metadata = m.metadata;
  ck.job_id = m.job;
  ck.sampler = m.sampler;
  for (const TensorEntry& e : m.tensors) {
    LoadedTensor lt;
    lt.name = e.name;
    lt.dtype = e.dtype;
    lt.shape = e.shape;
    lt.bytes.resize(e.nbytes);
    if (e.nbytes > 0) read_all(f.fd, lt.bytes.data(), e.nbytes, e.offset, dpath);
    const uint32_t got = crc32c(lt.bytes.data(), e.nbytes);
    if (got != e.crc)
      throw CheckpointError(where + ": " + e.section + " tensor '" + e.name +
                            "': CRC32C mismatch (manifest " + std::to_string(e.crc) + ", data " +
                            std::to_string(got) + ")");
    (e.section == "model" ? ck.model : ck.optimizer).push_back(std::move(lt));
  }
  return ck;
}

}  // namespace

json read_manifest(const std::string& step_dir) {
  try {
    const Fd sfd = open_step_dir(step_dir);
    return read_manifest_at(sfd.fd, step_dir);
  } catch (const std::bad_alloc&) {
    throw CheckpointError("checkpoint " + step_dir + ": out of memory reading its manifest",
                          ENOMEM);
  }
}

}  // namespace ckpt

Checkpoint Checkpointer::load(const std::string& step_dir) {
  try {
    return load_checked(step_dir);
  } catch (const std::bad_alloc&) {
    throw CheckpointError("checkpoint " + step_dir + ": out of memory loading it", ENOMEM);
  }
}

}  // namespace trun::worker
