#pragma once
// The launcher's options as data: one identity per option (Opt) and one flat table of
// declarations (names, kind, default, help group and text). The CLI11 declaration
// (launcher/cli.cpp), the argparse pre-pass (launcher/argparse_compat.h), the resolution of
// argv > PET_* > SLURM > defaults (launcher/cli_resolve.h) and the SLURM derivation
// (launcher/slurm_options.h) all name options by Opt, never by their strings.
//
// Plain constant data: thread-safe, no I/O.

#include <cstddef>
#include <string>
#include <vector>

namespace trun::launcher {

// In declaration (and --help) order.
enum class Opt {
  kNnodes,
  kNprocPerNode,
  kRole,
  kVirtualLocalRank,
  kMaxRestarts,
  kStandalone,
  kRdzvBackend,
  kRdzvEndpoint,
  kRdzvId,
  kRdzvConf,
  kModule,
  kDryRun,
  kNoPython,
  kRunPath,
  kLegacyLaunch,
  kUseEnv,
  kLogDir,
  kEventLog,
  kMetricsPort,
  kRedirects,
  kTee,
  kLocalRanksFilter,
  kDuplicateStdoutFilters,
  kDuplicateStderrFilters,
  kLogsSpecs,
  kLogLinePrefixTemplate,
  kMonitorInterval,
  kStartMethod,
  kEventLogHandler,
  kNumaBinding,
  kShutdownTimeout,
  kSignalsToHandle,
  kExitBarrierTimeout,
  kHangDetection,
  kHangTimeout,
  kHangTimeoutFloor,
  kHangTimeoutFactor,
  kHangWarmup,
  kHangStartupTimeout,
  kHangCheckpointTimeout,
  kHangSectionTimeout,
  kHealthCheck,
  kHealthCheckTimeout,
  kHealthBuiltin,
  kCrashLoopLimit,
  kCrashLoopUptime,
  kExcludeAfter,
  kExcludeWindow,
  kExcludeCooldown,
  kStragglerThreshold,
  kStragglerWindow,
  kStragglerAction,
  kNodeRank,
  kMasterAddr,
  kMasterPort,
  kLocalAddr,
};
inline constexpr size_t kOptCount = static_cast<size_t>(Opt::kLocalAddr) + 1;

enum class OptKind {
  kValue,     // --opt VALUE, --opt=VALUE
  kFlag,      // --flag (true), --flag=false; read as a bool
  kTextFlag,  // --legacy-launch or --legacy-launch=dash: a flag whose value is kept as text
};

struct OptionDecl {
  Opt id;
  const char* name;  // the dash spelling without "--": "nproc-per-node"
  char short_name;   // 'r' for -r, '\0' for none
  OptKind kind;
  const char* default_value;  // kValue only ("" for none)
  const char* group;          // the --help section
  const char* help;
};

// Every option, in Opt order: option_table()[static_cast<size_t>(id)].id == id.
const std::vector<OptionDecl>& option_table();
const OptionDecl& declaration(Opt id);

// "--nproc-per-node": the name messages use.
std::string flag_name(Opt id);
// {"nproc-per-node", "nproc_per_node"}: both spellings (one when the name has no '-').
std::vector<std::string> long_names(Opt id);
// "PET_NPROC_PER_NODE".
std::string env_name(Opt id);

}  // namespace trun::launcher
