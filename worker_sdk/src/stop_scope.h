#pragma once
// Internal to libtrun_worker (trun/stop.h): the part of a worker's life in which a stop signal
// cannot be answered by a graceful stop.

namespace trun::worker::detail {

// While one exists (init() holds one), a stop signal ends the process by the signal's default
// action even when the stop handlers are installed: a process that is still connecting to the
// store or waiting for its peers has nothing to save, and it would otherwise wait out its whole
// timeout (10 min by default) before it could look at stop_requested(). A stop requested before
// the scope begins ends the process at once (exit_by_stop_signal()).
class DieOnStopScope {
 public:
  DieOnStopScope();
  ~DieOnStopScope();
  DieOnStopScope(const DieOnStopScope&) = delete;
  DieOnStopScope& operator=(const DieOnStopScope&) = delete;
};

}  // namespace trun::worker::detail
