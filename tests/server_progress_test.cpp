// The weight-loading progress bar: its text, and plain lines (no carriage return, no escape code) when
// the stream is not a terminal.
#include <cstdio>
#include <regex>
#include <thread>

#include <gtest/gtest.h>

#include "model_test_util.hpp"
#include "server/progress_bar.hpp"

namespace fulcrum::server {
namespace {

TEST(ServerProgress, BarText) {
  EXPECT_EQ(ProgressBar::render("loading weights", 3, 8, "ranks", 2.4, 16),
            "loading weights [######          ] 3/8 ranks, 2 s");
  EXPECT_EQ(ProgressBar::render("x", 0, 2, "ranks", 0, 4), "x [    ] 0/2 ranks, 0 s");
  EXPECT_EQ(ProgressBar::render("x", 2, 2, "ranks", 61, 4), "x [####] 2/2 ranks, 61 s");
}

TEST(ServerProgress, PlainLinesWhenNotATerminal) {
  test::TempDir dir("progress");
  std::FILE* out = std::fopen(dir.file("log.txt").c_str(), "w");
  ASSERT_NE(out, nullptr);
  {
    ProgressBar bar("loading weights", 8, "ranks", out, /*min_interval_s=*/3600);
    bar.update(0);
    bar.tick();  // too soon for another line
    for (int done = 1; done <= 8; ++done) bar.update(done);
    bar.update(8);  // repeated: nothing more
    bar.tick();     // finished: nothing more
  }
  std::fclose(out);
  const std::string text = test::slurp(dir.file("log.txt"));
  const std::regex expected(R"(loading weights \[ {30}\] 0/8 ranks, 0 s\nloading weights \[#{30}\] 8/8 ranks, 0 s\n)");
  EXPECT_TRUE(std::regex_match(text, expected)) << text;
  EXPECT_EQ(text.find('\r'), std::string::npos);
  EXPECT_EQ(text.find('\033'), std::string::npos);
}

TEST(ServerProgress, TicksShowTimePassingWhileTheCountStandsStill) {
  test::TempDir dir("progress_tick");
  std::FILE* out = std::fopen(dir.file("log.txt").c_str(), "w");
  ASSERT_NE(out, nullptr);
  {
    ProgressBar bar("loading weights", 2, "ranks", out, /*min_interval_s=*/0.001);  // a tick line every 10 ms
    bar.update(0);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    bar.tick();
    bar.update(2);
  }
  std::fclose(out);
  const std::string text = test::slurp(dir.file("log.txt"));
  EXPECT_TRUE(std::regex_match(text, std::regex(R"((loading weights \[ +\] 0/2 ranks, 0 s\n){2}loading weights \[#+\] 2/2 ranks, 0 s\n)")))
      << text;
}

}  // namespace
}  // namespace fulcrum::server
