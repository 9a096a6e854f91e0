#include "rendezvous/etcd/backend.h"

#include <spdlog/spdlog.h>

#include <condition_variable>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>
#include <utility>

#include "rendezvous/etcd/kv.h"

namespace trun::rendezvous {
namespace {

using etcd::Clock;
using etcd::Compare;
using etcd::Op;
using json = nlohmann::json;

// etcd's lease for a LeaseSpec without a ttl (c10d binds those to the connection; etcd cannot).
constexpr std::chrono::seconds kDefaultLeaseTtl{15};

std::string random_name() {
  std::random_device rd;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%08x%08x", rd(), rd());
  return buf;
}

class EtcdBackend : public RendezvousBackend {
 public:
  explicit EtcdBackend(const EtcdBackendOptions& o)
      : options_(o),
        kv_(kv_options()),
        dir_("trun/etcd/" + o.run_id + "/"),
        node_tag_(random_name() + "-"),
        record_(kv_.full(dir_ + "leases/" + node_tag_)) {
    // The run's first revision: where the record watch starts, so it also sees leases that
    // expired before this node came.
    const std::string marker = kv_.full(dir_ + "started");
    auto r =
        kv_.client().txn({Compare::missing(marker)}, {Op::put(marker, "")}, {Op::range(marker)});
    start_revision_ = r.succeeded ? r.revision : r.reads[0]->create_revision;
    watcher_ = std::thread([this] { watch_records(); });
  }

  ~EtcdBackend() override {
    {
      std::lock_guard<std::mutex> lock(watcher_mu_);
      stopping_ = true;
      if (watch_) watch_->interrupt();
    }
    watcher_cv_.notify_all();
    watcher_.join();
  }

  std::string name() const override { return "etcd"; }

  void set(const std::string& key, const std::string& value) override { kv_.set(key, value); }
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override {
    return kv_.compare_set(key, expected, desired);
  }
  // The protocol's counters (tickets, goodbyes) only count arrivals. Each arrival is a key of its
  // own under `<key>/+/`, and its count is the number of arrivals that exist right after it is
  // written, in the same transaction (arrivals are never deleted): one request and no retries,
  // where a read-modify-write counter made each of 256 nodes joining at once retry about 100 times.
  // Such counters are read with add(key, 0), never try_get.
  int64_t add(const std::string& key, int64_t delta) override {
    if (delta != 0 && delta != 1) {
      throw std::invalid_argument("etcd rendezvous backend: add() counts up by one (got " +
                                  std::to_string(delta) + ")");
    }
    const std::string arrivals = etcd_counter_arrivals(kv_.full(key));
    if (delta == 0) return kv_.client().count_prefix(arrivals);
    // One transaction: the count after our arrival, at our arrival's revision.
    auto r = kv_.client().txn({}, {Op::put(arrivals + node_tag_ + std::to_string(++arrivals_), ""),
                                   Op::count_prefix(arrivals)});
    return r.counts[1];
  }
  void append(const std::string& key, const std::string& value) override { kv_.append(key, value); }
  std::optional<std::string> try_get(const std::string& key) override { return kv_.try_get(key); }
  std::vector<std::string> multi_get(const std::vector<std::string>& keys,
                                     Duration timeout) override {
    return kv_.multi_get(keys, timeout);
  }
  std::optional<std::string> wait_get(const std::string& key, Duration timeout) override {
    return kv_.wait_get(key, timeout);
  }
  void interrupt_waits() override { kv_.interrupt_waits(); }

  void arm_lease(const store::LeaseSpec& lease) override {
    json action = {{"a_key", lease.a_key},
                   {"a_value", lease.a_value},
                   {"b_key", lease.b_key},
                   {"b_value", lease.b_value}};
    std::lock_guard<std::mutex> lock(lease_mu_);
    for (int attempt = 0;; ++attempt) {
      if (lease_id_ == 0) {
        lease_id_ = kv_.client().lease_grant(lease.ttl.count() > 0 ? lease.ttl : kDefaultLeaseTtl);
      }
      std::vector<Op> ops;
      if (!lease.set_key.empty()) ops.push_back(Op::put(kv_.full(lease.set_key), lease.set_value));
      ops.push_back(Op::put(record_, action.dump(), lease_id_));
      try {
        kv_.client().txn({}, ops);
        return;
      } catch (const etcd::EtcdError& e) {
        // Our lease expired since the last renewal: take a new one.
        if (e.code() != etcd::EtcdError::kNotFound || attempt > 0) throw;
        lease_id_ = 0;
      }
    }
  }

  bool renew_lease() override {
    std::lock_guard<std::mutex> lock(lease_mu_);
    if (lease_id_ == 0) return false;
    if (kv_.client().lease_keep_alive(lease_id_)) return true;
    lease_id_ = 0;  // expired: the watchers fired its action
    return false;
  }

  void release_lease() override {
    std::lock_guard<std::mutex> lock(lease_mu_);
    if (lease_id_ == 0) return;
    int64_t id = std::exchange(lease_id_, 0);
    try {
      kv_.client().put(record_, "", id);  // an empty record fires nothing when revoked
    } catch (const etcd::EtcdError& e) {
      if (e.code() != etcd::EtcdError::kNotFound) throw;
      return;  // already expired (and fired)
    }
    kv_.client().lease_revoke(id);
  }

