// ShmComm's barrier and failure detection (shm_comm.h): arriving at and waiting for a barrier
// in the segment's header (spin, yield, then sleep on a futex), the segment's abort flag, and
// checking that the peers being waited for are still alive. Members of ShmComm; the layout they
// use is shm_layout.h's.

#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <ctime>

#include "worker_sdk/src/cpu/shm_comm.h"
#include "worker_sdk/src/cpu/shm_layout.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TRUN_CPU_RELAX() _mm_pause()
#else
#define TRUN_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace trun::worker::detail {

namespace {

long futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* ts) {
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, ts, nullptr, 0);
}

}  // namespace

void ShmComm::set_abort(const std::string& reason) {
  int32_t expected = -1;
  if (hdr_->abort_owner.compare_exchange_strong(expected, me_)) {
    std::snprintf(hdr_->abort_reason, sizeof hdr_->abort_reason, "%s", reason.c_str());
    hdr_->aborted.store(1, std::memory_order_release);
  }
  hdr_->wake.fetch_add(1);
  futex(&hdr_->wake, FUTEX_WAKE, INT_MAX, nullptr);
}

void ShmComm::abort(const std::string& reason) {
  if (hdr_) set_abort("local rank " + std::to_string(me_) + " aborted: " + reason);
}

void ShmComm::check_aborted(const char* what) {
  if (hdr_ && hdr_->aborted.load(std::memory_order_acquire)) fail_aborted(what);
}

void ShmComm::fail_aborted(const char* what) {
  throw CollectiveError(std::string(what) + " failed on local rank " + std::to_string(me_) +
                        " (shared memory " + name_ + "): " + hdr_->abort_reason);
}

void ShmComm::check_peers_alive(const char* what) {
  for (int r = 0; r < n_; ++r) {
    if (r == me_) continue;
    bool dead = false;
    if (pidfds_.empty()) break;  // still in setup
    if (pidfds_[r] >= 0) {
      pollfd p{pidfds_[r], POLLIN, 0};
      dead = ::poll(&p, 1, 0) > 0;
    } else if (pids_[r] > 0) {
      dead = ::kill(pids_[r], 0) != 0 && errno == ESRCH;
    }
    if (dead) {
      std::string reason = "local rank " + std::to_string(r) + " (pid " + std::to_string(pids_[r]) +
                           ") exited during " + what;
      set_abort(reason);
      fail_aborted(what);
    }
  }
}

void ShmComm::wait_for_all(uint32_t target, Deadline deadline, const char* what) {
  int spins = 0;
  int next = 0;  // first rank not yet known to have arrived
  auto last_check = Clock::now();
  Clock::time_point yield_until{};
  for (;;) {
    while (next < n_ &&
           static_cast<int32_t>(hdr_->ranks[next].arrived.load(std::memory_order_acquire) -
                                target) >= 0)
      ++next;
    if (next == n_) return;
    check_aborted(what);
    if (spins < spin_limit_) {
      ++spins;
      TRUN_CPU_RELAX();
      continue;
    }
    auto now = Clock::now();
    if (now >= deadline) {
      std::string reason = "local rank " + std::to_string(me_) + " timed out in " + what +
                           " waiting for local rank " + std::to_string(next) +
                           (pids_.empty() ? "" : " (pid " + std::to_string(pids_[next]) + ")");
      set_abort(reason);
      throw CollectiveTimeoutError(std::string(what) + " timed out on local rank " +
                                   std::to_string(me_) + ": " + reason);
    }
    if (now - last_check >= std::chrono::milliseconds(20)) {
      last_check = now;
      check_peers_alive(what);
    }
    // Then yield the core for a while before sleeping: the peers we wait for are often queued
    // behind us on this very core (more ranks than cores), and a yield hands it to them at once
    // with no futex round trip. Long waits (a peer still computing) end up on the futex.
    if (yield_until == Clock::time_point{}) yield_until = now + yield_for_;
    if (now < yield_until) {
      ::sched_yield();
      continue;
    }
    hdr_->waiters.fetch_add(1);
    uint32_t w = hdr_->wake.load();
    bool ready = static_cast<int32_t>(hdr_->ranks[next].arrived.load() - target) >= 0 ||
                 hdr_->aborted.load();
    if (!ready) {
      auto left = std::min<Clock::duration>(deadline - now, std::chrono::milliseconds(20));
      auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
      timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
      futex(&hdr_->wake, FUTEX_WAIT, w, &ts);
    }
    hdr_->waiters.fetch_sub(1);
  }
}

bool ShmComm::all_arrived(uint32_t target) const {
  for (int r = 0; r < n_; ++r)
    if (static_cast<int32_t>(hdr_->ranks[r].arrived.load() - target) < 0) return false;
  return true;
}

void ShmComm::arrive_and_wait(Deadline deadline, const char* what) {
  ++seq_;
  hdr_->ranks[me_].arrived.store(seq_);  // seq_cst: ordered before the loads below
  // Only the rank that completes the barrier wakes the sleepers: waking them at every arrival
  // costs each a context switch to find the barrier still closed (4 ranks on 2 cores: most of
  // the wake-ups). Of ranks arriving at once, the last store in the total order sees all the
  // others (seq_cst on both sides), so some rank always wakes them.
  if (hdr_->waiters.load() > 0 && all_arrived(seq_)) {
    hdr_->wake.fetch_add(1);
    futex(&hdr_->wake, FUTEX_WAKE, INT_MAX, nullptr);
  }
  wait_for_all(seq_, deadline, what);
  // Every rank's call for this collective is published (before its arrival) and stays until
  // its next collective, which it enters only after a barrier this rank has not reached.
  if (check_pending_) {
    check_pending_ = false;
    check_calls();
  }
}

void ShmComm::barrier(Deadline deadline) {
  if (n_ > 1) publish_call(Call{}, false);
  arrive_and_wait(deadline, "barrier");
}

}  // namespace trun::worker::detail
