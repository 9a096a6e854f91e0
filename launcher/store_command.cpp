#include "launcher/store_command.h"

#include <signal.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "rendezvous/dynamic_rendezvous.h"
#include "store/relay.h"
#include "store/server.h"
#include "store/store.h"

namespace trun::launcher {

int run_store_command(int argc, char** argv) {
  CLI::App app{
      "Runs trun's rendezvous store (wire-compatible with PyTorch's TCPStore) until "
      "SIGINT or SIGTERM; with --relay-to, a relay in front of one (docs/rendezvous.md, Scale).",
      "trun store"};
  store::StoreServerOptions opts;
  opts.host = "127.0.0.1";
  int port = 29500;
  std::string token;
  if (const char* env = std::getenv("TRUN_STORE_TOKEN")) token = env;
  app.add_option("--host", opts.host, "Address to listen on (0.0.0.0 or :: for all)")
      ->capture_default_str();
  app.add_option("--port", port, "Port to listen on; 0 picks a free one and prints it")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  app.add_option("--store-token", token,
                 "Shared secret clients must prove they know (default: $TRUN_STORE_TOKEN). Stock "
                 "PyTorch clients cannot authenticate");
  // Sizes are read as text and checked here: read into an unsigned number, -1 would wrap around
  // to "no limit".
  struct SizeOption {
    const char* name;
    uint64_t* target;
    std::string text;
  };
  SizeOption sizes[] = {
      {"--max-key-bytes", &opts.limits.max_key_bytes, ""},
      {"--max-value-bytes", &opts.limits.max_value_bytes, ""},
      {"--max-pending-output", &opts.max_pending_output, ""},
  };
  for (auto& size : sizes) size.text = std::to_string(*size.target);
  app.add_option(sizes[0].name, sizes[0].text, "Largest key accepted, in bytes")
      ->capture_default_str();
  app.add_option(sizes[1].name, sizes[1].text,
                 "Largest value accepted, in bytes (also bounds one MULTI_GET's values together)")
      ->capture_default_str();
  app.add_option(sizes[2].name, sizes[2].text,
                 "Unsent reply bytes per client over which the store stops serving that client "
                 "until it reads (memory per client: this plus one reply)")
      ->capture_default_str();
  std::string relay_to;
  app.add_option("--relay-to", relay_to,
                 "HOST:PORT of a store: relay to it instead of holding the keys here. Agents "
                 "connect to the relay as to the store (--rdzv-endpoint, is_host=false); it "
                 "shares their waits and keeps their leases, so the store serves relays, not "
                 "every agent");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "trun store: %s\n", e.what());
    return 2;
  }
  for (auto& size : sizes) {
    const std::string& t = size.text;
    uint64_t value = 0;
    auto [end, err] = std::from_chars(t.data(), t.data() + t.size(), value);
    if (t.empty() || err != std::errc() || end != t.data() + t.size() || value < 1 ||
        value > static_cast<uint64_t>(INT64_MAX)) {
      std::fprintf(stderr,
                   "trun store: %s=%s: expected a positive whole number of bytes (at most %lld)\n",
                   size.name, t.c_str(), static_cast<long long>(INT64_MAX));
      return 2;
    }
    *size.target = value;
  }
  opts.port = static_cast<uint16_t>(port);
  // Logs go to stderr: stdout carries only the "listening on" line that scripts read.
  spdlog::set_default_logger(spdlog::stderr_color_mt("trun-store"));
  opts.token = token;

  store::StoreRelayOptions relay_opts;
  if (!relay_to.empty()) {
    std::vector<std::pair<std::string, uint16_t>> ups;
    try {
      ups = rendezvous::parse_c10d_endpoints(relay_to);
    } catch (const std::exception&) {
      std::fprintf(stderr, "trun store: --relay-to=%s: expected the store's HOST:PORT\n",
                   relay_to.c_str());
      return 2;
    }
    if (ups.size() != 1) {
      std::fprintf(stderr, "trun store: --relay-to=%s: give one HOST:PORT\n", relay_to.c_str());
      return 2;
    }
    if (!token.empty()) {
      std::fprintf(stderr,
                   "trun store: --relay-to: a relay does not authenticate its clients or itself "
                   "(no --store-token / TRUN_STORE_TOKEN with a relay)\n");
      return 2;
    }
    relay_opts.host = opts.host;
    relay_opts.port = opts.port;
    relay_opts.upstream_host = ups[0].first;
    relay_opts.upstream_port = ups[0].second;
    relay_opts.limits = opts.limits;
    relay_opts.max_pending_output = opts.max_pending_output;
  }

  // Block the signals before the server's thread starts so only sigwait sees them.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);

  std::unique_ptr<store::StoreServer> server;
  std::unique_ptr<store::StoreRelay> relay;
  try {
    if (relay_to.empty()) {
      server = store::StoreServer::start(opts);
    } else {
      relay = store::StoreRelay::start(relay_opts);
    }
  } catch (const store::StoreError& e) {
    std::fprintf(stderr, "trun store: %s\n", e.what());
    return 1;
  }
  if (relay) {
    std::printf("trun store relaying %s:%u to %s\n", opts.host.c_str(), relay->port(),
                relay_to.c_str());
    std::fflush(stdout);
    int sig = 0;
    sigwait(&set, &sig);
    spdlog::info("trun store: signal {} received, stopping the relay", sig);
    relay->stop();
    return 0;
  }
  std::printf("trun store listening on %s:%u%s\n", opts.host.c_str(), server->port(),
              token.empty() ? "" : " (token required)");
  std::fflush(stdout);
  int sig = 0;
  sigwait(&set, &sig);
  spdlog::info("trun store: signal {} received, stopping", sig);
  server->stop();
  return 0;
}

}  // namespace trun::launcher
