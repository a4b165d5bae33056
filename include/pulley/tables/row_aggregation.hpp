// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "pulley/core/id_index.hpp"
#include "pulley/core/detail/random.hpp"

namespace pulley {

/// The gradient accumulator of one embedding table for one update: sums the rows pushed,
/// by id, and counts the pushes that held each row. `take` gives each row's mean over the
/// pushes that held it, as TensorFlow's SparseConditionalAccumulator averages (element-wise
/// by each row's own count, not by the number of pushes): a row pushed by 1 of R replicas
/// moves by that replica's gradient, not by a 1/R share of it. Ids come from peers: they
/// are indexed with a hash keyed at random.
class SparseAccumulator {
 public:
  /// An accumulator of rows of `dim` floats.
  explicit SparseAccumulator(std::size_t dim = 0) : dim_(dim) {}

  /// Adds one push: rows `rows` (`ids.size() × dim` floats) of the distinct ids `ids`. The
  /// first push of an update is kept as it came, with no lookups (every push of Async, the
  /// first of a sync step); ids are indexed only when a second one comes.
  void add(std::span<const std::uint64_t> ids, std::span<const float> rows) {
    if (taken_) clear();
    if (ids_.empty()) {
      ids_.assign(ids.begin(), ids.end());
      counts_.assign(ids.size(), 1);
      sums_.assign(rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(ids.size() * dim_));
      return;
    }
    if (position_.size() == 0) {  // positions are numbered as ids_ is ordered
      position_.reserve(ids_.size() + ids.size());
      for (const std::uint64_t id : ids_) position_.insert(id);
    }
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const auto [at, fresh] = position_.insert(ids[i]);
      const float* row = rows.data() + i * dim_;
      if (fresh) {
        ids_.push_back(ids[i]);
        counts_.push_back(1);
        sums_.insert(sums_.end(), row, row + dim_);
      } else {
        ++counts_[at];
        float* sum = sums_.data() + at * dim_;
        for (std::size_t k = 0; k < dim_; ++k) sum[k] += row[k];
      }
    }
  }

  /// The ids pushed since the last take, in the order they first came.
  [[nodiscard]] std::span<const std::uint64_t> ids() const noexcept { return ids_; }
  /// True if nothing was added since the last take.
  [[nodiscard]] bool empty() const noexcept { return taken_ || ids_.empty(); }

  /// Each row's mean (ids() order, `ids().size() × dim` floats), valid until the next add
  /// or clear; the next add starts a new update.
  [[nodiscard]] std::span<const float> take() {
    for (std::size_t r = 0; r < ids_.size(); ++r) {
      if (counts_[r] == 1) continue;
      const float n = static_cast<float>(counts_[r]);
      float* sum = sums_.data() + r * dim_;
      for (std::size_t k = 0; k < dim_; ++k) sum[k] /= n;
    }
    taken_ = true;
    return sums_;
  }

  /// Forgets everything added (memory is kept for the next update).
  void clear() noexcept {
    position_.clear();
    ids_.clear();
    counts_.clear();
    sums_.clear();
    taken_ = false;
  }

 private:
  std::size_t dim_;
  detail::IdIndex position_{detail::random_u64()};  ///< id → place in ids_, from the second push
  std::vector<std::uint64_t> ids_;
  std::vector<std::uint32_t> counts_;
  std::vector<float> sums_;
  bool taken_ = false;
};

}  // namespace pulley
