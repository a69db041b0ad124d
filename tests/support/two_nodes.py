"""Two torch.distributed nodes on this machine: ``torchrun --nnodes 2 --node_rank {0,1} --nproc_per_node 1`` on
127.0.0.1 (gloo), one launcher per node, as on two hosts -- each node has its own LOCAL_RANK 0 and may have its own
output directory (a node-local disk).

    launch(script, [[args of node 0], [args of node 1]], env=[{...}, {...}], timeout=300) -> [Node, Node]

``command``: how a node is started (:func:`torchrun` by default; benchmarks/two_nodes.py passes ``accelerate launch``).

Every launch gets a fresh port; a launch that outlives ``timeout`` is killed (both nodes), so a hang fails a test
instead of stalling the suite.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass
class Node:
    rank: int
    returncode: int | None  # None: killed at the timeout
    output: str  # stdout + stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script, node_args: list, *, rank: int, nodes: int, port: int) -> list[str]:
    """The command line of node ``rank``: ``torchrun --nnodes N --node_rank rank --nproc_per_node 1``."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank", str(rank),
            "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
            str(script), *map(str, node_args)]


def launch(script, args: list[list], *, env: list[dict] | None = None, timeout: float = 300,
           command=torchrun) -> list[Node]:
    """Start one process per node (``command(script, node_args, rank=, nodes=, port=)`` -> its command line) and wait
    for all of them, at most ``timeout`` seconds together."""
    port, procs = free_port(), []
    base = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1",
                TRL_EXPERIMENTAL_SILENCE="1")
    for rank, node_args in enumerate(args):
        cmd = command(script, node_args, rank=rank, nodes=len(args), port=port)
        procs.append(subprocess.Popen(cmd, env={**base, **((env or [{}] * len(args))[rank])}, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    deadline, out = time.monotonic() + timeout, []
    for rank, p in enumerate(procs):
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append(Node(rank, p.returncode, text))
        except subprocess.TimeoutExpired:
            for q in procs:  # the whole launch: torchrun and its worker
                try:
                    os.killpg(q.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            text, _ = p.communicate()
            out.append(Node(rank, None, text))
    return out
