"""The lm-eval adapter (``anyquant_tools.lmeval``), run offline through lm-eval's own evaluator on local YAML tasks over a
local JSON file, on the bundled model: multiple choice (``loglikelihood``), generation (``generate_until``) and
perplexity (``loglikelihood_rolling``), which agrees with ``anyquant.perplexity`` on the same text."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

import anyquant

lm_eval = pytest.importorskip("lm_eval", reason="the lmeval extra (lm-eval==0.4.13) is not installed")

# llama.cpp 0.3.36 gives log p(" Paris" | "The capital of France is") = -0.2644 on the bundled Q4_1 model
# (anyquant: -0.2576 through its compiled GGUF kernel, -0.2779 through the torch path).
LLAMA_CPP_PARIS = -0.2644

DOCS = [
    {
        "text": (
            "Paris is the capital and most populous city of France. It is located on the Seine river, in the north "
            "of the country, at the heart of the Ile-de-France region. The city has been one of the world's major "
            "centres of finance, diplomacy, commerce, fashion and science since the seventeenth century. It is "
            "known for its museums and architectural landmarks: the Louvre received millions of visitors, and the "
            "Eiffel Tower, built for the 1889 World's Fair, became a symbol of the city and of the country."
        ),
        "question": "The capital of France is",
        "choices": [" Paris", " London", " Berlin"],
        "answer": 0,
        "target": " Paris",
    },
    {
        "text": (
            "Berlin is the capital and largest city of Germany, both by area and by population. It lies on the "
            "banks of the Spree and Havel rivers in the northeast of the country. The city was divided during the "
            "Cold War, and the wall that separated its eastern and western parts stood from 1961 until 1989. Today "
            "Berlin is known for its universities, research institutes, orchestras, museums and night life, and "
            "for its diverse architecture, from baroque palaces to modern glass towers."
        ),
        "question": "The capital of Germany is",
        "choices": [" Paris", " London", " Berlin"],
        "answer": 2,
        "target": " Berlin",
    },
]

TASKS = {
    "anyquant_ppl": """
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
""",
    "anyquant_mc": """
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
target_delimiter: ""
metric_list:
  - metric: acc
""",
    "anyquant_gen": """
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{target}}"
target_delimiter: ""
generation_kwargs:
  until: [".", "\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any]]:
    from lm_eval.tasks import TaskManager

    import anyquant_tools.lmeval

    root = tmp_path_factory.mktemp("tasks")
    (root / "data.json").write_text(json.dumps(DOCS))
    for name, body in TASKS.items():
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / 'data.json'}\n"
        (root / f"{name}.yaml").write_text(head + "test_split: test\n" + body)
    model = anyquant.load(anyquant.default_model())
    out = lm_eval.simple_evaluate(
        model=anyquant_tools.lmeval.AnyquantLM(model=model),
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(root)),
        log_samples=True,
    )
    return model, out


def test_multiple_choice_scores_through_loglikelihood(evaluated: tuple[Any, dict[str, Any]]) -> None:
    model, out = evaluated
    assert out["results"]["anyquant_mc"]["acc,none"] == 1.0
    france = next(s for s in out["samples"]["anyquant_mc"] if s["doc"]["answer"] == 0)
    scores = [r[0] for r in france["resps"]]
    alone = [model.loglikelihood([(DOCS[0]["question"], c)])[0] for c in DOCS[0]["choices"]]
    assert [s[0] for s in scores] == pytest.approx([a[0] for a in alone], abs=1e-4)  # a batch of 6 vs one each
    assert [s[1] for s in scores] == [a[1] for a in alone] == [True, False, False]
    assert scores[0][0] == pytest.approx(LLAMA_CPP_PARIS, abs=0.02) and scores[0][1] is True


def test_generate_until_is_complete_with_the_tasks_stops(evaluated: tuple[Any, dict[str, Any]]) -> None:
    model, out = evaluated
    assert out["results"]["anyquant_gen"]["exact_match,none"] == 1.0
    got = sorted(s["resps"][0][0] for s in out["samples"]["anyquant_gen"])
    assert got == [" Berlin", " Paris"]
    assert model.generate("The capital of Germany is", max_new_tokens=8, stop=[".", "\n"]) == " Berlin"


