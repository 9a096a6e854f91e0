#include "launcher/status_command.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "agent/job_local.h"
#include "agent/node_status.h"
#include "launcher/timeline.h"  // printable()
#include "rendezvous/dynamic_decisions.h"
#include "rendezvous/dynamic_rendezvous.h"
#include "rendezvous/etcd/backend.h"
#include "rendezvous/etcd/kv.h"
#include "rendezvous/static_rendezvous.h"
#include "store/tcp_store.h"

namespace trun::launcher {
namespace {

using store::StoreError;
using Duration = std::chrono::milliseconds;

constexpr int kExitShown = 0;
constexpr int kExitNoSuchJob = 1;
constexpr int kExitUsage = 2;
constexpr int kExitUnreachable = 3;
// Bounds on what one status reads, so a corrupt or huge job cannot make it run for long.
constexpr int64_t kMaxNodes = 4096;
constexpr int64_t kMaxRoundSearch = int64_t{1} << 40;

struct NoSuchJob : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A read-only view of the job's state: keys and the rendezvous' ticket counters.
class Reader {
 public:
  virtual ~Reader() = default;
  // The value, or nullopt when the key does not exist. Never waits for the key.
  virtual std::optional<std::string> get(const std::string& key) = 0;
  // A rendezvous counter (tickets, arrivals); 0 when it does not exist.
  virtual int64_t counter(const std::string& key) = 0;
};

class StoreReader : public Reader {
 public:
  explicit StoreReader(store::TcpStoreOptions o) : store_(std::move(o)) {}
  std::optional<std::string> get(const std::string& key) override {
    try {
      return store_.get(key, Duration(0));
    } catch (const store::StoreTimeoutError&) {
      return std::nullopt;
    }
  }
  int64_t counter(const std::string& key) override {
    // add() counters are decimal strings; reading one must not create it (add(key, 0) would).
    auto v = get(key);
    if (!v) return 0;
    try {
      return std::stoll(*v);
    } catch (const std::exception&) {
      return 0;
    }
  }

 private:
  store::TcpStore store_;
};

class EtcdReader : public Reader {
 public:
  explicit EtcdReader(const rendezvous::etcd::KvOptions& o) : kv_(o) {}
  std::optional<std::string> get(const std::string& key) override { return kv_.try_get(key); }
  int64_t counter(const std::string& key) override {
    return kv_.client().count_prefix(rendezvous::etcd_counter_arrivals(kv_.full(key)));
  }

