// The resilient loop (trun/resilient.h): formations, the state's transfer, recovery.
#include "trun/resilient.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <stdexcept>
#include <thread>

#include "store/store.h"
#include "trun/process_group.h"
#include "trun/stop.h"
#include "worker_sdk/src/progress/progress.h"

namespace trun::worker {
namespace {

using Clock = std::chrono::steady_clock;

double resilient_seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// What one rank says at the start of a formation: whether it holds a state and at which step.
struct StateClaim {
  int64_t holds = 0;
  int64_t step = 0;
};

// The state's small part, moved before the buffers: the step and the sampler's position.
struct TransferHeader {
  uint64_t step = 0;
  uint64_t epoch = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;  // the sender's total, checked against the receiver's registration
};

// The small part of the state as it was before a step.
struct StepSnapshot {
  uint64_t step = 0;
  std::optional<SamplerState> sampler;
  std::vector<std::vector<unsigned char>> small;
};

// The state moves in messages of at most this much: between local ranks 16 MiB messages moved
// 1 GiB at memcpy's rate (256 MiB ones at about half of it), and each one's deadline stays
// meaningful for a large state.
constexpr size_t kTransferChunk = size_t{16} << 20;

}  // namespace

void ResilientState::add(std::string name, void* data, size_t bytes) {
  if (!data && bytes) throw std::invalid_argument("ResilientState::add: " + name + " is null");
  buffers_.push_back({std::move(name), data, bytes, false});
}

void ResilientState::add_small(std::string name, void* data, size_t bytes) {
  if (!data && bytes)
    throw std::invalid_argument("ResilientState::add_small: " + name + " is null");
  buffers_.push_back({std::move(name), data, bytes, true});
}

void ResilientState::add_serialized(std::string name, std::function<std::string()> save,
                                    std::function<void(const std::string&)> load) {
  if (!save || !load)
    throw std::invalid_argument("ResilientState::add_serialized: " + name +
                                " needs both save and load");
  serialized_.push_back({std::move(name), std::move(save), std::move(load)});
}

size_t ResilientState::bytes() const {
  size_t n = 0;
  for (const Buffer& b : buffers_) n += b.bytes;
  return n;
}

struct ResilientLoop::Impl {
  ResilientState& state;
  ResilientOptions options;
  std::optional<Worker> worker;
  std::unique_ptr<ProcessGroup> cpu_group;  // when the default group is NCCL
  uint64_t generation = 0;
  bool holds = false;  // this process holds a valid state (its step's)
  int formations = 0;
  Stats stats;

  Impl(ResilientState& s, ResilientOptions o) : state(s), options(std::move(o)) {}

  std::string who() const {
    return "[trun.worker] rank " + std::to_string(worker->rank()) + "/" +
           std::to_string(worker->world_size());
  }

  ProcessGroup& host_group() { return cpu_group ? *cpu_group : worker->process_group(); }

  StepSnapshot snapshot() const {
    StepSnapshot s;
    s.step = *state.step();
    if (state.sampler()) s.sampler = state.sampler()->state();
    for (const auto& b : state.buffers()) {
      if (!b.small) continue;
      const auto* p = static_cast<const unsigned char*>(b.data);
      s.small.emplace_back(p, p + b.bytes);
    }
    return s;
  }

  void put_back(const StepSnapshot& s) {
    *state.step() = s.step;
    if (s.sampler) state.sampler()->load_state(*s.sampler);
    size_t i = 0;
    for (const auto& b : state.buffers()) {
      if (!b.small) continue;
      std::memcpy(b.data, s.small[i++].data(), b.bytes);
    }
  }

