#pragma once
// Which sanitizer this test executable was built with (GCC's predefined macros), for the few
// cases that run less under ThreadSanitizer and say why next to it.

namespace trun::testing {

#if defined(__SANITIZE_THREAD__)
inline constexpr bool kThreadSanitizer = true;
#else
inline constexpr bool kThreadSanitizer = false;
#endif

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitizer = true;  // e.g. an address-space limit would break its shadow
#else
inline constexpr bool kSanitizer = false;
#endif

}  // namespace trun::testing
