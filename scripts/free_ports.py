#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Prints N free TCP ports on 127.0.0.1, one a line: every socket is bound before any is
closed, so the ports differ. With --run, the first of N consecutive free ports instead.

    python3 scripts/free_ports.py 5
    python3 scripts/free_ports.py --run 3
"""
import random
import socket
import sys


def free_ports(count):
    held = [socket.socket() for _ in range(count)]
    try:
        for s in held:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def free_port_run(count):
    for _ in range(200):
        base, held = random.randrange(40000, 50000), []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            pass
        finally:
            for s in held:
                s.close()
    sys.exit(f"free_ports.py: no {count} consecutive free ports found")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--run"]:
        print(free_port_run(int(args[1])))
    elif len(args) == 1:
        print("\n".join(str(p) for p in free_ports(int(args[0]))))
    else:
        sys.exit("usage: free_ports.py N | free_ports.py --run N")
