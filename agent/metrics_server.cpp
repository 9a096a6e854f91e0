#include "agent/metrics_server.h"

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http.hpp>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "base/build_info.h"

namespace trun::agent {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

struct MetricsServer::Impl {
  // Declared before io: sessions destroyed with io's pending handlers still count down `open`.
  std::mutex mu;
  AgentSnapshot snapshot;
  int open = 0;  // connections; touched on the server thread only
  asio::io_context io;
  tcp::acceptor acceptor{io};
  asio::steady_timer retry{io};  // after a failed accept (EMFILE): do not spin

  AgentSnapshot copy() {
    std::lock_guard<std::mutex> lock(mu);
    return snapshot;
  }
  void accept();
};

namespace {

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, MetricsServer::Impl& impl)
      : stream_(std::move(socket)), buffer_(MetricsServer::kMaxRequestBytes), impl_(impl) {
    ++impl_.open;
  }
  ~Session() { --impl_.open; }

  void start() {
    parser_.header_limit(static_cast<std::uint32_t>(MetricsServer::kMaxRequestBytes));
    parser_.body_limit(0);
    stream_.expires_after(MetricsServer::kRequestTimeout);
    http::async_read(
        stream_, buffer_, parser_,
        [self = shared_from_this()](beast::error_code ec, std::size_t) { self->on_read(ec); });
  }

 private:
  void on_read(beast::error_code ec) {
    if (ec) return close();  // malformed, too large, too slow or gone: nothing to answer
    const auto& req = parser_.get();
    MetricsServer::Response r;
    try {
      const AgentSnapshot s = impl_.copy();
      const auto now = std::chrono::steady_clock::now();
      std::string target(req.target());
      if (auto q = target.find('?'); q != std::string::npos) target.resize(q);
      if (req.method() != http::verb::get && req.method() != http::verb::head) {
        r = {405, "text/plain; charset=utf-8", "only GET is served\n"};
      } else if (target == "/metrics") {
        r = MetricsServer::metrics(s, now);
      } else if (target == "/healthz") {
        r = MetricsServer::healthz(s, now);
      } else {
        r = {404, "text/plain; charset=utf-8", "not found: try /metrics or /healthz\n"};
      }
    } catch (const std::exception&) {
      return close();  // never throw out of a completion handler
    }
    res_.version(req.version());
    res_.result(static_cast<unsigned>(r.status));
    res_.set(http::field::content_type, r.content_type);
    res_.set(http::field::server, "trun");
    res_.keep_alive(false);
    if (req.method() != http::verb::head) res_.body() = std::move(r.body);
    res_.prepare_payload();
    stream_.expires_after(MetricsServer::kRequestTimeout);
    http::async_write(stream_, res_, [self = shared_from_this()](beast::error_code, std::size_t) {
      self->close();
    });
  }

  void close() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.socket().close(ignored);
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  http::request_parser<http::empty_body> parser_;
  http::response<http::string_body> res_;
  MetricsServer::Impl& impl_;
};

std::string format_double(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

void family(std::ostringstream& out, const char* name, const char* type, const char* help) {
  out << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n';
}

// The goodput account's totals (agent/goodput.h, docs/goodput.md).
void goodput_families(std::ostringstream& out, const goodput::Totals& t) {
  family(out, "trun_goodput_ratio", "gauge",
         "Share of this node's time in the job that moved the model forward (productive / wall).");
  out << "trun_goodput_ratio " << format_double(t.ratio()) << '\n';
  family(out, "trun_goodput_wall_seconds_total", "counter",
         "This node's time in the job: productive time plus every badput cause.");
  out << "trun_goodput_wall_seconds_total " << format_double(t.wall) << '\n';
  family(out, "trun_goodput_productive_seconds_total", "counter",
         "Steps that count toward the model times the reference step time.");
  out << "trun_goodput_productive_seconds_total " << format_double(t.productive) << '\n';
  family(out, "trun_badput_seconds_total", "counter", "Time in the job lost, by cause.");
  for (int c = 0; c < goodput::kCauses; ++c) {
    out << "trun_badput_seconds_total{cause=\""
        << goodput::cause_name(static_cast<goodput::Cause>(c)) << "\"} "
        << format_double(t.badput[static_cast<size_t>(c)]) << '\n';
  }
  family(out, "trun_goodput_outside_seconds_total", "counter",
         "Time this node spent outside the job (unhealthy, excluded, a spare before it joined).");
  out << "trun_goodput_outside_seconds_total " << format_double(t.outside) << '\n';
  family(out, "trun_goodput_step_seconds", "gauge",
         "The reference step time: the median step time measured (0: none yet).");
  out << "trun_goodput_step_seconds " << format_double(t.step_seconds) << '\n';
  family(out, "trun_goodput_steps_redone_total", "counter",
         "Steps this node's groups took again after a restart resumed from an older checkpoint.");
  out << "trun_goodput_steps_redone_total " << t.steps_redone << '\n';
}

// One gauge per local rank, labelled with its global and local rank.
void rank_gauge(std::ostringstream& out, const std::vector<straggler::RankStats>& ranks,
                const char* name, const char* help, double straggler::RankStats::*field) {
  family(out, name, "gauge", help);
  for (const auto& r : ranks) {
    out << name << "{rank=\"" << r.rank << "\",local_rank=\"" << r.local_rank << "\"} "
        << format_double(r.*field) << '\n';
  }
}

double seconds_between(AgentSnapshot::TimePoint from, AgentSnapshot::TimePoint to) {
  return std::chrono::duration<double>(to - from).count();
}

}  // namespace

