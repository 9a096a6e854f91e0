#include "rendezvous/etcd/client.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <cstring>
#include <nlohmann/json.hpp>
#include <thread>

namespace trun::rendezvous::etcd {
namespace {

namespace asio = boost::asio;
namespace http = boost::beast::http;
using boost::system::error_code;
using json = nlohmann::json;
using tcp = asio::ip::tcp;

constexpr uint64_t kMaxResponseBytes = 256ull << 20;
constexpr Duration kConnectEach{2000};  // per member, when there are several

const char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

}  // namespace

std::string base64(std::string_view in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out += kB64[(v >> s) & 63];
  }
  if (i < in.size()) {
    uint32_t v = uint8_t(in[i]) << 16;
    if (i + 1 < in.size()) v |= uint8_t(in[i + 1]) << 8;
    out += kB64[(v >> 18) & 63];
    out += kB64[(v >> 12) & 63];
    out += i + 1 < in.size() ? kB64[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

std::string unbase64(std::string_view in) {
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    const char* p = c == '=' ? nullptr : std::strchr(kB64, c);
    if (p == nullptr || c == '\0') continue;  // padding (etcd never sends other characters)
    acc = (acc << 6) | static_cast<uint32_t>(p - kB64);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xFF);
    }
  }
  return out;
}

namespace {

// The gateway writes int64 fields as JSON strings and leaves out fields equal to their default.
int64_t int_field(const json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return 0;
  if (it->is_string()) return std::stoll(it->get<std::string>());
  return it->get<int64_t>();
}

std::string bytes_field(const json& j, const char* name) {
  auto it = j.find(name);
  return it == j.end() ? std::string() : unbase64(it->get<std::string>());
}

json parse_answer(const std::string& text, const std::string& what) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw store::StoreError(what + ": unreadable answer from etcd: " + e.what());
  }
}

KeyValue decode_kv(const json& j) {
  KeyValue kv;
  kv.key = bytes_field(j, "key");
  kv.value = bytes_field(j, "value");
  kv.create_revision = int_field(j, "create_revision");
  kv.mod_revision = int_field(j, "mod_revision");
  return kv;
}

std::optional<KeyValue> first_kv(const json& range_response) {
  auto it = range_response.find("kvs");
  if (it == range_response.end() || it->empty()) return std::nullopt;
  return decode_kv(it->at(0));
}

int64_t header_revision(const json& j) {
  auto it = j.find("header");
  return it == j.end() ? 0 : int_field(*it, "revision");
}

json encode_op(const Op& op) {
  if (op.kind == Op::Kind::kRange) return {{"request_range", {{"key", base64(op.key)}}}};
  if (op.kind == Op::Kind::kCountPrefix) {
    return {{"request_range",
             {{"key", base64(op.key)},
              {"range_end", base64(prefix_end(op.key))},
              {"count_only", true}}}};
  }
  json put = {{"key", base64(op.key)}, {"value", base64(op.value)}};
  if (op.lease != 0) put["lease"] = std::to_string(op.lease);
  return {{"request_put", put}};
}

json encode_compare(const Compare& c) {
  json j = {{"key", base64(c.key)}, {"result", "EQUAL"}};
  switch (c.target) {
    case Compare::Target::kCreateRevision:
      j["target"] = "CREATE";
      j["create_revision"] = std::to_string(c.revision);
      break;
    case Compare::Target::kModRevision:
      j["target"] = "MOD";
      j["mod_revision"] = std::to_string(c.revision);
      break;
    case Compare::Target::kValue:
      j["target"] = "VALUE";
      j["value"] = base64(c.value);
      break;
  }
  return j;
}

}  // namespace

// One HTTP/1.1 connection driven by its own io_context: every operation runs on the calling
// thread until it completes, its deadline passes (the socket's operations are cancelled), or
// interrupt() cancels it from another thread.
class HttpConnection {
 public:
  explicit HttpConnection(const Endpoint& target) { retarget(target); }

  // The endpoint the next connect() goes to (owning thread only; closes the connection).
  void retarget(const Endpoint& target) {
    close();
    host_ = target.host;
    port_ = target.port;
    endpoint_ = target.text();
  }

  bool is_open() const { return socket_.is_open(); }
  void close() {
    error_code ignored;
    socket_.close(ignored);
    buffer_.clear();
    stream_.reset();
  }

