// base/hostlist.h: SLURM's hostlist expressions, expanded by trun.
#include "base/hostlist.h"

#include <catch2/catch.hpp>
#include <stdexcept>

using trun::base::expand_hostlist;
using trun::base::first_host;
using V = std::vector<std::string>;

TEST_CASE("hostlists: plain names, ranges, lists in brackets, zero padding", "[hostlist]") {
  CHECK(expand_hostlist("login3") == V{"login3"});
  CHECK(expand_hostlist("a,b,c") == V{"a", "b", "c"});
  CHECK(expand_hostlist("n[01-04,07]") == V{"n01", "n02", "n03", "n04", "n07"});
  CHECK(expand_hostlist("n[8-10]") == V{"n8", "n9", "n10"});
  CHECK(expand_hostlist("n[098-101]") == V{"n098", "n099", "n100", "n101"});
  CHECK(expand_hostlist("n[0-2]") == V{"n0", "n1", "n2"});
  CHECK(expand_hostlist("n[5]") == V{"n5"});
  CHECK(expand_hostlist("gpu-[1-2]-ib,login3") == V{"gpu-1-ib", "gpu-2-ib", "login3"});
  CHECK(expand_hostlist("[1-2]x") == V{"1x", "2x"});
}

TEST_CASE("hostlists: several bracket groups vary the rightmost fastest", "[hostlist]") {
  CHECK(expand_hostlist("r[1-2]n[8-10]") == V{"r1n8", "r1n9", "r1n10", "r2n8", "r2n9", "r2n10"});
  CHECK(expand_hostlist("r[1,3]-n[01-02].ib,head") ==
        V{"r1-n01.ib", "r1-n02.ib", "r3-n01.ib", "r3-n02.ib", "head"});
  // Duplicates stay, in SLURM's order.
  CHECK(expand_hostlist("n[1-2],n1") == V{"n1", "n2", "n1"});
}

TEST_CASE("hostlists: the first host comes without expanding the rest", "[hostlist]") {
  CHECK(first_host("n[01-04,07]") == "n01");
  CHECK(first_host("r[3-4]n[7-9].ib,x") == "r3n7.ib");
  CHECK(first_host("head,n[1-1000000]") == "head");
  CHECK(first_host("n[1-999999999]") == "n1");  // a billion hosts: the first is still cheap
}

TEST_CASE("hostlists: malformed expressions are refused, quoting them", "[hostlist]") {
  const struct {
    const char* text;
    const char* why;
  } bad[] = {
      {"", "empty host name"},
      {"a,,b", "empty host name"},
      {"n[1-3", "'[' without ']'"},
      {"n1-3]", "']' without '['"},
      {"n[]", "empty brackets"},
      {"n[3-1]", "runs backwards"},
      {"n[a-b]", "is not a number"},
      {"n[1-]", "empty number"},
      {"n[1,,2]", "empty number"},
      {"n[[1-2]]", "nested"},
      {"n 1", "white space"},
      {"n[1-2000000]", "more than 1000000 hosts"},
      {"n[1-9999999999999999999]", "too long"},
  };
  for (const auto& b : bad) {
    INFO(b.text);
    try {
      expand_hostlist(b.text);
      FAIL("accepted");
    } catch (const std::invalid_argument& e) {
      CHECK_THAT(e.what(), Catch::StartsWith(std::string("hostlist '") + b.text + "': ") &&
                               Catch::Contains(b.why));
    }
  }
  CHECK_THROWS_AS(first_host("n[2-1],a"), std::invalid_argument);
}
