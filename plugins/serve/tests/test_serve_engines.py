"""The engine hand-off of ``anyquant serve`` (vLLM, exllamav3) and the commands ``advise`` prints: built from
detection on CPU, checked against vLLM's documented flags and against anyquant's own argument parser."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from anyquant import detect
from anyquant.errors import AnyquantError, MissingDependencyError
from anyquant.testing.fixtures import FIXTURES
from anyquant_serve.detected import vllm_command
from anyquant_tools.engines import VLLM_FLAGS, VLLM_VERSION, EngineError

#: the flags of ``vllm serve`` in vLLM 0.11.0's documentation (docs/cli/serve.md, "vllm serve --help=all"), as
#: written out by hand here: vLLM does not install without CUDA, so its parser cannot be asked on this machine
VLLM_0_11_DOCUMENTED = {
    "--host", "--port", "--api-key", "--served-model-name", "--tokenizer", "--dtype", "--max-model-len",
    "--quantization", "--tensor-parallel-size", "--pipeline-parallel-size", "--gpu-memory-utilization",
    "--max-num-seqs", "--kv-cache-dtype", "--distributed-executor-backend", "--trust-remote-code", "--revision",
    "--enable-prefix-caching", "--max-num-batched-tokens", "--data-parallel-size", "--seed", "--load-format",
    "--chat-template",  # the "Chat Template" section of its OpenAI-compatible server's page: a file or the text
}  # fmt: skip
VLLM_QUANTIZATION_CHOICES = {"awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors", "bitsandbytes", "fp8"}


def _fixture(tmp_path: Path, name: str) -> Path:
    return FIXTURES[name].build(tmp_path / name)


def _flags(argv: list[str]) -> dict[str, str | None]:
    assert argv[:2] == ["vllm", "serve"]
    out: dict[str, str | None] = {}
    rest = argv[3:]
    for i, arg in enumerate(rest):
        if arg.startswith("--"):
            value = rest[i + 1] if i + 1 < len(rest) and not rest[i + 1].startswith("--") else None
            out[arg] = value
    return out


def test_pinned_version_and_flags() -> None:
    assert VLLM_VERSION == "0.11.0"
    assert VLLM_FLAGS <= VLLM_0_11_DOCUMENTED


@pytest.mark.parametrize(
    ("fixture", "quantization", "dtype"),
    [
        ("gptq_v1", "gptq_marlin", "auto"),
        ("gptq_v2", "gptq_marlin", "auto"),
        ("awq_gemm", "awq_marlin", "float16"),
        ("compressed_tensors", "compressed-tensors", "auto"),
        ("dense", None, "auto"),
        ("gguf", None, "auto"),
    ],
)
def test_vllm_command_from_detection(tmp_path: Path, fixture: str, quantization: str | None, dtype: str) -> None:
    path = _fixture(tmp_path, fixture)
    plan = vllm_command(path, tensor_parallel_size=2, host="127.0.0.1", port=8001, served_model_name="m")
    argv = plan.argv()
    assert argv[2] == str(path)
    flags = _flags(argv)
    assert set(flags) <= VLLM_FLAGS
    assert flags.get("--quantization") == quantization
    if quantization is not None:
        assert quantization in VLLM_QUANTIZATION_CHOICES
    assert flags["--dtype"] == dtype and flags["--tensor-parallel-size"] == "2"
    assert flags["--served-model-name"] == "m" and flags["--port"] == "8001"
    if fixture != "gguf":
        config = json.loads((path / "config.json").read_text())
        want = config.get("max_position_embeddings")
        assert flags.get("--max-model-len") == (str(want) if want else None)
    assert shlex.split(plan.command()) == argv


@pytest.mark.parametrize("fixture", ["exl3_mul1", "exl2"])
def test_vllm_refuses_exllama_formats_with_the_way_out(tmp_path: Path, fixture: str) -> None:
    """EXL3: exllamav3's engine; EXL2: never exllamav3 (which refuses EXL2: advice that loops, #44 item 11) but the
    built-in server; both: the quantize way to vLLM."""
    path = _fixture(tmp_path, fixture)
    with pytest.raises(EngineError) as err:
        vllm_command(path)
    assert "anyquant quantize" in str(err.value)
    if fixture == "exl2":
        assert "--engine exllamav3" not in str(err.value) and f"`anyquant serve {path}`" in str(err.value)
    else:
        assert "--engine exllamav3" in str(err.value)


def _with_config(tmp_path: Path, fixture: str, **changes: Any) -> Path:
    path = _fixture(tmp_path, fixture)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    ("changes", "tp", "says"),
    [
        ({"num_attention_heads": 9, "num_key_value_heads": 9, "hidden_size": 9 * 16}, 2, "9 attention heads"),
        ({"num_attention_heads": 8, "num_key_value_heads": 3}, 2, "3 KV heads"),
        ({"num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 100}, 8, "intermediate_size 100"),
    ],
)
def test_tensor_parallel_that_vllm_refuses_is_refused_before_the_command(
    tmp_path: Path, changes: dict[str, Any], tp: int, says: str
) -> None:
    """A tensor-parallel size the heads, KV heads or MLP width do not divide over: refused naming the sizes (vLLM would
    refuse the printed command), with the sizes that fit (#44 item 11); KV heads fewer than GPUs replicate: fine."""
    path = _with_config(tmp_path, "dense", **changes)
    with pytest.raises(AnyquantError, match=rf"--tensor-parallel-size {tp}: .*{says}.*Sizes up to 8 that fit"):
        vllm_command(path, tensor_parallel_size=tp)
    run = _cli("serve", str(path), "--engine", "vllm", "--tensor-parallel-size", str(tp), "--print-command")
    assert run.returncode != 0 and says in run.stderr and "Traceback" not in run.stderr
    fine = _with_config(tmp_path / "ok", "dense", num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
    assert _flags(vllm_command(fine, tensor_parallel_size=8).argv())["--tensor-parallel-size"] == "8"


def test_group_quantized_shards_must_hold_whole_groups(tmp_path: Path) -> None:
    path = _fixture(tmp_path, "awq_gemm")
    config = json.loads((path / "config.json").read_text())
    group = config["quantization_config"]["group_size"]
    width = config["intermediate_size"]
    tp = next(n for n in (2, 4, 8, 16) if width % n == 0 and (width // n) % group)
    with pytest.raises(AnyquantError, match=rf"not whole groups of {group}"):
        vllm_command(path, tensor_parallel_size=tp)


def test_a_hub_id_with_a_revision_is_given_to_vllm_as_revision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve owner/name@BRANCH --engine vllm``: vLLM gets ``owner/name --revision BRANCH`` (``@BRANCH`` in the id is
    no model vLLM knows), and the served name is ``owner/name`` (``@refs/pr/1`` gave ``--served-model-name 1``)."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    commit = "a" * 40
    (repo / "snapshots").mkdir(parents=True)
    _fixture(tmp_path, "awq_gemm").rename(repo / "snapshots" / commit)
    for ref in ("refs/main", "refs/dev", "refs/pr/1"):
        (repo / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / ref).write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for rev in ("dev", "refs/pr/1"):
        run = _cli("serve", f"org/tiny@{rev}", "--engine", "vllm", "--print-command")
        assert run.returncode == 0, run.stderr
        argv = shlex.split(run.stdout.strip())
        flags = _flags(argv)
        assert argv[2] == "org/tiny" and flags["--revision"] == rev, argv
        assert flags["--served-model-name"] == "org/tiny"
        assert set(flags) <= VLLM_FLAGS
    plain = _flags(shlex.split(_cli("serve", "org/tiny", "--engine", "vllm", "--print-command").stdout.strip()))
    assert "--revision" not in plain and plain["--served-model-name"] == "org/tiny"


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "anyquant.cli", *argv], capture_output=True, text=True, timeout=120)


def test_serve_print_command(tmp_path: Path) -> None:
    path = _fixture(tmp_path, "awq_gemm")
    run = _cli("serve", str(path), "--engine", "vllm", "--tensor-parallel-size", "4", "--print-command")
    assert run.returncode == 0, run.stderr
    argv = shlex.split(run.stdout.strip())
    flags = _flags(argv)
    assert flags["--quantization"] == "awq_marlin" and flags["--tensor-parallel-size"] == "4"
    assert flags["--host"] == "127.0.0.1" and "--chat-template" not in flags
    refused = _cli("serve", str(_fixture(tmp_path, "exl3_mul1")), "--engine", "vllm", "--print-command")
    assert refused.returncode != 0 and "--engine exllamav3" in refused.stderr and "Traceback" not in refused.stderr
    # --chat-template goes to vLLM's own flag; the exllamav3 engine refuses it
    run = _cli("serve", str(path), "--engine", "vllm", "--chat-template", "tools.jinja", "--print-command")
    assert run.returncode == 0, run.stderr
    assert _flags(shlex.split(run.stdout.strip()))["--chat-template"] == "tools.jinja"
    refused = _cli("serve", str(path), "--engine", "exllamav3", "--chat-template", "tools.jinja")
    assert refused.returncode != 0 and "does not take --chat-template" in refused.stderr


def test_exllamav3_engine_refuses_without_cuda(tmp_path: Path) -> None:
    pytest.importorskip("starlette")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the refusal is for machines without one")
    run = _cli("serve", str(_fixture(tmp_path, "exl3_mul1")), "--engine", "exllamav3")
    assert run.returncode != 0 and "CUDA" in run.stderr and "Traceback" not in run.stderr
    wrong = _cli("serve", str(_fixture(tmp_path, "gptq_v1")), "--engine", "exllamav3")
    assert wrong.returncode != 0 and "EXL3" in wrong.stderr


def test_exllamav3_settings(tmp_path: Path) -> None:
    from anyquant_serve.exl3 import exl3_settings

    path = _fixture(tmp_path, "exl3_mul1")
    one = exl3_settings(path, max_batch=4, context=None, devices=[0])
    context = json.loads((path / "config.json").read_text()).get("max_position_embeddings", 8192)
    assert one["context"] == context and one["max_num_tokens"] % 256 == 0
    assert one["max_num_tokens"] >= context * 4 and one["load"] == {"tensor_p": False}
    assert exl3_settings(path, max_batch=4, context=2048, devices=[0, 1])["load"] == {"tensor_p": True}


def test_missing_http_stack_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from anyquant_serve.plugin import _need_http_stack

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sse_starlette" else real(name, *a)
    )
    with pytest.raises(MissingDependencyError, match=r"pip install anyquant-serve"):
        _need_http_stack()


def test_import_stays_light() -> None:
    code = (
        "import sys, anyquant, anyquant_serve, anyquant_tools.engines, anyquant_serve.plugin\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('starlette', 'uvicorn', 'sse_starlette', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------------- advise prints commands that run

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "tie_word_embeddings": False,
}  # fmt: skip
SITUATIONS = [
    ("RTX 4090", None, 1, 1),
    ("RTX 4090", None, 1, 2),
    ("RTX 4090", None, 8, 1),
    ("T4", None, 1, 1),
    ("CPU", 64, 1, 1),
    ("RTX A6000", 48, 1, 1),
    ("L40S", 48, 1, 1),
    ("RTX 4080", 48, 1, 1),
    ("MI300X", 48, 1, 1),
    ("Some Future GPU", 48, 2, 1),
]


def _models(tmp_path: Path) -> dict[str, Path]:
    import anyquant

    folder = tmp_path / "llama-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA))
    return {
        "config": folder / "config.json",
        "gguf": Path(anyquant.default_model()),
        "gptq": _fixture(tmp_path, "gptq_v1"),
        "exl3": _fixture(tmp_path, "exl3_mul1"),
    }


def _check_runs(command: str, model: Path, made: set[str], parser: Any) -> None:
    argv = shlex.split(command, comments=True)
    if argv[:2] == ["vllm", "serve"]:
        assert set(_flags(argv)) <= VLLM_FLAGS, command
        assert argv[2] in made or Path(argv[2]).exists(), command
        return
    if argv[0] != "anyquant":
        return  # llama.cpp's tools
    try:
        args = parser.parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"advise printed a command anyquant's parser refuses: {command}")
    if argv[1] == "quantize":
        src = Path(args.src if hasattr(args, "src") else argv[2])
        try:
            fmt = detect(src).format
        except AnyquantError:  # a folder with only config.json: the unquantized model's place
            fmt = "dense"
        assert fmt == "dense", f"advise asks to quantize a {fmt} checkpoint: {command}"
        made.add(argv[3])
    elif argv[1] in ("serve", "generate"):
        assert argv[2] in made or Path(argv[2]).exists(), f"{command}: serves what no earlier command made"


