"""Load a PEFT LoRA adapter directory into a `LoRAModel` laid out like our model: q/k/v into
qkv_proj's slices, gate/up into gate_up_proj's, o_proj and down_proj as single slices.

Everything is validated before anything is returned, so a rejected adapter leaves nothing
half-loaded; each rejection is a ValueError starting "Loading lora {name} failed: ", in vLLM's
wording where vLLM has one. As in vLLM, the tensors say which modules are adapted: PEFT skips
listed target modules a model lacks, so target_modules may name more than was trained.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import stat
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from vllm_tpu_lora.lora.layers import VOCAB_TARGETS, module_allowed
from vllm_tpu_lora.lora.models import LoRAModel, LoRASliceWeights

__all__ = ["LoRAModel", "LoRASliceWeights", "adapter_fingerprint", "load_peft_adapter",
           "raise_if_not_finite"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_SAFETENSORS = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"
# Modules that are LoRA-wrapped unpacked; the packed ones come from packed_modules_mapping.
_UNPACKED = ("o_proj", "down_proj")
# Our module names of the vocabulary-sized targets (served when lora_target_modules names them).
_VOCAB_MODULES = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}
# Config fields whose truthy value changes what the adapter computes in ways we don't implement
# (repeated layers, activated LoRA, trained token rows, LoRA on nn.Parameter). A bias on
# lora_B (lora_bias) and DoRA are served when the engine enables them.
_UNSUPPORTED_FEATURES = ("layer_replication", "alora_invocation_tokens",
                         "trainable_token_indices", "target_parameters")


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def safetensors_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (KeyError for one we do not read)."""
    return _SAFETENSORS_DTYPES[name]


class _Invalid(Exception):
    """A problem with the adapter; load_peft_adapter adds the adapter's name."""


class _Target(NamedTuple):
    """Where one PEFT module (e.g. model.layers.0.self_attn.k_proj) lives in our model."""
    module: str  # our module name (model.layers.0.self_attn.qkv_proj)
    slice: int  # WHOLE: all slices of a module packed in the checkpoint (Phi-3's qkv_proj)
    num_slices: int
    in_features: int
    out_features: int  # of this slice (of the whole module for WHOLE)
    sizes: tuple[int, ...] = ()  # WHOLE: the module's slice sizes


WHOLE = -1


def load_peft_adapter(lora_request, model: nn.Module, *, max_lora_rank: int,
                      dtype: torch.dtype = torch.float32, target_modules=None,
                      header_only: bool = False, allow_bias: bool = False,
                      allow_dora: bool = False, base_rows: dict | None = None,
                      targets: dict | None = None, check_finite: bool = True) -> LoRAModel:
    """Read, validate and repack the adapter at `lora_request.lora_path` for `model`.

    header_only: validate everything but the values (config, tensor names, shapes, ranks)
    from the config and the safetensors header, without reading tensor data; the modules
    then hold meta tensors. Cheap enough to run when a request names the adapter.

    `model` only supplies names and shapes (its `packed_modules_mapping`, and in/out features
    of each target layer, also through a LoRA wrapper's `base_layer`); it is not modified.
    Returns host tensors in `dtype`; raises ValueError naming the adapter on any problem.
    `target_modules` (the engine's lora_target_modules, checkpoint names such as "q_proj"):
    an adapter with weights for any other module is rejected.
    allow_bias / allow_dora: serve lora_bias=True / use_dora=True adapters (the engine's
    enable_lora_bias / enable_dora); otherwise they are rejected naming the flag.
    LoRA on embed_tokens / lm_head is served only when target_modules names them. PEFT
    also saves those layers' base weights next to such LoRA (save_embedding_layers): a
    copy is accepted if it is the base model's (same shape; and, given `base_rows`
    {our module: (row indices, rows)}, the same values at those rows), else rejected.
    targets: `model_targets(model, target_modules)`, when the caller keeps it (walking the
    model's modules costs ~0.5 ms, paid per adapter otherwise).
    check_finite=False: the caller checks the values itself (the LoRA manager checks the
    slot image it builds, in the serving dtype, and calls `raise_if_not_finite` to name
    the culprit); everything else is still validated.
    """
    try:
        return _load(lora_request, model, max_lora_rank, dtype, target_modules, header_only,
                     allow_bias, allow_dora, base_rows, targets, check_finite)
    except _Invalid as e:
        raise ValueError(f"Loading lora {lora_request.lora_name} failed: {e}") from e.__cause__


