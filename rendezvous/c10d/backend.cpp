#include "rendezvous/c10d/backend.h"

#include <atomic>
#include <mutex>

#include "store/tcp_store.h"

namespace trun::rendezvous {
namespace {

class StoreBackend : public RendezvousBackend {
 public:
  explicit StoreBackend(const StoreBackendOptions& o) : options_(o) {
    control_ = std::make_unique<store::TcpStore>(tcp_options());
    waiter_ = std::make_unique<store::TcpStore>(tcp_options());
  }

  std::string name() const override { return "c10d"; }

  void set(const std::string& key, const std::string& value) override {
    ++requests_;
    control_->set(key, value);
  }
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override {
    ++requests_;
    return control_->compare_set(key, expected, desired);
  }
  int64_t add(const std::string& key, int64_t delta) override {
    ++requests_;
    return control_->add(key, delta);
  }
  void append(const std::string& key, const std::string& value) override {
    ++requests_;
    control_->append(key, value);
  }
  std::optional<std::string> try_get(const std::string& key) override {
    ++requests_;
    try {
      return control_->get(key, Duration(0));
    } catch (const store::StoreTimeoutError&) {
      return std::nullopt;
    }
  }
  std::vector<std::string> multi_get(const std::vector<std::string>& keys,
                                     Duration timeout) override {
    // TcpStore's multi_get waits for the keys first (one request), then reads them (another).
    // Both on the wait channel: a missing key must not hold up keep-alives.
    requests_ += 2;
    return waiter_->multi_get(keys, timeout);
  }
  std::optional<std::string> wait_get(const std::string& key, Duration timeout) override {
    ++requests_;
    try {
      return waiter_->get(key, timeout);
    } catch (const store::StoreTimeoutError&) {
      return std::nullopt;
    }
  }
  void interrupt_waits() override { waiter_->interrupt(); }
  void arm_lease(const store::LeaseSpec& lease) override {
    ++requests_;
    control_->lease_arm(lease);
  }
  bool renew_lease() override {
    ++requests_;
    return control_->lease_renew();
  }
  void release_lease() override {
    ++requests_;
    control_->lease_release();
  }
  std::shared_ptr<store::Store> agent_store() override {
    std::lock_guard<std::mutex> lock(agent_mu_);
    if (!agent_) agent_ = std::make_shared<store::TcpStore>(tcp_options());
    return agent_;
  }
  uint64_t requests_sent() const override { return requests_.load(); }

 private:
  store::TcpStoreOptions tcp_options() const {
    store::TcpStoreOptions t;
    t.host = options_.host;
    t.port = options_.port;
    t.token = options_.token;
    t.timeout = options_.read_timeout;
    t.connect_timeout = options_.connect_timeout;
    t.dialect =
        store::StoreDialect::kTrun;  // rendezvous stores are trun's (leases, server-side waits)
    return t;
  }

  StoreBackendOptions options_;
  std::unique_ptr<store::TcpStore> control_;
  std::unique_ptr<store::TcpStore> waiter_;
  std::mutex agent_mu_;
  std::shared_ptr<store::Store> agent_;
  std::atomic<uint64_t> requests_{0};
};

}  // namespace

std::unique_ptr<RendezvousBackend> connect_store_backend(const StoreBackendOptions& options) {
  return std::make_unique<StoreBackend>(options);
}

}  // namespace trun::rendezvous
