#pragma once
// A progress bar on a terminal ("loading weights [#####     ] 4/8 ranks", redrawn in place), or plain
// lines when the stream is not a terminal (a log file gets no carriage returns or escape codes): the first
// and last counts, and at most one line per `min_interval_s` between them. Thread-safe.
#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>

namespace fulcrum::server {

class ProgressBar {
 public:
  ProgressBar(std::string label, int total, std::string unit, std::FILE* out = stderr, double min_interval_s = 1.0);

  // Reports `done` of `total` (done <= total); the line is finished when done == total.
  void update(int done);

  // The bar text for a count, without any terminal control: "label [###   ] done/total unit".
  static std::string render(const std::string& label, int done, int total, const std::string& unit, int width = 30);

 private:
  std::mutex mutex_;
  const std::string label_, unit_;
  const int total_;
  std::FILE* out_;
  const bool tty_;
  const double min_interval_s_;
  int last_done_ = -1;
  std::chrono::steady_clock::time_point last_line_{};
};

}  // namespace fulcrum::server
