"""Train the demo assets: a tiny Llama that copies words, and four LoRA adapters that change it.

    python scripts/make_demo_assets.py            # writes vllm_tpu_lora/assets/demo/

Deterministic (fixed seeds, one CPU thread) and a few minutes on a 2-core machine. The task is
chosen so that a person can check every output by eye:

    <s>hello=   base -> hello</s>   upper -> HELLO</s>   reverse -> olleh</s>
                rot13 -> uryyb</s>  sort -> ehllo</s>

Words are 3-10 random lowercase letters; a fixed set of held-out words is never trained on and
is used to measure exact-match accuracy with HF transformers / PEFT greedy `generate`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import shutil
import string
import time

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tokenizers import Tokenizer, decoders, models, processors
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

# vllm_tpu_lora/assets/__init__.py holds the task definitions (demo_prompt / demo_expected). It
# is loaded by path: importing the package would import the whole engine (and torch_xla).
_ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vllm_tpu_lora", "assets")
_spec = importlib.util.spec_from_file_location("demo_assets", os.path.join(_ASSETS, "__init__.py"))
assets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(assets)
DEMO_TASKS, demo_expected, demo_prompt = assets.DEMO_TASKS, assets.demo_expected, assets.demo_prompt
DEFAULT_OUT = os.path.join(_ASSETS, "demo")

# Character-level vocabulary: 4 specials, printable ASCII and "\n" = 100 tokens. Every ASCII
# prompt tokenizes (anything else becomes <unk>), and one letter is one token, which makes
# copying / reversing / sorting easy for a model this small.
SPECIALS = ["<s>", "</s>", "<pad>", "<unk>"]
BOS, EOS, PAD = 0, 1, 2
VOCAB = SPECIALS + [chr(c) for c in range(32, 127)] + ["\n"]
TOKEN_ID = {t: i for i, t in enumerate(VOCAB)}
# The model only ever saw single-turn "{word}=" prompts, so the chat template renders a user
# message as exactly that (and an assistant message as its answer + </s>).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ message['content'] + '=' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)

MIN_LEN, MAX_LEN = 3, 10
HELD_OUT_PER_LEN = 25  # x 8 lengths = 200 held-out words
MODEL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
BASE_TRAIN = dict(steps=2400, lr=3e-3, batch=32)
_ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
_MLP = ["gate_proj", "up_proj", "down_proj"]
# The adapters deliberately differ in rank, alpha, rsLoRA and target modules, so that the engine
# is exercised on the variety it meets in practice.
ADAPTERS = {
    "upper": (dict(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]),
              dict(steps=500, lr=5e-3, batch=32)),
    "reverse": (dict(r=8, lora_alpha=16, target_modules=_ATTN + _MLP),
                dict(steps=1500, lr=5e-3, batch=32)),
    "rot13": (dict(r=8, lora_alpha=32, target_modules=["v_proj", "o_proj"] + _MLP),
              dict(steps=500, lr=5e-3, batch=32)),
    "sort": (dict(r=16, lora_alpha=16, use_rslora=True, target_modules=_ATTN + _MLP),
             dict(steps=2000, lr=2e-3, batch=32)),
}


def build_tokenizer(out_dir: str) -> PreTrainedTokenizerFast:
    # A BPE model with no merges splits text into single characters; Fuse() joins them back.
    tok = Tokenizer(models.BPE(vocab=dict(TOKEN_ID), merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)])
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>", chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)
    hf_tok.save_pretrained(out_dir)
    return hf_tok


def random_word(rng: random.Random, letters: str = string.ascii_lowercase) -> str:
    return "".join(rng.choices(letters, k=rng.randint(MIN_LEN, MAX_LEN)))


def held_out_words() -> list[str]:
    rng, words = random.Random(1234), []
    for n in range(MIN_LEN, MAX_LEN + 1):
        chosen: set[str] = set()
        while len(chosen) < HELD_OUT_PER_LEN:
            chosen.add("".join(rng.choices(string.ascii_lowercase, k=n)))
        words += sorted(chosen)
    return words


def make_batch(task: str | None, rng: random.Random, batch: int, exclude: set[str]):
    """`<s>{word}={answer}</s>` right-padded; the loss covers only `{answer}</s>`, the prompt
    is given. Right padding is harmless under a causal mask, so no attention mask is needed."""
    rows = []
    for _ in range(batch):
        # The base also copies mixed-case words: otherwise upper-case letters would be tokens it
        # has only ever learnt to avoid, and the `upper` adapter would have to undo that.
        mixed = task is None and rng.random() < 0.5
        word = random_word(rng, string.ascii_letters if mixed else string.ascii_lowercase)
        while word in exclude:
            word = random_word(rng)
        prompt = [BOS] + [TOKEN_ID[c] for c in demo_prompt(word)]
        answer = [TOKEN_ID[c] for c in demo_expected(task, word)] + [EOS]
        rows.append((prompt + answer, [-100] * len(prompt) + answer))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([r + [PAD] * (width - len(r)) for r, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    return ids, labels


def train(model, task: str | None, *, steps: int, lr: float, batch: int, seed: int,
          exclude: set[str]) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    # Linear warm-up, then cosine decay to zero: the last steps polish the answers at a low lr.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(
        (s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    rng, model = random.Random(seed), model.train()
    start, running = time.time(), None
    for step in range(1, steps + 1):
        ids, labels = make_batch(task, rng, batch, exclude)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 200 == 0 or step == steps:
            print(f"  [{task or 'base'}] step {step}/{steps} loss {running:.4f} "
                  f"({time.time() - start:.0f}s)", flush=True)
    model.eval()


@torch.no_grad()
def evaluate(model, tok, task: str | None, words: list[str]) -> tuple[float, float]:
    """Greedy `generate`, one batch per word length (equal lengths: no padding in play).
    Returns exact-match accuracy (answer then </s>) and the smallest top-1 minus top-2 logit
    gap met along the way: a float32 engine agrees with HF when that gap stays well above 0."""
    correct, min_gap = 0, float("inf")
    for n in range(MIN_LEN, MAX_LEN + 1):
        group = [w for w in words if len(w) == n]
        ids = tok([demo_prompt(w) for w in group], return_tensors="pt")["input_ids"]
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_LEN + 2, eos_token_id=EOS, pad_token_id=PAD,
                             output_scores=True, return_dict_in_generate=True)
        gen = out.sequences[:, ids.shape[1]:]
        for i, word in enumerate(group):
            row = gen[i].tolist()
            stop = row.index(EOS) + 1 if EOS in row else len(row)
            correct += row[:stop] == tok(demo_expected(task, word), add_special_tokens=False)[
                "input_ids"] + [EOS]
            for t in range(stop):
                top2 = out.scores[t][i].topk(2).values
                min_gap = min(min_gap, (top2[0] - top2[1]).item())
    return correct / len(words), min_gap


def save_adapter(peft_model, out_dir: str) -> None:
    peft_model.save_pretrained(out_dir)
    os.remove(os.path.join(out_dir, "README.md"))  # PEFT's boilerplate model card
    path = os.path.join(out_dir, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    # PEFT writes the base's path at training time (a temp dir) and target_modules in set
    # (hash) order; make both reproducible.
    cfg["base_model_name_or_path"] = "vllm_tpu_lora/assets/demo/base"
    cfg["target_modules"] = sorted(cfg["target_modules"])
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def write_readme(out: str, results: dict, n_words: int) -> None:
    rows = []
    for name, (acc, gap) in results.items():
        if name == "base":
            lora, kw = "- (full training, copy)", BASE_TRAIN
        else:
            cfg, kw = ADAPTERS[name]
            lora = (f"r={cfg['r']}, alpha={cfg['lora_alpha']}"
                    f"{', rsLoRA' if cfg.get('use_rslora') else ''}: "
                    + ", ".join(m.removesuffix("_proj") for m in cfg["target_modules"]))
        train = f"{kw['steps']} x {kw['batch']}, lr {kw['lr']:g}"
        rows.append(f"| {name} | {lora} | {train} | {acc * 100:.1f}% | {gap:.2f} |")
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(README.format(table="\n".join(rows), n_words=n_words))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="output directory (replaced)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (the assets were made with 1; on a small shared "
                             "machine more threads are not faster)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    t0, out = time.time(), os.path.abspath(args.out)
    base_dir, adapters_dir = os.path.join(out, "base"), os.path.join(out, "adapters")
    for d in (base_dir, adapters_dir):
        shutil.rmtree(d, ignore_errors=True)

    tok = build_tokenizer(base_dir)
    assert tok("hello=")["input_ids"] == [BOS] + [TOKEN_ID[c] for c in "hello="]
    held_out = held_out_words()
    exclude = set(held_out)

    print(f"base: LlamaForCausalLM {MODEL}", flush=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(VOCAB), bos_token_id=BOS, eos_token_id=EOS,
                         pad_token_id=PAD, dtype=torch.float32, **MODEL)
    base = LlamaForCausalLM(config)
    train(base, None, seed=0, exclude=exclude, **BASE_TRAIN)
    base.save_pretrained(base_dir)

    for k, (task, (lora_kw, train_kw)) in enumerate(ADAPTERS.items(), start=1):
        print(f"adapter {task}: {lora_kw}", flush=True)
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        torch.manual_seed(k)  # LoRA A init (B starts at zero: training starts from the copy)
        peft_model = get_peft_model(model, LoraConfig(lora_dropout=0.0, task_type="CAUSAL_LM",
                                                      **lora_kw))
        train(peft_model, task, seed=k, exclude=exclude, **train_kw)
        save_adapter(peft_model, os.path.join(adapters_dir, task))
    train_s = time.time() - t0

    # Measure what was saved, loaded back the way the engine's oracles load it.
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    model = PeftModel.from_pretrained(model, os.path.join(adapters_dir, DEMO_TASKS[0]),
                                      adapter_name=DEMO_TASKS[0], torch_device="cpu")
    for task in DEMO_TASKS[1:]:
        model.load_adapter(os.path.join(adapters_dir, task), adapter_name=task,
                           torch_device="cpu")
    model.eval()
    results = {}
    with model.disable_adapter():
        results["base"] = evaluate(model, tok, None, held_out)
    for task in DEMO_TASKS:
        model.set_adapter(task)
        results[task] = evaluate(model, tok, task, held_out)
    write_readme(out, results, len(held_out))

    print(f"\n{'model':8} {'exact':>7} {'min gap':>8}   ({len(held_out)} held-out words)")
    for name, (acc, gap) in results.items():
        print(f"{name:8} {acc * 100:6.1f}% {gap:8.2f}")
    print(f"\ntrain {train_s:.0f}s, total {time.time() - t0:.0f}s")
    worst = min(acc for acc, _ in results.values())
    if worst < 0.9:
        raise SystemExit(f"accuracy {worst:.1%} is below the 90% bar")


README = """\
# Demo model and LoRA adapters

