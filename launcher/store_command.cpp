#include "launcher/store_command.h"

#include <signal.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "base/decimal.h"
#include "rendezvous/dynamic_rendezvous.h"
#include "store/relay.h"
#include "store/server.h"
#include "store/store.h"

namespace trun::launcher {
namespace {

// Sizes are read as text and checked here: read into an unsigned number, -1 would wrap around
// to "no limit".
struct SizeOption {
  const char* name;
  uint64_t* target;
  std::string text;
};

// What the command line says. Not copyable: `sizes` point into `opts`.
struct StoreArgs {
  store::StoreServerOptions opts;
  int port = 29500;
  std::string token;
  std::string relay_to;
  SizeOption sizes[3] = {
      {"--max-key-bytes", &opts.limits.max_key_bytes, ""},
      {"--max-value-bytes", &opts.limits.max_value_bytes, ""},
      {"--max-pending-output", &opts.max_pending_output, ""},
  };

  StoreArgs() {
    opts.host = "127.0.0.1";
    if (const char* env = std::getenv("TRUN_STORE_TOKEN")) token = env;
    for (auto& size : sizes) size.text = std::to_string(*size.target);
  }
  StoreArgs(const StoreArgs&) = delete;
  StoreArgs& operator=(const StoreArgs&) = delete;
};

void declare_options(CLI::App& app, StoreArgs& args) {
  app.add_option("--host", args.opts.host, "Address to listen on (0.0.0.0 or :: for all)")
      ->capture_default_str();
  app.add_option("--port", args.port, "Port to listen on; 0 picks a free one and prints it")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  app.add_option("--store-token", args.token,
                 "Shared secret clients must prove they know (default: $TRUN_STORE_TOKEN). Stock "
                 "PyTorch clients cannot authenticate");
  SizeOption* sizes = args.sizes;
  app.add_option(sizes[0].name, sizes[0].text, "Largest key accepted, in bytes")
      ->capture_default_str();
  app.add_option(sizes[1].name, sizes[1].text,
                 "Largest value accepted, in bytes (also bounds one MULTI_GET's values together)")
      ->capture_default_str();
  app.add_option(sizes[2].name, sizes[2].text,
                 "Unsent reply bytes per client over which the store stops serving that client "
                 "until it reads (memory per client: this plus one reply)")
      ->capture_default_str();
  app.add_option("--relay-to", args.relay_to,
                 "HOST:PORT of a store: relay to it instead of holding the keys here. Agents "
                 "connect to the relay as to the store (--rdzv-endpoint, is_host=false); it "
                 "shares their waits and keeps their leases, so the store serves relays, not "
                 "every agent");
}

// Stores each size in its target: a whole number of bytes from 1 to 2^63-1. Otherwise says which
// option is wrong and returns false.
bool apply_sizes(StoreArgs& args) {
  for (auto& size : args.sizes) {
    const std::string& t = size.text;
    // Unsigned, so no sign is accepted: "-1" and "+1" are not numbers here.
    uint64_t value = 0;
    if (!base::parse_decimal(t, &value) || value < 1 || value > static_cast<uint64_t>(INT64_MAX)) {
      std::fprintf(stderr,
                   "trun store: %s=%s: expected a positive whole number of bytes (at most %lld)\n",
                   size.name, t.c_str(), static_cast<long long>(INT64_MAX));
      return false;
    }
    *size.target = value;
  }
  return true;
}

// The relay's options from --relay-to and the server's options. Says what is wrong and returns
// false if --relay-to is not one HOST:PORT, or a token is given with it.
bool make_relay_options(const StoreArgs& args, store::StoreRelayOptions* relay_opts) {
  const std::string& relay_to = args.relay_to;
  std::vector<std::pair<std::string, uint16_t>> ups;
  try {
    ups = rendezvous::parse_c10d_endpoints(relay_to);
  } catch (const std::exception&) {
    std::fprintf(stderr, "trun store: --relay-to=%s: expected the store's HOST:PORT\n",
                 relay_to.c_str());
    return false;
  }
  if (ups.size() != 1) {
    std::fprintf(stderr, "trun store: --relay-to=%s: give one HOST:PORT\n", relay_to.c_str());
    return false;
  }
  if (!args.token.empty()) {
    std::fprintf(stderr,
                 "trun store: --relay-to: a relay does not authenticate its clients or itself "
                 "(no --store-token / TRUN_STORE_TOKEN with a relay)\n");
    return false;
  }
  relay_opts->host = args.opts.host;
  relay_opts->port = args.opts.port;
  relay_opts->upstream_host = ups[0].first;
  relay_opts->upstream_port = ups[0].second;
  relay_opts->limits = args.opts.limits;
  relay_opts->max_pending_output = args.opts.max_pending_output;
  return true;
}

// Blocks SIGINT and SIGTERM in this thread (and the threads it starts after), for sigwait.
sigset_t block_stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

// Starts the store (or, with --relay-to, the relay), prints where it listens and serves until
// SIGINT or SIGTERM. Returns the exit code.
int serve_until_signal(const StoreArgs& args, const store::StoreRelayOptions& relay_opts) {
  // Block the signals before the server's thread starts so only sigwait sees them.
  sigset_t set = block_stop_signals();
  std::unique_ptr<store::StoreServer> server;
  std::unique_ptr<store::StoreRelay> relay;
  try {
    if (args.relay_to.empty()) {
      server = store::StoreServer::start(args.opts);
    } else {
      relay = store::StoreRelay::start(relay_opts);
    }
  } catch (const store::StoreError& e) {
    std::fprintf(stderr, "trun store: %s\n", e.what());
    return 1;
  }
  if (relay) {
    std::printf("trun store relaying %s:%u to %s\n", args.opts.host.c_str(), relay->port(),
                args.relay_to.c_str());
    std::fflush(stdout);
    int sig = 0;
    sigwait(&set, &sig);
    spdlog::info("trun store: signal {} received, stopping the relay", sig);
    relay->stop();
    return 0;
  }
  std::printf("trun store listening on %s:%u%s\n", args.opts.host.c_str(), server->port(),
              args.token.empty() ? "" : " (token required)");
  std::fflush(stdout);
  int sig = 0;
  sigwait(&set, &sig);
  spdlog::info("trun store: signal {} received, stopping", sig);
  server->stop();
  return 0;
}

}  // namespace

int run_store_command(int argc, char** argv) {
  CLI::App app{
      "Runs trun's rendezvous store (wire-compatible with PyTorch's TCPStore) until "
      "SIGINT or SIGTERM; with --relay-to, a relay in front of one (docs/rendezvous.md, Scale).",
      "trun store"};
  StoreArgs args;
  declare_options(app, args);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "trun store: %s\n", e.what());
    return 2;
  }
  if (!apply_sizes(args)) return 2;
  args.opts.port = static_cast<uint16_t>(args.port);
  // Logs go to stderr: stdout carries only the "listening on" line that scripts read.
  spdlog::set_default_logger(spdlog::stderr_color_mt("trun-store"));
  args.opts.token = args.token;

  store::StoreRelayOptions relay_opts;
  if (!args.relay_to.empty() && !make_relay_options(args, &relay_opts)) return 2;
  return serve_until_signal(args, relay_opts);
}

}  // namespace trun::launcher
