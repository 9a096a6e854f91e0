// The hostile-input suite, checkpoints (issue 42, cases 2 and 4): whoever can write into a
// checkpoint directory plants links, FIFOs and forged manifests, and the job that uses the
// directory must neither write through a link nor allocate what a manifest claims.
//
// Black-box where the file's name is known in advance: examples/train_mlp under the real trun,
// saving into and resuming from the directory. The temporary files of a save are named after
// the writer's pid (and a step's files are created inside the save's own new directory), so
// those cases run the real Checkpointer in this process, whose pid the test knows.

#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include <trun/checkpoint.h>

#include "tests/launcher/process_util.h"
#include "tests/skip.h"
#include "tests/worker_sdk/checkpoint/ckpt_content.h"

using json = nlohmann::json;
namespace fs = std::filesystem;
using trun::testing::RunResult;
using trun::testing::TempDir;

namespace {

constexpr const char* kJob = "hostile-ckpt";
constexpr const char* kPrecious = "precious: must never be overwritten\n";

std::string train_mlp() { return std::string(TRUN_BINARY_DIR) + "/examples/train_mlp"; }

// train_mlp under trun: 200 samples in batches of 5 on `nproc` ranks, a checkpoint every 20
// steps in `ck`. One rank: 40 steps an epoch.
RunResult run_training(const std::string& ck, int epochs, int nproc = 1,
                       std::chrono::seconds timeout = std::chrono::seconds(120)) {
  return trun::testing::run_trun(
      {"--standalone", "--nproc-per-node=" + std::to_string(nproc), "--max-restarts=0", train_mlp(),
       "--dataset-size", "200", "--batch-size", "5", "--epochs", std::to_string(epochs),
       "--ckpt-every", "20", "--keep", "3", "--ckpt-dir", ck},
      {{"TRUN_JOB_ID", kJob}}, timeout, {"SLURM_JOB_ID"});
}

std::string describe(const RunResult& r) {
  return "exit " + std::to_string(r.exit_code) + (r.finished ? "" : " (killed: did not finish)") +
         "\n--- stdout\n" + r.out + "\n--- stderr\n" + r.err;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  REQUIRE(f.good());
}

std::string read_file(const std::string& path) { return trun::testing::read_file(path); }

std::vector<std::string> entries(const std::string& dir, const std::string& prefix) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(prefix, 0) == 0) out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

bool is_symlink(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
}

// A checkpoint directory of a finished 40-step training: step_20 and step_40, latest = step_40.
std::string trained_dir(const TempDir& d, int nproc = 1) {
  const std::string ck = d / "ck";
  const RunResult r = run_training(ck, 1, nproc);
  INFO(describe(r));
  REQUIRE(r.exit_code == 0);
  REQUIRE(read_file(ck + "/latest") == "step_" + std::to_string(40 / nproc) + "\n");
  if (nproc == 1) REQUIRE(fs::is_directory(ck + "/step_20"));
  return ck;
}

// Resuming must set step_40 aside and continue from step_20 to the end of the second epoch.
void expect_fallback_to_step_20(const std::string& ck, const RunResult& r) {
  INFO(describe(r));
  REQUIRE(r.finished);
  REQUIRE(r.exit_code == 0);
  REQUIRE_THAT(r.out, Catch::Contains("resumed from " + ck + "/step_20 (step 20"));
  REQUIRE_THAT(r.out, Catch::Contains("done: 80 steps"));
  REQUIRE(entries(ck, "step_40.damaged-").size() == 1);
  REQUIRE(read_file(ck + "/latest") == "step_80\n");
}

// A manifest as the writer stores it: {"crc32c": CRC of the body's compact text, "manifest":
// body}. `body_text` is the body's canonical (compact, keys sorted) text.
void write_manifest_text(const std::string& path, const std::string& body_text) {
  const uint32_t crc = trun::worker::crc32c(body_text.data(), body_text.size());
  write_file(path, "{\"crc32c\":" + std::to_string(crc) + ",\"manifest\":" + body_text + "}\n");
}

json read_body(const std::string& step_dir) {
  return json::parse(read_file(step_dir + "/manifest.json")).at("manifest");
}

uint64_t align64(uint64_t v) { return (v + 63) / 64 * 64; }

}  // namespace

// ---- Case 2: links and other files where the checkpoint code writes ----

TEST_CASE(
    "hostile checkpoint: a symbolic link at .lock fails the job naming it and its target is "
    "unchanged",
    "[hostile][checkpoint][lock]") {
  TempDir d;
  const std::string ck = d / "ck", victim = d / "victim";
  write_file(victim, kPrecious);
  fs::create_directories(ck);
  fs::create_symlink(victim, ck + "/.lock");

  const RunResult r = run_training(ck, 1);
  INFO(describe(r));
  REQUIRE(r.finished);
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Catch::Contains(ck + "/.lock is a symbolic link (to " + victim + ")"));
  CHECK(read_file(victim) == kPrecious);
  CHECK(is_symlink(ck + "/.lock"));  // named, not removed: the owner decides
  CHECK(entries(ck, "step_").empty());
}

