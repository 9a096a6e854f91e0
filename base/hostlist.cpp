#include "base/hostlist.h"

#include <stdexcept>

namespace trun::base {
namespace {

struct Range {
  unsigned long long lo = 0, hi = 0;
  size_t width = 0;  // of the zero-padded bound, or 0
};

// One host expression: literal text and bracket groups, alternating.
struct Pattern {
  std::vector<std::string> literals;       // literals.size() == groups.size() + 1
  std::vector<std::vector<Range>> groups;  // each group's ranges, in order
};

[[noreturn]] void fail(const std::string& expression, const std::string& why) {
  throw std::invalid_argument("hostlist '" + expression + "': " + why);
}

unsigned long long parse_bound(const std::string& expression, const std::string& text) {
  if (text.empty()) fail(expression, "empty number in a range");
  if (text.size() > 18) fail(expression, "number '" + text + "' is too long");
  unsigned long long v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') fail(expression, "'" + text + "' in brackets is not a number");
    v = v * 10 + static_cast<unsigned long long>(c - '0');
  }
  return v;
}

std::vector<Range> parse_group(const std::string& expression, const std::string& body) {
  if (body.empty()) fail(expression, "empty brackets");
  std::vector<Range> out;
  size_t start = 0;
  for (;;) {
    const size_t comma = body.find(',', start);
    const std::string item =
        body.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const size_t dash = item.find('-');
    Range r;
    const std::string lo = item.substr(0, dash);
    const std::string hi = dash == std::string::npos ? lo : item.substr(dash + 1);
    r.lo = parse_bound(expression, lo);
    r.hi = parse_bound(expression, hi);
    if (r.hi < r.lo) fail(expression, "range '" + item + "' runs backwards");
    if (lo.size() > 1 && lo[0] == '0') r.width = lo.size();
    out.push_back(r);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

Pattern parse_pattern(const std::string& expression, const std::string& text) {
  if (text.empty()) fail(expression, "empty host name");
  Pattern p;
  std::string literal;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == ']') fail(expression, "']' without '['");
    if (c == ' ' || c == '\t' || c == '\n') fail(expression, "white space in a host name");
    if (c != '[') {
      literal += c;
      continue;
    }
    const size_t close = text.find(']', i + 1);
    if (close == std::string::npos) fail(expression, "'[' without ']'");
    const std::string body = text.substr(i + 1, close - i - 1);
    if (body.find('[') != std::string::npos) fail(expression, "nested '['");
    p.literals.push_back(literal);
    literal.clear();
    p.groups.push_back(parse_group(expression, body));
    i = close;
  }
  p.literals.push_back(literal);
  return p;
}

std::string padded(unsigned long long v, size_t width) {
  std::string s = std::to_string(v);
  if (s.size() < width) s.insert(0, width - s.size(), '0');
  return s;
}

// Appends the hosts of `p` (groups from `g` on, after `prefix`) to *out.
void expand(const std::string& expression, const Pattern& p, size_t g, const std::string& prefix,
            std::vector<std::string>* out) {
  if (g == p.groups.size()) {
    if (out->size() >= kMaxHosts) {
      fail(expression, "more than " + std::to_string(kMaxHosts) + " hosts");
    }
    out->push_back(prefix);
    return;
  }
  for (const Range& r : p.groups[g]) {
    for (unsigned long long v = r.lo;; ++v) {
      expand(expression, p, g + 1, prefix + padded(v, r.width) + p.literals[g + 1], out);
      if (v == r.hi) break;
    }
  }
}

// Top-level host expressions: split at commas outside brackets.
std::vector<std::string> split_top(const std::string& expression) {
  std::vector<std::string> parts;
  std::string cur;
  int depth = 0;
  for (char c : expression) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  parts.push_back(cur);
  return parts;
}

}  // namespace

std::vector<std::string> expand_hostlist(const std::string& expression) {
  std::vector<std::string> out;
  for (const auto& part : split_top(expression)) {
    const Pattern p = parse_pattern(expression, part);
    expand(expression, p, 0, p.literals[0], &out);
  }
  return out;
}

std::string first_host(const std::string& expression) {
  const Pattern p = parse_pattern(expression, split_top(expression).front());
  std::string host = p.literals[0];
  for (size_t g = 0; g < p.groups.size(); ++g) {
    host += padded(p.groups[g].front().lo, p.groups[g].front().width) + p.literals[g + 1];
  }
  return host;
}

}  // namespace trun::base
