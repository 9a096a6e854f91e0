#include "store/relay_client.h"

#include <utility>

namespace trun::store::relay_detail {

namespace asio = boost::asio;
using asio::ip::tcp;
using wire::Op;

namespace {
// A client with a request passed to the store (or a wait) stops being read once this much
// unprocessed input has piled up behind it.
constexpr size_t kMaxBufferedBehindRequest = 1 << 20;
}  // namespace

Client::Client(RelayHost* relay, tcp::socket socket, uint64_t id)
    : relay_(relay),
      socket_(std::move(socket)),
      id_(id),
      wait_timer_(relay->io()),
      lease_timer_(relay->io()) {
  boost::system::error_code ec;
  socket_.set_option(tcp::no_delay(true), ec);
  socket_.non_blocking(true, ec);
}

bool Client::output_full() const {
  return out_.size() + writing_.size() > relay_->options().max_pending_output;
}

void Client::read() {
  if (closed_ || reading_) return;
  // Back-pressure, as the store's: a client that does not read its replies, or that pipelines
  // requests faster than they come back from the store, stops being read from.
  if (output_full()) return;
  if (in_.size() > kMaxBufferedBehindRequest && (busy_ || wait_id_ != 0)) return;
  reading_ = true;
  socket_.async_wait(
      tcp::socket::wait_read,
      [self = shared_from_this()](const boost::system::error_code& ec) { self->on_read(ec); });
}

void Client::on_read(boost::system::error_code ec) {
  reading_ = false;
  if (closed_) return;
  if (!ec) {
    auto& buffer = relay_->buffer();
    size_t n = socket_.read_some(asio::buffer(buffer), ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) {
      read();
      return;
    }
    if (!ec) in_.append(buffer.data(), n);
  }
  if (ec) {
    close(ec == asio::error::eof || ec == asio::error::connection_reset ? ""
                                                                        : "read: " + ec.message());
    return;
  }
  process();
  read();
}

void Client::process() {
  size_t offset = 0;
  while (!closed_ && !busy_) {
    std::string_view pending(in_.data() + offset, in_.size() - offset);
    if (pending.empty()) break;
    // Per request: nothing more is passed on while the client's unsent replies are over the
    // limit; the write completion goes on from here.
    if (output_full()) break;
    if (dialect_ == wire::Dialect::kUnknown) {
      dialect_ = wire::detect_dialect(pending);
      if (dialect_ == wire::Dialect::kUnknown) break;
      if (dialect_ != wire::Dialect::kV2) {
        close("PyTorch 1.13's dialect is not relayed (connect to the store itself)");
        break;
      }
    }
    wire::Request r;
    auto result = wire::decode(pending, dialect_, relay_->options().limits, &r);
    if (result.status == wire::Status::kNeedMore) break;
    if (result.status == wire::Status::kMalformed) {
      close("malformed request: " + result.error);
      break;
    }
    // Behind a wait only its cancellation is read.
    if (wait_id_ != 0 && r.op != Op::kCancelWait) break;
    offset += result.consumed;
    if (r.op != Op::kValidate) relay_->count_request();
    if (!execute(r, pending.substr(0, result.consumed))) break;
  }
  in_.erase(0, offset);
  flush();
}

bool Client::execute(wire::Request& r, std::string_view raw) {
  wire::Encoder enc(&out_);
  auto pass = [&](Answer::Kind kind, size_t count = 0) {
    busy_ = true;
    Answer a;
    a.kind = kind;
    a.count = count;
    relay_->pass(id_, raw, a);
    return false;
  };
  switch (r.op) {
    case Op::kValidate:
      if (static_cast<uint32_t>(r.number) != wire::kValidationMagic) {
        close("bad validation magic");
        return false;
      }
      return true;
    case Op::kPing:
      enc.u32(static_cast<uint32_t>(r.number));
      return true;
    case Op::kSet:
    case Op::kAppend:
    case Op::kMultiSet:
      relay_->pass_unanswered(raw);
      unfenced_writes_ = true;
      return true;
    case Op::kCompareSet:
    case Op::kGet:
      return pass(Answer::Kind::kBytes);
    case Op::kAdd:
    case Op::kDeleteKey:
    case Op::kNumKeys:
      return pass(Answer::Kind::kI64);
    case Op::kCheck:
      return pass(Answer::Kind::kU8);
    case Op::kMultiGet:
      if (r.keys.empty()) return true;  // nothing to answer
      return pass(Answer::Kind::kList, r.keys.size());
    case Op::kWait:
    case Op::kWaitKeys:
    case Op::kGetWait: {
      if (r.op == Op::kGetWait && r.keys.size() != 1) {
        close("GET_TIMEOUT with " + std::to_string(r.keys.size()) + " keys");
        return false;
      }
      if (r.op != Op::kWait && r.number == 0) {  // a look, not a wait: the store answers it
        return pass(r.op == Op::kGetWait ? Answer::Kind::kStatusValue : Answer::Kind::kU8);
      }
      if (unfenced_writes_) {
        busy_ = true;
        fenced_wait_ = r;
        relay_->fence(id_);
        return false;
      }
      if (!start_wait(r)) return false;
      return true;  // parked: process() reads only a CANCEL_WAIT behind it
    }
    case Op::kCancelWait:
      if (wait_id_ != 0) end_wait();
      enc.u8(wire::kWaitCanceled);
      return true;
    case Op::kLeaseArm:
      if (r.number < 0) {
        close("LEASE_ARM with a negative ttl");
        return false;
      }
      if (!r.keys[0].empty()) {
        std::string set;
        wire::Encoder(&set).query(Op::kSet).bytes(r.keys[0]).bytes(r.values[0]);
        relay_->pass_unanswered(set);
        unfenced_writes_ = true;
      }
      lease_ = std::move(r);
      lease_ttl_ = lease_.number;
      lease_armed_ = true;
      relay_->cover(lease_);
      arm_lease_timer();
      enc.u8(1);
      return true;
    case Op::kLeaseRenew:
      if (lease_armed_ && r.number > 0) lease_ttl_ = r.number;
      if (lease_armed_) arm_lease_timer();
      enc.u8(lease_armed_ ? 1 : 0);
      return true;
    case Op::kLeaseRelease: {
      const bool was = lease_armed_;
      lease_armed_ = false;
      ++lease_generation_;
      boost::system::error_code ec;
      lease_timer_.cancel(ec);
      enc.u8(was ? 1 : 0);
      return true;
    }
    default:
      close(std::string("a relay does not serve ") + wire::op_name(r.op) +
            " (connect to the store itself)");
      return false;
  }
}

bool Client::start_wait(const wire::Request& r) {
  wait_id_ = relay_->wait(id_, r.op == Op::kGetWait, r.keys, &wait_sig_);
  if (wait_id_ == 0) {
    close("the store does not take another wait connection");
    return false;
  }
  // A timeout over kMaxWaitTimeoutMs means none (a deadline that far out would overflow).
  if (r.op != Op::kWait && r.number > 0 && r.number <= wire::kMaxWaitTimeoutMs) {
    wait_timer_.expires_after(std::chrono::milliseconds(r.number));
    wait_timer_.async_wait(
        [self = shared_from_this(), id = wait_id_](const boost::system::error_code& ec) {
          if (ec || self->closed_ || self->wait_id_ != id) return;
          self->end_wait();
          const uint8_t timed_out = wire::kWaitTimedOut;
          self->answer(std::string_view(reinterpret_cast<const char*>(&timed_out), 1));
        });
  }
  return true;
}

void Client::fenced() {
  if (closed_) return;
  busy_ = false;
  unfenced_writes_ = false;
  if (!start_wait(fenced_wait_)) return;
  process();
  flush();
  read();
}

void Client::end_wait() {
  relay_->leave_wait(wait_sig_, id_);
  wait_id_ = 0;
  wait_sig_.clear();
  boost::system::error_code ec;
  wait_timer_.cancel(ec);
}

void Client::answer(std::string_view bytes, bool in_order) {
  if (closed_) return;
  busy_ = false;
  if (in_order) unfenced_writes_ = false;
  out_.append(bytes);
  process();  // what queued up behind the request
  flush();
  read();
}

void Client::wait_done(uint64_t wait_id, std::string_view bytes) {
  if (closed_ || wait_id != wait_id_) return;
  wait_id_ = 0;
  wait_sig_.clear();
  boost::system::error_code ec;
  wait_timer_.cancel(ec);
  const bool going_away = !bytes.empty() && static_cast<uint8_t>(bytes[0]) == wire::kWaitGoingAway;
  answer(bytes);
  if (going_away) close("");
}

void Client::arm_lease_timer() {
  const uint64_t generation = ++lease_generation_;
  boost::system::error_code ec;
  lease_timer_.cancel(ec);
  if (lease_ttl_ <= 0) return;  // bound to the connection only
  lease_timer_.expires_after(std::chrono::milliseconds(lease_ttl_));
  lease_timer_.async_wait(
      [self = shared_from_this(), generation](const boost::system::error_code& ec) {
        if (ec || self->closed_ || !self->lease_armed_ || self->lease_generation_ != generation) {
          return;
        }
        self->fire_lease();
      });
}

void Client::fire_lease() {
  if (!lease_armed_) return;
  lease_armed_ = false;
  ++lease_generation_;
  relay_->fire(lease_);
}

void Client::flush() {
  if (closed_ || writing_now_ || out_.empty()) return;
  writing_now_ = true;
  writing_.swap(out_);
  out_.clear();
  asio::async_write(socket_, asio::buffer(writing_),
                    [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                      self->writing_now_ = false;
                      self->writing_.clear();
                      if (self->closed_) return;
                      if (ec) {
                        self->close("write: " + ec.message());
                        return;
                      }
                      self->process();  // what back-pressure held back (flushes)
                      self->flush();
                      self->read();
                    });
}

void Client::close(const std::string& why) {
  if (closed_) return;
  closed_ = true;
  if (!why.empty())
    relay_->warn("closing the connection of client " + std::to_string(id_) + ": " + why);
  if (wait_id_ != 0) end_wait();
  // The agent is gone: the store hears it as from a closed connection. Not when the relay stops:
  // its own lease tells the store once for all of them.
  if (!relay_->stopping()) fire_lease();
  boost::system::error_code ec;
  lease_timer_.cancel(ec);
  socket_.close(ec);
  relay_->forget(id_);
}

}  // namespace trun::store::relay_detail
