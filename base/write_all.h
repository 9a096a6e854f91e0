// One write loop: everything or an errno, through partial writes and EINTR. Log files, pipes to a
// parent, sockets (the store's client polls and keeps its deadline on top) and checkpoint files
// (at an offset) all write through it.
//
// Async-signal-safe (write/send/pwrite and errno only): a signal handler may call it. Blocking
// exactly as the descriptor is; a non-blocking one that is full fails with EAGAIN, *written
// telling the caller how far it got, to poll and call again with the rest.
#pragma once

#include <cstddef>
#include <cstdint>

namespace trun::base {

// How each piece is written.
enum class WriteCall {
  kWrite,         // write(2)
  kSendNoSignal,  // send(2) with MSG_NOSIGNAL: a socket whose peer left gives EPIPE, not SIGPIPE
};

// Writes all `size` bytes of `data` to `fd`. Returns true when all are written; false with errno
// set on the first error other than EINTR (a write that takes nothing gives EIO). `*written`, if
// given, is how many bytes were written either way.
bool write_all(int fd, const void* data, size_t size, size_t* written = nullptr,
               WriteCall call = WriteCall::kWrite);

// As write_all, with pwrite(2) at `offset` (the file offset is not moved), at most `max_piece`
// bytes per call (checkpoints use 64 MiB pieces).
bool pwrite_all(int fd, const void* data, size_t size, uint64_t offset,
                size_t max_piece = SIZE_MAX);

}  // namespace trun::base
