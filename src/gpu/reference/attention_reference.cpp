#include "gpu/reference/attention_reference.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "eplb/error.hpp"
#include "model/checkpoint_writer.hpp"

namespace fulcrum::gpu::reference {

void paged_attention(const AttentionInputs& in, std::span<uint16_t> out) {
  using model::bf16_bits_to_f32;
  const int D = in.head_dim, group = in.num_heads / in.num_kv_heads;
  const size_t num_seqs = in.kv_len.size();
  FULCRUM_CHECK(in.q_indptr.size() == num_seqs + 1 && in.kv_page_indptr.size() == num_seqs + 1,
                "attention reference: indptr sizes");
  std::vector<float> scores, acc(static_cast<size_t>(D)), q(static_cast<size_t>(D)), keys, values;
  for (size_t s = 0; s < num_seqs; ++s) {
    const int n = in.q_indptr[s + 1] - in.q_indptr[s];
    const int64_t len = in.kv_len[s];
    if (n == 0) continue;
    FULCRUM_CHECK(len >= n, "attention reference: sequence {} holds {} positions for {} new tokens", s, len, n);
    const auto row_of = [&](int64_t p) {
      return static_cast<int64_t>(in.page_ids[in.kv_page_indptr[s] + p / in.page_size]) * in.page_size + p % in.page_size;
    };
    for (int kvh = 0; kvh < in.num_kv_heads; ++kvh) {
      // The sequence's keys and values of this kv head as fp32 [len, D] (exact: bf16 -> fp32), read once for
      // all its query heads; the sums below are the same whichever way the values were fetched.
      keys.resize(static_cast<size_t>(len * D));
      values.resize(static_cast<size_t>(len * D));
      for (int64_t p = 0; p < len; ++p) {
        const size_t at = static_cast<size_t>((row_of(p) * in.num_kv_heads + kvh) * D);
        for (int d = 0; d < D; ++d) {
          keys[p * D + d] = bf16_bits_to_f32(in.k_pool[at + d]);
          values[p * D + d] = bf16_bits_to_f32(in.v_pool[at + d]);
        }
      }
      for (int i = 0; i < n; ++i) {
        const int64_t t = in.q_indptr[s] + i, last = len - n + i;  // query position: keys [0, last]
        for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
          for (int d = 0; d < D; ++d) q[d] = bf16_bits_to_f32(in.q[(t * in.num_heads + h) * D + d]);
          scores.assign(static_cast<size_t>(last + 1), 0.0f);
          float max_score = -INFINITY;
          for (int64_t p = 0; p <= last; ++p) {
            const float* k = keys.data() + p * D;
            float dot = 0.0f;
            for (int d = 0; d < D; ++d) dot += q[d] * k[d];
            scores[p] = dot * in.sm_scale;
            max_score = std::max(max_score, scores[p]);
          }
          float total = 0.0f;
          for (float& sc : scores) total += (sc = std::exp(sc - max_score));
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int64_t p = 0; p <= last; ++p) {
            const float* v = values.data() + p * D;
            for (int d = 0; d < D; ++d) acc[d] += scores[p] * v[d];
          }
          for (int d = 0; d < D; ++d) out[(t * in.num_heads + h) * D + d] = model::f32_to_bf16_bits(acc[d] / total);
        }
      }
    }
  }
}

}  // namespace fulcrum::gpu::reference
