#pragma once
// The progress board: one shared-memory segment per node in which each local worker reports its
// progress, and from which its agent reads it (issue 36, docs/hangs.md). Header-only; the layout
// is the contract between libtrun_worker (worker_sdk/src/progress/, the writer) and the agent
// (agent/progress_monitor.*, the creator and reader), so it lives here, where both may look.
//
// Layout: a Header, a Formation, then `slots` RankRecords (one per local rank), each cache-line
// aligned. A record holds the rank's heartbeat counter and time of last progress, its phase, its
// section names and, per process group, the last issued and completed collective sequence
// numbers and a ring of the most recent kRingSize collectives (PyTorch's flight recorder idea).
//
// Writing is plain atomic stores (and one fetch_add for the heartbeat) into a mapped page: no
// system call, no lock. Every field is a lock-free std::atomic, so that the reader in another
// process (or thread) never sees a torn value; the reader must treat everything as untrusted
// (a worker may write anything here): it clamps counts and indices, and a name is at most
// kNameMax bytes with its terminator forced.
//
// Ordering (what makes a snapshot of a stalled rank consistent): a writer stores an event's
// fields first, then the counter that publishes them (the entry's seq, the group's issued or
// completed, num_groups, num_sections) with release, and bumps `heartbeat` last, with release.
// A reader loads `heartbeat` (acquire), copies the record, and loads `heartbeat` again: equal
// means no event was published in between. A rank that is not moving always passes.
//
// Times: CLOCK_MONOTONIC nanoseconds. The worker reads CLOCK_MONOTONIC_COARSE, the same clock
// at the kernel tick's resolution (1-4 ms), a third of the cost per hook (measured: 45 instead
// of 160 ns per collective on a kvm-clock VM); a reader's idle time is off by at most a tick.
//
// Versioning: `magic` and `version` are checked by the worker before it writes anything; a
// layout change bumps kVersion (a worker built against another layout then reports nothing).

#include <time.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace trun::base::progress {

inline constexpr uint64_t kMagic = 0x3142524f47525054ULL;  // "TPRGROB1", little-endian
// 2: RankRecord::collective_ns; 3: the goodput fields (first_step_ns ... checkpoint_load_ns);
// 4: the resilient loop's fields (Header::generation, RankRecord::resilient and generation);
// 5: the Formation after the Header; 6: Header::leaving
inline constexpr uint32_t kVersion = 6;
inline constexpr int kMaxGroups = 8;     // process groups tracked per rank (later ones: not)
inline constexpr int kRingSize = 16;     // recent collectives kept per group
inline constexpr int kMaxSections = 16;  // distinct section names per rank (later ones: "other")
inline constexpr int kNameMax = 32;      // bytes of a section name, with its terminator
inline constexpr int kMaxSlots = 1024;   // local ranks one board may hold
inline constexpr int kAddrMax = 256;     // bytes of Formation::master_addr, with its terminator
// The variable that carries the board's name ("/trun-progress-...") to the workers. A worker
// without it (run outside trun, or under torchrun) reports nothing and pays nothing.
inline constexpr const char* kEnvVar = "TRUN_PROGRESS_SHM";

// What the rank is doing, as its main thread last said. A collective in flight is not a phase:
// it is read from the groups (issued > completed).
enum class Phase : uint32_t {
  kNone = 0,            // not attached
  kInit = 1,            // inside trun::worker::init()
  kRunning = 2,         // after init(): the training loop (steps, collectives, user code)
  kStopCheck = 3,       // inside StopAgreement::should_stop's agreement
  kCheckpointSave = 4,  // inside Checkpointer::save (the blocking part)
  kSection = 5,         // inside a trun::worker::Section (RankRecord::section names it)
};

// Collective kinds, as the board stores them.
enum class Op : uint32_t {
  kNone = 0,
  kAllreduce,
  kBroadcast,
  kAllgather,
  kReduceScatter,
  kBarrier,
  kReduce,
  kGather,
  kScatter,
  kAllToAll,
  kAllToAllV,
  kSend,
  kRecv,
  kBatchP2P,
  kMonitoredBarrier,
  kCount,  // not an op: the number of codes
};

