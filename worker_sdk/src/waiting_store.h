#pragma once
// Never a silent wait (private to libtrun_worker): a Store view whose blocking calls (get, wait,
// multi_get) wait in slices, printing one line on stderr after the first 5 s and then every 30 s
// that says who waits, for what, where and why there; the timeout still applies in full, and its
// StoreTimeoutError says the same. Everything else passes straight through.
//
// Thread safety: as the underlying store's.

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "store/store.h"

namespace trun::worker::detail {

inline constexpr std::chrono::seconds kFirstWaitReport{5};
inline constexpr std::chrono::seconds kWaitReportEvery{30};

// Runs `attempt(slice)` until it returns, slicing `timeout` so that a line goes to stderr after
// kFirstWaitReport and then every kWaitReportEvery: "[trun.worker] <who>: waiting <s> s so far
// for <what>; waiting up to <timeout> s". `attempt` throws store::StoreTimeoutError when its
// slice passes; at the end of `timeout` that becomes "<who>: gave up after <s> s waiting for
// <what>: <error>". Other errors pass through.
// `abandon` (optional): asked between slices of at most kAbandonCheck; when it returns a
// non-empty reason the wait ends with store::StoreError("<who>: stopped waiting for <what>:
// <reason>").
void wait_reporting(const std::string& who, const std::string& what,
                    std::chrono::milliseconds timeout,
                    const std::function<void(std::chrono::milliseconds slice)>& attempt,
                    const std::function<std::string()>& abandon = nullptr);
inline constexpr std::chrono::milliseconds kAbandonCheck{100};
// What wait_reporting throws when `abandon` ended the wait.
class AbandonedWaitError : public store::StoreError {
 public:
  using store::StoreError::StoreError;
};

class WaitingStore : public store::Store {
 public:
  // `who`: "rank 1/2"; `purpose`: e.g. "the other ranks to build process group 0"; `where`: "the
  // store at 127.0.0.1:29500 (MASTER_ADDR/MASTER_PORT; ...)".
  // `abandon`: see wait_reporting (the resilient loop's groups: the agent's generation moved past
  // the one being built, so the peers waited for are building another).
  WaitingStore(std::shared_ptr<store::Store> base, std::string who, std::string purpose,
               std::string where, std::function<std::string()> abandon = nullptr);

  void set(const std::string& key, std::string_view value) override { base_->set(key, value); }
  using Store::get;
  std::string get(const std::string& key, Duration timeout) override;
  int64_t add(const std::string& key, int64_t delta) override { return base_->add(key, delta); }
  std::string compare_set(const std::string& key, std::string_view expected,
                          std::string_view desired) override {
    return base_->compare_set(key, expected, desired);
  }
  bool check(const std::vector<std::string>& keys) override { return base_->check(keys); }
  using Store::wait;
  void wait(const std::vector<std::string>& keys, Duration timeout) override;
  int64_t num_keys() override { return base_->num_keys(); }
  bool delete_key(const std::string& key) override { return base_->delete_key(key); }
  using Store::multi_get;
  std::vector<std::string> multi_get(const std::vector<std::string>& keys,
                                     Duration timeout) override;
  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::string>& values) override {
    base_->multi_set(keys, values);
  }
  void append(const std::string& key, std::string_view value) override {
    base_->append(key, value);
  }
  void queue_push(const std::string& key, std::string_view value) override {
    base_->queue_push(key, value);
  }
  using Store::queue_pop;
  std::optional<std::string> queue_pop(const std::string& key, bool block,
                                       Duration timeout) override {
    return base_->queue_pop(key, block, timeout);
  }
  int64_t queue_len(const std::string& key) override { return base_->queue_len(key); }
  std::vector<std::string> list_keys() override { return base_->list_keys(); }

 private:
  std::string what(const std::vector<std::string>& keys) const;

  std::shared_ptr<store::Store> base_;
  std::string who_, purpose_, where_;
  std::function<std::string()> abandon_;
};

}  // namespace trun::worker::detail
