#pragma once
// Private to store/: the accept loop that the store server and the relay share. It owns the
// listening socket, hands each accepted connection to `adopt`, and takes up to a burst of
// connections per wake-up (a crowd connecting at once).
//
// When accept() fails (EMFILE and friends: nothing can be accepted until a descriptor frees up,
// and the listening socket stays readable meanwhile) it backs off instead of spinning: 10 ms,
// doubling up to 1 s, reset by the next accepted connection; one warn line per 5 s that says how
// many failures in a row it stands for, and one line when connections are accepted again.
// Existing connections keep being served meanwhile (docs/errors.md).
//
// Thread safety: listen() before the event loop runs; start() and close() on the event-loop
// thread (or before it runs). `adopt` runs on the event-loop thread. The acceptor must outlive
// nothing but its io_context's handlers, which close() ends (operation_aborted).

#include <boost/asio.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "store/log_limiter.h"

namespace trun::store {

class Acceptor {
 public:
  using Adopt = std::function<void(boost::asio::ip::tcp::socket)>;

  // `who` starts every log line and error ("store server", "store relay").
  Acceptor(boost::asio::io_context& io, std::string who);

  // Opens, binds and listens on `endpoint` (non-blocking, SO_REUSEADDR; `dual_stack`: an IPv6
  // endpoint takes IPv4 clients too, where the system allows). Returns the bound port; on
  // failure `ec` says why and the socket is not listening.
  uint16_t listen(const boost::asio::ip::tcp::endpoint& endpoint, int backlog, bool dual_stack,
                  boost::system::error_code& ec);

  // Accepts until close(), handing each connection to `adopt`.
  void start(Adopt adopt);
  void close();

  // The back-off bounds (docs/errors.md).
  static constexpr std::chrono::milliseconds kMinBackoff{10};
  static constexpr std::chrono::milliseconds kMaxBackoff{1000};

 private:
  void accept();
  void failed(const boost::system::error_code& ec);

  boost::asio::io_context& io_;
  std::string who_;
  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::steady_timer retry_timer_;
  Adopt adopt_;
  std::chrono::milliseconds backoff_ = kMinBackoff;
  uint64_t failures_ = 0;  // in a row
  LogLimiter log_{std::chrono::seconds(5)};
};

}  // namespace trun::store
