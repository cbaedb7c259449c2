"""Model ids and bucket URLs wherever a model path is taken (finetune, infer, plan).

A Hub stand-in (tests/hubserver.py) serves tiny random models on 127.0.0.1; HF_ENDPOINT
and the HF cache point at it and a temp dir, so nothing here reaches huggingface.co.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hubserver import HubServer
from shoestring.cli import main
from shoestring.infer.fixtures import build_random_model

REPO = Path(__file__).resolve().parents[1]
TOKEN = "hf_test_token"
STEPS = [
    "--train.batch_size",
    "2",
    "--train.num_threads",
    "1",
    "--train.warmup_steps",
    "1",
    "--checkpoint.every_steps",
    "2",
    "--data.max_length",
    "32",
    "--data.eval",
    "",
]


def _model(root: Path, seed: int) -> Path:
    m = build_random_model(root, "llama", hidden=64, ffn=128, layers=2, seed=seed, shard="60KB")
    (m / "pytorch_model.bin").write_bytes(b"a pickle that must never be downloaded")
    return m


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hub-models")
    return _model(root / "v1", 1), _model(root / "v2", 2)


@pytest.fixture(scope="module")
def server(models: tuple[Path, Path]) -> Iterator[HubServer]:
    with HubServer() as hub:
        tiny = hub.repo("org/tiny")
        tiny.refs["v1"] = tiny.add_commit(models[0])
        hub.repo("org/gated").token = TOKEN
        hub.repo("org/gated").add_commit(models[0])
        yield hub


@pytest.fixture
def env(
    server: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Path | str]:
    """This process's environment for ``main``: the stand-in Hub, a fresh HF cache."""
    import huggingface_hub.constants as hfc

    for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_HOME", "SHOESTRING_FAULTS"):
        monkeypatch.delenv(name, raising=False)
    vals: dict[str, Path | str] = {
        "HF_ENDPOINT": server.url,
        "HF_HUB_CACHE": tmp_path / "hf",
        "SHOESTRING_CACHE": tmp_path / "cache",
    }
    for k, v in vals.items():
        monkeypatch.setenv(k, str(v))
    # huggingface_hub read the environment at import: never the real Hub from here.
    monkeypatch.setattr(hfc, "ENDPOINT", server.url)
    template = server.url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(hfc, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setattr(hfc, "HF_HUB_OFFLINE", False)
    return vals


def _finetune(
    out: Path, model: str, steps: int, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    capsys.readouterr()
    code = main(
        [
            "finetune",
            "--output_dir",
            str(out),
            "--model.path",
            model,
            "--train.max_steps",
            str(steps),
            *STEPS,
        ]
    )
    return code, capsys.readouterr().err


def _error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if "error:" in x]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def _prompts(path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("alpha beta", "gamma")))
    return path


def _infer(model: str, inp: Path, out: Path, *extra: str) -> list[str]:
    args = ["infer", "--model", model, "--input", str(inp), "--output", str(out)]
    args += ["--threads", "1", "--job.progress", "off", "--max-new-tokens", "4", *extra]
    assert main(args) == 0
    return [json.loads(x)["completion"] for x in out.read_text().splitlines()]


def _downloaded(server: HubServer, name: str) -> int:
    """GETs of ``name`` ("file", or "org/repo/file" for one repo's)."""
    if "/" not in name:
        return sum(1 for r in server.requests if r.startswith("GET ") and r.endswith("/" + name))
    repo, file = name.rsplit("/", 1)
    return sum(
        1
        for r in server.requests
        if r.startswith(f"GET /{repo}/resolve/") and r.endswith("/" + file)
    )


# --------------------------------------------------------------------------- finetune


def test_finetune_by_id_records_the_commit_and_a_moved_branch_is_refused_on_resume(
    server: HubServer,
    models: tuple[Path, Path],
    env: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    repo = server.repo("org/moving")
    c1 = repo.add_commit(models[0])
    out = tmp_path / "run"
    code, err = _finetune(out, "org/moving", 2, capsys)
    assert code == 0, err[-3000:]
    assert json.loads((out / "run.json").read_text())["model"] == {
        "source": "hub",
        "ref": "org/moving",
        "commit": c1,
    }
    manifest = json.loads((out / "checkpoints" / "step-00000002" / "manifest.json").read_text())
    assert manifest["meta"]["base_source"]["commit"] == c1
    snapshot = env["HF_HUB_CACHE"] / "models--org--moving" / "snapshots" / c1
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(
        p.name for p in models[0].iterdir() if p.suffix != ".bin"
    )
    assert _downloaded(server, "pytorch_model.bin") == 0

    c2 = repo.add_commit(models[1])  # main moves to other weights
    before = {p: p.read_bytes() for p in (out / "run.json", out / "events.jsonl")}
    code, err = _finetune(out, "org/moving", 4, capsys)
    line = _error_line(err)
    assert code == 2 and c1 in line and c2 in line and f"--model.path org/moving@{c1}" in line
    assert {p: p.read_bytes() for p in before} == before  # nothing written

    code, err = _finetune(out, f"org/moving@{c1}", 4, capsys)  # pinned: the same weights
    assert code == 0, err[-3000:]
    resumed = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "resume" and e["from_step"] == 2 for e in resumed)


