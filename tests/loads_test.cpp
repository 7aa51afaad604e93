// Load input: CSV and JSON parsing, summing, and one-line errors with file and line.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>

#include "eplb/loads.hpp"
#include "model_test_util.hpp"
#include "test_data.hpp"

namespace fulcrum::eplb {
namespace {

using test::error_of;

TEST(Loads, ParsesCsvWithCommentsAndBlankLines) {
  const LoadMatrix m = parse_loads_csv("# header\n1,2,3\n\n# mid\n4, 5 ,6\r\n", "t.csv");
  EXPECT_EQ(m.num_layers, 2);
  EXPECT_EQ(m.num_logical_experts, 3);
  EXPECT_EQ(m.values, (std::vector<double>{1, 2, 3, 4, 5, 6}));
  EXPECT_DOUBLE_EQ(m.at(1, 2), 6.0);
}

TEST(Loads, CsvErrorsNameFileAndLine) {
  EXPECT_EQ(error_of([] { parse_loads_csv("1,2\n3,nan\n", "a.csv"); }), "a.csv:2 column 2: load nan is not finite");
  EXPECT_EQ(error_of([] { parse_loads_csv("1,2\n3,-1\n", "a.csv"); }), "a.csv:2 column 2: load -1 is negative");
  EXPECT_EQ(error_of([] { parse_loads_csv("1,2\n3\n", "a.csv"); }), "a.csv:2: ragged row of 1 values, expected 2");
  EXPECT_EQ(error_of([] { parse_loads_csv("# only\n\n", "a.csv"); }), "a.csv: no load rows");
  EXPECT_EQ(error_of([] { parse_loads_csv("1,x\n", "a.csv"); }), "a.csv:1 column 2: 'x' is not a number");
  EXPECT_EQ(error_of([] { parse_loads_csv("1,,2\n", "a.csv"); }), "a.csv:1 column 2: empty value");
  EXPECT_EQ(error_of([] { parse_loads_csv("1,inf\n", "a.csv"); }), "a.csv:1 column 2: load inf is not finite");
  // Finite values whose sums overflow (balancedness came out NaN): counts above 2^53 are refused.
  EXPECT_EQ(error_of([] { parse_loads_csv("1,1e308\n", "a.csv"); }),
            "a.csv:1 column 2: load 1e+308 is above 2^53, the largest count a double holds exactly");
  EXPECT_EQ(parse_loads_csv("1,9007199254740992\n", "a.csv").values[1], 9007199254740992.0);
}

TEST(Loads, AUtf8ByteOrderMarkIsSkipped) {
  EXPECT_EQ(parse_loads_csv("\xEF\xBB\xBF" "1,2\n3,4\n", "bom.csv").values, (std::vector<double>{1, 2, 3, 4}));
  const test::TempDir dir("bom_loads");
  std::ofstream(dir.file("loads.json")) << "\xEF\xBB\xBF" R"({"logical_count": [[1, 2]]})";
  EXPECT_EQ(read_loads_file(dir.file("loads.json")).values, (std::vector<double>{1, 2}));
}

TEST(Loads, JsonSingleWindowAndWindowsSummed) {
  const LoadMatrix one = parse_loads_json(R"({"logical_count": [[1, 2], [3, 4]]})", "a.json");
  EXPECT_EQ(one.num_layers, 2);
  EXPECT_EQ(one.values, (std::vector<double>{1, 2, 3, 4}));
  const LoadMatrix summed = parse_loads_json(R"({"logical_count": [[[1, 2]], [[10, 20]], [[100, 200]]]})", "b.json");
  EXPECT_EQ(summed.num_layers, 1);
  EXPECT_EQ(summed.values, (std::vector<double>{111, 222}));
  EXPECT_EQ(parse_load_windows_json(R"({"logical_count": [[[1, 2]], [[10, 20]]]})", "b.json").size(), 2u);
}

TEST(Loads, JsonErrorsNameFileAndPlace) {
  EXPECT_EQ(error_of([] { parse_loads_json("{\"logical_count\":\n [[1, NaN]]}", "a.json"); }),
            "a.json: parse error at line 2, column 7: syntax error while parsing value - invalid literal; "
            "last read: '1, N'");
  EXPECT_EQ(error_of([] { parse_loads_json(R"({"logical_count": [[1, 2], [3]]})", "a.json"); }),
            "a.json: logical_count[1]: ragged row of 1 values, expected 2");
  EXPECT_EQ(error_of([] { parse_loads_json(R"({"logical_count": [[1, -2]]})", "a.json"); }),
            "a.json: logical_count[0][1]: load -2 is negative");
  EXPECT_EQ(error_of([] { parse_loads_json(R"({"logical_count": [[1, 1e300]]})", "a.json"); }),
            "a.json: logical_count[0][1]: load 1e+300 is above 2^53, the largest count a double holds exactly");
  EXPECT_EQ(error_of([] { parse_loads_json(R"({"logical_count": []})", "a.json"); }),
            "a.json: logical_count: expected a non-empty array");
  EXPECT_EQ(error_of([] { parse_loads_json(R"({"counts": [[1]]})", "a.json"); }),
            "a.json: expected an object with \"logical_count\"");
  EXPECT_EQ(error_of([] { parse_loads_json(R"({"logical_count": [[[1, 2]], [[1, 2, 3]]]})", "a.json"); }),
            "a.json: logical_count[1]: window is 1x3, the first is 1x2");
}

// A corrupt file's raw bytes, quoted by the parser, are shown as \xNN: the message stays one line of ASCII.
TEST(Loads, ParseErrorsShowRawBytesEscaped) {
  const std::string error = error_of([] { parse_loads_json("{\"logical\xde\x0a\": [[1]]}", "a.json"); });
  EXPECT_NE(error.find("\\xde"), std::string::npos) << error;
  EXPECT_TRUE(std::all_of(error.begin(), error.end(), [](char c) { return c >= 0x20 && c < 0x7f; })) << error;
}

TEST(Loads, SumRequiresSameShape) {
  LoadMatrix a(2, 3), b(2, 3), c(3, 3);
  a.at(0, 0) = 1;
  b.at(0, 0) = 2;
  EXPECT_DOUBLE_EQ(sum_loads({a, b}).at(0, 0), 3.0);
  EXPECT_EQ(error_of([&] { sum_loads({a, c}); }), "load matrix 2 is 3 layers x 3 experts, the first is 2 x 3");
}

TEST(Loads, ReadsTheRealLoadFiles) {
  const auto files = test::real_load_files();
  ASSERT_EQ(files.size(), 12u);
  for (const auto& file : files) {
    const LoadMatrix m = read_loads_file(file);
    EXPECT_EQ(m.num_layers, 48) << file;
    EXPECT_EQ(m.num_logical_experts, 128) << file;
    double row_sum = 0.0;
    for (double v : m.layer(0)) row_sum += v;
    EXPECT_NEAR(row_sum, 8.0, 5e-3) << file;  // top-8: each row sums to 8 (values are rounded)
  }
  EXPECT_EQ(error_of([] { read_loads_file("/nonexistent/x.csv"); }), "/nonexistent/x.csv: cannot open file");
}

}  // namespace
}  // namespace fulcrum::eplb
