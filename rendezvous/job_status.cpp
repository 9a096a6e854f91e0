// read_job_status (job_status.h): each backend's rendezvous state read back, key by key, without
// waiting or writing.
#include "rendezvous/job_status.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "rendezvous/dynamic_decisions.h"
#include "rendezvous/etcd/backend.h"
#include "rendezvous/etcd/kv.h"
#include "rendezvous/static_rendezvous.h"
#include "store/tcp_store.h"

namespace trun::rendezvous {
namespace {

using Duration = std::chrono::milliseconds;

// Bounds on what one status reads, so a corrupt or huge job cannot make it run for long.
constexpr int64_t kMaxNodes = 4096;
constexpr int64_t kMaxRoundSearch = int64_t{1} << 40;

class StoreReader : public JobReader {
 public:
  explicit StoreReader(const store::TcpStoreOptions& o) : store_(o) {}
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

class EtcdReader : public JobReader {
 public:
  explicit EtcdReader(const etcd::KvOptions& o) : kv_(o) {}
  std::optional<std::string> get(const std::string& key) override { return kv_.try_get(key); }
  int64_t counter(const std::string& key) override {
    return kv_.client().count_prefix(etcd_counter_arrivals(kv_.full(key)));
  }

 private:
  etcd::Kv kv_;
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

void add_node(JobState* js, JobNode row) {
  for (auto& n : js->nodes) {
    if (n.node_id == row.node_id) return;
  }
  js->nodes.push_back(std::move(row));
}

// The members of the next round's joiners: marks members as rejoining, adds the others waiting.
void add_joiners(JobState* js, const std::vector<std::pair<std::string, std::string>>& joiners) {
  for (const auto& [id, addr] : joiners) {
    bool member = false;
    for (auto& n : js->nodes) {
      if (n.node_id == id) {
        member = true;
        if (n.state != "left") n.state = js->round_state == "running" ? "alive" : "rejoining";
      }
    }
    if (!member) {
      JobNode row;
      row.node_id = id;
      row.addr = addr;
      row.state = "waiting";
      add_node(js, std::move(row));
      ++js->waiting;
    }
  }
}

void mark_over(JobState* js, const std::string& over_log) {
  using Kind = RoundEvent::Kind;
  auto records = dynamic::parse_over(over_log);
  js->round_state = js->closed ? "closed" : "over";
  if (!records.empty()) {
    RoundEvent e;
    e.round = js->round;
    e.kind = records[0].kind;
    e.node_id = records[0].node_id;
    e.detail = records[0].detail;
    // A round ended by worker failures: the earliest failure of every node's report, not the
    // first report (a secondary failure may be reported before the root cause).
    if (e.kind == Kind::kWorkerFailed) {
      if (auto root = root_cause(dynamic::failure_reports(records))) {
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
JobState read_dynamic(JobReader& r, const std::string& run_id) {
  namespace dyn = dynamic;
  const dyn::Keys keys(run_id);
  JobState js;
  auto round_text = r.get(keys.round());
  if (!round_text) throw NoSuchJobError("no rendezvous");
  const dyn::RoundKey rk = dyn::parse_round_key(*round_text);
  js.closed = rk.closed;
  // Where to look back from: the round being gathered, or (closed) the last one with a result.
  int64_t top = rk.round;
  if (rk.closed) {
    top = last_existing([&](int64_t i) { return r.get(keys.result(i)).has_value(); });
  }
  std::optional<dyn::RoundResult> formed;
  for (int64_t i = top; i >= 0 && i >= top - dynamic::kMaxAbortedRounds; --i) {
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
      JobNode row;
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
JobState read_static(JobReader& r, const std::string& run_id) {
  const StaticKeys keys(run_id);
  JobState js;
  // Every node counts itself in joined(k) before anything else of round k.
  const int64_t last = last_existing([&](int64_t k) { return r.get(keys.joined(k)).has_value(); });
  if (last < 0 && !r.get(keys.host())) throw NoSuchJobError("no rendezvous");
  js.closed = r.get(keys.closed()).has_value();
  for (int64_t k = last; k >= 0 && k >= last - dynamic::kMaxAbortedRounds; --k) {
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
      auto node = parse_static_node(*v);
      out.emplace_back(std::move(node.node_id), std::move(node.addr));
    }
    return out;
  };
  if (js.round >= 0) {
    const auto members = claims(js.round);
    for (size_t g = 0; g < members.size(); ++g) {
      JobNode row;
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

}  // namespace

std::unique_ptr<JobReader> open_job_reader(const JobStateSource& source) {
  if (source.endpoints.empty()) throw RendezvousOptionError("no endpoint to read the job at");
  if (source.backend == BackendKind::kEtcd) {
    etcd::KvOptions o;
    o.endpoints.clear();
    for (const auto& [host, port] : source.endpoints) o.endpoints.push_back({host, port});
    o.prefix = source.etcd_prefix;
    o.timeout = source.timeout;
    o.connect_timeout = source.connect_timeout;
    return std::make_unique<EtcdReader>(o);
  }
  store::TcpStoreOptions o;
  o.host = source.endpoints.front().first;
  o.port = source.endpoints.front().second;
  o.timeout = source.timeout;
  o.connect_timeout = source.connect_timeout;
  o.reconnect_timeout = source.connect_timeout;
  o.token = source.store_token;
  return std::make_unique<StoreReader>(o);
}

size_t current_c10d_store(const std::vector<std::pair<std::string, uint16_t>>& endpoints,
                          const std::string& run_id, const std::string& store_token) {
  store::TcpStoreOptions probe;
  probe.token = store_token;
  probe.dialect = store::StoreDialect::kTrun;
  const std::string key = dynamic::Keys(run_id).failover();
  for (size_t i = 1; i < endpoints.size(); ++i) {
    probe.host = endpoints[i].first;
    probe.port = endpoints[i].second;
    if (store::probe_store_key(probe, key, std::chrono::milliseconds(500))) return i;
  }
  return 0;
}

JobState read_job_status(BackendKind backend, JobReader& reader, const std::string& run_id) {
  return backend == BackendKind::kStatic ? read_static(reader, run_id)
                                         : read_dynamic(reader, run_id);
}

}  // namespace trun::rendezvous
