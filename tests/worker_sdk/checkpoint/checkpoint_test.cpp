#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>

#include <trun/checkpoint.h>

#include "tests/worker_sdk/checkpoint/ckpt_content.h"
#include "tests/worker_sdk/checkpoint/ckpt_test_util.h"

using namespace trun::worker;
using namespace trun::test;
namespace fs = std::filesystem;

TEST_CASE("crc32c: matches the standard check value", "[checkpoint]") {
  REQUIRE(crc32c("123456789", 9) == 0xE3069283u);
  REQUIRE(crc32c("", 0) == 0u);
  // Incremental == one shot, including unaligned splits.
  std::string s(1000, 'x');
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(i * 31);
  for (size_t split : {0, 1, 7, 8, 33, 999, 1000})
    REQUIRE(crc32c(s.data() + split, s.size() - split, crc32c(s.data(), split)) ==
            crc32c(s.data(), s.size()));
}

TEST_CASE("checkpoint: save and load round-trip every field", "[checkpoint]") {
  TempDir d;
  Checkpointer ck(d.path);
  REQUIRE_FALSE(ck.load_latest().has_value());
  trun::test::ContentBuffers buf;
  ck.save(trun::test::make_request(7, buf));
  REQUIRE(read_file(d.path + "/latest") == "step_7\n");
  auto c = ck.load_latest();
  REQUIRE(c.has_value());
  std::string why;
  REQUIRE(trun::test::check_content(*c, &why));
  REQUIRE(c->world_size == 1);
  REQUIRE(c->path == d.path + "/step_7");
  std::vector<float> w(trun::test::kWeightNumel);
  c->copy_to("model", "weight", w.data(), w.size(), DataType::kFloat32);
  REQUIRE(w[5] == trun::test::weight_at(7, 5));
  REQUIRE_THROWS_WITH(c->copy_to("model", "weight", w.data(), 3, DataType::kFloat32),
                      Catch::Contains("expects float32 x 3"));
  REQUIRE_THROWS_WITH(c->copy_to("model", "nope", w.data(), 3, DataType::kFloat32),
                      Catch::Contains("no model tensor 'nope'"));
  // No temporary leftovers.
  for (auto& e : fs::directory_iterator(d.path))
    REQUIRE(e.path().filename().string().rfind(".tmp", 0) != 0);
}

TEST_CASE("checkpoint: bad save requests are rejected with a clear message", "[checkpoint]") {
  TempDir d;
  Checkpointer ck(d.path);
  float x = 1;
  SaveRequest r;
  r.model.push_back({"a", DataType::kFloat32, {1}, &x});
  r.model.push_back({"a", DataType::kFloat32, {1}, &x});
  REQUIRE_THROWS_WITH(ck.save(r), Catch::Contains("duplicate model tensor 'a'"));
  r.model.pop_back();
  r.metadata = "{oops";
  REQUIRE_THROWS_WITH(ck.save(r), Catch::Contains("metadata is not JSON"));
  r.metadata = "{}";
  r.model.push_back({"b", DataType::kFloat32, {4}, nullptr});
  REQUIRE_THROWS_WITH(ck.save(r), Catch::Contains("'b' has no data"));
  r.model.pop_back();
  // The bounds the reader enforces hold at save time too, so that every checkpoint saved loads.
  r.metadata = std::string(70, '[') + std::string(70, ']');
  REQUIRE_THROWS_WITH(ck.save(r), Catch::Contains("metadata nests deeper than 60 levels"));
  r.metadata = "{}";
  r.model.push_back({std::string(65 * 1024, 'n'), DataType::kFloat32, {1}, &x});
  REQUIRE_THROWS_WITH(ck.save(r), Catch::Contains("name is 66560 bytes, more than 65536"));
  r.model.back() = {"c", DataType::kFloat32, {int64_t{1} << 40, int64_t{1} << 40}, &x};
  REQUIRE_THROWS_WITH(ck.save(r), Catch::Contains("tensor 'c' has an element count over 2^64"));
  r.model.back() = {"c", DataType::kFloat32, std::vector<int64_t>(65, 1), &x};
  REQUIRE_THROWS_WITH(ck.save(r), Catch::Contains("tensor 'c' has 65 dimensions, more than 64"));
  CheckpointerOptions zero;
  zero.keep_last = 0;
  REQUIRE_THROWS_WITH(Checkpointer(d.path, zero), Catch::Contains("keep_last"));
  CheckpointerOptions long_job;
  long_job.job_id = std::string(65 * 1024, 'j');
  REQUIRE_THROWS_WITH(Checkpointer(d.path + "/other", long_job),
                      Catch::Contains("the job id is 66560 bytes"));
}

