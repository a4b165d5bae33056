// SPDX-License-Identifier: MIT
#pragma once

/// EmbeddingTable's updates (declared in ps/embedding_table.hpp, which includes this
/// header after the class): an update applied (apply), or prepared and committed (prepare,
/// commit: update_in_place for the rows proven finite in advance), and the proven rows'
/// bookkeeping (proven, set_proven, prove_as_held).

#include "pulley/ps/embedding_table.hpp"

namespace pulley {

template <RowWiseOptimizer O>
bool EmbeddingTable<O>::apply(std::span<const std::uint64_t> ids, std::span<const float> gradients,
                              std::int64_t step, std::int64_t updates) {
  if (!prepare(ids, gradients, step, updates)) return false;
  commit(step);
  return true;
}

template <RowWiseOptimizer O>
bool EmbeddingTable<O>::prepare(std::span<const std::uint64_t> ids,
                                std::span<const float> gradients, std::int64_t step,
                                std::int64_t updates) {
  const std::size_t d = spec_.dim;
  scratch_rows_.clear();
  in_place_rows_.clear();
  pending_ = Pending{ids, gradients, updates, false, false};
  if constexpr (BoundsRowMagnitudes<O>) {
    const RowContext context{step, updates, spec_.name, 0};
    pending_.in_place =
        optimizer_.row_stays_finite_given(kOrdinaryMagnitude, kOrdinaryMagnitude, context) &&
        detail::all_ordinary(gradients);
    if (pending_.in_place && unproven_ == 0) {
      pending_.one_pass = true;  // every row held is proven: commit finds and updates them
      return true;
    }
  }
  // A row not proven is updated into a copy first, so that a row going non-finite changes
  // nothing; each is copied the moment it is found, while its prefetched record is in
  // cache.
  scratch_.resize(ids.size() * stride_);
  for_each_found(ids, [&](std::size_t i, std::uint32_t row) {
    if (row == kNone) {
      ++stats_.pushes_dropped;
      return;
    }
    if (pending_.in_place && proven(row)) {
      in_place_rows_.push_back({row, i});
      return;
    }
    std::copy(at(row), at(row) + stride_, scratch_.data() + scratch_rows_.size() * stride_);
    scratch_rows_.push_back({row, i});
  });
  scratch_.resize(scratch_rows_.size() * stride_);
  scratch_proven_.assign(scratch_rows_.size(), false);
  for (std::size_t k = 0; k < scratch_rows_.size(); ++k) {
    const std::size_t i = scratch_rows_[k].second;
    float* copy = scratch_.data() + k * stride_;
    const RowContext context{step, updates, spec_.name, ids[i]};
    const std::span<float> values(copy, d);
    const std::span<float> slots(copy + d, stride_ - d);
    if constexpr (BoundsRowMagnitudes<O>) {
      scratch_proven_[k] = optimizer_.apply_row_bounded(values, slots, gradients.subspan(i * d, d),
                                                        context) <= kOrdinaryMagnitude;
    } else {
      optimizer_.apply_row(values, slots, gradients.subspan(i * d, d), context);
    }
  }
  if (!detail::all_finite(scratch_)) {
    ++stats_.updates_refused;
    scratch_rows_.clear();
    in_place_rows_.clear();
    pending_ = Pending{};
    return false;
  }
  return true;
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::commit(std::int64_t step) {
  constexpr std::size_t kAhead = 8;
  if constexpr (BoundsRowMagnitudes<O>) {  // (only then are rows updated in place)
    if (pending_.one_pass) {
      for_each_found(pending_.ids, [&](std::size_t i, std::uint32_t row) {
        if (row == kNone) {
          ++stats_.pushes_dropped;
          return;
        }
        update_in_place(row, i, step);
      });
    }
    for (std::size_t k = 0; k < in_place_rows_.size(); ++k) {
      if (k + kAhead < in_place_rows_.size()) prefetch_record(in_place_rows_[k + kAhead].first);
      update_in_place(in_place_rows_[k].first, in_place_rows_[k].second, step);
    }
  }
  for (std::size_t k = 0; k < scratch_rows_.size(); ++k) {
    if (k + kAhead < scratch_rows_.size()) prefetch_record(scratch_rows_[k + kAhead].first);
    const std::uint32_t row = scratch_rows_[k].first;
    if (frozen_ && row < cut_rows_) keep_for_cut(row);
    std::copy(scratch_.data() + k * stride_, scratch_.data() + (k + 1) * stride_, at(row));
    if constexpr (BoundsRowMagnitudes<O>) set_proven(row, scratch_proven_[k]);
    touch(row, step);
  }
  scratch_rows_.clear();
  in_place_rows_.clear();
  pending_ = Pending{};
}

template <RowWiseOptimizer O>
bool EmbeddingTable<O>::proven(std::uint32_t row) const noexcept {
  std::uint32_t flag = 0;
  std::memcpy(&flag, record(row) + 3, sizeof flag);
  return flag != 0;
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::set_proven(std::uint32_t row, bool is) noexcept {
  if (proven(row) == is) return;
  const std::uint32_t flag = is ? 1 : 0;
  std::memcpy(record(row) + 3, &flag, sizeof flag);
  if (is) {
    --unproven_;
  } else {
    ++unproven_;
  }
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::prove_as_held(std::uint32_t row) noexcept {
  if constexpr (BoundsRowMagnitudes<O>) {
    const float* r = at(row);
    set_proven(row, detail::all_ordinary(std::span<const float>(r, spec_.dim)) &&
                        detail::all_ordinary_non_negative(
                            std::span<const float>(r + spec_.dim, stride_ - spec_.dim)));
  }
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::update_in_place(std::uint32_t row, std::size_t i,
                                        std::int64_t step) requires BoundsRowMagnitudes<O> {
  const std::size_t d = spec_.dim;
  if (frozen_ && row < cut_rows_) keep_for_cut(row);
  float* r = at(row);
  const RowContext context{step, pending_.updates, spec_.name, pending_.ids[i]};
  const float bound =
      optimizer_.apply_row_bounded(std::span<float>(r, d), std::span<float>(r + d, stride_ - d),
                                   pending_.gradients.subspan(i * d, d), context);
  set_proven(row, bound <= kOrdinaryMagnitude);
  touch(row, step);
}

}  // namespace pulley
