#pragma once
// The --hang-* options (launcher/cli_options.cpp, docs/hangs.md) into LaunchConfig::hang_timeouts.

#include "agent/launch_config.h"
#include "launcher/cli_resolve.h"

namespace trun::launcher {

// Throws CliError for a value it cannot read, naming the option and what it expects.
void hang_detection(const ResolvedOptions& o, agent::LaunchConfig& c);

}  // namespace trun::launcher
