#include "common/signals.h"

#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>

namespace trainer {

namespace {

// Only lock-free atomics may be touched from a signal handler.
std::atomic<int> g_stop_signal{0};
std::atomic<bool> g_checkpoint_request{false};
std::atomic<bool> g_memory_report_request{false};
static_assert(std::atomic<int>::is_always_lock_free && std::atomic<bool>::is_always_lock_free,
              "signal flags must be lock-free to be async-signal-safe");

constexpr int kSignals[] = {SIGTERM, SIGINT, SIGUSR1, SIGUSR2};
struct sigaction g_previous[sizeof(kSignals) / sizeof(kSignals[0])];
bool g_installed = false;

void on_signal(int sig) {
  switch (sig) {
    case SIGTERM:
    case SIGINT: {
      int none = 0;
      g_stop_signal.compare_exchange_strong(none, sig);  // keep the first stop signal
      if (sig == SIGINT) {
        // The next Ctrl-C takes the default action (terminate): a user can always force-quit a run
        // whose graceful stop hangs. sigaction is async-signal-safe.
        struct sigaction dfl;
        std::memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigemptyset(&dfl.sa_mask);
        sigaction(SIGINT, &dfl, nullptr);
      }
      break;
    }
    case SIGUSR1: g_checkpoint_request.store(true); break;
    case SIGUSR2: g_memory_report_request.store(true); break;
    default: break;
  }
}

void clear_flags() {
  g_stop_signal.store(0);
  g_checkpoint_request.store(false);
  g_memory_report_request.store(false);
}

}  // namespace

void install_signal_handlers() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  clear_flags();
  for (size_t i = 0; i < sizeof(kSignals) / sizeof(kSignals[0]); ++i) {
    struct sigaction old;
    if (sigaction(kSignals[i], &sa, &old) != 0)
      throw std::runtime_error(std::string("install_signal_handlers: sigaction(") + strsignal(kSignals[i]) +
                               ") failed: " + std::strerror(errno));
    if (!g_installed) g_previous[i] = old;  // a second install keeps the true originals
  }
  g_installed = true;
}

void restore_signal_handlers() {
  if (g_installed)
    for (size_t i = 0; i < sizeof(kSignals) / sizeof(kSignals[0]); ++i) sigaction(kSignals[i], &g_previous[i], nullptr);
  g_installed = false;
  clear_flags();
}

bool stop_requested() { return g_stop_signal.load() != 0; }

int stop_signal() { return g_stop_signal.load(); }

bool take_checkpoint_request() { return g_checkpoint_request.exchange(false); }

bool take_memory_report_request() { return g_memory_report_request.exchange(false); }

}  // namespace trainer
