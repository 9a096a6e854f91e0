#include "rendezvous/etcd/kv.h"

#include <algorithm>
#include <random>
#include <thread>
#include <utility>

#include "base/decimal.h"

namespace trun::rendezvous::etcd {
namespace {

// Retries of one read-modify-write under contention, each after a short random pause so that
// many nodes taking tickets at once do not collide in lockstep.
constexpr int kMaxUpdateAttempts = 10000;
// etcd refuses transactions of more than --max-txn-ops operations (128 by default).
constexpr std::ptrdiff_t kMaxTxnOps = 128;

void contention_pause(int attempt) {
  thread_local std::minstd_rand rng(std::random_device{}());
  int cap_us = std::min(50 << std::min(attempt, 6), 5000);
  std::this_thread::sleep_for(std::chrono::microseconds(rng() % (cap_us + 1)));
}

int64_t parse_counter(const std::string& key, const std::optional<std::string>& value) {
  if (!value) return 0;
  int64_t v = 0;  // stoll's syntax as always: a leading '+' or spaces are taken
  if (base::parse_decimal(*value, &v, base::DecimalSyntax{true, true})) return v;
  throw store::StoreError("etcd: add on key '" + key + "': its value '" + *value +
                          "' is not an integer");
}

}  // namespace

Kv::Kv(const KvOptions& options)
    : options_(options), client_(options.endpoints, options.timeout, options.connect_timeout) {}

std::optional<std::string> Kv::try_get(const std::string& key) {
  auto kv = client_.get(full(key));
  if (!kv) return std::nullopt;
  return kv->value;
}

void Kv::set(const std::string& key, const std::string& value) { client_.put(full(key), value); }

std::string Kv::compare_set(const std::string& key, const std::string& expected,
                            const std::string& desired) {
  const std::string k = full(key);
  if (expected.empty()) {
    auto r = client_.txn({Compare::missing(k)}, {Op::put(k, desired)}, {Op::range(k)});
    if (r.succeeded) return desired;
    if (!r.reads[0] || !r.reads[0]->value.empty()) return r.reads[0] ? r.reads[0]->value : desired;
    // The key exists and holds "": that is `expected` too.
  }
  auto r = client_.txn({Compare::value_is(k, expected)}, {Op::put(k, desired)}, {Op::range(k)});
  if (r.succeeded) return desired;
  return r.reads[0] ? r.reads[0]->value : expected;  // missing with a non-empty expected: c10d
}

std::optional<std::string> Kv::update(
    const std::string& key, const std::function<std::string(const std::optional<std::string>&)>& f,
    const std::vector<std::string>& absent, const std::vector<Op>& also) {
  const auto deadline = Clock::now() + options_.timeout;
  std::vector<Op> reads{Op::range(key)};
  for (auto& a : absent) reads.push_back(Op::range(a));
  std::optional<KeyValue> current = client_.get(key);
  for (int attempt = 0; attempt < kMaxUpdateAttempts; ++attempt) {
    std::optional<std::string> value;
    if (current) value = current->value;
    std::string next = f(value);
    std::vector<Compare> compares{current ? Compare::mod_revision_is(key, current->mod_revision)
                                          : Compare::missing(key)};
    for (auto& a : absent) compares.push_back(Compare::missing(a));
    std::vector<Op> writes{Op::put(key, next)};
    writes.insert(writes.end(), also.begin(), also.end());
    auto r = client_.txn(compares, writes, reads);
    if (r.succeeded) return next;
    for (size_t i = 0; i < absent.size(); ++i) {
      if (r.reads[1 + i]) return std::nullopt;
    }
    current = r.reads[0];
    if (Clock::now() >= deadline) break;
    contention_pause(attempt);
  }
  throw store::StoreTimeoutError("etcd at " + client_.endpoint() + ": key '" + key +
                                 "' kept changing under concurrent updates until the timeout");
}

int64_t Kv::add(const std::string& key, int64_t delta) {
  const std::string k = full(key);
  if (delta == 0) return parse_counter(key, try_get(key));  // a read: no write, no contention
  auto v = update(k, [&](const std::optional<std::string>& cur) {
    return std::to_string(parse_counter(key, cur) + delta);
  });
  return std::stoll(*v);
}

void Kv::append(const std::string& key, const std::string& value) {
  update(full(key),
         [&](const std::optional<std::string>& cur) { return cur.value_or("") + value; });
}

std::vector<std::optional<KeyValue>> Kv::txn_in_chunks(const std::vector<Op>& ops) {
  std::vector<std::optional<KeyValue>> reads;
  reads.reserve(ops.size());
  for (auto it = ops.begin(); it != ops.end();) {
    auto end = it + std::min<std::ptrdiff_t>(kMaxTxnOps, ops.end() - it);
    auto r = client_.txn({}, std::vector<Op>(it, end));
    reads.insert(reads.end(), r.reads.begin(), r.reads.end());
    it = end;
  }
  return reads;
}

std::vector<std::optional<KeyValue>> Kv::read_all(const std::vector<std::string>& keys) {
  std::vector<Op> ops;
  ops.reserve(keys.size());
  for (auto& k : keys) ops.push_back(Op::range(full(k)));
  return txn_in_chunks(ops);
}

bool Kv::check(const std::vector<std::string>& keys) {
  for (auto& kv : read_all(keys)) {
    if (!kv) return false;
  }
  return true;
}

bool Kv::erase(const std::string& key) { return client_.erase(full(key)); }

int64_t Kv::num_keys() { return client_.count_prefix(options_.prefix); }

void Kv::multi_set(const std::vector<std::string>& keys, const std::vector<std::string>& values) {
  if (keys.size() != values.size()) {
    throw std::invalid_argument("multi_set: " + std::to_string(keys.size()) + " keys but " +
                                std::to_string(values.size()) + " values");
  }
  std::vector<Op> ops;
  ops.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) ops.push_back(Op::put(full(keys[i]), values[i]));
  txn_in_chunks(ops);
}

