#include "agent/elastic_agent.h"

#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <unordered_map>

#include "agent/decisions.h"
#include "agent/event_loop.h"
#include "agent/failure_report.h"
#include "agent/log_mux.h"
#include "agent/process_supervisor.h"
#include "rendezvous/handler.h"
#include "rendezvous/shm_names.h"
#include "rendezvous/static_rendezvous.h"
#include "rendezvous/store/store.h"

extern char** environ;

namespace trun::agent {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// After SIGKILL, how long to wait for the kernel to let the workers go before giving up.
constexpr auto kAfterKillGrace = std::chrono::seconds(30);

// libtrun_worker shares its segments as unnamed memfds by default; with TRUN_SHM_NAMED=1 (or
// where memfd_create is missing) it names them in /dev/shm (rendezvous/shm_names.h) and unlinks
// each as soon as every local rank mapped it. This removes the named ones a local rank 0 left
// behind when it died between creating and sharing one. Called once every worker is gone.
void remove_worker_shm_segments(const std::string& run_id) {
  const std::string prefix = rendezvous::shm_run_prefix(run_id);
  std::error_code ec;
  for (fs::directory_iterator it("/dev/shm", ec), end; !ec && it != end; it.increment(ec)) {
    std::string name = it->path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    std::error_code rm;
    if (fs::remove(it->path(), rm)) {
      spdlog::warn("removed shared-memory segment {} left by a worker", name);
    }
  }
}

std::string generate_run_id() {
  std::random_device rd;
  std::mt19937_64 gen((static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                      static_cast<uint64_t>(Clock::now().time_since_epoch().count()));
  uint64_t a = gen(), b = gen();
  // UUID version 4 layout, as torchrun's uuid.uuid4().
  a = (a & ~0xF000ull) | 0x4000ull;
  b = (b & 0x3FFFFFFFFFFFFFFFull) | 0x8000000000000000ull;
  char buf[40];
  std::snprintf(buf, sizeof buf, "%08x-%04x-%04x-%04x-%012llx", static_cast<unsigned>(a >> 32),
                static_cast<unsigned>((a >> 16) & 0xFFFF), static_cast<unsigned>(a & 0xFFFF),
                static_cast<unsigned>(b >> 48),
                static_cast<unsigned long long>(b & 0xFFFFFFFFFFFFull));
  return buf;
}

std::string host_name() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof buf - 1) != 0) return "localhost";
  return buf;
}

struct Worker {
  int local_rank = 0;
  int rank = 0;
  int role_rank = 0;
  pid_t pid = -1;
  bool running = false;     // started and not yet reaped
  bool group_live = false;  // its process group may still have members
  int exitcode = 0;
  std::string error_file;
};

struct Ranks {
  std::vector<int> global;  // by local rank
  std::vector<int> role;
  int world_size = 0;
  int role_world_size = 0;
};

// torchelastic's rank assignment: ranks are handed out in group-rank order; role ranks among the
// agents of the same role. Single node: no store traffic.
Ranks assign_ranks(const rendezvous::RendezvousInfo& info, const std::string& role, int nproc,
                   std::chrono::milliseconds timeout) {
  struct Info {
    int group_rank;
    std::string role;
    int nproc;
  };
  std::vector<Info> infos;
  if (info.group_world_size == 1 || !info.store) {
    infos.push_back({info.group_rank, role, nproc});
  } else {
    auto& store = *info.store;
    store.set("role_info/" + std::to_string(info.group_rank), role + "\n" + std::to_string(nproc));
    std::vector<std::string> keys;
    for (int r = 0; r < info.group_world_size; ++r)
      keys.push_back("role_info/" + std::to_string(r));
    store.wait(keys, timeout);
    auto values = store.multi_get(keys);
    for (int r = 0; r < info.group_world_size; ++r) {
      auto nl = values[r].find('\n');
      if (nl == std::string::npos) {
        throw rendezvous::RendezvousError("malformed role info from node " + std::to_string(r));
      }
      infos.push_back({r, values[r].substr(0, nl), std::stoi(values[r].substr(nl + 1))});
    }
  }
  Ranks out;
  int offset = 0, role_offset = 0;
  for (const auto& i : infos) {
    out.world_size += i.nproc;
    if (i.role == role) out.role_world_size += i.nproc;
    if (i.group_rank < info.group_rank) {
      offset += i.nproc;
      if (i.role == role) role_offset += i.nproc;
    }
  }
  for (int l = 0; l < nproc; ++l) {
    out.global.push_back(offset + l);
    out.role.push_back(role_offset + l);
  }
  return out;
}

