// Loads the CUDA runtime and NCCL with dlopen (see gpu_libs.h). The dlopen calls must stay in
// libtrun_worker: dlopen searches the RUNPATH of the object that calls it, and libtrun_worker's
// names the CUDA library directory found at build time.

#include "worker_sdk/src/nccl/gpu_libs.h"

#include <dlfcn.h>
#include <link.h>

#include <cstdlib>

#include "trun/process_group.h"

// Two steps, so that a name the headers define as a macro is expanded first.
#define TRUN_GPU_STRINGIFY_(x) #x
#define TRUN_GPU_STRINGIFY(x) TRUN_GPU_STRINGIFY_(x)

namespace trun::worker::detail {
namespace {

// CUDA 12 and later name the runtime libcudart.so.<major>; CUDA 11 named it libcudart.so.11.0
// whatever the minor version, and earlier versions libcudart.so.<major>.<minor>.
std::string cudart_soname() {
  const int major = CUDART_VERSION / 1000, minor = CUDART_VERSION % 1000 / 10;
  std::string version = std::to_string(major);
  if (major == 11)
    version += ".0";
  else if (major < 11)
    version += "." + std::to_string(minor);
  return "libcudart.so." + version;
}

// One library: what dlopen looks for, the variable naming another file, and what the messages
// say it is and how to get it.
struct LibrarySpec {
  std::string soname;
  const char* override_variable;
  std::string what;     // "NCCL, which the NCCL backend needs"
  std::string install;  // "Install NCCL 2.14 or newer (...)"
};

LibrarySpec cudart_spec() {
  const std::string cuda = "CUDA " + std::to_string(CUDART_VERSION / 1000);
  return {cudart_soname(), "TRUN_CUDART_LIBRARY",
          "the " + cuda + " runtime, which the NCCL backend and CUDA buffers need",
          "Install the " + cuda + " runtime (NVIDIA's CUDA toolkit or its runtime package)"};
}

LibrarySpec nccl_spec() {
  return {"libnccl.so.2", "TRUN_NCCL_LIBRARY", "NCCL, which the NCCL backend needs",
          "Install NCCL 2.14 or newer (NVIDIA's libnccl2 package, say)"};
}

// With the override variable set, LD_LIBRARY_PATH is not searched: the advice differs.
std::string how_to_fix(const LibrarySpec& spec, bool overridden) {
  if (overridden)
    return spec.install + " and name its " + spec.soname + " in " + spec.override_variable +
           ", or unset " + spec.override_variable + " to search LD_LIBRARY_PATH and the system";
  return spec.install + ", or add the directory that holds " + spec.soname +
         " to LD_LIBRARY_PATH (or name the file in " + spec.override_variable + ")";
}

std::string last_dl_error() {
  const char* e = dlerror();
  return e ? e : "no detail from dlerror()";
}

// The file a handle was loaded from (LD_LIBRARY_PATH or the RUNPATH decided which), for the
// message about a missing function.
std::string loaded_from(void* handle) {
  link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name && *map->l_name)
    return map->l_name;
  return "unknown path";
}

// A library's table, or why it could not be loaded (then `error` is not empty).
template <typename Api>
struct Loaded {
  Api api;
  std::string error;
};

// Opens the library; `resolve(handle, api, missing)` fills the table and names the first
// function it could not find. The handle is never closed: the table points into it.
template <typename Api, typename Resolve>
Loaded<Api> load(const LibrarySpec& spec, Resolve resolve) {
  Loaded<Api> out;
  const char* chosen = std::getenv(spec.override_variable);
  const bool overridden = chosen && *chosen;
  const std::string file = overridden ? chosen : spec.soname;
  void* handle = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    out.error = "cannot load " + file +
                (overridden ? std::string(" (") + spec.override_variable + ")" : "") + ", " +
                spec.what + ": " + last_dl_error() + ". " + how_to_fix(spec, overridden);
    return out;
  }
  std::string missing;
  resolve(handle, out.api, missing);
  if (!missing.empty())
    out.error = file + " (loaded from " + loaded_from(handle) + "), " + spec.what + ", lacks " +
                missing + ": an older or incomplete library. " + how_to_fix(spec, overridden);
  return out;
}

// dlsym, recording the first name not found with dlerror()'s text.
void* symbol(void* handle, const char* name, std::string& missing) {
  dlerror();  // clear an earlier error, so that the one read below is dlsym's
  void* p = dlsym(handle, name);
  if (!p && missing.empty()) missing = std::string(name) + " (" + last_dl_error() + ")";
  return p;
}

#define TRUN_GPU_RESOLVE_OVERLOADED(name, type) TRUN_GPU_RESOLVE(name)
#define TRUN_GPU_RESOLVE(name) \
  api.name =                   \
      reinterpret_cast<decltype(api.name)>(symbol(handle, TRUN_GPU_STRINGIFY(name), missing));

// Function-local statics: loaded once, by the first caller, while any other waits. Never
// destroyed, so that a backend torn down during exit still finds its table.
const Loaded<CudaRuntimeApi>& cudart_state() {
  static const auto* loaded = new Loaded<CudaRuntimeApi>(load<CudaRuntimeApi>(
      cudart_spec(), [](void* handle, CudaRuntimeApi& api, std::string& missing) {
        TRUN_CUDART_FUNCTIONS(TRUN_GPU_RESOLVE, TRUN_GPU_RESOLVE_OVERLOADED)
      }));
  return *loaded;
}

const Loaded<NcclApi>& nccl_state() {
  static const auto* loaded = new Loaded<NcclApi>(
      load<NcclApi>(nccl_spec(), [](void* handle, NcclApi& api, std::string& missing) {
        TRUN_NCCL_FUNCTIONS(TRUN_GPU_RESOLVE, TRUN_GPU_RESOLVE_OVERLOADED)
      }));
  return *loaded;
}

#undef TRUN_GPU_RESOLVE
#undef TRUN_GPU_RESOLVE_OVERLOADED

template <typename Api>
bool loadable(const Loaded<Api>& loaded, std::string* why) {
  if (loaded.error.empty()) return true;
  if (why) *why = loaded.error;
  return false;
}

}  // namespace

const CudaRuntimeApi& cudart() {
  const auto& loaded = cudart_state();
  if (!loaded.error.empty()) throw CollectiveError(loaded.error);
  return loaded.api;
}

const NcclApi& nccl() {
  const auto& loaded = nccl_state();
  if (!loaded.error.empty()) throw CollectiveError(loaded.error);
  return loaded.api;
}

bool cudart_loadable(std::string* why) { return loadable(cudart_state(), why); }
bool nccl_loadable(std::string* why) { return loadable(nccl_state(), why); }

}  // namespace trun::worker::detail
