"""Slot images moved to the device by the loader thread, ahead of their slot write.

Why (issue 41): on the TPU host a slot write's transfer is a real host-to-device copy,
and it ran on the engine thread: 0.39 of the 0.46 ms `write_slots` took per adapter
(docs/benchmarks.md, seventh session on the chip), time every step that admits new
adapters waited for. The loader thread, which has just laid the image out, now also
starts its transfer; the engine thread's write then moves only the slot indices.

A staged image is device memory beside the KV cache, so the images staged and not yet
written are bounded by bytes. The staged copy is dropped once its slot is written (the
host copy stays in the host cache), or with its host copy if that is evicted first.
"""

from __future__ import annotations

import threading
import weakref

# Device bytes the staged, not yet written images may hold: a few adapters of a 1B-8B
# model at rank 16 (22-84 MB each), a window's worth of small ones. At least one image
# is always allowed.
STAGED_BYTES = 128 << 20


class DeviceStaging:
    def __init__(self, runtime, limit_bytes: int = STAGED_BYTES) -> None:
        self._rt = runtime
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()  # the loader thread stages, the engine thread frees
        self.staged_bytes = 0
        self.num_staged = 0  # images staged so far (a counter for stats and tests)

    def stage(self, host) -> bool:
        """Move host.flat to the device as host.device (loader thread), if the budget
        allows; False if it did not (the write then moves it)."""
        nbytes = host.nbytes
        with self._lock:
            if self.staged_bytes and self.staged_bytes + nbytes > self.limit_bytes:
                return False
            self.staged_bytes += nbytes
            self.num_staged += 1
        (device,) = self._rt.to_device_many([host.flat])
        # Freed when the last reference goes: the write drops it, or the host copy is
        # evicted with it still unwritten.
        weakref.finalize(device, self._release, nbytes)
        host.device = device
        return True

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.staged_bytes -= nbytes
