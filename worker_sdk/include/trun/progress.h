#pragma once
// Progress reporting to trun's hang detection (docs/hangs.md).
//
// Under trun, libtrun_worker already tells its agent when the rank makes progress, with no code
// in the program: init() begin and end, every collective issued and finished (with its group and
// sequence number), each DDP step, each StopAgreement check, each checkpoint save. Two calls
// cover the rest:
//
//   trun::worker::heartbeat();                // "still going": e.g. in a long data-loading loop
//   {
//     trun::worker::Section eval("eval");     // a phase with a timeout class of its own
//     run_evaluation();                       // (its own learned intervals, not the step's)
//   }
//
// Cost: a clock read (vDSO, no system call) and a few atomic stores into a page the agent maps.
// Outside trun (torchrun, srun, a plain run: TRUN_PROGRESS_SHM unset) both do nothing and cost a
// load and a branch. Before init() they do nothing either (the board is mapped by init()).
//
// Thread safety: both from any thread. The section is the process's: a Section on one thread is
// what the agent sees for the whole rank until it ends (sections nest; each restores the one
// before it). Up to 16 distinct names per process have classes of their own; later names share
// one "other" class. A name is cut at 31 bytes.

#include <cstdint>
#include <string>

#include <trun/export.h>

namespace trun::worker {

// One progress event: resets the time this rank has gone without progress.
TRUN_API void heartbeat();

// Whether progress is reported to an agent (init() found the agent's board).
TRUN_API bool progress_reported();

// A named phase, for its lifetime: entering and leaving it are progress events, and while it
// lasts the rank is timed against the section's class.
class TRUN_API Section {
 public:
  explicit Section(const char* name);
  explicit Section(const std::string& name);
  ~Section();
  Section(const Section&) = delete;
  Section& operator=(const Section&) = delete;

 private:
  uint32_t prev_phase_ = 0;
  uint32_t prev_section_ = 0;
  bool active_ = false;
};

}  // namespace trun::worker
