#include "model/safetensors.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "eplb/atomic_file.hpp"
#include "eplb/error.hpp"
#include "eplb/json_text.hpp"

static_assert(std::endian::native == std::endian::little, "safetensors reading assumes a little-endian host");

namespace fulcrum::model {
namespace {

using nlohmann::json;

// A header larger than this is refused before it is parsed (real checkpoints stay far below).
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

bool parse_dtype(const std::string& text, Dtype* dtype) {
  static const std::map<std::string, Dtype> kDtypes = {{"F32", Dtype::kF32}, {"F16", Dtype::kF16},
                                                       {"BF16", Dtype::kBF16}, {"I64", Dtype::kI64},
                                                       {"I32", Dtype::kI32}, {"F8_E4M3", Dtype::kF8E4M3}};
  const auto it = kDtypes.find(text);
  if (it == kDtypes.end()) return false;
  *dtype = it->second;
  return true;
}

float bf16_to_f32(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

float f16_to_f32(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1f;
  uint32_t mantissa = bits & 0x3ff;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));  // inf / nan
  if (exponent != 0) return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return std::bit_cast<float>(sign);  // signed zero
  // Subnormal half: value = mantissa * 2^-24, exact in fp32.
  const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
  return sign ? -magnitude : magnitude;
}

// Tensor names and metadata keys are quoted in errors here and in every loader: one with a line break or of
// kilobytes would make those messages several lines or huge (found by fuzz/fuzz_safetensors_header). Real
// checkpoints name tensors in printable ASCII ("model.layers.0.mlp.gate.weight").
constexpr size_t kMaxHeaderNameBytes = 512;
void check_header_name(const std::string& name, const char* what, const std::string& path) {
  const bool control = std::any_of(name.begin(), name.end(), [](char c) {
    const auto byte = static_cast<unsigned char>(c);
    return byte < 0x20 || byte == 0x7f;
  });
  FULCRUM_CHECK(!control && name.size() <= kMaxHeaderNameBytes,
                "{}: {} '{}' holds a control character or is over {} bytes", path, what,
                eplb::printable_excerpt(name), kMaxHeaderNameBytes);
}

// Validates one header entry and returns it; `origin` is "file: tensor 'name'".
TensorInfo parse_entry(const std::string& name, const json& entry, uint64_t data_size, const std::string& origin) {
  FULCRUM_CHECK(entry.is_object(), "{}: header entry must be an object", origin);
  TensorInfo info;
  info.name = name;
  FULCRUM_CHECK(entry.contains("dtype") && entry["dtype"].is_string(), "{}: missing or non-string dtype", origin);
  const std::string dtype = entry["dtype"].get<std::string>();
  FULCRUM_CHECK(parse_dtype(dtype, &info.dtype), "{}: unknown or unsupported dtype '{}'", origin,
                eplb::printable_excerpt(dtype));
  FULCRUM_CHECK(entry.contains("shape") && entry["shape"].is_array(), "{}: missing or non-list shape", origin);
  uint64_t numel = 1;
  for (const json& dim : entry["shape"]) {
    FULCRUM_CHECK(dim.is_number_unsigned(), "{}: shape entry {} is not a non-negative integer", origin, eplb::json_excerpt(dim));
    const uint64_t d = dim.get<uint64_t>();
    FULCRUM_CHECK(d <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) &&
                      (d == 0 || numel <= std::numeric_limits<uint64_t>::max() / 16 / d),
                  "{}: shape {} is too large", origin, eplb::json_excerpt(entry["shape"]));
    numel *= d;
    info.shape.push_back(static_cast<int64_t>(d));
  }
  const json& offsets = entry.contains("data_offsets") ? entry["data_offsets"] : json();
  FULCRUM_CHECK(offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() &&
                    offsets[1].is_number_unsigned(),
                "{}: data_offsets must be [begin, end] of non-negative integers", origin);
  info.data_begin = offsets[0].get<uint64_t>();
  info.data_end = offsets[1].get<uint64_t>();
  FULCRUM_CHECK(info.data_begin <= info.data_end && info.data_end <= data_size,
                "{}: data_offsets [{}, {}] out of range of the {}-byte data section", origin, info.data_begin,
                info.data_end, data_size);
  const uint64_t expected_bytes = numel * dtype_size(info.dtype);
  FULCRUM_CHECK(info.data_end - info.data_begin == expected_bytes,
                "{}: data_offsets span {} bytes but shape {} of {} needs {}", origin, info.data_end - info.data_begin,
                eplb::json_excerpt(entry["shape"]), dtype, expected_bytes);
  return info;
}

