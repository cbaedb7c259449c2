"""One argument system for every verb: YAML + flags, Literal choices, aliases, checks."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from shoestring.cli import VERBS, Verb, main, verb_help
from shoestring.config import ArgSpec, ConfigError, build, iter_fields, load, parse_command_line
from shoestring.report.cli import ReportConfig
from shoestring.supervise.config import RunConfig, SlurmConfig
from shoestring.supervise.supervisor import Supervisor, SupervisorConfig
from shoestring.train.config import FinetuneConfig, Quantize


@pytest.fixture
def supervised(monkeypatch: pytest.MonkeyPatch) -> list[Supervisor]:
    """``shoestring run`` up to the restart loop: the Supervisor it would run."""
    seen: list[Supervisor] = []
    monkeypatch.setattr(Supervisor, "run", lambda self: seen.append(self) or 0)
    return seen


def test_run_yaml_bad_key_names_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    y = tmp_path / "run.yaml"
    y.write_text("nproc_per_node: 1\nhang_flor: 5\n")
    assert main(["run", "--config", str(y), "--", "true"]) == 2
    assert f"{y}:2: unknown key 'hang_flor' (did you mean 'hang_floor'?)" in capsys.readouterr().err


def test_run_yaml_values_and_flags_reach_the_supervisor(
    tmp_path: Path, supervised: list[Supervisor]
) -> None:
    y = tmp_path / "run.yaml"
    y.write_text("max_restarts: 7\nhang_floor: 4\nslurm_requeue: never\ncommand: [echo, hi]\n")
    assert main(["run", "--config", str(y), "--hang-floor", "6", "--job-id", "j1"]) == 0
    (sup,) = supervised
    assert sup.argv == ["echo", "hi"]
    assert (sup.cfg.max_restarts, sup.cfg.hang.floor_s, sup.cfg.slurm_requeue, sup.cfg.job) == (
        7,
        6.0,
        "never",
        "j1",
    )


def test_run_value_out_of_range_names_the_flag_or_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--hang-floor", "0", "--", "true"]) == 2
    assert "--hang-floor: 'hang_floor' must be > 0; got 0.0" in capsys.readouterr().err
    assert main(["run", "--prometheus-port", "70000", "--", "true"]) == 2
    assert "--prometheus-port: 'prometheus_port' must be in 0..65535" in capsys.readouterr().err
    assert main(["run", "--alert-webhook", "ftp://x", "--", "true"]) == 2
    assert "--alert-webhook: 'alert_webhook' must be an http(s) URL" in capsys.readouterr().err
    y = tmp_path / "run.yaml"
    y.write_text("\nnproc_per_node: 0\n")
    assert main(["run", "--config", str(y), "--", "true"]) == 2
    assert f"{y}:2: 'nproc_per_node' must be >= 1; got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, watch",
    [
        ([], True),
        (["--no-watch"], False),
        (["--watch", "false"], False),
        (["--watch"], True),
        (["--no-watch", "--watch", "true"], True),
    ],
)
def test_no_watch_is_watch_false(
    flags: list[str], watch: bool, supervised: list[Supervisor]
) -> None:
    assert main(["run", *flags, "--", "true"]) == 0
    assert supervised[0].cfg.watch is watch


def test_a_switch_takes_no_value_when_negated(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--no-watch=1", "--", "true"]) == 2
    assert "--no-watch: takes no value" in capsys.readouterr().err


def test_the_command_starts_at_the_first_bare_word(supervised: list[Supervisor]) -> None:
    assert main(["run", "--no-watch", "python", "-c", "pass", "--max-restarts", "1"]) == 0
    assert supervised[0].argv == ["python", "-c", "pass", "--max-restarts", "1"]
    assert supervised[0].cfg.max_restarts == 3


def test_supervisor_config_from_run_config() -> None:
    cfg = build(RunConfig, [])
    sc = SupervisorConfig.from_run(cfg, {"SLURM_JOB_ID": "42"})
    assert sc == SupervisorConfig(job="42")  # the run defaults are the supervisor defaults


def test_literal_choices_come_from_the_type(tmp_path: Path) -> None:
    fields = {k: (f, tp) for k, f, tp in iter_fields(FinetuneConfig)}
    f, tp = fields["lora.quantize"]
    assert tp == Quantize and "choices" not in f.metadata
    with pytest.raises(
        ConfigError,
        match=r"^--lora\.quantize: 'lora\.quantize' must be one "
        r"of none, nf4, int8; got 'x'$",
    ):
        load(FinetuneConfig, None, ["--lora.quantize", "x"])
    y = tmp_path / "c.yaml"
    y.write_text("checkpoint:\n  async_mode: off\n  interval: often\n")
    with pytest.raises(
        ConfigError,
        match=r"c\.yaml:3: 'checkpoint\.interval' must be one of "
        r"fixed, auto; got 'often'",
    ):
        load(FinetuneConfig, str(y), [])  # 'off' (a YAML 1.1 boolean) is read as typed


def test_plan_uses_the_same_choices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-3-8b", "--quantize", "nf5"]) == 2
    assert (
        f"must be one of {', '.join(typing.get_args(Quantize))}; got 'nf5'"
        in capsys.readouterr().err
    )


def test_slurm_passes_finetune_flags_on_and_repeats_sbatch_args() -> None:
    spec = VERBS["slurm"]
    assert isinstance(spec, Verb)
    p = parse_command_line(
        [
            "--config",
            "c.yaml",
            "--data.packing",
            "--nodes",
            "2",
            "--sbatch-arg=--mem=1G",
            "--train.lr=1e-4",
            "--sbatch-arg",
            "--exclusive",
            "--no-eval.exact_match",
        ],
        SlurmConfig,
        spec.args,
    )
    assert p.rest == ["--data.packing", "--train.lr=1e-4", "--no-eval.exact_match"]
    cfg = build(SlurmConfig, p.layers)
    assert (cfg.config, cfg.nodes, cfg.sbatch_arg) == ("c.yaml", 2, ["--mem=1G", "--exclusive"])


def test_positional_alias_and_missing_value() -> None:
    spec = ArgSpec(positional="run_dir", aliases={"-o": "output"})
    p = parse_command_line(["-o", "x.html", "runs/a"], ReportConfig, spec)
    assert build(ReportConfig, p.layers) == ReportConfig(run_dir="runs/a", output="x.html")
    with pytest.raises(ConfigError, match="unexpected argument 'runs/b'"):
        parse_command_line(["runs/a", "runs/b"], ReportConfig, spec)
    with pytest.raises(ConfigError, match="-o: missing value"):
        parse_command_line(["runs/a", "-o"], ReportConfig, spec)


@pytest.mark.parametrize("name", [n for n, v in VERBS.items() if isinstance(v, Verb)])
def test_every_verb_lists_its_keys_in_help(name: str) -> None:
    verb = VERBS[name]
    assert isinstance(verb, Verb)
    text = verb_help(name, verb)
    flat = all("." not in k for k, _f, _tp in iter_fields(verb.config))
    for key, _f, _tp in iter_fields(verb.config):
        assert f"--{key.replace('_', '-') if flat else key} " in text


def test_run_help_shows_the_documented_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--nproc-per-node",
        "--max-restarts",
        "--run-dir",
        "--watch",
        "--hang-floor",
        "--prometheus-port",
        "--alert-webhook",
        "--nccl-dump-wait",
        "COMMAND",
    ):
        assert flag in out


def test_stray_arguments_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "-n", "2", "--", "true"]) == 2
    assert "-n: unknown flag" in capsys.readouterr().err
    assert main(["finetune", "--", "x"]) == 2
    assert "unexpected argument '--'" in capsys.readouterr().err
    assert main(["finetune", "--train.lr", "1e-3", "extra"]) == 2
    assert "unexpected argument 'extra'" in capsys.readouterr().err


def test_slurm_keys_from_their_own_yaml(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cfg.yaml").write_text("output_dir: run\n")
    (tmp_path / "cluster.yaml").write_text("nodes: 2\ngpus_per_node: 4\nsbatch_arg: [--mem=8G]\n")
    monkeypatch.chdir(tmp_path)
    assert (
        main(
            [
                "slurm",
                "--slurm-config",
                "cluster.yaml",
                "--config",
                "cfg.yaml",
                "--sbatch-arg=--exclusive",
                "--train.max_steps",
                "5",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --mem=8G",
        "#SBATCH --exclusive",
    ):
        assert line in out
    assert "--train.max_steps 5" in out
    (tmp_path / "cluster.yaml").write_text("nodes: 2\ngpus: 4\n")
    assert main(["slurm", "--slurm-config", "cluster.yaml", "--config", "cfg.yaml"]) == 2
    assert "cluster.yaml:2: unknown key 'gpus'" in capsys.readouterr().err


def test_help_after_the_command_belongs_to_the_command(supervised: list[Supervisor]) -> None:
    assert main(["run", "--no-watch", "--", "python", "--help"]) == 0
    assert supervised[0].argv == ["python", "--help"]
    assert main(["run", "python", "-h"]) == 0
    assert supervised[1].argv == ["python", "-h"]


@pytest.mark.parametrize(
    "prefix",
    [["shoestring"], ["/opt/venv/bin/shoestring"], ["python3", "-m", "shoestring"]],
    ids=["entry-point", "path", "python-m"],
)
def test_run_watches_a_finetune_commands_output_dir_without_run_dir(
    tmp_path: Path, supervised: list[Supervisor], monkeypatch: pytest.MonkeyPatch, prefix: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    y = tmp_path / "ft.yaml"
    y.write_text("output_dir: from-yaml\n")
    cases = [
        (["--output_dir", "out/a"], tmp_path / "out" / "a"),
        (["--output_dir=abs"], tmp_path / "abs"),
        (["--config", str(y), "--lora.r", "4"], tmp_path / "from-yaml"),
        (["--resume", "never"], tmp_path / FinetuneConfig().output_dir),
    ]
    for args, want in cases:
        assert main(["run", "--nproc-per-node", "1", "--", *prefix, "finetune", *args]) == 0
        sup = supervised.pop()
        assert sup.cfg.run_dir == want.resolve() and sup.cfg.watch, args


def test_run_without_run_dir_leaves_other_commands_unwatched(
    supervised: list[Supervisor], caplog: pytest.LogCaptureFixture
) -> None:
    assert main(["run", "--", "python3", "train.py", "--output_dir", "x"]) == 0
    assert supervised.pop().cfg.run_dir is None
    assert "not watching: COMMAND is not `shoestring finetune`" in caplog.text
    assert main(["run", "--no-watch", "--", "shoestring", "finetune", "--output_dir", "y"]) == 0
    sup = supervised.pop()
    assert sup.cfg.run_dir is None and not sup.cfg.watch  # --no-watch: nothing derived


def test_bitsandbytes_hub_kernel_notice_is_dropped_and_nothing_else(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """bitsandbytes says at import (CPUs with AVX512-BF16) that it could not fetch a Hub
    kernel, which shoestring never fetches: the CLI drops that one record, as bitsandbytes
    logs it, and lets its logger's other warnings through."""
    import logging

    from shoestring.hf import HubKernelNotice

    assert main(["plan", "--list-gpus"]) == 0
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    assert any(isinstance(f, HubKernelNotice) for f in log.filters)
    with caplog.at_level(logging.WARNING):
        log.warning(
            "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make "
            "sure you already `pip install kernels` and the kernels >= 0.11.1",
            RuntimeError("could not verify publisher trust status"),
        )
        log.warning("another bitsandbytes warning")
    assert [r.getMessage() for r in caplog.records] == ["another bitsandbytes warning"]
