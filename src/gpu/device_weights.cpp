#include "gpu/device_weights.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>

#include <fmt/ranges.h>

#include "backend/cuda/cuda_check.hpp"
#include "comm/device_exchange.hpp"
#include "gpu/moe/moe_kernels.hpp"
#include "eplb/error.hpp"
#include "model/checkpoint_writer.hpp"
#include "model/rng.hpp"
#include "model/synthetic_model.hpp"

namespace fulcrum::gpu {

// One checkpoint tensor and where its bf16 values go. fill_scale: the random fill's bound (0: a norm, all ones).
struct DeviceWeights::Entry {
  std::string name;
  std::vector<int64_t> shape;
  uint16_t* dst = nullptr;
  float fill_scale = 0.0f;
  int layer_idx = -1;  // -1: embedding, final norm, LM head
};

// One dense projection kept in FP8: checkpoint weights stacked by rows (each part's rows a multiple of 128) into
// codes [rows, cols] e4m3 and scales [cols / 128][rows / 128] fp32 on the device.
struct DeviceWeights::Fp8Entry {
  std::string name;                  // the cache's stem: "layers.{l}.qkv"
  std::vector<std::string> parts;    // checkpoint weights, top to bottom
  std::vector<int64_t> part_rows;
  int64_t rows = 0, cols = 0;
  uint8_t* codes = nullptr;
  float* scales = nullptr;
  float fill_scale = 0.0f;           // the random fill's bound on |W|: 1 / sqrt(fan-in)
  int layer_idx = 0;
};

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr int kFp8Block = 128;
constexpr int64_t kFp8Alignment = 256;  // every FP8 codes / scales region (TMA and 16-byte loads need 16)

int64_t qkv_rows(const model::Qwen3MoeConfig& c) {
  return int64_t{c.num_attention_heads + 2 * c.num_key_value_heads} * c.head_dim;
}

// Elements of one decoder layer's non-expert bf16 tensors (the projections kept in FP8 excluded).
int64_t layer_elems(const model::Qwen3MoeConfig& c, const DeviceWeights::Fp8Dense& fp8, int layer_idx) {
  const int64_t h = c.hidden_size, d = c.head_dim, q = int64_t{c.num_attention_heads} * d;
  int64_t n = 2 * h + 2 * d;
  if (!fp8.qkv) n += qkv_rows(c) * h;
  if (!fp8.o) n += h * q;
  if (c.is_moe_layer(layer_idx)) {
    n += int64_t{c.num_experts} * h;
  } else if (!fp8.mlp) {
    n += 3 * int64_t{c.intermediate_size} * h;
  }
  return n;
}

int64_t non_expert_elems(const model::Qwen3MoeConfig& c, const DeviceWeights::Fp8Dense& fp8) {
  int64_t n = int64_t{c.vocab_size} * c.hidden_size * (c.tie_word_embeddings ? 1 : 2) + c.hidden_size;
  for (int l = 0; l < c.num_hidden_layers; ++l) n += layer_elems(c, fp8, l);
  return n;
}

// The FP8 dense projections of a config in allocation order: per layer qkv, o, then a dense layer's gate_up, down.
enum class Fp8Proj { kQkv, kO, kGateUp, kDown };
struct Fp8Shape {
  int layer_idx;
  Fp8Proj proj;
  int64_t rows, cols;  // out, in
};

std::vector<Fp8Shape> fp8_dense_shapes(const model::Qwen3MoeConfig& c, const DeviceWeights::Fp8Dense& fp8) {
  const int64_t h = c.hidden_size, q = int64_t{c.num_attention_heads} * c.head_dim, i = c.intermediate_size;
  std::vector<Fp8Shape> out;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (fp8.qkv) out.push_back({l, Fp8Proj::kQkv, qkv_rows(c), h});
    if (fp8.o) out.push_back({l, Fp8Proj::kO, h, q});
    if (fp8.mlp && !c.is_moe_layer(l)) {
      out.push_back({l, Fp8Proj::kGateUp, 2 * i, h});
      out.push_back({l, Fp8Proj::kDown, h, i});
    }
  }
  return out;
}

int64_t fp8_align(int64_t bytes) { return (bytes + kFp8Alignment - 1) / kFp8Alignment * kFp8Alignment; }
int64_t fp8_codes_bytes(const Fp8Shape& s) { return fp8_align(s.rows * s.cols); }
int64_t fp8_scales_bytes(const Fp8Shape& s) { return fp8_align(s.rows / kFp8Block * (s.cols / kFp8Block) * 4); }
// The device pointer table: codes pointers [n], then scales pointers [n].
int64_t fp8_table_bytes(size_t n) { return fp8_align(static_cast<int64_t>(2 * sizeof(void*) * n)); }

// Bytes of the FP8 allocation: [pointer table][codes | scales of each projection in fp8_dense_shapes order].
int64_t fp8_dense_bytes(const model::Qwen3MoeConfig& c, const DeviceWeights::Fp8Dense& fp8) {
  const std::vector<Fp8Shape> shapes = fp8_dense_shapes(c, fp8);
  if (shapes.empty()) return 0;
  int64_t n = fp8_table_bytes(shapes.size());
  for (const Fp8Shape& s : shapes) n += fp8_codes_bytes(s) + fp8_scales_bytes(s);
  return n;
}

Fp8Weight& fp8_view(LayerWeights& w, Fp8Proj proj) {
  switch (proj) {
    case Fp8Proj::kQkv: return w.qkv_fp8;
    case Fp8Proj::kO: return w.o_fp8;
    case Fp8Proj::kGateUp: return w.mlp_gate_up_fp8;
    case Fp8Proj::kDown: return w.mlp_down_fp8;
  }
  return w.qkv_fp8;
}

