// The weight-loading progress bar: its text, and plain lines (no carriage return, no escape code) when
// the stream is not a terminal.
#include <cstdio>

#include <gtest/gtest.h>

#include "model_test_util.hpp"
#include "server/progress_bar.hpp"

namespace fulcrum::server {
namespace {

TEST(ServerProgress, BarText) {
  EXPECT_EQ(ProgressBar::render("loading weights", 3, 8, "ranks", 16), "loading weights [######          ] 3/8 ranks");
  EXPECT_EQ(ProgressBar::render("x", 0, 2, "ranks", 4), "x [    ] 0/2 ranks");
  EXPECT_EQ(ProgressBar::render("x", 2, 2, "ranks", 4), "x [####] 2/2 ranks");
}

TEST(ServerProgress, PlainLinesWhenNotATerminal) {
  test::TempDir dir("progress");
  std::FILE* out = std::fopen(dir.file("log.txt").c_str(), "w");
  ASSERT_NE(out, nullptr);
  {
    ProgressBar bar("loading weights", 8, "ranks", out, /*min_interval_s=*/3600);
    for (int done = 0; done <= 8; ++done) bar.update(done);
    bar.update(8);  // repeated: nothing more
  }
  std::fclose(out);
  const std::string text = test::slurp(dir.file("log.txt"));
  EXPECT_EQ(text, ProgressBar::render("loading weights", 0, 8, "ranks") + "\n" +
                      ProgressBar::render("loading weights", 8, 8, "ranks") + "\n");
  EXPECT_EQ(text.find('\r'), std::string::npos);
  EXPECT_EQ(text.find('\033'), std::string::npos);
}

}  // namespace
}  // namespace fulcrum::server