TEST_CASE("hostile checkpoint: a hard link at .lock fails the job and the other file is unchanged",
          "[hostile][checkpoint][lock]") {
  TempDir d;
  const std::string ck = d / "ck", victim = d / "victim";
  write_file(victim, kPrecious);
  fs::create_directories(ck);
  REQUIRE(::link(victim.c_str(), (ck + "/.lock").c_str()) == 0);

  const RunResult r = run_training(ck, 1);
  INFO(describe(r));
  REQUIRE(r.finished);
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Catch::Contains(ck + "/.lock has 2 hard links"));
  CHECK(read_file(victim) == kPrecious);
}

TEST_CASE("hostile checkpoint: a FIFO at .lock fails the job naming it, without blocking",
          "[hostile][checkpoint][lock]") {
  TempDir d;
  const std::string ck = d / "ck";
  fs::create_directories(ck);
  REQUIRE(::mkfifo((ck + "/.lock").c_str(), 0644) == 0);
  const RunResult r = run_training(ck, 1, 1, std::chrono::seconds(60));
  INFO(describe(r));
  REQUIRE(r.finished);
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Catch::Contains(ck + "/.lock is a FIFO"));
}

TEST_CASE(
    "hostile checkpoint: a quarantined step's REASON planted as a link is not written "
    "through",
    "[hostile][checkpoint][quarantine]") {
  TempDir d;
  const std::string ck = trained_dir(d), victim = d / "victim";
  write_file(victim, kPrecious);
  // Damage step_40 (a flipped byte in its data) and plant REASON -> victim in it.
  {
    std::fstream f(ck + "/step_40/data", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    f.put('\x7f');
    REQUIRE(f.good());
  }
  fs::create_symlink(victim, ck + "/step_40/REASON");

  const RunResult r = run_training(ck, 2);
  expect_fallback_to_step_20(ck, r);
  CHECK(read_file(victim) == kPrecious);
  const std::string q = ck + "/" + entries(ck, "step_40.damaged-").at(0);
  CHECK_FALSE(is_symlink(q + "/REASON"));
  CHECK_THAT(read_file(q + "/REASON"), Catch::Contains("CRC32C mismatch"));
}

TEST_CASE("hostile checkpoint: links at latest and .resume are replaced, never written through",
          "[hostile][checkpoint][latest]") {
  TempDir d;
  const std::string ck = trained_dir(d, 2);  // two ranks: rank 0 writes .resume for rank 1
  const std::string victim_latest = d / "victim-latest", victim_resume = d / "victim-resume";
  write_file(victim_latest, "step_20\n");
  write_file(victim_resume, kPrecious);
  fs::remove(ck + "/latest");
  fs::create_symlink(victim_latest, ck + "/latest");
  fs::remove(ck + "/.resume");
  fs::create_symlink(victim_resume, ck + "/.resume");

  const RunResult r = run_training(ck, 2, 2);
  INFO(describe(r));
  REQUIRE(r.exit_code == 0);
  CHECK(read_file(victim_latest) == "step_20\n");
  CHECK(read_file(victim_resume) == kPrecious);
  CHECK_FALSE(is_symlink(ck + "/latest"));
  CHECK_FALSE(is_symlink(ck + "/.resume"));
  CHECK(read_file(ck + "/latest") == "step_40\n");
}

TEST_CASE("hostile checkpoint: a FIFO at manifest.json or a link at data is a damaged step",
          "[hostile][checkpoint][damage]") {
  TempDir d;
  const std::string ck = trained_dir(d);
  std::string expected;
  SECTION("manifest.json is a FIFO: nothing blocks on it") {
    fs::remove(ck + "/step_40/manifest.json");
    REQUIRE(::mkfifo((ck + "/step_40/manifest.json").c_str(), 0644) == 0);
    expected = ck + "/step_40/manifest.json is a FIFO";
  }
  SECTION("data is a symbolic link (to an intact copy): not read through") {
    fs::copy_file(ck + "/step_40/data", d / "data-copy");
    fs::remove(ck + "/step_40/data");
    fs::create_symlink(d / "data-copy", ck + "/step_40/data");
    expected = ck + "/step_40/data is a symbolic link";
  }
  const RunResult r = run_training(ck, 2, 1, std::chrono::seconds(60));
  expect_fallback_to_step_20(ck, r);
  CHECK_THAT(r.err, Catch::Contains(expected));
}

// ---- Case 4: forged manifests (a valid CRC) and truncated data ----

TEST_CASE("hostile checkpoint: a forged manifest sets its step aside and the previous one is used",
          "[hostile][checkpoint][manifest]") {
  TempDir d;
  const std::string ck = trained_dir(d);
  const std::string step = ck + "/step_40";
  json body = read_body(step);
  const uint64_t size = body.at("data_size").get<uint64_t>();
  std::vector<std::string> expected;  // in the job's output

  SECTION("a 1 TiB tensor, its data file sparse to match (the CRC of the manifest is valid)") {
    const uint64_t tib = uint64_t{1} << 40, offset = align64(size);
    if (static_cast<uint64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGESIZE) >= tib)
      TRUN_SKIP("this machine has 1 TiB of memory or more: the forged tensor would fit",
                kEnvironment);
    body["tensors"].push_back({{"section", "model"},
                               {"name", "huge"},
                               {"dtype", "float32"},
                               {"shape", {tib / 4}},
                               {"offset", offset},
                               {"nbytes", tib},
                               {"crc32c", 0}});
    body["data_size"] = offset + tib;
    REQUIRE(::truncate((step + "/data").c_str(), static_cast<off_t>(offset + tib)) == 0);
    expected = {"step_40: manifest field 'data_size' says " + std::to_string(offset + tib) +
                    " bytes (and data has " + std::to_string(offset + tib) + ")",
                "bytes of memory this process may have"};
  }
  SECTION("data_size larger than the data file") {
    body["data_size"] = size + (uint64_t{1} << 40);
    expected = {"step_40: data has " + std::to_string(size) + " bytes, the manifest says " +
                std::to_string(size + (uint64_t{1} << 40)) + " (manifest field 'data_size')"};
  }
  SECTION("a negative offset") {
    body["tensors"][0]["offset"] = -64;
    expected = {"step_40: manifest field 'tensors[0]", ".offset' is not an unsigned integer: -64"};
  }
  SECTION("an offset past the end of the data file") {
    body["tensors"][1]["offset"] = size;
    expected = {"step_40: manifest field 'tensors[1]", "lie outside data_size"};
  }
  SECTION("a second tensor on the bytes of the first (memory of a file, many times over)") {
    json alias = body["tensors"][0];
    alias["name"] = "alias";
    body["tensors"].push_back(alias);
    expected = {"step_40: manifest field 'tensors[", "tensors overlap"};
  }
  SECTION("a shape whose element count overflows 64 bits") {
    body["tensors"].push_back({{"section", "model"},
                               {"name", "overflow"},
                               {"dtype", "float32"},
                               {"shape", {uint64_t{1} << 33, uint64_t{1} << 33}},
                               {"offset", 0},
                               {"nbytes", 0},
                               {"crc32c", 0}});
    expected = {"step_40: manifest field 'tensors[", ".shape' is impossible",
                "element count over 2^64"};
  }
  SECTION("a tensor name of 100 KiB") {
    body["tensors"].push_back({{"section", "model"},
                               {"name", std::string(100 * 1024, 'n')},
                               {"dtype", "float32"},
                               {"shape", {0}},
                               {"offset", 0},
                               {"nbytes", 0},
                               {"crc32c", 0}});
    expected = {"step_40: manifest field 'tensors[", ".name' is 102400 bytes long"};
  }
  SECTION("metadata nested 100000 levels deep") {
    // The canonical text of the body with the nested metadata spliced in (no JSON library in
    // this test may hold such a document).
    body["metadata"] = "NESTED-METADATA";
    std::string text = body.dump();
    const std::string nested = std::string(100000, '[') + std::string(100000, ']');
    text.replace(text.find("\"NESTED-METADATA\""), 17, nested);
    write_manifest_text(step + "/manifest.json", text);
    body = json();
    expected = {"step_40: manifest.json nests arrays and objects deeper than 64 levels"};
  }
  SECTION("a truncated data file") {
    REQUIRE(::truncate((step + "/data").c_str(), static_cast<off_t>(size / 2)) == 0);
    expected = {"step_40: data has " + std::to_string(size / 2) + " bytes, the manifest says " +
                std::to_string(size)};
  }
  if (!body.is_null()) write_manifest_text(step + "/manifest.json", body.dump());

  const RunResult r = run_training(ck, 2);
  expect_fallback_to_step_20(ck, r);
  for (const auto& e : expected) CHECK_THAT(r.err, Catch::Contains(e));
  // The reason is recorded with the step that was set aside.
  const std::string q = ck + "/" + entries(ck, "step_40.damaged-").at(0);
  CHECK_THAT(read_file(q + "/REASON"), Catch::Contains(expected.front()));
}

