#include "rendezvous/static_rendezvous.h"

#include "rendezvous/store/prefix_store.h"
#include "rendezvous/store/server.h"
#include "rendezvous/store/tcp_store.h"

namespace trun::rendezvous {
namespace {

class StaticRendezvous : public RendezvousHandler {
 public:
  explicit StaticRendezvous(StaticRendezvousOptions options) : options_(std::move(options)) {
    if (options_.world_size < 1 || options_.rank < 0 || options_.rank >= options_.world_size) {
      throw RendezvousError("static rendezvous: rank " + std::to_string(options_.rank) +
                            " is outside 0.." + std::to_string(options_.world_size - 1));
    }
    if (options_.port == 0 && options_.world_size > 1) {
      throw RendezvousError("static rendezvous: port 0 only works on a single node");
    }
  }
  ~StaticRendezvous() override { shutdown(); }

  std::string backend() const override { return "static"; }
  std::string run_id() const override { return options_.run_id; }

  RendezvousInfo next_rendezvous() override {
    if (options_.rank == 0 && !server_) {
      StoreServerOptions so;
      so.host = options_.host;
      so.port = options_.port;
      try {
        server_ = StoreServer::start(so);
      } catch (const StoreError& e) {
        throw RendezvousError("static rendezvous: cannot host the store on " + options_.host + ":" +
                              std::to_string(options_.port) + ": " + e.what());
      }
    }
    RendezvousInfo info;
    info.group_rank = options_.rank;
    info.group_world_size = options_.world_size;
    info.master_addr = options_.host;
    info.master_port = server_ ? server_->port() : options_.port;
    info.use_agent_store = true;
    if (options_.world_size > 1) {
      if (!store_) {
        TcpStoreOptions to;
        to.host = options_.host;
        to.port = info.master_port;
        to.timeout = options_.timeout;
        to.connect_timeout = options_.timeout;
        try {
          auto tcp = std::make_shared<TcpStore>(to);
          store_ = std::make_shared<PrefixStore>("torchelastic/" + options_.run_id, tcp);
        } catch (const StoreError& e) {
          throw RendezvousError(std::string("static rendezvous: ") + e.what());
        }
      }
      info.store = store_;
    }
    return info;
  }

  int num_nodes_waiting() override { return 0; }

  void shutdown() override {
    store_.reset();
    if (server_) server_->stop();
  }

 private:
  StaticRendezvousOptions options_;
  std::unique_ptr<StoreServer> server_;
  std::shared_ptr<Store> store_;
};

}  // namespace

std::unique_ptr<RendezvousHandler> create_static_rendezvous(
    const StaticRendezvousOptions& options) {
  return std::make_unique<StaticRendezvous>(options);
}

}  // namespace trun::rendezvous
