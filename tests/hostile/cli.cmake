# The command line and the guardian (issue 42, cases 6 and 7 and the command-line items of 8):
# black-box against the trun binary and tests/bin's worker.
trun_add_test(hostile_cli_test
  SOURCES cli_hostile_test.cpp
  LIBS nlohmann_json::nlohmann_json
  LABELS hostile)
add_dependencies(hostile_cli_test trun trun_test_worker)