class Agent {
 public:
  explicit Agent(const LaunchConfig& c) : cfg_(c) {}
  ~Agent() { cleanup(); }

  int run();

 private:
  void setup_signals();
  void start_workers();
  GroupOutcome supervise();
  void on_signalfd();
  void on_children();
  void on_agent_signal(int sig);
  void begin_stop(int sig);
  void kill_all();
  void update_groups();
  bool all_groups_gone() const;
  int running_count() const;
  StreamMode stream_mode(int local_rank, int stream) const;
  std::vector<std::string> worker_env(const Worker& w) const;
  void exit_barrier();
  void cleanup();
  void create_rendezvous();
  void rendezvous_round();
  void on_round_over_fd();
  std::string failure_detail() const;
  void close_job();
  bool reconnect(const std::string& why);

  bool multi_node() const { return dynamic_ || info_.group_world_size > 1; }

  const LaunchConfig& cfg_;
  EventLoop loop_;
  int sigfd_ = -1;
  std::unique_ptr<ProcessSupervisor> sup_;
  std::unique_ptr<rendezvous::RendezvousHandler> rdzv_;
  rendezvous::RendezvousInfo info_;
  Ranks ranks_;
  std::string run_id_;
  std::string base_dir_;  // DIR/<run id>, or a temporary directory
  bool temp_base_ = false;
  std::map<std::string, std::string> base_env_;
  std::string hostname_;

  int restart_count_ = 0;
  std::vector<Worker> workers_;
  std::unordered_map<pid_t, size_t> by_pid_;
  std::unique_ptr<LogMux> logs_;
  GroupPhase phase_ = GroupPhase::kRunning;
  std::optional<GroupOutcome> outcome_;
  std::optional<Clock::time_point> kill_at_;
  bool killed_ = false;
  Clock::time_point killed_at_;
  int received_signal_ = 0;
  uint64_t failure_seq_ = 0;
  std::vector<WorkerFailure> failures_;  // of the current attempt

  // Round-over events: the handler's callback thread stores the newest one and signals the
  // eventfd; the loop thread takes it (on_round_over_fd).
  bool dynamic_ = false;  // c10d: membership may change between rounds
  std::string store_endpoint_;
  std::chrono::milliseconds rdzv_timeout_{std::chrono::seconds(300)};
  // While reconnect() runs: the end of its window, which bounds each new handler's first round.
  std::optional<Clock::time_point> rejoin_deadline_;
  int evfd_ = -1;
  std::mutex ev_mu_;
  std::optional<rendezvous::RoundEvent> pending_event_;
  std::optional<rendezvous::RoundEvent> round_over_;  // the event that ended this attempt
};

