"""``import anyquant`` does nothing: no torch, no plugin discovery, no logging config."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_is_light() -> None:
    r = _run(
        "import sys, logging, anyquant\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "assert 'anyquant.registry' not in sys.modules\n"
        "assert not logging.getLogger().handlers\n"
        "anyquant.Claim; anyquant.AnyquantError\n"
        "assert 'torch' not in sys.modules\n"
    )
    assert r.returncode == 0, r.stderr


def test_detect_does_not_import_torch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from anyquant.testing.fixtures import FIXTURES

    root = FIXTURES["gptq_v2"].build(tmp_path / "m")
    r = _run(
        f"import sys, anyquant\nd = anyquant.detect({str(root)!r})\nassert d.format == 'gptq'\n"
        "heavy = [m for m in ('torch', 'transformers', 'numpy', 'gptqmodel') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    assert r.returncode == 0, r.stderr


def test_int4_base_is_lazy() -> None:
    """``import anyquant`` leaves core's int4 loader base out; the base (what the GPTQ and AWQ loaders import)
    imports neither torch nor GPTQModel until a load asks for them."""
    r = _run(
        "import sys, anyquant\nassert 'anyquant_runtime.int4' not in sys.modules\n"
        "from anyquant_runtime.int4.loader import Int4Loader\nfrom anyquant_tools.gptqmodel_quantizer import GPTQModelQuantizer\n"
        "heavy = [m for m in ('torch', 'transformers', 'gptqmodel') if m in sys.modules]\nassert not heavy, heavy\n"
    )
    assert r.returncode == 0, r.stderr


def test_cli_help_is_fast_and_light() -> None:
    r = _run(
        "import sys; from anyquant.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\nassert 'torch' not in sys.modules"
    )
    assert r.returncode == 0, r.stderr


def test_all_is_a_literal_list_of_every_export(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Type checkers read ``__all__`` only as a literal; `mypy --strict` refused `sdk.load` ("does not
    explicitly export") when it was built from _EXPORTS."""
    import os
    import subprocess
    import sys

    import anyquant

    assert anyquant.__all__ == ["__version__", *anyquant._EXPORTS]
    user = tmp_path / "user.py"
    user.write_text(
        "import anyquant as sdk\nfrom anyquant import CheckpointError, Registry, load\n\n\n"
        "def main(path: str) -> str:\n    model = sdk.load(path)\n    return model.generate('Hi')\n"
    )
    env = {**os.environ, "MYPYPATH": ""}
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--follow-imports=silent", str(user)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert "does not explicitly export" not in out.stdout, out.stdout


USER_TYPED = """
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict

import torch

import anyquant as sdk
from anyquant import Prompt, Report
from anyquant.hookspecs import CalibrationRegistrar, CommandRegistrar
from anyquant.protocols import Quantizer, QuantizeSpec


class Message(TypedDict):
    role: str
    content: str | None


def prompts() -> Iterator[str]:
    yield "a"
    yield "b"


def main(path: Path) -> list[str]:
    report: Report = sdk.inspect(path)
    print(report)
    model = sdk.load(path, dtype=torch.bfloat16, device=torch.device("cpu"))
    messages: list[Message] = [{"role": "user", "content": "Hi"}]
    p: Prompt = messages
    print(model.generate(p, max_new_tokens=4, stop="."))
    return model.generate_batch(prompts(), temperature=0.5, seed=1)


class MyQuantizer:
    method = "myq"

    def quantize(self, src: Path, dst: Path, spec: QuantizeSpec, progress: object) -> Path:
        return dst


class Strict:
    @property
    def method(self) -> str:
        return "myq"

    def quantize(self, src: Path, dst: Path, spec: QuantizeSpec, progress: object) -> Path:
        return dst


quantizers: list[Quantizer] = [MyQuantizer(), Strict()]


def hooks(register: CalibrationRegistrar, cli: CommandRegistrar) -> None:
    register("mine", lambda n, seq_len, seed: ["text"] * n)
    cli.add_command("hello", "say hello", lambda parser: None, lambda args: 0)
"""


