# DDP reducer, checkpoints, the distributed sampler and stopping on request (stop.cpp): part of
# libtrun_worker, kept in their own file so the collectives' build rules stay untouched.
target_sources(trun_worker PRIVATE
  src/checkpoint/checkpoint.cpp
  src/checkpoint/crc32c.cpp
  src/checkpoint/directory.cpp
  src/checkpoint/format.cpp
  src/checkpoint/resume.cpp
  src/checkpoint/save.cpp
  src/ddp/bucket_plan.cpp
  src/ddp/comm_hooks.cpp
  src/ddp/powersgd_hook.cpp
  src/ddp/ddp.cpp
  src/ddp/host_staging.cpp
  src/ddp/join.cpp
  src/ddp/param_check.cpp
  src/ddp/reducer.cpp
  src/sampler/sampler.cpp
  src/stop.cpp)
if(TRUN_HAVE_NCCL)
  target_sources(trun_worker PRIVATE src/ddp/device_memory_cuda.cpp)
else()
  target_sources(trun_worker PRIVATE src/ddp/device_memory_none.cpp)
endif()
target_link_libraries(trun_worker PRIVATE nlohmann_json::nlohmann_json)
if(TRUN_HAVE_NCCL)
  target_include_directories(trun_worker PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
endif()
