#pragma once
// PyTorch 1.13's own TCPStore server in a Python process of its own (torch_store_ops.py serve),
// for the compatibility tests, and why it cannot run here when it cannot.

#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <string>

#include "tests/store/compat/child_process.h"

namespace trun::test {

inline const std::string kTorchPython = "/usr/bin/python3";
inline const std::string kTorchStoreOps = TRUN_SOURCE_DIR "/tests/store/compat/torch_store_ops.py";

// Why PyTorch 1.13 cannot be used here, or empty when it can.
inline std::string torch_missing() {
  if (access(kTorchPython.c_str(), X_OK) != 0) return kTorchPython + " does not exist";
  if (access("/usr/lib/python3/dist-packages/torch/distributed/__init__.py", R_OK) != 0) {
    return "python3-torch (PyTorch 1.13 for " + kTorchPython + ") is not installed";
  }
  return "";
}

struct TorchServer {
  TorchServer() : process({kTorchPython, kTorchStoreOps, "serve"}) {
    using namespace std::chrono_literals;
    std::string line;
    REQUIRE(process.read_line(&line, 60s));
    REQUIRE(line.rfind("PORT ", 0) == 0);
    port = static_cast<uint16_t>(std::stoi(line.substr(5)));
  }
  ChildProcess process;
  uint16_t port = 0;
};

}  // namespace trun::test