// Element `i` of a float tensor's data `src` (F32, BF16, F16, F8_E4M3) as fp32; other dtypes are
// rejected by the callers before.
float float_at(const uint8_t* src, Dtype dtype, int64_t i) {
  switch (dtype) {
    case Dtype::kF32: {
      float v = 0;
      std::memcpy(&v, src + 4 * i, 4);
      return v;
    }
    case Dtype::kBF16:
    case Dtype::kF16: {
      uint16_t bits = 0;
      std::memcpy(&bits, src + 2 * i, 2);
      return dtype == Dtype::kBF16 ? bf16_to_f32(bits) : f16_to_f32(bits);
    }
    case Dtype::kF8E4M3: return f8e4m3_to_f32(src[i]);
    default: return 0.0f;
  }
}

bool is_float(Dtype dtype) {
  return dtype == Dtype::kF32 || dtype == Dtype::kBF16 || dtype == Dtype::kF16 || dtype == Dtype::kF8E4M3;
}

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

float f8e4m3_to_f32(uint8_t bits) {
  const bool negative = (bits & 0x80) != 0;
  const int exponent = (bits >> 3) & 0xf;
  const int mantissa = bits & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return std::numeric_limits<float>::quiet_NaN();
  // Normal: (1 + m / 8) * 2^(e - 7) = (8 + m) * 2^(e - 10); subnormal (e = 0): m / 8 * 2^-6 = m * 2^-9.
  const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                        : std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
  return negative ? -magnitude : magnitude;
}

size_t dtype_size(Dtype dtype) {
  switch (dtype) {
    case Dtype::kF32: return 4;
    case Dtype::kF16: return 2;
    case Dtype::kBF16: return 2;
    case Dtype::kI64: return 8;
    case Dtype::kI32: return 4;
    case Dtype::kF8E4M3: return 1;
  }
  return 0;
}

