"""Config: every key documented, bad keys/values named with file:line or the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoestring.cli import main
from shoestring.config import ConfigError, help_table, iter_fields, load
from shoestring.train.config import FinetuneConfig, config_hash


def test_defaults_and_required_keys_exist() -> None:
    keys = {k for k, _f, _t in iter_fields(FinetuneConfig)}
    required = {
        "model.path",
        "data.train",
        "data.eval",
        "output_dir",
        "train.max_steps",
        "train.seed",
        "train.batch_size",
        "train.micro_batch_size",
        "train.lr",
        "lora.r",
        "checkpoint.every_steps",
        "checkpoint.every_seconds",
        "checkpoint.keep",
        "checkpoint.storage",
    }
    assert required <= keys


def test_every_key_is_in_help() -> None:
    table = help_table(FinetuneConfig)
    for key, f, _t in iter_fields(FinetuneConfig):
        assert f"--{key} " in table
        assert f.metadata["help"] in table


def test_yaml_then_flags(tmp_path: Path) -> None:
    y = tmp_path / "c.yaml"
    y.write_text("train:\n  lr: 0.01\n  max_steps: 7\nlora:\n  r: 4\n")
    cfg = load(
        FinetuneConfig, str(y), ["--train.lr", "2e-4", "--lora.target_modules=q_proj,v_proj"]
    )
    assert cfg.train.lr == 2e-4 and cfg.train.max_steps == 7 and cfg.lora.r == 4
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]


def test_unknown_yaml_key_names_file_and_line(tmp_path: Path) -> None:
    y = tmp_path / "c.yaml"
    y.write_text("train:\n  lr: 0.01\n  max_stepz: 7\n")
    with pytest.raises(
        ConfigError,
        match=r"c\.yaml:3: unknown key 'train\.max_stepz' "
        r"\(did you mean 'train\.max_steps'\?\)",
    ):
        load(FinetuneConfig, str(y), [])


def test_bad_yaml_value_names_file_line_and_key(tmp_path: Path) -> None:
    y = tmp_path / "c.yaml"
    y.write_text("output_dir: x\ncheckpoint:\n  keep: 0\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:3: 'checkpoint\.keep' must be > 0"):
        load(FinetuneConfig, str(y), [])
    y.write_text("train:\n  batch_size: lots\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:2: 'train\.batch_size' expects an integer"):
        load(FinetuneConfig, str(y), [])


def test_invalid_yaml_syntax_names_line(tmp_path: Path) -> None:
    y = tmp_path / "c.yaml"
    y.write_text("train:\n  lr: [1,\n  x: 2\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:\d+: invalid YAML"):
        load(FinetuneConfig, str(y), [])


def test_bad_flag_value_names_flag() -> None:
    with pytest.raises(ConfigError, match=r"--train\.lr: 'train\.lr' expects a number"):
        load(FinetuneConfig, None, ["--train.lr", "fast"])
    with pytest.raises(ConfigError, match=r"--checkpoint\.async_mode: .*must be one of"):
        load(FinetuneConfig, None, ["--checkpoint.async_mode", "maybe"])
    with pytest.raises(ConfigError, match=r"--lora\.rr: unknown key"):
        load(FinetuneConfig, None, ["--lora.rr", "4"])
    with pytest.raises(ConfigError, match=r"--train\.lr: missing value"):
        load(FinetuneConfig, None, ["--train.lr"])


def test_config_hash_ignores_resume_safe_keys() -> None:
    a = load(FinetuneConfig, None, [])
    b = load(
        FinetuneConfig,
        None,
        ["--train.max_steps", "999", "--checkpoint.keep", "5", "--output_dir", "elsewhere"],
    )
    c = load(FinetuneConfig, None, ["--train.lr", "1e-5"])
    assert config_hash(a) == config_hash(b) != config_hash(c)


def test_cli_bad_config_fails_fast_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    y = tmp_path / "c.yaml"
    y.write_text("model:\n  path: builtin:tiny\n  dtipe: float32\n")
    rc = main(["finetune", "--config", str(y), "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "c.yaml:3: unknown key 'model.dtipe'" in err
    assert not (tmp_path / "out").exists()  # nothing started


def test_cli_missing_model_dir_names_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        ["finetune", "--model.path", str(tmp_path / "nope"), "--output_dir", str(tmp_path / "out")]
    )
    assert rc == 2
    assert "model.path:" in capsys.readouterr().err


def test_help_lists_keys(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    out = capsys.readouterr().out
    assert "--checkpoint.storage" in out and "--resume" in out and "75" in out


def test_shipped_configs_are_valid() -> None:
    configs = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))
    assert configs
    for c in configs:
        cfg = load(FinetuneConfig, str(c), [])
        assert cfg.output_dir.startswith("runs/")
