#pragma once
// The learned timeouts agreed across nodes (issue 36, docs/hangs.md "Across nodes"): each node's
// TimeoutRule learns from its own ranks; before each group starts, the agent merges what it
// learned into one record in the job's store (the longest interval and the most intervals per
// class, over every node that wrote) and adopts the merged record. So every node judges the next
// group with the same timeouts, a node that joins later (a spare, a replacement) starts warm
// instead of in the 30-minute warm-up, and what was learned survives the restart of any node's
// agent for as long as the store lives (the whole job; with etcd, the etcd cluster).
//
// The record is a compare-and-set on one key: a node writes only when it knows a longer interval
// or more intervals than the record holds, so of N nodes with similar intervals about ln N write
// and the rest read once.

#include <map>
#include <string>

#include "agent/hang_rules.h"

namespace trun::store {
class Store;
}

namespace trun::agent::hang {

using LearnedMap = std::map<TimeoutClass, TimeoutRule::Learned>;

// The most section classes a record holds: section names are the workers' text, and a program that
// names a section per step (or a job whose programs changed names over many restarts) must not
// grow the record, which every node reads before each group, without end. The first 64 stay; a
// section beyond them is judged by the step rule (as a section the board has no room for is).
constexpr int kMaxLearnedSections = 64;

// "startup", "step", "checkpoint" or "section <name>" (TimeoutClass::name) back to the class;
// false for anything else.
bool class_from_name(const std::string& name, TimeoutClass* out);

// The record's text: a JSON object, class name -> {"intervals", "longest_s"}.
std::string encode_learned(const LearnedMap& learned);
// The record read back. What is not a well-formed entry (a foreign or damaged record, a negative
// or non-finite interval) is skipped, never thrown; sections beyond kMaxLearnedSections too.
LearnedMap decode_learned(const std::string& text);
// Per class, the most intervals and the longest interval of either; a section class only in `b`
// is added while `a` holds fewer than kMaxLearnedSections.
LearnedMap merge_learned(LearnedMap a, const LearnedMap& b);

// The job's record key (in the run store, beside trun status's records).
std::string learned_key(const std::string& run_id);

// Merges `local` into the record at `key` (compare-and-set, at most `max_tries` rounds against
// concurrent writers) and returns the merged record, which includes `local`. Throws the store's
// errors; after `max_tries` lost races returns the merge of the last record read.
LearnedMap agree_learned(store::Store& store, const std::string& key, const LearnedMap& local,
                         int max_tries = 16);

}  // namespace trun::agent::hang
