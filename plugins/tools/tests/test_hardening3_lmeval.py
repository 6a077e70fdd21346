"""Issue #44 item 14: the lm-eval adapter shows a progress bar (tqdm, as lm-eval's own HF model does) unless
lm-eval passes ``disable_tqdm=True``, and honours and reports the batch size it was given (``model_args``'
``batch_size=8`` is not overridden by lm-eval's default of 1). A stand-in for the loaded model records the
batches it is given: the adapter's own behaviour, without a model."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("lm_eval", reason="the lmeval extra (lm-eval==0.4.13) is not installed")

from lm_eval.api.instance import Instance

import anyquant_tools.lmeval
from anyquant_tools.lmeval import AnyquantLM


class _Model:
    """What AnyquantLM calls on a LoadedModel, recording each call's size and batch size."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int | None]] = []

    def loglikelihood(self, pairs: list[tuple[str, str]], *, batch_size: int = 8) -> list[tuple[float, bool]]:
        self.calls.append(("loglikelihood", len(pairs), batch_size))
        return [(-float(len(c) + len(x)), len(x) < 3) for c, x in pairs]

    def loglikelihood_rolling(self, texts: list[str], *, window: int | None = None, batch_size: int = 8) -> list[float]:
        self.calls.append(("rolling", len(texts), batch_size))
        return [-float(len(t)) for t in texts]

    def complete(self, prompt: str, **kwargs: Any) -> Any:
        self.calls.append(("complete", 1, None))
        return type("R", (), {"text": prompt[-3:]})()


def _requests(kind: str, n: int) -> list[Instance]:
    out = []
    for i in range(n):
        if kind == "loglikelihood":
            args: tuple[Any, ...] = (f"context {i} " + "x" * (i % 7), f" c{i % 5}")
        elif kind == "loglikelihood_rolling":
            args = (f"text {i} " + "y" * (i % 11),)
        else:
            args = (f"prompt {i}", {"until": ["."], "max_gen_toks": 4})
        out.append(Instance(request_type=kind, doc={}, arguments=args, idx=i))
    return out


@pytest.fixture(autouse=True)
def _tqdm_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TQDM_DISABLE", raising=False)


@pytest.mark.parametrize("kind", ["loglikelihood", "loglikelihood_rolling", "generate_until"])
def test_a_progress_bar_unless_disable_tqdm(kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    model = _Model()
    lm = AnyquantLM(model=model, batch_size=8)  # type: ignore[arg-type]
    requests = _requests(kind, 120)
    answers = getattr(lm, kind)(requests)
    err = capsys.readouterr().err
    assert "120/120" in err and kind in err  # lm-eval's own wording: "Running <kind> requests"
    assert getattr(lm, kind)(requests, disable_tqdm=True) == answers
    assert "120/120" not in capsys.readouterr().err


def test_answers_keep_the_requests_order_whatever_the_batches() -> None:
    model = _Model()
    lm = AnyquantLM(model=model, batch_size=8)  # type: ignore[arg-type]
    requests = _requests("loglikelihood", 120)
    assert lm.loglikelihood(requests) == [(-float(len(c) + len(x)), len(x) < 3) for c, x in (r.args for r in requests)]
    rolling = _requests("loglikelihood_rolling", 30)
    assert lm.loglikelihood_rolling(rolling) == [-float(len(r.args[0])) for r in rolling]


def test_the_batch_size_given_is_the_one_used() -> None:
    model = _Model()
    lm = AnyquantLM(model=model, batch_size=8)  # type: ignore[arg-type]
    lm.loglikelihood(_requests("loglikelihood", 120))
    sizes = [(n, b) for kind, n, b in model.calls if kind == "loglikelihood"]
    assert {b for _, b in sizes} == {8} and sum(n for n, _ in sizes) == 120
    assert lm.batch_size == 8 and list(lm.batch_sizes.values()) == [8]  # what lm-eval reports (HFLM's names)


def test_model_args_batch_size_wins_over_lm_evals_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = _Model()
    monkeypatch.setattr("anyquant.api.load", lambda *a, **k: model)
    # lm-eval's command line always passes its --batch_size (default 1) beside model_args
    lm = AnyquantLM.create_from_arg_string("pretrained=x,batch_size=8", {"batch_size": 1, "device": None})
    assert lm.batch_size == 8
    lm = AnyquantLM.create_from_arg_obj({"pretrained": "x"}, {"batch_size": 4})
    assert lm.batch_size == 4  # lm-eval's own --batch_size when model_args names none
    lm = AnyquantLM.create_from_arg_obj({"pretrained": "x", "batch_size": "16"}, {"batch_size": None})
    assert lm.batch_size == 16


def test_the_command_line_reports_the_batch_size_of_model_args() -> None:
    """``python -m anyquant_tools.lmeval run ... --model_args ...,batch_size=8`` prints ``batch_size: 8``: lm-eval prints its
    own --batch_size (default 1), so the adapter's command line passes the one model_args names."""
    argv = anyquant_tools.lmeval._cli_argv(["run", "--model", "anyquant", "--model_args", "pretrained=x,batch_size=8"])
    assert argv[argv.index("--batch_size") + 1] == "8"
    argv = anyquant_tools.lmeval._cli_argv(["run", "--model_args", "pretrained=x,batch_size=8", "--batch_size", "2"])
    assert argv.count("--batch_size") == 1 and argv[argv.index("--batch_size") + 1] == "2"  # an explicit one stays
    argv = anyquant_tools.lmeval._cli_argv(["run", "--model_args=pretrained=x,batch_size=8", "-b", "2"])
    assert "--batch_size" not in argv
    argv = anyquant_tools.lmeval._cli_argv(["run", "--model_args=pretrained=x,batch_size=4"])
    assert argv[argv.index("--batch_size") + 1] == "4"
    assert anyquant_tools.lmeval._cli_argv(["run", "--model_args", "pretrained=x"]) == [
        "run",
        "--model_args",
        "pretrained=x",
    ]
