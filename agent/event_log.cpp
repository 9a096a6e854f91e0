#include "agent/event_log.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace trun::agent {

std::unique_ptr<EventLog> EventLog::open(const std::string& path) {
  if (path.empty()) throw std::runtime_error("--event-log: the file name is empty");
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw std::runtime_error("cannot open the event log " + path +
                             " for writing: " + std::strerror(errno));
  }
  return std::unique_ptr<EventLog>(new EventLog(fd, path));
}

EventLog::EventLog(int fd, std::string path) : fd_(fd), path_(std::move(path)) {
  thread_ = std::thread([this] { writer(); });
}

EventLog::~EventLog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
  warn_once_locked();  // the writer has stopped: no lock needed
  if (dropped_ > 0) spdlog::warn("the event log {} misses {} event(s)", path_, dropped_);
  ::close(fd_);
}

void EventLog::set_common(const std::string& key, EventValue value) {
  std::lock_guard<std::mutex> lock(mu_);
  common_[key] = std::move(value);
}

uint64_t EventLog::dropped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

std::string EventLog::format(const std::string& name, int64_t timestamp_ms,
                             const EventMetadata& metadata) {
  nlohmann::json md = nlohmann::json::object();
  for (const auto& [key, value] : metadata) {
    nlohmann::json& v = md[key];
    std::visit(
        [&v](const auto& x) {
          using T = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<T, std::monostate>) {
            v = nullptr;
          } else {
            v = x;
          }
        },
        value);
  }
  nlohmann::json j{{"name", name},
                   {"source", "AGENT"},
                   {"timestamp", timestamp_ms},
                   {"metadata", std::move(md)}};
  // Worker output or an error message may hold invalid UTF-8: replace, never throw.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void EventLog::record(const std::string& name, EventMetadata metadata) {
  const int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  std::unique_lock<std::mutex> lock(mu_);
  warn_once_locked();
  for (const auto& [key, value] : common_) metadata.emplace(key, value);  // the event's own win
  if (failed_ || queue_.size() >= kMaxQueuedLines) {
    ++dropped_;
    return;
  }
  lock.unlock();
  std::string line = format(name, now, metadata) + "\n";
  lock.lock();
  queue_.push_back(std::move(line));
  lock.unlock();
  cv_.notify_one();
}

// On the recording thread (the agent's): the writer thread never logs.
void EventLog::warn_once_locked() {
  if (!failed_ || warned_) return;
  warned_ = true;
  spdlog::warn("cannot write the event log {}: {}; the job goes on without it", path_, error_);
}

void EventLog::writer() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and nothing left
    if (failed_) {
      dropped_ += queue_.size();
      queue_.clear();
      continue;
    }
    std::string batch;
    size_t lines = 0;
    while (!queue_.empty() && batch.size() < (64u << 10)) {
      batch += queue_.front();
      queue_.pop_front();
      ++lines;
    }
    lock.unlock();
    size_t done = 0;
    int err = 0;
    for (int tries = 0; done < batch.size() && tries < 1000; ++tries) {
      ssize_t n = ::write(fd_, batch.data() + done, batch.size() - done);
      if (n > 0) {
        done += static_cast<size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else {
        err = n < 0 ? errno : ENOSPC;
        break;
      }
    }
    lock.lock();
    if (done < batch.size()) {
      failed_ = true;
      dropped_ += lines;
      error_ = std::strerror(err != 0 ? err : EIO);
    }
  }
}

}  // namespace trun::agent