def test_the_public_api_type_checks_as_a_user_writes_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """From a typing audit: generation keywords were ``**kwargs: Any`` (mypy passed ``max_tokens=5``), a
    list of TypedDict messages or a generator of prompts was refused, ``torch.bfloat16``/``torch.device``/
    ``os.PathLike`` were refused by ``load``'s types though they run, the protocols refused a quantizer with
    a ``ClassVar``/property ``method`` or no ``progress`` default, and the hook arguments were untyped."""
    import os
    import subprocess
    import sys

    good = tmp_path / "good.py"
    good.write_text(USER_TYPED)
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import anyquant as sdk\n\n\ndef main(path: str) -> str:\n"
        "    return sdk.load(path).generate('Hi', max_tokens=5)\n"
    )
    env = {**os.environ, "MYPYPATH": ""}
    cmd = [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--follow-imports=silent"]
    out = subprocess.run([*cmd, str(good)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout
    out = subprocess.run([*cmd, str(bad)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert 'Unexpected keyword argument "max_tokens"' in out.stdout, out.stdout


def test_generation_keywords_are_the_params_fields() -> None:
    from dataclasses import fields

    from anyquant import GenerationKwargs, GenerationParams

    assert list(GenerationKwargs.__annotations__) == [f.name for f in fields(GenerationParams)]


def test_fixtures_need_no_pytest(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``anyquant.testing.fixtures`` (standard library only, plugins.md sends third parties there) failed to
    import without pytest, because the package imported the conformance kit eagerly."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['pytest'] = None\n"
        "from anyquant.testing.fixtures import write_safetensors\n"
        f"write_safetensors(__import__('pathlib').Path({str(tmp_path / 'x.safetensors')!r}), {{'x': ('U8', (4, 4))}})\n"
        "import anyquant.testing as t\n"
        "try:\n    t.PluginConformance\nexcept ImportError:\n    print('kit needs pytest')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "kit needs pytest", out.stderr


def test_public_type_hints_resolve_without_torch() -> None:
    """Hosts that read annotations at run time (typing.get_type_hints, inspect.signature(eval_str=True):
    CLI and web frameworks, docs tools) resolve every public function's hints; only torch's own types
    need torch, passed in by the host, which has it. Resolving them imports no torch."""
    r = _run(
        "import inspect, sys, typing, anyquant\n"
        "bad = []\n"
        "for name in anyquant.__all__:\n"
        "    obj = getattr(anyquant, name)\n"
        "    funcs = [obj] if inspect.isfunction(obj) else []\n"
        "    if inspect.isclass(obj) and obj.__module__.startswith('anyquant'):\n"
        "        funcs += [f for _, f in inspect.getmembers(obj, inspect.isfunction) if f.__module__.startswith('anyquant')]\n"
        "    for f in funcs:\n"
        "        try:\n"
        "            typing.get_type_hints(f)\n"
        "        except NameError as exc:\n"
        "            bad.append((f.__qualname__, exc.name))\n"
        "assert 'torch' not in sys.modules, 'resolving hints imported torch'\n"
        "need_torch = {q for q, n in bad if n in ('torch', 'nn')}\n"
        "assert {q for q, _ in bad} - need_torch == set(), bad  # Loader.load too: LoadedModel is in protocols\n"
        "assert 'load' in need_torch\n"
        "import torch\n"
        "from torch import nn\n"
        "for q in need_torch:\n"
        "    owner, _, attr = q.rpartition('.')\n"
        "    f = getattr(getattr(anyquant, owner), attr) if owner else getattr(anyquant, q)\n"
        "    typing.get_type_hints(f, localns={'torch': torch, 'nn': nn})\n"
        "hints = typing.get_type_hints(anyquant.load, localns={'torch': torch})\n"
        "assert hints['return'].__name__ == 'LoadedModel', hints\n"
        "assert typing.get_type_hints(anyquant.inspect)['return'].__name__ == 'Report'\n"
    )
    assert r.returncode == 0, r.stderr
