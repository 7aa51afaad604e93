#pragma once
// A progress bar on a terminal ("loading weights [#####     ] 4/8 ranks, 3 s", redrawn in place), or plain
// lines when the stream is not a terminal (a log file gets no carriage returns or escape codes): the first
// and last counts, at most one line per `min_interval_s` between them, and while the count does not move,
// one line per 10 x `min_interval_s` from tick(). Thread-safe.
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>

namespace fulcrum::server {

class ProgressBar {
 public:
  ProgressBar(std::string label, int total, std::string unit, std::FILE* out = stderr, double min_interval_s = 1.0);
  ~ProgressBar();  // stops the ticking thread

  // Reports `done` of `total` (done <= total); the line is finished when done == total.
  void update(int done);
  // Shows that time passes while the count stands still (call every second or so).
  void tick();
  // Calls tick() every second on a thread of its own until the count reaches the total.
  void tick_every_second();

  // The bar text, without any terminal control: "label [###   ] done/total unit, S s".
  static std::string render(const std::string& label, int done, int total, const std::string& unit, double seconds,
                            int width = 30);

 private:
  void draw(bool finished);  // mutex_ held

  std::mutex mutex_;
  const std::string label_, unit_;
  const int total_;
  std::FILE* out_;
  const bool tty_;
  const double min_interval_s_;
  const std::chrono::steady_clock::time_point start_;
  int done_ = -1;
  bool printed_ = false;
  std::chrono::steady_clock::time_point last_line_{};
  std::condition_variable finished_cv_;
  std::thread ticker_;
};

}  // namespace fulcrum::server
