// Safetensors reader/writer: round trip, dtype conversion, sharded checkpoints, every malformed-file
// error, and random truncations / bit flips that must throw fulcrum::Error and never crash.
#include <cstring>
#include <fstream>
#include <random>

#include <gtest/gtest.h>

#include "model/safetensors.hpp"
#include "model_test_util.hpp"

namespace fulcrum::test {
namespace {

using model::HostTensor;

std::map<std::string, HostTensor> small_tensors() {
  return {{"a", {{2, 3}, {1, 2, 3, 4, 5, 6}}},
          {"b.weight", {{4}, {-1.5f, 0.25f, 1e-20f, 3e30f}}},
          {"empty", {{0, 5}, {}}}};
}

void write_raw(const std::string& path, const std::string& header, const std::string& data) {
  std::string bytes(8, '\0');
  const uint64_t size = header.size();
  std::memcpy(bytes.data(), &size, 8);
  std::ofstream(path, std::ios::binary) << bytes << header << data;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(ModelSafetensors, RoundTrip) {
  TempDir dir("st");
  const auto tensors = small_tensors();
  model::write_safetensors(dir.file("t.safetensors"), tensors, {{"format", "pt"}});
  const model::SafetensorsFile file(dir.file("t.safetensors"));
  EXPECT_EQ(file.names(), (std::vector<std::string>{"a", "b.weight", "empty"}));
  EXPECT_EQ(file.metadata().at("format"), "pt");
  for (const auto& [name, tensor] : tensors) {
    const HostTensor read = file.read_f32(name);
    EXPECT_EQ(read.shape, tensor.shape) << name;
    EXPECT_EQ(read.data, tensor.data) << name;
  }
}

TEST(ModelSafetensors, Bf16AndF16ConvertToF32) {
  TempDir dir("st");
  // bf16: 1.0 = 0x3f80, -2.5 = 0xc020; f16: 1.0 = 0x3c00, -2.0 = 0xc000, 65504 = 0x7bff, 2^-24 = 0x0001.
  const uint16_t bf16[2] = {0x3f80, 0xc020};
  const uint16_t f16[4] = {0x3c00, 0xc000, 0x7bff, 0x0001};
  std::string data(reinterpret_cast<const char*>(bf16), 4);
  data.append(reinterpret_cast<const char*>(f16), 8);
  write_raw(dir.file("h.safetensors"),
            R"({"x":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},"y":{"dtype":"F16","shape":[2,2],"data_offsets":[4,12]}})",
            data);
  const model::SafetensorsFile file(dir.file("h.safetensors"));
  EXPECT_EQ(file.read_f32("x").data, (std::vector<float>{1.0f, -2.5f}));
  EXPECT_EQ(file.read_f32("y").data, (std::vector<float>{1.0f, -2.0f, 65504.0f, 0x1p-24f}));
}

TEST(ModelSafetensors, ShardedCheckpoint) {
  TempDir dir("st");
  model::write_safetensors(dir.file("model-00001-of-00002.safetensors"), {{"a", {{2}, {1, 2}}}});
  model::write_safetensors(dir.file("model-00002-of-00002.safetensors"), {{"b", {{1}, {3}}}});
  std::ofstream(dir.file("model.safetensors.index.json"))
      << R"({"metadata":{},"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors"}})";
  model::Checkpoint checkpoint(dir.path());
  EXPECT_EQ(checkpoint.names(), (std::vector<std::string>{"a", "b"}));
  std::vector<float> b(1);
  const std::vector<int64_t> shape_b = {1};
  checkpoint.read_f32_into("b", shape_b, b);
  EXPECT_EQ(b[0], 3.0f);
  const std::vector<int64_t> wrong = {2};
  const std::string message = error_of([&] { checkpoint.read_f32_into("b", wrong, b); });
  EXPECT_NE(message.find("'b'"), std::string::npos) << message;
  EXPECT_NE(message.find("shape [1], expected [2]"), std::string::npos) << message;
  EXPECT_NE(error_of([&] { checkpoint.info("c"); }).find("missing tensor 'c'"), std::string::npos);

  // An index naming a tensor its shard lacks, and a shard tensor the index does not list.
  std::ofstream(dir.file("model.safetensors.index.json"))
      << R"({"weight_map":{"a":"model-00001-of-00002.safetensors","c":"model-00002-of-00002.safetensors"}})";
  EXPECT_NE(error_of([&] { model::Checkpoint c(dir.path()); }).find("missing tensor 'c'"), std::string::npos);
  model::write_safetensors(dir.file("model-00001-of-00002.safetensors"), {{"a", {{2}, {1, 2}}}, {"x", {{1}, {4}}}});
  std::ofstream(dir.file("model.safetensors.index.json"))
      << R"({"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors"}})";
  EXPECT_NE(error_of([&] { model::Checkpoint c(dir.path()); }).find("'x' is not listed"), std::string::npos);
}

TEST(ModelSafetensors, MalformedFilesNameTheProblem) {
  TempDir dir("st");
  const std::string path = dir.file("bad.safetensors");
  const std::string data(16, '\0');
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"t":{"dtype":"F32","shape":[4],"data_offsets":[0,20]}})", "out of range"},
      {R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", "needs 12"},
      {R"({"t":{"dtype":"Q4","shape":[4],"data_offsets":[0,16]}})", "unknown or unsupported dtype 'Q4'"},
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"u":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       "overlaps"},
      {R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,16]}})", "non-negative"},
      {R"({"t":{"dtype":"F32","shape":[4],"data_offsets":[8,0]}})", "out of range"},
      {R"({"t":{"dtype":"F32","shape":[4]}})", "data_offsets"},
      {R"({"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]})", "parse error"},
      {R"([1,2])", "JSON object"},
  };
  for (const auto& [header, expected] : cases) {
    write_raw(path, header, data);
    const std::string message = error_of([&] { model::SafetensorsFile f(path); });
    EXPECT_NE(message.find(expected), std::string::npos) << header << " -> " << message;
    EXPECT_NE(message.find("bad.safetensors"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
  std::ofstream(path, std::ios::binary) << "abc";
  EXPECT_NE(error_of([&] { model::SafetensorsFile f(path); }).find("truncated"), std::string::npos);
  std::string huge(8, '\0');
  const uint64_t length = 1000;
  std::memcpy(huge.data(), &length, 8);
  std::ofstream(path, std::ios::binary) << huge << "{}";
  EXPECT_NE(error_of([&] { model::SafetensorsFile f(path); }).find("beyond the file"), std::string::npos);
  EXPECT_NE(error_of([&] { model::SafetensorsFile f(dir.file("absent.safetensors")); }).find("cannot open"),
            std::string::npos);
}

// Random truncations and bit flips: opening and reading every tensor either succeeds (a flip inside
// tensor data cannot be detected) or throws fulcrum::Error; a truncation always throws.
TEST(ModelSafetensors, FuzzTruncationsAndBitFlips) {
  TempDir dir("st");
  model::write_safetensors(dir.file("good.safetensors"), small_tensors(), {{"format", "pt"}});
  const std::string good = read_bytes(dir.file("good.safetensors"));
  const std::string path = dir.file("fuzz.safetensors");
  std::mt19937 rng(1234);
  int num_errors = 0;
  for (int iter = 0; iter < 600; ++iter) {
    std::string bytes = good;
    const bool truncate = iter % 2 == 0;
    if (truncate) {
      bytes.resize(std::uniform_int_distribution<size_t>(0, good.size() - 1)(rng));
    } else {
      const int num_flips = 1 + iter % 3;
      for (int f = 0; f < num_flips; ++f) {
        const size_t pos = std::uniform_int_distribution<size_t>(0, bytes.size() - 1)(rng);
        bytes[pos] = static_cast<char>(bytes[pos] ^ (1 << std::uniform_int_distribution<int>(0, 7)(rng)));
      }
    }
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
    bool threw = false;
    try {
      const model::SafetensorsFile file(path);
      for (const std::string& name : file.names()) {
        const auto& info = file.info(name);
        if (info.dtype == model::Dtype::kI64 || info.dtype == model::Dtype::kI32) {
          file.read_i64(name);
        } else {
          file.read_f32(name);
        }
      }
    } catch (const Error&) {
      threw = true;
    }
    // Any other exception type escapes and fails the test.
    if (truncate) {
      EXPECT_TRUE(threw) << "truncation to " << bytes.size() << " bytes was accepted";
    }
    num_errors += threw ? 1 : 0;
  }
  EXPECT_GE(num_errors, 300);
}

}  // namespace
}  // namespace fulcrum::test
