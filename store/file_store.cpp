#include "store/file_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "base/decimal.h"
#include "store/socket_conn.h"

namespace trun::store {
namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kPoll = std::chrono::milliseconds(10);  // PyTorch's polling period
const std::string kUserPrefix = "/";
const std::string kDeletePrefix = "-";
const std::string kCleanupKey = "cleanup/";

std::string errno_text(int err) { return std::strerror(err); }

void put_u32(std::string& out, uint32_t v) {
  // The machine's byte order, as PyTorch writes it.
  char b[sizeof v];
  std::memcpy(b, &v, sizeof v);
  out.append(b, sizeof v);
}

}  // namespace

// An open descriptor of the store's file holding a flock, both released on destruction.
class FileStore::Open {
 public:
  // `wait_until`: with O_RDONLY, how long a missing file is waited for (PyTorch retries ENOENT
  // too); time_point::min(): not at all (fd() is then -1 when the file does not exist).
  Open(const FileStore& store, int flags, int lock, Clock::time_point wait_until, const char* op) {
    for (;;) {
      do {
        fd_ = ::open(store.path_.c_str(), flags | O_CLOEXEC, 0644);
      } while (fd_ < 0 && errno == EINTR);
      if (fd_ >= 0) break;
      const int err = errno;
      if (err != ENOENT || (flags & O_CREAT)) store.fail(op, "open: " + errno_text(err));
      if (Clock::now() >= wait_until) return;
      std::this_thread::sleep_for(kPoll);
    }
    int rc;
    do {
      rc = ::flock(fd_, lock);
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) {
      const int err = errno;
      ::close(fd_);
      fd_ = -1;
      store.fail(op, "flock: " + errno_text(err));
    }
  }
  ~Open() {
    if (fd_ >= 0) ::close(fd_);  // releases the flock
  }
  Open(const Open&) = delete;
  Open& operator=(const Open&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
};

FileStore::FileStore(std::string path, int num_workers)
    : path_(std::move(path)), num_workers_(num_workers) {}

FileStore::~FileStore() {
  // As PyTorch: a file already gone (removed by someone else) is left alone.
  if (::access(path_.c_str(), F_OK) != 0) return;
  try {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t finished = add_raw_locked(kCleanupKey, 1, "cleanup");
    if (num_workers_ >= 0 && finished == num_workers_) std::remove(path_.c_str());
  } catch (const std::exception&) {
    // Best effort, like PyTorch's: a destructor does not throw.
  }
}

void FileStore::fail(const char* op, const std::string& what) const {
  throw StoreError("file store " + path_ + ": " + op + ": " + what);
}

void FileStore::refresh_locked(int fd, const char* op) {
  struct stat st;
  if (::fstat(fd, &st) != 0) fail(op, "fstat: " + errno_text(errno));
  const int64_t size = st.st_size;
  if (size < pos_) {
    // The file was removed and created again: replay the new one from the start.
    cache_.clear();
    pos_ = 0;
  }
  if (size == pos_) return;
  std::string buf(static_cast<size_t>(size - pos_), '\0');
  size_t got = 0;
  while (got < buf.size()) {
    ssize_t n = ::pread(fd, buf.data() + got, buf.size() - got, pos_ + got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(op, "read: " + errno_text(errno));
    if (n == 0) break;  // shrank under us: replay what is there
    got += static_cast<size_t>(n);
  }
  size_t at = 0;
  auto field = [&](std::string* out) {
    uint32_t len = 0;
    if (got - at < sizeof len) return false;
    std::memcpy(&len, buf.data() + at, sizeof len);
    if (got - at - sizeof len < len) return false;
    out->assign(buf.data() + at + sizeof len, len);
    at += sizeof len + len;
    return true;
  };
  std::string key, value;
  for (;;) {
    const size_t start = at;
    if (at == got) break;
    if (!field(&key) || !field(&value)) {
      // Writers hold the exclusive lock for a whole record, so this is a corrupt file.
      fail(op, "truncated record at byte " + std::to_string(pos_ + start) + " of " +
                   std::to_string(size) + " (not a FileStore file?)");
    }
    if (key.compare(0, kDeletePrefix.size(), kDeletePrefix) == 0) {
      cache_.erase(key.substr(kDeletePrefix.size()));
    } else {
      cache_[key] = std::move(value);
    }
  }
  pos_ += static_cast<int64_t>(at);
}

void FileStore::append_records_locked(int fd,
                                      const std::vector<std::pair<std::string, std::string>>& recs,
                                      const char* op) {
  std::string out;
  for (const auto& [k, v] : recs) {
    if (k.size() > UINT32_MAX || v.size() > UINT32_MAX) fail(op, "key or value over 4 GiB");
    put_u32(out, static_cast<uint32_t>(k.size()));
    out += k;
    put_u32(out, static_cast<uint32_t>(v.size()));
    out += v;
  }
  if (::lseek(fd, 0, SEEK_END) < 0) fail(op, "lseek: " + errno_text(errno));
  size_t done = 0;
  while (done < out.size()) {
    ssize_t n = ::write(fd, out.data() + done, out.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(op, "write: " + errno_text(errno));
    done += static_cast<size_t>(n);
  }
}

void FileStore::set(const std::string& key, std::string_view value) {
  std::lock_guard<std::mutex> lock(mu_);
  Open f(*this, O_RDWR | O_CREAT, LOCK_EX, Clock::time_point::min(), "set");
  append_records_locked(f.fd(), {{kUserPrefix + key, std::string(value)}}, "set");
}

std::string FileStore::get(const std::string& key, Duration timeout) {
  const auto deadline = net::deadline_after(timeout);
  const std::string raw = kUserPrefix + key;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      Open f(*this, O_RDONLY, LOCK_SH, deadline, "get");
      if (f.fd() >= 0) {
        refresh_locked(f.fd(), "get");
        auto it = cache_.find(raw);
        if (it != cache_.end()) return it->second;
      }
    }
    if (Clock::now() >= deadline)
      throw StoreTimeoutError("file store " + path_ + ": get('" + key + "'): not set within " +
                              std::to_string(timeout.count()) + " ms");
    std::this_thread::sleep_for(kPoll);
  }
}

int64_t FileStore::add_raw_locked(const std::string& raw_key, int64_t delta, const char* op) {
  Open f(*this, O_RDWR | O_CREAT, LOCK_EX, Clock::time_point::min(), op);
  refresh_locked(f.fd(), op);
  int64_t value = delta;
  auto it = cache_.find(raw_key);
  if (it != cache_.end() && !it->second.empty()) {
    long long now = 0;  // strtoll's syntax as always: a leading '+' or spaces are taken
    if (!base::parse_decimal(it->second, &now, base::DecimalSyntax{true, true}))
      fail(op, "the value of '" + raw_key + "' is not an integer: '" + it->second + "'");
    value += now;
  }
  append_records_locked(f.fd(), {{raw_key, std::to_string(value)}}, op);
  return value;
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  std::lock_guard<std::mutex> lock(mu_);
  return add_raw_locked(kUserPrefix + key, delta, "add");
}

std::string FileStore::compare_set(const std::string& key, std::string_view expected,
                                   std::string_view desired) {
  std::lock_guard<std::mutex> lock(mu_);
  Open f(*this, O_RDWR | O_CREAT, LOCK_EX, Clock::time_point::min(), "compare_set");
  refresh_locked(f.fd(), "compare_set");
  const std::string raw = kUserPrefix + key;
  auto it = cache_.find(raw);
  if ((it == cache_.end() && expected.empty()) || (it != cache_.end() && it->second == expected)) {
    append_records_locked(f.fd(), {{raw, std::string(desired)}}, "compare_set");
    return std::string(desired);
  }
  if (it == cache_.end()) return std::string(expected);
  return it->second;
}

bool FileStore::check_locked(const std::vector<std::string>& keys, const char* op) {
  Open f(*this, O_RDONLY, LOCK_SH, Clock::time_point::min(), op);
  if (f.fd() < 0) return keys.empty();
  refresh_locked(f.fd(), op);
  for (const auto& k : keys)
    if (cache_.count(kUserPrefix + k) == 0) return false;
  return true;
}

bool FileStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mu_);
  return check_locked(keys, "check");
}

void FileStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  const auto deadline = net::deadline_after(timeout);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (check_locked(keys, "wait")) return;
    }
    if (Clock::now() >= deadline) {
      std::string names;
      for (const auto& k : keys) names += (names.empty() ? "'" : ", '") + k + "'";
      throw StoreTimeoutError("file store " + path_ + ": wait(" + names + "): not set within " +
                              std::to_string(timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(kPoll);
  }
}

int64_t FileStore::num_keys() {
  std::lock_guard<std::mutex> lock(mu_);
  Open f(*this, O_RDONLY, LOCK_SH, Clock::time_point::min(), "num_keys");
  if (f.fd() >= 0) refresh_locked(f.fd(), "num_keys");
  return static_cast<int64_t>(cache_.size());
}

bool FileStore::delete_key(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  Open f(*this, O_RDWR | O_CREAT, LOCK_EX, Clock::time_point::min(), "delete_key");
  refresh_locked(f.fd(), "delete_key");
  const std::string raw = kUserPrefix + key;
  const bool existed = cache_.count(raw) != 0;
  append_records_locked(f.fd(), {{kDeletePrefix + raw, std::string()}}, "delete_key");
  return existed;
}

std::vector<std::string> FileStore::multi_get(const std::vector<std::string>& keys,
                                              Duration timeout) {
  const auto deadline = net::deadline_after(timeout);
  for (;;) {
    wait(keys, std::chrono::duration_cast<Duration>(
                   std::max(Clock::duration::zero(), deadline - Clock::now())));
    std::lock_guard<std::mutex> lock(mu_);
    Open f(*this, O_RDONLY, LOCK_SH, Clock::time_point::min(), "multi_get");
    if (f.fd() < 0) continue;  // removed since the wait: wait again
    refresh_locked(f.fd(), "multi_get");
    std::vector<std::string> out;
    for (const auto& k : keys) {
      auto it = cache_.find(kUserPrefix + k);
      if (it == cache_.end()) break;  // deleted since the wait: wait again
      out.push_back(it->second);
    }
    if (out.size() == keys.size()) return out;
  }
}

void FileStore::multi_set(const std::vector<std::string>& keys,
                          const std::vector<std::string>& values) {
  if (keys.size() != values.size())
    fail("multi_set",
         std::to_string(keys.size()) + " keys but " + std::to_string(values.size()) + " values");
  std::vector<std::pair<std::string, std::string>> recs;
  for (size_t i = 0; i < keys.size(); ++i) recs.emplace_back(kUserPrefix + keys[i], values[i]);
  std::lock_guard<std::mutex> lock(mu_);
  Open f(*this, O_RDWR | O_CREAT, LOCK_EX, Clock::time_point::min(), "multi_set");
  append_records_locked(f.fd(), recs, "multi_set");
}

void FileStore::append(const std::string& key, std::string_view value) {
  std::lock_guard<std::mutex> lock(mu_);
  Open f(*this, O_RDWR | O_CREAT, LOCK_EX, Clock::time_point::min(), "append");
  refresh_locked(f.fd(), "append");
  const std::string raw = kUserPrefix + key;
  auto it = cache_.find(raw);
  std::string now = it == cache_.end() ? std::string() : it->second;
  now.append(value);
  append_records_locked(f.fd(), {{raw, now}}, "append");
}

std::vector<std::string> FileStore::list_keys() {
  std::lock_guard<std::mutex> lock(mu_);
  Open f(*this, O_RDONLY, LOCK_SH, Clock::time_point::min(), "list_keys");
  if (f.fd() >= 0) refresh_locked(f.fd(), "list_keys");
  std::vector<std::string> out;
  for (const auto& [k, v] : cache_)
    if (k.compare(0, kUserPrefix.size(), kUserPrefix) == 0) out.push_back(k.substr(1));
  return out;
}

}  // namespace trun::store