std::string layer_name(int layer_idx, const char* what) { return fmt::format("model.layers.{}.{}", layer_idx, what); }

float fan_in_scale(int64_t fan_in) { return 1.0f / std::sqrt(static_cast<float>(fan_in)); }

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (const int64_t s : shape) n *= s;
  return n;
}

}  // namespace

bool DeviceWeights::fp8_experts_for(const model::Qwen3MoeConfig& config) {
  return config.quantization.has_value() && config.hidden_size % kFp8Block == 0;
}

int DeviceWeights::expert_intermediate_for(const model::Qwen3MoeConfig& config) {
  const int i = config.moe_intermediate_size;
  return fp8_experts_for(config) ? (i + kFp8Block - 1) / kFp8Block * kFp8Block : i;
}

DeviceWeights::Fp8Dense DeviceWeights::fp8_dense_for(const model::Qwen3MoeConfig& config, bool fp8_dense_gemms) {
  Fp8Dense fp8;
  if (!fp8_dense_gemms || !config.quantization.has_value() || config.hidden_size % kFp8Block != 0) return fp8;
  const int64_t q = int64_t{config.num_attention_heads} * config.head_dim;
  const int64_t kv = int64_t{config.num_key_value_heads} * config.head_dim;
  // q and kv rows on 128 boundaries: qkv's scale blocks then never straddle two checkpoint weights.
  fp8.qkv = q % kFp8Block == 0 && kv % kFp8Block == 0;
  fp8.o = q % kFp8Block == 0;
  const bool has_dense_layers = static_cast<int>(config.moe_layer_indices().size()) < config.num_hidden_layers;
  fp8.mlp = has_dense_layers && config.intermediate_size > 0 && config.intermediate_size % kFp8Block == 0;
  return fp8;
}

int64_t DeviceWeights::bytes_needed(const model::Qwen3MoeConfig& config, int num_slots, bool fp8_dense_gemms) {
  const Fp8Dense fp8 = fp8_dense_for(config, fp8_dense_gemms);
  const int64_t moe_layers = static_cast<int64_t>(config.moe_layer_indices().size());
  const int64_t h = config.hidden_size, i = expert_intermediate_for(config);
  const int64_t slot_bytes = fp8_experts_for(config) ? backend::fp8_blob_bytes(2 * i, h) + backend::fp8_blob_bytes(h, i)
                                                     : 2 * 3 * i * h;
  // The slot pool keeps one layer of spare buffers for migration staging.
  return 2 * non_expert_elems(config, fp8) + fp8_dense_bytes(config, fp8) +
         (moe_layers + (moe_layers > 0 ? 1 : 0)) * num_slots * slot_bytes;
}

DeviceWeights::DeviceWeights(const model::Qwen3MoeConfig& config, const eplb::Placement& placement, int device_idx,
                             bool fp8_dense_gemms, int ep_rank)
    : config_(config),
      placement_(placement),
      device_idx_(device_idx),
      ep_rank_(ep_rank),
      fp8_dense_(fp8_dense_for(config, fp8_dense_gemms)) {
  const int ep_world = placement.topology.num_gpus;
  FULCRUM_CHECK(ep_world >= 1 && ep_rank >= 0 && ep_rank < ep_world &&
                    (config.moe_layer_indices().empty() || placement.num_physical_experts() % ep_world == 0),
                "GPU weights: EP rank {} of a placement of {} slots over {} GPUs (the slots must split evenly)", ep_rank,
                placement.num_physical_experts(), ep_world);
  FULCRUM_CUDA_CHECK(cudaSetDevice(device_idx));
  const int num_slots = config.moe_layer_indices().empty() ? 0 : placement.num_physical_experts() / ep_world;
  const int64_t needed = bytes_needed(config, num_slots, fp8_dense_gemms);
  size_t free_bytes = 0, total_bytes = 0;
  FULCRUM_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  FULCRUM_CHECK(needed <= static_cast<int64_t>(free_bytes),
                "the model's {} weights need {:.2f} GiB on GPU {}, which has {:.2f} GiB free of {:.2f} GiB",
                fp8_experts_for(config) || fp8_dense_.any() ? "bf16 + FP8" : "bf16", needed / kGiB, device_idx, free_bytes / kGiB, total_bytes / kGiB);
  bytes_ = needed;
  FULCRUM_CUDA_CHECK(cudaMalloc(&base_, static_cast<size_t>(2 * non_expert_elems(config, fp8_dense_))));

  const Fp8Dense& fp8 = fp8_dense_;
  const int64_t h = config.hidden_size, d = config.head_dim, q = int64_t{config.num_attention_heads} * d;
  uint16_t* cursor = base_;
  const auto take = [&](int64_t elems) { uint16_t* p = cursor; cursor += elems; return p; };
  embed_ = take(int64_t{config.vocab_size} * h);
  norm_ = take(h);
  lm_head_ = config.tie_word_embeddings ? embed_ : take(int64_t{config.vocab_size} * h);
  for (int l = 0; l < config.num_hidden_layers; ++l) {
    LayerWeights w;
    w.layer_idx = l;
    w.moe_layer_idx = config.moe_layer_ordinal(l);
    w.input_norm = take(h);
    w.post_norm = take(h);
    if (!fp8.qkv) w.qkv = take(qkv_rows(config) * h);
    if (!fp8.o) w.o = take(h * q);
    w.q_norm = take(d);
    w.k_norm = take(d);
    if (w.moe_layer_idx >= 0) {
      w.router = take(int64_t{config.num_experts} * h);
    } else if (!fp8.mlp) {
      w.mlp_gate_up = take(2 * int64_t{config.intermediate_size} * h);
      w.mlp_down = take(h * config.intermediate_size);
    }
    layers_.push_back(w);
  }
  const std::vector<Fp8Shape> shapes = fp8_dense_shapes(config, fp8);
  if (!shapes.empty()) {
    FULCRUM_CUDA_CHECK(cudaMalloc(&fp8_base_, static_cast<size_t>(fp8_dense_bytes(config, fp8))));
    const size_t n = shapes.size();
    std::vector<const void*> table(2 * n);  // codes pointers, then scales pointers
    std::byte* at = fp8_base_ + fp8_table_bytes(n);
    for (size_t k = 0; k < n; ++k) {
      Fp8Weight& v = fp8_view(layers_[static_cast<size_t>(shapes[k].layer_idx)], shapes[k].proj);
      v.codes = reinterpret_cast<const uint8_t*>(at);
      at += fp8_codes_bytes(shapes[k]);
      v.scales = reinterpret_cast<const float*>(at);
      at += fp8_scales_bytes(shapes[k]);
      v.device_codes_ptr = reinterpret_cast<const uint8_t* const*>(fp8_base_) + k;
      v.device_scales_ptr = reinterpret_cast<const float* const*>(fp8_base_ + sizeof(void*) * n) + k;
      table[k] = v.codes;
      table[n + k] = v.scales;
    }
    FULCRUM_CUDA_CHECK(cudaMemcpy(fp8_base_, table.data(), sizeof(void*) * table.size(), cudaMemcpyHostToDevice));
    FULCRUM_CUDA_CHECK(cudaDeviceSynchronize());  // a pageable copy may return before its DMA lands
  }
  if (num_slots > 0) {
    slots_ = std::make_unique<backend::GpuSlotPool>(
        backend::SlotPoolShape{static_cast<int>(config.moe_layer_indices().size()), num_slots, config.hidden_size,
                               expert_intermediate_for(config), -1, fp8_experts_for(config)},
        device_idx);
  }
}