const char* dtype_name(Dtype dtype) {
  switch (dtype) {
    case Dtype::kF32: return "F32";
    case Dtype::kF16: return "F16";
    case Dtype::kBF16: return "BF16";
    case Dtype::kI64: return "I64";
    case Dtype::kI32: return "I32";
    case Dtype::kF8E4M3: return "F8_E4M3";
  }
  return "?";
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

std::string shape_text(std::span<const int64_t> shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(shape[i]);
  }
  return text + "]";
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  FULCRUM_CHECK(fd >= 0, "{}: cannot open safetensors file: {}", path, std::strerror(errno));
  struct stat st{};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(fmt::format("{}: not a regular file", path));
  }
  file_size_ = static_cast<size_t>(st.st_size);
  if (file_size_ < 8) {
    ::close(fd);
    throw Error(fmt::format("{}: truncated file ({} bytes, the header length alone needs 8)", path, file_size_));
  }
  void* mapped = ::mmap(nullptr, file_size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  FULCRUM_CHECK(mapped != MAP_FAILED, "{}: mmap failed: {}", path, std::strerror(errno));
  mapped_ = static_cast<const uint8_t*>(mapped);
  try {
    uint64_t header_size = 0;
    std::memcpy(&header_size, mapped_, 8);
    FULCRUM_CHECK(header_size <= kMaxHeaderBytes && header_size <= file_size_ - 8,
                  "{}: header length {} goes beyond the file ({} bytes)", path, header_size, file_size_);
    data_ = mapped_ + 8 + header_size;
    const uint64_t data_size = file_size_ - 8 - header_size;
    const std::string header_text(reinterpret_cast<const char*>(mapped_ + 8), header_size);
    const json header = eplb::parse_json_text(header_text, path + ": header");
    FULCRUM_CHECK(header.is_object(), "{}: header must be a JSON object", path);
    for (const auto& [name, entry] : header.items()) {
      check_header_name(name, "tensor name", path);
      if (name == "__metadata__") {
        FULCRUM_CHECK(entry.is_object(), "{}: __metadata__ must be an object", path);
        for (const auto& [key, value] : entry.items()) {
          check_header_name(key, "__metadata__ key", path);
          FULCRUM_CHECK(value.is_string(), "{}: __metadata__ value of '{}' must be a string", path, key);
          metadata_[key] = value.get<std::string>();
        }
        continue;
      }
      tensors_[name] = parse_entry(name, entry, data_size, fmt::format("{}: tensor '{}'", path, name));
    }
    // No two tensors may share bytes.
    std::vector<const TensorInfo*> by_offset;
    for (const auto& [name, info] : tensors_) by_offset.push_back(&info);
    std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
      return a->data_begin != b->data_begin ? a->data_begin < b->data_begin : a->data_end < b->data_end;
    });
    const TensorInfo* furthest = nullptr;  // the non-empty tensor seen so far that ends last
    for (const TensorInfo* cur : by_offset) {
      if (cur->data_begin == cur->data_end) continue;
      FULCRUM_CHECK(furthest == nullptr || cur->data_begin >= furthest->data_end,
                    "{}: tensor '{}' (bytes [{}, {})) overlaps tensor '{}' (bytes [{}, {}))", path, cur->name,
                    cur->data_begin, cur->data_end, furthest->name, furthest->data_begin, furthest->data_end);
      if (furthest == nullptr || cur->data_end > furthest->data_end) furthest = cur;
    }
  } catch (const nlohmann::json::exception& e) {
    ::munmap(const_cast<uint8_t*>(mapped_), file_size_);
    throw Error(fmt::format("{}: malformed header: {}", path, e.what()));
  } catch (...) {
    ::munmap(const_cast<uint8_t*>(mapped_), file_size_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (mapped_ != nullptr) ::munmap(const_cast<uint8_t*>(mapped_), file_size_);
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  const auto it = tensors_.find(name);
  FULCRUM_CHECK(it != tensors_.end(), "{}: missing tensor '{}'", path_, name);
  return it->second;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> names;
  for (const auto& [name, info] : tensors_) names.push_back(name);
  return names;
}

void SafetensorsFile::read_f32_into(const std::string& name, std::span<float> out) const {
  const TensorInfo& t = info(name);
  const auto numel = static_cast<size_t>(t.numel());
  FULCRUM_CHECK(out.size() == numel, "{}: tensor '{}' has {} values, destination holds {}", path_, name, numel,
                out.size());
  FULCRUM_CHECK(is_float(t.dtype), "{}: tensor '{}' has dtype {}, expected F32, BF16, F16 or F8_E4M3", path_, name,
                dtype_name(t.dtype));
  const uint8_t* src = data_ + t.data_begin;
  if (t.dtype == Dtype::kF32) {
    if (numel > 0) std::memcpy(out.data(), src, numel * 4);
    return;
  }
  for (size_t i = 0; i < numel; ++i) out[i] = float_at(src, t.dtype, static_cast<int64_t>(i));
}

std::span<const uint8_t> SafetensorsFile::bytes(const std::string& name) const {
  const TensorInfo& t = info(name);
  return {data_ + t.data_begin, static_cast<size_t>(t.numel()) * dtype_size(t.dtype)};
}

void SafetensorsFile::read_f32_block_into(const std::string& name, int64_t row_begin, int64_t num_rows,
                                          int64_t col_begin, int64_t num_cols, std::span<float> out) const {
  const TensorInfo& t = info(name);
  FULCRUM_CHECK(t.shape.size() == 1 || t.shape.size() == 2, "{}: tensor '{}' has shape {}, a block read needs 1-D or 2-D",
                path_, name, shape_text(t.shape));
  const int64_t rows = t.shape.size() == 2 ? t.shape[0] : 1;
  const int64_t cols = t.shape.back();
  FULCRUM_CHECK(row_begin >= 0 && num_rows >= 0 && row_begin + num_rows <= rows && col_begin >= 0 && num_cols >= 0 &&
                    col_begin + num_cols <= cols,
                "{}: block rows [{}, {}) x cols [{}, {}) is outside tensor '{}' of shape {}", path_, row_begin,
                row_begin + num_rows, col_begin, col_begin + num_cols, name, shape_text(t.shape));
  FULCRUM_CHECK(static_cast<int64_t>(out.size()) == num_rows * num_cols,
                "{}: block of tensor '{}' has {} values, destination holds {}", path_, name, num_rows * num_cols,
                out.size());
  FULCRUM_CHECK(is_float(t.dtype), "{}: tensor '{}' has dtype {}, expected F32, BF16, F16 or F8_E4M3", path_, name,
                dtype_name(t.dtype));
  const uint8_t* src = data_ + t.data_begin;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t first = (row_begin + r) * cols + col_begin;  // element index in the tensor
    float* dst = out.data() + r * num_cols;
    if (t.dtype == Dtype::kF32) {
      if (num_cols > 0) std::memcpy(dst, src + 4 * first, static_cast<size_t>(num_cols) * 4);
      continue;
    }
    for (int64_t i = 0; i < num_cols; ++i) dst[i] = float_at(src, t.dtype, first + i);
  }
}