  std::shared_ptr<store::Store> agent_store() override {
    std::lock_guard<std::mutex> lock(agent_mu_);
    if (!agent_) agent_ = etcd::make_etcd_store(kv_options());
    return agent_;
  }

  uint64_t requests_sent() const override { return kv_.requests(); }

 private:
  etcd::KvOptions kv_options() const {
    etcd::KvOptions k;
    k.endpoints.clear();
    for (auto& [host, port] : options_.endpoints) k.endpoints.push_back({host, port});
    k.prefix = options_.prefix;
    k.timeout = options_.read_timeout;
    k.connect_timeout = options_.connect_timeout;
    return k;
  }

  // The watcher thread: carries out the action of every record that etcd deletes while it holds
  // one (an expired lease), from the run's first revision on. Reconnects while etcd is away.
  void watch_records() {
    const std::string dir = kv_.full(dir_ + "leases/");
    int64_t from = start_revision_;
    auto pause = std::chrono::milliseconds(100);
    size_t failures = 0;  // in a row: each new watch starts at the next endpoint
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(watcher_mu_);
        if (stopping_) return;
      }
      try {
        auto watch = std::make_unique<etcd::Watch>(
            kv_.options().endpoints,
            etcd::Watch::Options{dir, etcd::prefix_end(dir), from, true, failures});
        {
          std::lock_guard<std::mutex> lock(watcher_mu_);
          if (stopping_) return;
          watch_ = watch.get();  // from here on the destructor can interrupt it
        }
        try {
          watch->open(Clock::now() + options_.read_timeout);
          pause = std::chrono::milliseconds(100);
          failures = 0;
          for (;;) {
            auto events = watch->next(Clock::now() + std::chrono::seconds(1));
            if (events) {
              for (auto& e : *events) {
                if (e.is_delete && e.prev_kv && !e.prev_kv->value.empty()) fire(*e.prev_kv);
              }
            }
            from = std::max(from, watch->revision() + 1);
          }
        } catch (...) {
          if (watch->compact_revision() > from) from = watch->compact_revision();
          std::lock_guard<std::mutex> lock(watcher_mu_);
          watch_ = nullptr;
          throw;
        }
      } catch (const std::exception& e) {  // nothing may escape the thread
        ++failures;
        std::unique_lock<std::mutex> lock(watcher_mu_);
        if (stopping_) return;
        // Quiet while etcd blinks; a warning once it stays away (the keep-alives report it too).
        spdlog::log(
            pause >= std::chrono::milliseconds(1600) ? spdlog::level::warn : spdlog::level::debug,
            "etcd rendezvous: lease watch: {}; again in {} ms", e.what(), pause.count());
        watcher_cv_.wait_for(lock, pause, [this] { return stopping_; });
        pause = std::min(pause * 2, std::chrono::milliseconds(2000));
      }
    }
  }

  // Carries out an expired lease's action once across all watchers: if `a_key` is missing it is
  // set, otherwise `b_value` is appended to `b_key` (the LeaseSpec contract). A StoreError goes to
  // the watcher, whose new watch replays this event (the claim makes a repeat harmless).
  void fire(const etcd::KeyValue& record) {
    json action = json::parse(record.value, nullptr, /*allow_exceptions=*/false);
    if (!action.is_object()) {
      spdlog::warn("etcd rendezvous: ignoring the unreadable lease record {}", record.key);
      return;
    }
    auto field = [&](const char* name) {
      auto it = action.find(name);
      return it != action.end() && it->is_string() ? it->get<std::string>() : std::string();
    };
    const std::string claim = kv_.full(dir_ + "fired/") +
                              record.key.substr(record.key.rfind('/') + 1) + "@" +
                              std::to_string(record.mod_revision);
    const std::string a_key = field("a_key"), b_key = field("b_key");
    if (!a_key.empty()) {
      const std::string a = kv_.full(a_key);
      auto r =
          kv_.client().txn({Compare::missing(claim), Compare::missing(a)},
                           {Op::put(claim, "1"), Op::put(a, field("a_value"))}, {Op::range(claim)});
      if (r.succeeded || r.reads[0]) return;  // done here, or by another node
    }
    if (b_key.empty()) {
      kv_.client().txn({Compare::missing(claim)}, {Op::put(claim, "1")});
      return;
    }
    const std::string b_value = field("b_value");
    kv_.update(kv_.full(b_key),
               [&](const std::optional<std::string>& cur) { return cur.value_or("") + b_value; },
               {claim}, {Op::put(claim, "1")});
  }

  EtcdBackendOptions options_;
  etcd::Kv kv_;
  const std::string dir_;       // relative: the run's backend keys
  const std::string node_tag_;  // unique to this backend: its arrivals and its lease record
  std::atomic<uint64_t> arrivals_{0};
  const std::string record_;  // full key of this node's lease record
  int64_t start_revision_ = 0;

  std::mutex lease_mu_;
  int64_t lease_id_ = 0;  // under lease_mu_; 0: none

  std::mutex agent_mu_;
  std::shared_ptr<store::Store> agent_;

  std::mutex watcher_mu_;
  std::condition_variable watcher_cv_;
  bool stopping_ = false;         // under watcher_mu_
  etcd::Watch* watch_ = nullptr;  // under watcher_mu_
  std::thread watcher_;
};

}  // namespace

std::unique_ptr<RendezvousBackend> connect_etcd_backend(const EtcdBackendOptions& options) {
  return std::make_unique<EtcdBackend>(options);
}

}  // namespace trun::rendezvous