  void connect(Clock::time_point deadline) {
    close();
    error_code ec;
    tcp::resolver resolver(ioc_);
    auto endpoints = resolver.resolve(host_, std::to_string(port_), ec);
    if (ec)
      throw store::StoreError("etcd at " + endpoint_ +
                              ": cannot resolve the host: " + ec.message());
    bool timed_out = false;
    ec = run(
        [&](auto handler) {
          asio::async_connect(
              socket_, endpoints,
              [handler](error_code e, const tcp::endpoint&) mutable { handler(e); });
        },
        deadline, &timed_out);
    if (ec) {
      close();
      if (timed_out) throw store::StoreTimeoutError("etcd at " + endpoint_ + ": connect timed out");
      if (interrupted_) throw store::StoreError("etcd at " + endpoint_ + ": interrupted");
      throw store::StoreError("etcd at " + endpoint_ + ": cannot connect: " + ec.message());
    }
    error_code ignored;
    socket_.set_option(tcp::no_delay(true), ignored);
  }

  // Sends a POST of `body` (JSON) to `target`. Returns the error (timed_out says whether it was
  // the deadline); the connection is unusable after an error.
  error_code send(const std::string& target, const std::string& body, Clock::time_point deadline,
                  bool* timed_out) {
    http::request<http::string_body> req{http::verb::post, target, 11};
    req.set(http::field::host, endpoint_);
    req.set(http::field::content_type, "application/json");
    req.keep_alive(true);
    req.body() = body;
    req.prepare_payload();
    return run(
        [&](auto handler) {
          http::async_write(socket_, req, [handler](error_code e, size_t) mutable { handler(e); });
        },
        deadline, timed_out);
  }

  error_code read_response(http::response<http::string_body>* out, Clock::time_point deadline,
                           bool* timed_out) {
    http::response_parser<http::string_body> parser;
    parser.body_limit(kMaxResponseBytes);
    auto ec = run(
        [&](auto handler) {
          http::async_read(socket_, buffer_, parser,
                           [handler](error_code e, size_t) mutable { handler(e); });
        },
        deadline, timed_out);
    if (!ec) *out = parser.release();
    return ec;
  }

  // Streaming responses: the header first, then the body as it arrives.
  error_code read_stream_header(Clock::time_point deadline, bool* timed_out) {
    stream_.emplace();
    stream_->body_limit(boost::none);
    return run(
        [&](auto handler) {
          http::async_read_header(socket_, buffer_, *stream_,
                                  [handler](error_code e, size_t) mutable { handler(e); });
        },
        deadline, timed_out);
  }
  unsigned stream_status() const { return stream_->get().result_int(); }
  bool stream_done() const { return stream_->is_done(); }
  // Appends what arrived of the body to `out`. A deadline leaves the stream usable.
  error_code read_stream(std::string* out, Clock::time_point deadline, bool* timed_out) {
    auto ec = run(
        [&](auto handler) {
          http::async_read_some(socket_, buffer_, *stream_,
                                [handler](error_code e, size_t) mutable { handler(e); });
        },
        deadline, timed_out);
    auto& body = stream_->get().body();
    out->append(body);
    body.clear();
    return ec;
  }

  void interrupt() {
    interrupted_ = true;
    asio::post(ioc_, [this] {
      error_code ignored;
      socket_.cancel(ignored);
    });
  }
  bool interrupted() const { return interrupted_.load(); }
  const std::string& endpoint() const { return endpoint_; }

 private:
  // Runs one asynchronous operation to completion on this thread. `initiate(handler)` starts it;
  // `handler(error_code)` must be called once.
  template <class Initiate>
  error_code run(Initiate&& initiate, Clock::time_point deadline, bool* timed_out) {
    *timed_out = false;
    if (interrupted_) return asio::error::operation_aborted;
    error_code result = asio::error::would_block;
    asio::steady_timer timer(ioc_, deadline);
    timer.async_wait([&](error_code ec) {
      if (ec) return;
      *timed_out = true;
      error_code ignored;
      socket_.cancel(ignored);
    });
    initiate([&](error_code ec) {
      result = ec;
      timer.cancel();
    });
    ioc_.restart();
    ioc_.run();
    if (!result) *timed_out = false;
    if (result && interrupted_) *timed_out = false;
    return result;
  }