void Agent::create_rendezvous() {
  if (cfg_.rdzv_backend != "static" && !cfg_.standalone) {  // c10d, etcd: dynamic membership
    rendezvous::RendezvousOptions o;
    o.run_id = run_id_;
    o.endpoint = cfg_.rdzv_endpoint;
    o.min_nodes = cfg_.min_nodes;
    o.max_nodes = cfg_.max_nodes;
    o.local_addr = cfg_.local_addr;
    if (const char* t = std::getenv("TRUN_STORE_TOKEN")) o.store_token = t;
    rendezvous::apply_rdzv_conf(cfg_.rdzv_conf, &o);
    o.first_round_deadline = rejoin_deadline_;
    rdzv_timeout_ = o.join_timeout;
    store_endpoint_ = cfg_.rdzv_endpoint;
    dynamic_ = true;
    rdzv_ = rendezvous::create_rendezvous_handler(cfg_.rdzv_backend, o);
  } else {
    rendezvous::StaticRendezvousOptions ro;
    ro.run_id = run_id_;
    ro.host = cfg_.standalone ? "127.0.0.1" : cfg_.master_addr;
    ro.port = cfg_.standalone ? 0 : static_cast<uint16_t>(cfg_.master_port);
    ro.rank = cfg_.node_rank;
    ro.world_size = cfg_.max_nodes;
    if (cfg_.rdzv_conf.count("timeout") || cfg_.rdzv_conf.count("join_timeout")) {
      rendezvous::RendezvousOptions parsed;  // validated by the command line already
      rendezvous::apply_rdzv_conf(cfg_.rdzv_conf, &parsed);
      ro.timeout = parsed.join_timeout;
    }
    rdzv_timeout_ = ro.timeout;
    store_endpoint_ = ro.host + ":" + std::to_string(ro.port);
    rdzv_ = rendezvous::create_static_rendezvous(ro);
  }
  evfd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (evfd_ < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
  loop_.add(evfd_, EPOLLIN, [this](uint32_t) { on_round_over_fd(); });
  const int fd = evfd_;
  rdzv_->set_round_over_callback([this, fd](const rendezvous::RoundEvent& e) {
    {
      std::lock_guard<std::mutex> lock(ev_mu_);
      pending_event_ = e;
    }
    uint64_t one = 1;
    ssize_t n = write(fd, &one, sizeof one);
    (void)n;
  });
}

// Forms the next round and this node's worker ranks. Throws RendezvousError and friends.
void Agent::rendezvous_round() {
  info_ = rdzv_->next_rendezvous();
  round_over_.reset();
  ranks_ = assign_ranks(info_, cfg_.role, cfg_.nproc_per_node, rdzv_timeout_);
  spdlog::info(
      "rendezvous done: backend={} run_id={} round={} master={}:{} group_rank={} "
      "group_world_size={} world_size={}",
      cfg_.standalone ? "standalone" : rdzv_->backend(), run_id_, info_.round, info_.master_addr,
      info_.master_port, info_.group_rank, info_.group_world_size, ranks_.world_size);
}

void Agent::on_round_over_fd() {
  uint64_t n;
  while (read(evfd_, &n, sizeof n) > 0) {
  }
  std::optional<rendezvous::RoundEvent> e;
  {
    std::lock_guard<std::mutex> lock(ev_mu_);
    e.swap(pending_event_);
  }
  if (!e || e->round != info_.round || round_over_) return;
  using Kind = rendezvous::RoundEvent::Kind;
  if (e->kind == Kind::kShutdown) return;
  // Our own report comes back as the round's end: the local failure is already being handled.
  if (e->kind == Kind::kWorkerFailed && e->node_id == rdzv_->node_id()) return;
  if (workers_.empty() || outcome_) return;  // the group already stops for a local reason
  round_over_ = *e;
  spdlog::warn("{}; stopping the workers", e->describe());
  outcome_ = GroupOutcome::kRoundOver;
  begin_stop(SIGTERM);
}

std::string Agent::failure_detail() const {
  if (failures_.empty()) return "worker failure on " + hostname_;
  const auto& f = failures_[root_cause_index(failures_)];
  std::string d = "rank " + std::to_string(f.rank) + " (local_rank " +
                  std::to_string(f.local_rank) + ") on " + hostname_ + " exited with " +
                  (f.exitcode < 0 ? signal_name(-f.exitcode) : std::to_string(f.exitcode));
  if (!f.message.empty()) {
    std::string m = f.message.substr(0, 200);
    for (auto& c : m) c = c == '\n' ? ' ' : c;
    d += ": " + m;
  }
  return d;
}

// After losing the store (c10d): drops the handler and joins again with a new one, retrying
// until join_timeout. A partitioned node rejoins this way once its link is back. Returns false
// (after printing why, naming the endpoint) when the store stays unreachable or the job ended.
// The window is one deadline: each new handler gets what is left of it for connecting and for
// its first round (first_round_deadline), and the pause between attempts never runs past it.
bool Agent::reconnect(const std::string& why) {
  const auto deadline = Clock::now() + rdzv_timeout_;
  std::string last = why;
  spdlog::warn("lost the rendezvous store at {}: {}; trying to rejoin for up to {} s",
               store_endpoint_, why, rdzv_timeout_.count() / 1000.0);
  rejoin_deadline_ = deadline;
  bool rejoined = false;
  int attempts = 0;
  while (attempts < 100000 && Clock::now() < deadline) {
    ++attempts;
    if (rdzv_) rdzv_->shutdown();
    rdzv_.reset();
    if (evfd_ >= 0) {
      loop_.remove(evfd_);
      close(evfd_);
      evfd_ = -1;
    }
    {
      std::lock_guard<std::mutex> lock(ev_mu_);
      pending_event_.reset();
    }
    try {
      create_rendezvous();
      rendezvous_round();
      rejoined = true;
      break;
    } catch (const rendezvous::RendezvousClosedError& e) {
      rejoin_deadline_.reset();
      std::fprintf(stderr, "trun: error: the job '%s' has finished (rendezvous closed): %s\n",
                   run_id_.c_str(), e.what());
      return false;
    } catch (const std::exception& e) {
      last = e.what();
      spdlog::debug("rejoin attempt {}: {}", attempts, last);
    }
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) break;
    std::this_thread::sleep_for(std::min<Clock::duration>(std::chrono::milliseconds(500), left));
  }
  rejoin_deadline_.reset();  // later rounds get join_timeout each
  if (rejoined) return true;
  std::fprintf(stderr,
               "trun: error: lost the rendezvous store at %s (%s) and could not rejoin within "
               "%g s (%d attempt(s)): %s\n",
               store_endpoint_.c_str(), cfg_.rdzv_backend.c_str(), rdzv_timeout_.count() / 1000.0,
               attempts, last.c_str());
  std::fflush(stderr);
  return false;
}

