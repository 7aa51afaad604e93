#include "server/progress_bar.hpp"

#include <algorithm>

#include <unistd.h>

#include <fmt/format.h>

namespace fulcrum::server {
namespace {

double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

ProgressBar::ProgressBar(std::string label, int total, std::string unit, std::FILE* out, double min_interval_s)
    : label_(std::move(label)), unit_(std::move(unit)), total_(std::max(total, 1)), out_(out),
      tty_(::isatty(::fileno(out)) == 1), min_interval_s_(min_interval_s), start_(std::chrono::steady_clock::now()) {}

ProgressBar::~ProgressBar() {
  {
    std::lock_guard lock(mutex_);
    if (tty_ && printed_ && done_ < total_) std::fputc('\n', out_);  // e.g. a failed load: the error goes below
    done_ = total_;
  }
  finished_cv_.notify_all();
  if (ticker_.joinable()) ticker_.join();
}

void ProgressBar::tick_every_second() {
  ticker_ = std::thread([this] {
    std::unique_lock lock(mutex_);
    while (!finished_cv_.wait_for(lock, std::chrono::seconds(1), [&] { return done_ == total_; })) {
      lock.unlock();
      tick();
      lock.lock();
    }
  });
}

std::string ProgressBar::render(const std::string& label, int done, int total, const std::string& unit, double seconds,
                                int width) {
  const int filled = total > 0 ? static_cast<int>(int64_t{width} * std::clamp(done, 0, total) / total) : width;
  return fmt::format("{} [{}{}] {}/{} {}, {:.0f} s", label, std::string(static_cast<size_t>(filled), '#'),
                     std::string(static_cast<size_t>(width - filled), ' '), done, total, unit, seconds);
}

void ProgressBar::draw(bool finished) {
  const auto now = std::chrono::steady_clock::now();
  const std::string text = render(label_, std::max(done_, 0), total_, unit_, seconds_between(start_, now));
  if (tty_) {
    fmt::print(out_, "\r\033[K{}{}", text, finished ? "\n" : "");
  } else {
    fmt::print(out_, "{}\n", text);
  }
  std::fflush(out_);
  printed_ = true;
  last_line_ = now;
}

void ProgressBar::update(int done) {
  std::lock_guard lock(mutex_);
  done = std::clamp(done, 0, total_);
  if (done <= done_) return;
  done_ = done;
  const bool finished = done == total_;
  if (finished) finished_cv_.notify_all();
  const double since_last = seconds_between(last_line_, std::chrono::steady_clock::now());
  if (tty_ || !printed_ || finished || since_last >= min_interval_s_) draw(finished);
}

void ProgressBar::tick() {
  std::lock_guard lock(mutex_);
  if (done_ == total_) return;
  const double since_last = seconds_between(last_line_, std::chrono::steady_clock::now());
  if (tty_ || !printed_ || since_last >= 10 * min_interval_s_) draw(false);
}

}  // namespace fulcrum::server