# --------------------------------------------------------------------------- infer


def test_infer_by_id_revision_and_adapter_id_match_the_local_folders(
    server: HubServer,
    models: tuple[Path, Path],
    env: dict[str, Any],
    tmp_path: Path,
) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(models[0])),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False),
    )
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(str(adapter))
    server.repo("org/adapter").add_commit(adapter)
    inp = _prompts(tmp_path / "in.jsonl")
    local = _infer(str(models[0]), inp, tmp_path / "a.jsonl")
    by_tag = _infer("org/tiny@v1", inp, tmp_path / "b.jsonl")
    assert by_tag == local
    record = json.loads((tmp_path / "b.jsonl.run" / "run.json").read_text())
    assert record["identity"]["model_source"]["commit"] == server.repo("org/tiny").refs["v1"]
    with_local = _infer(str(models[0]), inp, tmp_path / "c.jsonl", "--adapter", str(adapter))
    with_id = _infer("org/tiny", inp, tmp_path / "d.jsonl", "--adapter", "org/adapter")
    assert with_id == with_local != local


def test_offline_after_caching_makes_no_request(
    server: HubServer, env: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import huggingface_hub.constants as hfc

    inp = _prompts(tmp_path / "in.jsonl")
    online = _infer("org/tiny", inp, tmp_path / "a.jsonl")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hfc, "HF_HUB_OFFLINE", True)
    seen = len(server.requests)
    assert _infer("org/tiny", inp, tmp_path / "b.jsonl") == online
    assert main(["plan", "--model", "org/tiny", "--device", "cpu"]) in (0, 1)
    assert server.requests[seen:] == []


# --------------------------------------------------------------------------- plan


