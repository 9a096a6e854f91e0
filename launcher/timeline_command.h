#pragma once
// `trun timeline EVENTLOG... -o run.html`: one HTML page for a run from the --event-log files of
// its nodes (launcher/timeline.h draws it; docs/observability.md, "trun timeline").
//
// Input errors: a file that cannot be read ends the command (exit 1, one line naming the file
// and the reason). A line that is not an event (a node killed mid-write leaves half a line) is
// skipped with a warning naming the file and line; no event in any file is an error (exit 1).
// Command-line errors (no file, no -o, an unknown option) exit 2. The page is written to a
// temporary file next to the output and renamed, so a reader never sees half a page.

namespace trun::launcher {

// argv without the program name and the "timeline" word. Returns the process exit code.
int run_timeline_command(int argc, char** argv);

}  // namespace trun::launcher