 private:
  rendezvous::etcd::Kv kv_;
};

// The last n >= 0 for which exists(n) holds, given that it holds for every smaller n; -1 when
// exists(0) fails. About 2 log2(n) reads.
template <typename F>
int64_t last_existing(F exists) {
  if (!exists(0)) return -1;
  int64_t lo = 0, hi = 1;
  while (hi < kMaxRoundSearch && exists(hi)) {
    lo = hi;
    hi *= 2;
  }
  while (hi - lo > 1) {  // exists(lo), !exists(hi)
    const int64_t mid = lo + (hi - lo) / 2;
    (exists(mid) ? lo : hi) = mid;
  }
  return lo;
}

struct NodeRow {
  std::string node_id;
  std::string addr;
  int group_rank = -1;  // in the current round; -1 for a node that waits
  // alive: a member of the current round, which runs; left: it left (or died) and ended it;
  // rejoining: a member that has joined the next round; waiting: joined the next round and
  // not a member of the current one; re-forming: a member that has not joined the next one yet.
  std::string state;
  std::optional<agent::NodeStatus> record;
};

struct JobStatus {
  std::string run_id, backend, endpoint;
  bool closed = false;
  int64_t round = -1;       // the last round that formed, -1 when none did yet
  int64_t next_round = -1;  // the round nodes join now
  std::string round_state;  // forming, running, over, closed
  std::string over_cause;   // why the current round ended (its first over record)
  std::vector<NodeRow> nodes;
  int waiting = 0;  // nodes that joined the next round and are not members of the current one
};

void add_node(JobStatus* js, NodeRow row) {
  for (auto& n : js->nodes) {
    if (n.node_id == row.node_id) return;
  }
  js->nodes.push_back(std::move(row));
}

// The members of the next round's joiners: marks members as rejoining, adds the others waiting.
void add_joiners(JobStatus* js, const std::vector<std::pair<std::string, std::string>>& joiners) {
  for (const auto& [id, addr] : joiners) {
    bool member = false;
    for (auto& n : js->nodes) {
      if (n.node_id == id) {
        member = true;
        if (n.state != "left") n.state = js->round_state == "running" ? "alive" : "rejoining";
      }
    }
    if (!member) {
      NodeRow row;
      row.node_id = id;
      row.addr = addr;
      row.state = "waiting";
      add_node(js, std::move(row));
      ++js->waiting;
    }
  }
}

void mark_over(JobStatus* js, const std::string& over_log) {
  using Kind = rendezvous::RoundEvent::Kind;
  auto records = rendezvous::dynamic::parse_over(over_log);
  js->round_state = js->closed ? "closed" : "over";
  if (!records.empty()) {
    rendezvous::RoundEvent e;
    e.round = js->round;
    e.kind = records[0].kind;
    e.node_id = records[0].node_id;
    e.detail = records[0].detail;
    // A round ended by worker failures: the earliest failure of every node's report, not the
    // first report (a secondary failure may be reported before the root cause).
    if (e.kind == Kind::kWorkerFailed) {
      if (auto root = rendezvous::root_cause(rendezvous::dynamic::failure_reports(records))) {
        e.node_id = root->node_id;
        e.detail = "root cause: " + root->detail;
      }
    }
    js->over_cause = e.describe();
  }
  for (auto& n : js->nodes) n.state = js->closed ? "finished" : "re-forming";
  for (const auto& r : records) {
    if (r.kind != Kind::kNodeLeft) continue;
    for (auto& n : js->nodes) {
      if (n.node_id == r.node_id) n.state = "left";
    }
  }
}

// c10d and etcd: the round key, the last completed round's result and over log, the tickets of
// the round being gathered (dynamic_decisions.h).
JobStatus read_dynamic(Reader& r, const std::string& run_id) {
  namespace dyn = rendezvous::dynamic;
  const dyn::Keys keys(run_id);
  JobStatus js;
  auto round_text = r.get(keys.round());
  if (!round_text) throw NoSuchJob("no rendezvous");
  const dyn::RoundKey rk = dyn::parse_round_key(*round_text);
  js.closed = rk.closed;
  // Where to look back from: the round being gathered, or (closed) the last one with a result.
  int64_t top = rk.round;
  if (rk.closed) {
    top = last_existing([&](int64_t i) { return r.get(keys.result(i)).has_value(); });
  }
  std::optional<dyn::RoundResult> formed;
  for (int64_t i = top; i >= 0 && i >= top - rendezvous::dynamic::kMaxAbortedRounds; --i) {
    auto v = r.get(keys.result(i));
    if (!v) continue;
    auto res = dyn::decode_result(*v);
    if (res.kind == dyn::RoundResult::Kind::kComplete) {
      js.round = i;
      // A large round lists a few members in its result; the whole list has its own key.
      if (res.partial()) {
        if (auto whole = r.get(keys.members(i))) res = dyn::decode_result(*whole);
      }
      formed = std::move(res);
      break;
    }
  }
  js.next_round = rk.closed ? -1 : (js.round >= rk.round ? js.round + 1 : rk.round);
  js.round_state = js.closed ? "closed" : formed ? "running" : "forming";
  if (formed) {
    for (size_t g = 0; g < formed->members.size() && g < kMaxNodes; ++g) {
      NodeRow row;
      row.node_id = std::string(formed->members.field(g, 0));
      row.addr = std::string(formed->members.field(g, 1));
      row.group_rank = static_cast<int>(g);
      row.state = js.closed ? "finished" : "alive";
      add_node(&js, std::move(row));
    }
    if (auto over = r.get(keys.over(js.round))) mark_over(&js, *over);
  }
  // The next round's joiners, unless it ended before it formed (they move on or are gone).
  std::optional<std::string> next_result;
  if (js.next_round >= 0) next_result = r.get(keys.result(js.next_round));
  if (js.next_round >= 0 && !next_result) {
    const int64_t n = std::min(r.counter(keys.ticket(js.next_round)), kMaxNodes);
    std::vector<std::pair<std::string, std::string>> joiners;
    for (int64_t t = 1; t <= n; ++t) {
      auto v = r.get(keys.node(js.next_round, t));
      if (!v) continue;  // its ticket is taken, its descriptor not written yet (or it left)
      auto d = dyn::decode_node(*v, t);
      joiners.emplace_back(d.id, d.addr);
    }
    add_joiners(&js, joiners);
  }
  return js;
}

// static: the rounds are barriers of every rank (static_rendezvous.cpp's StaticKeys).
JobStatus read_static(Reader& r, const std::string& run_id) {
  const rendezvous::StaticKeys keys(run_id);
  JobStatus js;
  // Every node counts itself in joined(k) before anything else of round k.
  const int64_t last = last_existing([&](int64_t k) { return r.get(keys.joined(k)).has_value(); });
  if (last < 0 && !r.get(keys.host())) throw NoSuchJob("no rendezvous");
  js.closed = r.get(keys.closed()).has_value();
  for (int64_t k = last; k >= 0 && k >= last - rendezvous::dynamic::kMaxAbortedRounds; --k) {
    auto all = r.get(keys.all(k));
    if (all && *all == "ok") {
      js.round = k;
      break;
    }
  }
  js.round_state = js.closed ? "closed" : js.round >= 0 ? "running" : "forming";
  auto claims = [&](int64_t k) {
    std::vector<std::pair<std::string, std::string>> out;
    for (int rank = 0; rank < kMaxNodes; ++rank) {
      auto v = r.get(keys.claim(k, rank));
      if (!v) break;
      auto node = rendezvous::parse_static_node(*v);
      out.emplace_back(std::move(node.node_id), std::move(node.addr));
    }
    return out;
  };
  if (js.round >= 0) {
    const auto members = claims(js.round);
    for (size_t g = 0; g < members.size(); ++g) {
      NodeRow row;
      row.node_id = members[g].first;
      row.addr = members[g].second;
      row.group_rank = static_cast<int>(g);
      row.state = js.closed ? "finished" : "alive";
      add_node(&js, std::move(row));
    }
    if (auto over = r.get(keys.over(js.round))) mark_over(&js, *over);
  }
  if (!js.closed) {
    js.next_round = js.round + 1;
    if (last >= js.next_round) add_joiners(&js, claims(js.next_round));
  }
  return js;
}

void read_records(Reader& r, JobStatus* js) {
  for (auto& n : js->nodes) {
    if (auto v = r.get(agent::node_status_key(js->run_id, n.node_id))) {
      n.record = agent::decode_node_status(*v);
    }
  }
}

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// A record's time (unix seconds) that can be one: after 1970 and at most a day ahead of this
// clock (another node's clock may be a little ahead). A record holds whatever was written to the
// store: -2^63, NaN or 1e300 is shown as invalid, never as a nonsense age.
constexpr double kMaxClockAheadS = 86400;
bool valid_time(double at) {
  return std::isfinite(at) && at > 0 && at <= unix_now() + kMaxClockAheadS;
}

std::string ago(double at) {
  if (!valid_time(at)) return "invalid time";
  const double s = std::max(0.0, unix_now() - at);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.0f s ago", s);
  return buf;
}

// Text from the store, for the terminal: no control character reaches it (an OSC or CSI
// sequence in a record would retitle the window or rewrite the screen).
std::string safe(const std::string& text) { return printable(text); }

// A JSON text whose bytes are all printable ASCII but for its own newlines: \u escapes for the
// control and non-ASCII characters of every string (nlohmann escapes C0 itself; ensure_ascii
// the rest) and for DEL, which JSON leaves raw (it only occurs inside strings).
std::string ascii_json(const nlohmann::json& j) {
  std::string text =
      j.dump(2, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace);
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    if (c == '\x7f') {
      out += "\\u007f";
    } else {
      out += c;
    }
  }
  return out;
}

// The most restarts any node counted (every node restarts together), the newest failure and
// the root cause of the newest failed round (every node of it records the same one).
struct Summary {
  int restarts = 0;
  int max_restarts = -1;
  const agent::NodeStatus* last_failure = nullptr;
  const agent::NodeStatus* root_cause = nullptr;
};
Summary summarize(const JobStatus& js) {
  Summary s;
  for (const auto& n : js.nodes) {
    if (!n.record) continue;
    s.restarts = std::max(s.restarts, n.record->restarts);
    s.max_restarts = std::max(s.max_restarts, n.record->max_restarts);
    // A failure with an invalid time is still shown, but never wins over one with a valid time.
    const auto at = [](const agent::NodeStatus* r) {
      return valid_time(r->last_failure_at) ? r->last_failure_at : -1.0;
    };
    if (!n.record->last_failure.empty() &&
        (!s.last_failure || at(&*n.record) > at(s.last_failure))) {
      s.last_failure = &*n.record;
    }
    if (!n.record->root_cause.empty() &&
        (!s.root_cause || n.record->root_cause_round > s.root_cause->root_cause_round)) {
      s.root_cause = &*n.record;
    }
  }
  return s;
}

std::string to_json(const JobStatus& js) {
  using nlohmann::json;
  const Summary sum = summarize(js);
  json nodes = json::array();
  for (const auto& n : js.nodes) {
    json j = {{"node_id", n.node_id},
              {"addr", n.addr},
              {"group_rank", n.group_rank >= 0 ? json(n.group_rank) : json(nullptr)},
              {"state", n.state}};
    if (n.record) {
      j["hostname"] = n.record->hostname;
      j["pid"] = n.record->pid;
      j["local_world_size"] = n.record->local_world_size;
      j["agent_state"] = n.record->state;
      j["restarts"] = n.record->restarts;
      j["max_restarts"] = n.record->max_restarts;
      j["record_round"] = n.record->round;
      j["last_failure"] =
          n.record->last_failure.empty() ? json(nullptr) : json(n.record->last_failure);
      j["updated_at"] =
          valid_time(n.record->updated_at) ? json(n.record->updated_at) : json(nullptr);
    } else {
      j["local_world_size"] = nullptr;
      j["agent_state"] = nullptr;
    }
    nodes.push_back(std::move(j));
  }
  json out = {{"run_id", js.run_id},
              {"backend", js.backend},
              {"endpoint", js.endpoint},
              {"round", js.round >= 0 ? json(js.round) : json(nullptr)},
              {"round_state", js.round_state},
              {"next_round", js.next_round >= 0 ? json(js.next_round) : json(nullptr)},
              {"round_over_cause", js.over_cause.empty() ? json(nullptr) : json(js.over_cause)},
              {"closed", js.closed},
              {"restarts", sum.restarts},
              {"max_restarts", sum.max_restarts >= 0 ? json(sum.max_restarts) : json(nullptr)},
              {"waiting", js.waiting},
              {"nodes", std::move(nodes)}};
  if (sum.last_failure) {
    out["last_failure"] = {{"node_id", sum.last_failure->node_id},
                           {"message", sum.last_failure->last_failure},
                           {"at", valid_time(sum.last_failure->last_failure_at)
                                      ? json(sum.last_failure->last_failure_at)
                                      : json(nullptr)}};
  } else {
    out["last_failure"] = nullptr;
  }
  if (sum.root_cause) {
    const auto* r = sum.root_cause;
    out["root_cause"] = {
        {"node_id", r->root_cause_node},
        {"message", r->root_cause},
        {"round", r->root_cause_round},
        {"at", valid_time(r->root_cause_at) ? json(r->root_cause_at) : json(nullptr)}};
  } else {
    out["root_cause"] = nullptr;
  }
  return ascii_json(out) + "\n";
}

std::string to_table(const JobStatus& js) {
  const Summary sum = summarize(js);
  std::string out =
      "job '" + safe(js.run_id) + "' (" + js.backend + " at " + safe(js.endpoint) + ")\n";
  out += "round:        ";
  if (js.round < 0) {
    out += "none formed yet";
  } else {
    out += std::to_string(js.round) + " (" + js.round_state + ")";
  }
  if (!js.over_cause.empty()) out += ": " + safe(js.over_cause);
  if (js.next_round >= 0 && (js.round_state != "running" || js.waiting > 0)) {
    out += "; nodes join round " + std::to_string(js.next_round);
  }
  out += "\nnodes:        " + std::to_string(js.nodes.size() - js.waiting) + " in the round, " +
         std::to_string(js.waiting) + " waiting\n";
  out += "restarts:     " + std::to_string(sum.restarts);
  if (sum.max_restarts >= 0) {
    out += " of " + std::to_string(sum.max_restarts) + " (" +
           std::to_string(std::max(0, sum.max_restarts - sum.restarts)) + " left)";
  }
  out += "\nlast failure: ";
  if (sum.last_failure) {
    out += safe(sum.last_failure->last_failure) + " (node " + safe(sum.last_failure->node_id) +
           ", " + ago(sum.last_failure->last_failure_at) + ")";
  } else {
    out += "none";
  }
  if (sum.root_cause) {
    const auto* r = sum.root_cause;
    out += "\nroot cause:   " + safe(r->root_cause) + " (node " + safe(r->root_cause_node) +
           ", round " + std::to_string(r->root_cause_round) + ", " +
           (valid_time(r->root_cause_at) ? ago(r->root_cause_at) : "time unknown") +
           "; the earliest failure across nodes)";
  }
  out += "\n\n";
  std::vector<std::vector<std::string>> rows = {
      {"NODE", "ADDRESS", "RANK", "WORKERS", "STATE", "AGENT", "RESTARTS", "UPDATED"}};
  for (const auto& n : js.nodes) {
    std::vector<std::string> row = {safe(n.node_id), n.addr.empty() ? "-" : safe(n.addr),
                                    n.group_rank >= 0 ? std::to_string(n.group_rank) : "-"};
    if (n.record) {
      row.push_back(std::to_string(n.record->local_world_size));
      row.push_back(n.state);
      row.push_back(safe(n.record->state));
      row.push_back(std::to_string(n.record->restarts) + "/" +
                    std::to_string(n.record->max_restarts));
      row.push_back(ago(n.record->updated_at));
    } else {
      row.insert(row.end(), {"-", n.state, "-", "-", "-"});
    }
    rows.push_back(std::move(row));
  }
  std::vector<size_t> width(rows[0].size(), 0);
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      line += row[c];
      if (c + 1 < row.size()) line += std::string(width[c] - row[c].size() + 2, ' ');
    }
    out += line + "\n";
  }
  return out;
}

