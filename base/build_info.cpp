#include "base/build_info.h"

#include "trun_build_commit.h"  // generated at build time: cmake/build_info.cmake

// Set by CMakeLists.txt (once every module is configured, so the features are known).
#ifndef TRUN_BUILD_VERSION
#error "TRUN_BUILD_VERSION must be defined by the build"
#endif

namespace trun::base {

namespace {

std::string compiler_name() {
#if defined(__clang__)
  return "Clang " __clang_version__;
#elif defined(__GNUC__)
  return "GCC " __VERSION__;
#else
  return "unknown compiler";
#endif
}

}  // namespace

const BuildInfo& build_info() {
  static const std::string compiler = compiler_name();
  static const BuildInfo info{TRUN_BUILD_VERSION,   TRUN_BUILD_COMMIT,     TRUN_BUILD_DIRTY != 0,
                              TRUN_BUILD_NCCL != 0, TRUN_BUILD_TORCH != 0, TRUN_BUILD_TYPE,
                              TRUN_BUILD_SANITIZE,  compiler.c_str()};
  return info;
}

std::string commit_text() {
  const BuildInfo& b = build_info();
  return std::string(b.commit) + (b.modified ? "-modified" : "");
}

std::string version_text() {
  const BuildInfo& b = build_info();
  std::string out = std::string("trun ") + b.version + " (torchrun-compatible)\n";
  out += "commit: " + commit_text() + "\n";
  out += "features: rendezvous c10d etcd static; CPU backend gloo + shared memory; NCCL ";
  out += b.nccl ? "yes" : "no";
  out += "; libtorch adapter ";
  out += b.libtorch ? "yes" : "no";
  out += "\nbuild: ";
  out += *b.build_type ? b.build_type : "(no build type)";
  out += std::string(", ") + b.compiler;
  if (*b.sanitizers) out += std::string(", sanitizers ") + b.sanitizers;
  out += "\n";
  return out;
}

}  // namespace trun::base
