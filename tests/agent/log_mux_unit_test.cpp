// agent/log_mux.h: the pure parts (line prefixes). Tee and files run black-box in logs_test.cpp.
#include <catch2/catch.hpp>

#include "agent/log_mux.h"

using namespace trun::agent;

TEST_CASE("line prefixes follow torchrun's template", "[logs]") {
  CHECK(line_prefix("", "default", 5, 1) == "[default1]:");
  CHECK(line_prefix("${role_name}/${rank}/${local_rank}", "w", 5, 1) == "[w/5/1]:");
  CHECK(line_prefix("${unknown}", "w", 5, 1) == "[${unknown}]:");
}
