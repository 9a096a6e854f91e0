#include "store/dialect_probe.h"

#include <unistd.h>

#include <string>

#include "store/wire.h"

namespace trun::store {
namespace {

// Closes the descriptor it holds unless released.
class FdGuard {
 public:
  explicit FdGuard(int fd) : fd_(fd) {}
  ~FdGuard() {
    if (fd_ >= 0) ::close(fd_);
  }
  FdGuard(const FdGuard&) = delete;
  FdGuard& operator=(const FdGuard&) = delete;
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

}  // namespace

ProbeResult probe_dialect(int fd, net::Clock::time_point deadline,
                          const std::function<int()>& reopen) {
  using wire::Op;
  FdGuard first(fd);
  std::string probe;
  wire::Encoder(&probe)
      .query(Op::kValidate)
      .u32(wire::kValidationMagic)
      .query(Op::kPing)
      .u32(kProbeNonce)
      .query(Op::kLeaseRelease);
  net::Reader r(first.get(), deadline);
  int answered = 0;  // bytes of the expected answer (4 echo + 1) that arrived
  bool wrong_echo = false;
  try {
    net::write_all(first.get(), probe, deadline);
    if (r.u32() != kProbeNonce) {
      wrong_echo = true;
    } else {
      answered = 4;
      r.u8();
      answered = 5;
    }
  } catch (const net::IoError& e) {
    if (e.timed_out) throw;  // no answer at all: a failed attempt (retried)
  }
  if (wrong_echo) throw net::IoError{false, "unexpected answer to the probe"};
  if (answered == 5) return {StoreDialect::kTrun, first.release()};
  ::close(first.release());
  if (answered == 4) return {StoreDialect::kTorch2, -1};

  FdGuard second(reopen());
  if (second.get() < 0) return {StoreDialect::kAuto, -1};
  std::string num_keys;
  wire::Encoder(&num_keys).query(Op::kNumKeys, wire::Dialect::kV1);
  net::write_all(second.get(), num_keys, deadline);
  net::Reader r2(second.get(), deadline);
  try {
    r2.i64();
    return {StoreDialect::kTorch1_13, second.release()};
  } catch (const net::IoError& e) {
    if (e.timed_out) throw;
  }
  return {StoreDialect::kTorch2, -1};
}

}  // namespace trun::store