  std::string host_;
  uint16_t port_ = 0;
  std::string endpoint_;
  asio::io_context ioc_;  // before socket_: destroyed after it, dropping any posted cancel
  tcp::socket socket_{ioc_};
  boost::beast::flat_buffer buffer_;
  std::optional<http::response_parser<http::string_body>> stream_;
  std::atomic<bool> interrupted_{false};
};

std::string to_string(const Endpoints& endpoints) {
  std::string out;
  for (auto& e : endpoints) out += (out.empty() ? "" : ",") + e.text();
  return out;
}

namespace {
// Connects `conn` to the first of `endpoints` that accepts, trying them in order from `*first`
// (which is updated); one try each. Throws what the last one threw, naming all when several.
void connect_first(HttpConnection* conn, const Endpoints& endpoints, size_t* first,
                   Clock::time_point deadline) {
  std::string errors;
  for (size_t i = 0; i < endpoints.size(); ++i) {
    size_t idx = (*first + i) % endpoints.size();
    conn->retarget(endpoints[idx]);
    try {
      // With others to try, one member that does not answer may not take the whole deadline.
      conn->connect(endpoints.size() == 1 ? deadline
                                          : std::min(deadline, Clock::now() + kConnectEach));
      *first = idx;
      return;
    } catch (const store::StoreTimeoutError&) {
      if (endpoints.size() == 1 || Clock::now() >= deadline) throw;
      errors += std::string(errors.empty() ? "" : "; ") + endpoints[idx].text() + " timed out";
    } catch (const store::StoreError& e) {
      if (endpoints.size() == 1 || conn->interrupted()) throw;
      errors += std::string(errors.empty() ? "" : "; ") + e.what();
    }
  }
  throw store::StoreError("no etcd endpoint accepted a connection: " + errors);
}
}  // namespace

Client::Client(Endpoints endpoints, Duration timeout, Duration connect_timeout)
    : endpoints_(std::move(endpoints)),
      endpoint_(to_string(endpoints_)),
      timeout_(timeout),
      conn_(std::make_unique<HttpConnection>(endpoints_.at(0))) {
  // etcd may still be starting (a job script that starts it just before the agents).
  const auto deadline = Clock::now() + connect_timeout;
  auto pause = Duration(50);
  for (;;) {
    try {
      connect_any(std::min(deadline, Clock::now() + timeout_));
      last_used_ = Clock::now();
      return;
    } catch (const store::StoreError& e) {
      auto left = std::chrono::duration_cast<Duration>(deadline - Clock::now());
      if (left <= Duration(0)) {
        char waited[32];
        std::snprintf(waited, sizeof waited, "%.1f", connect_timeout.count() / 1000.0);
        throw store::StoreError(std::string(e.what()) + " (retried for " + waited + " s)");
      }
      std::this_thread::sleep_for(std::min(pause, left));
      pause = std::min(pause * 2, Duration(1000));
    }
  }
}

Client::~Client() = default;

void Client::connect_any(Clock::time_point deadline) {
  connect_first(conn_.get(), endpoints_, &current_, deadline);
}

std::string Client::call(const std::string& path, const std::string& body, bool idempotent) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto deadline = Clock::now() + timeout_;
  const std::string what = "etcd at " + endpoint_ + ": " + path;
  for (int attempt = 0;; ++attempt) {
    bool fresh = false;
    // A request that must not be repeated goes on a fresh connection when this one sat idle long
    // enough for something on the way (or etcd) to have dropped it unnoticed.
    if (!idempotent && conn_->is_open() && Clock::now() - last_used_ > kIdleReconnect) {
      conn_->close();
    }
    if (!conn_->is_open()) {
      connect_any(deadline);
      fresh = true;
    }
    ++requests_;
    bool timed_out = false;
    http::response<http::string_body> res;
    auto ec = conn_->send(path, body, deadline, &timed_out);
    if (!ec) ec = conn_->read_response(&res, deadline, &timed_out);
    if (ec) {
      conn_->close();
      if (timed_out) {
        current_ =
            (current_ + 1) % endpoints_.size();  // a hung member: the next call tries another
        throw store::StoreTimeoutError(what + ": no answer in time");
      }
      // A kept-alive connection that etcd closed meanwhile: retry once on a new one, when
      // repeating the request is harmless.
      bool stale = ec == http::error::end_of_stream || ec == asio::error::eof ||
                   ec == asio::error::connection_reset || ec == asio::error::broken_pipe;
      if (stale && !fresh && idempotent && attempt == 0) continue;
      throw store::StoreError(what + ": " + ec.message());
    }
    last_used_ = Clock::now();
    if (!res.keep_alive()) conn_->close();
    // A member that cannot serve (shutting down: its gateway answers 503 while the rest of the
    // cluster is fine) is left for the next one; a harmless request is repeated there at once.
    if (res.result_int() >= 500 && endpoints_.size() > 1) {
      conn_->close();
      current_ = (current_ + 1) % endpoints_.size();
      if (idempotent && attempt < static_cast<int>(endpoints_.size())) continue;
    }
    if (res.result() != http::status::ok) {
      std::string message = res.body();
      int code = 0;
      try {
        auto j = json::parse(res.body());
        message = j.value("message", message);
        code = static_cast<int>(int_field(j, "code"));
      } catch (const json::exception&) {
      }
      throw EtcdError(what + ": HTTP " + std::to_string(res.result_int()) + ": " + message, code);
    }
    return std::move(res.body());
  }
}