void Agent::close_job() {
  if (!rdzv_ || !multi_node()) return;
  try {
    rdzv_->set_closed();
  } catch (const std::exception& e) {
    spdlog::debug("closing the rendezvous: {}", e.what());
  }
}

void Agent::setup_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGCHLD);
  for (int s : cfg_.signals_to_handle) sigaddset(&set, s);
  if (pthread_sigmask(SIG_BLOCK, &set, nullptr) != 0) {
    throw std::system_error(errno, std::generic_category(), "pthread_sigmask");
  }
  sigfd_ = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
  if (sigfd_ < 0) throw std::system_error(errno, std::generic_category(), "signalfd");
  // Writes to a closed console or to the guardian must fail with EPIPE, not kill trun. Workers
  // get SIGPIPE back (process_supervisor.cpp).
  signal(SIGPIPE, SIG_IGN);
  loop_.add(sigfd_, EPOLLIN, [this](uint32_t) { on_signalfd(); });
}

int Agent::run() {
  try {
    setup_signals();
    if (!ProcessSupervisor::become_subreaper()) {
      spdlog::warn("cannot become a child subreaper: {}", std::strerror(errno));
    }
    sup_ = std::make_unique<ProcessSupervisor>();
  } catch (const std::exception& e) {
    spdlog::error("cannot set up process supervision: {}", e.what());
    return kExitAgentError;
  }
  hostname_ = host_name();

  run_id_ = cfg_.standalone ? generate_run_id() : cfg_.run_id;
  try {
    create_rendezvous();
    rendezvous_round();
  } catch (const rendezvous::RendezvousClosedError& e) {
    spdlog::error("rendezvous failed: the job '{}' has finished (its rendezvous is closed): {}",
                  run_id_, e.what());
    return kExitAgentError;
  } catch (const std::exception& e) {
    spdlog::error("rendezvous failed: {}", e.what());
    return kExitAgentError;
  }

  // Log and error-file directory.
  try {
    if (cfg_.log_dir.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/trun-XXXXXX";
      std::vector<char> buf(tmpl.begin(), tmpl.end());
      buf.push_back('\0');
      if (mkdtemp(buf.data()) == nullptr) {
        throw std::system_error(errno, std::generic_category(), "mkdtemp " + tmpl);
      }
      base_dir_ = buf.data();
      temp_base_ = true;
    } else {
      base_dir_ = cfg_.log_dir + "/" + run_id_;
      fs::create_directories(base_dir_);
    }
  } catch (const std::exception& e) {
    spdlog::error("cannot create the log directory: {}", e.what());
    return kExitAgentError;
  }

  for (char** e = environ; *e; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq) base_env_[std::string(*e, static_cast<size_t>(eq - *e))] = eq + 1;
  }
  if (!base_env_.count("OMP_NUM_THREADS") && cfg_.nproc_per_node > 1) {
    spdlog::warn(
        "setting OMP_NUM_THREADS=1 for each worker (it is unset and there are {} "
        "workers); set it yourself to tune performance",
        cfg_.nproc_per_node);
    base_env_["OMP_NUM_THREADS"] = "1";
  }
  for (const char* k : {"NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}) {
    if (!base_env_.count(k)) base_env_[k] = "1";
  }

  int exit_code = kExitAgentError;
  for (;;) {
    GroupOutcome outcome;
    try {
      start_workers();
      outcome = supervise();
    } catch (const std::exception& e) {
      spdlog::error("agent error: {}", e.what());
      if (!workers_.empty()) {
        kill_all();
        for (int i = 0; i < 100 && running_count() > 0; ++i) {
          loop_.run_once(Clock::now() + std::chrono::milliseconds(100));
        }
      }
      return kExitAgentError;
    }
    if (outcome == GroupOutcome::kRoundOver) {
      using Kind = rendezvous::RoundEvent::Kind;
      const rendezvous::RoundEvent e = *round_over_;
      if (e.kind == Kind::kStoreLost && dynamic_) {
        if (!reconnect(e.detail)) return kExitAgentError;
        continue;
      }
      if (e.kind == Kind::kStoreLost) {
        spdlog::error("lost the rendezvous store at {} ({}): {}; giving up", store_endpoint_,
                      rdzv_->backend(), e.describe());
        std::fprintf(stderr, "trun: error: lost the rendezvous store at %s: %s\n",
                     store_endpoint_.c_str(), e.detail.c_str());
        return kExitAgentError;
      }
      if (e.kind == Kind::kClosed) {
        spdlog::error("the job was closed by node {}: {}", e.node_id, e.detail);
        return kExitWorkersFailed;
      }
      if (e.kind == Kind::kWorkerFailed) {
        if (restart_count_ >= cfg_.max_restarts) {
          std::fprintf(stderr,
                       "trun: error: the worker group failed on node %s and no restarts are "
                       "left (%d/%d)\nroot cause: %s\n",
                       e.node_id.c_str(), restart_count_, cfg_.max_restarts, e.detail.c_str());
          std::fflush(stderr);
          close_job();
          return kExitWorkersFailed;
        }
        ++restart_count_;
        spdlog::warn("worker failure on node {} ({}); restarting the worker group ({}/{} restarts)",
                     e.node_id, e.detail, restart_count_, cfg_.max_restarts);
      } else {
        spdlog::warn("{}: re-forming the group (restart count unchanged: {})", e.describe(),
                     restart_count_);
      }
      try {
        rendezvous_round();
      } catch (const rendezvous::RendezvousClosedError& ex) {
        spdlog::error("rendezvous for the restart failed: the job has finished: {}", ex.what());
        return kExitAgentError;
      } catch (const std::exception& ex) {
        if (!dynamic_ || !reconnect(ex.what())) {
          spdlog::error("rendezvous for the restart failed: {}", ex.what());
          return kExitAgentError;
        }
      }
      continue;
    }
    AfterStop next =
        decide_after_stop(outcome, received_signal_, restart_count_, cfg_.max_restarts);
    if (outcome == GroupOutcome::kFailed && multi_node()) {
      // Ends the round on every node: they restart too, or give up with this root cause.
      try {
        rdzv_->report_worker_failure(failure_detail());
      } catch (const std::exception& e) {
        spdlog::error("cannot report the failure to the other nodes: {}", e.what());
      }
    }
    if (next.restart) {
      for (const auto& f : failures_) {
        spdlog::warn("worker group failed (attempt {}): rank {} (local_rank {}) exited with {}",
                     restart_count_, f.rank, f.local_rank,
                     f.exitcode < 0 ? signal_name(-f.exitcode) : std::to_string(f.exitcode));
      }
      ++restart_count_;
      spdlog::warn("restarting the worker group ({}/{} restarts)", restart_count_,
                   cfg_.max_restarts);
      if (multi_node()) {
        try {
          rendezvous_round();
        } catch (const std::exception& e) {
          spdlog::error("rendezvous for the restart failed: {}", e.what());
          return kExitAgentError;
        }
      }
      continue;
    }
    exit_code = next.exit_code;
    if (outcome == GroupOutcome::kFailed && !failures_.empty()) {
      std::string summary = format_summary(cfg_.entrypoint_name, failures_, hostname_);
      std::fputs(summary.c_str(), stderr);
      std::fflush(stderr);
      const auto& root = failures_[root_cause_index(failures_)];
      if (const char* ef = std::getenv("TORCHELASTIC_ERROR_FILE"); ef && *ef) {
        if (!write_root_cause(ef, root)) {
          spdlog::error("cannot write the root cause to TORCHELASTIC_ERROR_FILE={}", ef);
        }
      }
    } else if (outcome == GroupOutcome::kSignaled) {
      spdlog::warn("stopped the workers after {}; exiting with {}", signal_name(received_signal_),
                   exit_code);
    } else if (outcome == GroupOutcome::kSucceeded) {
      try {
        exit_barrier();
      } catch (const std::exception& e) {
        spdlog::warn("exit barrier: {}", e.what());
      }
    }
    if (outcome != GroupOutcome::kSignaled) close_job();
    break;
  }
  return exit_code;
}

