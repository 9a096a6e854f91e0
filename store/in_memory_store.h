#pragma once
// InMemoryStore: a Store inside one process, for unit tests of code above the store (rendezvous
// decisions, process-group set-up) that do not need sockets. Not for production: nothing outside
// the process can reach it. Thread-safe; blocking calls wait on a condition variable. The
// semantics (compare_set, add, append, queues, ...) are the server's own: KvState (kv_state.h),
// which needs linking trun_store_kv (trun_store_server links it).

#include <condition_variable>
#include <mutex>

#include "store/kv_state.h"
#include "store/store.h"

namespace trun::store {

class InMemoryStore : public Store {
 public:
  void set(const std::string& key, std::string_view value) override {
    std::lock_guard<std::mutex> lock(mu_);
    kv_.set(key, std::string(value));
    cv_.notify_all();
  }
  using Store::get;
  std::string get(const std::string& key, Duration timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    wait_locked(lock, {key}, timeout, "get");
    return *kv_.find(key);
  }
  int64_t add(const std::string& key, int64_t delta) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto value = kv_.add(key, delta);
    if (!value) throw StoreError("in-memory store: add('" + key + "'): value is not an integer");
    cv_.notify_all();
    return *value;
  }
  std::string compare_set(const std::string& key, std::string_view expected,
                          std::string_view desired) override {
    std::lock_guard<std::mutex> lock(mu_);
    bool swapped = false;
    std::string now = kv_.compare_set(key, expected, desired, &swapped);
    if (swapped) cv_.notify_all();
    return now;
  }
  bool check(const std::vector<std::string>& keys) override {
    std::lock_guard<std::mutex> lock(mu_);
    return kv_.all_present(keys, true);
  }
  using Store::wait;
  void wait(const std::vector<std::string>& keys, Duration timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    wait_locked(lock, keys, timeout, "wait", true);
  }
  int64_t num_keys() override {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(kv_.num_keys());
  }
  bool delete_key(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    return kv_.erase(key);
  }
  using Store::multi_get;
  std::vector<std::string> multi_get(const std::vector<std::string>& keys,
                                     Duration timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    wait_locked(lock, keys, timeout, "multi_get");
    std::vector<std::string> out;
    for (auto& k : keys) out.push_back(*kv_.find(k));
    return out;
  }
  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::string>& values) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < keys.size() && i < values.size(); ++i) kv_.set(keys[i], values[i]);
    cv_.notify_all();
  }
  void append(const std::string& key, std::string_view value) override {
    std::lock_guard<std::mutex> lock(mu_);
    bool ok = kv_.append(key, value);
    cv_.notify_all();
    if (!ok) {
      throw StoreError("in-memory store: append('" + key + "'): past the value size limit");
    }
  }
  void queue_push(const std::string& key, std::string_view value) override {
    std::lock_guard<std::mutex> lock(mu_);
    kv_.queue_push(key, std::string(value));
    cv_.notify_all();
  }
  using Store::queue_pop;
  std::optional<std::string> queue_pop(const std::string& key, bool block,
                                       Duration timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    auto ready = [&] { return kv_.queue_len(key) > 0; };
    if (block && !cv_.wait_for(lock, timeout, ready))
      throw StoreTimeoutError("in-memory store: queue_pop('" + key + "'): no value within " +
                              std::to_string(timeout.count()) + " ms");
    return kv_.queue_pop(key);
  }
  int64_t queue_len(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(kv_.queue_len(key));
  }
  std::vector<std::string> list_keys() override {
    std::lock_guard<std::mutex> lock(mu_);
    return kv_.list_keys();
  }

 private:
  // With `queues`, a non-empty queue counts as its key (wait, as on the server).
  void wait_locked(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                   Duration timeout, const char* op, bool queues = false) {
    if (!cv_.wait_for(lock, timeout, [&] { return kv_.all_present(keys, queues); })) {
      throw StoreTimeoutError(std::string("in-memory store: ") + op +
                              ": keys did not appear within " + std::to_string(timeout.count()) +
                              " ms");
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  KvState kv_;  // never parks: waits are the condition variable's
};

}  // namespace trun::store
