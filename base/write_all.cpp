#include "base/write_all.h"

#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace trun::base {

bool write_all(int fd, const void* data, size_t size, size_t* written, WriteCall call) {
  const auto* p = static_cast<const char*>(data);
  size_t done = 0;
  bool ok = true;
  while (done < size) {
    const ssize_t n = call == WriteCall::kSendNoSignal
                          ? ::send(fd, p + done, size - done, MSG_NOSIGNAL)
                          : ::write(fd, p + done, size - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      if (n == 0) errno = EIO;  // nothing taken and no error: do not spin
      ok = false;
      break;
    }
  }
  if (written != nullptr) *written = done;
  return ok;
}

bool pwrite_all(int fd, const void* data, size_t size, uint64_t offset, size_t max_piece) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::pwrite(fd, p, std::min(size, max_piece), static_cast<off_t>(offset));
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
      offset += static_cast<uint64_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      if (n == 0) errno = EIO;
      return false;
    }
  }
  return true;
}

}  // namespace trun::base