StreamMode Agent::stream_mode(int local_rank, int stream) const {
  bool redirect = (cfg_.redirects.for_rank(local_rank) & stream) != 0;
  bool tee = (cfg_.tee.for_rank(local_rank) & stream) != 0;
  bool hidden = cfg_.local_ranks_filter && !cfg_.local_ranks_filter->count(local_rank);
  if (tee && !hidden) return StreamMode::kTee;
  if (tee || redirect) return StreamMode::kFile;
  return hidden ? StreamMode::kDiscard : StreamMode::kInherit;
}

std::vector<std::string> Agent::worker_env(const Worker& w) const {
  std::map<std::string, std::string> env = base_env_;
  env["LOCAL_RANK"] = std::to_string(w.local_rank);
  env.erase("TRUN_LOCAL_RANK");  // a trun started by a worker of another must not pass it on
  if (cfg_.virtual_local_rank) {
    // Each worker sees one device, as its device 0 (see LaunchConfig::visible_devices).
    env["LOCAL_RANK"] = "0";
    env["TRUN_LOCAL_RANK"] = std::to_string(w.local_rank);
    env["CUDA_VISIBLE_DEVICES"] = cfg_.visible_devices.empty()
                                      ? std::to_string(w.local_rank)
                                      : cfg_.visible_devices[static_cast<size_t>(w.local_rank)];
  }
  env["RANK"] = std::to_string(w.rank);
  env["GROUP_RANK"] = std::to_string(info_.group_rank);
  env["ROLE_RANK"] = std::to_string(w.role_rank);
  env["ROLE_NAME"] = cfg_.role;
  env["LOCAL_WORLD_SIZE"] = std::to_string(cfg_.nproc_per_node);
  env["WORLD_SIZE"] = std::to_string(ranks_.world_size);
  env["GROUP_WORLD_SIZE"] = std::to_string(info_.group_world_size);
  env["ROLE_WORLD_SIZE"] = std::to_string(ranks_.role_world_size);
  env["MASTER_ADDR"] = info_.master_addr;
  env["MASTER_PORT"] = std::to_string(info_.master_port);
  env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(restart_count_);
  env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(cfg_.max_restarts);
  env["TORCHELASTIC_RUN_ID"] = run_id_;
  env["TORCHELASTIC_USE_AGENT_STORE"] = info_.use_agent_store ? "True" : "False";
  env["TORCHELASTIC_ERROR_FILE"] = w.error_file;
  env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = cfg_.signals_to_handle_text;
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

void Agent::start_workers() {
  phase_ = GroupPhase::kRunning;
  outcome_.reset();
  kill_at_.reset();
  killed_ = false;
  failures_.clear();
  by_pid_.clear();
  workers_.assign(static_cast<size_t>(cfg_.nproc_per_node), Worker{});
  logs_.reset();
  logs_ = std::make_unique<LogMux>(loop_);

  const std::string attempt_dir = base_dir_ + "/attempt_" + std::to_string(restart_count_);
  std::error_code ec;
  if (fs::exists(attempt_dir, ec)) {
    spdlog::warn("replacing the logs of an earlier run in {}", attempt_dir);
    fs::remove_all(attempt_dir, ec);
  }
  fs::create_directories(attempt_dir);
  if (!cfg_.duplicate_stdout_filters.empty()) {
    logs_->duplicate(STDOUT_FILENO, attempt_dir + "/filtered_stdout.log",
                     cfg_.duplicate_stdout_filters);
  }
  if (!cfg_.duplicate_stderr_filters.empty()) {
    logs_->duplicate(STDERR_FILENO, attempt_dir + "/filtered_stderr.log",
                     cfg_.duplicate_stderr_filters);
  }
  std::vector<SpawnRequest> requests(workers_.size());
  for (size_t i = 0; i < workers_.size(); ++i) {
    Worker& w = workers_[i];
    w.local_rank = static_cast<int>(i);
    w.rank = ranks_.global[i];
    w.role_rank = ranks_.role[i];
    const std::string dir = attempt_dir + "/" + std::to_string(i);
    fs::create_directories(dir);
    w.error_file = dir + "/error.json";
    SpawnRequest& req = requests[i];
    req.argv = cfg_.entrypoint;
    req.env = worker_env(w);
    const std::string prefix =
        line_prefix(cfg_.log_line_prefix_template, cfg_.role, w.rank, w.local_rank);
    req.stdout_fd = logs_->prepare(stream_mode(w.local_rank, kStdOut), STDOUT_FILENO,
                                   dir + "/stdout.log", prefix);
    req.stderr_fd = logs_->prepare(stream_mode(w.local_rank, kStdErr), STDERR_FILENO,
                                   dir + "/stderr.log", prefix);
  }
  auto results = sup_->spawn(requests);
  logs_->close_child_ends();
  bool spawn_failed = false;
  for (size_t i = 0; i < workers_.size(); ++i) {
    Worker& w = workers_[i];
    if (results[i].pid > 0) {
      w.pid = results[i].pid;
      w.running = true;
      w.group_live = true;
      by_pid_[w.pid] = i;
    } else {
      w.exitcode = results[i].error == ENOENT ? 127 : 126;
      WorkerFailure f = read_failure(w.local_rank, w.rank, -1, w.exitcode, "", failure_seq_++);
      f.message = "cannot start worker: " + results[i].error_message;
      failures_.push_back(std::move(f));
      spawn_failed = true;
    }
  }
  spdlog::info("attempt {}: started {} workers", restart_count_, by_pid_.size());
  if (spawn_failed) {
    outcome_ = GroupOutcome::kFailed;
    begin_stop(SIGTERM);
  }
}

int Agent::running_count() const {
  int n = 0;
  for (const auto& w : workers_) n += w.running ? 1 : 0;
  return n;
}

bool Agent::all_groups_gone() const {
  for (const auto& w : workers_) {
    if (w.group_live) return false;
  }
  return true;
}

GroupOutcome Agent::supervise() {
  for (;;) {
    if (phase_ == GroupPhase::kRunning && running_count() == 0) {
      // Every worker exited 0 (a failure would have started the stop). Leftover processes in
      // their groups (background grandchildren) are stopped like workers.
      outcome_ = GroupOutcome::kSucceeded;
      if (!all_groups_gone()) begin_stop(SIGTERM);
    }
    if (outcome_ && running_count() == 0 && all_groups_gone()) break;
    std::optional<Clock::time_point> deadline;
    if (phase_ == GroupPhase::kStopping) {
      deadline = killed_ ? killed_at_ + kAfterKillGrace : *kill_at_;
    }
    loop_.run_once(deadline);
    // The phase may have changed inside run_once; only a deadline set before it can expire.
    if (deadline && phase_ == GroupPhase::kStopping && Clock::now() >= *deadline) {
      if (!killed_) {
        spdlog::warn("workers still running {} ms after the stop signal; sending SIGKILL",
                     cfg_.shutdown_timeout.count());
        kill_all();
      } else {
        throw std::runtime_error("workers did not exit " + std::to_string(kAfterKillGrace.count()) +
                                 " s after SIGKILL");
      }
    }
  }
  logs_->drain();
  logs_.reset();
  return *outcome_;
}

void Agent::on_signalfd() {
  signalfd_siginfo si[16];
  for (int round = 0; round < 64; ++round) {
    ssize_t n = read(sigfd_, si, sizeof si);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    bool child = false;
    for (size_t i = 0; i < static_cast<size_t>(n) / sizeof(signalfd_siginfo); ++i) {
      int sig = static_cast<int>(si[i].ssi_signo);
      if (sig == SIGCHLD) {
        child = true;
      } else {
        on_agent_signal(sig);
      }
    }
    if (child) on_children();
  }
}

void Agent::on_children() {
  const GroupPhase phase_before = phase_;
  auto exits = sup_->reap([this](pid_t pid) { return by_pid_.count(pid) > 0; });
  bool failed = false;
  for (const auto& e : exits) {
    Worker& w = workers_[by_pid_.at(e.pid)];
    w.running = false;
    w.exitcode = e.exitcode();
    spdlog::debug("worker local_rank={} pid={} exited with {}", w.local_rank, w.pid, w.exitcode);
    // Exits in the same batch as the first failure are failures too: they happened before the
    // stop began.
    // A worker that fails on its own after the stop began (it wrote an error file) is a failure
    // too, so the root cause can be chosen among all of them by their timestamps.
    bool own_failure = phase_before == GroupPhase::kStopping && outcome_ == GroupOutcome::kFailed &&
                       w.exitcode != 0 && std::filesystem::exists(w.error_file);
    if (on_worker_exit(phase_before, w.exitcode, 1) == ExitAction::kStopGroupFailed ||
        own_failure) {
      failures_.push_back(
          read_failure(w.local_rank, w.rank, w.pid, w.exitcode, w.error_file, failure_seq_++));
      failed = true;
    }
  }
  update_groups();
  if (failed && phase_ == GroupPhase::kRunning) {
    outcome_ = GroupOutcome::kFailed;
    begin_stop(SIGTERM);
  }
}

void Agent::update_groups() {
  for (auto& w : workers_) {
    if (w.group_live && !w.running && !ProcessSupervisor::group_alive(w.pid)) {
      w.group_live = false;
      sup_->forget_group(w.pid);
    }
  }
}

void Agent::on_agent_signal(int sig) {
  if (received_signal_ == 0) {
    received_signal_ = sig;
    spdlog::warn("received {}: forwarding it to the workers and stopping them", signal_name(sig));
  } else if ((sig == SIGINT || sig == SIGTERM) && phase_ == GroupPhase::kStopping && !killed_) {
    // The user asked twice (a second Ctrl-C): do not make them wait for --shutdown-timeout.
    spdlog::warn("received a second signal ({}) while stopping the workers: sending SIGKILL now",
                 signal_name(sig));
    outcome_ = GroupOutcome::kSignaled;
    kill_all();
    return;
  }
  outcome_ = GroupOutcome::kSignaled;
  if (phase_ == GroupPhase::kRunning) {
    begin_stop(sig);
  } else {
    for (auto& w : workers_) {
      if (w.group_live) sup_->signal_group(w.pid, sig);
    }
  }
}

void Agent::begin_stop(int sig) {
  phase_ = GroupPhase::kStopping;
  kill_at_ = Clock::now() + cfg_.shutdown_timeout;
  for (auto& w : workers_) {
    if (w.group_live) sup_->signal_group(w.pid, sig);
  }
  if (cfg_.shutdown_timeout.count() == 0) kill_all();
}

void Agent::kill_all() {
  for (auto& w : workers_) {
    if (w.group_live) sup_->signal_group(w.pid, SIGKILL);
  }
  killed_ = true;
  killed_at_ = Clock::now();
}

void Agent::exit_barrier() {
  if (info_.group_world_size <= 1 || !info_.store) return;
  auto& store = *info_.store;
  int64_t arrived = store.add("exit_barrier/count", 1);
  if (arrived >= info_.group_world_size) store.set("exit_barrier/done", "1");
  store.wait({"exit_barrier/done"}, cfg_.exit_barrier_timeout);
}

void Agent::cleanup() {
  logs_.reset();
  if (rdzv_) rdzv_->shutdown();
  sup_.reset();
  remove_worker_shm_segments(run_id_);
  if (temp_base_ && !base_dir_.empty()) {
    std::error_code ec;
    fs::remove_all(base_dir_, ec);
  }
  if (evfd_ >= 0) {
    loop_.remove(evfd_);
    close(evfd_);
    evfd_ = -1;
  }
  if (sigfd_ >= 0) {
    loop_.remove(sigfd_);
    close(sigfd_);
    sigfd_ = -1;
  }
}

}  // namespace

int ElasticAgent::run() {
  Agent agent(config_);
  return agent.run();
}

}  // namespace trun::agent
