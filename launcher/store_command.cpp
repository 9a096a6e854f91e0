#include "launcher/store_command.h"

#include <signal.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>

#include "rendezvous/store/server.h"
#include "rendezvous/store/store.h"

namespace trun::launcher {

int run_store_command(int argc, char** argv) {
  CLI::App app{
      "Runs trun's rendezvous store (wire-compatible with PyTorch's TCPStore) until "
      "SIGINT or SIGTERM.",
      "trun store"};
  rendezvous::StoreServerOptions opts;
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
  app.add_option("--max-key-bytes", opts.limits.max_key_bytes, "Largest key accepted")
      ->capture_default_str();
  app.add_option("--max-value-bytes", opts.limits.max_value_bytes, "Largest value accepted")
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "trun store: %s\n", e.what());
    return 2;
  }
  opts.port = static_cast<uint16_t>(port);
  // Logs go to stderr: stdout carries only the "listening on" line that scripts read.
  spdlog::set_default_logger(spdlog::stderr_color_mt("trun-store"));
  opts.token = token;

  // Block the signals before the server's thread starts so only sigwait sees them.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);

  std::unique_ptr<rendezvous::StoreServer> server;
  try {
    server = rendezvous::StoreServer::start(opts);
  } catch (const rendezvous::StoreError& e) {
    std::fprintf(stderr, "trun store: %s\n", e.what());
    return 1;
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
