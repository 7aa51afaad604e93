#pragma once
// Safetensors checkpoints: a read-only memory map of one file, sharded checkpoints through
// model.safetensors.index.json, and a writer for fp32 dumps.
//
// File layout: [u64 little-endian N][N bytes of JSON header][data]. The header maps each tensor name to
// {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the data section), plus an optional
// "__metadata__" object of strings. Every problem is a one-line fulcrum::Error naming the file and tensor.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "model/qwen3_config.hpp"

namespace fulcrum::model {

// kF8E4M3: float8_e4m3fn ("F8_E4M3"): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinity,
// 0x7f / 0xff are NaN, largest finite 448.
enum class Dtype { kF32, kF16, kBF16, kI64, kI32, kF8E4M3 };

// Bytes per element of `dtype`.
size_t dtype_size(Dtype dtype);
const char* dtype_name(Dtype dtype);

struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::kF32;
  std::vector<int64_t> shape;
  uint64_t data_begin = 0;  // offset into the data section
  uint64_t data_end = 0;

  int64_t numel() const;
};

// A host fp32 tensor, row-major: what the writer takes and what readers return.
struct HostTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;  // [prod(shape)]
};

std::string shape_text(std::span<const int64_t> shape);

// The exact fp32 value of float8_e4m3fn bits.
float f8e4m3_to_f32(uint8_t bits);

// One .safetensors file, mapped read-only for the lifetime of the object. The header is fully validated
// at open: sizes, dtypes, offsets in range, no overlap, byte count = numel x dtype size.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;  // throws "missing tensor"
  std::vector<std::string> names() const;                  // sorted

  // Converts a float tensor (F32, BF16, F16, F8_E4M3: the raw fp8 values, unscaled) to fp32 into `out`, which must hold numel() values.
  void read_f32_into(const std::string& name, std::span<float> out) const;
  // Block [row_begin, row_begin + num_rows) x [col_begin, col_begin + num_cols) of a 2-D float tensor (a
  // 1-D tensor is one row), converted to fp32 into `out` (num_rows * num_cols values, row-major). Reads
  // only those elements: what a tensor-parallel rank loads of a sharded weight.
  void read_f32_block_into(const std::string& name, int64_t row_begin, int64_t num_rows, int64_t col_begin,
                           int64_t num_cols, std::span<float> out) const;
  HostTensor read_f32(const std::string& name) const;
  // The stored bytes of a tensor as they lie in the file (numel x dtype size), e.g. F8_E4M3 codes.
  std::span<const uint8_t> bytes(const std::string& name) const;
  // Integer tensors (I64, I32), e.g. token ids of golden data.
  std::vector<int64_t> read_i64(const std::string& name) const;

 private:
  std::string path_;
  const uint8_t* mapped_ = nullptr;
  size_t file_size_ = 0;
  const uint8_t* data_ = nullptr;  // start of the data section
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint folder: model.safetensors.index.json (weight_map: name -> shard file) when present, else
// model.safetensors.
//
// FP8 block quantization (the Qwen3-*-FP8 layout, see Fp8BlockQuantization in qwen3_config.hpp): the
// folder's config.json, when present, is read for its `quantization_config`. With one, every F8_E4M3
// tensor `w` [out, in] must have `w_scale_inv` [ceil(out / 128), ceil(in / 128)] of dtype F32 or BF16,
// every `*_scale_inv` must belong to an F8_E4M3 tensor, and the read_f32* functions return the
// dequantized weight W[r][c] = fp8[r][c] * scale_inv[r / 128][c / 128] (one fp32 multiply; a block read
// uses the scales of its absolute rows and columns, so a tensor-parallel shard may cut a 128 block).
// Scales are checked finite and positive when their weight is read. Without a quantization_config an
// F8_E4M3 tensor is an error. All checked at open (header only) or read, as one-line errors.
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& dir);
  // The checkpoint's FP8 block quantization (from config.json), or nullopt.
  const std::optional<Fp8BlockQuantization>& quantization() const { return quantization_; }

  const std::string& dir() const { return dir_; }
  bool contains(const std::string& name) const { return file_of_.count(name) != 0; }
  std::vector<std::string> names() const;  // sorted
  const TensorInfo& info(const std::string& name) const;
  // Reads `name` as fp32 into `out`; its shape must equal `expected_shape` (else "wrong shape" error).
  void read_f32_into(const std::string& name, std::span<const int64_t> expected_shape, std::span<float> out);
  // The block rows [row_begin, +num_rows) x cols [col_begin, +num_cols) of a tensor of shape `expected_shape`
  // (2-D, or 1-D as one row); shape checked as above.
  void read_f32_block_into(const std::string& name, std::span<const int64_t> expected_shape, int64_t row_begin,
                           int64_t num_rows, int64_t col_begin, int64_t num_cols, std::span<float> out);
  // An F8_E4M3 tensor of shape `expected_shape` [out, in] as it is stored: its codes into `codes` (out * in
  // bytes, row-major) and its scales into `scale_inv` (ceil(out / 128) * ceil(in / 128), checked finite and
  // positive as for the dequantizing reads), for a device that computes in FP8. A tensor of another dtype or a
  // checkpoint without quantization_config is a one-line error.
  void read_fp8_into(const std::string& name, std::span<const int64_t> expected_shape, std::span<uint8_t> codes,
                     std::span<float> scale_inv);
  // Where a tensor lives, for messages: "dir/model-00001-of-00002.safetensors".
  const std::string& file_of(const std::string& name) const;

 private:
  // The scales of F8_E4M3 tensor `name` as fp32 [ceil(out / 128) * ceil(in / 128)], checked finite, > 0.
  std::vector<float> read_scale_inv(const std::string& name) const;
  void check_quantized_layout() const;

  std::string dir_;
  std::optional<Fp8BlockQuantization> quantization_;
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  std::map<std::string, const SafetensorsFile*> file_of_;
};

// The scale tensors a loader of `config` accepts in `checkpoint` beside the model's own tensors
// (fp8_scale_names; empty unless quantized), after checking that the checkpoint's config.json and
// `config` agree on quantization and that, when quantized, every linear weight present is F8_E4M3
// (missing ones are reported when read). One-line errors.
std::set<std::string> checked_fp8_scale_names(const Qwen3MoeConfig& config, const Checkpoint& checkpoint);

// Writes fp32 tensors (sorted by name, 8-byte aligned data) atomically through write_file_atomically.
void write_safetensors(const std::string& path, const std::map<std::string, HostTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace fulcrum::model
