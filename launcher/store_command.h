#pragma once
// `trun store`: runs the rendezvous store on its own until SIGINT/SIGTERM.

namespace trun::launcher {

// argv without the program name and the "store" word. Returns the process exit code.
int run_store_command(int argc, char** argv);

}  // namespace trun::launcher
