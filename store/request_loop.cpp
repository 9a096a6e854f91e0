#include "store/request_loop.h"

#include <string_view>
#include <utility>

#include "base/check.h"
#include "store/auth.h"

namespace trun::store {

using wire::Op;

namespace {

bool is_handshake(Op op) {
  return op == Op::kValidate || op == Op::kAuthHello || op == Op::kAuthProof;
}

}  // namespace

RequestLoop::RequestLoop(RequestLoopOptions options, KvState* kv, KvState::Waiter waiter)
    : options_(std::move(options)),
      kv_(kv),
      waiter_(waiter),
      authenticated_(options_.token.empty()) {}

bool RequestLoop::close(std::string why, Stop* stop, bool rejected) {
  why_ = std::move(why);
  rejected_ = rejected;
  *stop = Stop::kClose;
  return false;
}

RequestLoop::Stop RequestLoop::process(Host& host) {
  Stop stop = Stop::kNeedInput;
  size_t offset = 0;
  const size_t out_at_start = out_.size();
  for (;;) {
    std::string_view pending(in_.data() + offset, in_.size() - offset);
    if (pending.empty()) break;
    // Back-pressure per request: one read can hold thousands of requests, and their replies must
    // not all be produced at once for a client that reads none of them.
    if (output_full(host)) {
      stop = Stop::kOutputFull;
      break;
    }
    if (out_.size() >= out_at_start + options_.output_per_turn) {
      stop = Stop::kYield;
      break;
    }
    if (dialect_ == wire::Dialect::kUnknown) {
      dialect_ = wire::detect_dialect(pending);
      if (dialect_ == wire::Dialect::kUnknown) break;  // at most 4 bytes so far
    }
    if (!authenticated_) {
      // Refused at its first byte: nothing a client sends before authenticating is buffered
      // beyond the handshake's few bytes.
      Op op;
      const uint8_t byte = static_cast<uint8_t>(pending[0]);
      if (!wire::lookup_op(byte, dialect_, &op) || !is_handshake(op)) {
        std::string what = wire::lookup_op(byte, dialect_, &op)
                               ? std::string(wire::op_name(op))
                               : "unknown query type " + std::to_string(byte);
        close(what + " before authenticating (a token is required)", &stop, true);
        break;
      }
    }
    wire::Request request;
    auto result = wire::decode(pending, dialect_, options_.limits, &request);
    if (result.status == wire::Status::kNeedMore) {
      if (!authenticated_ && pending.size() > kMaxPreAuthInput) {
        close(std::to_string(pending.size()) + " bytes buffered before authenticating (at most " +
                  std::to_string(kMaxPreAuthInput) + ")",
              &stop, true);
      }
      break;
    }
    if (result.status == wire::Status::kMalformed) {
      close("malformed request: " + result.error, &stop);
      break;
    }
    // A blocked request holds back the ones behind it until it is answered or cancelled, except
    // a 1.13 WAIT: the 1.13 client gives up on a wait silently (a socket timeout, no CANCEL_WAIT)
    // and goes on using the connection, and PyTorch's 1.13 server keeps serving it, sending the
    // STOP_WAITING whenever the keys appear. Do the same.
    const wire::Request* parked = kv_->parked(waiter_);
    bool background_wait = dialect_ == wire::Dialect::kV1 && parked && parked->op == Op::kWait;
    if (parked && request.op != Op::kCancelWait && !background_wait) {
      stop = Stop::kBlocked;
      break;
    }
    offset += result.consumed;
    // Counted once here: a blocked request runs again through KvState::resume, not here.
    if (!is_handshake(request.op)) {
      ++executed_;
      host.counted();
    }
    if (!execute(request, host, &stop)) break;
  }
  in_.erase(0, offset);
  // Handshake requests left over when the output filled up (a flood of AUTH_HELLOs) count
  // against the cap as well.
  if (stop != Stop::kClose && !authenticated_ && in_.size() > kMaxPreAuthInput) {
    close(std::to_string(in_.size()) + " bytes buffered before authenticating (at most " +
              std::to_string(kMaxPreAuthInput) + ")",
          &stop, true);
  }
  return stop;
}

bool RequestLoop::execute(wire::Request& r, Host& host, Stop* stop) {
  // process() holds requests back behind a parked one, with the two exceptions it names; the
  // state machine clears the wait before the parked request runs again.
  const wire::Request* parked = kv_->parked(waiter_);
  TRUN_CHECK(parked == nullptr || r.op == Op::kCancelWait ||
                 (dialect_ == wire::Dialect::kV1 && parked->op == Op::kWait),
             "waiter " << waiter_ << " executes " << wire::op_name(r.op) << " while parked in "
                       << wire::op_name(parked->op));
  TRUN_CHECK(authenticated_ || is_handshake(r.op), "waiter " << waiter_ << " executes "
                                                             << wire::op_name(r.op)
                                                             << " before authenticating");
  wire::Encoder enc(&out_);
  switch (r.op) {
    case Op::kValidate:
      if (static_cast<uint32_t>(r.number) != wire::kValidationMagic) {
        return close("bad validation magic", stop);
      }
      return true;
    case Op::kAuthHello:
      challenge_ = options_.make_challenge ? options_.make_challenge() : auth::make_challenge();
      enc.bytes(challenge_);
      return true;
    case Op::kAuthProof: {
      bool ok =
          !challenge_.empty() &&
          auth::constant_time_equal(r.values[0], auth::hmac_sha256(options_.token, challenge_));
      challenge_.clear();
      if (!ok) {
        enc.u8(0);  // sent before the connection closes
        return close("wrong token", stop, true);
      }
      authenticated_ = true;
      enc.u8(1);
      return true;
    }
    case Op::kPing:
      enc.u32(static_cast<uint32_t>(r.number));
      return true;
    case Op::kCancelWait:
      if (kv_->parked(waiter_)) {
        kv_->cancel(waiter_);
        host.wait_cancelled();
      }
      enc.u8(wire::kWaitCanceled);
      return true;
    case Op::kWatchKey:
      // 1.13's callback socket; PyTorch itself never uses watches in its launcher. Confirmed with
      // KEY_CALLBACK_REGISTERED (the 1.13 C++ client's watchKey() blocks until it arrives) and
      // never notified.
      enc.u8(3);  // WatchResponseType::KEY_CALLBACK_REGISTERED
      return true;
    case Op::kLeaseArm:
    case Op::kLeaseRenew:
    case Op::kLeaseRelease:
    case Op::kLeaseFire: {
      std::string why;
      if (!host.lease(r, &out_, &why)) return close(std::move(why), stop);
      return true;
    }
    default:
      break;
  }
  KvState::Outcome outcome = kv_->execute(waiter_, r, &out_);
  switch (outcome.kind) {
    case KvState::Outcome::Kind::kReply:
      return true;
    case KvState::Outcome::Kind::kClose:
      return close(std::move(outcome.why), stop);
    case KvState::Outcome::Kind::kPark:
      host.parked(outcome);
      *stop = Stop::kBlocked;
      return false;
  }
  return true;
}

}  // namespace trun::store