HostTensor SafetensorsFile::read_f32(const std::string& name) const {
  const TensorInfo& t = info(name);
  HostTensor tensor{t.shape, std::vector<float>(static_cast<size_t>(t.numel()))};
  read_f32_into(name, tensor.data);
  return tensor;
}

std::vector<int64_t> SafetensorsFile::read_i64(const std::string& name) const {
  const TensorInfo& t = info(name);
  const auto numel = static_cast<size_t>(t.numel());
  std::vector<int64_t> values(numel);
  const uint8_t* src = data_ + t.data_begin;
  FULCRUM_CHECK(t.dtype == Dtype::kI64 || t.dtype == Dtype::kI32, "{}: tensor '{}' has dtype {}, expected I64 or I32",
                path_, name, dtype_name(t.dtype));
  for (size_t i = 0; i < numel; ++i) {
    if (t.dtype == Dtype::kI64) {
      std::memcpy(&values[i], src + 8 * i, 8);
    } else {
      int32_t v = 0;
      std::memcpy(&v, src + 4 * i, 4);
      values[i] = v;
    }
  }
  return values;
}

Checkpoint::Checkpoint(const std::string& dir) : dir_(dir) {
  namespace fs = std::filesystem;
  const fs::path config_path = fs::path(dir) / "config.json";
  if (fs::exists(config_path)) {
    std::ifstream in(config_path, std::ios::binary);
    FULCRUM_CHECK(in.good(), "{}: cannot open", config_path.string());
    std::stringstream text;
    text << in.rdbuf();
    quantization_ = parse_quantization_config(eplb::parse_json_text(text.str(), config_path.string()),
                                              config_path.string());
  }
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  if (!fs::exists(index_path)) {
    shards_.push_back(std::make_unique<SafetensorsFile>((fs::path(dir) / "model.safetensors").string()));
    for (const std::string& name : shards_.back()->names()) file_of_[name] = shards_.back().get();
    check_quantized_layout();
    return;
  }
  std::ifstream in(index_path, std::ios::binary);
  FULCRUM_CHECK(in.good(), "{}: cannot open", index_path.string());
  std::stringstream text;
  text << in.rdbuf();
  const json index = eplb::parse_json_text(text.str(), index_path.string());
  FULCRUM_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
                "{}: missing key 'weight_map'", index_path.string());
  std::map<std::string, const SafetensorsFile*> shard_by_file;
  for (const auto& [name, file] : index["weight_map"].items()) {
    FULCRUM_CHECK(file.is_string(), "{}: weight_map entry of '{}' must be a file name", index_path.string(),
                  eplb::printable_excerpt(name, 256));
    const std::string shard_name = file.get<std::string>();
    FULCRUM_CHECK(shard_name.find('/') == std::string::npos && shard_name != ".." && !shard_name.empty(),
                  "{}: weight_map entry of '{}' must be a file in the same folder, got '{}'", index_path.string(),
                  eplb::printable_excerpt(name, 256), eplb::printable_excerpt(shard_name));
    auto it = shard_by_file.find(shard_name);
    if (it == shard_by_file.end()) {
      shards_.push_back(std::make_unique<SafetensorsFile>((fs::path(dir) / shard_name).string()));
      it = shard_by_file.emplace(shard_name, shards_.back().get()).first;
    }
    FULCRUM_CHECK(it->second->contains(name), "{}: missing tensor '{}' (listed in {})", it->second->path(),
                  eplb::printable_excerpt(name, 256), index_path.string());
    file_of_[name] = it->second;
  }
  for (const auto& shard : shards_) {
    for (const std::string& name : shard->names()) {
      FULCRUM_CHECK(file_of_.count(name) != 0 && file_of_[name] == shard.get(),
                    "{}: tensor '{}' is not listed for this shard in {}", shard->path(), name, index_path.string());
    }
  }
  check_quantized_layout();
}

