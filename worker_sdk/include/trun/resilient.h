#pragma once
// A training loop that survives its peers (issue 38, docs/worker_sdk.md "Resilient loop").
//
//   trun::worker::ResilientState state;
//   state.set_step(&step);                 // the completed-step counter
//   state.add("fc1.weight", w.data(), w.size() * sizeof(float));   // parameters, momentum, ...
//   state.set_sampler(&sampler);           // its position is state too
//   trun::worker::ResilientLoop loop(state);
//   loop.run({.on_group = ..., .release = ..., .restore = ..., .step = ...});
//
// When a peer dies (a collective fails) or the agent starts a new generation of workers (it
// replaced a failed local rank: docs/launcher.md "Resilient loops"), the loop, in the same
// process: calls `release` (drop everything that holds the groups), destroys its groups, waits
// for the agent's new generation on the progress board, builds new groups at that generation
// (with the replacement), calls `on_group`, and brings every rank to the most advanced completed
// step: the ranks allgather their step, and the lowest rank at the highest step broadcasts the
// registered state (through the node's shared memory between local ranks). Only when no rank
// holds a state (every rank is new: the first start, or all were lost) does it call `restore`
// (load the newest checkpoint, or start fresh), after which rank 0's state is broadcast. Then
// steps continue: at most the step in flight is lost.
//
// The step's contract: a step either completes (returns true) or throws before it changed the
// registered buffers. Compute and exchange first, then apply: DDP's finalize() followed by the
// optimizer step is that order. The step counter and the sampler are saved before each step and
// put back when it throws, so a step may advance them before its collectives. A step that
// returns false took no step: training is over (the loop returns).
//
// A stop signal while the loop waits for a generation ends the wait: rank 0, if it holds a
// completed step, saves it alone (ResilientProgram::save_alone), and the failure is rethrown.
//
// Without a trun agent's progress board (run by hand, torchrun, srun), or when the agent does
// not replace the failed rank (it restarts the whole group: a multi-node round, restarts spent,
// --hang-detection=off), a failure is rethrown as it would be without the loop, after at most
// ResilientOptions::reform_timeout.
//
// Thread safety: one thread runs the loop; the Worker it hands out changes at each formation.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <trun/export.h>
#include <trun/sampler.h>
#include <trun/worker.h>

namespace trun::worker {

// What the loop keeps equal on every rank and moves from a live rank to a new one.
class TRUN_API ResilientState {
 public:
  // The completed-step counter (required before run()): the loop reads it to find the most
  // advanced rank, and restores it when a step fails.
  void set_step(uint64_t* step) { step_ = step; }
  // Memory that is equal on every rank after each step (parameters, optimizer buffers, RNG
  // state, counters). Host memory; it must stay valid and keep its size while the loop runs.
  // `name` is for messages. std::invalid_argument for a null pointer with bytes > 0.
  void add(std::string name, void* data, size_t bytes);
  // Memory that a step may change before its collectives (e.g. an epoch counter, a loss sum):
  // copied before each step and put back when the step throws, and moved like add()'s.
  void add_small(std::string name, void* data, size_t bytes);
  // State kept in objects rather than fixed memory (e.g. a libtorch optimizer's): `save` writes it
  // out on the rank that sends the state, `load` reads it in on the others. Moved after the
  // buffers; not saved around steps (a step must not change it before its last collective).
  void add_serialized(std::string name, std::function<std::string()> save,
                      std::function<void(const std::string&)> load);
  // A sampler whose position (epoch and global offset) is part of the state (saved and restored
  // around each step, moved to new ranks). Optional.
  void set_sampler(DistributedSampler* sampler) { sampler_ = sampler; }

  uint64_t* step() const { return step_; }
  DistributedSampler* sampler() const { return sampler_; }
  // Bytes of the add() and add_small() buffers (what every rank must register alike).
  size_t bytes() const;

