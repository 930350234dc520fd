"""XLA's CPU backend against the kernel's limit on a process's memory mappings.

XLA:CPU (jaxlib 0.7) JIT-compiles every kernel of an executable into memory mappings of
its own: ~480 for a graph of 50 small dense layers, from ~600 to ~9,700 for the graphs
of a 16-layer Llama with LoRA, the larger buckets more (measured on the project's CPU
host). Linux caps a process at
`vm.max_map_count` mappings (65,530 by default). The compile that crosses it fails inside
LLVM ("LLVM compilation error: Cannot allocate memory") and the process then dies of a
segmentation fault: an engine over a 16-layer model with LoRA, whose warm-up compiles ~90
graphs, did so on that host. `MapBudget` refuses the next compile while there is still
room to say why. TPU executables live on the chip and are not counted.
"""

from __future__ import annotations

import threading

# Mappings left for everything else the process maps after warm-up (arrays, threads).
RESERVE = 2048


def count_maps() -> int | None:
    """This process's memory mappings (None where /proc does not say)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def max_map_count() -> int | None:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


class MapBudget:
    """Refuses a compile that would start with fewer mappings left under the limit than
    the compiles running beside it may take (each counted at the most one compile has
    added so far) plus RESERVE. Only running compiles count: the ones queued behind the
    compile threads have mapped nothing yet. One per process (`BUDGET`): the limit is the
    process's, whatever engines it holds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._per_graph = 0  # the most mappings one compile added, shared among those beside it
        self._compiled = 0

    def starting(self) -> tuple[int | None, int]:
        """In the compiling thread, before the compile: what `finished` needs, or
        RuntimeError if this compile may cross the limit."""
        limit, now = max_map_count(), count_maps()
        with self._lock:
            self._running += 1
            per_graph, running, done = self._per_graph, self._running, self._compiled
        if limit is None or now is None or now + per_graph * running <= limit - RESERVE:
            return now, running
        with self._lock:
            self._running -= 1
        raise RuntimeError(
            f"Compiling this engine's graphs on XLA's CPU backend needs more memory mappings "
            f"than the kernel allows a process (vm.max_map_count = {limit}): the {done} "
            f"graphs compiled so far took up to ~{per_graph} mappings each and the process "
            f"has {now}; the next compiles would fail inside LLVM and crash the process. "
            "Raise the limit (sudo sysctl -w vm.max_map_count=262144) or compile fewer "
            "graphs (a smaller max_num_batched_tokens, max_num_seqs or max_loras).")

    def finished(self, started: tuple[int | None, int]) -> None:
        """After the compile (done or failed), with what `starting` returned. The growth is
        split among the compiles that ran beside it, which mapped into the same count."""
        before, running_then = started
        after = count_maps()
        with self._lock:
            beside = max(running_then, self._running)
            self._running -= 1
            self._compiled += 1
            if before is not None and after is not None:
                self._per_graph = max(self._per_graph, (after - before) // beside)


BUDGET = MapBudget()
