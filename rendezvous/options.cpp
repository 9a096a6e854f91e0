// The rendezvous options (options.h): --rdzv-conf parsing, validation, handler_options, and
// the backend registry (handler.h).
#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "base/decimal.h"
#include "rendezvous/dynamic_rendezvous.h"
#include "rendezvous/handler.h"
#include "rendezvous/round_rendezvous.h"
#include "rendezvous/static_rendezvous.h"
#include "store/socket_conn.h"

namespace trun::rendezvous {
namespace {

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

// The longest duration any --rdzv-conf key accepts (about 115 days), and the resolution of all
// of them: a value below it but above 0 would round to 0.
constexpr double kMaxSeconds = 1e7;
constexpr double kResolutionSeconds = 0.001;

// A duration key's value: seconds, fractions allowed, in 0.001..1e7, or also exactly 0 where
// `zero` says what 0 means. Checked when the command line is read (so --dry-run refuses it too),
// with the accepted range in the message; nan, inf, negative values and values that would round
// to 0 ms (1e-9) are refused.
std::chrono::milliseconds parse_seconds(const std::string& key, const std::string& value,
                                        const char* zero = nullptr) {
  char* end = nullptr;
  errno = 0;
  const double s = std::strtod(value.c_str(), &end);
  const bool number =
      !value.empty() && end == value.c_str() + value.size() && errno == 0 && std::isfinite(s);
  const bool in_range =
      number && ((s == 0 && zero != nullptr) || (s >= kResolutionSeconds && s <= kMaxSeconds));
  if (!in_range) {
    throw RendezvousOptionError(
        "--rdzv-conf " + key + "=" + value + ": expected a number of seconds from 0.001 to 1e7" +
        (zero != nullptr ? std::string(", or 0 (") + zero + ")" : std::string()) +
        (number && s > 0 && s < kResolutionSeconds ? " (trun counts in milliseconds)" : ""));
  }
  return std::chrono::milliseconds(static_cast<int64_t>(std::llround(s * 1000)));
}

int parse_count(const std::string& key, const std::string& value) {
  // strtol's syntax as always: a leading '+' or spaces are taken.
  long v = 0;
  if (!base::parse_decimal(value, &v, base::DecimalSyntax{true, true}) || v < 1 || v > 1000000) {
    throw RendezvousOptionError("--rdzv-conf " + key + "=" + value +
                                ": expected a whole number >= 1 (at most 1000000)");
  }
  return static_cast<int>(v);
}

std::string lowercase(const std::string& value) {
  std::string v;
  for (char c : value) v += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return v;
}

bool parse_bool(const std::string& key, const std::string& value) {
  const std::string v = lowercase(value);
  if (v == "1" || v == "true" || v == "yes" || v == "y" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "n" || v == "off") return false;
  throw RendezvousOptionError("--rdzv-conf " + key + "=" + value +
                              ": expected true or false (also 1/0, yes/no)");
}

const char* const kConfKeys[] = {"join_timeout",
                                 "last_call_timeout",
                                 "close_timeout",
                                 "keep_alive_interval",
                                 "keep_alive_max_attempt",
                                 "read_timeout",
                                 "progress_interval",
                                 "is_host",
                                 "failover",
                                 "timeout",
                                 "use_libuv",
                                 "store_type",
                                 "etcd_prefix",
                                 "protocol"};
// torchrun's etcd backends' certificate keys: known, and refused (no TLS).
const char* const kTlsKeys[] = {"cacert", "cert", "key", "ca_cert", "ssl_cert", "ssl_cert_key"};

}  // namespace

std::map<std::string, std::string> parse_rdzv_conf(const std::string& text) {
  std::map<std::string, std::string> out;
  if (trim(text).empty()) return out;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    std::string item = trim(text.substr(pos, comma - pos));
    pos = comma + 1;
    if (item.empty()) {
      throw RendezvousOptionError("--rdzv-conf=" + text + ": empty entry (expected key=value)");
    }
    size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0) {
      throw RendezvousOptionError("--rdzv-conf=" + text + ": malformed entry '" + item +
                                  "' (expected key=value)");
    }
    std::string key = trim(item.substr(0, eq));
    std::string value = trim(item.substr(eq + 1));
    if (!out.emplace(key, value).second) {
      throw RendezvousOptionError("--rdzv-conf=" + text + ": key '" + key + "' given twice");
    }
  }
  return out;
}

