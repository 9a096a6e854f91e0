#pragma once
// trun --dry-run: the resolved launch configuration as one JSON document (docs/launcher.md,
// "--dry-run"), for checking what trun would do (under SLURM above all) without starting
// anything.
//
// Pure: thread-safe, no I/O.

#include <string>

#include "launcher/cli.h"

namespace trun::launcher {

// `cli.config` must be set. Pretty-printed, ending in a newline.
std::string dry_run_json(const CliResult& cli);

}  // namespace trun::launcher
