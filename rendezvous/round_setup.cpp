// What the round-based handlers (c10d, static) need before one exists (round_rendezvous.h):
// parsing an endpoint and telling whether it is this machine, default node ids and addresses, a
// free port, the options every backend checks, the first round's clock and hosting the store.
// The handler itself is in round_rendezvous.cpp, its round-over side in round_over.cpp.
#include "rendezvous/round_rendezvous.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <random>
#include <set>
#include <thread>

#include "base/decimal.h"
#include "store/socket_conn.h"

namespace trun::rendezvous {
namespace {

using Clock = std::chrono::steady_clock;

bool valid_token(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-' ||
          c == ':' || c == '@' || c == '+' || c == '[' || c == ']')) {
      return false;
    }
  }
  return true;
}

// Numeric addresses `host` resolves to.
std::set<std::string> resolve_all(const std::string& host) {
  std::set<std::string> out;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return out;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    char buf[NI_MAXHOST];
    if (::getnameinfo(ai->ai_addr, ai->ai_addrlen, buf, sizeof(buf), nullptr, 0, NI_NUMERICHOST) ==
        0) {
      out.insert(buf);
    }
  }
  ::freeaddrinfo(res);
  return out;
}

bool is_loopback(const std::string& numeric) {
  return numeric.rfind("127.", 0) == 0 || numeric == "::1";
}

bool is_numeric_ip(const std::string& host) {
  in6_addr a6;
  in_addr a4;
  return ::inet_pton(AF_INET, host.c_str(), &a4) == 1 ||
         ::inet_pton(AF_INET6, host.c_str(), &a6) == 1;
}

}  // namespace

Endpoint parse_endpoint(const std::string& text, uint16_t default_port, const char* what) {
  const std::string prefix = std::string(what) + "=" + text + ": ";
  auto bad = [&](const std::string& why) { return RendezvousOptionError(prefix + why); };
  Endpoint e;
  std::string port;
  bool has_port = false;
  if (text.empty()) throw RendezvousOptionError(std::string(what) + ": expected HOST[:PORT]");
  if (text[0] == '[') {
    size_t close = text.find(']');
    if (close == std::string::npos) throw bad("unterminated [IPv6] (expected [ADDRESS]:PORT)");
    e.host = text.substr(1, close - 1);
    if (e.host.empty()) throw bad("empty host between the brackets");
    // Brackets hold an IPv6 address (a zone, "%eth0", may follow it), nothing else.
    in6_addr a6;
    std::string address = e.host.substr(0, e.host.find('%'));
    if (::inet_pton(AF_INET6, address.c_str(), &a6) != 1) {
      throw bad("'" + e.host + "' in brackets is not an IPv6 address");
    }
    if (close + 1 < text.size()) {
      if (text[close + 1] != ':') throw bad("expected [ADDRESS]:PORT after the brackets");
      port = text.substr(close + 2);
      has_port = true;
    }
  } else if (text.find(']') != std::string::npos) {
    throw bad("']' without '[' (write an IPv6 address as [ADDRESS]:PORT)");
  } else {
    size_t colon = text.rfind(':');
    if (colon != std::string::npos && text.find(':') == colon) {
      e.host = text.substr(0, colon);
      port = text.substr(colon + 1);
      has_port = true;
    } else if (colon != std::string::npos) {
      // Several colons: a bare IPv6 address (no port) or a mistake.
      in6_addr a6;
      std::string address = text.substr(0, text.find('%'));
      if (::inet_pton(AF_INET6, address.c_str(), &a6) != 1) {
        throw bad("not HOST:PORT, and not an IPv6 address (write one as [ADDRESS]:PORT)");
      }
      e.host = text;
    } else {
      e.host = text;  // no port
    }
  }
  if (e.host.empty()) throw bad("empty host (expected HOST:PORT)");
  for (char c : e.host) {
    if (std::isspace(static_cast<unsigned char>(c))) throw bad("space in host");
  }
  e.port = default_port;
  if (has_port) {
    if (port.empty()) throw bad("empty port (expected HOST:PORT)");
    // At most 5 digits (so "000080" stays refused, as before), nothing else, and up to 65535.
    uint16_t p = 0;
    if (port.size() > 5 || !base::parse_decimal(port, &p)) {
      throw bad("port '" + port + "' is not a number in 0..65535");
    }
    e.port = p;
  }
  return e;
}

bool endpoint_is_local(const std::string& host, const std::string& local_addr) {
  if (host == "localhost" || (!local_addr.empty() && host == local_addr)) return true;
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) == 0 && host == name) return true;
  auto wanted = resolve_all(host);
  for (auto& a : wanted) {
    if (is_loopback(a)) return true;
  }
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) return false;
  bool found = false;
  for (ifaddrs* i = ifs; i && !found; i = i->ifa_next) {
    if (!i->ifa_addr) continue;
    int family = i->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    char buf[NI_MAXHOST];
    socklen_t len = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    if (::getnameinfo(i->ifa_addr, len, buf, sizeof(buf), nullptr, 0, NI_NUMERICHOST) != 0) {
      continue;
    }
    std::string a = buf;
    if (auto pct = a.find('%'); pct != std::string::npos) a.resize(pct);
    found = wanted.count(a) > 0;
  }
  ::freeifaddrs(ifs);
  return found;
}

std::string default_local_addr() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == 0) return "127.0.0.1";
  return name;
}

