// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "pulley/concepts/row_aggregation.hpp"
#include "pulley/core/detail/random.hpp"
#include "pulley/core/id_index.hpp"

namespace pulley {

/// The rows of one table pushed for one update, summed by id, with the number of pushes
/// that held each row: what RowMean and RowSum keep. The first push of an update is kept
/// as it came, with no lookups (every push of Async, the first of a sync step); ids are
/// indexed only when a second one comes, with a hash keyed at random.
class RowSums {
 public:
  /// Rows of `dim` floats.
  explicit RowSums(std::size_t dim = 0) : dim_(dim) {}

  /// Adds one push: `rows` (`ids.size() × dim` floats) of the distinct `ids`.
  void add(std::span<const std::uint64_t> ids, std::span<const float> rows) {
    if (ids_.empty()) {
      ids_.assign(ids.begin(), ids.end());
      counts_.assign(ids.size(), 1);
      sums_.assign(rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(ids.size() * dim_));
      return;
    }
    if (positions_.size() == 0) {  // positions are numbered as ids_ is ordered
      positions_.reserve(ids_.size() + ids.size());
      for (const std::uint64_t id : ids_) positions_.insert(id);
    }
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const auto [at, fresh] = positions_.insert(ids[i]);
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

  /// The distinct ids added, in the order they first came.
  [[nodiscard]] std::span<const std::uint64_t> ids() const noexcept { return ids_; }
  /// The sums, `ids().size() × dim` floats in ids() order.
  [[nodiscard]] std::span<float> sums() noexcept { return sums_; }
  /// How many pushes held each row, in ids() order.
  [[nodiscard]] std::span<const std::uint32_t> counts() const noexcept { return counts_; }
  /// Floats in a row.
  [[nodiscard]] std::size_t dim() const noexcept { return dim_; }

  /// Forgets everything added (memory is kept for the next update).
  void clear() noexcept {
    positions_.clear();
    ids_.clear();
    counts_.clear();
    sums_.clear();
  }

 private:
  std::size_t dim_;
  IdPositions positions_{detail::random_u64()};  ///< id → place in ids_, from the second push
  std::vector<std::uint64_t> ids_;
  std::vector<std::uint32_t> counts_;
  std::vector<float> sums_;
};

/// Each row's update is the sum of its gradients over the update's pushes, as TensorFlow's
/// SparseConditionalAccumulator with `reduction_type='SUM'`: with gradients of each
/// replica's mean loss, a row many replicas pushed moves by all of them.
struct RowSum {
  using Accumulator = RowSums;
  [[nodiscard]] RowSums make_accumulator(std::size_t dim) const { return RowSums(dim); }
  void add(RowSums& acc, std::span<const std::uint64_t> ids, std::span<const float> rows) const {
    acc.add(ids, rows);
  }
  [[nodiscard]] std::span<const std::uint64_t> ids(const RowSums& acc) const noexcept { return acc.ids(); }
  [[nodiscard]] std::span<const float> take(RowSums& acc) const noexcept { return acc.sums(); }
  void clear(RowSums& acc) const noexcept { acc.clear(); }
};
static_assert(RowAggregation<RowSum>);

/// Each row's update is its mean over the pushes of the update that held it, as
/// TensorFlow's SparseConditionalAccumulator with `reduction_type='MEAN'` (element-wise by
/// each row's own count, not by the number of pushes): a row that 1 of R replicas pushed
/// moves by that replica's gradient, not by a 1/R share of it. The default. RowSum's
/// accumulator, divided at the end.
struct RowMean : RowSum {
  /// Divides each sum by its count, in place.
  [[nodiscard]] std::span<const float> take(RowSums& acc) const noexcept {
    const std::span<float> sums = acc.sums();
    const std::size_t dim = acc.dim();
    for (std::size_t r = 0; r < acc.counts().size(); ++r) {
      const std::uint32_t n = acc.counts()[r];
      if (n == 1) continue;
      for (float& x : sums.subspan(r * dim, dim)) x /= static_cast<float>(n);
    }
    return sums;
  }
};
static_assert(RowAggregation<RowMean>);

}  // namespace pulley
