#pragma once
// The checkpoint format's helpers, private to the Checkpointer: file I/O that reports errno,
// step names, and reading a manifest. The layout is described in trun/checkpoint.h.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/write_all.h"
#include "trun/checkpoint.h"
#include "trun/sampler.h"

namespace trun::worker::ckpt {

using json = nlohmann::json;

constexpr const char* kFormat = "trun-checkpoint";
constexpr int kVersion = 2;  // 2: the saving job's id ("job"); 1 is still read
constexpr size_t kAlign = 64;
constexpr size_t kIoChunk = size_t{64} << 20;

// Bounds of what a manifest may hold. save() refuses what exceeds them (so everything saved loads)
// and the reader treats a manifest that exceeds them as damaged, before it allocates anything the
// manifest claims. Parsing costs memory proportional to the manifest's real size only.
constexpr size_t kMaxManifestBytes = size_t{64} << 20;   // manifest.json's size
constexpr size_t kMaxMetadataBytes = size_t{16} << 20;   // the user's metadata, as JSON text
constexpr int kMaxJsonDepth = 64;                        // nesting of manifest.json as a whole
constexpr int kMaxMetadataDepth = kMaxJsonDepth - 4;     // nesting of the user's metadata
constexpr size_t kMaxTensors = size_t{1} << 20;          // tensors per checkpoint
constexpr size_t kMaxNameBytes = size_t{64} << 10;       // a tensor's name
constexpr size_t kMaxDims = 64;                          // a tensor's dimensions
constexpr size_t kMaxSmallFileBytes = size_t{64} << 10;  // latest
constexpr size_t kMaxResumeBytes = size_t{16} << 20;     // .resume (may list every damaged step)

inline std::string errno_text(int err) { return std::strerror(err); }

// JSON text of `j` that never throws on bytes that are not UTF-8 (a job id from the environment,
// an error message quoting a damaged file): they become U+FFFD. Every JSON file of a checkpoint
// directory is written through it.
inline std::string json_text(const json& j, int indent = -1) {
  return j.dump(indent, ' ', false, json::error_handler_t::replace);
}

[[noreturn]] inline void io_fail(const std::string& what, const std::string& path, int err) {
  throw CheckpointError("checkpoint: " + what + " " + path + ": " + errno_text(err), err);
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
  Fd(Fd&& o) noexcept : fd(o.fd) { o.fd = -1; }
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      if (fd >= 0) ::close(fd);
      fd = o.fd;
      o.fd = -1;
    }
    return *this;
  }
};

inline void write_all(int fd, const void* data, size_t n, uint64_t offset,
                      const std::string& path) {
  if (!base::pwrite_all(fd, data, n, offset, kIoChunk)) io_fail("write", path, errno);
}

inline void read_all(int fd, void* data, size_t n, uint64_t offset, const std::string& path) {
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

inline void fsync_fd(int fd, const std::string& shown) {
  if (::fsync(fd) != 0) io_fail("fsync", shown, errno);
}

// The dtypes of the format and their on-disk names (the same as dtype_name()) and sizes: the
// reader needs no process group code, so the manifest parser links on its own (fuzz target).
struct DtypeInfo {
  DataType dtype;
  const char* name;
  size_t size;
};
constexpr DtypeInfo kDtypes[] = {
    {DataType::kFloat32, "float32", 4}, {DataType::kFloat64, "float64", 8},
    {DataType::kFloat16, "float16", 2}, {DataType::kBFloat16, "bfloat16", 2},
    {DataType::kInt32, "int32", 4},     {DataType::kInt64, "int64", 8},
    {DataType::kInt8, "int8", 1},       {DataType::kUInt8, "uint8", 1},
    {DataType::kBool, "bool", 1},
};

inline const DtypeInfo& dtype_info(DataType d) {
  for (const auto& i : kDtypes)
    if (i.dtype == d) return i;
  throw std::invalid_argument("checkpoint: unknown DataType " +
                              std::to_string(static_cast<int>(d)));
}
inline const char* dtype_key(DataType d) { return dtype_info(d).name; }

// a * b, or nullopt when it does not fit in 64 bits.
inline std::optional<uint64_t> mul_checked(uint64_t a, uint64_t b) {
  uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// The element count of `shape`; throws std::invalid_argument for a negative dimension, more than
// kMaxDims dimensions, or a count that overflows 64 bits.
inline uint64_t numel_of(const std::vector<int64_t>& shape, const std::string& name) {
  if (shape.size() > kMaxDims)
    throw std::invalid_argument("tensor '" + name + "' has " + std::to_string(shape.size()) +
                                " dimensions, more than " + std::to_string(kMaxDims));
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) throw std::invalid_argument("tensor '" + name + "' has a negative dimension");
    const auto m = mul_checked(n, static_cast<uint64_t>(d));
    if (!m) throw std::invalid_argument("tensor '" + name + "' has an element count over 2^64");
    n = *m;
  }
  return n;
}

