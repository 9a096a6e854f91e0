#pragma once
// What the rendezvous benchmarks' forked processes share: CLOCK_MONOTONIC (one clock for every
// process of a run) and whole reads and writes on their pipes.
#include <time.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>

#include "base/write_all.h"

namespace trun::bench {

inline int64_t mono_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// False when the pipe closed or failed first.
inline bool read_all(int fd, void* buf, size_t n) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t r = ::read(fd, p, n);
    if (r <= 0) return false;
    p += r;
    n -= size_t(r);
  }
  return true;
}
// False when the pipe closed or failed first (errno says which).
using base::write_all;

}  // namespace trun::bench