inline const char* op_name(Op op) {
  switch (op) {
    case Op::kAllreduce:
      return "allreduce";
    case Op::kBroadcast:
      return "broadcast";
    case Op::kAllgather:
      return "allgather";
    case Op::kReduceScatter:
      return "reduce_scatter";
    case Op::kBarrier:
      return "barrier";
    case Op::kReduce:
      return "reduce";
    case Op::kGather:
      return "gather";
    case Op::kScatter:
      return "scatter";
    case Op::kAllToAll:
      return "all_to_all";
    case Op::kAllToAllV:
      return "all_to_all_v";
    case Op::kSend:
      return "send";
    case Op::kRecv:
      return "recv";
    case Op::kBatchP2P:
      return "batch_isend_irecv";
    case Op::kMonitoredBarrier:
      return "monitored_barrier";
    default:
      return "collective";
  }
}

// Data types: 0 is none (barrier), 1 + trun::worker::DataType's value otherwise (the worker side
// checks the correspondence at compile time).
inline const char* dtype_name(uint32_t code) {
  static const char* const kNames[] = {"none",  "float32", "float64", "float16", "bfloat16",
                                       "int32", "int64",   "int8",    "uint8",   "bool"};
  return code < sizeof(kNames) / sizeof(kNames[0]) ? kNames[code] : "unknown";
}

enum class State : uint32_t {
  kEmpty = 0,
  kIssued = 1,     // the program called it; queued, or running on the caller's thread soon
  kStarted = 2,    // the backend runs it (this rank waits for its peers in here)
  kCompleted = 3,  // returned successfully
  kFailed = 4,     // threw (a CollectiveError)
};

inline const char* state_name(State s) {
  switch (s) {
    case State::kIssued:
      return "issued";
    case State::kStarted:
      return "started";
    case State::kCompleted:
      return "completed";
    case State::kFailed:
      return "failed";
    default:
      return "empty";
  }
}

// One collective of a group's ring, at index seq % kRingSize. `seq` (1-based) is stored last on
// issue; a reader that finds another seq than the one it looks for has lost that entry (more
// than kRingSize collectives since).
struct alignas(64) CollectiveEntry {
  std::atomic<uint64_t> seq;
  std::atomic<uint32_t> op;     // Op
  std::atomic<uint32_t> dtype;  // see dtype_name
  std::atomic<uint64_t> count;  // elements
  std::atomic<uint32_t> state;  // State
  std::atomic<int64_t> issued_ns;
  std::atomic<int64_t> started_ns;
  std::atomic<int64_t> finished_ns;  // completed or failed
};

struct alignas(64) GroupRecord {
  // FNV-1a of the group's tag (ProcessGroupOptions::tag): the same group on every rank.
  std::atomic<uint64_t> key;
  std::atomic<int32_t> number;  // Worker::new_group's number (shm_group_number), -1: unknown
  std::atomic<int32_t> group_rank;
  std::atomic<int32_t> group_size;
  std::atomic<uint64_t> issued;     // the last issued seq (0: none)
  std::atomic<uint64_t> completed;  // the last finished seq (completed or failed)
  CollectiveEntry ring[kRingSize];
};

struct alignas(64) RankRecord {
  std::atomic<int32_t> pid;  // 0: no worker attached
  std::atomic<int32_t> rank;
  std::atomic<int32_t> local_rank;
  std::atomic<uint32_t> phase;    // Phase
  std::atomic<uint32_t> section;  // kSection: index + 1 into section_names; 0 none
  std::atomic<uint32_t> num_groups;
  std::atomic<uint32_t> num_sections;
  std::atomic<uint32_t> untracked_groups;  // groups beyond kMaxGroups
  std::atomic<uint64_t> heartbeat;         // every progress event adds 1
  std::atomic<int64_t> last_progress_ns;   // CLOCK_MONOTONIC(_COARSE) of the last event
  std::atomic<int64_t> attached_ns;
  std::atomic<int64_t> phase_since_ns;
  // `heartbeat` when init() returned (0: it has not): no progress since means "starting up".
  std::atomic<uint64_t> init_end_heartbeat;
  std::atomic<uint64_t> steps;  // DDP steps finished (finalize) and explicit heartbeats
  // Nanoseconds spent inside collectives so far: each one's finish minus its start, added when it
  // finishes (the straggler scores: a rank that waits little in them is the one the others wait
  // for; agent/straggler.h).
  std::atomic<int64_t> collective_ns;
  // Goodput (agent/goodput.h): when this process's first and last DDP step ended, the step its
  // checkpoint load resumed from plus one (0: no load yet; 1: it loaded nothing, a fresh start)
  // and what that load took (Checkpointer::load_latest).
  std::atomic<int64_t> first_step_ns;
  std::atomic<int64_t> last_step_ns;
  std::atomic<uint64_t> resumed_step_plus1;
  std::atomic<int64_t> checkpoint_load_ns;
  // The resilient loop (trun/resilient.h, docs/worker_sdk.md): 1 once this process runs one, so
  // that its agent may replace a failed local rank alone instead of stopping the group; and the
  // generation (Header::generation) its process groups were last built at (0: not yet).
  std::atomic<uint32_t> resilient;
  std::atomic<uint64_t> generation;
  // Written once each, before num_sections publishes them (release).
  char section_names[kMaxSections][kNameMax];
  GroupRecord groups[kMaxGroups];
};

