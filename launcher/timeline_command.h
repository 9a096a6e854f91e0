#pragma once
// `trun timeline EVENTLOG... -o run.html`: one HTML page for a run from the --event-log files of
// its nodes (launcher/timeline.h draws it; docs/observability.md, "trun timeline").
//
// Input: regular files only (a FIFO, a device such as /dev/zero, a directory is refused before
// it is opened, and checked again after: opened without blocking); their sizes together at most
// --max-input-size (64 MiB by default), checked before reading and while reading; read in
// chunks, one line at a time (launcher/timeline.h's EventLogParser), so memory is about the
// events kept, never the file. The page is bounded too (render_timeline_html). Running out of
// memory anyway (a memory limit) is one line and exit 1, not an abort.
//
// Input errors: a file that cannot be read, is not a regular file or is too large ends the
// command (exit 1, one line naming the file and the reason). A line that is not an event (a
// node killed mid-write leaves half a line) is skipped with a warning naming the file and line;
// no event in any file is an error (exit 1). Command-line errors (no file, no -o, an unknown
// option, an output that is one of the inputs or exists and is not a regular file) exit 2.
// The page is written to a new temporary file next to the output and renamed, so a reader never
// sees half a page and no link at the output is followed. Every text printed from a file (its
// name too) goes through printable().

namespace trun::launcher {

// argv without the program name and the "timeline" word. Returns the process exit code.
int run_timeline_command(int argc, char** argv);

}  // namespace trun::launcher
