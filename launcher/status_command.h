#pragma once
// `trun status`: what a running job looks like, read from its rendezvous state (c10d, static or
// etcd) and the status record each agent publishes there (agent/node_status.h): the current
// round, each node (address, group rank, workers, alive / waiting / left), restarts used and left,
// the last failure. A table for people, --json for scripts.
//
// Read-only: it connects as a plain client and only reads keys (and, for etcd, counts a ticket
// prefix); it never joins, takes a ticket, arms a lease or writes, so a running job does not
// notice it. Every read is bounded by --timeout.
//
// Exit codes: 0 shown; 1 no job with that --rdzv-id at the endpoint; 2 invalid command line;
// 3 the endpoint cannot be reached (nothing listens, a timeout, a refused token).

namespace trun::launcher {

// argv without the program name and the "status" word. Returns the process exit code.
int run_status_command(int argc, char** argv);

}  // namespace trun::launcher
