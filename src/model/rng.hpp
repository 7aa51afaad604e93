#pragma once
// A small seeded random generator whose sequence is the same on every platform and standard library
// (std:: distributions are implementation-defined): xoshiro256** seeded through splitmix64.
#include <cmath>
#include <cstdint>
#include <string_view>

namespace fulcrum::model {

// One splitmix64 step: advances `state` and returns a well-mixed 64-bit value.
inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// FNV-1a hash of a string: derives independent streams from names ("model.layers.3.mlp.gate.weight").
inline uint64_t fnv1a64(std::string_view text) {
  uint64_t hash = 0xCBF29CE484222325ull;
  for (const char c : text) {
    hash ^= static_cast<uint8_t>(c);
    hash *= 0x100000001B3ull;
  }
  return hash;
}

class Rng {
 public:
  explicit Rng(uint64_t seed = 0) {
    uint64_t state = seed;
    for (uint64_t& word : s_) word = splitmix64(state);
  }
  // An independent stream for (seed, name).
  Rng(uint64_t seed, std::string_view name) : Rng(seed ^ (fnv1a64(name) * 0x2545F4914F6CDD1Dull)) {}

  uint64_t next() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  // Uniform in [0, 1), 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  // Uniform with mean 0 and standard deviation 1: in [-sqrt(3), sqrt(3)).
  double unit_uniform() { return (2.0 * uniform() - 1.0) * 1.7320508075688772; }
  // Standard normal (Box-Muller, one value per call; the second is discarded to keep the stream simple).
  double normal() {
    const double u1 = 1.0 - uniform();  // (0, 1]
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

}  // namespace fulcrum::model