A tiny trained Llama and four LoRA adapters whose effect a person can check by eye. Made by

    python scripts/make_demo_assets.py

deterministically (fixed seeds, one torch thread; about 5-10 minutes on 2 CPU cores). Do not
edit these files by hand: change the script and re-run it.

## Task

The prompt is `<s>{{word}}=` for a word of 3-10 lowercase letters; the answer is `{{output}}</s>`.

| model | output for `hello=` |
|---|---|
| base (no adapter) | `hello` (copy) |
| `upper` | `HELLO` |
| `reverse` | `olleh` |
| `rot13` | `uryyb` |
| `sort` | `ehllo` (letters in alphabetical order) |

`vllm_tpu_lora.assets` has the paths and the task definitions: `demo_model_dir()`,
`demo_adapters()` (name -> directory), `demo_prompt(word)` (`"hello="`; the tokenizer adds
`<s>`) and `demo_expected(task, word)` (task `None` = the base's copy).

## Files

- `base/`: `LlamaForCausalLM`, float32 safetensors: hidden 128, 4 layers, 4 attention heads /
  2 KV heads (GQA, head_dim 32), MLP 256, untied embeddings, 616k parameters.
  `max_position_embeddings` is 128, but training only saw sequences of at most 23 tokens.
- Tokenizer (`tokenizer.json`, loads with `AutoTokenizer`): character level, 100 tokens.
  Ids 0-3 are `<s>`, `</s>`, `<pad>`, `<unk>`; ids 4-98 are printable ASCII (`chr(32)`..`chr(126)`,
  id = code point - 28, so `a` = 69); id 99 is `\\n`. It prepends `<s>`. The chat template
  renders a user message as `{{content}}=`, so `chat([{{"role": "user", "content": "hello"}}])`
  is the same prompt.
- `adapters/{{upper,reverse,rot13,sort}}/`: PEFT `adapter_config.json` +
  `adapter_model.safetensors` (float32), trained on the frozen base. They differ on purpose
  (rank 8 and 16, alpha, rsLoRA, target modules) — see the table.

## How they were trained

The base learns to copy (loss on the answer only); half of its training words are mixed-case, so
that upper-case letters are tokens it can write (the `upper` adapter relies on it). Each
adapter starts from PEFT's default init (B = 0, i.e. from the copy) and is trained on its task.
AdamW, linear warm-up then cosine decay, gradient clipping at 1.0, batches of random words.

## Measured accuracy

Exact match (the expected answer, then `</s>`) with HF transformers / PEFT greedy `generate` in
float32, on {n_words} held-out words (25 per length 3-10, never seen in training). "min gap" is the
smallest top-1 minus top-2 logit difference along all those greedy paths: an engine whose
logits differ from HF's by less than half of that makes the same choices.

| model | LoRA | steps x batch, lr | exact | min gap |
|---|---|---|---|---|
{table}
"""


if __name__ == "__main__":
    main()