std::optional<KeyValue> Client::get(const std::string& key, int64_t* revision) {
  json req = {{"key", base64(key)}};
  auto j = parse_answer(call("/v3/kv/range", req.dump(), true), endpoint_);
  if (revision) *revision = header_revision(j);
  return first_kv(j);
}

int64_t Client::put(const std::string& key, const std::string& value, int64_t lease) {
  json req = {{"key", base64(key)}, {"value", base64(value)}};
  if (lease != 0) req["lease"] = std::to_string(lease);
  return header_revision(parse_answer(call("/v3/kv/put", req.dump(), true), endpoint_));
}

bool Client::erase(const std::string& key) {
  json req = {{"key", base64(key)}};
  auto j = parse_answer(call("/v3/kv/deleterange", req.dump(), false), endpoint_);
  return int_field(j, "deleted") > 0;
}

int64_t Client::count_prefix(const std::string& prefix) {
  json req = encode_op(Op::count_prefix(prefix))["request_range"];
  return int_field(parse_answer(call("/v3/kv/range", req.dump(), true), endpoint_), "count");
}

TxnResult Client::txn(const std::vector<Compare>& compares, const std::vector<Op>& success,
                      const std::vector<Op>& failure) {
  json req = {{"compare", json::array()}, {"success", json::array()}, {"failure", json::array()}};
  for (auto& c : compares) req["compare"].push_back(encode_compare(c));
  for (auto& op : success) req["success"].push_back(encode_op(op));
  for (auto& op : failure) req["failure"].push_back(encode_op(op));
  auto j = parse_answer(call("/v3/kv/txn", req.dump(), false), endpoint_);
  TxnResult r;
  r.succeeded = j.value("succeeded", false);
  r.revision = header_revision(j);
  const auto& ops = r.succeeded ? success : failure;
  auto responses = j.find("responses");
  for (size_t i = 0; i < ops.size(); ++i) {
    json range;
    if (responses != j.end() && i < responses->size()) {
      range = responses->at(i).value("response_range", json::object());
    }
    bool read = ops[i].kind == Op::Kind::kRange && !range.is_null();
    r.reads.push_back(read ? first_kv(range) : std::nullopt);
    bool count = ops[i].kind == Op::Kind::kCountPrefix && !range.is_null();
    r.counts.push_back(count ? int_field(range, "count") : 0);
  }
  return r;
}

int64_t Client::lease_grant(Duration ttl) {
  int64_t seconds = std::max<int64_t>(1, (ttl.count() + 999) / 1000);
  json req = {{"TTL", std::to_string(seconds)}};
  auto j = parse_answer(call("/v3/lease/grant", req.dump(), false), endpoint_);
  int64_t id = int_field(j, "ID");
  if (id == 0) throw store::StoreError("etcd at " + endpoint_ + ": lease grant: " + j.dump());
  return id;
}

bool Client::lease_keep_alive(int64_t id) {
  json req = {{"ID", std::to_string(id)}};
  auto j = parse_answer(call("/v3/lease/keepalive", req.dump(), true), endpoint_);
  // A streaming call: the answer is wrapped in "result". A lease that is gone has no TTL.
  return int_field(j.value("result", json::object()), "TTL") > 0;
}

