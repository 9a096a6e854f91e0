// PyTorch 1.13's own TCPStore clients against trun's store, with PyTorch's own TCPStore server as
// the oracle: the same scenario runs against both servers (at the same time, in separate
// processes) and every step's result must be the same. The scenarios live in torch_store_ops.py
// (Python client) and torch_check_client.cpp (C++ client, for check(), which the 1.13 Python
// binding lacks).
//
// Not labelled no_sanitize: the clients are separate, uninstrumented processes (exec replaces the
// sanitized image), and the server under test runs instrumented, in this process or as the
// `trun store` binary of the same build, which is exactly what the ASan run should exercise.
#include <unistd.h>
#include <catch2/catch.hpp>
#include <chrono>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "store/server.h"
#include "tests/skip.h"
#include "tests/store/compat/child_process.h"
#include "tests/store/compat/torch_server.h"

namespace {

using namespace std::chrono_literals;
using trun::store::StoreServer;
using trun::store::StoreServerOptions;
using trun::test::ChildProcess;

using trun::test::torch_missing;
using trun::test::TorchServer;
const std::string& kPython = trun::test::kTorchPython;
const std::string& kScript = trun::test::kTorchStoreOps;

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> lines;
  std::istringstream in(s);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// `trun store --port 0` from this build.
struct TrunStoreBinary {
  TrunStoreBinary()
      : process({TRUN_BINARY_DIR "/launcher/trun", "store", "--host", "127.0.0.1", "--port", "0"}) {
    std::string line;
    REQUIRE(process.read_line(&line, 30s));
    auto colon = line.rfind(':');
    REQUIRE(line.find("listening on 127.0.0.1:") != std::string::npos);
    port = std::stoi(line.substr(colon + 1));
  }
  ~TrunStoreBinary() {
    // Stops on SIGTERM; a clean exit code shows the sanitizers found nothing at shutdown.
    kill(process.pid(), SIGTERM);
    bool exited = process.wait_exit(30s);
    CHECK(exited);
    if (exited) CHECK(process.exit_code() == 0);
  }
  ChildProcess process;
  int port = 0;
};

std::unique_ptr<StoreServer> start_trun_server() {
  StoreServerOptions opts;
  opts.host = "127.0.0.1";
  return StoreServer::start(opts);
}

// Runs a client scenario to its end and returns its lines.
std::vector<std::string> finish(ChildProcess& client) {
  std::string out;
  bool done = client.read_all(&out, 180s);
  INFO(out);
  REQUIRE(done);
  REQUIRE(client.wait_exit(30s));
  REQUIRE(client.exit_code() == 0);
  auto lines = split_lines(out);
  REQUIRE(!lines.empty());
  REQUIRE(lines.back().rfind("END ", 0) == 0);
  return lines;
}

void compare(const std::vector<std::string>& torch, const std::vector<std::string>& trun,
             const std::string& what) {
  INFO("server: " << what);
  REQUIRE(trun.size() == torch.size());
  for (size_t i = 0; i < torch.size(); ++i) {
    INFO("step " << i);
    CHECK(trun[i] == torch[i]);
  }
}

bool wait_connections(StoreServer& server, size_t n) {
  for (int i = 0; i < 1000 && server.num_connections() != n; ++i) std::this_thread::sleep_for(10ms);
  return server.num_connections() == n;
}

TEST_CASE("PyTorch 1.13 Python clients get PyTorch's own results from trun's store",
          "[store][compat][torch]") {
  if (auto why = torch_missing(); !why.empty()) TRUN_SKIP(why, kSetup);
  TorchServer oracle;
  auto in_process = start_trun_server();
  TrunStoreBinary binary;
  auto client = [](int port) {
    return std::make_unique<ChildProcess>(
        std::vector<std::string>{kPython, kScript, "client", "127.0.0.1", std::to_string(port)});
  };
  // The three runs take the same time (their waits time out), so they run side by side.
  auto on_torch = client(oracle.port);
  auto on_trun = client(in_process->port());
  auto on_binary = client(binary.port);
  auto expected = finish(*on_torch);
  auto got = finish(*on_trun);
  auto got_binary = finish(*on_binary);
  CHECK(expected.size() > 60);  // the whole scenario ran
  compare(expected, got, "StoreServer in process");
  compare(expected, got_binary, "trun store binary");
  // The clients (including their idle 1.13 callback connections) are gone, and so are their
  // connections on the server.
  CHECK(wait_connections(*in_process, 0));
}

TEST_CASE("PyTorch 1.13's C++ client gets PyTorch's own check() results from trun's store",
          "[store][compat][torch]") {
  std::string client_path = TRUN_TORCH_CHECK_CLIENT;
  if (client_path.empty()) TRUN_SKIP(TRUN_TORCH_CHECK_CLIENT_WHY, kSetup);
  if (auto why = torch_missing(); !why.empty()) TRUN_SKIP(why, kSetup);
  TorchServer oracle;
  auto server = start_trun_server();
  ChildProcess on_torch({client_path, "127.0.0.1", std::to_string(oracle.port)});
  ChildProcess on_trun({client_path, "127.0.0.1", std::to_string(server->port())});
  auto expected = finish(on_torch);
  auto got = finish(on_trun);
  CHECK(expected.size() > 15);
  compare(expected, got, "StoreServer in process");
  CHECK(wait_connections(*server, 0));
}

}  // namespace
