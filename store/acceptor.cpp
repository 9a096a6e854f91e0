#include "store/acceptor.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

namespace trun::store {

namespace asio = boost::asio;
using asio::ip::tcp;

namespace {
// Connections taken per wake-up of the listening socket.
constexpr int kAcceptBurst = 256;
}  // namespace

Acceptor::Acceptor(asio::io_context& io, std::string who)
    : io_(io), who_(std::move(who)), acceptor_(io), retry_timer_(io) {}

uint16_t Acceptor::listen(const tcp::endpoint& endpoint, int backlog, bool dual_stack,
                          boost::system::error_code& ec) {
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec && dual_stack && endpoint.protocol() == tcp::v6()) {
    acceptor_.set_option(asio::ip::v6_only(false), ec);
    ec.clear();  // where it is not allowed, IPv6 only
  }
  if (!ec) acceptor_.bind(endpoint, ec);
  if (!ec) acceptor_.listen(backlog, ec);
  if (!ec) acceptor_.non_blocking(true, ec);  // the accept burst must not block
  if (ec) return 0;
  return acceptor_.local_endpoint(ec).port();
}

void Acceptor::start(Adopt adopt) {
  adopt_ = std::move(adopt);
  accept();
}

void Acceptor::close() {
  boost::system::error_code ec;
  acceptor_.close(ec);
  retry_timer_.cancel(ec);
}

void Acceptor::accept() {
  acceptor_.async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
    if (ec) {
      failed(ec);
      return;
    }
    if (failures_ > 0) {
      spdlog::warn("{}: accepting connections again after {} failed accept(s)", who_, failures_);
      failures_ = 0;
      backoff_ = kMinBackoff;
    }
    adopt_(std::move(socket));
    // More may be waiting in the backlog: take them without a round trip through the loop.
    for (int i = 1; i < kAcceptBurst && acceptor_.is_open(); ++i) {
      boost::system::error_code more;
      tcp::socket next(io_);
      acceptor_.accept(next, more);
      if (more) break;
      adopt_(std::move(next));
    }
    accept();
  });
}

void Acceptor::failed(const boost::system::error_code& ec) {
  ++failures_;
  uint64_t held = 0;
  if (log_.allow(std::chrono::steady_clock::now(), &held)) {
    spdlog::warn(
        "{}: accept failed: {} ({} in a row{}); retrying in {} ms, existing connections are still "
        "served",
        who_, ec.message(), failures_,
        held ? ", " + std::to_string(held) + " not logged" : std::string(), backoff_.count());
  }
  retry_timer_.expires_after(backoff_);
  backoff_ = std::min(backoff_ * 2, kMaxBackoff);
  retry_timer_.async_wait([this](const boost::system::error_code& wait_ec) {
    if (wait_ec || !acceptor_.is_open()) return;
    accept();
  });
}

}  // namespace trun::store
