#pragma once
// trun inside an srun job step: the options SLURM's environment implies, for those the user left
// out (docs/launcher.md, "Under SLURM").
//
// Precedence: the command line > PET_* > what this derives > trun's defaults. The launcher passes
// the options the user gave (on the command line or through PET_*), and gets back the options to
// fill in, each with the SLURM variables it came from, so that one log line can say where every
// derived value came from. SLURM is recognised by SLURM_JOB_ID and SLURM_STEP_ID; TRUN_SLURM=0
// turns this off.
//
// A pure function of its arguments (the environment is read through `env`): thread-safe, no I/O.
// Errors: SlurmOptionError, one line naming the variable and its value, or the option and the
// variable it contradicts; exit_code is 2 (invalid input).

#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "launcher/cli_options.h"

namespace trun::launcher {

// One option filled in from SLURM's environment.
struct SlurmDerived {
  Opt id;                         // which option, by identity: Opt::kRdzvEndpoint
  std::string option;             // its name for messages and --dry-run, flag_name(id)
  std::string value;              // "n1:10096"
  std::vector<std::string> from;  // the variables it came from: {"SLURM_STEP_NODELIST", ...}
  bool presence = false;          // implied by the variables being set: "(SLURM_STEP_ID set)"
  std::string detail;             // how, when not obvious: "port 10000+(12 mod 2750)*8+0"
};

// The options the user gave, on the command line or through PET_*, as given (nullopt: not
// given). Only those that SLURM's environment can imply or contradict.
struct GivenOptions {
  bool standalone = false;
  std::optional<std::string> nnodes;
  std::optional<std::string> rdzv_backend;
  std::optional<std::string> rdzv_endpoint;
  std::optional<std::string> rdzv_id;
  std::optional<std::string> node_rank;
  std::optional<std::string> master_addr;
  std::optional<std::string> master_port;
  std::optional<std::string> signals_to_handle;
};

enum class SlurmContext {
  kNone,         // not under SLURM (no SLURM_JOB_ID)
  kDisabled,     // TRUN_SLURM=0
  kOutsideStep,  // in a SLURM job (a batch script, salloc) but not in an srun step
  kStep,         // in an srun step: options derived
};

struct SlurmOptions {
  SlurmContext context = SlurmContext::kNone;
  std::string job_id;   // SLURM_JOB_ID, when set
  std::string step_id;  // SLURM_STEP_ID, when set
  std::vector<SlurmDerived> derived;
  // The one line trun logs about SLURM (empty: nothing to say, as outside SLURM): the derived
  // values and their sources, or why nothing was derived.
  std::string log_line;
};

class SlurmOptionError : public std::runtime_error {
 public:
  explicit SlurmOptionError(const std::string& what, int exit_code = 2)
      : std::runtime_error(what), exit_code_(exit_code) {}
  int exit_code() const { return exit_code_; }

 private:
  int exit_code_;
};

// The value of an environment variable, nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

// trun's default --signals-to-handle, and the one under SLURM (SIGUSR1 added, so that
// `scancel --signal=USR1` reaches the workers instead of ending trun).
inline constexpr const char* kDefaultSignals = "SIGTERM,SIGINT,SIGHUP,SIGQUIT";
inline constexpr const char* kSlurmSignals = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1";

SlurmOptions derive_slurm_options(const EnvLookup& env, const GivenOptions& given);

// "--rdzv-endpoint=n1:10096 (SLURM_STEP_NODELIST; port 10000+(12 mod 2750)*8+0)"
std::string describe(const SlurmDerived& d);

}  // namespace trun::launcher