DeviceWeights::~DeviceWeights() {
  if (base_ != nullptr) cudaFree(base_);
  if (fp8_base_ != nullptr) cudaFree(fp8_base_);
}

std::vector<DeviceWeights::Entry> DeviceWeights::entries() const {
  const auto mut = [](const uint16_t* p) { return const_cast<uint16_t*>(p); };
  const model::Qwen3MoeConfig& c = config_;
  const int64_t h = c.hidden_size, d = c.head_dim, q = int64_t{c.num_attention_heads} * d;
  const int64_t kv = int64_t{c.num_key_value_heads} * d;
  std::vector<Entry> out;
  out.push_back({"model.embed_tokens.weight", {c.vocab_size, h}, mut(embed_), fan_in_scale(h)});
  out.push_back({"model.norm.weight", {h}, mut(norm_), 0.0f});
  if (!c.tie_word_embeddings) out.push_back({"lm_head.weight", {c.vocab_size, h}, mut(lm_head_), fan_in_scale(h)});
  for (const LayerWeights& w : layers_) {
    const int l = w.layer_idx;
    out.push_back({layer_name(l, "input_layernorm.weight"), {h}, mut(w.input_norm), 0.0f, l});
    out.push_back({layer_name(l, "post_attention_layernorm.weight"), {h}, mut(w.post_norm), 0.0f, l});
    if (w.qkv != nullptr) {  // else FP8 (fp8_entries)
      out.push_back({layer_name(l, "self_attn.q_proj.weight"), {q, h}, mut(w.qkv), fan_in_scale(h), l});
      out.push_back({layer_name(l, "self_attn.k_proj.weight"), {kv, h}, mut(w.qkv) + q * h, fan_in_scale(h), l});
      out.push_back({layer_name(l, "self_attn.v_proj.weight"), {kv, h}, mut(w.qkv) + (q + kv) * h, fan_in_scale(h), l});
    }
    if (w.o != nullptr) out.push_back({layer_name(l, "self_attn.o_proj.weight"), {h, q}, mut(w.o), fan_in_scale(q), l});
    out.push_back({layer_name(l, "self_attn.q_norm.weight"), {d}, mut(w.q_norm), 0.0f, l});
    out.push_back({layer_name(l, "self_attn.k_norm.weight"), {d}, mut(w.k_norm), 0.0f, l});
    if (w.moe_layer_idx >= 0) {
      out.push_back({layer_name(l, "mlp.gate.weight"), {c.num_experts, h}, mut(w.router), fan_in_scale(h), l});
    } else if (w.mlp_gate_up != nullptr) {
      const int64_t i = c.intermediate_size;
      out.push_back({layer_name(l, "mlp.gate_proj.weight"), {i, h}, mut(w.mlp_gate_up), fan_in_scale(h), l});
      out.push_back({layer_name(l, "mlp.up_proj.weight"), {i, h}, mut(w.mlp_gate_up) + i * h, fan_in_scale(h), l});
      out.push_back({layer_name(l, "mlp.down_proj.weight"), {h, i}, mut(w.mlp_down), fan_in_scale(i), l});
    }
  }
  return out;
}

