#pragma once
// The launcher's command line, step 3 of 5 (launcher/cli.h): which value each option takes.
//
// Precedence, per option: the command line > PET_<NAME> (set and not empty) > what an srun step
// implies (launcher/slurm_options.h) > the option's default (launcher/cli_options.h). Three
// options fall back, before their defaults, on torchrun's own variables:
// TORCH_ELASTIC_SHUTDOWN_TIMEOUT (--shutdown-timeout), TORCHELASTIC_HEALTH_CHECK_PORT
// (--metrics-port) and TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE (--log-line-prefix-template).
//
// Pure functions: the environment comes in as data, no I/O, no CLI11; thread-safe.
// Errors: CliError, one line for "trun: error: ..." with the exit code (2).

#include <array>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>

#include "launcher/cli_options.h"
#include "launcher/slurm_options.h"

namespace trun::launcher {

// The process environment as data: name -> value.
using Environment = std::map<std::string, std::string>;

// An invalid command line (or environment): the one-line message and the exit code.
class CliError : public std::runtime_error {
 public:
  explicit CliError(const std::string& what, int exit_code = 2)
      : std::runtime_error(what), exit_code_(exit_code) {}
  int exit_code() const { return exit_code_; }

 private:
  int exit_code_;
};

// Where an option's value came from, lowest precedence first.
enum class Source {
  kDefault,
  kTorchVariable,  // TORCH_ELASTIC_SHUTDOWN_TIMEOUT and the like: `variable` names it
  kSlurm,          // derived from SLURM_* (ResolvedOptions::slurm says how)
  kPet,            // PET_<NAME>: `variable` names it
  kCommandLine,
};

struct OptionValue {
  std::string text;  // kFlag: "true" or "false"; kTextFlag: as given ("true" for the bare flag)
  Source source = Source::kDefault;
  std::string variable;  // the environment variable, for kPet and kTorchVariable
};

// The options the command line gave, as CLI11 read them after the argparse pre-pass (the last
// of a repeated option; a kFlag as "true" or "false", a kTextFlag as its text).
using CommandLineOptions = std::map<Opt, std::string>;

struct ResolvedOptions {
  std::array<OptionValue, kOptCount> values;
  SlurmOptions slurm;  // what SLURM's environment implied, with its log line

  const OptionValue& operator[](Opt id) const { return values[static_cast<size_t>(id)]; }
  OptionValue& operator[](Opt id) { return values[static_cast<size_t>(id)]; }
  const std::string& text(Opt id) const { return (*this)[id].text; }
  // Given by the user: on the command line or through PET_*.
  bool given(Opt id) const;
  // A kFlag's value.
  bool flag(Opt id) const { return text(id) == "true"; }
  // What messages call the value's origin: the torchrun variable it came from, else the option
  // ("--shutdown-timeout" for PET_SHUTDOWN_TIMEOUT too, as before).
  std::string origin(Opt id) const;
};

// A PET_* value of a flag read as CLI11 2.1 reads flag values: true/false, on/off, yes/no,
// enable/disable, one of 0-9 t f y n + -, or a number (> 0: true). nullopt: none of these.
std::optional<bool> parse_flag_value(const std::string& text);

// The command line over PET_* over defaults. Throws CliError for a PET_* flag value
// parse_flag_value refuses ("Could not convert: --standalone = maybe (see trun --help)").
ResolvedOptions merge_command_line_and_environment(const CommandLineOptions& command_line,
                                                   const Environment& env);

// Fills, in `options`, what torchrun's own variables and then an srun step imply for the options
// the user did not give; sets options.slurm. Throws CliError for what SLURM's environment makes
// invalid (SlurmOptionError's message and exit code).
void apply_fallbacks(ResolvedOptions& options, const Environment& env);

// Both of the above.
ResolvedOptions resolve_options(const CommandLineOptions& command_line, const Environment& env);

// The environment variables other than SLURM_* that the configuration reads, as set: every
// PET_*, TORCH_ELASTIC_SHUTDOWN_TIMEOUT, TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE,
// CUDA_VISIBLE_DEVICES, PYTHON_EXEC and TRUN_SLURM (--dry-run shows them).
std::map<std::string, std::string> environment_read(const Environment& env);

}  // namespace trun::launcher
