#pragma once
// The launcher's command line: argv + PET_* environment variables -> a validated LaunchConfig.
//
// Accepts every torchrun option in both spellings (--nproc-per-node and --nproc_per_node); each
// option may also come from PET_<NAME> (upper case, underscores), the command line winning.
// Inside an srun step, options neither given nor in PET_* are derived from SLURM_* variables
// (launcher/slurm_options.h) before the defaults apply.
//
// In five steps: (1) declare the options to CLI11 from one table (launcher/cli_options.h);
// (2) parse argv, after an argparse-compatibility pre-pass (launcher/argparse_compat.h);
// (3) resolve each option's value, argv > PET_* > SLURM > default (launcher/cli_resolve.h);
// (4, 5) check the values and build the LaunchConfig (launcher/cli_config.h). Steps 3 to 5 are
// pure functions of their inputs (the environment as data, the host behind HostProbe); only
// parse_command_line below reads the process environment and the host.
// Single-threaded; never exits the process itself.

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "agent/launch_config.h"
#include "launcher/slurm_options.h"

namespace trun::launcher {

struct CliResult {
  // Set when the job should run; otherwise exit with `exit_code` (0 after --help/--version,
  // 2 for invalid input, with `error` holding the one-line explanation).
  std::optional<agent::LaunchConfig> config;
  int exit_code = 0;
  std::string error;
  // Accepted-but-ignored settings worth one warning line each (e.g. --start-method=fork).
  std::vector<std::string> notes;
  // --dry-run: print the resolved configuration (launcher/dry_run.h) instead of running it.
  bool dry_run = false;
  // What SLURM's environment implied (launcher/slurm_options.h); its log_line is logged before
  // the job starts, or before the error when a derived value turned out invalid.
  SlurmOptions slurm;
  // The environment variables (other than SLURM_*) the resolved configuration read, as set.
  std::map<std::string, std::string> environment;
};

// argv as given to main (argv[0] is the program name).
CliResult parse_command_line(int argc, char** argv);

}  // namespace trun::launcher
