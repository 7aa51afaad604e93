// HttpServer::stop() from another thread at any moment of the listener's start: before listen() began, while
// it starts, and while it serves. cpp-httplib's own stop() does nothing until its accept loop runs, so a server
// that got SIGTERM right after it logged "listening" could stay in listen() for ever (seen as a 30 s shutdown
// timeout in ServerEplb.EngineFlagsAreCheckedLikeGenerates under AddressSanitizer and a loaded machine).
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <future>
#include <thread>

#include "eplb/error.hpp"
#include "server/http_server.hpp"
#include "server/metrics.hpp"
#include "server/scheduler.hpp"
#include "server_test_util.hpp"

namespace fulcrum::server {
namespace {

using namespace std::chrono_literals;

struct Served {
  test::FakeExecutor executor;
  ServerMetrics metrics;
  Scheduler scheduler{executor, {}};
  HttpServer http{scheduler, metrics, nullptr, {}};
  Served() { http.bind("127.0.0.1", 0); }
};

// Runs listen() on a thread; true when it returned within 10 s of `stop_at` (which calls stop()).
bool listen_ends(Served& s, const std::function<void()>& stop_at) {
  std::promise<void> returned;
  std::future<void> done = returned.get_future();
  std::thread listener([&] {
    s.http.listen();
    returned.set_value();
  });
  stop_at();
  const bool ended = done.wait_for(10s) == std::future_status::ready;
  if (!ended) s.http.stop();  // the listener runs by now: let the thread end so the test can report
  listener.join();
  return ended;
}

int open_fds() {
  int n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

TEST(HttpServerStop, AStopBeforeListenMakesListenReturnAtOnceAndClosesTheSocket) {
  const int fds_before = open_fds();
  {
    Served s;
    s.http.stop();
    EXPECT_TRUE(listen_ends(s, [] {}));
  }
  EXPECT_EQ(open_fds(), fds_before) << "the bound socket was left open";
}

TEST(HttpServerStop, AStopWhileTheListenerStartsEndsIt) {
  for (int i = 0; i < 100; ++i) {
    Served s;
    ASSERT_TRUE(listen_ends(s, [&] { s.http.stop(); })) << "attempt " << i;
  }
}

TEST(HttpServerStop, AStopWhileServingEndsIt) {
  Served s;
  EXPECT_TRUE(listen_ends(s, [&] {
    std::this_thread::sleep_for(50ms);
    s.http.stop();
  }));
}

// The port is bound exclusively: a second server on a port in use is a one-line error, not a second listener
// the kernel would split connections with.
TEST(HttpServerBind, APortInUseIsAOneLineError) {
  test::FakeExecutor executor;
  ServerMetrics metrics;
  Scheduler scheduler{executor, {}};
  HttpServer probe{scheduler, metrics, nullptr, {}};
  const int port = probe.bind("127.0.0.1", 0);
  HttpServer second{scheduler, metrics, nullptr, {}};
  try {
    second.bind("127.0.0.1", port);
    ADD_FAILURE() << "a second server bound port " << port;
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("in use"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
  probe.stop();
  probe.listen();  // returns at once (stopped) and closes the socket
}

}  // namespace
}  // namespace fulcrum::server
