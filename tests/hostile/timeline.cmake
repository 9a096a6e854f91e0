# trun timeline and trun status display (issue 42 case 5 and the status/timestamp items of case
# 8): black-box against the real trun binary, one real agent for the status case. The
# address-space-limit case is compiled only without a sanitizer (see the source).
trun_add_test(hostile_timeline_test
  SOURCES timeline_hostile_test.cpp
  LIBS trun_rendezvous trun_agent nlohmann_json::nlohmann_json
  LABELS hostile)
add_dependencies(hostile_timeline_test trun trun_test_worker)