def _load(lora_request, model: nn.Module, max_lora_rank: int, dtype: torch.dtype,
          target_modules, header_only: bool, allow_bias: bool, allow_dora: bool,
          base_rows: dict | None, targets: dict | None, check_finite: bool) -> LoRAModel:
    path = lora_request.lora_path
    cfg = _read_config(path)
    _check_config(cfg)
    if cfg.get("use_dora") and not allow_dora:
        raise _Invalid("DoRA adapters (use_dora=True) are served only by an engine started "
                       "with enable_dora=True (--enable-dora).")
    if cfg.get("lora_bias") and not allow_bias:
        raise _Invalid("adapters with a bias on lora_B (lora_bias=True) are served only by an "
                       "engine started with enable_lora_bias=True (--enable-lora-bias).")
    tensors = _read_weights(path, header_only)
    _check_base_copies(tensors, model, base_rows)
    if targets is None:
        targets = model_targets(model, target_modules)
    pairs = _group_tensors(tensors, targets, cfg, path)
    modules = _build_modules(pairs, targets, cfg, dtype, check_finite)
    rank = max(s.rank for slices in modules.values() for s in slices if s is not None)
    if rank > max_lora_rank:
        raise _Invalid(f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}.")
    return LoRAModel(name=lora_request.lora_name, int_id=lora_request.lora_int_id, path=path,
                     rank=rank, modules=modules)


# ---- files ------------------------------------------------------------------------------