std::string default_node_id() {
  static std::atomic<uint32_t> counter{0};
  std::random_device rd;
  char suffix[16];
  std::snprintf(suffix, sizeof(suffix), "%04x%02x", rd() & 0xffff, counter++ & 0xff);
  std::string host = default_local_addr();
  std::string id;
  for (char c : host) id += valid_token(std::string(1, c)) ? c : '_';
  return id + "-" + std::to_string(::getpid()) + "-" + suffix;
}

uint16_t pick_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof(addr);
  uint16_t port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

void validate_common_options(const RendezvousOptions& o, const char* backend) {
  std::string b = std::string("--rdzv-backend=") + backend + ": ";
  if (o.run_id.empty()) throw RendezvousOptionError(b + "--rdzv-id is required");
  for (char c : o.run_id) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      throw RendezvousOptionError(b + "--rdzv-id=" + o.run_id +
                                  ": only letters, digits, '.', '_' and '-' are allowed");
    }
  }
  if (o.min_nodes < 1) {
    throw RendezvousOptionError(b + "--nnodes: the minimum (" + std::to_string(o.min_nodes) +
                                ") must be at least 1");
  }
  if (o.max_nodes < o.min_nodes) {
    throw RendezvousOptionError(b + "--nnodes: the maximum (" + std::to_string(o.max_nodes) +
                                ") is below the minimum (" + std::to_string(o.min_nodes) + ")");
  }
  if (!o.node_id.empty() && !valid_token(o.node_id)) {
    throw RendezvousOptionError(b + "node id '" + o.node_id +
                                "': only letters, digits and . _ - : @ + [ ] are allowed");
  }
  if (!o.local_addr.empty() && !valid_token(o.local_addr)) {
    throw RendezvousOptionError(b + "--local-addr=" + o.local_addr + ": not an address");
  }
  auto positive = [&](std::chrono::milliseconds d, const char* name) {
    if (d.count() <= 0) {
      throw RendezvousOptionError(b + "--rdzv-conf " + name + ": must be greater than 0");
    }
  };
  positive(o.join_timeout, "join_timeout");
  positive(o.close_timeout, "close_timeout");
  positive(o.keep_alive_interval, "keep_alive_interval");
  positive(o.read_timeout, "read_timeout");
  if (o.last_call_timeout.count() < 0) {
    throw RendezvousOptionError(b + "--rdzv-conf last_call_timeout: must be >= 0");
  }
  if (o.keep_alive_max_attempt < 1) {
    throw RendezvousOptionError(b + "--rdzv-conf keep_alive_max_attempt: must be at least 1");
  }
}

std::chrono::milliseconds time_left(Clock::time_point deadline, std::chrono::milliseconds cap) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return std::clamp(left, std::chrono::milliseconds(1), cap);
}

std::chrono::milliseconds start_first_round(RendezvousOptions* o, std::chrono::milliseconds cap) {
  if (o->first_round_deadline) return time_left(*o->first_round_deadline, cap);
  o->first_round_deadline = Clock::now() + o->join_timeout;
  return std::min(cap, o->join_timeout);
}

namespace {

// Whether something accepts TCP connections on this machine at `bind_host`:`port` (the address
// a store server was to bind; a wildcard is asked on loopback). A loopback connect answers at
// once, accepted or refused; 200 ms bounds it all the same.
bool someone_listens_here(const std::string& bind_host, uint16_t port) {
  std::string host = bind_host;
  if (host == "0.0.0.0") host = "127.0.0.1";
  if (host == "::") host = "::1";
  store::net::OpenError error;
  int fd =
      store::net::open_socket(host, port, Clock::now() + std::chrono::milliseconds(200), &error);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

}  // namespace

std::unique_ptr<store::StoreServer> host_store(
    const Endpoint& endpoint, const std::string& token, bool forced, const char* backend,
    const std::vector<std::pair<std::string, std::string>>& seed, std::string* not_hosted) {
  store::StoreServerOptions so;
  so.host = is_numeric_ip(endpoint.host) ? endpoint.host : "0.0.0.0";
  so.port = endpoint.port;
  so.token = token;
  so.seed = seed;
  // Two agents on one machine that both take the endpoint for theirs (both "nodes" of a test
  // cluster on one host) race for the port, and the loser becomes a client. Once under SLURM on
  // one machine neither hosted: both waited for a store that never came. The cause is not
  // confirmed (perhaps both listen() calls failing after both SO_REUSEADDR binds succeeded; 3000
  // tight tries did not reproduce that). So a failure while nothing listens on the port is tried
  // again, after a random pause so the two part ways; 8 tries, under 0.4 s in all.
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> pause_ms(5, 40);
  for (int attempt = 1;; ++attempt) {
    try {
      return store::StoreServer::start(so);
    } catch (const store::StoreError& e) {
      if (attempt < 8 && !someone_listens_here(so.host, so.port)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms(rng)));
        continue;
      }
      if (forced) {
        throw RendezvousError(std::string(backend) + " rendezvous: cannot host the store on " +
                              so.host + ":" + std::to_string(endpoint.port) + ": " + e.what());
      }
      spdlog::info("{} rendezvous: not hosting the store ({}); connecting to {}:{} as a client",
                   backend, e.what(), endpoint.host, endpoint.port);
      if (not_hosted) *not_hosted = e.what();
      return nullptr;
    }
  }
}

}  // namespace trun::rendezvous