std::optional<std::string> Kv::wait_get(const std::string& key, Duration timeout) {
  const auto deadline = Clock::now() + timeout;
  const std::string k = full(key);
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    if (std::exchange(interrupt_pending_, false)) {
      throw store::StoreError("etcd at " + client_.endpoint() + ": wait for '" + k +
                              "': interrupted");
    }
  }
  // A watch broken by the death of the member it went to is taken up on another member (a read
  // first, then a new watch from after it): one try per member.
  for (size_t attempt = 0;; ++attempt) {
    int64_t revision = 0;
    if (auto kv = client_.get(k, &revision)) return kv->value;
    // Registered before any I/O, so interrupt_waits() reaches it from here on.
    Watch watch(options_.endpoints, Watch::Options{k, "", revision + 1, false, attempt});
    {
      std::lock_guard<std::mutex> lock(watch_mu_);
      if (std::exchange(interrupt_pending_, false)) watch.interrupt();
      active_.push_back(&watch);
    }
    struct Unregister {
      Kv* kv;
      Watch* w;
      ~Unregister() {
        std::lock_guard<std::mutex> lock(kv->watch_mu_);
        kv->active_.erase(std::find(kv->active_.begin(), kv->active_.end(), w));
      }
    } unregister{this, &watch};
    ++watches_;
    try {
      watch.open(deadline);
      for (;;) {
        auto events = watch.next(deadline);
        if (!events) return std::nullopt;
        for (auto& e : *events) {
          if (!e.is_delete && e.kv.key == k) return e.kv.value;
        }
      }
    } catch (const store::StoreTimeoutError&) {
      return std::nullopt;
    } catch (const store::StoreError&) {
      if (watch.interrupted() || attempt + 1 >= options_.endpoints.size()) throw;
    }
  }
}

std::vector<std::string> Kv::multi_get(const std::vector<std::string>& keys, Duration timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    auto reads = read_all(keys);
    std::vector<std::string> values;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!reads[i]) {
        auto left = std::chrono::duration_cast<Duration>(deadline - Clock::now());
        if (left <= Duration(0) || !wait_get(keys[i], left)) {
          throw store::StoreTimeoutError("etcd at " + client_.endpoint() + ": key '" +
                                         full(keys[i]) + "' was not set within " +
                                         std::to_string(timeout.count() / 1000.0) + " s");
        }
        break;  // read them all again, at once
      }
      values.push_back(std::move(reads[i]->value));
    }
    if (values.size() == keys.size()) return values;
  }
}

void Kv::interrupt_waits() {
  std::lock_guard<std::mutex> lock(watch_mu_);
  if (active_.empty()) interrupt_pending_ = true;
  for (auto* w : active_) w->interrupt();
}

namespace {

class EtcdStore : public store::Store {
 public:
  explicit EtcdStore(const KvOptions& options) : kv_(options) { timeout_ = options.timeout; }

  void set(const std::string& key, std::string_view value) override {
    kv_.set(key, std::string(value));
  }
  std::string get(const std::string& key, Duration timeout) override {
    auto v = kv_.wait_get(key, timeout);
    if (!v) {
      throw store::StoreTimeoutError("etcd at " + kv_.client().endpoint() + ": get '" +
                                     kv_.full(key) + "': not set within " +
                                     std::to_string(timeout.count() / 1000.0) + " s");
    }
    return *v;
  }
  int64_t add(const std::string& key, int64_t delta) override { return kv_.add(key, delta); }
  std::string compare_set(const std::string& key, std::string_view expected,
                          std::string_view desired) override {
    return kv_.compare_set(key, std::string(expected), std::string(desired));
  }
  bool check(const std::vector<std::string>& keys) override { return kv_.check(keys); }
  void wait(const std::vector<std::string>& keys, Duration timeout) override {
    kv_.multi_get(keys, timeout);
  }
  int64_t num_keys() override { return kv_.num_keys(); }
  bool delete_key(const std::string& key) override { return kv_.erase(key); }
  std::vector<std::string> multi_get(const std::vector<std::string>& keys,
                                     Duration timeout) override {
    return kv_.multi_get(keys, timeout);
  }
  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::string>& values) override {
    kv_.multi_set(keys, values);
  }
  void append(const std::string& key, std::string_view value) override {
    kv_.append(key, std::string(value));
  }

 private:
  Kv kv_;
};

}  // namespace

std::shared_ptr<store::Store> make_etcd_store(const KvOptions& options) {
  return std::make_shared<EtcdStore>(options);
}

}  // namespace trun::rendezvous::etcd
