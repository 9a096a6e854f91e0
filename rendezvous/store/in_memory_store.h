#pragma once
// InMemoryStore: a Store inside one process, for unit tests of code above the store (rendezvous
// decisions, process-group set-up) that do not need sockets. Not for production: nothing outside
// the process can reach it. Thread-safe; blocking calls wait on a condition variable.

#include <charconv>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>

#include "rendezvous/store/store.h"

namespace trun::rendezvous {

class InMemoryStore : public Store {
 public:
  void set(const std::string& key, std::string_view value) override {
    std::lock_guard<std::mutex> lock(mu_);
    data_[key] = std::string(value);
    cv_.notify_all();
  }
  using Store::get;
  std::string get(const std::string& key, Duration timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    wait_locked(lock, {key}, timeout, "get");
    return data_[key];
  }
  int64_t add(const std::string& key, int64_t delta) override {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t value = 0;
    auto it = data_.find(key);
    if (it != data_.end()) {
      auto& s = it->second;
      auto [p, err] = std::from_chars(s.data(), s.data() + s.size(), value);
      if (err != std::errc() || p != s.data() + s.size()) {
        throw StoreError("in-memory store: add('" + key + "'): value is not an integer");
      }
    }
    value += delta;
    data_[key] = std::to_string(value);
    cv_.notify_all();
    return value;
  }
  std::string compare_set(const std::string& key, std::string_view expected,
                          std::string_view desired) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = data_.find(key);
    if (it == data_.end()) {
      if (!expected.empty()) return std::string(expected);
      data_[key] = std::string(desired);
      cv_.notify_all();
      return std::string(desired);
    }
    if (it->second != expected) return it->second;
    it->second = std::string(desired);
    cv_.notify_all();
    return it->second;
  }
  bool check(const std::vector<std::string>& keys) override {
    std::lock_guard<std::mutex> lock(mu_);
    return all_exist(keys, true);
  }
  using Store::wait;
  void wait(const std::vector<std::string>& keys, Duration timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    wait_locked(lock, keys, timeout, "wait", true);
  }
  int64_t num_keys() override {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(data_.size());
  }
  bool delete_key(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    return data_.erase(key) > 0;
  }
  using Store::multi_get;
  std::vector<std::string> multi_get(const std::vector<std::string>& keys,
                                     Duration timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    wait_locked(lock, keys, timeout, "multi_get");
    std::vector<std::string> out;
    for (auto& k : keys) out.push_back(data_[k]);
    return out;
  }
  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::string>& values) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < keys.size() && i < values.size(); ++i) data_[keys[i]] = values[i];
    cv_.notify_all();
  }
  void append(const std::string& key, std::string_view value) override {
    std::lock_guard<std::mutex> lock(mu_);
    data_[key].append(value);
    cv_.notify_all();
  }
  void queue_push(const std::string& key, std::string_view value) override {
    std::lock_guard<std::mutex> lock(mu_);
    queues_[key].emplace_back(value);
    cv_.notify_all();
  }
  using Store::queue_pop;
  std::optional<std::string> queue_pop(const std::string& key, bool block,
                                       Duration timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    auto ready = [&] { return queues_.count(key) > 0; };  // empty queues are erased
    if (block && !cv_.wait_for(lock, timeout, ready))
      throw StoreTimeoutError("in-memory store: queue_pop('" + key + "'): no value within " +
                              std::to_string(timeout.count()) + " ms");
    auto it = queues_.find(key);
    if (it == queues_.end()) return std::nullopt;
    std::string v = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) queues_.erase(it);
    return v;
  }
  int64_t queue_len(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = queues_.find(key);
    return it == queues_.end() ? 0 : static_cast<int64_t>(it->second.size());
  }
  std::vector<std::string> list_keys() override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> keys;
    for (const auto& kv : data_) keys.push_back(kv.first);
    return keys;
  }

 private:
  // With `queues`, a non-empty queue counts as its key (check and wait, as on the server).
  bool all_exist(const std::vector<std::string>& keys, bool queues = false) const {
    for (auto& k : keys) {
      if (!data_.count(k) && !(queues && queues_.count(k))) return false;
    }
    return true;
  }
  void wait_locked(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                   Duration timeout, const char* op, bool queues = false) {
    if (!cv_.wait_for(lock, timeout, [&] { return all_exist(keys, queues); })) {
      throw StoreTimeoutError(std::string("in-memory store: ") + op +
                              ": keys did not appear within " + std::to_string(timeout.count()) +
                              " ms");
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> data_;
  std::map<std::string, std::deque<std::string>> queues_;
};

}  // namespace trun::rendezvous
