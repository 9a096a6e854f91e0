// clang-format off
// fuzz-sources: worker_sdk/src/checkpoint/format.cpp worker_sdk/src/checkpoint/crc32c.cpp worker_sdk/src/sampler/sampler.cpp
// clang-format on
// libFuzzer target for the checkpoint manifest parser and directory reader
// (worker_sdk/src/checkpoint/format.h, Checkpointer::load), built and run by scripts/fuzz.sh.
//
// The first input byte picks how the rest is used:
//   bit 0 clear: the rest is manifest.json's text as it is (its CRC32C almost never matches, so
//                this mostly exercises the size, nesting and JSON checks);
//   bit 0 set:   the rest is the manifest's body: when it parses, it is stored with a valid
//                CRC32C, so that every field check is reached.
//   bits 1-2:    the data file: 0 = data_size bytes when that is small, 1 = 100 bytes,
//                2 = sparse at data_size when that is more than this process's memory (the
//                1 TiB tensor of issue 42), 3 = absent.
// The manifest and data file are written into a step directory under a /tmp directory of this
// process (created once, removed at exit) and loaded with the real Checkpointer::load.
//
// Invariants besides the sanitizers (and libFuzzer's -malloc_limit_mb, which turns any single
// allocation over the RSS limit into a finding): the parser and load either succeed or throw
// CheckpointError with a message that names the checkpoint; a manifest that check_manifest
// accepts has every tensor inside data_size, byte counts equal to shape x dtype size without
// overflow, no overlaps and its bounds respected; a loaded checkpoint holds no more tensor bytes
// than its data file really has.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "worker_sdk/src/checkpoint/format.h"

namespace ckpt = trun::worker::ckpt;
using trun::worker::Checkpoint;
using trun::worker::Checkpointer;
using trun::worker::CheckpointError;

namespace {

void check(bool ok) {
  if (!ok) std::abort();
}

std::string g_root;  // /tmp/trun-fuzz-ckpt-XXXXXX

void remove_root() {
  if (!g_root.empty()) {
    const int fd = ::open(g_root.c_str(), O_RDONLY | O_DIRECTORY);
    if (fd >= 0) {
      ckpt::remove_tree_at(fd, "step_1");
      ::close(fd);
    }
    ::rmdir(g_root.c_str());
  }
}

const std::string& root() {
  if (g_root.empty()) {
    char tmpl[] = "/tmp/trun-fuzz-ckpt-XXXXXX";
    check(::mkdtemp(tmpl) != nullptr);
    g_root = tmpl;
    std::atexit(remove_root);
  }
  return g_root;
}

void write_file(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  check(fd >= 0);
  check(::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()));
  ::close(fd);
}

// What check_manifest promises about a manifest it accepts.
void check_accepted(const ckpt::Manifest& m) {
  check(m.tensors.size() <= ckpt::kMaxTensors);
  check(m.world_size >= 1);
  check(!m.data_file.empty() && m.data_file.find('/') == std::string::npos &&
        m.data_file[0] != '.');
  std::vector<std::pair<uint64_t, uint64_t>> extents;
  for (const auto& t : m.tensors) {
    check(t.section == "model" || t.section == "optimizer");
    check(!t.name.empty() && t.name.size() <= ckpt::kMaxNameBytes);
    check(t.shape.size() <= ckpt::kMaxDims);
    unsigned __int128 bytes = ckpt::dtype_info(t.dtype).size;
    for (int64_t d : t.shape) {
      check(d >= 0);
      bytes *= static_cast<uint64_t>(d);
      if (bytes > UINT64_MAX) bytes = static_cast<unsigned __int128>(UINT64_MAX) + 1;
    }
    check(bytes == t.nbytes);
    check(t.offset <= m.data_size && t.nbytes <= m.data_size - t.offset);
    if (t.nbytes > 0) extents.emplace_back(t.offset, t.nbytes);
  }
  std::sort(extents.begin(), extents.end());
  for (size_t i = 1; i < extents.size(); ++i)
    check(extents[i].first >= extents[i - 1].first + extents[i - 1].second);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  const std::string step_dir = root() + "/step_1";
  const std::string where = "checkpoint " + step_dir;

  if (mode & 1) {
    // The rest is the body: store it with its CRC, as the writer does.
    if (ckpt::json_depth(text.data(), text.size(), ckpt::kMaxJsonDepth) > ckpt::kMaxJsonDepth)
      return 0;
    ckpt::json body;
    try {
      body = ckpt::json::parse(text);
    } catch (const ckpt::json::exception&) {
      return 0;
    }
    const std::string canon = ckpt::json_text(body);
    text = "{\"crc32c\":" + std::to_string(trun::worker::crc32c(canon.data(), canon.size())) +
           ",\"manifest\":" + canon + "}";
  }

  // The parser on its own.
  std::optional<ckpt::Manifest> accepted;
  try {
    const ckpt::json body = ckpt::parse_manifest_text(text, where);
    accepted = ckpt::check_manifest(body, where);
    check_accepted(*accepted);
  } catch (const CheckpointError& e) {
    check(std::string(e.what()).rfind(where + ": ", 0) == 0);
  }

  // The directory reader, on real files.
  const int rootfd = ::open(root().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  check(rootfd >= 0);
  check(ckpt::remove_tree_at(rootfd, "step_1") == 0);
  check(::mkdirat(rootfd, "step_1", 0755) == 0);
  ::close(rootfd);
  write_file(step_dir + "/manifest.json", text);
  const std::string data_file =
      accepted ? step_dir + "/" + accepted->data_file : step_dir + "/data";
  const uint64_t claimed = accepted ? accepted->data_size : 0;
  uint64_t real_size = 0;
  switch ((mode >> 1) & 3) {
    case 0:  // the size the manifest claims, when it is small
      real_size = claimed <= 4096 ? claimed : 64;
      write_file(data_file, std::string(real_size, '\x5a'));
      break;
    case 1:
      real_size = 100;
      write_file(data_file, std::string(real_size, '\x00'));
      break;
    case 2:  // sparse, and only when no load could hold it anyway
      write_file(data_file, "");
      if (claimed > ckpt::memory_limit() && claimed <= (uint64_t{1} << 43)) {
        check(::truncate(data_file.c_str(), static_cast<off_t>(claimed)) == 0);
        real_size = claimed;
      }
      break;
    default:
      break;
  }
  try {
    const Checkpoint ck = Checkpointer::load(step_dir);
    check(accepted.has_value());
    check(ck.step == accepted->step);
    uint64_t held = 0;
    for (const auto* list : {&ck.model, &ck.optimizer})
      for (const auto& t : *list) {
        uint64_t numel = 1;
        for (int64_t d : t.shape) numel *= static_cast<uint64_t>(d);  // checked on load
        check(t.bytes.size() == numel * ckpt::dtype_info(t.dtype).size);
        held += t.bytes.size();
      }
    check(held <= real_size);
  } catch (const CheckpointError& e) {
    check(std::string(e.what()).rfind(where + ": ", 0) == 0);
  }
  return 0;
}