void Checkpoint::check_quantized_layout() const {
  const std::string config_path = (std::filesystem::path(dir_) / "config.json").string();
  for (const auto& [name, file] : file_of_) {
    const TensorInfo& t = file->info(name);
    if (t.dtype == Dtype::kF8E4M3) {
      FULCRUM_CHECK(quantization_.has_value(),
                    "{}: tensor '{}' is F8_E4M3 but {} has no quantization_config (an FP8 checkpoint needs "
                    "quant_method fp8, weight_block_size [128, 128])",
                    file->path(), name, config_path);
      const std::string scale_name = name + kScaleInvSuffix;
      FULCRUM_CHECK(t.shape.size() == 2, "{}: F8_E4M3 tensor '{}' has shape {}, expected 2-D [out, in]", file->path(),
                    name, shape_text(t.shape));
      FULCRUM_CHECK(file_of_.count(scale_name) != 0, "{}: F8_E4M3 tensor '{}' has no scale tensor '{}'", file->path(),
                    name, scale_name);
      const SafetensorsFile* scale_file = file_of_.at(scale_name);
      const TensorInfo& scale = scale_file->info(scale_name);
      FULCRUM_CHECK(scale.dtype == Dtype::kF32 || scale.dtype == Dtype::kBF16,
                    "{}: scale tensor '{}' of F8_E4M3 tensor '{}' has dtype {}, expected F32 or BF16",
                    scale_file->path(), scale_name, name, dtype_name(scale.dtype));
      const std::vector<int64_t> expected = {ceil_div(t.shape[0], quantization_->block_rows),
                                             ceil_div(t.shape[1], quantization_->block_cols)};
      FULCRUM_CHECK(scale.shape == expected,
                    "{}: scale tensor '{}' has shape {}, expected {} (ceil of {} / [{}, {}] blocks)", scale_file->path(),
                    scale_name, shape_text(scale.shape), shape_text(expected), shape_text(t.shape),
                    quantization_->block_rows, quantization_->block_cols);
    } else if (ends_with(name, kScaleInvSuffix)) {
      const std::string weight = name.substr(0, name.size() - std::char_traits<char>::length(kScaleInvSuffix));
      const auto it = file_of_.find(weight);
      FULCRUM_CHECK(it != file_of_.end() && it->second->info(weight).dtype == Dtype::kF8E4M3,
                    "{}: scale tensor '{}' belongs to no F8_E4M3 tensor ('{}' is {})", file->path(), name, weight,
                    it == file_of_.end() ? std::string("missing") : dtype_name(it->second->info(weight).dtype));
    }
  }
}

