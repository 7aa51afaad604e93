#include "server/progress_bar.hpp"

#include <algorithm>

#include <unistd.h>

#include <fmt/format.h>

namespace fulcrum::server {

ProgressBar::ProgressBar(std::string label, int total, std::string unit, std::FILE* out, double min_interval_s)
    : label_(std::move(label)), unit_(std::move(unit)), total_(std::max(total, 1)), out_(out),
      tty_(::isatty(::fileno(out)) == 1), min_interval_s_(min_interval_s) {}

std::string ProgressBar::render(const std::string& label, int done, int total, const std::string& unit, int width) {
  const int filled = total > 0 ? static_cast<int>(int64_t{width} * std::clamp(done, 0, total) / total) : width;
  return fmt::format("{} [{}{}] {}/{} {}", label, std::string(static_cast<size_t>(filled), '#'),
                     std::string(static_cast<size_t>(width - filled), ' '), done, total, unit);
}

void ProgressBar::update(int done) {
  std::lock_guard lock(mutex_);
  done = std::clamp(done, 0, total_);
  if (done <= last_done_) return;
  last_done_ = done;
  const bool last = done == total_;
  const auto now = std::chrono::steady_clock::now();
  if (tty_) {
    fmt::print(out_, "\r\033[K{}{}", render(label_, done, total_, unit_), last ? "\n" : "");
  } else {
    const bool first = last_line_ == std::chrono::steady_clock::time_point{};
    if (!first && !last && std::chrono::duration<double>(now - last_line_).count() < min_interval_s_) return;
    fmt::print(out_, "{}\n", render(label_, done, total_, unit_));
    last_line_ = now;
  }
  std::fflush(out_);
}

}  // namespace fulcrum::server
