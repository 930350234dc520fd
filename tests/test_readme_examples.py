"""The README's examples run as written, offline, on the bundled demo model and adapters,
and the examples/ scripts with them.

Fences say what happens to a block: ```python runs in this process, ```sh in bash,
```bash only has its `vllm-tpu-lora` commands parsed (installs, the test suite itself,
servers one starts by hand), ```text is output. A comment `# -> X` on a line says that
the example prints X. The one ```sh block that is `vllm-tpu-lora serve ...` is started as
a real server, and the blocks that talk to localhost:8000 run against it.

`LLM(...)` with the same arguments returns one shared engine across blocks and scripts:
XLA compiles ~1 s per graph on CPU, and the README sizes its examples alike for that.
"""

import contextlib
import dataclasses
import io
import os
import pathlib
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from typing import NamedTuple

import pytest

import vllm_tpu_lora
from vllm_tpu_lora.config import EngineArgs

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TEST_COMMAND = "python -m pytest -q -n 2 --dist loadfile tests"
INSTALL_COMMAND = 'pip install -e ".[torch_xla,dev,ray]" && vllm-tpu-lora demo'
SERVER_URL = "localhost:8000"


class Block(NamedTuple):
    lang: str
    code: str
    line: int

    @property
    def name(self) -> str:
        return f"README.md:{self.line}"

    def expected(self) -> list[str]:
        return [m.strip() for m in re.findall(r"#\s*->\s*(.+)$", self.code, re.M)]

    def is_server(self) -> bool:
        return self.lang == "sh" and self.code.lstrip().startswith("vllm-tpu-lora serve")


def readme_blocks() -> list[Block]:
    text = README.read_text()
    return [Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1)
            for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M)]


BLOCKS = readme_blocks()
RUN = [b for b in BLOCKS if b.lang in ("python", "sh")]


def _cli() -> list[str]:
    exe = shutil.which("vllm-tpu-lora", path=_env()["PATH"])
    return [exe] if exe else [sys.executable, "-m", "vllm_tpu_lora.entrypoints.cli"]


def _env() -> dict[str, str]:
    """This interpreter's bin first, so the blocks' `python` and `vllm-tpu-lora` are ours."""
    bin_dir = os.path.dirname(sys.executable)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}


@pytest.fixture(scope="module")
def shared_llm():
    real = vllm_tpu_lora.LLM
    engines: dict = {}

    def llm(model, **kwargs):
        key = (model, repr(sorted(kwargs.items())))
        if key not in engines:
            engines[key] = real(model, **kwargs)
        return engines[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_tpu_lora, "LLM", llm)
        yield engines


@pytest.fixture(scope="module")
def readme_server():
    from vllm_tpu_lora.testing.server import RemoteServer

    (block,) = [b for b in BLOCKS if b.is_server()]
    argv = shlex.split(block.code.replace("\\\n", " "), comments=True)
    with RemoteServer([], command=_cli() + argv[1:], env=_env()) as srv:
        yield srv


def _run_python(code: str, name: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
    return out.getvalue()


def _run_sh(code: str) -> str:
    if not shutil.which("vllm-tpu-lora", path=_env()["PATH"]):  # not pip-installed
        code = 'vllm-tpu-lora() { python -m vllm_tpu_lora.entrypoints.cli "$@"; }\n' + code
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True,
                          text=True, timeout=600, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.parametrize("block", RUN, ids=[b.name for b in RUN])
def test_readme_block_runs(block, shared_llm, request):
    if block.is_server():
        srv = request.getfixturevalue("readme_server")
        assert srv.stats()["num_graphs"] > 0
        return
    code = block.code
    if block.lang == "sh" and re.search(r"^curl ", code, re.M) and not shutil.which("curl"):
        pytest.skip("curl is not installed")
    if SERVER_URL in code:
        srv = request.getfixturevalue("readme_server")
        code = code.replace(SERVER_URL, f"127.0.0.1:{srv.port}")
    out = _run_python(code, block.name) if block.lang == "python" else _run_sh(code)
    for want in block.expected():
        assert want in out, f"{block.name} should print {want!r}; it printed:\n{out}"


def _commands(code: str):
    """Each `vllm-tpu-lora ...` command of a shell block, as its argument list."""
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        command: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", "||", ";"):
                if command[:1] == ["vllm-tpu-lora"]:
                    yield command[1:]
                command = []
            else:
                command.append(word)


def test_bash_block_commands_parse():
    from vllm_tpu_lora.entrypoints.cli import build_parser

    commands = [(b, c) for b in BLOCKS if b.lang == "bash" for c in _commands(b.code)]
    assert len(commands) >= 3  # the demo, serve with a model, serve-ray
    for block, argv in commands:
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{block.name}: `vllm-tpu-lora {shlex.join(argv)}` does not parse")


@pytest.mark.parametrize("script, prints", [
    ("offline_inference.py", ["'kitchen=' -> 'kitchen'", "'zebra=' -> 'zebra'"]),
    ("multi_lora_inference.py", ["upper: 'VIOLIN'", "reverse: 'niloiv'", "rot13: 'ivbyva'",
                                 "base: 'violin'"]),
])
def test_example_script_runs_on_the_demo_assets(script, prints, shared_llm, monkeypatch):
    path = ROOT / "examples" / script
    monkeypatch.setattr(sys, "argv", [str(path)])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(path), run_name="__main__")
    for want in prints:
        assert want in out.getvalue(), out.getvalue()


def test_install_and_test_commands_open_a_short_readme():
    lines = README.read_text().splitlines()
    assert len(lines) <= 400
    head = "\n".join(lines[:60])
    assert INSTALL_COMMAND in head and TEST_COMMAND in head
    # CI runs the same command with its venv's python.
    assert TEST_COMMAND.removeprefix("python") in (ROOT / ".ci" / "run").read_text()


def test_configuration_table_names_every_engine_argument():
    text = README.read_text()
    section = text[text.index("## Configuration"):]
    section = section[:section.index("\n## ", 1)]
    first_cells = re.findall(r"^\| ([^|]+) \|", section, re.M)
    named = {n for cell in first_cells[1:] for n in re.findall(r"`(\w+)`", cell)}
    fields = {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
    assert named == fields, f"missing {fields - named}, unknown {named - fields}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", ["README.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_resolve(doc):
    path = ROOT / doc
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"\w+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{doc}: {target} does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", dest.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{doc}: no heading for {target}"