// ---- Case 2, the files a save creates (named after the writer's pid: in this process) ----

namespace {

std::string host() {
  char buf[256] = {};
  REQUIRE(::gethostname(buf, sizeof buf - 1) == 0);
  return buf;
}

std::string suffix() { return "-" + std::to_string(::getpid()) + "@" + host(); }

trun::worker::CheckpointerOptions options() {
  trun::worker::CheckpointerOptions o;
  o.job_id = kJob;
  o.keep_last = 3;
  o.fsync = false;
  return o;
}

}  // namespace

TEST_CASE("hostile checkpoint: a link planted at a save's temporary latest file is not followed",
          "[hostile][checkpoint][temp]") {
  TempDir d;
  const std::string ck = d / "ck", victim = d / "victim";
  write_file(victim, kPrecious);
  trun::test::ContentBuffers buf;
  trun::worker::Checkpointer c(ck, options());
  c.save(trun::test::make_request(1, buf));
  fs::create_symlink(victim, ck + "/.latest.tmp" + suffix());

  c.save(trun::test::make_request(2, buf));
  CHECK(read_file(victim) == kPrecious);
  CHECK_FALSE(is_symlink(ck + "/latest"));
  CHECK(read_file(ck + "/latest") == "step_2\n");
  CHECK(c.load_latest()->step == 2);
}