TEST_CASE("checkpoint: every dtype round-trips", "[checkpoint]") {
  TempDir d;
  Checkpointer ck(d.path);
  const DataType all[] = {DataType::kFloat32,  DataType::kFloat64, DataType::kFloat16,
                          DataType::kBFloat16, DataType::kInt32,   DataType::kInt64,
                          DataType::kInt8,     DataType::kUInt8,   DataType::kBool};
  std::vector<unsigned char> bytes(3 * 8);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>(i * 37 + 1);
  SaveRequest r;
  r.step = 1;
  for (DataType t : all) r.model.push_back({dtype_name(t), t, {3}, bytes.data()});
  ck.save(r);
  auto c = ck.load_latest();
  REQUIRE(c.has_value());
  for (DataType t : all) {
    INFO(dtype_name(t));
    const LoadedTensor* lt = c->find("model", dtype_name(t));
    REQUIRE(lt != nullptr);
    REQUIRE(lt->dtype == t);
    REQUIRE(lt->bytes.size() == 3 * dtype_size(t));
    REQUIRE(std::equal(lt->bytes.begin(), lt->bytes.end(), bytes.begin()));
  }
}

TEST_CASE("checkpoint: a flipped byte is detected and load_latest falls back", "[checkpoint]") {
  TempDir d;
  Checkpointer ck(d.path);
  trun::test::ContentBuffers buf;
  ck.save(trun::test::make_request(1, buf));
  ck.save(trun::test::make_request(2, buf));
  SECTION("in a tensor's data") {
    flip_byte(d.path + "/step_2/data", 12345);
    REQUIRE_THROWS_WITH(Checkpointer::load(d.path + "/step_2"),
                        Catch::Contains("tensor 'weight': CRC32C mismatch"));
  }
  SECTION("in the manifest") {
    const std::string m = d.path + "/step_2/manifest.json";
    const std::string text = read_file(m);
    // A digit of the step: still valid JSON, caught by the manifest's checksum.
    const auto pos = text.find("\"step\": 2");
    REQUIRE(pos != std::string::npos);
    flip_byte(m, pos + 8, 0x01);  // '2' -> '3'

    REQUIRE_THROWS_WITH(Checkpointer::load(d.path + "/step_2"),
                        Catch::Contains("manifest CRC32C mismatch"));
  }
  SECTION("a truncated data file") {
    REQUIRE(::truncate((d.path + "/step_2/data").c_str(), 1000) == 0);
    REQUIRE_THROWS_WITH(Checkpointer::load(d.path + "/step_2"),
                        Catch::Contains("the manifest says"));
  }
  SECTION("a missing manifest") {
    fs::remove(d.path + "/step_2/manifest.json");
    REQUIRE_THROWS_WITH(Checkpointer::load(d.path + "/step_2"),
                        Catch::Contains("cannot open manifest.json"));
  }
  auto c = ck.load_latest();
  REQUIRE(c.has_value());
  REQUIRE(c->step == 1);
  std::string why;
  REQUIRE(trun::test::check_content(*c, &why));
}

TEST_CASE("checkpoint: keeps the last K and drops an abandoned future", "[checkpoint]") {
  TempDir d;
  CheckpointerOptions o;
  o.keep_last = 2;
  Checkpointer ck(d.path, o);
  trun::test::ContentBuffers buf;
  for (uint64_t s : {10, 20, 30, 40}) ck.save(trun::test::make_request(s, buf));
  REQUIRE(ck.list_steps() == std::vector<uint64_t>{30, 40});
  // Resumed from 30 (say 40 was damaged) and saved 35: 40 is from an abandoned history.
  ck.save(trun::test::make_request(35, buf));
  REQUIRE(ck.list_steps() == std::vector<uint64_t>{30, 35});
  REQUIRE(ck.load_latest()->step == 35);
  // Saving the same step again replaces it atomically.
  ck.save(trun::test::make_request(35, buf));
  REQUIRE(ck.list_steps() == std::vector<uint64_t>{30, 35});
  REQUIRE(ck.load_latest()->step == 35);
}

