#pragma once
// Private to store/: the event-loop thread's body for the store server and the relay.

#include <boost/asio/io_context.hpp>

namespace trun::store {

// Runs `io` until it runs out of work. A handler must never throw; if one does, the exception is
// logged ("<who>: unexpected error in event loop: ...") and the loop goes on serving the others.
void run_event_loop(boost::asio::io_context& io, const char* who);

}  // namespace trun::store
