#include "model/checkpoint_writer.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "eplb/atomic_file.hpp"
#include "eplb/error.hpp"

namespace fulcrum::model {
namespace {

namespace fs = std::filesystem;

// One safetensors file: header of its tensors (in `specs` order), then their data as produced.
void write_shard(const fs::path& path, const std::vector<const TensorSpec*>& specs, Dtype default_dtype,
                 const TensorProducer& produce, const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const TensorSpec* spec : specs) {
    const Dtype dtype = spec->dtype.value_or(default_dtype);
    const uint64_t bytes = static_cast<uint64_t>(spec->numel()) * dtype_size(dtype);
    header[spec->name] = {{"dtype", dtype_name(dtype)}, {"shape", spec->shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');  // data section starts 8-byte aligned

  const fs::path temp = path.parent_path() / fmt::format(".{}.tmp.{}", path.filename().string(), ::getpid());
  std::ofstream out(temp, std::ios::binary | std::ios::trunc);
  FULCRUM_CHECK(out.good(), "{}: cannot create output file", path.string());
  const uint64_t header_size = header_text.size();
  out.write(reinterpret_cast<const char*>(&header_size), 8);
  out.write(header_text.data(), static_cast<std::streamsize>(header_text.size()));
  std::vector<uint16_t> bf16;
  std::vector<uint8_t> fp8;
  for (const TensorSpec* spec : specs) {
    const Dtype dtype = spec->dtype.value_or(default_dtype);
    int64_t written = 0;
    produce(*spec, [&](std::span<const float> chunk) {
      written += static_cast<int64_t>(chunk.size());
      FULCRUM_CHECK(written <= spec->numel(), "{}: producer gave more than {} values", spec->name, spec->numel());
      if (dtype == Dtype::kF32) {
        out.write(reinterpret_cast<const char*>(chunk.data()), static_cast<std::streamsize>(chunk.size() * 4));
      } else if (dtype == Dtype::kF8E4M3) {
        fp8.resize(chunk.size());
        for (size_t i = 0; i < chunk.size(); ++i) fp8[i] = f32_to_f8e4m3_bits(chunk[i]);
        out.write(reinterpret_cast<const char*>(fp8.data()), static_cast<std::streamsize>(chunk.size()));
      } else {
        bf16.resize(chunk.size());
        for (size_t i = 0; i < chunk.size(); ++i) bf16[i] = f32_to_bf16_bits(chunk[i]);
        out.write(reinterpret_cast<const char*>(bf16.data()), static_cast<std::streamsize>(chunk.size() * 2));
      }
    });
    FULCRUM_CHECK(written == spec->numel(), "{}: producer gave {} of {} values", spec->name, written, spec->numel());
  }
  out.flush();
  const bool ok = out.good();
  out.close();
  std::error_code ec;
  if (ok) fs::rename(temp, path, ec);
  if (!ok || ec) {
    std::error_code ignored;
    fs::remove(temp, ignored);
    throw Error(fmt::format("{}: write failed{}", path.string(), ec ? ": " + ec.message() : ""));
  }
}

}  // namespace

int64_t TensorSpec::numel() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

uint8_t f32_to_f8e4m3_bits(float value) {
  if (std::isnan(value)) return 0x7f;
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  const float magnitude = std::min(std::abs(value), 448.0f);
  if (magnitude == 0.0f) return sign;
  int k = 0;
  std::frexp(magnitude, &k);  // magnitude = f * 2^k, f in [0.5, 1): unbiased exponent k - 1
  const int biased = k + 6;   // exponent bias 7
  // nearbyint rounds to nearest even (the default rounding mode); a mantissa that rounds up to 8 carries
  // into the exponent, which the code arithmetic below does by itself.
  int code = 0;
  if (biased <= 0) {
    code = static_cast<int>(std::nearbyint(std::ldexp(magnitude, 9)));  // subnormal: m * 2^-9
  } else {
    code = (biased << 3) + static_cast<int>(std::nearbyint(std::ldexp(magnitude, 4 - k))) - 8;  // [8, 16) -> m
  }
  return static_cast<uint8_t>(sign | std::min(code, 0x7e));
}

uint16_t f32_to_bf16_bits(float value) {
  uint32_t bits = 0;
  std::memcpy(&bits, &value, 4);
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(bits >> 16);
}

float bf16_bits_to_f32(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value = 0;
  std::memcpy(&value, &wide, 4);
  return value;
}

void round_to_dtype(std::span<float> values, Dtype dtype) {
  if (dtype != Dtype::kBF16) return;
  for (float& v : values) v = bf16_bits_to_f32(f32_to_bf16_bits(v));
}

CheckpointLayout plan_checkpoint_layout(const std::vector<TensorSpec>& specs, Dtype dtype, uint64_t max_shard_bytes) {
  FULCRUM_CHECK(dtype == Dtype::kF32 || dtype == Dtype::kBF16, "checkpoint writer: dtype {} not supported",
                dtype_name(dtype));
  for (const TensorSpec& spec : specs) {
    const Dtype own = spec.dtype.value_or(dtype);
    FULCRUM_CHECK(own == Dtype::kF32 || own == Dtype::kBF16 || own == Dtype::kF8E4M3,
                  "checkpoint writer: tensor '{}': dtype {} not supported", spec.name, dtype_name(own));
  }
  FULCRUM_CHECK(max_shard_bytes > 0, "checkpoint writer: shard size must be positive");
  std::vector<int> shard_of(specs.size());
  std::vector<uint64_t> shard_bytes;
  CheckpointLayout layout;
  for (size_t i = 0; i < specs.size(); ++i) {
    const uint64_t bytes = static_cast<uint64_t>(specs[i].numel()) * dtype_size(specs[i].dtype.value_or(dtype));
    if (shard_bytes.empty() || (shard_bytes.back() > 0 && shard_bytes.back() + bytes > max_shard_bytes)) {
      shard_bytes.push_back(0);
    }
    shard_bytes.back() += bytes;
    shard_of[i] = static_cast<int>(shard_bytes.size()) - 1;
    layout.total_tensor_bytes += bytes;
  }
  const size_t num_shards = shard_bytes.size();
  for (size_t s = 0; s < num_shards; ++s) {
    layout.files.push_back(num_shards == 1 ? "model.safetensors"
                                           : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, num_shards));
  }
  for (size_t i = 0; i < specs.size(); ++i) layout.file_of[specs[i].name] = layout.files[shard_of[i]];
  return layout;
}

CheckpointLayout write_checkpoint(const std::string& dir, const std::vector<TensorSpec>& specs, Dtype dtype,
                                  uint64_t max_shard_bytes, const TensorProducer& produce,
                                  const std::map<std::string, std::string>& metadata) {
  const CheckpointLayout layout = plan_checkpoint_layout(specs, dtype, max_shard_bytes);
  for (const std::string& file : layout.files) {
    std::vector<const TensorSpec*> in_file;
    for (const TensorSpec& spec : specs) {
      if (layout.file_of.at(spec.name) == file) in_file.push_back(&spec);
    }
    write_shard(fs::path(dir) / file, in_file, dtype, produce, metadata);
  }
  if (layout.files.size() > 1) {
    nlohmann::json index = {{"metadata", {{"total_size", layout.total_tensor_bytes}}},
                            {"weight_map", layout.file_of}};
    write_file_atomically((fs::path(dir) / "model.safetensors.index.json").string(), index.dump(2) + "\n");
  }
  return layout;
}

}  // namespace fulcrum::model
