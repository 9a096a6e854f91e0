// One strict decimal-integer parser for options, environment variables and values read back from
// the store, so that every caller rejects the same texts ("4x", "", "0x10", "1e3", overflow) and
// words the range the same way.
//
// Thread-safe, no allocation except the error text, never throws.
#pragma once

#include <cctype>
#include <charconv>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>

namespace trun::base {

// What may come before the digits. The default is the strictest: an optional '-' (signed types
// only) and nothing else. The two options reproduce what strtol() accepts, for callers whose
// inputs always took it (the whole text must still be the number).
struct DecimalSyntax {
  bool plus = false;           // a leading '+'
  bool leading_space = false;  // leading isspace() characters (' ', '\t', '\n', ...)
};

enum class DecimalStatus {
  kOk,
  kNotAnInteger,  // empty, a character that is not part of a number, or trailing text
  kOutOfRange,    // a number, but not representable in the target type
};

// The status, testable as a bool: `if (!parse_decimal(s, &n)) ...`.
struct DecimalResult {
  DecimalStatus status;
  explicit operator bool() const { return status == DecimalStatus::kOk; }
};

// Parses all of `text` as a base-10 integer of type T. On success stores it in *out; on failure
// leaves *out unchanged.
template <typename T>
DecimalResult parse_decimal(std::string_view text, T* out, DecimalSyntax syntax = {}) {
  static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>, "an integer type");
  size_t i = 0;
  if (syntax.leading_space) {
    while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  }
  if (syntax.plus && i < text.size() && text[i] == '+') {
    ++i;
    // "+-5" is not a number (from_chars alone would take the "-5").
    if (i == text.size() || text[i] == '-') return {DecimalStatus::kNotAnInteger};
  }
  const char* first = text.data() + i;
  const char* last = text.data() + text.size();
  if (first == last) return {DecimalStatus::kNotAnInteger};
  T value{};
  auto [p, ec] = std::from_chars(first, last, value);
  if (ec == std::errc::result_out_of_range) {
    // The digits run to the end, but the value does not fit: "99999999999999999999".
    return {p == last ? DecimalStatus::kOutOfRange : DecimalStatus::kNotAnInteger};
  }
  if (ec != std::errc() || p != last) return {DecimalStatus::kNotAnInteger};
  *out = value;
  return {DecimalStatus::kOk};
}

// Parses `text` as an integer in [lo, hi]. On failure returns nullopt and sets *error to a text
// naming the value and the range, for the caller to prefix with what it is ("RANK=" + *error):
//   "'<text>' is not an integer"         (not a number, or beyond long long)
//   "<text> is outside [<lo>, <hi>]"     (a number, out of bounds)
std::optional<long long> parse_decimal_in(std::string_view text, long long lo, long long hi,
                                          std::string* error, DecimalSyntax syntax = {});

}  // namespace trun::base
