#pragma once
// The launcher's option values, one parser each: text -> the LaunchConfig field, or CliError
// naming the option, the value and what was expected ("--nnodes=0: expected a node count ...").
//
// Pure functions: no I/O, thread-safe.

#include <chrono>
#include <set>
#include <string>
#include <vector>

#include "agent/launch_config.h"

namespace trun::launcher {

// The highest local rank a per-rank setting may name (--nproc-per-node is at most 4096).
inline constexpr long long kMaxLocalRank = 4095;

std::vector<std::string> split(const std::string& s, char sep);
// Without leading and trailing blanks and tabs.
std::string trim(const std::string& s);

// A decimal integer as strtoll reads one, but all of `s` (leading blanks and '+' allowed).
bool parse_int(const std::string& s, long long& out);
// A finite number as strtod reads one, all of `s`.
bool parse_double(const std::string& s, double& out);

// An integer option's value, argparse's type=int with a range: "--flag=VALUE: expected ...".
long long whole_number(const std::string& flag, const std::string& value, long long lo,
                       long long hi, const char* expected);

// --nnodes: N or MIN:MAX with 1 <= MIN <= MAX <= 1000000.
void parse_nnodes(const std::string& value, int& min_nodes, int& max_nodes);

// torchrun's comma-separated filter list: ",," stands for a comma inside a filter.
std::vector<std::string> parse_filters(const std::string& value);

// --redirects / --tee: 0-3 for every rank, or a per-rank map like 0:1,1:3.
agent::StdSpec parse_std(const std::string& flag, const std::string& value);

// --local-ranks-filter: 0,1,2.
std::set<int> parse_ranks_filter(const std::string& value);

// Seconds (fractions allowed, at most 1e7) as milliseconds; `flag` names the value's origin.
std::chrono::milliseconds parse_seconds(const std::string& flag, const std::string& value,
                                        bool allow_zero);

// SIGTERM, TERM, term -> SIGTERM's number among the signals trun may handle; -1 otherwise.
int signal_number(const std::string& name);
// --signals-to-handle: names separated by commas, each number once, in order.
std::vector<int> parse_signals(const std::string& value);

}  // namespace trun::launcher
