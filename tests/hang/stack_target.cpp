// A target for tests/hang/stack_dump_test.cpp: three threads, each in a distinctively named
// function that is never inlined, so each one's native stack can be recognised.
//   main thread      stack_target_read_here: blocked in read(0); answers "pong" to each line
//   thread "spinner" stack_target_spin_here: spins in user code, never in a system call
//   thread "sleeper" stack_target_sleep_here: blocked in nanosleep
// With argument "vfork", a fourth:
//   thread "vforker" stack_target_vfork_here: vfork()s a child that waits in pause(), so the
//                    thread waits for it in uninterruptible (killable) sleep, state D, where
//                    ptrace cannot stop it; when the child is killed it sleeps in nanosleep.
// Prints "ready" once all are in place (each thread says so through an atomic counter); exits
// when stdin is closed. The test ends it by its pid.

#include <pthread.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace {
std::atomic<int> g_in_place{0};
std::atomic<unsigned long> g_spins{0};
}  // namespace

// Global, C linkage: plain names in the symbol table.
extern "C" __attribute__((noinline)) void stack_target_spin_here() {
  g_in_place.fetch_add(1);
  for (;;) {
    g_spins.fetch_add(1, std::memory_order_relaxed);
    asm volatile("" ::: "memory");
  }
}

extern "C" __attribute__((noinline)) void stack_target_sleep_here() {
  g_in_place.fetch_add(1);
  for (;;) {
    timespec ts{3600, 0};
    ::nanosleep(&ts, nullptr);
    asm volatile("" ::: "memory");
  }
}

extern "C" __attribute__((noinline)) void stack_target_vfork_here() {
  g_in_place.fetch_add(1);
  pid_t child = ::vfork();
  if (child == 0) {
    for (;;) ::pause();
  }
  if (child > 0) ::waitpid(child, nullptr, 0);
  for (;;) {
    timespec ts{3600, 0};
    ::nanosleep(&ts, nullptr);
  }
}

extern "C" __attribute__((noinline)) void stack_target_read_here() {
  char buf[256];
  for (;;) {
    ssize_t n = ::read(0, buf, sizeof buf);
    asm volatile("" ::: "memory");
    if (n == 0) return;
    if (n < 0) continue;  // EINTR
    std::printf("pong %lu\n", g_spins.load());
    std::fflush(stdout);
  }
}

int main(int argc, char** argv) {
  const bool with_vfork = argc > 1 && std::strcmp(argv[1], "vfork") == 0;
  std::thread spinner(stack_target_spin_here);
  std::thread sleeper(stack_target_sleep_here);
  ::pthread_setname_np(spinner.native_handle(), "spinner");
  ::pthread_setname_np(sleeper.native_handle(), "sleeper");
  if (with_vfork) {
    std::thread vforker(stack_target_vfork_here);
    ::pthread_setname_np(vforker.native_handle(), "vforker");
    vforker.detach();
  }
  while (g_in_place.load() < (with_vfork ? 3 : 2)) ::usleep(1000);
  std::printf("ready\n");
  std::fflush(stdout);
  stack_target_read_here();
  std::_Exit(0);  // the other threads never return
}
