#include "store/event_loop.h"

#include <spdlog/spdlog.h>

#include <exception>

namespace trun::store {

void run_event_loop(boost::asio::io_context& io, const char* who) {
  for (;;) {  // ends when the loop runs out of work; each turn is one escaped exception
    try {
      io.run();
      return;
    } catch (const std::exception& e) {
      spdlog::error("{}: unexpected error in event loop: {}", who, e.what());
    }
  }
}

}  // namespace trun::store
