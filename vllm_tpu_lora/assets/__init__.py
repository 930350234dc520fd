"""Demo assets shipped with the package: a tiny trained Llama and four LoRA adapters.

The base model copies a lowercase word; each adapter changes what it writes, in a way a person
can check by eye (see assets/demo/README.md; rebuilt by scripts/make_demo_assets.py):

    prompt "hello="  ->  base "hello" | upper "HELLO" | reverse "olleh" | rot13 "uryyb" | sort "ehllo"

The tokenizer is character-level and prepends <s> itself, so `demo_prompt` returns plain text.
"""

from __future__ import annotations

import os
from typing import NamedTuple

DEMO_TASKS = ("upper", "reverse", "rot13", "sort")

_DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")
_ROT13 = str.maketrans("abcdefghijklmnopqrstuvwxyz", "nopqrstuvwxyzabcdefghijklm")


def demo_model_dir() -> str:
    """The base model directory (config.json, model.safetensors, tokenizer files)."""
    return os.path.join(_DEMO_DIR, "base")


def demo_adapters() -> dict[str, str]:
    """Adapter name -> PEFT adapter directory, for every task in DEMO_TASKS."""
    return {task: os.path.join(_DEMO_DIR, "adapters", task) for task in DEMO_TASKS}


class DemoAssets(NamedTuple):
    model: str  # the base model's directory
    adapters: dict[str, str]  # adapter name -> PEFT adapter directory


def demo_assets() -> DemoAssets:
    """The bundled model and adapters, for examples that must run anywhere, offline:
    `model, adapters = demo_assets()`, then `LLM(model, ...)` and
    `LoRARequest("reverse", 1, adapters["reverse"])`."""
    return DemoAssets(demo_model_dir(), demo_adapters())


def demo_prompt(word: str) -> str:
    """The prompt for one word ("hello" -> "hello="); the tokenizer adds the leading <s>."""
    return f"{word}="


def demo_expected(task: str | None, word: str) -> str:
    """What greedy decoding should write (before </s>) for a lowercase word: task None is
    the base model's copy, otherwise one of DEMO_TASKS."""
    if task is None:
        return word
    if task == "upper":
        return word.upper()
    if task == "reverse":
        return word[::-1]
    if task == "rot13":
        return word.translate(_ROT13)
    if task == "sort":
        return "".join(sorted(word))
    raise ValueError(f"unknown demo task {task!r}; expected None or one of {DEMO_TASKS}")
