// SPDX-License-Identifier: MIT
#pragma once

/// pulley: a header-only parameter-server framework. This header is the core — the policy
/// concepts, the stock policies, the hosts and the in-process transport — and needs nothing
/// but the standard library. What needs more stands apart, each with its CMake target:
/// models (`models/`, pulley::models: xtensor), the TCP transport (`transport/tcp.hpp`,
/// pulley::tcp: Asio and cereal), cluster discovery (`cluster/`, pulley::cluster:
/// nlohmann-json) and the role runner (`runner/`, pulley::runner: all of them).
///
/// The layers, each using only those before it:
///   contracts  error, variable, placement, messages, call, concepts/
///   policies   optimizers/, sharding/, sync/
///   hosts      ParameterServer (with EmbeddingTable), Worker, Chief, Evaluator
///   transports transport/
///   cluster and runner

#include "pulley/address.hpp"
#include "pulley/call.hpp"
#include "pulley/call_group.hpp"
#include "pulley/chief.hpp"
#include "pulley/client_options.hpp"
#include "pulley/concepts/model.hpp"
#include "pulley/concepts/optimizer.hpp"
#include "pulley/concepts/service.hpp"
#include "pulley/concepts/sharding.hpp"
#include "pulley/concepts/sync_policy.hpp"
#include "pulley/concepts/transport.hpp"
#include "pulley/embedding_table.hpp"
#include "pulley/error.hpp"
#include "pulley/evaluator.hpp"
#include "pulley/heartbeat.hpp"
#include "pulley/initializers.hpp"
#include "pulley/log.hpp"
#include "pulley/messages.hpp"
#include "pulley/node.hpp"
#include "pulley/optimizers/adagrad.hpp"
#include "pulley/optimizers/adam.hpp"
#include "pulley/optimizers/ftrl.hpp"
#include "pulley/optimizers/momentum.hpp"
#include "pulley/optimizers/rmsprop.hpp"
#include "pulley/optimizers/sgd.hpp"
#include "pulley/parameter_server.hpp"
#include "pulley/placement.hpp"
#include "pulley/sharding/ids.hpp"
#include "pulley/sharding/partition.hpp"
#include "pulley/sharding/partitioned.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/async.hpp"
#include "pulley/sync/bounded_staleness.hpp"
#include "pulley/sync/sparse_accumulator.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "pulley/transport/in_process.hpp"
#include "pulley/variable.hpp"
#include "pulley/version.hpp"
#include "pulley/worker.hpp"
