#include "model/router_skew.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "backend/cpu/cpu_backend.hpp"
#include "eplb/error.hpp"
#include "eplb/metrics.hpp"
#include "eplb/placement.hpp"
#include "model/qwen3_moe.hpp"
#include "model/rng.hpp"
#include "model/synthetic_model.hpp"

namespace fulcrum::model {
namespace {

using backend::CpuBackend;

// Per MoE layer records of one forward: r [T] and router logits without the bias channel z [T, E].
struct RouterRecord {
  std::vector<float> r;
  std::vector<float> z;
};

// The CPU backend, plus r_t * delta_e added to router logits before routing. route() is called once per
// MoE layer, in layer order, per run_layers call; that order identifies the layer.
class BiasingBackend final : public Backend {
 public:
  BiasingBackend(int num_moe_layers, int num_experts)
      : delta(num_moe_layers, std::vector<float>(num_experts, 0.0f)), records(num_moe_layers) {}

  std::vector<std::vector<float>> delta;  // [num_moe_layers][num_experts]
  std::vector<RouterRecord> records;      // [num_moe_layers], filled by the last forward

  std::string name() const override { return "cpu+router-bias"; }
  Device device() const override { return Device::kCpu; }
  Tensor zeros(std::vector<int64_t> shape) override { return cpu_.zeros(std::move(shape)); }
  void upload(const Tensor& dst, std::span<const float> src) override { cpu_.upload(dst, src); }
  std::vector<float> download(const Tensor& src) override { return cpu_.download(src); }
  void copy(const Tensor& dst, const Tensor& src) override { cpu_.copy(dst, src); }
  Tensor embedding(const Tensor& t, std::span<const int32_t> ids) override { return cpu_.embedding(t, ids); }
  Tensor rms_norm(const Tensor& x, const Tensor& w, float eps) override { return cpu_.rms_norm(x, w, eps); }
  Tensor matmul(const Tensor& x, const Tensor& w) override { return cpu_.matmul(x, w); }
  void rope_inplace(const Tensor& x, std::span<const int32_t> pos, double theta) override { cpu_.rope_inplace(x, pos, theta); }
  Tensor paged_attention(const Tensor& q, const Tensor& k, const Tensor& v, KvPages pages, int64_t start) override {
    return cpu_.paged_attention(q, k, v, pages, start);
  }
  Tensor silu_mul(const Tensor& gate_up) override { return cpu_.silu_mul(gate_up); }
  void add_inplace(const Tensor& x, const Tensor& y) override { cpu_.add_inplace(x, y); }
  Tensor gather_rows(const Tensor& x, std::span<const int32_t> rows) override { return cpu_.gather_rows(x, rows); }
  void scatter_rows(const Tensor& dst, const Tensor& src, std::span<const int32_t> rows) override {
    cpu_.scatter_rows(dst, src, rows);
  }
  Tensor weighted_sum(const Tensor& rows, std::span<const float> w, int k) override { return cpu_.weighted_sum(rows, w, k); }

  RouterChoice route(const Tensor& router_logits, int top_k, bool norm_topk_prob) override {
    const size_t layer = calls_++ % delta.size();
    const int64_t num_tokens = router_logits.dim(0), num_experts = router_logits.dim(1);
    RouterRecord& record = records[layer];
    record.r.assign(static_cast<size_t>(num_tokens), 0.0f);
    record.z.assign(static_cast<size_t>(num_tokens * num_experts), 0.0f);
    Tensor biased = cpu_.zeros({num_tokens, num_experts});  // [num_tokens, num_experts]
    for (int64_t t = 0; t < num_tokens; ++t) {
      const float* in = router_logits.data() + t * num_experts;
      // Columns 1.. of the router are centred and column 0 averages kRouterBiasBase: the mean logit is r_t * base.
      const double mean = std::accumulate(in, in + num_experts, 0.0) / static_cast<double>(num_experts);
      const auto r = static_cast<float>(mean / kRouterBiasBase);
      record.r[t] = r;
      for (int64_t e = 0; e < num_experts; ++e) {
        record.z[t * num_experts + e] = static_cast<float>(in[e] - mean);
        biased.data()[t * num_experts + e] = in[e] + r * delta[layer][e];
      }
    }
    return cpu_.route(biased, top_k, norm_topk_prob);
  }

