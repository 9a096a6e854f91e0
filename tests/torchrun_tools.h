#pragma once
// What tests that launch PyTorch's own torchrun (1.13, Debian's python3-torch) need: where it is,
// and why it cannot run here (empty when it can), for a TRUN_SKIP(..., kSetup).

#include <unistd.h>

#include <chrono>
#include <string>

#include "tests/launcher/process_util.h"

namespace trun::testing {

inline constexpr const char* kPython = "/usr/bin/python3";
inline constexpr const char* kTorchrun = "/usr/bin/torchrun";

inline std::string torch_missing() {
  if (::access(kTorchrun, X_OK) != 0) return std::string(kTorchrun) + " is not installed";
  Child c({kPython, "-c", "import torch.distributed.run"});
  if (!c.wait(std::chrono::seconds(60)) || c.exit_code() != 0) {
    return std::string(kPython) + " cannot import torch.distributed.run: " + c.err();
  }
  return "";
}

}  // namespace trun::testing
