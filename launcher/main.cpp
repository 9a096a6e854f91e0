// trun: entry point. `trun store ...` runs the store on its own; anything else is the launcher.
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "agent/elastic_agent.h"
#include "launcher/cli.h"
#include "launcher/store_command.h"

namespace {

// LOGLEVEL as torchrun reads it (DEBUG, INFO, WARNING, ERROR, CRITICAL); default WARNING.
void setup_logging() {
  auto logger = spdlog::stderr_logger_mt("trun");
  logger->set_pattern("[%H:%M:%S.%e] trun %l: %v");
  spdlog::set_default_logger(logger);
  std::string level = "warning";
  if (const char* env = std::getenv("LOGLEVEL"); env && *env) {
    level = env;
    for (auto& c : level) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  if (level == "warning") level = "warn";
  if (level == "critical") level = "critical";
  if (level == "fatal") level = "critical";
  auto parsed = spdlog::level::from_str(level);
  if (parsed == spdlog::level::off && level != "off") {
    std::fprintf(stderr,
                 "trun: warning: LOGLEVEL=%s is not one of DEBUG, INFO, WARNING, ERROR, "
                 "CRITICAL; using WARNING\n",
                 std::getenv("LOGLEVEL"));
    parsed = spdlog::level::warn;
  }
  spdlog::set_level(parsed);
  logger->flush_on(spdlog::level::trace);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "store") == 0) {
    return trun::launcher::run_store_command(argc - 1, argv + 1);
  }
  setup_logging();
  trun::launcher::CliResult cli = trun::launcher::parse_command_line(argc, argv);
  if (!cli.config) {
    if (!cli.error.empty()) std::fprintf(stderr, "trun: error: %s\n", cli.error.c_str());
    return cli.exit_code;
  }
  for (const auto& note : cli.notes) spdlog::warn("{}", note);
  trun::agent::ElasticAgent agent(*cli.config);
  return agent.run();
}
