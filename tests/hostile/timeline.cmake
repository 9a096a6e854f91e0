# trun timeline and trun status display (issue 42 case 5 and the status/timestamp items of case
# 8): black-box against the real trun binary, one real agent for the status case. The
# address-space-limit case is compiled only without a sanitizer (see the source).
trun_add_test(hostile_timeline_test
  SOURCES timeline_hostile_test.cpp
  LIBS trun_rendezvous trun_agent nlohmann_json::nlohmann_json
  LABELS hostile)
add_dependencies(hostile_timeline_test trun trun_test_worker)
# The address-space-limit case is not compiled under a sanitizer (its shadow memory needs more
# address space than the limit leaves), and the plain step runs only no_sanitize tests: it runs
# here, from the plain build, which builds this executable for it (TRUN_PLAIN_EXTRA).
if(NOT TRUN_SANITIZE)
  add_test(NAME hostile.timeline_address_space_limit
           COMMAND hostile_timeline_test "[rlimit]")
  set_tests_properties(hostile.timeline_address_space_limit PROPERTIES
                       LABELS "hostile;no_sanitize" TIMEOUT 600)
  set_property(GLOBAL APPEND PROPERTY TRUN_PLAIN_EXTRA hostile_timeline_test)
endif()
