"""Import torchax beside the torch it finds.

torchax 0.0.13 names, at import, aten overloads of the named-tensor API in its tables
(`aten.prod.dim_Dimname`, `aten.all.dimname`, `aten.norm.names_ScalarOpt_dim`, ...);
torch >= 2.13 removed them, so `import torchax` raises AttributeError there. Those table
entries can never match (torch no longer emits the overloads), so while torchax builds
its tables a missing named-tensor overload resolves to an inert placeholder instead of
raising. Any other missing name still raises, and the patch is undone right after: no
file on disk is touched, and nothing changes on a torch that still has the overloads.
"""

from __future__ import annotations

import contextlib
import re
import sys

import torch

# Overload names of the named-tensor API: dim_Dimname, dimname_out, names_dim, Dimname, ...
_NAMED_TENSOR_OVERLOAD = re.compile(r"dimname|names", re.IGNORECASE)


class RemovedOverload:
    """Stands for an overload torch no longer has: a dict key that nothing dispatches to,
    and an error naming the overload if anything ever calls it."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<removed overload {self.name}>"

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self.name} was removed from this torch ({torch.__version__})")


@contextlib.contextmanager
def tolerate_removed_named_overloads():
    """Within the block, `torch.ops.aten.<op>.<named-tensor overload>` never raises."""
    packet = torch._ops.OpOverloadPacket
    original = packet.__getattr__

    def lookup(self, key):
        try:
            return original(self, key)
        except AttributeError:
            if _NAMED_TENSOR_OVERLOAD.search(key):
                return RemovedOverload(f"{self._qualified_op_name}.{key}")
            raise

    packet.__getattr__ = lookup
    try:
        yield
    finally:
        packet.__getattr__ = original


def is_torchax_tensor(t) -> bool:
    """A torchax tensor (its data a jax array in `._elem`): code running on the jax
    runtime, which some ops take a JAX path for (Pallas kernels, bitcasts, barriers)."""
    return hasattr(t, "_elem")


def import_torchax():
    """torchax with its default environment built (its op tables load there, lazily)."""
    if "torchax" not in sys.modules or not getattr(sys.modules["torchax"], "env", None):
        with tolerate_removed_named_overloads():
            import torchax

            torchax.default_env()
    return sys.modules["torchax"]