def test_advise_prints_only_commands_that_run(tmp_path: Path) -> None:
    from anyquant.cli import build_parser
    from anyquant_tools.advise import advise

    parser = build_parser()
    for label, model in _models(tmp_path).items():
        for gpu, vram, users, gpus in SITUATIONS:
            a = advise(gpu, vram, users, model, gpus, context=4096)
            assert a.commands or not a.fits, (label, gpu)
            made: set[str] = {str(model.parent if model.suffix == ".json" else model)}
            for command in a.commands:
                if command.startswith("llama-quantize"):
                    made.add(shlex.split(command)[-2])
                _check_runs(command, model, made, parser)


def test_advise_gpu_name_is_a_label_with_vram() -> None:
    from anyquant_tools.advise import GPUS, advise, find_gpu
    from anyquant_tools.estimate import SizingError

    for name in ("RTX A6000", "L40S", "RTX 4080", "MI300X", "NVIDIA RTX A6000", "AMD Instinct MI300X"):
        assert find_gpu(name).name in {g.name for g in GPUS}  # in the table: known without --vram
        assert advise(name, 48, 1, LLAMA).vram_gb == 48
    a = advise("Some Future GPU", 48, 1, LLAMA)
    assert a.vram_gb == 48 and "not in anyquant's GPU table" in a.reasons[0]
    with pytest.raises(SizingError, match="--vram"):
        advise("Some Future GPU", None, 1, LLAMA)