TEST_CASE("checkpoint: async mode snapshots, writes in the background and reports",
          "[checkpoint]") {
  TempDir d;
  CheckpointerOptions o;
  o.async = true;
  Checkpointer ck(d.path, o);
  trun::test::ContentBuffers buf;
  for (uint64_t s = 1; s <= 5; ++s) {
    ck.save(trun::test::make_request(s, buf));
    // The snapshot is taken: scribbling over the caller's memory must not reach the file.
    std::fill(buf.weight.begin(), buf.weight.end(), -1.0f);
  }
  ck.wait();
  auto c = ck.load_latest();
  REQUIRE(c.has_value());
  REQUIRE(c->step == 5);
  std::string why;
  REQUIRE(trun::test::check_content(*c, &why));
  REQUIRE(ck.last_write().count() > 0);
}

TEST_CASE("checkpoint: async failures surface on the next call", "[checkpoint]") {
  TempDir d;
  CheckpointerOptions o;
  o.async = true;
  Checkpointer ck(d.path + "/sub", o);
  trun::test::ContentBuffers buf;
  fs::remove_all(d.path + "/sub");
  {
    std::ofstream f(d.path + "/sub");  // a file where the directory was
  }
  ck.save(trun::test::make_request(1, buf));
  REQUIRE_THROWS_AS(ck.wait(), CheckpointError);
}

TEST_CASE("checkpoint: a writer killed at every phase leaves a loadable checkpoint",
          "[checkpoint][crash]") {
  TempDir d;
  const std::string dir = d.path + "/ck";
  int st = 0;
  std::string out = run_writer(dir, 3, "", std::chrono::seconds(60), &st);
  REQUIRE(WIFEXITED(st));
  REQUIRE(WEXITSTATUS(st) == 0);
  uint64_t last = 3;
  for (const char* phase :
       {"data_written", "manifest_written", "synced", "renamed", "latest_written", "done"}) {
    INFO("phase " << phase);
    out = run_writer(dir, 3, phase, std::chrono::seconds(60), &st);
    REQUIRE(WIFSIGNALED(st));
    REQUIRE(WTERMSIG(st) == SIGKILL);
    REQUIRE(out.find("resumed " + std::to_string(last)) != std::string::npos);
    Checkpointer reader(dir);
    auto c = reader.load_latest();
    REQUIRE(c.has_value());
    std::string why;
    REQUIRE(trun::test::check_content(*c, &why));
    // `latest` decides: until it is replaced the previous step is the one loaded (a renamed but
    // unreferenced step_<n> is complete, and replaced when the step is saved again).
    const bool visible = std::string(phase) == "latest_written" || std::string(phase) == "done";
    REQUIRE(c->step == (visible ? last + 1 : last));
    last = c->step;
  }
}

TEST_CASE("checkpoint: SIGKILL at 50 random moments never leaves a bad latest checkpoint",
          "[checkpoint][crash]") {
  TempDir d;
  const std::string dir = d.path + "/ck";
  // Calibrate: one clean run (start, load, one save) takes T here (much more under ASan); kill
  // at random moments between 0.3 T and 3 T, so kills land in start-up, loading and saves.
  int st0 = 0;
  const auto t0 = std::chrono::steady_clock::now();
  run_writer(dir, 1, "", std::chrono::seconds(60), &st0);
  REQUIRE(WIFEXITED(st0));
  REQUIRE(WEXITSTATUS(st0) == 0);
  const auto t_us =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  std::mt19937 rng(12345);
  std::uniform_int_distribution<long> delay_us(t_us * 3 / 10, t_us * 3);
  uint64_t last = 1;
  int killed = 0, progressed = 0;
  for (int i = 0; i < 50; ++i) {
    int st = 0;
    const int us = delay_us(rng);
    std::string out = run_writer(dir, 1000, "", std::chrono::microseconds(us), &st);
    INFO("iteration " << i << ", killed after " << us << " us; writer said: " << out);
    REQUIRE_FALSE((WIFEXITED(st) && WEXITSTATUS(st) != 0));  // 1: it loaded wrong contents
    killed += WIFSIGNALED(st) ? 1 : 0;
    Checkpointer reader(dir);
    auto c = reader.load_latest();
    REQUIRE(c.has_value());  // step 1 was complete before the first kill
    std::string why;
    REQUIRE(trun::test::check_content(*c, &why));
    REQUIRE(c->step >= last);  // never goes backwards
    progressed += c->step > last;
    last = c->step;
  }
  WARN("random kills: " << killed << " of 50 writers killed, " << progressed
                        << " iterations made progress, final step " << last << " (T = " << t_us
                        << " us)");
  REQUIRE(killed >= 40);
  REQUIRE(progressed >= 5);  // the kills did land while checkpoints were being written
}
