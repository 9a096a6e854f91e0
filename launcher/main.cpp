// trun: entry point. Dispatches subcommands; everything else is the launcher (issue 3).
#include <cstdio>
#include <cstring>

#include "launcher/store_command.h"

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "store") == 0) {
    return trun::launcher::run_store_command(argc - 1, argv + 1);
  }
  std::fprintf(stderr,
               "trun: usage: trun store [--host H] [--port P] [--store-token T]\n"
               "trun: the launcher itself is not built yet\n");
  return 2;
}
