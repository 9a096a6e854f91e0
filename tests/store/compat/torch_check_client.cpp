// PyTorch 1.13's C++ TCPStore client (c10d::TCPStore, is_master=false) driven through a fixed
// scenario; built against Debian's libtorch. It exists because the 1.13 Python binding has no
// check(): the C++ client does, and sends 1.13's CHECK query.
//
//   torch_check_client HOST PORT
//
// Prints one line per step, "<step> <result>" (the result or the exception), then "END <steps>".
// The test runs it against PyTorch's own server and against trun's and compares the outputs; no
// expected result is written here.
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

namespace {

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& v) {
  return "'" + std::string(v.begin(), v.end()) + "'";
}

int steps = 0;

void step(const std::string& name, const std::function<std::string()>& fn) {
  std::string result;
  try {
    result = fn();
  } catch (const std::exception& e) {
    // c10 errors append a backtrace after the first line; the message is the first line.
    std::string what = e.what();
    result = "raised: " + what.substr(0, what.find('\n'));
  }
  ++steps;
  std::cout << name << " " << result << std::endl;
}

std::string boolean(bool b) { return b ? "true" : "false"; }

// set() has no reply; a round trip on the same connection makes sure the server has applied it
// before another client looks (requests on one connection are served in order).
std::string set_synced(c10d::TCPStore& store, const std::string& key, const std::string& value) {
  store.set(key, bytes(value));
  store.getNumKeys();
  return "ok";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: torch_check_client HOST PORT\n";
    return 2;
  }
  auto connect = [&](std::chrono::milliseconds timeout) {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<uint16_t>(std::atoi(argv[2]));
    opts.isServer = false;
    opts.numWorkers = 2;
    opts.timeout = timeout;
    return std::make_unique<c10d::TCPStore>(argv[1], opts);
  };
  auto a = connect(std::chrono::seconds(5));
  auto b = connect(std::chrono::seconds(5));

  step("check_none", [&] { return boolean(a->check({})); });
  step("check_missing", [&] { return boolean(a->check({"k"})); });
  step("set", [&] { return set_synced(*a, "k", "v"); });
  step("check_present", [&] { return boolean(b->check({"k"})); });
  step("check_present_and_missing", [&] { return boolean(b->check({"k", "other"})); });
  step("add", [&] { return std::to_string(b->add("other", 3)); });
  step("check_both", [&] { return boolean(a->check({"k", "other"})); });
  step("check_repeated", [&] { return boolean(a->check({"k", "k", "other"})); });
  step("check_init_key_is_prefixed", [&] { return boolean(a->check({"init/"})); });
  step("compare_set_missing", [&] { return text(a->compareSet("cas", bytes("x"), bytes("y"))); });
  step("check_compare_set_missing", [&] { return boolean(a->check({"cas"})); });
  step("compare_set_create", [&] { return text(a->compareSet("cas", {}, bytes("y"))); });
  step("check_compare_set_created", [&] { return boolean(b->check({"cas"})); });
  step("set_empty", [&] { return set_synced(*a, "empty", ""); });
  step("check_empty_value", [&] { return boolean(b->check({"empty"})); });
  step("delete", [&] { return boolean(a->deleteKey("k")); });
  step("check_deleted", [&] { return boolean(b->check({"k"})); });
  step("wait_timeout",
       [&] { return b->wait({"k"}, std::chrono::milliseconds(300)), std::string("ok"); });
  step("check_after_wait_timeout", [&] { return boolean(b->check({"other"})); });
  step("get", [&] { return text(b->get("cas")); });
  step("num_keys", [&] { return std::to_string(a->getNumKeys()); });
  // watchKey() (C++ only) registers on the idle callback connection and blocks until the server
  // confirms. trun does not notify watchers (the callback does nothing here, so only the
  // registration is compared).
  step("watch_key_registers", [&] {
    a->watchKey("watched", [](c10::optional<std::string>, c10::optional<std::string>) {});
    return std::string("ok");
  });
  step("after_watch_key", [&] { return text(a->get("cas")); });
  std::cout << "END " << steps << std::endl;
  return 0;
}