std::vector<DeviceWeights::Fp8Entry> DeviceWeights::fp8_entries() const {
  const model::Qwen3MoeConfig& c = config_;
  const int64_t h = c.hidden_size, q = int64_t{c.num_attention_heads} * c.head_dim;
  const int64_t kv = int64_t{c.num_key_value_heads} * c.head_dim, i = c.intermediate_size;
  std::vector<Fp8Entry> out;
  for (const LayerWeights& w : layers_) {
    const int l = w.layer_idx;
    const auto add = [&](const Fp8Weight& v, const char* what, std::vector<std::pair<const char*, int64_t>> parts,
                         int64_t cols) {
      if (!v.present()) return;
      Fp8Entry e;
      e.name = fmt::format("layers.{}.{}", l, what);
      for (const auto& [part, rows] : parts) {
        e.parts.push_back(layer_name(l, part));
        e.part_rows.push_back(rows);
        e.rows += rows;
      }
      e.cols = cols;
      e.codes = const_cast<uint8_t*>(v.codes);
      e.scales = const_cast<float*>(v.scales);
      e.fill_scale = fan_in_scale(cols);
      e.layer_idx = l;
      out.push_back(std::move(e));
    };
    add(w.qkv_fp8, "qkv", {{"self_attn.q_proj.weight", q}, {"self_attn.k_proj.weight", kv}, {"self_attn.v_proj.weight", kv}}, h);
    add(w.o_fp8, "o", {{"self_attn.o_proj.weight", h}}, q);
    add(w.mlp_gate_up_fp8, "mlp_gate_up", {{"mlp.gate_proj.weight", i}, {"mlp.up_proj.weight", i}}, h);
    add(w.mlp_down_fp8, "mlp_down", {{"mlp.down_proj.weight", h}}, i);
  }
  return out;
}

void DeviceWeights::load(model::Checkpoint& checkpoint, const std::function<void(int, int)>& on_layer) {
  FULCRUM_CUDA_CHECK(cudaSetDevice(device_idx_));
  std::set<std::string> expected;
  for (const model::TensorSpec& spec : model::synthetic_tensor_specs(config_)) expected.insert(spec.name);
  // An FP8 checkpoint's scales; its weights come back dequantized from read_f32_into (W = fp8 x scale_inv).
  expected.merge(model::checked_fp8_scale_names(config_, checkpoint));
  for (const std::string& name : checkpoint.names()) {
    // A tied model's checkpoint may still store lm_head.weight; it is ignored, as the CPU loader does.
    if (name == "lm_head.weight" && config_.tie_word_embeddings) continue;
    FULCRUM_CHECK(expected.count(name) != 0, "{}: unexpected tensor '{}' (not part of a {}-layer Qwen3-MoE of this config)",
                  checkpoint.file_of(name), name, config_.num_hidden_layers);
  }
  std::vector<float> host;
  const auto read = [&](const std::string& name, const std::vector<int64_t>& shape, std::vector<uint16_t>& out, size_t at) {
    FULCRUM_CHECK(checkpoint.contains(name), "{}: missing tensor '{}'", checkpoint.dir(), name);
    const int64_t n = numel_of(shape);
    host.resize(static_cast<size_t>(n));
    checkpoint.read_f32_into(name, shape, host);
    for (int64_t i = 0; i < n; ++i) out[at + static_cast<size_t>(i)] = model::f32_to_bf16_bits(host[static_cast<size_t>(i)]);
  };
  std::vector<uint8_t> part_codes;
  std::vector<float> part_scales;
  const auto read_fp8 = [&](const Fp8Entry& e, std::vector<uint8_t>& codes, std::vector<float>& scales) {
    const int64_t row_blocks = e.rows / kFp8Block, col_blocks = e.cols / kFp8Block;  // whole (fp8_dense_for)
    codes.resize(static_cast<size_t>(e.rows * e.cols));
    scales.resize(static_cast<size_t>(row_blocks * col_blocks));
    int64_t first_row = 0;
    for (size_t p = 0; p < e.parts.size(); ++p) {
      const int64_t rows = e.part_rows[p];
      FULCRUM_CHECK(checkpoint.contains(e.parts[p]), "{}: missing tensor '{}'", checkpoint.dir(), e.parts[p]);
      part_codes.resize(static_cast<size_t>(rows * e.cols));
      part_scales.resize(static_cast<size_t>(rows / kFp8Block * col_blocks));
      const std::vector<int64_t> shape = {rows, e.cols};
      checkpoint.read_fp8_into(e.parts[p], shape, part_codes, part_scales);
      std::memcpy(codes.data() + first_row * e.cols, part_codes.data(), part_codes.size());
      // The checkpoint's [row blocks][col blocks] -> [col blocks][row blocks], below the earlier parts' row blocks.
      for (int64_t rb = 0; rb < rows / kFp8Block; ++rb) {
        for (int64_t cb = 0; cb < col_blocks; ++cb) {
          scales[static_cast<size_t>(cb * row_blocks + first_row / kFp8Block + rb)] = part_scales[static_cast<size_t>(rb * col_blocks + cb)];
        }
      }
      first_row += rows;
    }
  };
  const int64_t h = config_.hidden_size, im = config_.moe_intermediate_size;
  std::vector<uint16_t> gate_up_bits, down_bits;
  upload_in_order(
      [&](const Entry& e, std::vector<uint16_t>& bits) {
        bits.resize(static_cast<size_t>(numel_of(e.shape)));
        read(e.name, e.shape, bits, 0);
      },
      read_fp8,
      [&](int l, int moe, std::vector<std::byte>& gate_up, std::vector<std::byte>& down) {
        const std::span<const int32_t> map = local_row(moe);
        const auto expert = [&](size_t s, const char* proj) {
          return layer_name(l, fmt::format("mlp.experts.{}.{}.weight", map[s], proj).c_str());
        };
        if (fp8_experts()) {
          load_fp8_slots(checkpoint, map.size(), expert, gate_up, down);
          return;
        }
        gate_up_bits.resize(map.size() * static_cast<size_t>(2 * im * h));
        down_bits.resize(map.size() * static_cast<size_t>(h * im));
        for (size_t s = 0; s < map.size(); ++s) {
          read(expert(s, "gate_proj"), {im, h}, gate_up_bits, s * static_cast<size_t>(2 * im * h));
          read(expert(s, "up_proj"), {im, h}, gate_up_bits, s * static_cast<size_t>(2 * im * h) + static_cast<size_t>(im * h));
          read(expert(s, "down_proj"), {h, im}, down_bits, s * static_cast<size_t>(h * im));
        }
        as_blob(gate_up_bits, gate_up);
        as_blob(down_bits, down);
      },
      on_layer);
}

