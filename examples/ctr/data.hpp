// SPDX-License-Identifier: MIT
#pragma once

// Criteo-shaped click data with a known answer: 13 dense features and 26 categorical fields
// whose values follow a power law (a few values in most examples, most values in few), with
// labels drawn from a planted logistic model with per-value weights and factorized field
// interactions. The planted model's own AUC on held-out data is the best any model can
// reach on it. Written to a binary file first and read back, as real data would be.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "pulley/core/initializers.hpp"

namespace ctr {

inline constexpr std::size_t kDense = 13;   ///< Criteo's integer features, standardized
inline constexpr std::size_t kFields = 26;  ///< Criteo's categorical features

/// One example as a file holds it: the label, the dense features and each field's value
/// (an index into that field's vocabulary, as Criteo's hashed tokens are).
struct Example {
  float label = 0.0F;
  float dense[kDense] = {};
  std::uint32_t value[kFields] = {};
};

/// The 64-bit id of `value` of `field`: what the model's tables are keyed by.
inline std::uint64_t id_of(std::size_t field, std::uint32_t value) {
  return pulley::mix_id((static_cast<std::uint64_t>(field) << 32U) | value);
}

/// A standard normal drawn from a hash: the planted model's parameters need no storage.
inline double hashed_normal(std::uint64_t key) {
  pulley::SplitMix64 rng(key);
  const double u1 = 1.0 - rng.uniform(), u2 = rng.uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

/// The planted model: logit = bias + a·dense + Σ_f w_f(value_f) + Σ_pairs <v_f, v_g>. Per-value
/// weights are large for a field's 50 most frequent values, smaller for the next 1000 and
/// small for the long tail (what data of this size can teach); three field pairs interact
/// through 4-dimensional factors of their 50 most frequent values.
struct Planted {
  std::uint64_t seed = 1;
  double logit(const Example& e) const {
    double z = -1.2;
    for (std::size_t j = 0; j < kDense; ++j) z += 0.3 * hashed_normal(seed ^ (0xD0 + j)) * e.dense[j];
    for (std::size_t f = 0; f < kFields; ++f) {
      const std::uint32_t v = e.value[f];
      const double scale = v < 50 ? 0.6 : v < 1050 ? 0.25 : 0.05;
      z += scale * hashed_normal(seed ^ id_of(f, v));
    }
    for (std::size_t p = 0; p < 3; ++p) {
      const std::size_t f = 2 * p, g = 2 * p + 1;
      if (e.value[f] >= 50 || e.value[g] >= 50) continue;
      for (std::uint64_t k = 0; k < 4; ++k) {
        z += 0.4 * hashed_normal(seed ^ id_of(f, e.value[f]) ^ (k + 1) * 0x9E37U) *
             hashed_normal(seed ^ id_of(g, e.value[g]) ^ (k + 1) * 0x7F4AU);
      }
    }
    return z;
  }
};

/// Draws `count` examples: field f's value is floor(V^u) - 1 for u uniform in [0, 1) (a
/// log-uniform rank, P(rank) about 1 / rank), V = `vocabulary` per field; labels from the
/// planted model.
inline std::vector<Example> generate(std::size_t count, std::uint32_t vocabulary,
                                     const Planted& planted, std::uint64_t seed) {
  std::vector<Example> out(count);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const double log_v = std::log(static_cast<double>(vocabulary));
  for (Example& e : out) {
    for (float& x : e.dense) x = normal(rng);
    for (std::uint32_t& v : e.value) {
      v = static_cast<std::uint32_t>(std::min<double>(std::exp(uniform(rng) * log_v) - 1.0, vocabulary - 1));
    }
    const double p = 1.0 / (1.0 + std::exp(-planted.logit(e)));
    e.label = uniform(rng) < p ? 1.0F : 0.0F;
  }
  return out;
}

inline constexpr char kMagic[8] = {'P', 'L', 'Y', 'C', 'T', 'R', '0', '1'};

/// Writes examples to `path`: the magic, the count, then each example as label (1 byte),
/// 13 floats and 26 uint32 values, little-endian. Written beside it and renamed into place,
/// so a reader never sees half a file.
inline void write(const std::filesystem::path& path, const std::vector<Example>& examples) {
  const std::filesystem::path partial = path.string() + ".partial";
  std::ofstream out(partial, std::ios::binary | std::ios::trunc);
  const std::uint64_t n = examples.size();
  out.write(kMagic, sizeof kMagic);
  out.write(reinterpret_cast<const char*>(&n), sizeof n);
  for (const Example& e : examples) {
    const auto label = static_cast<char>(e.label > 0.5F ? 1 : 0);
    out.write(&label, 1);
    out.write(reinterpret_cast<const char*>(e.dense), sizeof e.dense);
    out.write(reinterpret_cast<const char*>(e.value), sizeof e.value);
  }
  out.close();
  if (!out) throw std::runtime_error("cannot write " + partial.string());
  std::filesystem::rename(partial, path);
}

/// Reads what `write` wrote; throws naming the file if it is not such a file or is cut
/// short.
inline std::vector<Example> read(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[sizeof kMagic] = {};
  std::uint64_t n = 0;
  in.read(magic, sizeof magic);
  in.read(reinterpret_cast<char*>(&n), sizeof n);
  if (!in || std::memcmp(magic, kMagic, sizeof kMagic) != 0) {
    throw std::runtime_error(path.string() + " is not a ctr data file");
  }
  const auto record = static_cast<std::uintmax_t>(1 + sizeof(Example::dense) + sizeof(Example::value));
  if (std::filesystem::file_size(path) != 16 + n * record) {
    throw std::runtime_error(path.string() + " is truncated or has trailing bytes");
  }
  std::vector<Example> out(static_cast<std::size_t>(n));
  for (Example& e : out) {
    char label = 0;
    in.read(&label, 1);
    in.read(reinterpret_cast<char*>(e.dense), sizeof e.dense);
    in.read(reinterpret_cast<char*>(e.value), sizeof e.value);
    e.label = label != 0 ? 1.0F : 0.0F;
  }
  if (!in) throw std::runtime_error(path.string() + " ends early");
  return out;
}

/// The area under the ROC curve of `scores` against `labels` (ties counted half).
inline double auc(const std::vector<double>& scores, const std::vector<float>& labels) {
  std::vector<std::size_t> order(scores.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return scores[a] < scores[b]; });
  double rank_sum = 0.0, positives = 0.0;
  for (std::size_t i = 0; i < order.size();) {
    std::size_t j = i;
    while (j < order.size() && scores[order[j]] == scores[order[i]]) ++j;
    const double mid_rank = 0.5 * static_cast<double>(i + j + 1);  // 1-based average rank
    for (std::size_t k = i; k < j; ++k) {
      if (labels[order[k]] > 0.5F) {
        rank_sum += mid_rank;
        positives += 1.0;
      }
    }
    i = j;
  }
  const double negatives = static_cast<double>(scores.size()) - positives;
  if (positives == 0.0 || negatives == 0.0) return 0.5;
  return (rank_sum - positives * (positives + 1.0) / 2.0) / (positives * negatives);
}

}  // namespace ctr