def test_perplexity_agrees_with_anyquant_eval(evaluated: tuple[Any, dict[str, Any]]) -> None:
    model, out = evaluated
    for sample in out["samples"]["anyquant_ppl"]:
        text = sample["doc"]["text"]
        (total,) = sample["resps"][0]
        assert total == pytest.approx(model.loglikelihood_rolling([text])[0], rel=1e-6)
        ids = model.tokenizer(text)["input_ids"]
        ours = anyquant.perplexity(model, text, window=len(ids))
        # rolling also scores the first token, from BOS (lm-eval's prefix token; here -19 and -15 nats, most of the
        # gap between the two perplexities); on the tokens both score they agree within a few percent (the rest
        # differs only by BOS in the context: 234.06 against 237.82, 276.48 against 275.96)
        ((first, _),) = model.loglikelihood([([model.tokenizer.bos_token_id], ids[:1])])
        assert -(total - first) == pytest.approx(ours["nll_sum"], rel=0.03)
        assert math.exp(-(total - first) / (len(ids) - 1)) == pytest.approx(ours["perplexity"], rel=0.05)
    words = sum(len(d["text"].split()) for d in DOCS)
    totals = [s["resps"][0][0] for s in out["samples"]["anyquant_ppl"]]
    assert out["results"]["anyquant_ppl"]["word_perplexity,none"] == pytest.approx(math.exp(-sum(totals) / words))


def test_registered_and_built_from_an_arg_string(tmp_path: Path) -> None:
    from lm_eval.api.registry import get_model

    import anyquant_tools.lmeval
    from anyquant.testing.tiny import make_tiny_dense

    assert get_model("anyquant") is anyquant_tools.lmeval.AnyquantLM
    path = make_tiny_dense(tmp_path / "m")
    lm = anyquant_tools.lmeval.AnyquantLM.create_from_arg_string(f"pretrained={path},batch_size=4,max_length=16")
    assert lm.batch_size == 4 and lm.max_length == 16 and lm.model.format == "dense"
    with pytest.raises(anyquant.ParameterError, match="not read by anyquant"):
        anyquant_tools.lmeval.generation_keywords({"until": ["x"], "num_beams": 4})
    assert anyquant_tools.lmeval.generation_keywords({"until": "x", "do_sample": True, "temperature": 0.5}) == {
        "stop": ["x"],
        "max_new_tokens": 256,
        "temperature": 0.5,
    }


def test_lm_eval_command_line_through_python_m(tmp_path: Path) -> None:
    """``python -m anyquant_tools.lmeval run --model anyquant ...`` is lm-eval's own CLI with the model registered (its
    ``lm-eval`` command alone cannot find it); the accuracy it prints comes from anyquant's loglikelihood."""
    import os
    import subprocess
    import sys

    (tmp_path / "data.json").write_text(json.dumps(DOCS))
    head = (
        f"task: anyquant_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'data.json'}\n"
    )
    (tmp_path / "anyquant_mc.yaml").write_text(head + "test_split: test\n" + TASKS["anyquant_mc"])
    out_dir = tmp_path / "out"
    args = ["run", "--model", "anyquant", "--model_args", f"pretrained={anyquant.default_model()},batch_size=4"]
    args += ["--tasks", "anyquant_mc", "--include_path", str(tmp_path), "--output_path", str(out_dir)]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "anyquant_tools.lmeval", *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = out_dir.rglob("results_*.json")
    assert json.loads(result.read_text())["results"]["anyquant_mc"]["acc,none"] == 1.0
    assert json.loads(result.read_text())["config"]["model"] == "anyquant"
    # issue #44 item 14: model_args' batch_size is the one used and printed (not lm-eval's default of 1), with
    # lm-eval's progress bar on stderr
    assert json.loads(result.read_text())["config"]["batch_sizes"] == [4]
    assert "batch_size: 4 (4)" in proc.stdout
    assert "Running loglikelihood requests" in proc.stderr and "6/6" in proc.stderr


def test_lm_eval_default_device_falls_back_but_an_explicit_one_is_strict(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    import anyquant_tools.lmeval
    from anyquant.testing.tiny import make_tiny_dense

    path = make_tiny_dense(tmp_path / "m")
    # lm-eval's CLI passes device="cuda:0" by default: anyquant picks the device instead, as lm-eval's HFLM does
    lm = anyquant_tools.lmeval.AnyquantLM.create_from_arg_obj({"pretrained": str(path)}, {"device": "cuda:0"})
    assert str(lm.model.device).startswith("cpu")
    with pytest.raises(anyquant.ParameterError, match="sees no CUDA"):
        anyquant_tools.lmeval.AnyquantLM.create_from_arg_obj({"pretrained": str(path), "device": "cuda:0"}, None)
