"""Device and precision resolution, and the placement check of everything a step touches."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shoestring.config import ConfigError, load
from shoestring.train.config import FinetuneConfig
from shoestring.train.device import Accelerator, Precision, resolve
from shoestring.train.placement import misplaced
from shoestring.train.resume import resume
from shoestring.train.run import Inputs, RunOptions, open_run
from shoestring.train.step import MisplacedTensorError, check_placement, train_step
from shoestring.train.strategy import SingleDevice
from shoestring.train.trainer import Trainer, build_trainer

CPU = Accelerator()
T4x2 = Accelerator(cuda_devices=2, bf16=False, name="Tesla T4")
A100 = Accelerator(cuda_devices=1, bf16=True, name="NVIDIA A100-SXM4-80GB")


def _cfg(*over: str) -> FinetuneConfig:
    return load(FinetuneConfig, None, list(over))  # type: ignore[no-any-return]


def test_auto_resolves_per_machine() -> None:
    cpu = resolve(_cfg(), CPU, 0)
    assert (cpu.train.device, cpu.train.precision, cpu.model.dtype) == ("cpu", "fp32", "float32")
    t4 = resolve(_cfg(), T4x2, 1)
    assert (t4.train.device, t4.train.precision, t4.model.dtype) == ("cuda:1", "fp16", "float16")
    a100 = resolve(_cfg(), A100, 0)
    assert (a100.train.device, a100.train.precision, a100.model.dtype) == (
        "cuda:0",
        "bf16",
        "bfloat16",
    )
    pinned = resolve(
        _cfg("--train.device", "cuda:0", "--train.precision", "fp32", "--model.dtype", "float32"),
        T4x2,
        1,
    )
    assert (pinned.train.device, pinned.train.precision, pinned.model.dtype) == (
        "cuda:0",
        "fp32",
        "float32",
    )


@pytest.mark.parametrize(
    "over,acc,key",
    [
        (["--train.device", "cuda"], CPU, "train.device"),
        (["--train.device", "cuda:2"], T4x2, "train.device"),
        (["--train.precision", "fp16"], CPU, "train.precision"),
        (["--model.attn_implementation", "flash_attention_2"], CPU, "model.attn_implementation"),
    ],
)
def test_impossible_device_choices_are_refused_naming_the_key(
    over: list[str], acc: Accelerator, key: str
) -> None:
    with pytest.raises(ConfigError, match=key):
        resolve(_cfg(*over), acc, 0)


def test_device_spelling_is_checked_when_the_config_is_read() -> None:
    with pytest.raises(ConfigError, match="train.device"):
        _cfg("--train.device", "gpu")


def test_precision_autocast_and_scaler() -> None:
    cpu = torch.device("cpu")
    assert Precision("fp32", cpu).make_scaler() is None
    assert Precision("bf16", cpu).make_scaler() is None
    with Precision("bf16", cpu).autocast():
        y = torch.ones(4, 4) @ torch.ones(4, 4)
    assert y.dtype == torch.bfloat16
    with Precision("fp32", cpu).autocast():
        assert (torch.ones(4, 4) @ torch.ones(4, 4)).dtype == torch.float32


@contextlib.contextmanager
def _trainer(tmp: Path, cache: Path, *over: str) -> Iterator[Trainer]:
    cfg = resolve(
        _cfg(
            "--output_dir",
            str(tmp),
            "--train.max_steps",
            "2",
            "--train.batch_size",
            "4",
            "--data.max_length",
            "32",
            "--data.eval",
            "",
            "--watch.enabled",
            "false",
            "--train.num_threads",
            "1",
            *over,
        ),
        CPU,
        0,
    )
    opts = RunOptions(resume="never", cache_dir=cache, tty=False)
    inputs = Inputs.prepare(cfg, opts.dist, opts.cache_dir)
    with open_run(cfg, opts, inputs.remote) as run:
        yield build_trainer(cfg, run, inputs)


def test_everything_a_step_touches_is_on_the_strategy_device(
    tmp_path: Path, cache_dir: Path
) -> None:
    with _trainer(tmp_path / "run", cache_dir) as t:
        assert isinstance(t.run.strategy, SingleDevice) and t.device == torch.device("cpu")
        progress = resume(t, "never")
        seen: set[torch.device] = set()
        batch_devices = _record_devices(seen)
        with batch_devices:
            train_step(t, progress)
        assert seen == {t.device}  # every tensor every op of the step read or wrote
        assert t.learner.optimizer.state  # the first step created the state it checked
        assert misplaced(t.device, t.learner.model, t.learner.optimizer) == []


def test_a_tensor_left_on_another_device_stops_the_run(tmp_path: Path, cache_dir: Path) -> None:
    with _trainer(tmp_path / "run", cache_dir) as t:
        progress = resume(t, "never")
        train_step(t, progress)
        name, p = next(iter(t.learner.params.items()))
        owner, attr = name.rsplit(".", 1)
        setattr(
            t.learner.model.get_submodule(owner), attr, torch.nn.Parameter(p.detach().to("meta"))
        )
        state = next(iter(t.learner.optimizer.state.values()))
        state["exp_avg"] = state["exp_avg"].to("meta")
        batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long, device="meta")}
        wrong = misplaced(t.device, t.learner.model, t.learner.optimizer, batch)
        assert any(w.startswith(name) for w in wrong)
        assert any(w.startswith("optimizer.state") and "exp_avg" in w for w in wrong)
        assert "batch.input_ids on meta" in wrong
        with pytest.raises(MisplacedTensorError, match=name):
            check_placement(t, batch)


def _record_devices(seen: set[torch.device]) -> contextlib.AbstractContextManager[None]:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class DeviceLog(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            for x in tree_flatten((args, kwargs, out))[0]:
                if isinstance(x, torch.Tensor) and x.dim() > 0:
                    seen.add(x.device)
            return out

    return DeviceLog()