void Client::lease_revoke(int64_t id) {
  json req = {{"ID", std::to_string(id)}};
  try {
    call("/v3/lease/revoke", req.dump(), true);
  } catch (const EtcdError& e) {
    if (e.code() != EtcdError::kNotFound) throw;
  }
}

Watch::Watch(Endpoints endpoints, Options options)
    : conn_(std::make_unique<HttpConnection>(endpoints.at(0))),
      endpoints_(std::move(endpoints)),
      endpoint_(to_string(endpoints_)),
      options_(std::move(options)) {}

void Watch::open(Clock::time_point deadline) {
  if (conn_->interrupted())
    throw store::StoreError("etcd at " + endpoint_ + ": watch: interrupted");
  size_t first = options_.first_endpoint % endpoints_.size();
  connect_first(conn_.get(), endpoints_, &first, deadline);
  json create = {{"key", base64(options_.key)}};
  if (!options_.range_end.empty()) create["range_end"] = base64(options_.range_end);
  if (options_.start_revision > 0) {
    create["start_revision"] = std::to_string(options_.start_revision);
  }
  if (options_.prev_kv) create["prev_kv"] = true;
  json req = {{"create_request", create}};
  bool timed_out = false;
  auto ec = conn_->send("/v3/watch", req.dump(), deadline, &timed_out);
  if (!ec) ec = conn_->read_stream_header(deadline, &timed_out);
  if (ec) {
    if (timed_out)
      throw store::StoreTimeoutError("etcd at " + endpoint_ + ": watch: no answer in time");
    if (conn_->interrupted())
      throw store::StoreError("etcd at " + endpoint_ + ": watch: interrupted");
    throw store::StoreError("etcd at " + endpoint_ + ": watch: " + ec.message());
  }
  if (conn_->stream_status() != 200) {
    throw store::StoreError("etcd at " + endpoint_ + ": watch: HTTP " +
                            std::to_string(conn_->stream_status()));
  }
  while (!created_) {
    if (!next(deadline)) {
      throw store::StoreTimeoutError("etcd at " + endpoint_ + ": watch: not created in time");
    }
  }
}

Watch::~Watch() = default;

void Watch::interrupt() { conn_->interrupt(); }
bool Watch::interrupted() const { return conn_->interrupted(); }

std::optional<std::vector<WatchEvent>> Watch::next(Clock::time_point deadline) {
  const std::string what = "etcd at " + endpoint_ + ": watch";
  size_t nl;
  while ((nl = pending_.find('\n')) == std::string::npos) {
    if (conn_->stream_done()) throw store::StoreError(what + ": etcd ended the stream");
    bool timed_out = false;
    auto ec = conn_->read_stream(&pending_, deadline, &timed_out);
    if (timed_out) return std::nullopt;
    if (conn_->interrupted()) throw store::StoreError(what + ": interrupted");
    if (ec) throw store::StoreError(what + ": " + ec.message());
  }
  json message = parse_answer(pending_.substr(0, nl), what);
  pending_.erase(0, nl + 1);
  if (message.contains("error")) {
    throw store::StoreError(what + ": " +
                            message["error"].value("message", message["error"].dump()));
  }
  const json& result = message.value("result", json::object());
  if (result.value("created", false)) created_ = true;
  if (result.value("canceled", false)) {
    compact_revision_ = int_field(result, "compact_revision");
    throw store::StoreError(
        what + ": cancelled by etcd" +
        (compact_revision_ > 0
             ? " (history compacted up to revision " + std::to_string(compact_revision_) + ")"
             : ": " + result.value("cancel_reason", std::string("no reason given"))));
  }
  std::vector<WatchEvent> events;
  for (const auto& e : result.value("events", json::array())) {
    WatchEvent ev;
    ev.is_delete = e.value("type", std::string("PUT")) == "DELETE";
    ev.kv = decode_kv(e.value("kv", json::object()));
    if (e.contains("prev_kv")) ev.prev_kv = decode_kv(e["prev_kv"]);
    revision_ = std::max(revision_, ev.kv.mod_revision);
    events.push_back(std::move(ev));
  }
  return events;
}

std::string prefix_end(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    auto c = static_cast<unsigned char>(end.back());
    if (c < 0xFF) {
      end.back() = static_cast<char>(c + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

}  // namespace trun::rendezvous::etcd