TEST_CASE("hostile checkpoint: a link planted at manifest.json during a save fails the save",
          "[hostile][checkpoint][temp]") {
  TempDir d;
  const std::string ck = d / "ck", victim = d / "victim";
  write_file(victim, kPrecious);
  const std::string tmp = ck + "/.tmp-step_2" + suffix();
  auto o = options();
  bool planted = false;
  o.on_phase = [&](const char* phase) {
    if (std::string(phase) != "data_written" || planted || !fs::is_directory(tmp)) return;
    fs::create_symlink(victim, tmp + "/manifest.json");
    planted = true;
  };
  trun::test::ContentBuffers buf;
  trun::worker::Checkpointer c(ck, o);
  c.save(trun::test::make_request(1, buf));
  REQUIRE_THROWS_WITH(c.save(trun::test::make_request(2, buf)),
                      Catch::Contains("cannot create " + tmp +
                                      "/manifest.json: a symbolic link "
                                      "is already there"));
  REQUIRE(planted);
  CHECK(read_file(victim) == kPrecious);
  CHECK_FALSE(fs::exists(tmp));  // the failed save removed its files (not the victim)
  c.save(trun::test::make_request(2, buf));
  CHECK(c.load_latest()->step == 2);
}

TEST_CASE(
    "hostile checkpoint: links at a save's temporary directory and at its step are not "
    "followed",
    "[hostile][checkpoint][temp]") {
  TempDir d;
  const std::string ck = d / "ck", other = d / "other";
  fs::create_directories(other);
  write_file(other + "/keep", kPrecious);
  trun::test::ContentBuffers buf;
  trun::worker::Checkpointer c(ck, options());
  c.save(trun::test::make_request(1, buf));

  SECTION("the temporary directory of the next save is a link: removed itself, not emptied") {
    fs::create_directory_symlink(other, ck + "/.tmp-step_2" + suffix());
    c.save(trun::test::make_request(2, buf));
    CHECK(c.load_latest()->step == 2);
  }
  SECTION("the step directory a save replaces is a link: the save fails naming it") {
    fs::create_directory_symlink(other, ck + "/step_2");
    REQUIRE_THROWS_WITH(c.save(trun::test::make_request(2, buf)),
                        Catch::Contains(ck + "/step_2 is a symbolic link"));
    CHECK(is_symlink(ck + "/step_2"));
    CHECK(entries(ck, ".tmp-").empty());
  }
  CHECK(read_file(other + "/keep") == kPrecious);
  CHECK(entries(other, "").size() == 1);
}

TEST_CASE(
    "hostile checkpoint: a damaged step that is a link is quarantined without writing into "
    "its target",
    "[hostile][checkpoint][quarantine]") {
  TempDir d;
  const std::string ck = d / "ck", outside = d / "outside";
  trun::test::ContentBuffers buf;
  {
    trun::worker::Checkpointer c(ck, options());
    for (uint64_t s : {1, 2, 3}) c.save(trun::test::make_request(s, buf));
  }
  fs::create_directories(outside);
  fs::rename(ck + "/step_3", outside + "/step_3");
  fs::create_directory_symlink(outside + "/step_3", ck + "/step_3");
  REQUIRE(::truncate((outside + "/step_3/data").c_str(), 10) == 0);

  trun::worker::Checkpointer c(ck, options());
  const auto loaded = c.load_latest();
  REQUIRE(loaded.has_value());
  CHECK(loaded->step == 2);
  REQUIRE(entries(ck, "step_3.damaged-").size() == 1);
  CHECK(is_symlink(ck + "/" + entries(ck, "step_3.damaged-")[0]));
  CHECK_FALSE(fs::exists(outside + "/step_3/REASON"));
  CHECK(entries(outside + "/step_3", "").size() == 2);  // data and manifest.json, untouched
}