def test_plan_reads_only_config_json_and_counts_a_prequantized_base(
    server: HubServer, models: tuple[Path, Path], env: dict[str, Any], tmp_path: Path
) -> None:
    from shoestring.hub import HubAccess
    from shoestring.plan.workload import PlanRequest, resolve_request

    cfg = json.loads((models[0] / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
    }
    pre = tmp_path / "bnb"
    pre.mkdir()
    (pre / "config.json").write_text(json.dumps(cfg))
    server.repo("org/tiny-bnb-4bit").add_commit(pre)
    seen = len(server.requests)
    hub = HubAccess(tmp_path / "cache", hf_cache=env["HF_HUB_CACHE"], endpoint=server.url)
    plain = resolve_request(PlanRequest(model="org/tiny", gpu="T4"), hub=hub).workload
    got = resolve_request(PlanRequest(model="org/tiny-bnb-4bit", gpu="T4"), hub=hub).workload
    asked = [r.split(" ")[1].rsplit("/", 1)[-1] for r in server.requests[seen:]]
    assert set(asked) == {"config.json"}  # never a weight file
    assert (plain.method, plain.quantize) == ("lora", "none")
    assert (got.method, got.quantize) == ("qlora", "nf4")
    assert got.arch.params == plain.arch.params
    from shoestring.config import ConfigError

    with pytest.raises(ConfigError, match="pre-quantized"):
        resolve_request(PlanRequest(model="org/tiny-bnb-4bit", method="full"), hub=hub)


def test_infer_streams_a_prequantized_base_from_the_hub(
    server: HubServer, models: tuple[Path, Path], env: dict[str, Any], tmp_path: Path
) -> None:
    pytest.importorskip("bitsandbytes")
    from test_infer_prequant import save_4bit

    pre = save_4bit(models[0], tmp_path / "bnb", "nf4", True)  # a *-bnb-4bit repo
    commit = server.repo("org/tiny-bnb-4bit").add_commit(pre)
    inp = _prompts(tmp_path / "i.jsonl")
    by_id = _infer("org/tiny-bnb-4bit", inp, tmp_path / "a.jsonl")
    assert by_id == _infer(str(pre), inp, tmp_path / "b.jsonl")
    record = json.loads((tmp_path / "a.jsonl.run" / "run.json").read_text())
    assert record["identity"]["model_source"]["commit"] == commit


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("spec", "extra", "needles"),
    [
        ("org/nope", {}, ("Hub model org/nope not found", "HF_TOKEN")),
        ("org/gated", {}, ("org/gated is gated", "HF_TOKEN")),
        ("org/tiny@nobranch", {}, ("org/tiny has no revision 'nobranch'", "branch, tag or commit")),
        ("org/tiny", {"HF_ENDPOINT": "http://127.0.0.1:9"}, ("cannot reach", "HF_HUB_OFFLINE=1")),
        ("org/tiny", {"HF_HUB_OFFLINE": "1"}, ("org/tiny is not in the local", "HF_HUB_OFFLINE")),
        ("/nowhere/model", {}, ("'/nowhere/model' is not a directory, a Hub id",)),
    ],
    ids=["not-found", "gated", "revision", "no-network", "offline-empty", "no-dir"],
)
def test_each_error_is_one_line_exit_2_and_nothing_is_written(
    spec: str,
    extra: dict[str, str],
    needles: tuple[str, ...],
    env: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for k, v in extra.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "run"
    code, err = _finetune(out, spec, 2, capsys)
    line = _error_line(err)
    assert code == 2 and line.startswith("shoestring finetune: error: model.path: "), line
    for needle in needles:
        assert needle in line, line
    assert not out.exists()


def test_a_token_opens_a_gated_repo(
    env: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert main(["plan", "--model", "org/gated", "--device", "cpu"]) in (0, 1)
    assert "error" not in capsys.readouterr().err


# --------------------------------------------------------------------------- a kill


@pytest.mark.e2e
def test_a_download_killed_mid_file_completes_on_rerun(
    server: HubServer, models: tuple[Path, Path], env: dict[str, Any], tmp_path: Path
) -> None:
    """huggingface_hub's own recovery: files that completed are kept (never fetched
    again); the file cut mid-way is fetched again (2.4 downloads to a per-process temp
    file, so a new process restarts that file), and the result is byte-exact."""
    server.repo("org/killed").add_commit(models[0])
    shards = sorted(models[0].glob("*.safetensors"), key=lambda p: p.stat().st_size)
    slow, size = f"org/killed/{shards[-1].name}", shards[-1].stat().st_size
    server.throttle[slow] = size / 4  # ~4 s for this file; the others come at once
    script = (
        "from pathlib import Path; from shoestring.hub import HubAccess, resolve; "
        f"resolve('org/killed', HubAccess(Path({str(tmp_path)!r}), hf_cache=Path({str(env['HF_HUB_CACHE'])!r}), "
        f"endpoint={server.url!r}), key='model.path')"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"},
    )
    try:
        deadline = time.time() + 60
        while server.sent.get(slow, 0) < size // 3:
            assert child.poll() is None and time.time() < deadline, "the download ended early"
            time.sleep(0.02)
    finally:
        child.kill()
        child.wait(10)
    server.throttle.pop(slow)
    assert server.sent[slow] < size  # killed in the middle of the file
    from shoestring.hub import HubAccess, resolve

    hub = HubAccess(tmp_path, hf_cache=env["HF_HUB_CACHE"], endpoint=server.url)
    ref = resolve("org/killed", hub, key="model.path")
    for name in [p.name for p in shards] + ["config.json", "tokenizer.json"]:
        got = hashlib.sha256((ref.path / name).read_bytes()).hexdigest()
        assert got == hashlib.sha256((models[0] / name).read_bytes()).hexdigest(), name
    assert _downloaded(server, slow) == 2
    assert all(_downloaded(server, f"org/killed/{p.name}") == 1 for p in shards[:-1])


# --------------------------------------------------------------------------- buckets


def test_a_bucket_url_is_copied_once_with_sha256_checks(
    s3_server: Any,
    models: tuple[Path, Path],
    env: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    client = s3_server.client()
    for p in models[0].iterdir():
        client.put_object(Bucket=s3_server.bucket, Key=f"models/tiny/{p.name}", Body=p.read_bytes())
    url = s3_server.url("models/tiny")
    inp = _prompts(tmp_path / "in.jsonl")
    assert _infer(url, inp, tmp_path / "a.jsonl") == _infer(
        str(models[0]), inp, tmp_path / "b.jsonl"
    )
    (copy,) = [p for p in (env["SHOESTRING_CACHE"] / "models").iterdir() if p.is_dir()]
    manifest = json.loads((copy / "manifest.json").read_text())
    assert "pytorch_model.bin" not in manifest["files"]
    assert (
        manifest["files"]["config.json"]["sha256"]
        == hashlib.sha256((models[0] / "config.json").read_bytes()).hexdigest()
    )
    committed = (copy / "manifest.json").stat().st_mtime_ns
    _infer(url, inp, tmp_path / "c.jsonl")
    assert (copy / "manifest.json").stat().st_mtime_ns == committed  # reused, not copied again

    # A folder that carries a manifest: a file whose bytes differ from it is refused.
    published = {
        "format": "shoestring-checkpoint/1",
        "step": 0,
        "meta": {},
        "files": {"config.json": {"size": 1, "sha256": "0" * 64}},
    }
    client.put_object(
        Bucket=s3_server.bucket, Key="models/tiny/manifest.json", Body=json.dumps(published)
    )
    capsys.readouterr()
    out = tmp_path / "d.jsonl"
    assert main(["infer", "--model", url, "--input", str(inp), "--output", str(out)]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "config.json: sha256 differs" in line and "models/tiny" in line