RdzvConf read_rdzv_conf(const std::map<std::string, std::string>& conf) {
  RdzvConf c;
  // In key order: with both join_timeout and timeout given, timeout's value stays.
  for (auto& [key, value] : conf) {
    if (key == "join_timeout" || key == "timeout") {
      c.join_timeout = parse_seconds(key, value);
    } else if (key == "last_call_timeout") {
      c.last_call_timeout = parse_seconds(key, value, "no last call");
    } else if (key == "close_timeout") {
      c.close_timeout = parse_seconds(key, value);
    } else if (key == "keep_alive_interval") {
      c.keep_alive_interval = parse_seconds(key, value);
    } else if (key == "read_timeout") {
      c.read_timeout = parse_seconds(key, value);
    } else if (key == "progress_interval") {
      c.progress_interval = parse_seconds(key, value, "no progress lines");
    } else if (key == "keep_alive_max_attempt") {
      c.keep_alive_max_attempt = parse_count(key, value);
    } else if (key == "is_host") {
      c.is_host = parse_bool(key, value);
    } else if (key == "failover") {
      c.failover = parse_bool(key, value);
    } else if (key == "store_type") {
      // torchrun's c10d also offers a FileStore on a shared file system; trun's is TCP only.
      if (lowercase(value) != "tcp") {
        throw RendezvousOptionError("--rdzv-conf store_type=" + value +
                                    ": trun's rendezvous store is TCP only (store_type=tcp)");
      }
    } else if (key == "etcd_prefix") {
      if (value.empty()) throw RendezvousOptionError("--rdzv-conf etcd_prefix: must not be empty");
      c.etcd_prefix = value;
    } else if (key == "protocol") {
      // torchrun's etcd backends take http or https; trun speaks plain HTTP to etcd.
      if (lowercase(value) != "http") {
        throw RendezvousOptionError("--rdzv-conf protocol=" + value +
                                    ": trun reaches etcd over plain HTTP only (no TLS)");
      }
    } else if (std::find(std::begin(kTlsKeys), std::end(kTlsKeys), key) != std::end(kTlsKeys)) {
      throw RendezvousOptionError("--rdzv-conf " + key +
                                  ": TLS to etcd is not supported (trun reaches etcd over plain "
                                  "HTTP; keep etcd's client URL on a trusted network)");
    } else if (key == "use_libuv") {
      parse_bool(key, value);  // torchrun's choice of PyTorch store server; trun's has one kind
    } else {
      std::string known;
      for (const char* k : kConfKeys) known += std::string(known.empty() ? "" : ", ") + k;
      throw RendezvousOptionError("--rdzv-conf: unknown key '" + key + "' (known: " + known + ")");
    }
  }
  return c;
}

void apply_rdzv_conf(const RdzvConf& c, RendezvousOptions* o) {
  if (c.join_timeout) o->join_timeout = *c.join_timeout;
  if (c.last_call_timeout) o->last_call_timeout = *c.last_call_timeout;
  if (c.close_timeout) o->close_timeout = *c.close_timeout;
  if (c.keep_alive_interval) o->keep_alive_interval = *c.keep_alive_interval;
  if (c.keep_alive_max_attempt) o->keep_alive_max_attempt = *c.keep_alive_max_attempt;
  if (c.read_timeout) o->read_timeout = *c.read_timeout;
  if (c.progress_interval) o->progress_interval = *c.progress_interval;
  if (c.is_host) o->is_host = *c.is_host;
  if (c.failover) o->failover = *c.failover;
  if (c.etcd_prefix) o->etcd_prefix = *c.etcd_prefix;
}

void apply_rdzv_conf(const std::map<std::string, std::string>& conf, RendezvousOptions* o) {
  apply_rdzv_conf(read_rdzv_conf(conf), o);
}

