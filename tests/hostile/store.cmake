# Store area (issue 42 cases 1, 3 and the store items of 8): `trun store` and the store of
# `trun --standalone` under a GET flood that reads nothing, unauthenticated 50 MiB SETs, huge wait
# timeouts, bad size options, garbage, huge lengths, slowloris and a connect storm. The RSS
# assertions hold under ASan too: the store runs with its quarantine off (see the test's header).
trun_add_test(hostile_store_test
  SOURCES store_hostile_test.cpp
  LIBS trun_store_client
  LABELS hostile)
add_dependencies(hostile_store_test trun)