void DeviceWeights::as_blob(const std::vector<uint16_t>& bits, std::vector<std::byte>& blob) {
  blob.resize(bits.size() * 2);
  std::memcpy(blob.data(), bits.data(), blob.size());
}

void DeviceWeights::load_fp8_slots(model::Checkpoint& checkpoint, size_t num_slots,
                                   const std::function<std::string(size_t, const char*)>& expert_name,
                                   std::vector<std::byte>& gate_up, std::vector<std::byte>& down) {
  // The slot pool's FP8 blobs (gpu_slot_pool.hpp) with I padded to ip: gate rows [0, I), up rows [ip, ip + I) of
  // gate_up [2 ip, H]; down [H, ip]; padding codes 0 (e4m3 +0). Scales transposed from the checkpoint's
  // [row blocks][col blocks] into [col blocks][row blocks] (the FP8 GEMM's MN-major weight scales).
  const int64_t h = config_.hidden_size, im = config_.moe_intermediate_size, ip = expert_intermediate_size();
  const int64_t hb = h / kFp8Block, ib = ip / kFp8Block;  // whole blocks (ip padded; h checked)
  const int64_t gu_bytes = slots_->gate_up_blob_bytes(), dn_bytes = slots_->down_blob_bytes();
  gate_up.assign(num_slots * static_cast<size_t>(gu_bytes), std::byte{0});
  down.assign(num_slots * static_cast<size_t>(dn_bytes), std::byte{0});
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  const auto read = [&](const std::string& name, int64_t rows, int64_t cols) {
    codes.resize(static_cast<size_t>(rows * cols));
    scales.resize(static_cast<size_t>((rows + kFp8Block - 1) / kFp8Block * ((cols + kFp8Block - 1) / kFp8Block)));
    const std::vector<int64_t> shape = {rows, cols};
    checkpoint.read_fp8_into(name, shape, codes, scales);
  };
  for (size_t s = 0; s < num_slots; ++s) {
    std::byte* gu = gate_up.data() + s * static_cast<size_t>(gu_bytes);
    float* gu_scales = reinterpret_cast<float*>(gu + backend::fp8_scales_offset(2 * ip, h));
    for (int half = 0; half < 2; ++half) {  // gate, then up
      read(expert_name(s, half == 0 ? "gate_proj" : "up_proj"), im, h);
      std::memcpy(gu + half * ip * h, codes.data(), codes.size());
      for (int64_t rb = 0; rb < (im + kFp8Block - 1) / kFp8Block; ++rb) {
        for (int64_t kb = 0; kb < hb; ++kb) gu_scales[kb * 2 * ib + half * ib + rb] = scales[rb * hb + kb];
      }
    }
    std::byte* dn = down.data() + s * static_cast<size_t>(dn_bytes);
    float* dn_scales = reinterpret_cast<float*>(dn + backend::fp8_scales_offset(h, ip));
    read(expert_name(s, "down_proj"), h, im);
    for (int64_t r = 0; r < h; ++r) std::memcpy(dn + r * ip, codes.data() + r * im, static_cast<size_t>(im));
    const int64_t im_blocks = (im + kFp8Block - 1) / kFp8Block;
    for (int64_t rb = 0; rb < hb; ++rb) {
      for (int64_t kb = 0; kb < im_blocks; ++kb) dn_scales[kb * hb + rb] = scales[rb * im_blocks + kb];
    }
  }
}

