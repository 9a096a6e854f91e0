#pragma once
// EventLog: --event-log FILE, one JSON object per line for every rendezvous and agent event.
//
// Each line has torchelastic's Event fields (torch.distributed.elastic.events.api.Event):
//   {"name": "trun.agent.worker_exited", "source": "AGENT", "timestamp": <ms since the epoch>,
//    "metadata": {"run_id": ..., "hostname": ..., "pid": ..., ...}}
// so tools that read torchelastic's serialized events read these. The names and the metadata
// of each event are listed in docs/observability.md.
//
// Blocking: record() only formats the line and appends it to a bounded in-memory queue; one
// writer thread owned by the log writes it to the file. When the queue is full (the disk is
// slower than the agent) lines are dropped and counted, never waited for. A write error (full
// disk, file gone read-only) is reported once on trun's log as a warning (by the next record()
// or the destructor: the writer thread never logs); the job goes on and later lines are dropped.
//
// Thread safety: record() may be called from any thread. The destructor writes what is queued
// (bounded by the queue size) and joins the writer.
//
// Errors: open() throws std::runtime_error naming the path and the reason when the file cannot
// be opened for appending (the agent then exits 3 before starting anything).

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <variant>

namespace trun::agent {

// A metadata value: torchelastic's EventMetadataValue (str, int, float, bool, None).
using EventValue = std::variant<std::monostate, std::string, int64_t, double, bool>;
using EventMetadata = std::map<std::string, EventValue>;

class EventLog {
 public:
  static constexpr size_t kMaxQueuedLines = 4096;

  // Opens (creates, appends to) `path` and starts the writer thread. Call it after the agent
  // blocked its signals (the thread inherits the mask).
  static std::unique_ptr<EventLog> open(const std::string& path);
  ~EventLog();
  EventLog(const EventLog&) = delete;
  EventLog& operator=(const EventLog&) = delete;

  // Fields added to every event's metadata (run_id, hostname, pid, ...); set before recording.
  void set_common(const std::string& key, EventValue value);
  // Queues one event named `name` (source AGENT, timestamp now). Never blocks on the file.
  void record(const std::string& name, EventMetadata metadata);
  // Lines dropped because the queue was full or the file failed.
  uint64_t dropped() const;

  // One event as its JSON line (without the newline). For tests and the writer.
  static std::string format(const std::string& name, int64_t timestamp_ms,
                            const EventMetadata& metadata);

 private:
  EventLog(int fd, std::string path);
  void writer();
  void warn_once_locked();

  const int fd_;
  const std::string path_;
  EventMetadata common_;  // written before the writer reads events; guarded by mu_ as well
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::string> queue_;
  bool stop_ = false;
  bool failed_ = false;
  bool warned_ = false;
  std::string error_;
  uint64_t dropped_ = 0;
  std::thread thread_;
};

}  // namespace trun::agent
