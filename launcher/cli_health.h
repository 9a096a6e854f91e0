#pragma once
// The health and crash-loop options (launcher/cli_options.cpp, docs/health.md) into LaunchConfig.

#include "agent/launch_config.h"
#include "launcher/cli_resolve.h"

namespace trun::launcher {

// Throws CliError for a value it cannot read, naming the option and what it expects.
void health_options(const ResolvedOptions& o, agent::LaunchConfig& c);

}  // namespace trun::launcher