 private:
  CpuBackend cpu_;
  size_t calls_ = 0;
};

// Random prompts: uniform token ids, `num_tokens` rounded up to whole sequences.
std::vector<std::vector<int32_t>> random_prompts(int vocab_size, int num_tokens, int sequence_length, uint64_t seed) {
  FULCRUM_CHECK(num_tokens > 0 && sequence_length > 0, "calibration needs a positive token count and sequence length");
  Rng rng(seed, "router-skew-prompts");
  std::vector<std::vector<int32_t>> prompts((num_tokens + sequence_length - 1) / sequence_length);
  for (auto& prompt : prompts) {
    prompt.resize(static_cast<size_t>(sequence_length));
    for (int32_t& id : prompt) id = static_cast<int32_t>(rng.next() % static_cast<uint64_t>(vocab_size));
  }
  return prompts;
}

// One pass through every layer (no LM head); returns inclusion fractions [num_moe_layers][num_experts].
eplb::LoadMatrix run_routing(Qwen3MoeModel& model, const std::vector<std::vector<int32_t>>& prompts) {
  const Qwen3MoeConfig& config = model.config();
  std::vector<KvCache> caches;
  std::vector<SequenceInput> batch;
  for (const auto& prompt : prompts) caches.push_back(model.create_kv_cache(static_cast<int64_t>(prompt.size())));
  for (size_t i = 0; i < prompts.size(); ++i) batch.push_back({prompts[i], &caches[i]});
  eplb::LoadMatrix inclusion(static_cast<int>(config.moe_layer_indices().size()), config.num_experts);
  size_t num_tokens = 0;
  ForwardHooks hooks;
  hooks.on_router = [&](int layer_idx, const Tensor& logits, const RouterChoice& choice) {
    num_tokens = static_cast<size_t>(logits.dim(0));
    auto row = inclusion.layer(config.moe_layer_ordinal(layer_idx));
    for (const int32_t e : choice.expert_ids) row[e] += 1.0;
  };
  model.run_layers(model.embed(batch), batch, hooks);
  for (double& v : inclusion.values) v /= static_cast<double>(num_tokens);
  return inclusion;
}

double max_abs_diff(std::span<const double> a, std::span<const double> b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

// Fits delta (warm start) so that top-k of z + r_t * delta includes each expert at its target fraction.
void fit_layer_bias(const RouterRecord& record, std::span<const double> target, int top_k, std::vector<float>& delta) {
  const size_t num_experts = target.size(), num_tokens = record.r.size();
  const double mean_r = std::accumulate(record.r.begin(), record.r.end(), 0.0) / static_cast<double>(num_tokens);
  FULCRUM_CHECK(mean_r > 0, "router skew: bias channel is not positive (mean {})", mean_r);
  const double floor = 0.5 / static_cast<double>(num_tokens);
  const double tolerance = std::max(0.002, 4.0 / static_cast<double>(num_tokens));
  std::vector<double> observed(num_experts), best_delta(delta.begin(), delta.end());
  std::vector<float> top_logit(static_cast<size_t>(top_k));   // [top_k], descending
  std::vector<int32_t> top_expert(static_cast<size_t>(top_k)); // [top_k]
  double best_error = INFINITY;
  for (int iteration = 0; iteration < 200; ++iteration) {
    std::fill(observed.begin(), observed.end(), 0.0);
    for (size_t t = 0; t < num_tokens; ++t) {
      // Top-k by insertion: descending logit, equal logits keep the lower expert first (as route does).
      const float* z = record.z.data() + t * num_experts;
      const float r = record.r[t];
      int filled = 0;
      for (size_t e = 0; e < num_experts; ++e) {
        const float logit = z[e] + r * delta[e];
        if (filled == top_k && !(logit > top_logit[top_k - 1])) continue;
        int pos = filled < top_k ? filled++ : top_k - 1;
        while (pos > 0 && logit > top_logit[pos - 1]) {
          top_logit[pos] = top_logit[pos - 1];
          top_expert[pos] = top_expert[pos - 1];
          --pos;
        }
        top_logit[pos] = logit;
        top_expert[pos] = static_cast<int32_t>(e);
      }
      for (int j = 0; j < top_k; ++j) observed[top_expert[j]] += 1.0;
    }
    for (double& v : observed) v /= static_cast<double>(num_tokens);
    const double error = max_abs_diff(observed, target);
    if (error < best_error) {
      best_error = error;
      best_delta.assign(delta.begin(), delta.end());
    }
    if (error <= tolerance) break;
    const double step = iteration < 40 ? 0.5 : (iteration < 100 ? 0.2 : 0.08);
    for (size_t e = 0; e < num_experts; ++e) {
      delta[e] += static_cast<float>(step * (std::log(std::max(target[e], floor)) - std::log(std::max(observed[e], floor))) / mean_r);
    }
    const double mean = std::accumulate(delta.begin(), delta.end(), 0.0) / static_cast<double>(num_experts);
    for (float& d : delta) d = static_cast<float>(d - mean);  // a shared shift changes no routing
  }
  delta.assign(best_delta.begin(), best_delta.end());
}

double pearson(std::span<const double> a, std::span<const double> b) {
  const double n = static_cast<double>(a.size());
  const double ma = std::accumulate(a.begin(), a.end(), 0.0) / n, mb = std::accumulate(b.begin(), b.end(), 0.0) / n;
  double sab = 0, saa = 0, sbb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    sab += (a[i] - ma) * (b[i] - mb);
    saa += (a[i] - ma) * (a[i] - ma);
    sbb += (b[i] - mb) * (b[i] - mb);
  }
  return saa > 0 && sbb > 0 ? sab / std::sqrt(saa * sbb) : (saa == sbb ? 1.0 : 0.0);
}

}  // namespace

eplb::LoadMatrix router_skew_targets(const eplb::LoadMatrix& loads, const Qwen3MoeConfig& config) {
  const int num_moe_layers = static_cast<int>(config.moe_layer_indices().size());
  FULCRUM_CHECK(num_moe_layers > 0, "--router-skew: the model has no MoE layer");
  FULCRUM_CHECK(loads.num_logical_experts == config.num_experts,
                "--router-skew: the load matrix has {} experts, the model {} (they must be equal)",
                loads.num_logical_experts, config.num_experts);
  FULCRUM_CHECK(loads.num_layers > 0, "--router-skew: the load matrix has no layers");
  eplb::LoadMatrix targets(num_moe_layers, config.num_experts);
  for (int k = 0; k < num_moe_layers; ++k) {
    const auto row = loads.layer(k % loads.num_layers);
    const double total = std::accumulate(row.begin(), row.end(), 0.0);
    FULCRUM_CHECK(total > 0, "--router-skew: load row {} is all zero", k % loads.num_layers);
    for (int e = 0; e < config.num_experts; ++e) {
      const double fraction = row[e] / total * config.num_experts_per_tok;
      FULCRUM_CHECK(fraction <= 1.0 + 1e-9,
                    "--router-skew: load row {} gives expert {} an inclusion fraction of {:.3f} > 1 (top-{})",
                    k % loads.num_layers, e, fraction, config.num_experts_per_tok);
      targets.at(k, e) = fraction;
    }
  }
  return targets;
}

RouterCalibration calibrate_router_bias(const std::string& checkpoint_dir, const Qwen3MoeConfig& config,
                                        const eplb::LoadMatrix& targets, const RouterCalibrationOptions& options) {
  const int num_moe_layers = targets.num_layers;
  BiasingBackend backend(num_moe_layers, config.num_experts);
  Qwen3MoeModel model(config, backend);
  Checkpoint checkpoint(checkpoint_dir);
  model.load_weights(checkpoint);
  const auto prompts = random_prompts(config.vocab_size, options.num_tokens, options.sequence_length, options.seed);
  const double round_tolerance = 0.01;

  RouterCalibration result;
  for (int round = 0; round < std::max(1, options.max_rounds); ++round) {
    const eplb::LoadMatrix observed = run_routing(model, prompts);
    result.rounds = round + 1;
    result.max_abs_error = max_abs_diff(observed.values, targets.values);
    if (result.max_abs_error <= round_tolerance) break;
    for (int k = 0; k < num_moe_layers; ++k) {
      fit_layer_bias(backend.records[k], targets.layer(k), config.num_experts_per_tok, backend.delta[k]);
    }
  }
  result.bias = backend.delta;
  return result;
}

eplb::LoadMatrix measure_inclusion(const std::string& checkpoint_dir, const Qwen3MoeConfig& config, int num_tokens,
                                   int sequence_length, uint64_t seed) {
  CpuBackend backend;
  Qwen3MoeModel model(config, backend);
  Checkpoint checkpoint(checkpoint_dir);
  model.load_weights(checkpoint);
  return run_routing(model, random_prompts(config.vocab_size, num_tokens, sequence_length, seed));
}

RouterFit evaluate_router_fit(const eplb::LoadMatrix& measured, const eplb::LoadMatrix& targets) {
  FULCRUM_CHECK(measured.num_layers == targets.num_layers && measured.num_logical_experts == targets.num_logical_experts,
                "router fit: measured {}x{} vs target {}x{}", measured.num_layers, measured.num_logical_experts,
                targets.num_layers, targets.num_logical_experts);
  RouterFit fit;
  for (int k = 0; k < targets.num_layers; ++k) {
    fit.pearson.push_back(pearson(measured.layer(k), targets.layer(k)));
    fit.max_abs_error.push_back(max_abs_diff(measured.layer(k), targets.layer(k)));
  }
  fit.pearson_min = *std::min_element(fit.pearson.begin(), fit.pearson.end());
  fit.pearson_mean = std::accumulate(fit.pearson.begin(), fit.pearson.end(), 0.0) / static_cast<double>(fit.pearson.size());
  fit.max_abs_error_max = *std::max_element(fit.max_abs_error.begin(), fit.max_abs_error.end());
  for (const int ranks : {8, 16, 32}) {
    if (targets.num_logical_experts % ranks != 0) continue;
    const eplb::Topology topo{targets.num_logical_experts, ranks, 1};
    const eplb::Placement trivial = eplb::trivial_placement(topo, targets.num_layers, targets.num_logical_experts);
    fit.ranks.push_back(ranks);
    fit.trivial_balancedness_measured.push_back(eplb::evaluate_placement(trivial, measured).balancedness_mean);
    fit.trivial_balancedness_target.push_back(eplb::evaluate_placement(trivial, targets).balancedness_mean);
  }
  return fit;
}

std::string router_fit_text(const RouterFit& fit) {
  std::string text = fmt::format(
      "router fit over {} MoE layers: pearson min {:.4f} mean {:.4f}, max abs error of inclusion fraction {:.4f}\n",
      fit.pearson.size(), fit.pearson_min, fit.pearson_mean, fit.max_abs_error_max);
  for (size_t i = 0; i < fit.ranks.size(); ++i) {
    text += fmt::format("trivial placement on {:>2} EP ranks: balancedness {:.4f} measured, {:.4f} target\n",
                        fit.ranks[i], fit.trivial_balancedness_measured[i], fit.trivial_balancedness_target[i]);
  }
  return text;
}

}  // namespace fulcrum::model
