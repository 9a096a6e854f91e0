// base/decimal.h: the one strict decimal parser.
#include "base/decimal.h"

#include <catch2/catch.hpp>
#include <climits>
#include <cstdint>
#include <string>

using trun::base::DecimalStatus;
using trun::base::DecimalSyntax;
using trun::base::parse_decimal;
using trun::base::parse_decimal_in;

namespace {

template <typename T>
DecimalStatus status_of(const std::string& text, DecimalSyntax syntax = {}) {
  T v{};
  return parse_decimal(text, &v, syntax).status;
}

}  // namespace

TEST_CASE("decimal: the whole text is the number, in the target type", "[decimal]") {
  int v = 7;
  REQUIRE(parse_decimal("42", &v));
  CHECK(v == 42);
  REQUIRE(parse_decimal("-17", &v));
  CHECK(v == -17);
  int64_t big = 0;
  REQUIRE(parse_decimal("9223372036854775807", &big));
  CHECK(big == INT64_MAX);
  REQUIRE(parse_decimal("-9223372036854775808", &big));
  CHECK(big == INT64_MIN);
  uint16_t port = 0;
  REQUIRE(parse_decimal("65535", &port));
  CHECK(port == 65535);
}

TEST_CASE("decimal: texts that are not a number are refused and leave the output alone",
          "[decimal]") {
  for (const char* text : {"", "-", "+", "4x", "x4", " 4", "4 ", "0x10", "1e3", "1.5", "--1", "+5",
                           "\t5", "5\n", "+-5"}) {
    INFO("text '" << text << "'");
    int v = 99;
    CHECK(parse_decimal(text, &v).status == DecimalStatus::kNotAnInteger);
    CHECK(v == 99);
  }
  CHECK(status_of<unsigned>("-1") == DecimalStatus::kNotAnInteger);
}

TEST_CASE("decimal: a number beyond the type is out of range, not wrapped", "[decimal]") {
  CHECK(status_of<int>("2147483648") == DecimalStatus::kOutOfRange);
  CHECK(status_of<int>("-2147483649") == DecimalStatus::kOutOfRange);
  CHECK(status_of<uint16_t>("65536") == DecimalStatus::kOutOfRange);
  CHECK(status_of<long long>("99999999999999999999") == DecimalStatus::kOutOfRange);
  CHECK(status_of<int>("2147483647") == DecimalStatus::kOk);
}

TEST_CASE("decimal: strtol's leading '+' and spaces only when the caller asks for them",
          "[decimal]") {
  const DecimalSyntax lenient{true, true};
  int v = 0;
  REQUIRE(parse_decimal("+5", &v, DecimalSyntax{true, false}));
  CHECK(v == 5);
  REQUIRE(parse_decimal(" \t\n-3", &v, DecimalSyntax{false, true}));
  CHECK(v == -3);
  REQUIRE(parse_decimal("  +8", &v, lenient));
  CHECK(v == 8);
  CHECK(status_of<int>("+5", DecimalSyntax{false, true}) == DecimalStatus::kNotAnInteger);
  CHECK(status_of<int>(" 5", DecimalSyntax{true, false}) == DecimalStatus::kNotAnInteger);
  // Still the whole text, one sign, no space after the sign.
  for (const char* text : {"+-5", "-+5", "++5", "+ 5", "5 ", "   ", "+"}) {
    INFO("text '" << text << "'");
    CHECK(status_of<int>(text, lenient) == DecimalStatus::kNotAnInteger);
  }
  CHECK(status_of<unsigned>("+7", lenient) == DecimalStatus::kOk);
}

TEST_CASE("decimal: a bounded value names the text and the range when refused", "[decimal]") {
  std::string error;
  CHECK(parse_decimal_in("8", 0, 8, &error) == 8);
  CHECK(parse_decimal_in("0", 0, 8, &error) == 0);
  CHECK(error.empty());
  CHECK_FALSE(parse_decimal_in("9", 0, 8, &error));
  CHECK(error == "9 is outside [0, 8]");
  CHECK_FALSE(parse_decimal_in("-1", 0, 8, &error));
  CHECK(error == "-1 is outside [0, 8]");
  CHECK_FALSE(parse_decimal_in("4x", 0, 8, &error));
  CHECK(error == "'4x' is not an integer");
  CHECK_FALSE(parse_decimal_in("99999999999999999999", 0, LLONG_MAX, &error));
  CHECK(error == "'99999999999999999999' is not an integer");
  CHECK(parse_decimal_in("+3", 1, 65535, &error, DecimalSyntax{true, true}) == 3);
  CHECK_FALSE(parse_decimal_in("+3", 1, 65535, &error));
  CHECK(error == "'+3' is not an integer");
}
