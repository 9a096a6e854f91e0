#pragma once
// `trun status`, printing: a JobStatus (status_read.h) as a table for people or one JSON object
// for scripts. Text from the store is made safe for a terminal: no control character of a
// record reaches the output. Pure functions of the status and the clock; thread-safe.

#include <string>

#include "launcher/status_read.h"

namespace trun::launcher::status {

// The table, ending in a newline.
std::string to_table(const JobStatus& js);
// One JSON object in printable ASCII, ending in a newline.
std::string to_json(const JobStatus& js);
// Text from the store, for the terminal: no control character reaches it.
std::string safe(const std::string& text);

}  // namespace trun::launcher::status