RendezvousConfig standalone_config(RendezvousConfig config) {
  config.backend = BackendKind::kStatic;
  config.node_rank = 0;
  config.master_addr = "127.0.0.1";
  config.master_port = 0;
  return config;
}

const char* backend_name(BackendKind kind) {
  switch (kind) {
    case BackendKind::kStatic:
      return "static";
    case BackendKind::kC10d:
      return "c10d";
    case BackendKind::kEtcd:
      return "etcd";
  }
  return "static";
}

std::optional<BackendKind> parse_backend_kind(std::string_view name) {
  if (name == "static") return BackendKind::kStatic;
  if (name == "c10d") return BackendKind::kC10d;
  if (name == "etcd" || name == "etcd-v2") return BackendKind::kEtcd;  // torchrun's two names
  return std::nullopt;
}

RendezvousOptions handler_options(const RendezvousConfig& config, const std::string& run_id,
                                  int min_nodes, int max_nodes) {
  RendezvousOptions o;
  o.run_id = run_id;
  if (config.backend != BackendKind::kStatic) {
    o.endpoint = config.endpoint;
    o.min_nodes = min_nodes;
    o.max_nodes = max_nodes;
    o.local_addr = config.local_addr;
    o.store_token = config.store_token;
    apply_rdzv_conf(config.conf, &o);
    return o;
  }
  // torchrun's static backend has one timeout, for joining and for the store alike.
  o.min_nodes = o.max_nodes = max_nodes;
  o.node_rank = config.node_rank;
  o.master_addr = config.master_addr;
  o.master_port = config.master_port;
  o.join_timeout = config.conf.join_timeout.value_or(std::chrono::seconds(300));
  o.read_timeout = o.join_timeout;
  if (config.conf.progress_interval) o.progress_interval = *config.conf.progress_interval;
  return o;
}

bool is_rdzv_conf_key(const std::string& key) {
  for (const char* k : kConfKeys) {
    if (key == k) return true;
  }
  for (const char* k : kTlsKeys) {
    if (key == k) return true;
  }
  return false;
}

void abandon_store_connection_retries() { store::net::abandon_connect_retries(); }

std::vector<std::string> rendezvous_backend_names() { return {"c10d", "etcd", "static"}; }

void check_backend_options(const std::string& name, const RendezvousOptions& options) {
  const bool etcd = name == "etcd" || name == "etcd-v2";  // torchrun's two names
  if (!etcd && !options.etcd_prefix.empty()) {
    throw RendezvousOptionError("--rdzv-backend=" + name +
                                ": --rdzv-conf etcd_prefix is only for --rdzv-backend=etcd");
  }
  if (etcd && !options.endpoint.empty()) parse_etcd_endpoints(options.endpoint);
  // The port is only a default here: the check is of the form.
  if (name == "c10d" && !options.endpoint.empty()) parse_c10d_endpoints(options.endpoint);
}

namespace {

// After check_backend_options.
std::unique_ptr<RendezvousHandler> create_checked(BackendKind kind,
                                                  const RendezvousOptions& options) {
  switch (kind) {
    case BackendKind::kC10d:
      return create_c10d_rendezvous(options);
    case BackendKind::kEtcd:
      return create_etcd_rendezvous(options);
    case BackendKind::kStatic:
      break;
  }
  return create_static_rendezvous(options);
}

}  // namespace

std::unique_ptr<RendezvousHandler> create_rendezvous_handler(BackendKind kind,
                                                             const RendezvousOptions& options) {
  check_backend_options(backend_name(kind), options);
  return create_checked(kind, options);
}

std::unique_ptr<RendezvousHandler> create_rendezvous_handler(const std::string& name,
                                                             const RendezvousOptions& options) {
  if (const auto kind = parse_backend_kind(name)) {
    check_backend_options(name, options);  // its messages name the backend as given
    return create_checked(*kind, options);
  }
  std::string known;
  for (auto& n : rendezvous_backend_names()) known += (known.empty() ? "" : ", ") + n;
  throw RendezvousOptionError("--rdzv-backend=" + name +
                              ": unknown rendezvous backend (known: " + known + ")");
}

}  // namespace trun::rendezvous
