#include "launcher/status_command.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "agent/job_local.h"
#include "base/decimal.h"
#include "launcher/status_read.h"
#include "launcher/status_render.h"
#include "rendezvous/job_status.h"
#include "rendezvous/options.h"
#include "store/store.h"

namespace trun::launcher {
namespace {

using rendezvous::BackendKind;
using rendezvous::JobReader;
using status::JobStatus;
using status::safe;
using store::StoreError;
using Duration = std::chrono::milliseconds;

constexpr int kExitShown = 0;
constexpr int kExitNoSuchJob = 1;
constexpr int kExitUsage = 2;
constexpr int kExitUnreachable = 3;

// What the command line asks for.
struct StatusOptions {
  std::string backend = "static", endpoint, run_id, master_addr, conf;
  BackendKind kind = BackendKind::kStatic;  // `backend`, checked (validate)
  int master_port = -1;
  double timeout_s = 5;
  bool json = false;
  std::string token;
};

int usage(const std::string& what) {
  std::fprintf(stderr, "trun status: error: %s\n", safe(what).c_str());
  return kExitUsage;
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
  int v = 0;
  if (!base::parse_decimal(p, &v) || v < 1 || v > 65535) return false;
  *port = static_cast<uint16_t>(v);
  return true;
}

void declare_options(CLI::App& app, StatusOptions* o) {
  if (const char* env = std::getenv("TRUN_STORE_TOKEN")) o->token = env;
  app.add_option("--rdzv-backend,--rdzv_backend", o->backend,
                 "The job's rendezvous backend: static, c10d or etcd (alias etcd-v2)")
      ->capture_default_str();
  app.add_option("--rdzv-endpoint,--rdzv_endpoint", o->endpoint,
                 "The job's --rdzv-endpoint (c10d: HOST[:PORT], port 29400, or the list of where "
                 "the store may have moved; etcd: HOST[:PORT] of "
                 "a client URL, port 2379; static: node 0's store, when --master-addr is not "
                 "given)");
  app.add_option("--rdzv-id,--rdzv_id", o->run_id, "The job's --rdzv-id")->required();
  app.add_option("--rdzv-conf,--rdzv_conf", o->conf,
                 "The job's --rdzv-conf (only etcd_prefix is used here)");
  app.add_option("--master-addr,--master_addr", o->master_addr,
                 "static: node 0's address (default 127.0.0.1)");
  app.add_option("--master-port,--master_port", o->master_port,
                 "static: node 0's store port (default 29500)")
      ->check(CLI::Range(1, 65535));
  app.add_option("--store-token", o->token,
                 "The job's store secret (default: $TRUN_STORE_TOKEN; c10d and static)");
  app.add_option("--timeout", o->timeout_s, "Bound in seconds on connecting and on each read")
      ->check(CLI::Range(0.01, 3600.0))
      ->capture_default_str();
  app.add_flag("--json", o->json, "One JSON object on stdout instead of the table");
}

// The backend and job id as given; kExitShown when they are valid, else the exit code (printed).
int validate(StatusOptions* o) {
  const auto kind = rendezvous::parse_backend_kind(o->backend);
  if (!kind) {
    return usage("--rdzv-backend=" + o->backend +
                 ": unknown backend; expected static, c10d or etcd");
  }
  o->kind = *kind;
  o->backend = rendezvous::backend_name(*kind);  // etcd-v2 is etcd
  const std::string& run_id = o->run_id;
  if (run_id.size() > agent::kMaxRunIdBytes) {
    return usage("--rdzv-id: " + std::to_string(run_id.size()) + " bytes; a job id has at most " +
                 std::to_string(agent::kMaxRunIdBytes));
  }
  if (run_id.empty() || run_id.find_first_not_of(
                            "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-") !=
                            std::string::npos) {
    return usage("--rdzv-id=" + run_id + ": expected [A-Za-z0-9._-]+");
  }
  return kExitShown;
}

// etcd: the cluster at --rdzv-endpoint under the --rdzv-conf prefix. kExitShown and *reader set,
// or a usage error's exit code (printed); throws when it cannot connect.
int open_etcd(const StatusOptions& opt, rendezvous::JobStateSource source, JobStatus* js,
              std::unique_ptr<JobReader>* reader) {
  std::string prefix = "/";
  try {
    auto map = rendezvous::parse_rdzv_conf(opt.conf);
    if (map.count("etcd_prefix") && !map["etcd_prefix"].empty()) prefix = map["etcd_prefix"];
  } catch (const rendezvous::RendezvousError& e) {
    return usage(std::string("--rdzv-conf: ") + e.what());
  }
  try {
    source.endpoints = rendezvous::parse_etcd_endpoints(opt.endpoint);
  } catch (const rendezvous::RendezvousError& e) {
    return usage(e.what());
  }
  source.etcd_prefix = prefix;
  js->endpoint = opt.endpoint;
  *reader = rendezvous::open_job_reader(source);
  return kExitShown;
}

// A c10d endpoint list: as an agent would, prefer a store that took over (a failover) at a later
// entry; else the first entry. Sets *where; kExitShown, or a usage error's exit code (printed).
int pick_c10d_endpoint(const StatusOptions& opt, std::string* where) {
  std::vector<std::pair<std::string, uint16_t>> list;
  try {
    list = rendezvous::parse_c10d_endpoints(*where);
  } catch (const rendezvous::RendezvousError& e) {
    return usage(e.what());
  }
  const size_t i = rendezvous::current_c10d_store(list, opt.run_id, opt.token);
  *where = rendezvous::endpoint_text(list[i].first, list[i].second);
  return kExitShown;
}

// c10d and static: the job's store. As open_etcd.
int open_store(const StatusOptions& opt, rendezvous::JobStateSource source, JobStatus* js,
               std::unique_ptr<JobReader>* reader) {
  const bool c10d = opt.kind == BackendKind::kC10d;
  uint16_t default_port = c10d ? 29400 : 29500;
  std::string where = opt.endpoint;
  if (opt.kind == BackendKind::kStatic &&
      (!opt.master_addr.empty() || opt.master_port > 0 || opt.endpoint.empty())) {
    where = (opt.master_addr.empty() ? "127.0.0.1" : opt.master_addr);
    if (where.find(':') != std::string::npos) where = "[" + where + "]";
    where += ":" + std::to_string(opt.master_port > 0 ? opt.master_port : 29500);
  }
  if (where.empty()) return usage("--rdzv-backend=c10d: --rdzv-endpoint is required");
  if (c10d && where.find(',') != std::string::npos) {
    if (const int rc = pick_c10d_endpoint(opt, &where); rc != kExitShown) return rc;
  }
  std::string host;
  uint16_t port = 0;
  if (!split_host_port(where, default_port, &host, &port)) {
    return usage("--rdzv-endpoint=" + where + ": expected HOST[:PORT] with a port 1..65535");
  }
  js->endpoint = host + ":" + std::to_string(port);
  source.endpoints = {{host, port}};
  source.store_token = opt.token;
  *reader = rendezvous::open_job_reader(source);
  return kExitShown;
}

// Connects to where the job's state is. Sets js->endpoint (also when it fails to connect).
// kExitShown and *reader set, or the exit code (printed).
int open_reader(const StatusOptions& opt, JobStatus* js, std::unique_ptr<JobReader>* reader) {
  rendezvous::JobStateSource source;
  source.backend = opt.kind;
  source.timeout = Duration(static_cast<int64_t>(opt.timeout_s * 1000));
  // Nothing listening is an answer, not something to wait for.
  source.connect_timeout = std::min<Duration>(source.timeout, std::chrono::seconds(1));
  const bool etcd = opt.kind == BackendKind::kEtcd;
  try {
    return etcd ? open_etcd(opt, source, js, reader) : open_store(opt, source, js, reader);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trun status: error: cannot reach the %s at %s: %s\n",
                 etcd ? "etcd cluster" : "job's store",
                 safe(opt.endpoint.empty() ? js->endpoint : opt.endpoint).c_str(),
                 safe(e.what()).c_str());
    return kExitUnreachable;
  }
}

// Reads the job's rendezvous state and status records into *js (run_id, backend and endpoint
// kept). kExitShown, or the exit code (printed).
int read_job(JobReader& reader, const StatusOptions& opt, JobStatus* js) {
  try {
    status::read_job(opt.kind, reader, js);
  } catch (const rendezvous::NoSuchJobError&) {
    std::fprintf(stderr,
                 "trun status: error: no job with --rdzv-id=%s at %s (%s): nothing of its "
                 "rendezvous is there (wrong id, endpoint or backend, or not started yet)\n",
                 opt.run_id.c_str(), js->endpoint.c_str(), opt.backend.c_str());
    return kExitNoSuchJob;
  } catch (const rendezvous::RendezvousError& e) {
    std::fprintf(stderr, "trun status: error: the job's rendezvous state is malformed: %s\n",
                 safe(e.what()).c_str());
    return kExitUnreachable;
  } catch (const StoreError& e) {
    std::fprintf(stderr, "trun status: error: reading the job at %s: %s\n",
                 safe(js->endpoint).c_str(), safe(e.what()).c_str());
    return kExitUnreachable;
  }
  return kExitShown;
}

}  // namespace

int run_status_command(int argc, char** argv) {
  CLI::App app{
      "Shows a running job: its current round, each node (address, group rank, workers, "
      "alive/waiting), restarts and the last failure. Read-only: the job does not notice it.",
      "trun status"};
  StatusOptions opt;
  declare_options(app, &opt);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    return usage(e.what());
  }
  if (const int rc = validate(&opt); rc != kExitShown) return rc;
  JobStatus js;
  js.run_id = opt.run_id;
  js.backend = opt.backend;
  std::unique_ptr<JobReader> reader;
  if (const int rc = open_reader(opt, &js, &reader); rc != kExitShown) return rc;
  if (const int rc = read_job(*reader, opt, &js); rc != kExitShown) return rc;
  const std::string text = opt.json ? status::to_json(js) : status::to_table(js);
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
  return kExitShown;
}

}  // namespace trun::launcher
