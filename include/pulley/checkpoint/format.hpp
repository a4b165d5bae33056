// SPDX-License-Identifier: MIT
#pragma once

/// One checkpoint on disk: a directory holding two files.
///
///   data   every tensor (each variable's values, then its slots), float32 little-endian,
///          each starting at a multiple of 64 bytes; then each embedding table's arrays
///          (ids, rows, last-touched steps, admission counts), each in chunks of at most
///          64 MiB, each chunk starting at a multiple of 64 bytes
///   index  what the tensors are: "PULLEYCK", the format version, the global step, the sync
///          policy's state, and per variable its name, shape, initializer, where each of its
///          tensors lies in `data` with its CRC-32C, its slot names and its counters by part;
///          then (version 2) the tables' seed, per table its spec, slot names, update
///          counts, and where each chunk of its arrays lies with its CRC-32C; (version 3)
///          the base step of an incremental checkpoint (-1: a full one) and per table the
///          ids evicted since it; last, the CRC-32C of everything before it
///
/// Versions 1 (pulley 0.2, no tables) and 2 (tables, no incremental checkpoints) still read.
///
/// `write_checkpoint` writes both files and flushes them to the disk (fsync) before it
/// returns; `read_checkpoint` checks every length against what is left and every CRC, and
/// throws `kDataLoss` naming what is wrong, so a checkpoint cut short by a crash or damaged
/// on disk is never taken for a good one. Integers are little-endian.
///
/// The format's constants are in checkpoint/format_constants.hpp, write_checkpoint in
/// checkpoint/write.hpp, the reading side in checkpoint/read.hpp; this header includes them
/// all.

#include "pulley/checkpoint/format_constants.hpp"
#include "pulley/checkpoint/read.hpp"
#include "pulley/checkpoint/write.hpp"