struct alignas(64) Header {
  std::atomic<uint64_t> magic;  // stored last by the creator (release)
  std::atomic<uint32_t> version;
  std::atomic<uint32_t> slots;        // RankRecords that follow
  std::atomic<uint32_t> record_size;  // sizeof(RankRecord), checked by the worker
  std::atomic<uint32_t> max_groups;
  std::atomic<uint32_t> ring_size;
  std::atomic<int64_t> created_ns;
  // The generation of the workers now meant to run: the agent's restart count of the attempt,
  // stored before it spawns them, and again (one higher) when it replaces failed workers of
  // resilient loops in place. A resilient worker whose groups run at a lower generation leaves
  // them and builds new ones at this one (with the replacements), in the same process.
  std::atomic<uint64_t> generation;
  std::atomic<int64_t> generation_ns;  // CLOCK_MONOTONIC when `generation` was last stored
  // 1 once the agent stops its workers because this node leaves the job (the agent was asked to
  // stop, or its node was excluded), stored (release) before it signals them; 0 again when a
  // group is spawned. A worker's stop agreement then tells the other nodes' ranks that only this
  // node stops, and those of resilient loops go on without it (trun/stop.h).
  std::atomic<uint32_t> leaving;
};
static_assert(sizeof(Header) == 64, "the header is one cache line");

// After the Header: where the workers of Header::generation stand, for the resilient loop
// (trun/resilient.h). The agent fills it in, then stores `generation` (release), then the
// Header's (release); a worker that saw the Header's generation (acquire) reads `generation`
// (acquire), copies the rest and reads `generation` again: the same value means it copied one
// formation's fields, not a mix of two.
struct alignas(64) Formation {
  std::atomic<uint64_t> generation;  // the Header::generation these fields are of (0: unset)
  // What names the process groups' store keys and shared-memory segments when rank 0 hosts the
  // store: the same on every node of the round (the round store's counter of replacements,
  // agent/reform_watch.h); -1: nothing (a new store, or the names torchrun's workers use).
  std::atomic<int64_t> naming;
  // The workers' places: after a new round formed around running workers (a node joined or
  // left) they differ from the environment the workers were started with.
  std::atomic<int32_t> world_size;
  std::atomic<int32_t> group_rank;
  std::atomic<int32_t> group_world_size;
  std::atomic<int32_t> master_port;
  char master_addr[kAddrMax];             // NUL-terminated (a reader forces the terminator)
  std::atomic<int32_t> ranks[kMaxSlots];  // the global rank of each local slot
};

static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<int64_t>::is_always_lock_free,
              "the board is shared between processes: its atomics must be lock-free");
static_assert(sizeof(CollectiveEntry) == 64, "one cache line per ring entry");

// The reader's clock: CLOCK_MONOTONIC nanoseconds, the clock of every time on the board.
inline int64_t monotonic_ns() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

inline constexpr size_t board_bytes(uint32_t slots) {
  return sizeof(Header) + sizeof(Formation) + static_cast<size_t>(slots) * sizeof(RankRecord);
}

inline Formation* formation_at(void* board) {
  return reinterpret_cast<Formation*>(static_cast<char*>(board) + sizeof(Header));
}

inline RankRecord* record_at(void* board, uint32_t slot) {
  return reinterpret_cast<RankRecord*>(static_cast<char*>(board) + sizeof(Header) +
                                       sizeof(Formation)) +
         slot;
}

// FNV-1a 64, the group's key (never 0: 0 marks an unused slot).
inline uint64_t group_key(const char* data, size_t size) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < size; ++i) {
    h ^= static_cast<unsigned char>(data[i]);
    h *= 0x100000001b3ULL;
  }
  return h ? h : 1;
}

}  // namespace trun::base::progress
