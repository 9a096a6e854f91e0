// GlooComm::abort(): two Gloo participants in this process (one thread each, real TCP sockets on
// loopback, an in-process store for Gloo's rendezvous). One blocks in an allreduce that its peer
// never joins; abort() from another thread must end it long before its deadline.

#include "worker_sdk/src/cpu/gloo_comm.h"

#include <catch2/catch.hpp>
#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "store/in_memory_store.h"

using namespace trun::worker;
using namespace trun::worker::detail;
using namespace std::chrono_literals;

namespace {

// Both participants connected (their constructors block until the full mesh exists).
std::vector<std::unique_ptr<GlooComm>> connect_pair(trun::store::Store& store) {
  std::vector<std::unique_ptr<GlooComm>> comms(2);
  std::exception_ptr errors[2];
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        comms[r] = std::make_unique<GlooComm>(store, r, 2, "127.0.0.1", Clock::now() + 30s);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return comms;
}

struct Outcome {
  bool threw = false;
  bool timeout = false;  // CollectiveTimeoutError
  std::string what;
  double seconds = 0;
};

Outcome run_allreduce(GlooComm& comm, std::vector<float>& buf, std::chrono::seconds limit) {
  Outcome out;
  auto t0 = Clock::now();
  try {
    comm.allreduce(buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum, t0 + limit);
  } catch (const CollectiveTimeoutError& e) {
    out.threw = out.timeout = true;
    out.what = e.what();
  } catch (const CollectiveError& e) {
    out.threw = true;
    out.what = e.what();
  }
  out.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return out;
}

}  // namespace

TEST_CASE("abort() ends a Gloo allreduce that waits for a peer that never joins",
          "[worker_sdk][gloo][failures]") {
  trun::store::InMemoryStore store;
  auto comms = connect_pair(store);
  std::vector<float> buf(1 << 16, 1.0f);

  // Rank 0 waits for rank 1, which never calls allreduce; the deadline is 120 s away, so a
  // failure within 60 s (the test's bound) comes from abort(), not from the deadline.
  Outcome out;
  std::thread blocked([&] { out = run_allreduce(*comms[0], buf, 120s); });
  std::this_thread::sleep_for(300ms);
  comms[0]->abort("test: stop the job");
  blocked.join();
  INFO(out.what);
  REQUIRE(out.threw);
  CHECK_FALSE(out.timeout);
  CHECK(out.what.find("aborted: test: stop the job") != std::string::npos);
  CHECK(out.what.find("allreduce") != std::string::npos);
  CHECK(out.seconds < 60);

  // Later collectives on the aborted side fail at once with the same reason.
  Outcome again = run_allreduce(*comms[0], buf, 120s);
  INFO(again.what);
  REQUIRE(again.threw);
  CHECK(again.what.find("aborted: test: stop the job") != std::string::npos);

  // The peer sees its connection closed: its next collective fails, without waiting for the
  // deadline either.
  Outcome peer = run_allreduce(*comms[1], buf, 120s);
  INFO(peer.what);
  REQUIRE(peer.threw);
  CHECK_FALSE(peer.timeout);
  CHECK(peer.seconds < 60);

  // A second abort() is a no-op (the first reason stays).
  comms[0]->abort("another reason");
  Outcome third = run_allreduce(*comms[0], buf, 120s);
  CHECK(third.what.find("test: stop the job") != std::string::npos);
}

TEST_CASE("abort() ends a Gloo barrier and broadcast the same way",
          "[worker_sdk][gloo][failures]") {
  trun::store::InMemoryStore store;
  auto comms = connect_pair(store);
  SECTION("barrier") {
    std::string what;
    std::thread blocked([&] {
      try {
        comms[1]->barrier(Clock::now() + 120s);
      } catch (const CollectiveError& e) {
        what = e.what();
      }
    });
    std::this_thread::sleep_for(300ms);
    comms[1]->abort("barrier abort");
    blocked.join();
    CHECK(what.find("barrier failed on node rank 1 (gloo): aborted: barrier abort") !=
          std::string::npos);
  }
  SECTION("broadcast from the absent root") {
    std::vector<char> data(1 << 20, 'x');
    std::string what;
    std::thread blocked([&] {
      try {
        comms[1]->broadcast(data.data(), data.size(), 0, Clock::now() + 120s);
      } catch (const CollectiveError& e) {
        what = e.what();
      }
    });
    std::this_thread::sleep_for(300ms);
    comms[1]->abort("broadcast abort");
    blocked.join();
    CHECK(what.find("aborted: broadcast abort") != std::string::npos);
  }
}
