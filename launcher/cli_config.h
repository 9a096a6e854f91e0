#pragma once
// The launcher's command line, steps 4 and 5 of 5 (launcher/cli.h): the resolved options
// (launcher/cli_resolve.h) checked and turned into a LaunchConfig.
//
// Checking and building go one option group at a time (worker group, rendezvous, supervision,
// logs, what to run), in a fixed order, so that the first invalid value is the one reported.
// A pure function of its arguments: the environment comes in as data and the host (devices,
// CPU topology, files) through HostProbe; thread-safe when `host` is.
// Errors: CliError, one line naming the option and the value, exit code 2.

#include <string>
#include <vector>

#include "agent/launch_config.h"
#include "launcher/cli_resolve.h"
#include "launcher/host_probe.h"

namespace trun::launcher {

struct BuiltConfig {
  agent::LaunchConfig config;
  // Accepted-but-ignored settings worth one warning line each (e.g. --start-method=fork).
  std::vector<std::string> notes;
};

// `rest`: what the command line left after the options, TRAINING_SCRIPT and its arguments (a
// leading "--" is dropped). `env` is read for CUDA_VISIBLE_DEVICES, ZE_AFFINITY_MASK,
// PYTHON_EXEC and PATH.
BuiltConfig build_launch_config(const ResolvedOptions& options, std::vector<std::string> rest,
                                const Environment& env, const HostProbe& host);

}  // namespace trun::launcher
