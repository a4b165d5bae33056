// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <type_traits>

#include "pulley/concepts/optimizer.hpp"
#include "pulley/concepts/row_aggregation.hpp"
#include "pulley/concepts/sharding.hpp"
#include "pulley/sharding/ids.hpp"
#include "pulley/tables/row_aggregation.hpp"

namespace pulley {

/// The embedding-table policy of a ParameterServer (its fourth policy): the row-wise
/// optimizer its tables are updated with (it may differ from the dense variables' one:
/// Adagrad or FTRL for embeddings and Adam for the rest is common), how their rows are
/// spread over the ps tasks, and how the rows pushed for one update are combined. Workers
/// must use the same id sharding: name it once (`using MyTables = Tables<...>`) and give
/// the workers `MyTables::Sharding`; ps tasks and workers that disagree are refused when
/// the workers get ready.
///
/// @tparam O RowWiseOptimizer of the tables; a dense-only one fails to compile here
/// @tparam I IdSharding of the rows (HashIds by default)
/// @tparam A RowAggregation of an update's rows (RowMean by default, as TensorFlow's
///           SparseConditionalAccumulator)
template <RowWiseOptimizer O, IdSharding I = HashIds, RowAggregation A = RowMean>
struct Tables {
  using Optimizer = O;
  using Sharding = I;
  using Aggregation = A;
  [[no_unique_address]] O optimizer{};    ///< updates every table's rows
  [[no_unique_address]] I sharding{};     ///< which ps holds which row
  [[no_unique_address]] A aggregation{};  ///< what an update's pushed rows add up to
  /// The bytes each ps's tables may hold, rows and admission counts (a row costs its
  /// values, slots and a 16-byte header, plus 8 bytes of index; 0: no budget). A worker's
  /// pull that would pass it first evicts the least recently touched eighth of the rows of
  /// the table it creates a row in, as TableSpec::max_rows does; failing that, the row is
  /// not created (it reads as its initial value, its pushes are dropped), counted in
  /// Stats::table_rows_capped. No worker request grows a ps's tables past it.
  std::uint64_t max_bytes = 0;
};

/// The table policy of a ParameterServer that serves no embedding tables: a model that
/// declares some is refused at registration, naming the fix. The default when the
/// ParameterServer's optimizer has no row-wise apply (Momentum).
struct NoTables {};

/// True for `Tables<...>` and any policy of its shape; NoTables is not one.
template <class T>
concept TablePolicy = RowWiseOptimizer<typename T::Optimizer> && IdSharding<typename T::Sharding> &&
    RowAggregation<typename T::Aggregation> && requires(const T& tables) {
  { tables.optimizer } -> std::convertible_to<const typename T::Optimizer&>;
  { tables.sharding } -> std::convertible_to<const typename T::Sharding&>;
  { tables.aggregation } -> std::convertible_to<const typename T::Aggregation&>;
};

/// A ParameterServer's fourth policy: a TablePolicy, or NoTables.
template <class T>
concept TablesOrNone = TablePolicy<T> || std::is_same_v<T, NoTables>;

namespace detail {
template <class O, bool = RowWiseOptimizer<O>>
struct default_tables {
  using type = NoTables;
};
template <class O>
struct default_tables<O, true> {
  using type = Tables<O>;
};
}  // namespace detail

/// Tables<O> when O can update rows, NoTables otherwise: a ParameterServer's default.
template <class O>
using DefaultTables = typename detail::default_tables<O>::type;

/// The table policy a ParameterServer gets when none is given: T{}, its optimizer a copy of
/// the dense `optimizer` (the same settings) when it is of the same type.
template <TablesOrNone T, class O>
T default_table_policy(const O& optimizer) {
  T tables{};
  if constexpr (TablePolicy<T>) {
    if constexpr (std::is_same_v<typename T::Optimizer, O>) tables.optimizer = optimizer;
  }
  return tables;
}

}  // namespace pulley