void DeviceWeights::upload_in_order(const EntryBits& entry_bits, const Fp8Bits& fp8_bits, const SlotBits& slot_bits,
                                    const std::function<void(int, int)>& on_layer) {
  const std::vector<Entry> all = entries();
  const std::vector<Fp8Entry> fp8 = fp8_entries();  // by layer, as layers_
  std::vector<uint16_t> bits;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  std::vector<std::byte> gate_up, down;
  size_t next = 0, next_fp8 = 0;
  const auto upload_until = [&](int layer_idx) {  // the entries of the embedding/head, or of one layer
    for (; next < all.size() && all[next].layer_idx == layer_idx; ++next) {
      entry_bits(all[next], bits);
      FULCRUM_CUDA_CHECK(cudaMemcpy(all[next].dst, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
    }
  };
  upload_until(-1);
  for (int l = 0; l < config_.num_hidden_layers; ++l) {
    upload_until(l);
    for (; next_fp8 < fp8.size() && fp8[next_fp8].layer_idx == l; ++next_fp8) {
      const Fp8Entry& e = fp8[next_fp8];
      fp8_bits(e, codes, scales);
      FULCRUM_CHECK(static_cast<int64_t>(codes.size()) == e.rows * e.cols &&
                        static_cast<int64_t>(scales.size()) == e.rows / kFp8Block * (e.cols / kFp8Block),
                    "{}: {} codes / {} scales for [{}, {}]", e.name, codes.size(), scales.size(), e.rows, e.cols);
      FULCRUM_CUDA_CHECK(cudaMemcpy(e.codes, codes.data(), codes.size(), cudaMemcpyHostToDevice));
      FULCRUM_CUDA_CHECK(cudaMemcpy(e.scales, scales.data(), scales.size() * 4, cudaMemcpyHostToDevice));
    }
    const int moe = layers_[static_cast<size_t>(l)].moe_layer_idx;
    if (moe >= 0) {
      slot_bits(l, moe, gate_up, down);
      slots_->upload_layer_blobs(moe, gate_up, down);
    }
    if (on_layer) on_layer(l + 1, config_.num_hidden_layers);
  }
  // Pageable copies may return before their DMA lands; the engine's non-blocking stream does not wait for them.
  FULCRUM_CUDA_CHECK(cudaDeviceSynchronize());
}

void DeviceWeights::fill_random(uint64_t seed) {
  FULCRUM_CUDA_CHECK(cudaSetDevice(device_idx_));
  const uint16_t one = model::f32_to_bf16_bits(1.0f);
  std::vector<uint16_t> ones;
  uint64_t stream = seed;
  for (const Entry& e : entries()) {
    const int64_t n = numel_of(e.shape);
    if (e.fill_scale == 0.0f) {
      ones.assign(static_cast<size_t>(n), one);
      FULCRUM_CUDA_CHECK(cudaMemcpy(e.dst, ones.data(), ones.size() * 2, cudaMemcpyHostToDevice));
    } else {
      FULCRUM_CUDA_CHECK(cuda::moe::launch_fill_random_bf16(e.dst, n, model::splitmix64(stream), e.fill_scale, nullptr));
    }
  }
  // FP8 projections: codes uniform over e4m3 in [-448, 448], one scale for all blocks, so W spans the bf16 fill's
  // +-1/sqrt(fan_in).
  for (const Fp8Entry& e : fp8_entries()) {
    FULCRUM_CUDA_CHECK(cuda::moe::launch_fill_random_e4m3(e.codes, e.rows * e.cols, model::splitmix64(stream), nullptr));
    FULCRUM_CUDA_CHECK(cuda::moe::launch_fill_f32(e.scales, e.rows / kFp8Block * (e.cols / kFp8Block),
                                                  e.fill_scale / 448.0f, nullptr));
  }
  FULCRUM_CUDA_CHECK(cudaDeviceSynchronize());
  for (int moe = 0; slots_ && moe < placement_.num_layers; ++moe) slots_->fill_layer(moe, local_row(moe), seed);
}

std::span<const int32_t> DeviceWeights::local_row(int moe_layer) const {
  const int per_rank = placement_.num_physical_experts() / placement_.topology.num_gpus;
  return placement_.layer(moe_layer).subspan(static_cast<size_t>(ep_rank_) * per_rank, static_cast<size_t>(per_rank));
}

int DeviceWeights::migrate_layer(int moe_layer, std::span<const int32_t> new_row, comm::DeviceExchange* exchange) {
  FULCRUM_CHECK(slots_ != nullptr && moe_layer >= 0 && moe_layer < placement_.num_layers,
                "GPU weights: no MoE layer {} to migrate ({} MoE layers)", moe_layer, placement_.num_layers);
  const int ranks = exchange != nullptr ? exchange->size() : 1;
  FULCRUM_CHECK(placement_.topology.num_gpus == ranks && (exchange == nullptr || exchange->rank() == ep_rank_),
                "GPU weights: a migration over {} rank(s) (this one {}) of a placement on {} GPUs held by EP rank {}",
                ranks, exchange != nullptr ? exchange->rank() : 0, placement_.topology.num_gpus, ep_rank_);
  const int moved = exchange != nullptr
                        ? slots_->migrate_layer_over(*exchange, moe_layer, placement_.layer(moe_layer), new_row)
                        : slots_->migrate_layer_locally(moe_layer, placement_.layer(moe_layer), new_row);
  std::copy(new_row.begin(), new_row.end(), placement_.layer(moe_layer).begin());
  return moved;
}

namespace {

constexpr const char* kCacheFormat = "fulcrum-gpu-weight-cache-1";
// Which weights the cache holds in FP8. A cache without this key was written before FP8 caches existed: bf16.
constexpr const char* kWeightsKey = "weights";
constexpr const char* kBf16Weights = "bf16";
constexpr int64_t kEmitChunk = int64_t{1} << 20;  // values converted per writer call

std::string slot_tensor(int moe, const char* what) { return fmt::format("slots.{}.{}", moe, what); }
std::string codes_tensor(const std::string& stem) { return stem + ".codes"; }
std::string scales_tensor(const std::string& stem) { return stem + ".scales"; }

// The cache holds every slot of one GPU: an EP rank's part is refused.
void require_every_slot(const eplb::Placement& placement, int ep_rank) {
  FULCRUM_CHECK(placement.topology.num_gpus == 1, "--weight-cache: the cache holds every slot of one GPU, not an EP "
                "rank's part ({} of {}); start without it", ep_rank, placement.topology.num_gpus);
}

}  // namespace

std::string DeviceWeights::cache_file(const std::string& dir) { return dir + "/gpu-rank0/model.safetensors"; }

std::string DeviceWeights::weights_identity() const {
  const Fp8Dense& fp8 = fp8_dense_;
  if (!fp8_experts() && !fp8.any()) return kBf16Weights;
  std::string parts;
  if (fp8_experts()) parts += " experts";
  if (fp8.qkv) parts += " qkv";
  if (fp8.o) parts += " o";
  if (fp8.mlp) parts += " mlp";
  return "fp8 e4m3 with 128x128 block scales:" + parts;
}

std::map<std::string, std::string> DeviceWeights::cache_identity() const {
  std::map<std::string, std::string> identity = {{"format", kCacheFormat},
                                                 {"config", model::weight_cache_config_identity(config_)},
                                                 {kWeightsKey, weights_identity()}};
  for (int moe = 0; slots_ && moe < placement_.num_layers; ++moe) {
    identity[fmt::format("slot_map.{}", moe)] = fmt::format("{}", fmt::join(placement_.layer(moe), " "));
  }
  return identity;
}

// In file order: the bf16 entries (the file's default dtype), two tensors per FP8 entry (codes, scales), then per
// MoE layer its slot arrays: bf16 gate_up, down; FP8 gate_up, gate_up_scales, down, down_scales.
std::vector<model::TensorSpec> DeviceWeights::cache_specs() const {
  std::vector<model::TensorSpec> specs;
  for (const Entry& e : entries()) specs.push_back({e.name, e.shape, std::nullopt});
  for (const Fp8Entry& e : fp8_entries()) {
    specs.push_back({codes_tensor(e.name), {e.rows, e.cols}, model::Dtype::kF8E4M3});
    specs.push_back({scales_tensor(e.name), {e.cols / kFp8Block, e.rows / kFp8Block}, model::Dtype::kF32});
  }
  const int num_moe = slots_ ? placement_.num_layers : 0;
  const int64_t p = slots_ ? placement_.num_physical_experts() : 0;
  const int64_t h = config_.hidden_size, i = expert_intermediate_size();
  for (int moe = 0; moe < num_moe; ++moe) {
    if (fp8_experts()) {
      specs.push_back({slot_tensor(moe, "gate_up"), {p, 2 * i, h}, model::Dtype::kF8E4M3});
      specs.push_back({slot_tensor(moe, "gate_up_scales"), {p, h / kFp8Block, 2 * i / kFp8Block}, model::Dtype::kF32});
      specs.push_back({slot_tensor(moe, "down"), {p, h, i}, model::Dtype::kF8E4M3});
      specs.push_back({slot_tensor(moe, "down_scales"), {p, i / kFp8Block, h / kFp8Block}, model::Dtype::kF32});
    } else {
      specs.push_back({slot_tensor(moe, "gate_up"), {p, 2 * i, h}, std::nullopt});
      specs.push_back({slot_tensor(moe, "down"), {p, h, i}, std::nullopt});
    }
  }
  return specs;
}

void DeviceWeights::save_cache(const std::string& dir) const {
  require_every_slot(placement_, ep_rank_);
  FULCRUM_CUDA_CHECK(cudaSetDevice(device_idx_));
  const std::vector<Entry> all = entries();
  const std::vector<Fp8Entry> fp8 = fp8_entries();
  const std::vector<model::TensorSpec> specs = cache_specs();
  std::map<std::string, size_t> index_of;
  for (size_t k = 0; k < specs.size(); ++k) index_of[specs[k].name] = k;
  const size_t slots_begin = all.size() + 2 * fp8.size();
  const size_t per_moe = fp8_experts() ? 4 : 2;
  const int64_t h = config_.hidden_size, i = expert_intermediate_size();
  const int64_t p = slots_ ? placement_.num_physical_experts() : 0;
  // The writer takes floats and stores them in the spec's dtype: exact for bf16 values, e4m3 values (every finite
  // code maps back to itself, -0 included; the checkpoint loaders admit no NaN) and fp32.
  using Emit = std::function<void(std::span<const float>)>;
  std::vector<float> chunk;
  std::vector<uint8_t> codes;
  const auto emit_bf16 = [&](const std::vector<uint16_t>& bits, const Emit& emit) {
    chunk.resize(bits.size());
    for (size_t q = 0; q < bits.size(); ++q) chunk[q] = model::bf16_bits_to_f32(bits[q]);
    emit(chunk);
  };
  const auto emit_codes = [&](const uint8_t* device, int64_t n, const Emit& emit) {
    codes.resize(static_cast<size_t>(n));
    FULCRUM_CUDA_CHECK(cudaMemcpy(codes.data(), device, codes.size(), cudaMemcpyDeviceToHost));
    for (int64_t first = 0; first < n; first += kEmitChunk) {
      const int64_t count = std::min(kEmitChunk, n - first);
      chunk.resize(static_cast<size_t>(count));
      for (int64_t q = 0; q < count; ++q) chunk[static_cast<size_t>(q)] = model::f8e4m3_to_f32(codes[static_cast<size_t>(first + q)]);
      emit(chunk);
    }
  };
  const auto emit_f32 = [&](const float* device, int64_t n, const Emit& emit) {
    chunk.resize(static_cast<size_t>(n));
    FULCRUM_CUDA_CHECK(cudaMemcpy(chunk.data(), device, chunk.size() * 4, cudaMemcpyDeviceToHost));
    emit(chunk);
  };
  const auto produce = [&](const model::TensorSpec& spec, const Emit& emit) {
    const size_t k = index_of.at(spec.name);
    if (k < all.size()) {
      std::vector<uint16_t> bits(static_cast<size_t>(numel_of(spec.shape)));
      FULCRUM_CUDA_CHECK(cudaMemcpy(bits.data(), all[k].dst, bits.size() * 2, cudaMemcpyDeviceToHost));
      emit_bf16(bits, emit);
      return;
    }
    if (k < slots_begin) {
      const Fp8Entry& e = fp8[(k - all.size()) / 2];
      if ((k - all.size()) % 2 == 0) {
        emit_codes(e.codes, e.rows * e.cols, emit);
      } else {
        emit_f32(e.scales, e.rows / kFp8Block * (e.cols / kFp8Block), emit);
      }
      return;
    }
    const int moe = static_cast<int>((k - slots_begin) / per_moe);
    const size_t which = (k - slots_begin) % per_moe;  // the cache_specs order
    for (int s = 0; s < p; ++s) {
      if (!fp8_experts()) {
        const auto [gu, dn] = slots_->download_slot(moe, s);
        emit_bf16(which == 0 ? gu : dn, emit);
        continue;
      }
      const int32_t buffer = slots_->map().buffer_of(moe, s);
      const bool gate_up = which < 2;
      const backend::Fp8MatrixPtrs m = gate_up ? slots_->gate_up_fp8(buffer) : slots_->down_fp8(buffer);
      const int64_t rows = gate_up ? 2 * i : h, cols = gate_up ? h : i;
      if (which % 2 == 0) {
        emit_codes(m.codes, rows * cols, emit);
      } else {
        emit_f32(m.scales, rows / kFp8Block * (cols / kFp8Block), emit);
      }
    }
  };
  const std::string file = cache_file(dir);
  std::filesystem::create_directories(std::filesystem::path(file).parent_path());
  // One file (no shard limit): the cache is read back whole by this engine only.
  model::write_checkpoint(std::filesystem::path(file).parent_path().string(), specs, model::Dtype::kBF16, UINT64_MAX,
                          produce, cache_identity());
}

void DeviceWeights::load_cache(const std::string& dir, const std::function<void(int, int)>& on_layer) {
  require_every_slot(placement_, ep_rank_);
  FULCRUM_CUDA_CHECK(cudaSetDevice(device_idx_));
  const std::string path = cache_file(dir);
  const model::SafetensorsFile file(path);
  // The weights' dtype first, so a bf16 cache met by an FP8 model (or the reverse) is named as that.
  const auto found_weights = file.metadata().find(kWeightsKey);
  const std::string cached_weights = found_weights == file.metadata().end() ? kBf16Weights : found_weights->second;
  FULCRUM_CHECK(cached_weights == weights_identity(),
                "{}: weight cache holds {} weights, this model {}: delete it to rebuild it", path, cached_weights,
                weights_identity());
  for (const auto& [key, expected] : cache_identity()) {
    if (key == kWeightsKey) continue;
    const auto found = file.metadata().find(key);
    FULCRUM_CHECK(found != file.metadata().end() && found->second == expected,
                  "{}: weight cache written for another {} ({}; this model: {}): delete it to rebuild it", path, key,
                  found == file.metadata().end() ? std::string("missing") : found->second, expected);
  }
  const std::vector<model::TensorSpec> specs = cache_specs();
  FULCRUM_CHECK(file.names().size() == specs.size(), "{}: weight cache holds {} tensors, this model {}", path,
                file.names().size(), specs.size());
  std::map<std::string, const model::TensorSpec*> spec_of;
  for (const model::TensorSpec& spec : specs) spec_of[spec.name] = &spec;
  // A tensor's stored bytes (the device's bits) after checking its shape and dtype.
  const auto stored = [&](const std::string& name) {
    const model::TensorSpec& spec = *spec_of.at(name);
    const model::Dtype dtype = spec.dtype.value_or(model::Dtype::kBF16);
    const model::TensorInfo& info = file.info(name);
    FULCRUM_CHECK(info.shape == spec.shape, "{}: tensor '{}' has shape {}, expected {}", path, name,
                  model::shape_text(info.shape), model::shape_text(spec.shape));
    FULCRUM_CHECK(info.dtype == dtype, "{}: tensor '{}' is {}, the cache holds {}", path, name,
                  model::dtype_name(info.dtype), model::dtype_name(dtype));
    const std::span<const uint8_t> bytes = file.bytes(name);
    FULCRUM_CHECK(bytes.size() == static_cast<size_t>(numel_of(spec.shape)) * model::dtype_size(dtype),
                  "{}: tensor '{}' holds {} bytes, expected {}", path, name, bytes.size(),
                  static_cast<size_t>(numel_of(spec.shape)) * model::dtype_size(dtype));
    return bytes;
  };
  const auto copy_to = [](std::span<const uint8_t> bytes, auto& out) {
    out.resize(bytes.size() / sizeof(out[0]));
    std::memcpy(out.data(), bytes.data(), bytes.size());
  };
  const int64_t h = config_.hidden_size, i = expert_intermediate_size(), p = placement_.num_physical_experts();
  upload_in_order([&](const Entry& e, std::vector<uint16_t>& bits) { copy_to(stored(e.name), bits); },
                  [&](const Fp8Entry& e, std::vector<uint8_t>& codes, std::vector<float>& scales) {
                    copy_to(stored(codes_tensor(e.name)), codes);
                    copy_to(stored(scales_tensor(e.name)), scales);
                  },
                  [&](int, int moe, std::vector<std::byte>& gate_up, std::vector<std::byte>& down) {
                    if (!fp8_experts()) {  // the stored bytes are the bf16 blobs [P][2I, H] / [P][H, I]
                      copy_to(stored(slot_tensor(moe, "gate_up")), gate_up);
                      copy_to(stored(slot_tensor(moe, "down")), down);
                      return;
                    }
                    // FP8 blobs (gpu_slot_pool.hpp): codes, then the scales at fp8_scales_offset, zero padding.
                    const auto blobs = [&](const char* codes_name, const char* scales_name, int64_t rows, int64_t cols,
                                           int64_t blob_bytes, std::vector<std::byte>& out) {
                      const std::span<const uint8_t> codes = stored(slot_tensor(moe, codes_name));
                      const std::span<const uint8_t> scales = stored(slot_tensor(moe, scales_name));
                      const size_t code_bytes = static_cast<size_t>(rows * cols);
                      const size_t scale_bytes = static_cast<size_t>(rows / kFp8Block * (cols / kFp8Block) * 4);
                      const size_t scales_at = static_cast<size_t>(backend::fp8_scales_offset(rows, cols));
                      out.assign(static_cast<size_t>(p * blob_bytes), std::byte{0});
                      for (int64_t s = 0; s < p; ++s) {
                        std::byte* blob = out.data() + s * blob_bytes;
                        std::memcpy(blob, codes.data() + s * code_bytes, code_bytes);
                        std::memcpy(blob + scales_at, scales.data() + s * scale_bytes, scale_bytes);
                      }
                    };
                    blobs("gate_up", "gate_up_scales", 2 * i, h, slots_->gate_up_blob_bytes(), gate_up);
                    blobs("down", "down_scales", h, i, slots_->down_blob_bytes(), down);
                  },
                  on_layer);
}

}  // namespace fulcrum::gpu
