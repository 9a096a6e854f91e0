#include "launcher/cli.h"

#include <CLI/CLI.hpp>
#include <array>
#include <memory>
#include <utility>

#include "agent/file_timer_server.h"
#include "base/build_info.h"
#include "launcher/argparse_compat.h"
#include "launcher/cli_config.h"
#include "launcher/cli_options.h"
#include "launcher/cli_resolve.h"
#include "launcher/host_probe.h"

extern char** environ;

namespace trun::launcher {
namespace {

constexpr const char* kDescription =
    "trun: an elastic launcher for distributed training, compatible with torchrun.\n"
    "Starts --nproc-per-node copies of TRAINING_SCRIPT on this node with the environment\n"
    "torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), supervises\n"
    "them, restarts the whole group when one fails (up to --max-restarts) and reports failures.\n"
    "Every option can also be set through PET_<OPTION> (e.g. PET_NPROC_PER_NODE=4); the\n"
    "command line wins. Both spellings work: --nproc-per-node and --nproc_per_node, and so\n"
    "does any unique prefix, as in torchrun (--nproc_per=2).\n"
    "Inside an srun step, options given neither way come from SLURM_* (the c10d store on the\n"
    "step's first node; TRUN_SLURM=0 turns this off); --dry-run shows the result.";

constexpr const char* kFooter =
    "Examples:\n"
    "  trun --standalone --nproc-per-node=4 train.py --epochs 3\n"
    "  trun --nproc-per-node=2 --max-restarts=3 --no-python ./train_binary\n"
    "Exit codes: 0 all workers succeeded; 1 workers failed (restarts exhausted; see the\n"
    "summary); 2 invalid command line; 3 trun itself failed (rendezvous, store, log dir);\n"
    "128+N trun received signal N and stopped the workers. Details: docs/exit-codes.md";

// CLI11 2.1 cannot name the positional part of the usage line itself; and trun, not CLI11, reads
// the PET_* variables (launcher/cli_resolve.h), so the help names them here.
class Formatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string) const override {
    return "Usage: trun [OPTIONS] TRAINING_SCRIPT [SCRIPT ARGS...]\n"
           "       trun store [--host H] [--port P] [--store-token T] [limits]   (the store "
           "alone;\n"
           "                  limits per request and per client: trun store --help)\n"
           "       trun status --rdzv-id ID ...   trun timeline EVENTLOG... -o PAGE\n";
  }
  // As CLI11 writes an option's envname (no option here has needs or excludes, which it would
  // write after it).
  std::string make_option_opts(const CLI::Option* opt) const override {
    std::string out = CLI::Formatter::make_option_opts(opt);
    if (auto it = env_names.find(opt); it != env_names.end()) {
      out += " (" + get_label("Env") + ":" + it->second + ")";
    }
    return out;
  }
  std::map<const CLI::Option*, std::string> env_names;
};

// Step 1: the options declared to CLI11 from the table (launcher/cli_options.h), bound to
// `values` (a kFlag to `flags`), which must outlive `app`.
struct Declared {
  std::array<std::string, kOptCount> values;
  std::array<bool, kOptCount> flags{};
  std::array<CLI::Option*, kOptCount> options{};
};

void declare_options(CLI::App& app, Formatter& formatter, Declared& d) {
  app.footer(kFooter);
  app.prefix_command();  // everything from TRAINING_SCRIPT on belongs to the worker
  std::string version = base::version_text();  // base/build_info.h
  version.pop_back();                          // CLI11 adds the final newline
  app.set_version_flag("--version", version);
  formatter.column_width(44);
  for (const OptionDecl& decl : option_table()) {
    const size_t i = static_cast<size_t>(decl.id);
    std::string names = decl.short_name ? std::string("-") + decl.short_name + "," : "";
    for (const auto& n : long_names(decl.id))
      names += (names.empty() || names.back() == ',' ? "--" : ",--") + n;
    CLI::Option* o = nullptr;
    switch (decl.kind) {
      case OptKind::kValue:
        d.values[i] = decl.default_value;
        // As argparse: the last of a repeated option wins (CLI11 would refuse the second).
        o = app.add_option(names, d.values[i], decl.help)
                ->group(decl.group)
                ->capture_default_str()
                ->take_last();
        break;
      case OptKind::kFlag:
        o = app.add_flag(names, d.flags[i], decl.help)->group(decl.group);
        break;
      case OptKind::kTextFlag:
        o = app.add_flag(names, d.values[i], decl.help)->group(decl.group);
        break;
    }
    d.options[i] = o;
    formatter.env_names[o] = env_name(decl.id);
  }
}