  // Waits for a generation above the current one on the board (the agent replaced a worker).
  // Rethrows `cause` when there is no board, when a stop was requested (after save_alone), or
  // after reform_timeout.
  void await_generation(const std::exception_ptr& cause, const ResilientProgram& program) {
    const Clock::time_point deadline = Clock::now() + options.reform_timeout;
    for (;;) {
      const std::optional<uint64_t> g = detail::progress::board_generation();
      if (stop_requested()) {
        save_alone(program);
        std::rethrow_exception(cause);
      }
      if (!g) std::rethrow_exception(cause);
      if (*g > generation) {
        generation = *g;
        return;
      }
      if (Clock::now() >= deadline) {
        std::fprintf(stderr, "%s: no new generation from the agent within %lld ms; giving up\n",
                     who().c_str(), static_cast<long long>(options.reform_timeout.count()));
        std::rethrow_exception(cause);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  // A stop while re-forming: rank 0 of the last formation saves the completed step it holds.
  void save_alone(const ResilientProgram& program) {
    if (!program.save_alone || !holds || !worker || worker->rank() != 0) return;
    const uint64_t step = *state.step();
    try {
      program.save_alone(*worker);
      if (options.verbose)
        std::fprintf(stderr,
                     "%s: stopped while the group re-formed: saved the state of step %" PRIu64
                     " without a group\n",
                     who().c_str(), step);
    } catch (const std::exception& e) {
      std::fprintf(stderr,
                   "%s: stopped while the group re-formed: cannot save the state of step %" PRIu64
                   ": %s\n",
                   who().c_str(), step, e.what());
    }
  }

  // Drops the current groups (after the program dropped what holds them).
  void drop_groups(const ResilientProgram& program) {
    if (program.release) program.release();
    if (worker) {
      try {
        worker->process_group().abort("the resilient loop forms new groups");
      } catch (const CollectiveError&) {
        // no default group: nothing to abort
      }
    }
    cpu_group.reset();
    if (worker) worker->default_group_.reset();
    detail::progress::forget_groups();
  }

  // Tests of the fallbacks (tests/examples/resilient_test.cpp): with
  // TRUN_TEST_DIE_SENDING_STATE=G, the rank that sends the state at generation G dies (SIGKILL)
  // after the transfer's header, before the buffers.
  void die_if_testing_a_lost_sender(bool sender) const {  // after the header
    static const char* const at = std::getenv("TRUN_TEST_DIE_SENDING_STATE");
    if (sender && at && std::to_string(generation) == at) {
      std::fprintf(stderr, "%s: dying while it sends the state (TRUN_TEST_DIE_SENDING_STATE)\n",
                   who().c_str());
      ::raise(SIGKILL);
    }
  }

  // TRUN_TEST_DIE_REFORMING=G:R: rank R dies (SIGKILL) as it begins to re-form at generation G,
  // after leaving its groups and 2 s more: the others are then building G's groups without it,
  // and G's replacement had the time to start (under a sanitizer too) and declare its loop.
  void die_if_testing_reforming() const {
    static const char* const at = std::getenv("TRUN_TEST_DIE_REFORMING");
    if (at && std::to_string(generation) + ":" + std::to_string(worker->rank()) == at) {
      std::this_thread::sleep_for(std::chrono::seconds(2));
      std::fprintf(stderr, "%s: dying as it re-forms (TRUN_TEST_DIE_REFORMING)\n", who().c_str());
      ::raise(SIGKILL);
    }
  }

  // Every rank to the state of the most advanced completed step (see trun/resilient.h).
  void sync(const ResilientProgram& program) {
    ProcessGroup& pg = host_group();
    const int world = pg.size();
    StateClaim mine{holds ? 1 : 0, holds ? static_cast<int64_t>(*state.step()) : -1};
    std::vector<StateClaim> all(static_cast<size_t>(world));
    pg.allgather(&mine, all.data(), 2, DataType::kInt64);
    int source = -1;  // the lowest rank at the highest step
    for (int r = 0; r < world; ++r) {
      const StateClaim& c = all[static_cast<size_t>(r)];
      if (c.holds && (source < 0 || c.step > all[static_cast<size_t>(source)].step)) source = r;
    }
    stats.restored = source < 0;
    // The ranks that need the state: those without one, or with an older step's.
    std::vector<int> needy;
    if (source < 0) {
      // Nobody holds a state: the program loads the checkpoint (or starts fresh) on every rank,
      // and rank 0's result is everyone's (fresh ranks may have drawn different weights).
      if (program.restore) program.restore(*worker);
      holds = true;
      source = 0;
      for (int r = 1; r < world; ++r) needy.push_back(r);
    } else {
      const int64_t top = all[static_cast<size_t>(source)].step;
      for (int r = 0; r < world; ++r) {
        const StateClaim& c = all[static_cast<size_t>(r)];
        if (!c.holds || c.step != top) needy.push_back(r);
      }
    }
    stats.last_source_rank = needy.empty() ? -1 : source;
    stats.last_bytes = 0;
    stats.last_transfer_s = 0;
    if (needy.empty()) return;  // every rank holds the same step's state
    const int me = pg.rank();
    const bool sender = me == source;
    const bool receiver = std::find(needy.begin(), needy.end(), me) != needy.end();
    if (!sender && !receiver) return;
    // The state goes point to point from the source to each rank that needs it (between local
    // ranks: pipelined copies through shared memory, or reads of the sender's memory); the
    // others keep theirs. A receiver holds no valid state until its transfer completes.
    if (receiver) holds = false;
    const Clock::time_point t0 = Clock::now();
    std::vector<std::string> blobs;
    if (sender)
      for (const auto& o : state.serialized()) blobs.push_back(o.save());
    for (int r : needy) {
      if (sender)
        send_state(pg, r, blobs);
      else if (r == me)
        receive_state(pg, source);
    }
    stats.last_transfer_s = resilient_seconds_since(t0);
  }

  static constexpr int kStateTag = 0x3338;  // "38"

  // `bytes` bytes to (from) one rank, in messages of at most kTransferChunk.
  static void send_bytes(ProcessGroup& pg, const void* data, size_t bytes, int to) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t off = 0; off < bytes; off += kTransferChunk)
      pg.send(p + off, std::min(kTransferChunk, bytes - off), DataType::kUInt8, to, kStateTag);
  }
  static void receive_bytes(ProcessGroup& pg, void* data, size_t bytes, int from) {
    auto* p = static_cast<unsigned char*>(data);
    for (size_t off = 0; off < bytes; off += kTransferChunk)
      pg.recv(p + off, std::min(kTransferChunk, bytes - off), DataType::kUInt8, from, kStateTag);
  }

  void send_state(ProcessGroup& pg, int to, const std::vector<std::string>& blobs) {
    TransferHeader h;
    h.step = *state.step();
    if (state.sampler()) {
      h.epoch = state.sampler()->epoch();
      h.offset = state.sampler()->offset();
    }
    h.bytes = state.bytes();
    pg.send(&h, sizeof h / sizeof(uint64_t), DataType::kInt64, to, kStateTag);
    die_if_testing_a_lost_sender(true);
    for (const auto& b : state.buffers()) send_bytes(pg, b.data, b.bytes, to);
    size_t moved = h.bytes;
    for (const std::string& bytes : blobs) {
      uint64_t n = bytes.size();
      pg.send(&n, 1, DataType::kInt64, to, kStateTag);
      send_bytes(pg, bytes.data(), n, to);
      moved += n;
    }
    stats.last_bytes += moved;
  }

  void receive_state(ProcessGroup& pg, int from) {
    TransferHeader h;
    pg.recv(&h, sizeof h / sizeof(uint64_t), DataType::kInt64, from, kStateTag);
    if (h.bytes != state.bytes())
      throw std::runtime_error(who() + ": the resilient state of rank " + std::to_string(from) +
                               " has " + std::to_string(h.bytes) + " bytes, this rank's " +
                               std::to_string(state.bytes()) +
                               ": every rank must register the same buffers");
    for (const auto& b : state.buffers()) receive_bytes(pg, b.data, b.bytes, from);
    size_t moved = h.bytes;
    for (const auto& o : state.serialized()) {
      uint64_t n = 0;
      pg.recv(&n, 1, DataType::kInt64, from, kStateTag);
      std::string bytes(n, '\0');
      receive_bytes(pg, bytes.data(), n, from);
      o.load(bytes);
      moved += n;
    }
    *state.step() = h.step;
    if (state.sampler()) {
      SamplerState st = state.sampler()->state();
      st.epoch = h.epoch;
      st.offset = h.offset;
      state.sampler()->load_state(st);
    }
    holds = true;
    stats.last_bytes = moved;
  }
};

ResilientLoop::ResilientLoop(ResilientState& state, ResilientOptions options)
    : impl_(std::make_unique<Impl>(state, std::move(options))) {
  if (!state.step()) throw std::invalid_argument("ResilientState: set_step() was not called");
  // Declared before init(): a second failure while this process is still building its first
  // groups (a replacement) is then replaced alone too.
  detail::progress::init_begin();
  detail::progress::declare_resilient();
  impl_->worker.emplace(init(impl_->options.init));
  impl_->generation = impl_->worker->generation_;
}

ResilientLoop::~ResilientLoop() = default;

Worker& ResilientLoop::worker() { return *impl_->worker; }

const ResilientLoop::Stats& ResilientLoop::stats() const { return impl_->stats; }

void ResilientLoop::run(const ResilientProgram& program) {
  if (!program.on_group || !program.step)
    throw std::invalid_argument("ResilientProgram: on_group and step are required");
  Impl& m = *impl_;
  std::optional<Clock::time_point> failed_at;  // the failure being recovered from
  std::string failure;
  for (;;) {
    try {
      if (failed_at) {
        m.drop_groups(program);
        m.die_if_testing_reforming();
        m.worker.emplace(m.worker->at_generation(m.generation));
        m.generation = m.worker->generation_;  // the board's newest
      }
      // The first formation's groups come from init(); later ones from at_generation() above.
      if (m.worker->process_group().backend() == Backend::kNccl && !m.cpu_group)
        m.cpu_group = m.worker->new_group(Backend::kCpu);
      Formation f;
      f.generation = m.generation;
      f.number = m.formations++;
      ++m.stats.formations;
      program.on_group(*m.worker, f);
      m.sync(program);
      detail::progress::joined_generation(m.generation);
      if (failed_at) {
        ++m.stats.recoveries;
        m.stats.last_reform_s = resilient_seconds_since(*failed_at);
        if (m.options.verbose) {
          const std::string us =
              std::to_string(static_cast<int64_t>(m.stats.last_transfer_s * 1e6)) + " us)";
          const std::string bytes = std::to_string(m.stats.last_bytes) + " bytes in ";
          const int me = m.worker->rank(), src = m.stats.last_source_rank;
          const std::string from =
              m.stats.restored ? "no rank held a state: restored (checkpoint or fresh start)"
              : src < 0        ? "held by every rank"
              : src == me      ? "sent by this rank (" + bytes + us
              : m.stats.last_bytes > 0
                  ? "from rank " + std::to_string(src) + " (" + bytes + us
                  : "kept (rank " + std::to_string(src) + " sent it to the ranks without it)";
          std::fprintf(stderr,
                       "%s: re-formed at generation %" PRIu64
                       " %.1f ms after %s; state of step "
                       "%" PRIu64 " %s\n",
                       m.who().c_str(), m.generation, m.stats.last_reform_s * 1e3, failure.c_str(),
                       *m.state.step(), from.c_str());
        }
        failed_at.reset();
      }
    } catch (const std::exception& e) {
      // The formation broke (a peer died while the groups formed or the state moved, or the
      // store failed meanwhile): the next generation, and its holders or the checkpoint, provide
      // the state. Anything else ends the process.
      const bool collective = dynamic_cast<const CollectiveError*>(&e) != nullptr;
      if (!collective && !dynamic_cast<const store::StoreError*>(&e)) throw;
      if (!failed_at) failed_at = Clock::now();
      failure = std::string(collective ? "a failure" : "a store failure") + " while re-forming (" +
                e.what() + ")";
      if (m.options.verbose)
        std::fprintf(stderr, "%s: %s; waiting for the next generation\n", m.who().c_str(),
                     failure.c_str());
      m.await_generation(std::current_exception(), program);
      continue;
    }
    // Steps until the end, a failure, or a new generation from the agent.
    try {
      for (;;) {
        const std::optional<uint64_t> g = detail::progress::board_generation();
        if (g && *g > m.generation) {
          failed_at = Clock::now();
          failure = "the agent's generation " + std::to_string(*g);
          m.generation = *g;
          break;
        }
        const StepSnapshot before = m.snapshot();
        bool stepped = false;
        try {
          stepped = program.step(*m.worker);
        } catch (const RanksStoppedError&) {
          m.put_back(before);  // the agreed step is complete: nothing to redo
          throw;
        } catch (const CollectiveError&) {
          m.put_back(before);
          ++m.stats.steps_redone;
          throw;
        } catch (const store::StoreError& e) {
          // A group's store wait inside the step (a point-to-point pair built on first use)
          // that the peers' move to a newer generation ended: a failure of the step as well.
          m.put_back(before);
          ++m.stats.steps_redone;
          throw CollectiveError(e.what());
        }
        if (!stepped) return;
      }
    } catch (const RanksStoppedError& e) {
      failed_at = Clock::now();
      failure = std::string("a stop of other ranks (") + e.what() + ")";
      if (m.options.verbose)
        std::fprintf(stderr, "%s: %s; waiting for the next generation\n", m.who().c_str(),
                     e.what());
      m.await_generation(std::current_exception(), program);
    } catch (const CollectiveError& e) {
      failed_at = Clock::now();
      failure = std::string("a failed collective (") + e.what() + ")";
      if (m.options.verbose)
        std::fprintf(stderr, "%s: step %" PRIu64 " failed: %s; waiting for the next generation\n",
                     m.who().c_str(), *m.state.step() + 1, e.what());
      m.await_generation(std::current_exception(), program);
    }
  }
}

}  // namespace trun::worker