def test_exllamav3_engine_refuses_what_it_cannot_do() -> None:
    """``--engine exllamav3``'s jobs generate at least one token (exllamav3 asserts ``max_new_tokens >= 1``) and
    report no log-probabilities: ``echo`` with ``max_tokens: 0`` and ``echo`` with ``logprobs`` are a 400 naming the
    parameter, decided from the engine's declared abilities before any prompt is read. ``n`` choices run as
    separate exllamav3 jobs, accepted up to what its queue takes at once (more is a 400 naming ``n``)."""
    pytest.importorskip("starlette")
    from anyquant_serve.app import ApiError, ServerConfig, _job, _Server
    from anyquant_serve.exl3 import Exl3Scheduler

    engine = object.__new__(Exl3Scheduler)  # its class's declared abilities; the engine itself needs CUDA
    engine.adapter, engine.max_queue = None, 4
    server = _Server(engine, ServerConfig("m"))
    for body, param in (
        ({"echo": True, "max_tokens": 0}, "max_tokens"),
        ({"n": 5, "max_tokens": 4}, "n"),  # more choices than its queue takes at once
        ({"echo": True, "max_tokens": 4, "logprobs": 1}, "logprobs"),
    ):
        with pytest.raises(ApiError) as refused:
            _job(server, {"model": "m", "prompt": "Hello", **body}, chat=False)
        assert refused.value.status == 400 and refused.value.param == param