  struct Buffer {
    std::string name;
    void* data;
    size_t bytes;
    bool small;
  };
  const std::vector<Buffer>& buffers() const { return buffers_; }
  struct Serialized {
    std::string name;
    std::function<std::string()> save;
    std::function<void(const std::string&)> load;
  };
  const std::vector<Serialized>& serialized() const { return serialized_; }

 private:
  uint64_t* step_ = nullptr;
  DistributedSampler* sampler_ = nullptr;
  std::vector<Buffer> buffers_;
  std::vector<Serialized> serialized_;
};

struct ResilientOptions {
  InitOptions init;  // for the first init() and every formation after it
  // How long a rank whose group broke waits for the agent's next generation before it gives up
  // and rethrows the failure (the agent then restarts the whole group as without the loop).
  std::chrono::milliseconds reform_timeout = std::chrono::seconds(60);
  // Progress lines on stderr (formation, source rank, bytes and time of the state transfer).
  bool verbose = true;
};

// One formation of the groups, as on_group sees it.
struct Formation {
  uint64_t generation = 0;  // the generation (restart count) the groups were built at
  int number = 0;           // this process's formations so far: 0 is its first
};

struct ResilientProgram {
  // Required. After each formation: build what uses the groups (DDP with
  // broadcast_on_construction = false, a StopAgreement, a Checkpointer with its group).
  std::function<void(Worker&, const Formation&)> on_group;
  // Before the groups are destroyed: destroy what on_group built (it refers to them).
  std::function<void()> release;
  // No rank holds a state: load the newest checkpoint (collective over the group) or start
  // fresh. Rank 0's state is broadcast after it. Optional (nothing to load).
  std::function<void(Worker&)> restore;
  // Required. One step: true when it completed one (the loop then counts it done), false when
  // training is over (no step taken).
  std::function<bool(Worker&)> step;
  // A stop was requested (a stop signal: the job stops, or the agent stops the group because its
  // restarts are spent) while the loop waited for a new generation: no group will form to agree
  // on a step. Called on the process that is rank 0 of its last formation, when it holds a
  // completed step's state (the registered buffers, step counter and sampler as that step left
  // them), before the loop rethrows the failure: save that state without a group (a Checkpointer
  // with group = nullptr), so that the job's next start loses at most the step in flight.
  // Optional; it needs the program to watch its stop signals (trun/stop.h: watch_stop_signals),
  // or a stop signal ends the process at once. What it throws is reported on stderr; the failure
  // is rethrown either way.
  std::function<void(Worker&)> save_alone;
};

class TRUN_API ResilientLoop {
 public:
  // Runs init(options.init) and declares the loop to the agent (the progress board).
  explicit ResilientLoop(ResilientState& state, ResilientOptions options = {});
  ~ResilientLoop();
  ResilientLoop(const ResilientLoop&) = delete;
  ResilientLoop& operator=(const ResilientLoop&) = delete;

  // Steps until program.step returns false. Rethrows a failure it cannot recover from (see the
  // header's comment), and any exception of the program's callbacks other than CollectiveError
  // in step (the process then ends and the agent replaces it).
  void run(const ResilientProgram& program);

  // The current formation's worker (its env() has the generation as restart_count).
  Worker& worker();

  struct Stats {
    int formations = 0;          // in this process, the first included
    int recoveries = 0;          // formations after a failure or a new generation
    uint64_t steps_redone = 0;   // steps this rank lost to failures (the step in flight)
    int last_source_rank = -1;   // the rank that sent the state at the last formation (-1: none)
    size_t last_bytes = 0;       // bytes of that transfer
    double last_transfer_s = 0;  // its duration
    double last_reform_s = 0;    // from the failure to the state in place, at the last recovery
    bool restored = false;       // the last formation called restore (no rank held a state)
  };
  const Stats& stats() const;

 private:
  struct TRUN_HIDDEN Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace trun::worker