void MetricsServer::Impl::accept() {
  acceptor.async_accept([this](beast::error_code ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted) return;
    if (ec) {
      retry.expires_after(std::chrono::milliseconds(100));
      retry.async_wait([this](beast::error_code wait_ec) {
        if (!wait_ec) accept();
      });
      return;
    }
    if (open >= kMaxConnections) {
      beast::error_code ignored;
      socket.close(ignored);
    } else {
      std::make_shared<Session>(std::move(socket), *this)->start();
    }
    accept();
  });
}

std::unique_ptr<MetricsServer> MetricsServer::start(uint16_t port) {
  auto impl = std::make_unique<Impl>();
  beast::error_code ec;
  const tcp::endpoint ep(asio::ip::address_v4::any(), port);
  impl->acceptor.open(ep.protocol(), ec);
  if (!ec) impl->acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(ep, ec);
  if (!ec) impl->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    throw MetricsPortError("cannot serve metrics on port " + std::to_string(port) + ": " +
                           ec.message());
  }
  const uint16_t bound = impl->acceptor.local_endpoint(ec).port();
  impl->accept();
  std::unique_ptr<MetricsServer> server(new MetricsServer(std::move(impl)));
  server->port_ = bound;
  return server;
}

MetricsServer::MetricsServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  thread_ = std::thread([this] {
    for (int i = 0; i < 1000000; ++i) {  // run() returns after stop(); an exception restarts it
      try {
        impl_->io.run();
        return;
      } catch (const std::exception&) {
      }
    }
  });
}

MetricsServer::~MetricsServer() {
  impl_->io.stop();
  if (thread_.joinable()) thread_.join();
}

void MetricsServer::publish(const AgentSnapshot& snapshot) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->snapshot = snapshot;
}

