#pragma once
// torchrun reads its command line with Python's argparse; trun with CLI11 2.1. This pre-pass
// rewrites argv (up to the training script) so that CLI11 reads it the way argparse would.
//
// A pure function of its arguments: no I/O, no CLI11 (the options come in as plain data), safe
// to call from any thread.

#include <optional>
#include <string>
#include <vector>

namespace trun::launcher {

// One option as the pre-pass needs to know it: its spellings and whether it takes a value.
struct ArgOption {
  std::vector<std::string> long_names;  // without "--": {"nproc-per-node", "nproc_per_node"}
  char short_name = '\0';               // 'r' for -r; '\0' for none
  bool takes_value = false;             // false for a flag
};

// What argparse takes for an option's value rather than for another option: anything not
// starting with '-', "-" alone, a negative number ("-1", "-.5"; trun has no option that looks
// like one) and anything with a space in it. `--log-dir -x` is therefore a missing value, as in
// torchrun, and `--log-dir=-x` the way to give it.
bool argparse_value(const std::string& s);

// Rewrites `args` (argv without the program name), up to the training script, into the form
// CLI11 2.1 reads the way argparse (torchrun) would:
// - allow_abbrev: a long option may be shortened to any prefix that names one option
//   (--nproc_per=2, --nnode=1); a prefix of several options is an error naming every candidate
//   (in the order of `options`);
// - an empty value (`--log-dir=`, `-r=`) is kept as the empty string: CLI11 would otherwise take
//   the next argument (`--nproc-per-node=2`) as the value;
// - `--opt VALUE` needs a VALUE that argparse would take (argparse_value): `--log-dir --tee 3`
//   is a missing value, not a directory named --tee;
// - a flag given a value must not give an empty one (`--standalone=`); argparse refuses any.
// The script's own arguments are never touched. An unknown option is left as it is (CLI11 names
// it). Returns the error line, if any (then `args` is unspecified).
std::optional<std::string> normalize_arguments(const std::vector<ArgOption>& options,
                                               std::vector<std::string>& args);

}  // namespace trun::launcher
