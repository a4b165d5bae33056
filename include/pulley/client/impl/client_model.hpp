// SPDX-License-Identifier: MIT
#pragma once

/// Client's model as the ps tasks hold it (declared in client/client.hpp, which includes
/// this header after the class): looking a variable up, checking a task's IdSharding,
/// registering the model, waiting until every member ps is ready, and adopting their
/// placement once their answers agree.

#include "pulley/client/client.hpp"

namespace pulley {

template <Transport T>
template <IdSharding I>
bool Client<T>::same_id_sharding(const I& sharding) const {
  return tables_.empty() ||
         id_sharding_fingerprint(sharding, tables_, std::span<const std::uint32_t>(members_)) ==
             id_sharding_;
}

template <Transport T>
template <IdSharding I>
void Client<T>::check_id_sharding(const I& sharding) const {
  if (same_id_sharding(sharding)) return;
  throw Error(
      ErrorCode::kFailedPrecondition,
      "this task's IdSharding puts rows of table '" + tables_.front().name +
          "' on other ps tasks than the ps tasks' own does: give it the IdSharding of the ps "
          "tasks' Tables policy (Worker<M, T, MyTables::Sharding>, read_rows(..., "
          "MyTables::Sharding{}))");
}

template <Transport T>
std::size_t Client<T>::variable_index(std::string_view name) const {
  for (std::size_t i = 0; i < variables_.size(); ++i) {
    if (variables_[i].name == name) return i;
  }
  throw Error(ErrorCode::kNotFound, "unknown variable '" + std::string(name) + "'");
}

template <Transport T>
void Client<T>::register_model(std::span<const VariableSpec> variables,
                               std::span<const TableSpec> tables, std::uint64_t table_seed) {
  std::vector<VariableSpec> list(variables.begin(), variables.end());
  std::vector<TableSpec> table_list(tables.begin(), tables.end());
  adopt(broadcast<PlacementReply>(
            [&](std::size_t) {
              return Register{list, table_list, table_seed, members_, membership_, ps_addresses_};
            },
            options_.request_timeout, "register"),
        list, &table_list);
  table_seed_ = table_seed;
}

template <Transport T>
void Client<T>::wait_ready(std::span<const VariableSpec> variables,
                           std::optional<std::span<const TableSpec>> tables) {
  std::vector<VariableSpec> list(variables.begin(), variables.end());
  std::optional<std::vector<TableSpec>> table_list;
  if (tables) table_list.emplace(tables->begin(), tables->end());
  (void)learn_membership();
  for (std::size_t round = 0;; ++round) {
    std::vector<PlacementReply> replies;
    try {
      replies = broadcast<PlacementReply>([](std::size_t) { return WaitReady{}; },
                                          options_.wait_timeout, "wait for initialization");
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kUnavailable || round >= kMembershipRounds || !learn_membership())
        throw;
      continue;
    }
    if (round < kMembershipRounds && follow_membership(replies)) continue;
    adopt(std::move(replies), list, table_list ? &*table_list : nullptr);
    return;
  }
}

template <Transport T>
void Client<T>::adopt(std::vector<PlacementReply> replies, std::vector<VariableSpec>& variables,
                      const std::vector<TableSpec>* tables) {
  if (replies.empty()) throw Error(ErrorCode::kInvalidArgument, "the cluster has no ps task");
  if (tables != nullptr && replies[0].tables != *tables) {
    throw Error(
        ErrorCode::kFailedPrecondition,
        "the ps tasks hold " + std::to_string(replies[0].tables.size()) +
            " embedding table(s), and this model declares " + std::to_string(tables->size()) +
            " that differ from them (name, dim, initializer, admission, eviction must match)");
  }
  for (std::size_t k = 1; k < replies.size(); ++k) {
    const std::string ps = std::to_string(members_[k]);
    const std::string first = std::to_string(members_[0]);
    if (replies[k].members != replies[0].members ||
        replies[k].membership != replies[0].membership) {
      throw Error(ErrorCode::kUnavailable,
                  "ps " + first + " and ps " + ps +
                      " are at different memberships of the job's ps tasks (" +
                      std::to_string(replies[0].membership) + " and " +
                      std::to_string(replies[k].membership) + "): a change is under way");
    }
    if (replies[k].id_sharding != replies[0].id_sharding) {
      throw Error(
          ErrorCode::kFailedPrecondition,
          "ps " + first + " and ps " + ps +
              " spread the rows of embedding tables differently: are they configured with the same "
              "Tables policy (IdSharding)?");
    }
    if (!(replies[k].placement == replies[0].placement)) {
      throw Error(
          ErrorCode::kFailedPrecondition,
          "ps " + first + " and ps " + ps +
              " place the variables differently: are they configured with the same sharding policy "
              "and number of ps tasks?");
    }
  }
  const auto& registered = replies[0].variables;
  if (registered.size() != variables.size()) {
    throw Error(ErrorCode::kFailedPrecondition,
                "the ps tasks hold " + std::to_string(registered.size()) +
                    " variables but this model has " + std::to_string(variables.size()));
  }
  for (std::size_t v = 0; v < variables.size(); ++v) {
    if (!(registered[v] == variables[v])) {
      throw Error(ErrorCode::kFailedPrecondition,
                  "variable " + std::to_string(v) + " of this model ('" + variables[v].name +
                      "') differs from the one the chief registered ('" + registered[v].name +
                      "'): name, shape and initializer must match");
    }
  }
  if (replies[0].members != members_) {
    throw Error(ErrorCode::kFailedPrecondition, "the ps tasks say the job's ps tasks are " +
                                                    describe_members(replies[0].members) +
                                                    ", not " + describe_members(members_) +
                                                    ": are they configured with the same cluster?");
  }
  for (const Part& part : replies[0].placement.parts) {
    if (!std::binary_search(members_.begin(), members_.end(), part.ps)) {
      throw Error(ErrorCode::kFailedPrecondition,
                  "the ps tasks place parts on ps " + std::to_string(part.ps) +
                      ", which is not among the job's " + describe_members(members_) +
                      ": are they configured with the same cluster?");
    }
  }
  if (replies[0].placement.num_variables() != variables.size()) {
    throw Error(ErrorCode::kFailedPrecondition,
                "the ps tasks' placement does not cover this model's variables");
  }
  membership_ = replies[0].membership;
  if (!replies[0].ps_addresses.empty()) ps_addresses_ = std::move(replies[0].ps_addresses);
  placement_ = std::move(replies[0].placement);
  variables_ = std::move(variables);
  epoch_ = 0;
  for (const PlacementReply& r : replies) epoch_ = std::max(epoch_, r.epoch);
  slot_names_ = std::move(replies[0].slot_names);
  counter_names_ = std::move(replies[0].counter_names);
  tables_ = std::move(replies[0].tables);
  id_sharding_ = replies[0].id_sharding;
  // A chief that did not register the model (it took over a lost one's) cuts with it.
  table_seed_ = replies[0].table_seed;
}

}  // namespace pulley
