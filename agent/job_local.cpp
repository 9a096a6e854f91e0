#include "agent/job_local.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <system_error>
#include <vector>

#include "base/shm_names.h"

namespace trun::agent {

namespace fs = std::filesystem;

void remove_worker_shm_segments(const std::string& run_id) {
  const std::string prefix = base::shm_run_prefix(run_id);
  std::error_code ec;
  for (fs::directory_iterator it("/dev/shm", ec), end; !ec && it != end; it.increment(ec)) {
    std::string name = it->path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    std::error_code rm;
    if (fs::remove(it->path(), rm)) {
      spdlog::warn("removed shared-memory segment {} left by a worker", name);
    }
  }
}

std::string generate_run_id() {
  std::random_device rd;
  std::mt19937_64 gen(
      (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  uint64_t a = gen(), b = gen();
  // UUID version 4 layout, as torchrun's uuid.uuid4().
  a = (a & ~0xF000ull) | 0x4000ull;
  b = (b & 0x3FFFFFFFFFFFFFFFull) | 0x8000000000000000ull;
  char buf[40];
  std::snprintf(buf, sizeof buf, "%08x-%04x-%04x-%04x-%012llx", static_cast<unsigned>(a >> 32),
                static_cast<unsigned>((a >> 16) & 0xFFFF), static_cast<unsigned>(a & 0xFFFF),
                static_cast<unsigned>(b >> 48),
                static_cast<unsigned long long>(b & 0xFFFFFFFFFFFFull));
  return buf;
}

std::string host_name() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof buf - 1) != 0) return "localhost";
  return buf;
}

std::string make_log_dir(const std::string& log_dir, const std::string& run_id, bool* temporary) {
  *temporary = false;
  if (!log_dir.empty()) {
    const std::string dir = log_dir + "/" + run_id;
    fs::create_directories(dir);
    return dir;
  }
  std::string dir = make_temporary_dir();
  *temporary = true;
  return dir;
}

std::string make_temporary_dir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/trun-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) {
    throw std::system_error(errno, std::generic_category(), "mkdtemp " + tmpl);
  }
  return buf.data();
}

}  // namespace trun::agent
