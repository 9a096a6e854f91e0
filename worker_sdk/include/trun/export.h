#pragma once
// TRUN_API marks what libtrun_worker exports: the classes and functions of the public headers
// (<trun/...>), nothing else. The library is compiled with -fvisibility=hidden and
// -fvisibility-inlines-hidden (worker_sdk/CMakeLists.txt), so everything without TRUN_API (the
// implementation under worker_sdk/src, the store client and server, and the Asio, spdlog, fmt,
// Gloo and JSON code instantiated in them) stays inside the library: no symbol of it can clash
// with another copy of those libraries in the same process (libtorch bundles its own Gloo).
//
// On a class it exports its out-of-line members, vtable and typeinfo (so an exception thrown by
// the library is caught by its type in the program); on a function, that function. Header-only
// types (plain option structs, enums, the abstract store::Store of <trun/store/store.h>) need
// none. The same attribute serves building the library and using it (ELF has no import side).

#define TRUN_API __attribute__((visibility("default")))

// TRUN_HIDDEN marks the private implementation types nested in exported classes (pimpl State,
// Impl): a nested class takes its enclosing class's visibility, which would export their
// out-of-line members too.
#define TRUN_HIDDEN __attribute__((visibility("hidden")))
