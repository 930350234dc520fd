"""Block hashes for automatic prefix caching.

A full KV block is named by a hash chain: sha256(parent block's hash, the block's token
ids). The chain's root holds everything else the block's K/V depends on: the identity of
the weights it was computed with (base model, or an adapter's id plus its weights version,
which changes on every reload, `load_inplace` included) and the request's `cache_salt`.
So a block matches only a request that would compute the very same K/V.

The root hashes the repr of a tuple, not a concatenation of strings: no adapter name or
salt can be written to look like another key (vLLM #44701). sha256 rather than Python's
hash(): tenants share the cache, and a collision someone could craft would hand one tenant
another's KV.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Any

from vllm_tpu_lora.engine.sequence import Sequence


def root_hash(weights_key: Any, cache_salt: str | None) -> bytes:
    """weights_key: None for the base model, else a hashable, repr-stable adapter identity."""
    return hashlib.sha256(repr(("vllm_tpu_lora/kv", weights_key, cache_salt)).encode()).digest()


def block_hashes(seq: Sequence, root: bytes, num_blocks: int, block_size: int) -> list[bytes]:
    """The hashes of `seq`'s first `num_blocks` full blocks, computed once and kept on the
    sequence (re-rooted if the root changed while it waited, e.g. its adapter reloaded)."""
    if seq.hash_root != root:
        seq.hash_root, seq.block_hashes = root, []
    hashes = seq.block_hashes
    for i in range(len(hashes), num_blocks):
        tokens = seq.token_ids_slice(i * block_size, (i + 1) * block_size)
        parent = hashes[i - 1] if i else root
        hashes.append(hashlib.sha256(parent + array("q", tokens).tobytes()).digest())
    return hashes[:num_blocks]
