// trun: entry point. `trun store ...` runs the store on its own, `trun status ...` shows a job,
// `trun timeline ...` draws a run from its event logs; anything else is the launcher.
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "agent/console.h"
#include "agent/elastic_agent.h"
#include "launcher/cli.h"
#include "launcher/dry_run.h"
#include "launcher/status_command.h"
#include "launcher/store_command.h"
#include "launcher/timeline_command.h"

namespace {

// `text` with what a terminal would act on escaped as \xNN: control characters (a newline
// too, so that an error stays one line), DEL, C1 controls (U+0080..U+009F) and bytes that are
// not UTF-8. Command-line values reach error messages as given, binary garbage included.
std::string printable(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  auto escape = [&](unsigned char c) {
    static const char kHex[] = "0123456789abcdef";
    out += "\\x";
    out += kHex[c >> 4];
    out += kHex[c & 15];
  };
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      if (c < 0x20 || c == 0x7f) {
        escape(c);
      } else {
        out += static_cast<char>(c);
      }
      ++i;
      continue;
    }
    // The length of a well-formed UTF-8 sequence starting here, 0 if there is none.
    size_t n = c >= 0xc2 && c <= 0xdf   ? 2
               : c >= 0xe0 && c <= 0xef ? 3
               : c >= 0xf0 && c <= 0xf4 ? 4
                                        : 0;
    if (n > text.size() - i) n = 0;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(text[i + k]) & 0xc0) != 0x80) n = 0;
    }
    if (n == 2 && c == 0xc2 && static_cast<unsigned char>(text[i + 1]) < 0xa0) n = 0;  // C1
    if (n == 0) {
      escape(c);
      ++i;
    } else {
      out.append(text, i, n);
      i += n;
    }
  }
  return out;
}

// At exit, how long trun waits at most for a slow console to take what is still buffered for it
// (it stops sooner when the console takes nothing for 100 ms).
constexpr std::chrono::milliseconds kConsoleFlushBound(2000);

// LOGLEVEL as torchrun reads it (DEBUG, INFO, WARNING, ERROR, CRITICAL); default WARNING.
// Log lines, like everything trun prints, go through the non-blocking console (agent/console.h).
void setup_logging() {
  trun::agent::install_console();
  auto logger = std::make_shared<spdlog::logger>("trun", trun::agent::console_sink(2));
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

int run_launcher(int argc, char** argv) {
  setup_logging();
  trun::launcher::CliResult cli = trun::launcher::parse_command_line(argc, argv);
  if (!cli.slurm.log_line.empty()) spdlog::warn("{}", printable(cli.slurm.log_line));
  if (!cli.config) {
    if (!cli.error.empty()) std::fprintf(stderr, "trun: error: %s\n", printable(cli.error).c_str());
    return cli.exit_code;
  }
  for (const auto& note : cli.notes) spdlog::warn("{}", printable(note));
  if (cli.dry_run) {
    const std::string json = trun::launcher::dry_run_json(cli);
    // Nothing else runs: a plain blocking write is right here.
    std::fwrite(json.data(), 1, json.size(), stdout);
    std::fflush(stdout);
    return 0;
  }
  trun::agent::ElasticAgent agent(*cli.config);
  const int code = agent.run();
  if (uint64_t dropped = trun::agent::console_dropped_lines(); dropped > 0) {
    const std::string where =
        cli.config->log_dir.empty()
            ? "pass --log-dir to keep every line of worker output in files"
            : "the log files under " + cli.config->log_dir + " hold every byte of worker output";
    std::fprintf(stderr,
                 "trun: warning: dropped %llu console lines while the console was stalled; %s\n",
                 static_cast<unsigned long long>(dropped), where.c_str());
  }
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "store") == 0) {
    return trun::launcher::run_store_command(argc - 1, argv + 1);
  }
  if (argc >= 2 && std::strcmp(argv[1], "timeline") == 0) {
    return trun::launcher::run_timeline_command(argc - 1, argv + 1);
  }
  if (argc >= 2 && std::strcmp(argv[1], "status") == 0) {
    return trun::launcher::run_status_command(argc - 1, argv + 1);
  }
  const int code = run_launcher(argc, argv);
  // Bounded: a console nobody reads must not keep trun (and its exit code) from its parent.
  trun::agent::flush_console(kConsoleFlushBound);
  return code;
}
