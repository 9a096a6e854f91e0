# Checkpoints (issue 42, cases 2 and 4): links, FIFOs and hard links where the checkpoint code
# reads and writes, forged manifests and truncated data, against examples/train_mlp under the
# real trun (and the real Checkpointer in the test process, for the files named after its pid).
trun_add_test(hostile_checkpoint_test
  SOURCES checkpoint_hostile_test.cpp
  LIBS trun_worker nlohmann_json::nlohmann_json
  LABELS hostile)
add_dependencies(hostile_checkpoint_test trun train_mlp)
