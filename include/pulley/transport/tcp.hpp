// SPDX-License-Identifier: MIT
#pragma once

/// The TCP transport over standalone Asio: `Tcp`, the client side (a `Transport`), and
/// `TcpServer`, which serves one ParameterServer on a port. Frames are those of wire.hpp;
/// tensors are gather-written from the caller's buffers and a pull reply is received
/// straight into the pull targets.

#include "pulley/transport/tcp_client.hpp"
#include "pulley/transport/tcp_server.hpp"