// HOST[:PORT], [V6]:PORT or a bare IPv6 address; false when the port is not one.
bool split_host_port(const std::string& text, uint16_t default_port, std::string* host,
                     uint16_t* port) {
  std::string h = text, p;
  if (!h.empty() && h[0] == '[') {
    const auto close = h.find(']');
    if (close == std::string::npos) return false;
    p = close + 1 < h.size() && h[close + 1] == ':' ? h.substr(close + 2) : "";
    h = h.substr(1, close - 1);
  } else if (std::count(h.begin(), h.end(), ':') == 1) {
    p = h.substr(h.find(':') + 1);
    h = h.substr(0, h.find(':'));
  }
  if (h.empty()) return false;
  *host = h;
  *port = default_port;
  if (p.empty()) return true;
  if (p.size() > 5 || p.find_first_not_of("0123456789") != std::string::npos) return false;
  const int v = std::stoi(p);
  if (v < 1 || v > 65535) return false;
  *port = static_cast<uint16_t>(v);
  return true;
}

}  // namespace

int run_status_command(int argc, char** argv) {
  CLI::App app{
      "Shows a running job: its current round, each node (address, group rank, workers, "
      "alive/waiting), restarts and the last failure. Read-only: the job does not notice it.",
      "trun status"};
  std::string backend = "static", endpoint, run_id, master_addr, conf;
  int master_port = -1;
  double timeout_s = 5;
  bool json = false;
  std::string token;
  if (const char* env = std::getenv("TRUN_STORE_TOKEN")) token = env;
  app.add_option("--rdzv-backend,--rdzv_backend", backend,
                 "The job's rendezvous backend: static, c10d or etcd (alias etcd-v2)")
      ->capture_default_str();
  app.add_option("--rdzv-endpoint,--rdzv_endpoint", endpoint,
                 "The job's --rdzv-endpoint (c10d: HOST[:PORT], port 29400, or the list of where "
                 "the store may have moved; etcd: HOST[:PORT] of "
                 "a client URL, port 2379; static: node 0's store, when --master-addr is not "
                 "given)");
  app.add_option("--rdzv-id,--rdzv_id", run_id, "The job's --rdzv-id")->required();
  app.add_option("--rdzv-conf,--rdzv_conf", conf,
                 "The job's --rdzv-conf (only etcd_prefix is used here)");
  app.add_option("--master-addr,--master_addr", master_addr,
                 "static: node 0's address (default 127.0.0.1)");
  app.add_option("--master-port,--master_port", master_port,
                 "static: node 0's store port (default 29500)")
      ->check(CLI::Range(1, 65535));
  app.add_option("--store-token", token,
                 "The job's store secret (default: $TRUN_STORE_TOKEN; c10d and static)");
  app.add_option("--timeout", timeout_s, "Bound in seconds on connecting and on each read")
      ->check(CLI::Range(0.01, 3600.0))
      ->capture_default_str();
  app.add_flag("--json", json, "One JSON object on stdout instead of the table");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "trun status: error: %s\n", safe(e.what()).c_str());
    return kExitUsage;
  }
  auto usage = [](const std::string& what) {
    std::fprintf(stderr, "trun status: error: %s\n", safe(what).c_str());
    return kExitUsage;
  };
  if (backend == "etcd-v2") backend = "etcd";
  if (backend != "static" && backend != "c10d" && backend != "etcd") {
    return usage("--rdzv-backend=" + backend + ": unknown backend; expected static, c10d or etcd");
  }
  if (run_id.size() > agent::kMaxRunIdBytes) {
    return usage("--rdzv-id: " + std::to_string(run_id.size()) + " bytes; a job id has at most " +
                 std::to_string(agent::kMaxRunIdBytes));
  }
  if (run_id.empty() || run_id.find_first_not_of(
                            "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-") !=
                            std::string::npos) {
    return usage("--rdzv-id=" + run_id + ": expected [A-Za-z0-9._-]+");
  }
  const Duration timeout(static_cast<int64_t>(timeout_s * 1000));
  JobStatus js;
  js.run_id = run_id;
  js.backend = backend;
  std::unique_ptr<Reader> reader;
  try {
    if (backend == "etcd") {
      std::string prefix = "/";
      try {
        auto map = rendezvous::parse_rdzv_conf(conf);
        if (map.count("etcd_prefix") && !map["etcd_prefix"].empty()) prefix = map["etcd_prefix"];
      } catch (const rendezvous::RendezvousError& e) {
        return usage(std::string("--rdzv-conf: ") + e.what());
      }
      rendezvous::etcd::KvOptions o;
      o.endpoints.clear();
      try {
        for (auto& [host, port] : rendezvous::parse_etcd_endpoints(endpoint)) {
          o.endpoints.push_back({host, port});
        }
      } catch (const rendezvous::RendezvousError& e) {
        return usage(e.what());
      }
      o.prefix = prefix;
      o.timeout = timeout;
      o.connect_timeout = std::min<Duration>(timeout, std::chrono::seconds(1));
      js.endpoint = endpoint;
      reader = std::make_unique<EtcdReader>(o);
    } else {
      store::TcpStoreOptions o;
      uint16_t default_port = backend == "c10d" ? 29400 : 29500;
      std::string where = endpoint;
      if (backend == "static" && (!master_addr.empty() || master_port > 0 || endpoint.empty())) {
        where = (master_addr.empty() ? "127.0.0.1" : master_addr);
        if (where.find(':') != std::string::npos) where = "[" + where + "]";
        where += ":" + std::to_string(master_port > 0 ? master_port : 29500);
      }
      if (where.empty()) return usage("--rdzv-backend=c10d: --rdzv-endpoint is required");
      if (backend == "c10d" && where.find(',') != std::string::npos) {
        // An endpoint list: as an agent would, prefer a store that took over (a failover) at a
        // later entry; else the first entry.
        std::vector<std::pair<std::string, uint16_t>> list;
        try {
          list = rendezvous::parse_c10d_endpoints(where);
        } catch (const rendezvous::RendezvousError& e) {
          return usage(e.what());
        }
        where = rendezvous::endpoint_text(list[0].first, list[0].second);
        store::TcpStoreOptions probe;
        probe.token = token;
        probe.dialect = store::StoreDialect::kTrun;
        const std::string key = rendezvous::dynamic::Keys(run_id).failover();
        for (size_t i = 1; i < list.size(); ++i) {
          probe.host = list[i].first;
          probe.port = list[i].second;
          if (store::probe_store_key(probe, key, std::chrono::milliseconds(500))) {
            where = rendezvous::endpoint_text(list[i].first, list[i].second);
            break;
          }
        }
      }
      if (!split_host_port(where, default_port, &o.host, &o.port)) {
        return usage("--rdzv-endpoint=" + where + ": expected HOST[:PORT] with a port 1..65535");
      }
      js.endpoint = o.host + ":" + std::to_string(o.port);
      o.timeout = timeout;
      // Nothing listening is an answer, not something to wait for.
      o.connect_timeout = std::min<Duration>(timeout, std::chrono::seconds(1));
      o.reconnect_timeout = o.connect_timeout;
      o.token = token;
      reader = std::make_unique<StoreReader>(o);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trun status: error: cannot reach the %s at %s: %s\n",
                 backend == "etcd" ? "etcd cluster" : "job's store",
                 safe(endpoint.empty() ? js.endpoint : endpoint).c_str(), safe(e.what()).c_str());
    return kExitUnreachable;
  }
  try {
    JobStatus read =
        backend == "static" ? read_static(*reader, run_id) : read_dynamic(*reader, run_id);
    read.run_id = js.run_id;
    read.backend = js.backend;
    read.endpoint = js.endpoint;
    js = std::move(read);
    read_records(*reader, &js);
  } catch (const NoSuchJob&) {
    std::fprintf(stderr,
                 "trun status: error: no job with --rdzv-id=%s at %s (%s): nothing of its "
                 "rendezvous is there (wrong id, endpoint or backend, or not started yet)\n",
                 run_id.c_str(), js.endpoint.c_str(), backend.c_str());
    return kExitNoSuchJob;
  } catch (const rendezvous::RendezvousError& e) {
    std::fprintf(stderr, "trun status: error: the job's rendezvous state is malformed: %s\n",
                 safe(e.what()).c_str());
    return kExitUnreachable;
  } catch (const StoreError& e) {
    std::fprintf(stderr, "trun status: error: reading the job at %s: %s\n",
                 safe(js.endpoint).c_str(), safe(e.what()).c_str());
    return kExitUnreachable;
  }
  const std::string text = json ? to_json(js) : to_table(js);
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
  return kExitShown;
}

}  // namespace trun::launcher
