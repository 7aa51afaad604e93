#include "eplb/loads.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <sstream>

#include "eplb/error.hpp"
#include "eplb/json_text.hpp"

namespace fulcrum::eplb {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

// Loads are token counts: above 2^53 a double no longer holds them exactly, and sums of values near the double
// range overflow to inf (balancedness then came out as NaN instead of an error).
constexpr double kMaxLoad = 9007199254740992.0;  // 2^53

// `where()` names the value in an error; it is only called on one (no string built per valid value).
template <typename Where>
double checked_load(double value, const Where& where) {
  FULCRUM_CHECK(std::isfinite(value), "{}: load {} is not finite", where(), value);
  FULCRUM_CHECK(value >= 0.0, "{}: load {} is negative", where(), value);
  FULCRUM_CHECK(value <= kMaxLoad, "{}: load {} is above 2^53, the largest count a double holds exactly", where(),
                value);
  return value;
}

template <typename Where>
double parse_load_value(std::string_view field, const Where& where) {
  field = trim(field);
  FULCRUM_CHECK(!field.empty(), "{}: empty value", where());
  double value = 0.0;
  auto [ptr, ec] = std::from_chars(field.data(), field.data() + field.size(), value);
  FULCRUM_CHECK(ec == std::errc() && ptr == field.data() + field.size(), "{}: '{}' is not a number", where(),
                printable_excerpt(field));  // a field may be a whole binary line (fuzz_loads)
  return checked_load(value, where);
}

// One [L][E] JSON array into a matrix; `path` names it in errors.
LoadMatrix matrix_from_json(const nlohmann::json& rows, const std::string& where) {
  FULCRUM_CHECK(rows.is_array() && !rows.empty(), "{}: expected a non-empty [layers][experts] array", where);
  LoadMatrix m;
  m.num_layers = static_cast<int>(rows.size());
  for (size_t l = 0; l < rows.size(); ++l) {
    const auto& row = rows[l];
    const std::string row_where = fmt::format("{}[{}]", where, l);
    FULCRUM_CHECK(row.is_array() && !row.empty(), "{}: expected a non-empty array of loads", row_where);
    if (l == 0) m.num_logical_experts = static_cast<int>(row.size());
    FULCRUM_CHECK(static_cast<int>(row.size()) == m.num_logical_experts, "{}: ragged row of {} values, expected {}",
                  row_where, row.size(), m.num_logical_experts);
    for (size_t e = 0; e < row.size(); ++e) {
      const auto& v = row[e];
      FULCRUM_CHECK(v.is_number(), "{}[{}]: expected a number, got {}", row_where, e, json_excerpt(v));
      m.values.push_back(checked_load(v.get<double>(), [&] { return fmt::format("{}[{}]", row_where, e); }));
    }
  }
  return m;
}

// A UTF-8 byte order mark (spreadsheet exports write one) is not part of the first value.
std::string_view without_bom(const std::string& text) {
  std::string_view view(text);
  if (view.starts_with("\xEF\xBB\xBF")) view.remove_prefix(3);
  return view;
}

bool looks_like_json(const std::string& text) {
  for (char c : without_bom(text)) {
    if (c == ' ' || c == '\n' || c == '\t' || c == '\r') continue;
    return c == '{' || c == '[';
  }
  return false;
}

}  // namespace

LoadMatrix parse_loads_csv(const std::string& text, const std::string& origin) {
  LoadMatrix m;
  std::istringstream in{std::string(without_bom(text))};
  std::string line;
  size_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    std::string_view row = trim(line);
    if (row.empty() || row.front() == '#') continue;
    const auto where = [&] { return fmt::format("{}:{}", origin, line_no); };
    size_t num_fields = 0;
    size_t start = 0;
    while (true) {
      const size_t comma = row.find(',', start);
      const std::string_view field = row.substr(start, comma == std::string_view::npos ? row.npos : comma - start);
      m.values.push_back(parse_load_value(field, [&] { return fmt::format("{} column {}", where(), num_fields + 1); }));
      ++num_fields;
      if (comma == std::string_view::npos) break;
      start = comma + 1;
    }
    if (m.num_layers == 0) m.num_logical_experts = static_cast<int>(num_fields);
    FULCRUM_CHECK(static_cast<int>(num_fields) == m.num_logical_experts, "{}: ragged row of {} values, expected {}",
                  where(), num_fields, m.num_logical_experts);
    ++m.num_layers;
  }
  FULCRUM_CHECK(m.num_layers > 0, "{}: no load rows", origin);
  return m;
}

std::vector<LoadMatrix> parse_load_windows_json(const std::string& text, const std::string& origin) {
  const nlohmann::json doc = parse_json_text(text, origin);
  FULCRUM_CHECK(doc.is_object() && doc.contains("logical_count"), "{}: expected an object with \"logical_count\"",
                origin);
  const auto& counts = doc["logical_count"];
  const std::string where = origin + ": logical_count";
  FULCRUM_CHECK(counts.is_array() && !counts.empty(), "{}: expected a non-empty array", where);
  std::vector<LoadMatrix> windows;
  const bool is_window_list = counts[0].is_array() && !counts[0].empty() && counts[0][0].is_array();
  if (!is_window_list) {
    windows.push_back(matrix_from_json(counts, where));
    return windows;
  }
  for (size_t s = 0; s < counts.size(); ++s) {
    windows.push_back(matrix_from_json(counts[s], fmt::format("{}[{}]", where, s)));
    FULCRUM_CHECK(windows.back().num_layers == windows.front().num_layers &&
                      windows.back().num_logical_experts == windows.front().num_logical_experts,
                  "{}[{}]: window is {}x{}, the first is {}x{}", where, s, windows.back().num_layers,
                  windows.back().num_logical_experts, windows.front().num_layers, windows.front().num_logical_experts);
  }
  return windows;
}

LoadMatrix parse_loads_json(const std::string& text, const std::string& origin) {
  return sum_loads(parse_load_windows_json(text, origin));
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  FULCRUM_CHECK(in.good(), "{}: cannot open file", path);
  std::ostringstream buffer;
  buffer << in.rdbuf();
  FULCRUM_CHECK(!in.bad(), "{}: read error", path);
  return buffer.str();
}

LoadMatrix read_loads_file(const std::string& path) {
  const std::string text = read_text_file(path);
  return looks_like_json(text) ? parse_loads_json(text, path) : parse_loads_csv(text, path);
}

std::vector<LoadMatrix> read_load_windows_file(const std::string& path) {
  const std::string text = read_text_file(path);
  if (looks_like_json(text)) return parse_load_windows_json(text, path);
  return {parse_loads_csv(text, path)};
}

LoadMatrix sum_loads(const std::vector<LoadMatrix>& matrices) {
  FULCRUM_CHECK(!matrices.empty(), "no load matrices to sum");
  LoadMatrix total = matrices.front();
  for (size_t i = 1; i < matrices.size(); ++i) {
    const LoadMatrix& m = matrices[i];
    FULCRUM_CHECK(m.num_layers == total.num_layers && m.num_logical_experts == total.num_logical_experts,
                  "load matrix {} is {} layers x {} experts, the first is {} x {}", i + 1, m.num_layers,
                  m.num_logical_experts, total.num_layers, total.num_logical_experts);
    for (size_t k = 0; k < total.values.size(); ++k) total.values[k] += m.values[k];
  }
  return total;
}

}  // namespace fulcrum::eplb