// Bytes of a tensor of `shape` and `dtype`; throws std::invalid_argument as numel_of, or when the
// byte count overflows.
inline uint64_t nbytes_of(const std::vector<int64_t>& shape, DataType dtype,
                          const std::string& name) {
  const auto b = mul_checked(numel_of(shape, name), dtype_info(dtype).size);
  if (!b) throw std::invalid_argument("tensor '" + name + "' has a byte count over 2^64");
  return *b;
}

// The deepest nesting of arrays and objects in JSON text (strings skipped); stops counting at
// `limit` + 1. Linear and allocation-free: run before parsing, so that nothing recursive (a copy,
// a dump, a destructor) ever sees a deeper document.
int json_depth(const char* text, size_t n, int limit);

inline std::string step_name(uint64_t step) { return "step_" + std::to_string(step); }

// "step_<digits>" -> step; nullopt for anything else.
inline std::optional<uint64_t> parse_step_name(const std::string& name) {
  if (name.size() <= 5 || name.compare(0, 5, "step_") != 0) return std::nullopt;
  uint64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || i - 5 >= 19) return std::nullopt;
    v = v * 10 + static_cast<uint64_t>(name[i] - '0');
  }
  return v;
}

inline int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// ---- Files of a checkpoint directory, never through a symbolic link ----
//
// Every file the checkpoint code opens is opened relative to a directory descriptor with
// O_NOFOLLOW (a symbolic link in its place is an error naming it, never followed) and O_NONBLOCK
// (a FIFO in its place does not block the open), and must be a regular file. `shown` is the path
// used in messages.

// Opens `path` (the user's directory, symbolic links in it followed) as a directory.
int open_directory(const std::string& path);

// Opens the regular file `name` in `dirfd` (flags: O_RDONLY or O_RDWR, plus O_CREAT). Throws
// CheckpointError naming `shown` when it is a symbolic link or not a regular file, or with the
// errno of the open.
int open_regular_at(int dirfd, const std::string& name, const std::string& shown, int flags);

// Creates `name` in `dirfd` for writing with O_CREAT | O_EXCL | O_NOFOLLOW. With `replace_stale`,
// an entry already there (a leftover temporary file of this process's name) is unlinked, never
// followed, and the creation retried once. Throws CheckpointError naming `shown`.
int create_exclusive_at(int dirfd, const std::string& name, const std::string& shown,
                        bool replace_stale);

// Reads the regular file DIR/name when it is at most `max_bytes` long. nullopt when it does not
// exist; otherwise throws CheckpointError (a symbolic link, not a regular file, too large, I/O).
std::optional<std::string> read_small_file(const std::string& dir, const std::string& name,
                                           size_t max_bytes);

// Removes `name` in `dirfd` and, for a directory, everything in it, never following a symbolic
// link (a link is removed itself). Returns 0 or the errno of the first failure; ENOENT is 0.
int remove_tree_at(int dirfd, const std::string& name);

// ---- Manifests ----

struct TensorEntry {
  std::string section;  // "model" or "optimizer"
  std::string name;
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
  uint32_t crc = 0;
};

// A manifest's fields, each checked: types, names, bounds (kMax*), shapes against byte counts
// without overflow, tensors inside data_size and not overlapping (so that together they need at
// most data_size bytes).
struct Manifest {
  uint64_t step = 0;
  int world_size = 1;
  std::string job;
  std::string data_file;
  uint64_t data_size = 0;
  std::vector<TensorEntry> tensors;
  std::string metadata = "{}";
  std::optional<SamplerState> sampler;
};

// Parses manifest.json's text: size and nesting bounds, JSON, the CRC32C of the body, format and
// version. Returns the body. Throws CheckpointError "<where>: <what is wrong>".
json parse_manifest_text(const std::string& text, const std::string& where);

// Checks every field of a manifest body (parse_manifest_text's result). Allocates nothing in
// proportion to a size the manifest claims. Throws CheckpointError "<where>: ..." naming the field.
Manifest check_manifest(const json& body, const std::string& where);

// Checks `m` against its data file's real size (fstat) and against the memory this process may
// have (a load holds every tensor at once): a difference names the field and both sizes. Throws
// CheckpointError.
void check_data_size(const Manifest& m, uint64_t file_size, const std::string& where);

// The bytes this process can hold at most: the least of physical memory, RLIMIT_AS, RLIMIT_DATA
// and its cgroup's memory.max.
uint64_t memory_limit();

// Reads and checks step_dir/manifest.json (not through a symbolic link, a regular file of at most
// kMaxManifestBytes); returns its body. Throws CheckpointError saying what is wrong.
json read_manifest(const std::string& step_dir);

}  // namespace trun::worker::ckpt
