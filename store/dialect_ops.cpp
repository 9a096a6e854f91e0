#include "store/dialect_ops.h"

namespace trun::store {

const char* to_string(StoreDialect dialect) {
  switch (dialect) {
    case StoreDialect::kAuto:
      return "auto";
    case StoreDialect::kTrun:
      return "trun";
    case StoreDialect::kTorch2:
      return "torch2";
    case StoreDialect::kTorch1_13:
      return "torch1.13";
  }
  return "?";
}

std::optional<StoreDialect> parse_store_dialect(std::string_view name) {
  for (auto d : {StoreDialect::kAuto, StoreDialect::kTrun, StoreDialect::kTorch2,
                 StoreDialect::kTorch1_13}) {
    if (name == to_string(d)) return d;
  }
  return std::nullopt;
}

namespace dialect {

const char* server_name(StoreDialect dialect) {
  switch (dialect) {
    case StoreDialect::kTorch1_13:
      return "PyTorch 1.13's TCPStore server";
    case StoreDialect::kTorch2:
      return "PyTorch 2.x's TCPStore server";
    default:
      return "trun's store server";
  }
}

}  // namespace dialect
}  // namespace trun::store
