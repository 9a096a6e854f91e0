#pragma once
// Shared-secret authentication for the store: HMAC-SHA256 over a server-chosen random challenge.
// The token never crosses the wire. Pure functions; thread-safe.

#include <string>
#include <string_view>

namespace trun::store::auth {

inline constexpr size_t kChallengeBytes = 32;

std::string sha256(std::string_view data);                            // 32 raw bytes
std::string hmac_sha256(std::string_view key, std::string_view msg);  // 32 raw bytes
// A fresh challenge from the OS's random source.
std::string make_challenge();
// Compares in time that depends only on the lengths, never on where the first difference is.
bool constant_time_equal(std::string_view a, std::string_view b);

}  // namespace trun::store::auth