def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise _Invalid(f"No adapter found for {path} (no such directory)")
    cfg_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(cfg_path):
        raise _Invalid(f"No adapter found for {path} ({ADAPTER_CONFIG} is missing)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _Invalid(f"cannot read {cfg_path}: {e}") from e
    if not isinstance(cfg, dict):
        raise _Invalid(f"{cfg_path} is not a JSON object")
    return cfg


def _weights_file(path: str) -> str | None:
    st_path, bin_path = os.path.join(path, ADAPTER_SAFETENSORS), os.path.join(path, ADAPTER_BIN)
    return next((f for f in (st_path, bin_path) if os.path.isfile(f)), None)


def _fingerprint(weights: str, config_stat: os.stat_result, weights_stat: os.stat_result
                 ) -> tuple:
    return tuple((weights, s.st_ino, s.st_size, s.st_mtime_ns) for s in (config_stat, weights_stat))


def adapter_fingerprint(path: str) -> tuple | None:
    """What identifies the adapter files' current content without reading them: (inode,
    size, mtime) of the config and the weights file (safetensors, else .bin); None if
    either is gone. Two stats: each file's is taken once (syscalls are dear on the TPU
    VM's disk; read_adapter_bytes takes the same fingerprint from its descriptors)."""
    for weights in (os.path.join(path, ADAPTER_SAFETENSORS), os.path.join(path, ADAPTER_BIN)):
        try:
            weights_stat = os.stat(weights)
        except OSError:
            continue
        if not stat.S_ISREG(weights_stat.st_mode):  # as os.path.isfile
            continue
        try:
            return _fingerprint(weights, os.stat(os.path.join(path, ADAPTER_CONFIG)), weights_stat)
        except OSError:
            return None
    return None


def header_digest(path: str) -> bytes | None:
    """A digest of everything a header-only validation reads: adapter_config.json, the
    safetensors header (names, dtypes, shapes, offsets) and the file's size (the header's
    offsets are checked against it), not the tensor data. Adapters trained with one recipe
    share it, so it keys a memo of validations passed (and the loader's copy plans). None
    when the files cannot be read this way (a .bin adapter, a missing or short file): the
    caller then validates in full, which names the problem."""
    files = read_adapter_bytes(path)
    return None if files is None else files.digest


class AdapterBytes(NamedTuple):
    """An adapter's files as read once: their header_digest, and the safetensors data."""
    digest: bytes
    header: bytes  # the safetensors JSON header
    data: bytearray | None  # the tensor data that follows it (None: not wanted)
    fingerprint: tuple  # adapter_fingerprint of the files these bytes came from


def read_adapter_bytes(path: str, want_data: Callable[[bytes], bool] = lambda digest: False
                       ) -> AdapterBytes | None:
    """Both files of a safetensors adapter, each read once, the tensor data only if
    `want_data(digest)`; None as for header_digest. Raw descriptors and positioned
    reads: 9 syscalls for both files where buffered `open()` took 19 with the
    fingerprint's stats (on the TPU VM a file syscall costs ~15-27 us, not ~1), and the
    fingerprint comes from the very descriptors the bytes were read through."""
    weights = os.path.join(path, ADAPTER_SAFETENSORS)
    try:
        fd = os.open(os.path.join(path, ADAPTER_CONFIG), os.O_RDONLY)
        try:
            config_stat = os.fstat(fd)
            config = os.pread(fd, config_stat.st_size, 0)
        finally:
            os.close(fd)
        fd = os.open(weights, os.O_RDONLY)
        try:
            weights_stat = os.fstat(fd)
            size = weights_stat.st_size
            head = os.pread(fd, 8, 0)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            # A header longer than safetensors' own 100 MB limit: let validation say so.
            if len(config) != config_stat.st_size or not 0 <= n <= min(size - 8, 100_000_000):
                return None
            header = os.pread(fd, n, 8)
            if len(header) != n:
                return None
            digest = hashlib.blake2b(b"%d %d\0" % (size, len(config)) + config + header,
                                     digest_size=32).digest()
            data = None
            if want_data(digest):
                data = bytearray(size - 8 - n)
                if os.preadv(fd, [data], 8 + n) != len(data):
                    return None
        finally:
            os.close(fd)
    except OSError:
        return None
    return AdapterBytes(digest, header, data, _fingerprint(weights, config_stat, weights_stat))


class PlainSlice(NamedTuple):
    """One PEFT module of a plain adapter: where its tensors are and where they go."""
    target: _Target
    lora_a: str  # safetensors key of lora_A [r, in]
    lora_b: str  # of lora_B [out, r]
    scale: float


def plain_slices(path: str, targets: dict) -> list[PlainSlice] | None:
    """The adapter at `path` as (target, A key, B key, scale) per PEFT module, from
    its config and safetensors header alone, if it is a plain LoRA adapter: lora_A/lora_B
    weights of linear layers only (no bias, DoRA, vocabulary modules or saved base
    weights). None for anything else. For an adapter that load_peft_adapter has accepted
    (the caller's duty): the facts its slot image is built from, so another adapter with
    the same config and header can be laid out straight from its file bytes."""
    try:
        cfg = _read_config(path)
        _check_config(cfg)
        file = _weights_file(path)
        if file != os.path.join(path, ADAPTER_SAFETENSORS):
            return None
        tensors = _read_safetensors(file, header_only=True)
        if any(_base_copy_module(k) for k in tensors):
            return None
        key_of = {id(t): k for k, t in tensors.items()}
        pairs = _group_tensors(tensors, targets, cfg, path)
    except (_Invalid, OSError, ValueError):
        return None
    out = []
    for name in sorted(pairs):
        if set(pairs[name]) != {"lora_A", "lora_B"} or name.rsplit(".", 1)[-1] in VOCAB_TARGETS:
            return None
        a, b = pairs[name]["lora_A"], pairs[name]["lora_B"]
        out.append(PlainSlice(targets[name], key_of[id(a)], key_of[id(b)],
                              float(_module_scale(name, a.shape[0], cfg))))
    return out


def _read_safetensors(file: str, header_only: bool) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, read with one read() into one buffer that every tensor
    views (header_only: meta tensors, reading just the header). The format is an 8-byte
    little-endian header length, a JSON header {name: {dtype, shape, data_offsets}} and
    the data; safetensors' own load_file cost the background loader ~1 ms per 56-tensor
    adapter in per-tensor overhead."""
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("file too short for a safetensors header")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise ValueError(f"header length {n} exceeds the file's size ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"invalid header: {e}") from e
        if not isinstance(header, dict):
            raise ValueError("invalid header: not a JSON object")
        data = None
        if not header_only:
            data = bytearray(size - 8 - n)
            if f.readinto(data) != len(data):
                raise ValueError("file shorter than its header says")
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _SAFETENSORS_DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            start, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"invalid header entry for {name!r}: {info!r}") from e
        count = math.prod(shape)
        if end - start != count * dtype.itemsize or start < 0 or end > size - 8 - n:
            raise ValueError(f"tensor {name!r}: data_offsets {[start, end]} do not hold "
                             f"shape {shape} in {info['dtype']}")
        if data is None:
            tensors[name] = torch.empty(shape, dtype=dtype, device="meta")
        else:
            tensors[name] = torch.frombuffer(data, dtype=dtype, count=count,
                                             offset=start).view(shape) if count else (
                torch.empty(shape, dtype=dtype))
    return tensors


def _read_weights(path: str, header_only: bool = False) -> dict[str, torch.Tensor]:
    file = _weights_file(path)
    if file is None:
        raise _Invalid(f"No adapter found for {path} (neither {ADAPTER_SAFETENSORS} "
                       f"nor {ADAPTER_BIN} exists)")
    st_path = os.path.join(path, ADAPTER_SAFETENSORS)
    try:
        if file == st_path:
            tensors = _read_safetensors(file, header_only)
        else:  # weights_only: a pickle from an untrusted adapter must not run code
            tensors = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors, pickle and zip errors share no base class
        # torch's own text advises weights_only=False, which we never do: don't echo it.
        detail = str(e) if file == st_path else (
            f"torch.load(weights_only=True) failed with {type(e).__name__}; the file is "
            "corrupt or holds more than plain tensors")
        raise _Invalid(f"cannot read {file}: {detail}") from e
    if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
        raise _Invalid(f"{file} does not hold a flat name -> tensor state dict")
    return tensors


# ---- config -----------------------------------------------------------------------------

def _check_config(cfg: dict) -> None:
    peft_type = cfg.get("peft_type", "LORA")  # vLLM doesn't require the field either
    if peft_type != "LORA":
        raise _Invalid(f"peft_type {peft_type!r} is not supported; only LoRA adapters "
                       "(peft_type 'LORA') can be loaded.")
    missing = {"r", "lora_alpha", "target_modules"} - cfg.keys()
    if missing:
        raise _Invalid(f"Missing required configuration fields: {sorted(missing)}")
    if cfg.get("modules_to_save"):
        raise _Invalid("vLLM only supports modules_to_save being None "
                       f"(got modules_to_save={cfg['modules_to_save']!r}).")
    if cfg.get("bias", "none") != "none":
        raise _Invalid(f"bias={cfg['bias']!r} is not supported; only bias='none' adapters "
                       "(no trained biases) can be loaded.")
    for key in _UNSUPPORTED_FEATURES:
        if cfg.get(key):
            raise _Invalid(f"{key}={cfg[key]!r} is not supported.")
    r = cfg["r"]
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise _Invalid(f"r must be a positive integer, got {r!r}")
    if not _is_number(cfg["lora_alpha"]):
        raise _Invalid(f"lora_alpha must be a number, got {cfg['lora_alpha']!r}")
    _check_target_modules(cfg["target_modules"])
    for field in ("rank_pattern", "alpha_pattern"):
        cfg[field] = dict(cfg.get(field) or {})  # older exports write null for "none"
        for key, value in cfg[field].items():
            _compile(key, field)
            if not _is_number(value):
                raise _Invalid(f"{field}[{key!r}] must be a number, got {value!r}")


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_target_modules(tm) -> None:
    if isinstance(tm, str):
        if tm.lower() != "all-linear":  # PEFT's all-linear never includes the output layer
            _compile(tm, "target_modules")
    elif not (isinstance(tm, list) and all(isinstance(t, str) for t in tm)):
        raise _Invalid(f"target_modules must be a string or a list of strings, got {tm!r}")


def _compile(pattern: str, field: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise _Invalid(f"{field} has an invalid regular expression {pattern!r}: {e}") from e


def _vocab_module_msg(names) -> str:
    return (f"LoRA on {', '.join(sorted(set(names)))} is served only by an engine whose "
            "lora_target_modules include embed_tokens / lm_head (e.g. --lora-target-modules "
            "q_proj k_proj v_proj o_proj gate_proj up_proj down_proj embed_tokens lm_head).")


def _is_targeted(tm, module: str) -> bool:
    """PEFT's own test (check_target_module_exists) of whether target_modules covers a module."""
    if isinstance(tm, str):
        return tm.lower() == "all-linear" or re.fullmatch(tm, module) is not None
    return module in tm or any(module.endswith(f".{t}") for t in tm)


def _pattern_value(pattern: dict, module: str, default):
    """rank_pattern/alpha_pattern lookup with PEFT's get_pattern_key semantics: the first key
    (in the config's order) that matches a dot-bounded suffix of the module name wins."""
    for key in pattern:
        if re.match(rf"(.*\.)?({key})$", module):
            return pattern[key]
    return default


# ---- tensors ----------------------------------------------------------------------------

def model_targets(model: nn.Module, target_modules=None) -> dict[str, _Target]:
    """The PEFT module names an adapter may carry for `model` under the engine's
    lora_target_modules (None: every LoRA-capable linear), and where each lives."""
    targets = _model_targets(model, target_modules or ())
    if target_modules:
        targets = {k: v for k, v in targets.items()
                   if module_allowed(k.rsplit(".", 1)[-1], target_modules)}
    return targets


def _model_targets(model: nn.Module, target_modules) -> dict[str, _Target]:
    """PEFT module name -> where it lives in our model, for every LoRA-capable layer (the
    vocabulary-sized ones only if target_modules names them)."""
    packed = getattr(model, "packed_modules_mapping", {})
    targets: dict[str, _Target] = {}
    vocab, hidden = _embedding_shape(model)
    if "embed_tokens" in target_modules:  # A is [r, vocab], B [hidden, r]
        targets["model.embed_tokens"] = _Target("model.embed_tokens", 0, 1, vocab, hidden)
    if "lm_head" in target_modules:
        targets["lm_head"] = _Target("lm_head", 0, 1, hidden, vocab)
    for name, module in model.named_modules():
        prefix, _, leaf = name.rpartition(".")
        base = getattr(module, "base_layer", module)  # a LoRA wrapper keeps the layer here
        if leaf in packed:
            parts, sizes = packed[leaf], base.output_sizes
            for i, part in enumerate(parts):
                targets[f"{prefix}.{part}"] = _Target(name, i, len(parts), base.in_features,
                                                      sizes[i])
        elif hasattr(base, "output_sizes"):  # packed in the checkpoint: PEFT adapts it whole
            sizes = tuple(base.output_sizes)
            targets[name] = _Target(name, WHOLE, len(sizes), base.in_features, sum(sizes), sizes)
        elif leaf in _UNPACKED:
            targets[name] = _Target(name, 0, 1, base.in_features, base.out_features)
    return targets


def _embedding_shape(model: nn.Module) -> tuple[int, int]:
    return tuple(model.model.embed_tokens.weight.shape)


def _base_copy_module(key: str) -> str | None:
    """Our module name if `key` is PEFT's saved copy of a vocabulary layer's base weight
    ('...embed_tokens.base_layer.weight', '...lm_head.weight'), else None."""
    parts = key.removeprefix("base_model.model.").split(".")
    if parts[-1] != "weight":
        return None
    core = parts[:-2] if parts[-2:-1] == ["base_layer"] else parts[:-1]
    return _VOCAB_MODULES.get(core[-1]) if core else None


def _check_base_copies(tensors: dict[str, torch.Tensor], model: nn.Module,
                       base_rows: dict | None) -> None:
    """Accept PEFT's copies of the embedding / lm_head base weights only if they are the
    base model's (a resized or retrained vocabulary is a different model); drop them."""
    for key in [k for k in tensors if _base_copy_module(k)]:
        module, saved = _base_copy_module(key), tensors.pop(key)
        if tuple(saved.shape) != _embedding_shape(model):
            raise _Invalid(f"{key} has shape {tuple(saved.shape)} but the base model's is "
                           f"{_embedding_shape(model)}: adapters with a resized vocabulary "
                           "(new or trained token embeddings) cannot be served.")
        if saved.is_meta or not base_rows or module not in base_rows:
            continue
        idx, rows = base_rows[module]
        if not torch.allclose(saved[idx].float(), rows.float(), rtol=1e-2, atol=1e-3):
            raise _Invalid(f"{key} differs from the base model's weights: adapters that "
                           "retrain the whole embedding or lm_head cannot be served (only "
                           "LoRA on them).")


@functools.lru_cache(maxsize=8192)  # adapters of one base model repeat the same keys
def _parse_key(key: str) -> tuple[str, str, str | None, str | None] | None:
    """'base_model.model.X.lora_A[.adapter].weight' -> (X, 'lora_A', adapter, 'weight');
    PEFT's embedding LoRA has no '.weight': 'X.lora_embedding_A' -> (X, ..., None, None)."""
    parts = key.removeprefix("base_model.model.").split(".")
    for i, part in enumerate(parts):
        if part in ("lora_A", "lora_B", "lora_magnitude_vector", "lora_embedding_A",
                    "lora_embedding_B"):
            rest = parts[i + 1:]
            param = rest.pop() if rest and rest[-1] in ("weight", "bias") else None
            if len(rest) > 1:
                return None
            return ".".join(parts[:i]), part, (rest[0] if rest else None), param
    return None


def _group_tensors(tensors: dict[str, torch.Tensor], targets: dict[str, _Target], cfg: dict,
                   path: str) -> dict[str, dict[str, torch.Tensor]]:
    """PEFT module name -> {'lora_A': tensor, 'lora_B': tensor}, every key accounted for."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    unexpected: set[str] = set()
    adapter_names: set[str | None] = set()
    for key, tensor in tensors.items():
        parsed = _parse_key(key)
        if parsed is None:
            raise _Invalid(f"unexpected tensor {key!r}: only lora_A/lora_B weights are supported.")
        module, kind, adapter, param = parsed
        leaf = module.rsplit(".", 1)[-1]
        is_embedding = leaf == "embed_tokens"
        if leaf in VOCAB_TARGETS:  # from here on: a vocabulary module the engine serves
            if module not in targets:
                raise _Invalid(_vocab_module_msg([module]))
            if cfg.get("ensure_weight_tying"):
                raise _Invalid("ensure_weight_tying=True (one LoRA shared by tied embed_tokens "
                               "and lm_head) is not supported.")
            if kind == "lora_magnitude_vector" or (kind == "lora_B" and param == "bias"):
                raise _Invalid(f"DoRA and lora_bias on {module} are not supported (only on "
                               "the q/k/v/o/gate/up/down projections).")
        if kind.startswith("lora_embedding_") != is_embedding:
            raise _Invalid(f"unexpected tensor {key!r}: PEFT stores an embedding's LoRA as "
                           "lora_embedding_A/B and a linear layer's as lora_A/B.")
        if is_embedding and param is None:
            kind, param = kind.replace("embedding_", ""), "weight"
        if kind == "lora_B" and param == "bias" and cfg.get("lora_bias"):
            kind = "lora_B_bias"
        elif kind == "lora_magnitude_vector" and param in (None, "weight") and cfg.get("use_dora"):
            kind = "magnitude"
        elif param != "weight" or kind == "lora_magnitude_vector":
            raise _Invalid(f"unexpected tensor {key!r}: only lora_A/lora_B weights (and lora_B "
                           "biases with lora_bias, magnitudes with use_dora) are supported.")
        if module not in targets:
            unexpected.add(module)
            continue
        adapter_names.add(adapter)
        pairs.setdefault(module, {})[kind] = tensor
    if unexpected:  # vLLM's check and text
        expected = sorted({name.rsplit(".", 1)[-1] for name in targets})
        raise _Invalid(f"While loading {path}, expected target modules in {expected} but received "
                       f"{sorted(unexpected)}. Please verify that the loaded LoRA module is correct")
    if len(adapter_names) > 1:  # e.g. both '.lora_A.weight' and '.lora_A.default.weight'
        raise _Invalid(f"the weights hold several adapters {sorted(map(str, adapter_names))}; "
                       "expected exactly one.")
    for module, ab in pairs.items():
        # PEFT would ignore weights of a module target_modules doesn't cover: an inconsistent
        # adapter, whichever of the two is wrong.
        if not _is_targeted(cfg["target_modules"], module):
            raise _Invalid(f"weights for {module} are present but target_modules="
                           f"{cfg['target_modules']!r} does not cover it.")
        if not {"lora_A", "lora_B"} <= set(ab):
            raise _Invalid(f"{module} has {sorted(ab)} but needs both lora_A and lora_B.")
        if cfg.get("use_dora") and "magnitude" not in ab:
            raise _Invalid(f"{module} has no lora_magnitude_vector but use_dora=True.")
    if not pairs:
        raise _Invalid(f"{path} holds no LoRA weights.")
    return pairs


def _build_modules(pairs, targets: dict[str, _Target], cfg: dict, dtype: torch.dtype,
                   check_finite: bool = True) -> dict[str, list[LoRASliceWeights | None]]:
    modules: dict[str, list[LoRASliceWeights | None]] = {}
    cast: list[tuple[str, str, torch.Tensor]] = []  # (module, kind, tensor) to check finite
    for name in sorted(pairs):
        target = targets[name]
        a, b = pairs[name]["lora_A"], pairs[name]["lora_B"]
        r = _checked_rank(name, a, b, target, cfg)
        scale = _module_scale(name, r, cfg)
        a, b = _cast(cast, name, "lora_A", a, dtype), _cast(cast, name, "lora_B", b, dtype)
        vectors = {}  # lora_B's bias, DoRA's magnitude: one value per output channel
        for key, field in (("lora_B_bias", "bias"), ("magnitude", "magnitude")):
            if key in pairs[name]:
                vec = pairs[name][key]
                if tuple(vec.shape) != (target.out_features,):
                    raise _Invalid(f"{field} of {name} has shape {tuple(vec.shape)}, expected "
                                   f"({target.out_features},).")
                vectors[field] = _cast(cast, name, field, vec, dtype)
        slices = modules.setdefault(target.module, [None] * target.num_slices)
        if target.slice == WHOLE:
            # One A for the packed output, B's rows per slice: slice i's delta is
            # B_i @ A @ x, exactly the packed module's delta split at the slice boundaries
            # (and so are the per-channel vectors).
            sizes = list(target.sizes)
            parts = {f: v.split(sizes) for f, v in vectors.items()}
            for i, b_i in enumerate(b.split(sizes, dim=0)):
                slices[i] = LoRASliceWeights(
                    lora_a=a, lora_b=b_i.contiguous(), scale=float(scale),
                    **{f: p[i].contiguous() for f, p in parts.items()})
        else:
            slices[target.slice] = LoRASliceWeights(lora_a=a, lora_b=b, scale=float(scale),
                                                    **vectors)
    if check_finite:
        _check_finite(cast, dtype)
    return modules


def _module_scale(name: str, r: int, cfg: dict) -> float:
    """PEFT's LoraLayer.update_layer: the scaling from the module's own r and alpha."""
    alpha = _pattern_value(cfg["alpha_pattern"], name, cfg["lora_alpha"])
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _checked_rank(name: str, a: torch.Tensor, b: torch.Tensor, target: _Target, cfg: dict) -> int:
    if (a.dim() != 2 or b.dim() != 2 or a.shape[1] != target.in_features
            or b.shape[0] != target.out_features or a.shape[0] != b.shape[1]):
        raise _Invalid(f"weight shapes of {name} do not match the base model: lora_A "
                       f"{tuple(a.shape)} and lora_B {tuple(b.shape)}, expected "
                       f"(r, {target.in_features}) and ({target.out_features}, r).")
    r = a.shape[0]
    expected = _pattern_value(cfg["rank_pattern"], name, cfg["r"])
    if r != expected:
        raise _Invalid(f"{name} has rank {r} in its weights but adapter_config.json gives "
                       f"rank {expected} (r / rank_pattern).")
    return r


def _cast(cast: list, name: str, kind: str, tensor: torch.Tensor,
          dtype: torch.dtype) -> torch.Tensor:
    # Checked after the cast (_check_finite), so values that overflow the serving dtype
    # are caught too.
    out = tensor.to(dtype=dtype).contiguous()
    if not out.is_meta:
        cast.append((name, kind, out))
    return out


def raise_if_not_finite(lora: LoRAModel, dtype: torch.dtype) -> None:
    """The exact per-tensor check of a model loaded (in `dtype`) with check_finite=False:
    raises the ValueError naming the first tensor with a NaN or Inf (returns if none)."""
    cast = [(name, kind, t) for name, slices in sorted(lora.modules.items())
            for w in slices if w is not None
            for kind, t in (("lora_A", w.lora_a), ("lora_B", w.lora_b), ("bias", w.bias),
                            ("magnitude", w.magnitude)) if t is not None]
    try:
        _name_non_finite(cast, dtype)
    except _Invalid as e:
        raise ValueError(f"Loading lora {lora.name} failed: {e}") from None


def _check_finite(cast: list[tuple[str, str, torch.Tensor]], dtype: torch.dtype) -> None:
    """No NaN/Inf in any cast tensor. Fast path: one sum over all of them is finite only
    if every value is (per-tensor isfinite cost the background loader ~2 of its ~6 ms per
    adapter); a non-finite sum (a NaN/Inf, or finite values overflowing the sum) falls
    back to the exact per-tensor check, which names the tensor."""
    if not cast or torch.isfinite(torch.cat([t.reshape(-1) for *_, t in cast]).sum()):
        return
    _name_non_finite(cast, dtype)


def _name_non_finite(cast: list[tuple[str, str, torch.Tensor]], dtype: torch.dtype) -> None:
    """The exact check: the first (module, kind) tensor holding a NaN or Inf, by name."""
    bad = next(((n, k) for n, k, t in cast if not torch.isfinite(t).all()), None)
    if bad is not None:
        raise _Invalid(f"{bad[1]} of {bad[0]} contains NaN or Inf values (in {dtype}).")
