#include "gpu/device_weights.hpp"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>

#include <fmt/ranges.h>

#include "backend/cuda/cuda_check.hpp"
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

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr int kFp8Block = 128;

int64_t qkv_rows(const model::Qwen3MoeConfig& c) {
  return int64_t{c.num_attention_heads + 2 * c.num_key_value_heads} * c.head_dim;
}

// Elements of one decoder layer's non-expert tensors.
int64_t layer_elems(const model::Qwen3MoeConfig& c, int layer_idx) {
  const int64_t h = c.hidden_size, d = c.head_dim, q = int64_t{c.num_attention_heads} * d;
  int64_t n = 2 * h + qkv_rows(c) * h + h * q + 2 * d;
  n += c.is_moe_layer(layer_idx) ? int64_t{c.num_experts} * h : 3 * int64_t{c.intermediate_size} * h;
  return n;
}

int64_t non_expert_elems(const model::Qwen3MoeConfig& c) {
  int64_t n = int64_t{c.vocab_size} * c.hidden_size * (c.tie_word_embeddings ? 1 : 2) + c.hidden_size;
  for (int l = 0; l < c.num_hidden_layers; ++l) n += layer_elems(c, l);
  return n;
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

int64_t DeviceWeights::bytes_needed(const model::Qwen3MoeConfig& config, int num_slots) {
  const int64_t moe_layers = static_cast<int64_t>(config.moe_layer_indices().size());
  const int64_t h = config.hidden_size, i = expert_intermediate_for(config);
  const int64_t slot_bytes = fp8_experts_for(config) ? backend::fp8_blob_bytes(2 * i, h) + backend::fp8_blob_bytes(h, i)
                                                     : 2 * 3 * i * h;
  // The slot pool keeps one layer of spare buffers for migration staging.
  return 2 * non_expert_elems(config) + (moe_layers + (moe_layers > 0 ? 1 : 0)) * num_slots * slot_bytes;
}

DeviceWeights::DeviceWeights(const model::Qwen3MoeConfig& config, const eplb::Placement& placement, int device_idx)
    : config_(config), placement_(placement), device_idx_(device_idx) {
  FULCRUM_CUDA_CHECK(cudaSetDevice(device_idx));
  const int num_slots = config.moe_layer_indices().empty() ? 0 : placement.num_physical_experts();
  const int64_t needed = bytes_needed(config, num_slots);
  size_t free_bytes = 0, total_bytes = 0;
  FULCRUM_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  FULCRUM_CHECK(needed <= static_cast<int64_t>(free_bytes),
                "the model's {} weights need {:.2f} GiB on GPU {}, which has {:.2f} GiB free of {:.2f} GiB",
                fp8_experts_for(config) ? "bf16 + FP8-expert" : "bf16", needed / kGiB, device_idx, free_bytes / kGiB, total_bytes / kGiB);
  bytes_ = needed;
  FULCRUM_CUDA_CHECK(cudaMalloc(&base_, static_cast<size_t>(2 * non_expert_elems(config))));

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
    w.qkv = take(qkv_rows(config) * h);
    w.o = take(h * q);
    w.q_norm = take(d);
    w.k_norm = take(d);
    if (w.moe_layer_idx >= 0) {
      w.router = take(int64_t{config.num_experts} * h);
    } else {
      w.mlp_gate_up = take(2 * int64_t{config.intermediate_size} * h);
      w.mlp_down = take(h * config.intermediate_size);
    }
    layers_.push_back(w);
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
    out.push_back({layer_name(l, "self_attn.q_proj.weight"), {q, h}, mut(w.qkv), fan_in_scale(h), l});
    out.push_back({layer_name(l, "self_attn.k_proj.weight"), {kv, h}, mut(w.qkv) + q * h, fan_in_scale(h), l});
    out.push_back({layer_name(l, "self_attn.v_proj.weight"), {kv, h}, mut(w.qkv) + (q + kv) * h, fan_in_scale(h), l});
    out.push_back({layer_name(l, "self_attn.o_proj.weight"), {h, q}, mut(w.o), fan_in_scale(q), l});
    out.push_back({layer_name(l, "self_attn.q_norm.weight"), {d}, mut(w.q_norm), 0.0f, l});
    out.push_back({layer_name(l, "self_attn.k_norm.weight"), {d}, mut(w.k_norm), 0.0f, l});
    if (w.moe_layer_idx >= 0) {
      out.push_back({layer_name(l, "mlp.gate.weight"), {c.num_experts, h}, mut(w.router), fan_in_scale(h), l});
    } else {
      const int64_t i = c.intermediate_size;
      out.push_back({layer_name(l, "mlp.gate_proj.weight"), {i, h}, mut(w.mlp_gate_up), fan_in_scale(h), l});
      out.push_back({layer_name(l, "mlp.up_proj.weight"), {i, h}, mut(w.mlp_gate_up) + i * h, fan_in_scale(h), l});
      out.push_back({layer_name(l, "mlp.down_proj.weight"), {h, i}, mut(w.mlp_down), fan_in_scale(i), l});
    }
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
  const int64_t h = config_.hidden_size, im = config_.moe_intermediate_size;
  std::vector<uint16_t> gate_up_bits, down_bits;
  upload_in_order(
      [&](const Entry& e, std::vector<uint16_t>& bits) {
        bits.resize(static_cast<size_t>(numel_of(e.shape)));
        read(e.name, e.shape, bits, 0);
      },
      [&](int l, int moe, std::vector<std::byte>& gate_up, std::vector<std::byte>& down) {
        const std::span<const int32_t> map = placement_.layer(moe);
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

void DeviceWeights::upload_in_order(const EntryBits& entry_bits, const SlotBits& slot_bits,
                                    const std::function<void(int, int)>& on_layer) {
  const std::vector<Entry> all = entries();
  std::vector<uint16_t> bits;
  std::vector<std::byte> gate_up, down;
  size_t next = 0;
  const auto upload_until = [&](int layer_idx) {  // the entries of the embedding/head, or of one layer
    for (; next < all.size() && all[next].layer_idx == layer_idx; ++next) {
      entry_bits(all[next], bits);
      FULCRUM_CUDA_CHECK(cudaMemcpy(all[next].dst, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
    }
  };
  upload_until(-1);
  for (int l = 0; l < config_.num_hidden_layers; ++l) {
    upload_until(l);
    const int moe = layers_[static_cast<size_t>(l)].moe_layer_idx;
    if (moe >= 0) {
      slot_bits(l, moe, gate_up, down);
      slots_->upload_layer_blobs(moe, gate_up, down);
    }
    if (on_layer) on_layer(l + 1, config_.num_hidden_layers);
  }
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
  FULCRUM_CUDA_CHECK(cudaDeviceSynchronize());
  for (int moe = 0; slots_ && moe < placement_.num_layers; ++moe) slots_->fill_layer(moe, placement_.layer(moe), seed);
}

namespace {

constexpr const char* kCacheFormat = "fulcrum-gpu-weight-cache-1";

std::string slot_tensor(int moe, const char* what) { return fmt::format("slots.{}.{}", moe, what); }

}  // namespace

std::string DeviceWeights::cache_file(const std::string& dir) { return dir + "/gpu-rank0/model.safetensors"; }

std::map<std::string, std::string> DeviceWeights::cache_identity() const {
  std::map<std::string, std::string> identity = {{"format", kCacheFormat},
                                                 {"config", model::weight_cache_config_identity(config_)}};
  for (int moe = 0; slots_ && moe < placement_.num_layers; ++moe) {
    identity[fmt::format("slot_map.{}", moe)] = fmt::format("{}", fmt::join(placement_.layer(moe), " "));
  }
  return identity;
}

void DeviceWeights::save_cache(const std::string& dir) const {
  FULCRUM_CHECK(!fp8_experts(), "--weight-cache {}: the GPU weight cache does not hold FP8 experts yet (load from "
                "the checkpoint)", dir);
  FULCRUM_CUDA_CHECK(cudaSetDevice(device_idx_));
  const std::vector<Entry> all = entries();
  std::vector<model::TensorSpec> specs;
  for (const Entry& e : all) specs.push_back({e.name, e.shape, std::nullopt});
  const int64_t h = config_.hidden_size, im = config_.moe_intermediate_size;
  const int num_moe = slots_ ? placement_.num_layers : 0;
  const int64_t p = slots_ ? placement_.num_physical_experts() : 0;
  for (int moe = 0; moe < num_moe; ++moe) {
    specs.push_back({slot_tensor(moe, "gate_up"), {p, 2 * im, h}, std::nullopt});
    specs.push_back({slot_tensor(moe, "down"), {p, h, im}, std::nullopt});
  }
  std::map<std::string, size_t> index_of;
  for (size_t k = 0; k < specs.size(); ++k) index_of[specs[k].name] = k;
  std::vector<float> chunk;
  const auto emit_bf16 = [&](const std::vector<uint16_t>& bits, const std::function<void(std::span<const float>)>& emit) {
    chunk.resize(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) chunk[i] = model::bf16_bits_to_f32(bits[i]);
    emit(chunk);
  };
  const auto produce = [&](const model::TensorSpec& spec, const std::function<void(std::span<const float>)>& emit) {
    const size_t k = index_of.at(spec.name);
    if (k < all.size()) {
      std::vector<uint16_t> bits(static_cast<size_t>(numel_of(spec.shape)));
      FULCRUM_CUDA_CHECK(cudaMemcpy(bits.data(), all[k].dst, bits.size() * 2, cudaMemcpyDeviceToHost));
      emit_bf16(bits, emit);
      return;
    }
    const int moe = static_cast<int>((k - all.size()) / 2);
    const bool gate_up = (k - all.size()) % 2 == 0;
    for (int s = 0; s < p; ++s) {
      const auto [gu, dn] = slots_->download_slot(moe, s);
      emit_bf16(gate_up ? gu : dn, emit);
    }
  };
  const std::string file = cache_file(dir);
  std::filesystem::create_directories(std::filesystem::path(file).parent_path());
  // One file (no shard limit): the cache is read back whole by this engine only.
  model::write_checkpoint(std::filesystem::path(file).parent_path().string(), specs, model::Dtype::kBF16, UINT64_MAX,
                          produce, cache_identity());
}

void DeviceWeights::load_cache(const std::string& dir, const std::function<void(int, int)>& on_layer) {
  FULCRUM_CHECK(!fp8_experts(), "--weight-cache {}: the GPU weight cache does not hold FP8 experts yet (load from "
                "the checkpoint)", dir);
  FULCRUM_CUDA_CHECK(cudaSetDevice(device_idx_));
  const std::string path = cache_file(dir);
  const model::SafetensorsFile file(path);
  for (const auto& [key, expected] : cache_identity()) {
    const auto found = file.metadata().find(key);
    FULCRUM_CHECK(found != file.metadata().end() && found->second == expected,
                  "{}: weight cache written for another {} ({}; this model: {}): delete it to rebuild it", path, key,
                  found == file.metadata().end() ? std::string("missing") : found->second, expected);
  }
  const std::vector<Entry> all = entries();
  const int num_moe = slots_ ? placement_.num_layers : 0;
  FULCRUM_CHECK(file.names().size() == all.size() + 2 * static_cast<size_t>(num_moe),
                "{}: weight cache holds {} tensors, this model {}", path, file.names().size(), all.size() + 2 * num_moe);
  std::vector<float> host;
  const auto read = [&](const std::string& name, const std::vector<int64_t>& shape, std::vector<uint16_t>& bits) {
    const model::TensorInfo& info = file.info(name);
    FULCRUM_CHECK(info.shape == shape, "{}: tensor '{}' has shape {}, expected {}", path, name, model::shape_text(info.shape),
                  model::shape_text(shape));
    FULCRUM_CHECK(info.dtype == model::Dtype::kBF16, "{}: tensor '{}' is {}, the cache holds BF16", path, name,
                  model::dtype_name(info.dtype));
    host.resize(static_cast<size_t>(numel_of(shape)));
    file.read_f32_into(name, host);
    bits.resize(host.size());
    for (size_t i = 0; i < host.size(); ++i) bits[i] = model::f32_to_bf16_bits(host[i]);  // exact: bf16 values
  };
  const int64_t h = config_.hidden_size, im = config_.moe_intermediate_size, p = placement_.num_physical_experts();
  upload_in_order([&](const Entry& e, std::vector<uint16_t>& bits) { read(e.name, e.shape, bits); },
                  [&](int, int moe, std::vector<std::byte>& gate_up, std::vector<std::byte>& down) {
                    std::vector<uint16_t> bits;
                    read(slot_tensor(moe, "gate_up"), {p, 2 * im, h}, bits);
                    as_blob(bits, gate_up);
                    read(slot_tensor(moe, "down"), {p, h, im}, bits);
                    as_blob(bits, down);
                  },
                  on_layer);
}

}  // namespace fulcrum::gpu
