// SPDX-License-Identifier: MIT
#pragma once

/// pulley: a header-only parameter-server framework. This header is the core — the policy
/// concepts, the stock policies, the hosts and the in-process transport — and needs nothing
/// but the standard library. What needs more stands apart, each with its CMake target:
/// models (`models/`, pulley::models: xtensor), the TCP transport (`transport/tcp.hpp`,
/// pulley::tcp: Asio and cereal), cluster discovery (`cluster/`, pulley::cluster:
/// nlohmann-json) and the role runner (`runner/`, pulley::runner: all of them).
///
/// The layers, each a folder, each using only those before it (docs/ARCHITECTURE.md):
///   contracts   core/, protocol/, concepts/
///   policies    optimizers/, sharding/, sync/, tables/, (models/)
///   storage     checkpoint/
///   hosts       ps/ (ParameterServer), client/ (Worker, Chief, Evaluator)
///   transports  transport/
///   cluster and runner

#include "pulley/checkpoint/directory.hpp"
#include "pulley/checkpoint/rows.hpp"
#include "pulley/client/all_reduce_worker.hpp"
#include "pulley/client/checkpoint_cut.hpp"
#include "pulley/client/chief.hpp"
#include "pulley/client/client.hpp"
#include "pulley/client/dense_on_ring.hpp"
#include "pulley/client/evaluator.hpp"
#include "pulley/client/heartbeat.hpp"
#include "pulley/client/options.hpp"
#include "pulley/client/snapshot.hpp"
#include "pulley/client/worker.hpp"
#include "pulley/collective/ring_all_reduce.hpp"
#include "pulley/concepts/model.hpp"
#include "pulley/concepts/optimizer.hpp"
#include "pulley/concepts/ring.hpp"
#include "pulley/concepts/row_aggregation.hpp"
#include "pulley/concepts/service.hpp"
#include "pulley/concepts/sharding.hpp"
#include "pulley/concepts/sync_policy.hpp"
#include "pulley/concepts/transport.hpp"
#include "pulley/core/address.hpp"
#include "pulley/core/error.hpp"
#include "pulley/core/hash.hpp"
#include "pulley/core/id_index.hpp"
#include "pulley/core/initializers.hpp"
#include "pulley/core/log.hpp"
#include "pulley/core/node.hpp"
#include "pulley/core/placement.hpp"
#include "pulley/core/prefetch.hpp"
#include "pulley/core/spin.hpp"
#include "pulley/core/variable.hpp"
#include "pulley/core/version.hpp"
#include "pulley/optimizers/adagrad.hpp"
#include "pulley/optimizers/adam.hpp"
#include "pulley/optimizers/ftrl.hpp"
#include "pulley/optimizers/momentum.hpp"
#include "pulley/optimizers/rmsprop.hpp"
#include "pulley/optimizers/sgd.hpp"
#include "pulley/protocol/call.hpp"
#include "pulley/protocol/call_group.hpp"
#include "pulley/protocol/messages.hpp"
#include "pulley/protocol/token.hpp"
#include "pulley/ps/parameter_server.hpp"
#include "pulley/ps/shard_copies.hpp"
#include "pulley/sharding/ids.hpp"
#include "pulley/sharding/partition.hpp"
#include "pulley/sharding/partitioned.hpp"
#include "pulley/sharding/rebalance.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/async.hpp"
#include "pulley/sync/bounded_staleness.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "pulley/tables/row_aggregation.hpp"
#include "pulley/tables/tables.hpp"
#include "pulley/transport/in_process.hpp"
#include "pulley/transport/in_process_ring.hpp"
