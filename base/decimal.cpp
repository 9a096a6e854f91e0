#include "base/decimal.h"

namespace trun::base {

std::optional<long long> parse_decimal_in(std::string_view text, long long lo, long long hi,
                                          std::string* error, DecimalSyntax syntax) {
  long long v = 0;
  const DecimalResult r = parse_decimal(text, &v, syntax);
  if (r.status == DecimalStatus::kOk && v >= lo && v <= hi) return v;
  // A number too large for long long is outside any range the caller can give, but callers have
  // always called it "not an integer" (strtoll's ERANGE): keep that.
  if (r.status != DecimalStatus::kOk) {
    *error = "'" + std::string(text) + "' is not an integer";
  } else {
    *error =
        std::string(text) + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  }
  return std::nullopt;
}

}  // namespace trun::base
