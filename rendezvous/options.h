#pragma once
// The rendezvous options: what the launcher parses once from the command line (RendezvousConfig:
// the backend, its endpoint, the store token and every --rdzv-conf key with its type), and what
// one backend's handler is created with (RendezvousOptions, built from it by handler_options()).
// The registry that creates a handler from them is in handler.h.
//
// Pure: no I/O, no environment. Errors: RendezvousOptionError (handler.h), naming the option or
// the --rdzv-conf key and its value.

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace trun::rendezvous {

// The backends of the registry.
enum class BackendKind {
  kStatic,  // fixed nodes and ranks (static_rendezvous.h); also --standalone
  kC10d,    // dynamic membership over the trun store (dynamic_rendezvous.h, c10d/backend.h)
  kEtcd,    // the same dynamic protocol over etcd (etcd/backend.h)
};
// "static", "c10d", "etcd".
const char* backend_name(BackendKind kind);
// The kind a --rdzv-backend name stands for ("etcd-v2" is etcd, as in torchrun); nullopt for
// an unknown name.
std::optional<BackendKind> parse_backend_kind(std::string_view name);

// --rdzv-conf, typed: one member per key trun reads, unset when the key was not given (the
// backend's default applies; handler_options()). Every value is checked when it is read
// (read_rdzv_conf). Keys accepted, checked and without effect are not members: store_type (tcp
// only), protocol (http only), use_libuv (a bool).
struct RdzvConf {
  // join_timeout, or its alias timeout (torchrun's static backend's name). Seconds, fractions
  // allowed, 0.001..1e7, as every duration here.
  std::optional<std::chrono::milliseconds> join_timeout;
  std::optional<std::chrono::milliseconds> last_call_timeout;  // also 0: no last call
  std::optional<std::chrono::milliseconds> close_timeout;
  std::optional<std::chrono::milliseconds> keep_alive_interval;
  std::optional<int> keep_alive_max_attempt;  // 1..1000000
  std::optional<std::chrono::milliseconds> read_timeout;
  std::optional<std::chrono::milliseconds> progress_interval;  // also 0: no progress lines
  std::optional<bool> is_host;                                 // c10d
  std::optional<bool> failover;                                // c10d
  std::optional<std::string> etcd_prefix;                      // etcd; not empty
};

// What one backend's handler is created with (create_rendezvous_handler validates it,
// RendezvousOptionError). A node's agent gets it from handler_options(); tests and benchmarks fill
// it themselves.
struct RendezvousOptions {
  std::string run_id;  // required, [A-Za-z0-9._-]+ (torchrun's silent default "none" collides)
  // c10d: HOST[:PORT] of the store (port 29400 by default); etcd: HOST[:PORT] of a client URL
  // (port 2379 by default, "http://" allowed) or several separated by commas; static: where
  // node 0 hosts the store when master_addr/master_port are unset.
  std::string endpoint;
  int min_nodes = 1;
  int max_nodes = 1;
  std::string node_id;     // unique per agent; empty: "<hostname>-<pid>-<random>"
  std::string local_addr;  // how other nodes reach this one (MASTER_ADDR); empty: hostname
  int node_rank = -1;      // c10d: a hint for the group rank; static: required
  // static: where node 0 hosts the store; the static backend uses endpoint when these are empty.
  std::string master_addr;
  int master_port = -1;
  std::chrono::milliseconds join_timeout{std::chrono::seconds(600)};
  std::chrono::milliseconds last_call_timeout{std::chrono::seconds(30)};
  std::chrono::milliseconds close_timeout{std::chrono::seconds(30)};  // validated; see docs
  std::chrono::milliseconds keep_alive_interval{std::chrono::seconds(5)};
  int keep_alive_max_attempt = 3;
  std::chrono::milliseconds read_timeout{std::chrono::seconds(60)};  // each store operation
  // While a node waits for a round to complete it logs a progress line this often (joined /
  // min / max, last call or join timeout remaining); 0: only the final line.
  std::chrono::milliseconds progress_interval{std::chrono::seconds(5)};
  // When the first round must have completed: creating the handler (hosting and connecting to
  // the store, each connection retrying no longer than what is left) and its first
  // next_rendezvous() share this one deadline. Unset: join_timeout from the creation. An agent
  // rejoining after losing its store passes the end of its rejoin window.
  std::optional<std::chrono::steady_clock::time_point> first_round_deadline;
  // c10d: unset hosts the store when the endpoint is this machine; etcd ignores it (warning).
  std::optional<bool> is_host;
  // c10d: when the store is lost, the survivors of the last round move it to one of them and
  // carry on (RendezvousSession; docs/rendezvous.md), and every round after an unplanned loss
  // needs a majority of the previous round (dynamic::check_quorum), so that a partition never
  // leaves two groups. false: neither (a lost store ends the job, as in torchrun). Ignored by etcd
  // and static.
  bool failover = true;
  // Rounds of more than this many nodes list only a few members in the result every node reads
  // (RendezvousInfo::participants then holds the first 8; docs/rendezvous.md, "Scale"). Tests
  // lower it to reach that path with a few nodes.
  int max_inline_members = 256;
  // The last round this node completed under an earlier handler (a rejoin after a lost store or
  // membership) and its group rank there: the first join reports them, so that the node counts as
  // a member of that round (quorum, rank order). -1: none.
  int64_t previous_round = -1;
  int previous_rank = -1;
  // c10d, when this node hosts the store: keys it starts with (a failover store:
  // dynamic::failover_seed).
  std::vector<std::pair<std::string, std::string>> store_seed;
  // Shared secret for the store (TRUN_STORE_TOKEN); etcd does not use it (warning).
  std::string store_token;
  // etcd: every key starts with it (--rdzv-conf etcd_prefix; empty: "/"). Other backends refuse
  // it.
  std::string etcd_prefix;
};

// What the command line says about the rendezvous, parsed and checked once by the launcher
// (launcher/cli_config.h) and carried by the agent's LaunchConfig. The job's run id and node
// counts are the agent's (agent/launch_config.h) and go to handler_options() beside it.
struct RendezvousConfig {
  BackendKind backend = BackendKind::kStatic;
  // --rdzv-endpoint as given (messages quote it): c10d, HOST[:PORT] or a list of them
  // (parse_c10d_endpoints); etcd, its client URLs (parse_etcd_endpoints). Checked by the
  // launcher (check_backend_options). Static: already in master_addr/master_port.
  std::string endpoint;
  int node_rank = 0;                      // static only
  std::string master_addr = "127.0.0.1";  // static: where node 0 hosts the store
  int master_port = 29500;                // static: 0 picks a free port (one node only)
  std::string local_addr;  // c10d, etcd: how other nodes reach this one; empty: hostname
  // The store's shared secret (TRUN_STORE_TOKEN, read by the launcher); c10d only (etcd warns
  // that it does not use it; the static store has none).
  std::string store_token;
  RdzvConf conf;
  // The --rdzv-conf entries trun knows, as given (for --dry-run); `conf` holds their values.
  std::map<std::string, std::string> conf_entries;
};

// The options the handler of `config.backend` is created with on this node, for the job
// `run_id` of min_nodes..max_nodes nodes: the backend's defaults, then what `config` gives.
// - c10d and etcd: the endpoint, local_addr, the token and every --rdzv-conf value.
// - static: node_rank, node 0's address (master_addr, master_port), max_nodes nodes, one timeout
// for joining and each store operation (join_timeout, 300 s
//   by default) and progress_interval; the other keys are checked and not used; no token.
// A rejoining agent then sets the rejoin fields (first_round_deadline, previous_round, ...).
RendezvousOptions handler_options(const RendezvousConfig& config, const std::string& run_id,
                                  int min_nodes, int max_nodes);
// --standalone's rendezvous: `config` (its --rdzv-conf) as the static backend's node 0, with the
// store on 127.0.0.1 at a free port.
RendezvousConfig standalone_config(RendezvousConfig config);

// --rdzv-endpoint, by backend (the registry checks it with check_backend_options).
// c10d's --rdzv-endpoint: HOST[:PORT] (port 29400 by default) or a comma-separated list of them
// (a trun extension): the first is where the store starts, the others where it may have moved
// after a failover (docs/rendezvous.md). Throws RendezvousOptionError naming the list.
std::vector<std::pair<std::string, uint16_t>> parse_c10d_endpoints(const std::string& text);
// "host:port", with an IPv6 address in brackets.
std::string endpoint_text(const std::string& host, uint16_t port);

// The etcd backend's --rdzv-endpoint: one client URL or several members separated by commas (a
// trun extension), each HOST[:PORT] (port 2379 by default) or http://HOST[:PORT]. Throws
// RendezvousOptionError naming the list (https://, an empty entry, a bad port).
std::vector<std::pair<std::string, uint16_t>> parse_etcd_endpoints(const std::string& text);

// --rdzv-conf's entries read into their types. Throws RendezvousOptionError naming the key for
// an unknown key and for a bad value (see apply_rdzv_conf for the keys).
RdzvConf read_rdzv_conf(const std::map<std::string, std::string>& conf);
// Sets the members of `options` that `conf` gives.
void apply_rdzv_conf(const RdzvConf& conf, RendezvousOptions* options);
// Parses a --rdzv-conf value "key1=value1,key2=value2" into a map (empty input: empty map).
// Throws RendezvousOptionError on a malformed entry or a repeated key.
std::map<std::string, std::string> parse_rdzv_conf(const std::string& text);
// Applies --rdzv-conf entries: join_timeout, last_call_timeout, close_timeout,
// keep_alive_interval, read_timeout, progress_interval (seconds, fractions allowed),
// keep_alive_max_attempt (integer), is_host and failover (true/false/1/0/yes/no), timeout (alias of
// join_timeout, as torchrun's static backend), use_libuv (true/false, accepted and ignored),
// store_type (tcp only), and for etcd: etcd_prefix, protocol (http only; https and the certificate
// keys are refused). Throws RendezvousOptionError naming the key for unknown keys and bad values.
void apply_rdzv_conf(const std::map<std::string, std::string>& conf, RendezvousOptions* options);
// Whether apply_rdzv_conf knows `key` (including the TLS keys it refuses). The launcher drops
// unknown keys with a warning, as torchrun ignores them, before calling apply_rdzv_conf.
bool is_rdzv_conf_key(const std::string& key);

}  // namespace trun::rendezvous
