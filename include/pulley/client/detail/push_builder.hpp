// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "pulley/client/detail/split.hpp"
#include "pulley/client/requests.hpp"
#include "pulley/core/detail/finite.hpp"
#include "pulley/core/detail/random.hpp"
#include "pulley/core/error.hpp"
#include "pulley/core/magnitude.hpp"
#include "pulley/core/placement.hpp"
#include "pulley/core/variable.hpp"
#include "pulley/protocol/messages.hpp"

namespace pulley::detail {

/// Turns a worker's gradients (one span per variable, and the rows of its tables) into one
/// Push per ps: each ps gets the gradient of every part it holds, viewed in place, and its
/// share of the rows. Everything is checked before anything is sent (one finite gradient
/// of the right size per variable, rows that fit one message per ps): a push refused by
/// one ps but applied by another would leave the ps tasks on different steps. Gradients are
/// clipped by their global norm first when asked (TensorFlow's clip_by_global_norm), into
/// buffers of its own.
class PushBuilder {
 public:
  /// @param clip_norm clips gradients whose global norm is larger (0: never)
  explicit PushBuilder(float clip_norm = 0.0F) : clip_norm_(clip_norm) {}

  /// One Push per ps of `num_ps`, all numbered alike (a push sent again is recognized by
  /// its number on every ps).
  std::vector<Push> build(const Placement& placement, const std::vector<VariableSpec>& variables,
                          const std::vector<TableSpec>& tables, std::size_t num_ps, std::uint32_t worker,
                          std::int64_t local_step, std::uint64_t epoch,
                          std::span<const std::span<const float>> gradients, std::span<const RowRequest> rows) {
    if (gradients.size() != variables.size()) {
      throw Error(ErrorCode::kInvalidArgument, "push needs one gradient per variable");
    }
    for (const RowRequest& r : rows) check_rows(r, tables, num_ps);
    if (clip_norm_ > 0.0F) gradients = clipped(gradients, rows);
    const std::uint64_t sequence = ++sequence_;
    std::vector<Push> pushes(num_ps, Push{worker, local_step, {}, epoch, sequence, {}, series_});
    for (const Part& part : placement.parts) {
      const VariableSpec& spec = variables[part.variable];
      const std::span<const float> g = gradients[part.variable];
      if (g.size() != spec.size()) {
        throw Error(ErrorCode::kInvalidArgument, "gradient of '" + spec.name + "' has " + std::to_string(g.size()) +
                                                     " elements, expected " + std::to_string(spec.size()));
      }
      pushes[part.ps].gradients.push_back({static_cast<std::uint32_t>(&part - placement.parts.data()),
                                           g.subspan(part.rows.begin * spec.row_size(), part.rows.size() * spec.row_size())});
    }
    // One read of each gradient says it is finite and, mostly, ordinary: a ps in this
    // process then proves the update finite without reading it again (Push::largest).
    bool ordinary = true;
    for (std::size_t v = 0; v < gradients.size(); ++v) {
      if (all_ordinary(gradients[v])) continue;
      ordinary = false;
      if (!all_finite(gradients[v])) {
        throw Error(ErrorCode::kInvalidArgument,
                    "non-finite (NaN or Inf) gradient for '" + variables[v].name + "'; nothing was pushed");
      }
    }
    for (Push& push : pushes) push.largest = magnitude_bound(ordinary);
    // One push per ps, whole: its rows must fit in one message.
    std::vector<std::size_t> ids_to(num_ps, 0);
    for (const RowRequest& r : rows) {
      for (std::size_t ps = 0; ps < num_ps; ++ps) {
        const std::size_t n = r.ps_begin[ps + 1] - r.ps_begin[ps];
        ids_to[ps] += n;
        if (ids_to[ps] > kMaxIdsPerMessage || n * tables[r.table].dim * sizeof(float) > kMaxRowBytesPerMessage) {
          throw Error(ErrorCode::kInvalidArgument,
                      "a push to ps " + std::to_string(ps) + " of more rows than one message carries (" +
                          std::to_string(kMaxIdsPerMessage) +
                          " ids, and 256 MiB of rows of a table): use smaller batches, or more ps tasks");
        }
      }
    }
    for (const RowRequest& r : rows) {
      if (!all_finite(r.values)) {
        throw Error(ErrorCode::kInvalidArgument,
                    "non-finite (NaN or Inf) row gradients for table '" + tables[r.table].name + "'; nothing was pushed");
      }
      const std::size_t dim = tables[r.table].dim;
      for (std::size_t ps = 0; ps < num_ps; ++ps) {
        const std::size_t begin = r.ps_begin[ps], end = r.ps_begin[ps + 1];
        if (begin == end) continue;
        pushes[ps].rows.push_back({static_cast<std::uint32_t>(r.table),
                                   std::vector<std::uint64_t>(r.ids.begin() + static_cast<std::ptrdiff_t>(begin),
                                                              r.ids.begin() + static_cast<std::ptrdiff_t>(end)),
                                   std::span<const float>(r.values).subspan(begin * dim, (end - begin) * dim)});
      }
    }
    return pushes;
  }

  /// Pushes whose gradients clipping scaled down.
  [[nodiscard]] std::int64_t clipped_steps() const noexcept { return clipped_steps_; }
  /// The global norm of the last push's gradients, when clipping is on (else 0).
  [[nodiscard]] double last_gradient_norm() const noexcept { return last_norm_; }

 private:
  /// `gradients` scaled by clip_norm / their global norm when that norm is larger, copied
  /// into buffers of this builder; as they are otherwise. A non-finite norm leaves them as
  /// they are, for the finiteness check to refuse. The rows' gradients count in the norm
  /// too (as TensorFlow's clip_by_global_norm counts IndexedSlices), and are scaled where
  /// they are: they are the worker's own buffers.
  std::span<const std::span<const float>> clipped(std::span<const std::span<const float>> gradients,
                                                 std::span<const RowRequest> rows) {
    double squares = 0.0;
    for (const std::span<const float> g : gradients) {
      for (const float x : g) squares += static_cast<double>(x) * static_cast<double>(x);
    }
    for (const RowRequest& r : rows) {
      for (const float x : r.values) squares += static_cast<double>(x) * static_cast<double>(x);
    }
    const double norm = std::sqrt(squares);
    last_norm_ = norm;
    if (!(norm > clip_norm_) || !std::isfinite(norm)) return gradients;
    const auto scale = static_cast<float>(clip_norm_ / norm);
    for (const RowRequest& r : rows) {
      for (float& x : r.values) x *= scale;
    }
    clipped_.resize(gradients.size());
    views_.clear();
    for (std::size_t v = 0; v < gradients.size(); ++v) {
      clipped_[v].resize(gradients[v].size());
      std::transform(gradients[v].begin(), gradients[v].end(), clipped_[v].begin(),
                     [scale](float x) { return x * scale; });
      views_.emplace_back(clipped_[v]);
    }
    ++clipped_steps_;
    return views_;
  }

  float clip_norm_;
  /// Numbers the pushes: from a random start, so that a client that restarts is not taken
  /// for the one before it (and never wraps).
  std::uint64_t sequence_ = random_u64() >> 1U;
  std::uint64_t series_ = random_u64() | 1U;  ///< never 0 (Push::series)
  std::vector<std::vector<float>> clipped_;    ///< gradients scaled by clipping
  std::vector<std::span<const float>> views_;  ///< views of them, by variable
  std::int64_t clipped_steps_ = 0;
  double last_norm_ = 0.0;
};

}  // namespace pulley::detail