std::vector<float> Checkpoint::read_scale_inv(const std::string& name) const {
  const std::string scale_name = name + kScaleInvSuffix;
  const SafetensorsFile* file = file_of_.at(scale_name);
  std::vector<float> scales(static_cast<size_t>(file->info(scale_name).numel()));
  file->read_f32_into(scale_name, scales);
  for (size_t i = 0; i < scales.size(); ++i) {
    FULCRUM_CHECK(std::isfinite(scales[i]) && scales[i] > 0.0f,
                  "{}: scale tensor '{}' holds {} at block {} (scales must be finite and positive)", file->path(),
                  scale_name, scales[i], i);
  }
  return scales;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> names;
  for (const auto& [name, file] : file_of_) names.push_back(name);
  return names;
}

const std::string& Checkpoint::file_of(const std::string& name) const {
  const auto it = file_of_.find(name);
  FULCRUM_CHECK(it != file_of_.end(), "{}: missing tensor '{}'", dir_, name);
  return it->second->path();
}

const TensorInfo& Checkpoint::info(const std::string& name) const {
  const auto it = file_of_.find(name);
  FULCRUM_CHECK(it != file_of_.end(), "{}: missing tensor '{}'", dir_, name);
  return it->second->info(name);
}

void Checkpoint::read_f32_into(const std::string& name, std::span<const int64_t> expected_shape,
                               std::span<float> out) {
  const TensorInfo& t = info(name);
  if (t.dtype == Dtype::kF8E4M3) {  // 2-D (checked at open): the whole tensor is one block read
    read_f32_block_into(name, expected_shape, 0, t.shape[0], 0, t.shape[1], out);
    return;
  }
  FULCRUM_CHECK(std::equal(t.shape.begin(), t.shape.end(), expected_shape.begin(), expected_shape.end()),
                "{}: tensor '{}' has shape {}, expected {}", file_of(name), name, shape_text(t.shape),
                shape_text(expected_shape));
  file_of_.at(name)->read_f32_into(name, out);
}

void Checkpoint::read_fp8_into(const std::string& name, std::span<const int64_t> expected_shape,
                               std::span<uint8_t> codes, std::span<float> scale_inv) {
  const TensorInfo& t = info(name);
  FULCRUM_CHECK(quantization_.has_value() && t.dtype == Dtype::kF8E4M3,
                "{}: tensor '{}' is {}{}, an FP8 read needs F8_E4M3 with a quantization_config", file_of(name), name,
                dtype_name(t.dtype), quantization_ ? "" : " in a checkpoint without quantization_config");
  FULCRUM_CHECK(std::equal(t.shape.begin(), t.shape.end(), expected_shape.begin(), expected_shape.end()),
                "{}: tensor '{}' has shape {}, expected {}", file_of(name), name, shape_text(t.shape),
                shape_text(expected_shape));
  const std::span<const uint8_t> stored = file_of_.at(name)->bytes(name);
  FULCRUM_CHECK(codes.size() == stored.size(), "{}: tensor '{}' has {} codes, destination holds {}", file_of(name), name,
                stored.size(), codes.size());
  std::copy(stored.begin(), stored.end(), codes.begin());
  const std::vector<float> scales = read_scale_inv(name);
  FULCRUM_CHECK(scale_inv.size() == scales.size(), "{}: tensor '{}' has {} scale blocks, destination holds {}",
                file_of(name), name, scales.size(), scale_inv.size());
  std::copy(scales.begin(), scales.end(), scale_inv.begin());
}

