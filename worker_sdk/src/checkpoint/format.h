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
#include <string>
#include <vector>

#include "trun/checkpoint.h"

namespace trun::worker::ckpt {

using json = nlohmann::json;

constexpr const char* kFormat = "trun-checkpoint";
constexpr int kVersion = 2;  // 2: the saving job's id ("job"); 1 is still read
constexpr size_t kAlign = 64;
constexpr size_t kIoChunk = size_t{64} << 20;
constexpr size_t kMaxManifestBytes = size_t{256} << 20;

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
};

inline void write_all(int fd, const void* data, size_t n, uint64_t offset,
                      const std::string& path) {
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

inline void fsync_path(const std::string& path, bool directory) {
  Fd f(::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC));
  if (f.fd < 0) io_fail("open (for fsync)", path, errno);
  if (::fsync(f.fd) != 0) io_fail("fsync", path, errno);
}

inline const char* dtype_key(DataType d) { return dtype_name(d); }

inline DataType parse_dtype(const std::string& s) {
  for (DataType d : {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16,
                     DataType::kBFloat16, DataType::kInt32, DataType::kInt64})
    if (s == dtype_name(d)) return d;
  throw CheckpointError("unknown dtype '" + s + "'");
}

inline size_t numel_of(const std::vector<int64_t>& shape, const std::string& name) {
  size_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) throw std::invalid_argument("tensor '" + name + "' has a negative dimension");
    n *= static_cast<size_t>(d);
  }
  return n;
}

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

// Reads and checks step_dir/manifest.json (CRC, format, version); returns its body. Throws
// CheckpointError saying what is wrong.
json read_manifest(const std::string& step_dir);

}  // namespace trun::worker::ckpt
