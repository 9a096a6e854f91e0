// Helper process for rendezvous tests: one agent's rendezvous, nothing else. Joins a dynamic
// rendezvous whose store (c10d, the default) or etcd (BACKEND etcd) is on 127.0.0.1:PORT, prints
// one line per completed round and per round event, and rejoins after each event until stdin
// closes or the rendezvous closes.
//
//   rdzv_test_node PORT RUN_ID MIN MAX NODE_ID [KEEP_ALIVE_MS [BACKEND [LAST_CALL_MS]]]
//
// Lines: "ranked <round> <rank> <world>", "event <kind-number> <node> <detail>", "closed",
// "error <what>".
#include <poll.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "rendezvous/handler.h"
#include "tests/rendezvous/test_options.h"

using namespace trun::rendezvous;
using namespace trun::store;
using namespace std::chrono_literals;

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr,
                 "usage: %s PORT RUN_ID MIN MAX NODE_ID [KEEP_ALIVE_MS [BACKEND [LAST_CALL_MS]]]\n",
                 argv[0]);
    return 2;
  }
  const std::string backend = argc > 7 ? argv[7] : "c10d";
  auto o = trun::testing::fast_rdzv_options(std::string("127.0.0.1:") + argv[1], argv[2], argv[5],
                                            std::atoi(argv[3]), std::atoi(argv[4]));
  if (backend == "c10d") o.is_host = false;  // etcd: nobody hosts anything
  if (argc > 6) o.keep_alive_interval = std::chrono::milliseconds(std::atoi(argv[6]));
  if (argc > 8) o.last_call_timeout = std::chrono::milliseconds(std::atoi(argv[8]));
  setvbuf(stdout, nullptr, _IOLBF, 0);
  spdlog::set_default_logger(spdlog::stderr_color_mt("node"));  // stdout carries results
  try {
    auto h = create_rendezvous_handler(backend, o);
    for (int rounds = 0; rounds < 20; ++rounds) {
      auto info = h->next_rendezvous();
      std::printf("ranked %lld %d %d\n", static_cast<long long>(info.round), info.group_rank,
                  info.group_world_size);
      for (;;) {
        // Stop when the parent closes our stdin.
        pollfd p{0, POLLIN, 0};
        if (::poll(&p, 1, 0) > 0) {
          char c;
          if (::read(0, &c, 1) <= 0) {
            h->shutdown();
            return 0;
          }
        }
        auto e = h->wait_round_over(100ms);
        if (!e) continue;
        std::printf("event %d %s %s\n", static_cast<int>(e->kind), e->node_id.c_str(),
                    e->detail.c_str());
        break;
      }
    }
  } catch (const RendezvousClosedError& e) {
    std::printf("closed\n");
    return 0;
  } catch (const std::exception& e) {
    std::printf("error %s\n", e.what());
    return 1;
  }
  return 0;
}