std::set<std::string> checked_fp8_scale_names(const Qwen3MoeConfig& config, const Checkpoint& checkpoint) {
  FULCRUM_CHECK(config.quantization.has_value() == checkpoint.quantization().has_value(),
                "{}: the model config is {} but the checkpoint's config.json is {}", checkpoint.dir(),
                config.quantization ? "FP8-quantized" : "not quantized",
                checkpoint.quantization() ? "FP8-quantized" : "not quantized (or missing)");
  if (!config.quantization) return {};
  for (const std::string& name : fp8_weight_names(config)) {
    if (!checkpoint.contains(name)) continue;
    const Dtype dtype = checkpoint.info(name).dtype;
    FULCRUM_CHECK(dtype == Dtype::kF8E4M3,
                  "{}: tensor '{}' has dtype {}, but config.json's quantization_config makes every linear weight "
                  "F8_E4M3",
                  checkpoint.file_of(name), name, dtype_name(dtype));
  }
  const std::vector<std::string> names = fp8_scale_names(config);
  return {names.begin(), names.end()};
}

void write_safetensors(const std::string& path, const std::map<std::string, HostTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    FULCRUM_CHECK(name != "__metadata__" && !name.empty(), "{}: invalid tensor name '{}'", path, name);
    int64_t numel = 1;
    for (const int64_t d : tensor.shape) {
      FULCRUM_CHECK(d >= 0, "{}: tensor '{}' has negative dimension in shape {}", path, name, shape_text(tensor.shape));
      numel *= d;
    }
    FULCRUM_CHECK(static_cast<size_t>(numel) == tensor.data.size(), "{}: tensor '{}' has shape {} but {} values",
                  path, name, shape_text(tensor.shape), tensor.data.size());
    const uint64_t bytes = static_cast<uint64_t>(numel) * 4;
    header[name] = {{"dtype", "F32"}, {"shape", tensor.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');  // data section starts 8-byte aligned
  std::string contents(8, '\0');
  const uint64_t header_size = header_text.size();
  std::memcpy(contents.data(), &header_size, 8);
  contents += header_text;
  contents.reserve(contents.size() + offset);
  for (const auto& [name, tensor] : tensors) {
    contents.append(reinterpret_cast<const char*>(tensor.data.data()), tensor.data.size() * 4);
  }
  write_file_atomically(path, contents);
}

void Checkpoint::read_f32_block_into(const std::string& name, std::span<const int64_t> expected_shape,
                                     int64_t row_begin, int64_t num_rows, int64_t col_begin, int64_t num_cols,
                                     std::span<float> out) {
  const TensorInfo& t = info(name);
  FULCRUM_CHECK(std::equal(t.shape.begin(), t.shape.end(), expected_shape.begin(), expected_shape.end()),
                "{}: tensor '{}' has shape {}, expected {}", file_of(name), name, shape_text(t.shape),
                shape_text(expected_shape));
  file_of_.at(name)->read_f32_block_into(name, row_begin, num_rows, col_begin, num_cols, out);
  if (t.dtype != Dtype::kF8E4M3) return;
  // Dequantize with the scales of the block's absolute rows and columns: W = fp8 x scale_inv[r / br][c / bc].
  const std::vector<float> scales = read_scale_inv(name);  // [ceil(out / br), ceil(in / bc)]
  const int64_t block_rows = quantization_->block_rows, block_cols = quantization_->block_cols;
  const int64_t num_col_blocks = ceil_div(t.shape[1], block_cols);
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* scale_row = scales.data() + (row_begin + r) / block_rows * num_col_blocks;
    float* dst = out.data() + r * num_cols;
    for (int64_t c = 0; c < num_cols; ++c) dst[c] *= scale_row[(col_begin + c) / block_cols];
  }
}

}  // namespace fulcrum::model