// Every option CLI11 knows (--help and --version first), as the argparse pre-pass sees them.
std::vector<ArgOption> argparse_options(const CLI::App& app) {
  std::vector<ArgOption> out;
  for (const CLI::Option* o : app.get_options()) {
    ArgOption a;
    a.long_names = o->get_lnames();
    for (const auto& n : o->get_snames()) a.short_name = n.empty() ? '\0' : n[0];
    a.takes_value = o->get_expected_max() > 0;
    out.push_back(std::move(a));
  }
  return out;
}

// What the command line gave, as CLI11 read it.
CommandLineOptions given_options(const Declared& d) {
  CommandLineOptions out;
  for (const OptionDecl& decl : option_table()) {
    const size_t i = static_cast<size_t>(decl.id);
    if (d.options[i]->count() == 0) continue;
    if (decl.kind == OptKind::kFlag) {
      out[decl.id] = d.flags[i] ? "true" : "false";
    } else {
      out[decl.id] = d.values[i];
    }
  }
  return out;
}

// When CLI11 read PET_* itself, it converted the flags' values from argv and from PET_* alike,
// in declaration order, before it acted on --help: a PET_* flag's invalid value was reported
// instead of the help, and instead of an argv flag's invalid value declared after it. After CLI11
// stopped at an argv flag's value (`help` false), that flag is the last one whose callback ran.
std::optional<CliError> earlier_flag_error(const Declared& d, const Environment& env, bool help) {
  size_t failed = help ? kOptCount : 0;
  if (!help) {
    for (size_t i = 0; i < kOptCount; ++i) {
      if (d.options[i]->count() > 0 && d.options[i]->get_callback_run()) failed = i;
    }
  }
  // Options given on argv, and those from the one that failed on, are not read from PET_*.
  CommandLineOptions not_read;
  for (const OptionDecl& decl : option_table()) {
    const size_t i = static_cast<size_t>(decl.id);
    if (d.options[i]->count() > 0 || i >= failed) not_read[decl.id] = "";
  }
  try {
    merge_command_line_and_environment(not_read, env);
  } catch (const CliError& e) {
    return e;
  }
  return std::nullopt;
}

Environment current_environment() {
  Environment env;
  for (char** e = environ; e && *e; ++e) {
    const std::string kv = *e;
    const size_t eq = kv.find('=');
    if (eq != std::string::npos) env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return env;
}

CliResult failure(int exit_code, std::string error) {
  CliResult result;
  result.exit_code = exit_code;
  result.error = std::move(error);
  return result;
}

}  // namespace

CliResult parse_command_line(int argc, char** argv) {
  const Environment env = current_environment();
  CLI::App app{kDescription, "trun"};
  auto formatter = std::make_shared<Formatter>();
  app.formatter(formatter);
  Declared declared;
  declare_options(app, *formatter, declared);

  // Step 2: parse argv, after the argparse pre-pass.
  std::vector<std::string> args(argv + 1, argv + argc);
  if (auto error = normalize_arguments(argparse_options(app), args)) {
    return failure(2, *error + " (see trun --help)");
  }
  std::vector<char*> expanded{argv[0]};
  for (auto& a : args) expanded.push_back(a.data());
  try {
    app.parse(static_cast<int>(expanded.size()), expanded.data());
  } catch (const CLI::ParseError& e) {
    const bool help = dynamic_cast<const CLI::CallForHelp*>(&e) != nullptr;
    const bool conversion = dynamic_cast<const CLI::ConversionError*>(&e) != nullptr;
    if (help || conversion) {
      if (auto error = earlier_flag_error(declared, env, help)) {
        return failure(error->exit_code(), error->what());
      }
    }
    if (e.get_exit_code() != 0) return failure(2, std::string(e.what()) + " (see trun --help)");
    CliResult result;
    result.exit_code = app.exit(e);
    return result;
  }

  // Step 3: argv > PET_* > SLURM > defaults.
  CliResult result;
  ResolvedOptions options;
  try {
    options = resolve_options(given_options(declared), env);
  } catch (const CliError& e) {
    return failure(e.exit_code(), e.what());
  }
  result.slurm = options.slurm;
  result.dry_run = options.flag(Opt::kDryRun);
  result.environment = environment_read(env);

  // Steps 4 and 5: check, and build the LaunchConfig.
  try {
    BuiltConfig built = build_launch_config(options, app.remaining(), env, system_host());
    result.config = std::move(built.config);
    // PyTorch's watchdog: torchrun reads these from its own environment, not from an option.
    const agent::FileTimerSetting timer = agent::file_timer_setting(env);
    result.config->file_timer = timer.enabled;
    result.config->file_timer_path = timer.path;
    result.notes = std::move(built.notes);
  } catch (const CliError& e) {
    result.exit_code = e.exit_code();
    result.error = e.what();
  }
  return result;
}

}  // namespace trun::launcher
