// SPDX-License-Identifier: MIT
#pragma once

/// The TCP transport over standalone Asio: `Tcp`, the client half (a `Transport`), and
/// `TcpServer`, which serves one `Service` (a ParameterServer) on a port. Frames are those
/// of wire/frame.hpp, encoded as wire/codec.hpp says; tensors are gather-written from the
/// caller's buffers and a reply's tensors are received straight into the call's targets.
/// `TcpRing` (tcp_ring.hpp) links the workers of an all-reduce job to each other;
/// `probe_ps` (tcp_probe.hpp) looks at who serves a ps's address.

#include "pulley/transport/tcp_client.hpp"
#include "pulley/transport/tcp_probe.hpp"
#include "pulley/transport/tcp_ring.hpp"
#include "pulley/transport/tcp_server.hpp"
