// fuzz-sources: store/wire.cpp
// libFuzzer target for the store's request decoder (store/wire.h), built and run by
// scripts/fuzz.sh. The input is treated as the byte stream of one connection: the dialect is
// detected from its start (or forced by the first input byte, so both dialects are reached from
// any input), then requests are decoded one after another, as the server does, with small limits
// so that the limit checks are hit often.
//
// Besides the sanitizers, it checks the decoder's own contract: a decoded request consumed at
// least one byte and no more than it was given, respected the limits, and decoding the same
// bytes again, or with extra bytes appended, gives the same request; a request that needs more
// bytes never becomes malformed from the bytes it already had.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "store/wire.h"

namespace wire = trun::store::wire;

namespace {

void check(bool ok) {
  if (!ok) std::abort();
}

bool same(const wire::Request& a, const wire::Request& b) {
  return a.op == b.op && a.keys == b.keys && a.values == b.values && a.number == b.number;
}

void check_limits(const wire::Request& r, const wire::Limits& limits) {
  check(r.keys.size() <= limits.max_keys_per_request);
  for (const auto& k : r.keys) check(k.size() <= limits.max_key_bytes);
  if (r.op == wire::Op::kAuthProof) return;  // its own fixed limit
  for (const auto& v : r.values) check(v.size() <= limits.max_value_bytes);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  wire::Limits limits;
  limits.max_key_bytes = 16;
  limits.max_value_bytes = 64;
  limits.max_keys_per_request = 4;

  // First byte: 0 = detect the dialect as the server does, 1 = force 1.13, 2 = force 2.x.
  uint8_t mode = data[0] % 3;
  std::string_view stream(reinterpret_cast<const char*>(data) + 1, size - 1);
  wire::Dialect dialect = wire::Dialect::kUnknown;
  if (mode == 0) {
    dialect = wire::detect_dialect(stream);
    // Detection looks at no more than the first 5 bytes, and more bytes never change it.
    if (dialect != wire::Dialect::kUnknown && stream.size() > 5) {
      check(wire::detect_dialect(stream.substr(0, 5)) == dialect);
    }
    if (dialect == wire::Dialect::kUnknown) return 0;
  } else {
    dialect = mode == 1 ? wire::Dialect::kV1 : wire::Dialect::kV2;
  }

  // Bounded by the input: every decoded request consumes at least one byte.
  while (!stream.empty()) {
    wire::Request request;
    wire::DecodeResult result = wire::decode(stream, dialect, limits, &request);
    if (result.status == wire::Status::kNeedMore) {
      check(result.consumed == 0);
      break;
    }
    if (result.status == wire::Status::kMalformed) {
      check(!result.error.empty());
      break;
    }
    check(result.consumed >= 1 && result.consumed <= stream.size());
    check_limits(request, limits);
    check(wire::query_byte(request.op, dialect) == static_cast<uint8_t>(stream[0]));

    // Decoding is deterministic and depends only on the consumed prefix.
    wire::Request again;
    std::string_view prefix = stream.substr(0, result.consumed);
    auto r2 = wire::decode(prefix, dialect, limits, &again);
    check(r2.status == wire::Status::kOk && r2.consumed == result.consumed && same(request, again));
    // Any shorter prefix needs more bytes (it cannot be malformed or a different request).
    if (result.consumed > 1) {
      wire::Request partial;
      auto r3 = wire::decode(prefix.substr(0, result.consumed - 1), dialect, limits, &partial);
      check(r3.status == wire::Status::kNeedMore);
    }
    stream.remove_prefix(result.consumed);
  }
  return 0;
}