MetricsServer::Response MetricsServer::metrics(const AgentSnapshot& s,
                                               AgentSnapshot::TimePoint now) {
  std::ostringstream out;
  const base::BuildInfo& build = base::build_info();
  family(out, "trun_build_info", "gauge",
         "trun's version, commit and compiled-in features (always 1).");
  out << "trun_build_info{version=\"" << build.version << "\",commit=\"" << base::commit_text()
      << "\",nccl=\"" << (build.nccl ? "yes" : "no") << "\",libtorch=\""
      << (build.libtorch ? "yes" : "no") << "\"} 1\n";
  family(out, "trun_agent_phase", "gauge",
         "The agent's phase: rendezvous, unhealthy, running, stopping, exit_barrier, succeeded, "
         "failed or signaled.");
  out << "trun_agent_phase{phase=\"" << s.phase << "\"} 1\n";
  family(out, "trun_worker_state", "gauge",
         "Each local worker's state: running, succeeded, failed or stopped.");
  for (size_t i = 0; i < s.worker_states.size(); ++i) {
    out << "trun_worker_state{local_rank=\"" << i << "\",state=\"" << s.worker_states[i]
        << "\"} 1\n";
  }
  family(out, "trun_worker_exits_total", "counter",
         "Worker exits other than 0, by exit code or signal.");
  for (const auto& [label, count] : s.worker_exits) {
    out << "trun_worker_exits_total{" << label << "} " << count << '\n';
  }
  family(out, "trun_hangs_total", "counter",
         "Hangs this node found (a rank without progress past its timeout; docs/hangs.md).");
  out << "trun_hangs_total " << s.hangs << '\n';
  family(out, "trun_node_healthy", "gauge",
         "1 when this node passed its last health gate check (docs/health.md), 0 while it "
         "stays out of the job.");
  out << "trun_node_healthy " << (s.healthy ? 1 : 0) << '\n';
  family(out, "trun_health_check_failures_total", "counter",
         "Health gate checks this node failed (it did not join while failing).");
  out << "trun_health_check_failures_total " << s.health_check_failures << '\n';
  rank_gauge(out, s.ranks, "trun_rank_step_seconds",
             "Each local rank's seconds per step over the last 10 s (libtrun_worker programs).",
             &straggler::RankStats::step_s);
  rank_gauge(out, s.ranks, "trun_rank_compute_seconds",
             "Of each local rank's step, the seconds outside collectives (the largest: the rank "
             "the others wait for).",
             &straggler::RankStats::compute_s);
  rank_gauge(out, s.ranks, "trun_rank_straggler_score",
             "1 / (1 + how much slower than the median of the others), 1 when not behind "
             "(docs/health.md).",
             &straggler::RankStats::score);
  rank_gauge(out, s.ranks, "trun_rank_self_score",
             "Each local rank's best compute time in this group over its compute time now.",
             &straggler::RankStats::self_score);
  family(out, "trun_slow_ranks", "gauge",
         "Ranks flagged slow now (on the node that judges: the only one, or group rank 0).");
  out << "trun_slow_ranks " << s.slow_ranks << '\n';
  goodput_families(out,
                   s.goodput.totals(std::chrono::duration<double>(now.time_since_epoch()).count()));
  family(out, "trun_restarts_total", "counter", "Restarts of the worker group so far.");
  out << "trun_restarts_total " << s.restarts << '\n';
  family(out, "trun_restarts_left", "gauge", "Restarts left before a failure ends the job.");
  out << "trun_restarts_left " << std::max(0, s.max_restarts - s.restarts) << '\n';
  family(out, "trun_workers_replaced_total", "counter",
         "Failed workers replaced alone while the others kept running (resilient loops; each "
         "also counts as a restart).");
  out << "trun_workers_replaced_total " << s.workers_replaced << '\n';
  family(out, "trun_rendezvous_rounds_total", "counter", "Rendezvous rounds this node formed.");
  out << "trun_rendezvous_rounds_total " << s.rounds_total << '\n';
  family(out, "trun_rendezvous_round_duration_seconds", "histogram",
         "How long forming each round took on this node.");
  uint64_t cumulative = 0;
  for (size_t i = 0; i < s.round_seconds_counts.size(); ++i) {
    cumulative += s.round_seconds_counts[i];
    const std::string le =
        i < s.round_seconds_buckets.size() ? format_double(s.round_seconds_buckets[i]) : "+Inf";
    out << "trun_rendezvous_round_duration_seconds_bucket{le=\"" << le << "\"} " << cumulative
        << '\n';
  }
  out << "trun_rendezvous_round_duration_seconds_sum " << format_double(s.round_seconds_sum)
      << '\n';
  out << "trun_rendezvous_round_duration_seconds_count " << cumulative << '\n';
  family(out, "trun_rendezvous_round", "gauge", "The current round (-1 before the first).");
  out << "trun_rendezvous_round " << s.round << '\n';
  family(out, "trun_group_world_size", "gauge", "Nodes in the current round (membership size).");
  out << "trun_group_world_size " << s.group_world_size << '\n';
  family(out, "trun_group_rank", "gauge", "This node's group rank in the current round.");
  out << "trun_group_rank " << s.group_rank << '\n';
  if (s.nodes_waiting >= 0) {
    family(out, "trun_rendezvous_nodes_waiting", "gauge",
           "Nodes that joined the next round and wait for it (sampled every few seconds).");
    out << "trun_rendezvous_nodes_waiting " << s.nodes_waiting << '\n';
  }
  family(out, "trun_store_requests_total", "counter",
         "Requests this agent's rendezvous sent to its store (or etcd).");
  out << "trun_store_requests_total " << s.store_requests << '\n';
  family(out, "trun_store_errors_total", "counter",
         "Of those, requests that failed (errors and timeouts).");
  out << "trun_store_errors_total " << s.store_errors << '\n';
  if (s.store_requests_served) {
    family(out, "trun_store_requests_served_total", "counter",
           "Requests the store this agent hosts has served (from every client).");
    out << "trun_store_requests_served_total " << *s.store_requests_served << '\n';
  }
  if (s.last_round_at) {
    family(out, "trun_seconds_since_last_round", "gauge",
           "Seconds since the last round completed on this node.");
    out << "trun_seconds_since_last_round " << format_double(seconds_between(*s.last_round_at, now))
        << '\n';
  }
  return {200, "text/plain; version=0.0.4; charset=utf-8", out.str()};
}

MetricsServer::Response MetricsServer::healthz(const AgentSnapshot& s,
                                               AgentSnapshot::TimePoint now) {
  const char* kText = "text/plain; charset=utf-8";
  const double in_phase = std::floor(seconds_between(s.phase_since, now));
  if (s.phase == "failed") {
    return {
        503, kText,
        "unhealthy: the worker group failed and no restarts are left: " + s.last_failure + "\n"};
  }
  if (s.phase == "rendezvous") {
    // next_rendezvous blocks the loop; the rendezvous bounds itself by join_timeout.
    return {200, kText, "ok: rendezvous in progress for " + format_double(in_phase) + " s\n"};
  }
  const double stale = seconds_between(s.heartbeat, now);
  if ((s.phase == "running" || s.phase == "stopping") &&
      stale > std::chrono::duration<double>(kStaleAfter).count()) {
    return {503, kText,
            "unhealthy: the agent's event loop has not answered for " +
                format_double(std::floor(stale)) + " s\n"};
  }
  return {200, kText,
          "ok: " + s.phase + " for " + format_double(in_phase) + " s, round " +
              std::to_string(s.round) + ", restarts " + std::to_string(s.restarts) + "/" +
              std::to_string(s.max_restarts) + "\n"};
}

}  // namespace trun::agent
