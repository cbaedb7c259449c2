"""SkyPilot: a managed-job task of a fine-tune, so a preempted spot run comes back.

Finding a new spot machine after the old one is taken is SkyPilot's work (managed
jobs, ``sky jobs launch``); surviving the preemption inside the job is shoestring's.
This module connects the two, as :mod:`shoestring.supervise.slurm` does for Slurm:

    preemption      the cloud's notice (watched by ``preempt/``) or the shutdown's
                    SIGTERM -> the step ends, an emergency checkpoint is committed and
                    published to checkpoint.storage, exit 75
    SkyPilot        sees the cluster preempted (or the job's exit 75/76:
                    ``recover_on_exit_codes``), finds another machine among the GPUs
                    offered, runs ``setup`` and ``run`` again
    new machine     an empty disk: ``--resume auto`` fetches the newest checkpoint from
                    the bucket; the event logs of earlier attempts come from
                    ``<storage>/events/`` (:mod:`shoestring.checkpoint.attemptlog`), so the
                    cost ledger at the end covers every attempt

The task YAML is SkyPilot's own format (``sky/utils/schemas.py``): ``resources.ordered``
(the GPUs, cheapest first), ``use_spot``, ``job_recovery`` (``strategy``,
``max_restarts_on_errors``, ``recover_on_exit_codes``), ``workdir`` (the source checkout
this shoestring runs from, installed by ``setup``), ``envs``, ``secrets`` (names only: a
null value is resolved at launch from ``--secret NAME``), ``setup``, ``run``.
SkyPilot is not imported here: it pins ``click<8.2``, which shoestring's huggingface-hub
cannot use, so it lives in an environment of its own and is run as a program.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from shoestring import __version__, exitcodes
from shoestring.config import ConfigError
from shoestring.gpus import CATALOG, GPU, find_gpu
from shoestring.secrets import redact_text

if TYPE_CHECKING:
    from shoestring.config import Invocation
    from shoestring.hub import HubAccess
    from shoestring.supervise.config import LaunchConfig
    from shoestring.train.config import FinetuneConfig

__all__ = [
    "TaskSpec",
    "cheapest_fitting",
    "render",
    "run_launch",
    "sky_command",
    "spec_from_config",
]

log = logging.getLogger("shoestring.launch")

#: The catalog's GPU names as SkyPilot's accelerator names (``sky show-gpus``).
SKY_ACCELERATORS = {
    "T4": "T4",
    "L4": "L4",
    "A10G": "A10G",
    "A100-40GB": "A100",
    "A100-80GB": "A100-80GB",
    "H100": "H100",
    "H200": "H200",
    "RTX3090": "RTX3090",
    "RTX4090": "RTX4090",
}

#: Credentials a fine-tune may need, passed as secrets when set where launch runs.
KNOWN_SECRETS = ("HF_TOKEN", "WANDB_API_KEY", "SHOESTRING_ALERT_WEBHOOK")

#: Names that are credentials: refused as plain ``envs`` (they would be in the YAML).
_CREDENTIAL_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_?KEY|ACCESS_KEY|AUTH")

#: What SkyPilot recovers on whatever max_restarts_on_errors says: preempted, checkpointed.
RECOVER_ON = sorted(exitcodes.RESUMABLE)

#: The VM-side names: the job's working folder holds the config and the run directory.
CONFIG_NAME = "finetune.yaml"
_EOF = "SHOESTRING_CONFIG_EOF"

INSTALL_HINT = (
    "SkyPilot is not installed here. It cannot share shoestring's environment (it pins "
    "click<8.2; huggingface-hub needs a newer click), so install it apart: "
    "`pipx install skypilot` (or a venv of its own) and run `sky check`; then pass "
    "--sky PATH/TO/sky if it is not on PATH. Without --yes, launch writes the task YAML "
    "for `sky jobs launch` to submit."
)


@dataclass(frozen=True)
class Offer:
    """One GPU offered to SkyPilot, and why (the plan's peak memory and spot price)."""

    gpu: GPU
    peak_gib: float | None = None  # None: asked for by name, not planned

    @property
    def accelerator(self) -> str:
        return SKY_ACCELERATORS[self.gpu.name]

    def note(self, spot: bool) -> str:
        price = self.gpu.spot_usd_h if spot else self.gpu.on_demand_usd_h
        fit = f"plan: {self.peak_gib:.1f} GiB of " if self.peak_gib is not None else ""
        return (
            f"{self.accelerator}: {fit}{self.gpu.memory_bytes / 2**30:.0f} GiB, "
            f"${price:.3f}/h {'spot' if spot else 'on-demand'} "
            f"({self.gpu.price_source}, {self.gpu.price_date})"
        )


@dataclass(frozen=True)
class TaskSpec:
    """Everything the task YAML says."""

    name: str
    offers: tuple[Offer, ...]
    finetune_yaml: str  # the resolved finetune config, written on the VM by `run`
    storage: str
    use_spot: bool = True
    recovery: str = "EAGER_NEXT_REGION"
    max_restarts_on_errors: int = 0
    install: str = f"shoestring[s3,gcs]=={__version__}"
    workdir: str = ""  # a local folder SkyPilot syncs to the VM; setup runs in it
    envs: Mapping[str, str] = field(default_factory=dict)
    secrets: tuple[str, ...] = ()


# --------------------------------------------------------------------------- the task


def default_install(package_file: str = __file__) -> tuple[str, str]:
    """What the setup installs when ``--install`` is not given, and from where:
    run from a source checkout (the package's tree holds the project's pyproject.toml),
    SkyPilot syncs the checkout as the task's ``workdir`` (what .gitignore or a
    .skyignore leaves out stays here) and setup installs it, so the VM runs this
    code; installed from a wheel, setup installs this version from the index."""
    root = Path(package_file).resolve().parents[3]
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and 'name = "shoestring"' in pyproject.read_text(encoding="utf-8"):
        return ".[s3,gcs]", str(root)
    return TaskSpec.install, ""


def setup_script(spec: TaskSpec) -> str:
    """Installs shoestring on a new machine (SkyPilot runs it before every ``run``)."""
    req = " ".join(shlex.quote(a) for a in shlex.split(spec.install))
    return f"set -euo pipefail\npython -m pip install --upgrade {req}\n"


def run_script(spec: TaskSpec) -> str:
    """Writes the finetune config and ``exec``s the fine-tune: the exit code and the
    signals are shoestring's own (0 done, 2 bad config, 75/76 preempted)."""
    cmd = [
        "shoestring",
        "finetune",
        "--config",
        CONFIG_NAME,
        "--checkpoint.storage",
        spec.storage,
        "--resume",
        "auto",
    ]
    return (
        "set -euo pipefail\n"
        f"cat > {CONFIG_NAME} <<'{_EOF}'\n{spec.finetune_yaml.rstrip()}\n{_EOF}\n"
        f"exec {' '.join(map(shlex.quote, cmd))}\n"
    )


def task_document(spec: TaskSpec) -> dict[str, Any]:
    """The task as SkyPilot's YAML fields (``sky/utils/schemas.py``)."""
    resources: dict[str, Any] = {
        "use_spot": spec.use_spot,
        "job_recovery": {
            "strategy": spec.recovery,
            "max_restarts_on_errors": spec.max_restarts_on_errors,
            "recover_on_exit_codes": RECOVER_ON,
        },
        "ordered": [{"accelerators": {o.accelerator: 1}} for o in spec.offers],
    }
    doc: dict[str, Any] = {"name": spec.name, "resources": resources}
    if spec.workdir:
        doc["workdir"] = spec.workdir
    if spec.envs:
        doc["envs"] = dict(spec.envs)
    if spec.secrets:
        doc["secrets"] = {name: None for name in spec.secrets}  # values: --secret NAME
    doc["setup"] = setup_script(spec)
    doc["run"] = run_script(spec)
    return doc


class _Literal(str):
    """A multi-line string dumped as a YAML block (``|``): scripts stay readable."""


def _literal(dumper: yaml.SafeDumper, s: _Literal) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|")


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Literal, _literal)


def render(spec: TaskSpec) -> str:
    """The task YAML, with a comment saying why these GPUs."""
    doc = task_document(spec)
    doc["setup"], doc["run"] = _Literal(doc["setup"]), _Literal(doc["run"])
    body = yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=1000)
    why = "\n".join(f"#   {o.note(spec.use_spot)}" for o in spec.offers)
    secrets = (
        f"# Secrets (values never written here): sky jobs launch ... "
        f"{' '.join('--secret ' + s for s in spec.secrets)}\n"
        if spec.secrets
        else ""
    )
    return (
        "# Generated by `shoestring launch`. Submit with: sky jobs launch THIS_FILE\n"
        f"# GPUs in order of preference (cheapest first):\n{why}\n{secrets}{body}"
    )


# --------------------------------------------------------------------------- the GPUs


def cheapest_fitting(
    ft: FinetuneConfig, hub: HubAccess | None, *, count: int, spot: bool
) -> list[Offer]:
    """The ``count`` cheapest GPUs of the catalog on which ``shoestring plan`` says the
    config fits (one GPU), cheapest first; ConfigError when none does."""
    from shoestring.plan.estimate import make_plan
    from shoestring.plan.workload import arch_for, workload_from_config

    try:
        arch = arch_for(ft.model.path, "model.path", hub)
    except ConfigError as e:  # e.g. a mixture of experts, which the plan cannot size
        raise ConfigError(f"{e}; name the GPUs to launch on (--gpu, repeated for more)") from None
    fitting = []
    for gpu in CATALOG.values():
        workload, _steps = workload_from_config(ft, arch, 1, device="cuda", gpu=gpu)
        plan = make_plan(workload, gpu)
        if plan.fits:
            fitting.append(Offer(gpu, plan.peak_bytes / 2**30))
    if not fitting:
        raise ConfigError(
            f"the plan says this config fits none of the catalog's GPUs ({', '.join(CATALOG)});"
            " see `shoestring plan --config ...` for what to change"
        )
    price = (lambda o: o.gpu.spot_usd_h) if spot else (lambda o: o.gpu.on_demand_usd_h)
    return sorted(fitting, key=price)[:count]


def named_offers(names: Sequence[str]) -> list[Offer]:
    offers = []
    for name in names:
        try:
            offers.append(Offer(find_gpu(name)))
        except KeyError as e:
            raise ConfigError(f"gpu: {e.args[0]}") from None
    return offers


# --------------------------------------------------------------------------- the config


def check_storage(storage: str) -> str:
    """checkpoint.storage must survive the machine: a bucket URL, without credentials."""
    if "://" not in storage or storage.startswith("file://"):
        raise ConfigError(
            f"checkpoint.storage: {storage!r} is not a bucket URL; a new machine after a "
            "preemption starts with an empty disk and resumes from the bucket "
            "(e.g. --checkpoint.storage s3://BUCKET/runs/NAME)"
        )
    if redact_text(storage) != storage:
        raise ConfigError(
            "checkpoint.storage: the URL carries a credential, which would be written into "
            "the task YAML; give the cloud's credentials to the machine instead"
        )
    return storage


def _vm_config(ft: FinetuneConfig, spot: bool) -> tuple[FinetuneConfig, str]:
    """The config the VM runs: output_dir relative to the job's folder, the market the
    ledger charges; as YAML of the keys that differ from the defaults, refused if writing
    it down would have to drop a credential."""
    from shoestring.config import to_flat
    from shoestring.hub import looks_remote
    from shoestring.secrets import redact
    from shoestring.train.builtin import BUILTIN_MODEL
    from shoestring.train.config import FinetuneConfig

    if ft.model.path != BUILTIN_MODEL and not looks_remote(ft.model.path):
        raise ConfigError(
            f"model.path: {ft.model.path!r} is a folder on this machine; the job's machine "
            "needs a Hub id (org/name[@revision]) or a bucket URL"
        )
    vm = replace(
        ft,
        output_dir=Path(ft.output_dir).name or "run",
        cost=replace(ft.cost, market="spot" if spot else "on_demand"),
    )
    defaults = to_flat(FinetuneConfig())
    changed: dict[str, Any] = {}
    for key, value in to_flat(vm).items():
        if value != defaults[key] or key == "output_dir":
            section = changed
            *parents, leaf = key.split(".")
            for part in parents:
                section = section.setdefault(part, {})
            section[leaf] = value
    if redact(changed) != changed:
        raise ConfigError(
            "the finetune config carries a credential in a URL, which would be written into "
            "the task YAML; pass it as a secret (--secret NAME) instead"
        )
    text = yaml.safe_dump(changed, sort_keys=False)
    if _EOF in text:
        raise ConfigError(f"the finetune config contains the line {_EOF!r}")
    return vm, text


def _envs(names: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    out = {}
    for name in names:
        if _CREDENTIAL_NAME.search(name.upper()):
            raise ConfigError(f"env: {name} looks like a credential; pass it with --secret {name}")
        if name not in env:
            raise ConfigError(f"env: {name} is not set in this environment")
        out[name] = env[name]
    return out


def _secrets(names: Sequence[str], env: Mapping[str, str]) -> tuple[str, ...]:
    chosen = list(dict.fromkeys([*names, *(n for n in KNOWN_SECRETS if env.get(n))]))
    missing = [n for n in chosen if n not in env]
    if missing:
        raise ConfigError(
            f"secret: {', '.join(missing)} not set in this environment "
            "(sky jobs launch --secret NAME reads the value from it)"
        )
    return tuple(chosen)


def spec_from_config(
    cfg: LaunchConfig, rest: Sequence[str], env: Mapping[str, str], hub: HubAccess | None
) -> TaskSpec:
    """Check the finetune config and its overrides (``rest``); everything the task says."""
    from shoestring.config import load
    from shoestring.train.config import FinetuneConfig

    ft = load(FinetuneConfig, cfg.config or None, list(rest))
    storage = check_storage(ft.checkpoint.storage)
    vm, text = _vm_config(ft, cfg.spot)
    offers = (
        named_offers(cfg.gpu)
        if cfg.gpu
        else cheapest_fitting(vm, hub, count=cfg.candidates, spot=cfg.spot)
    )
    install, workdir = (cfg.install, "") if cfg.install else default_install()
    return TaskSpec(
        name=cfg.name or f"shoestring-{vm.output_dir}",
        offers=tuple(offers),
        finetune_yaml=text,
        storage=storage,
        use_spot=cfg.spot,
        recovery=cfg.recovery,
        max_restarts_on_errors=cfg.max_restarts_on_errors,
        install=install,
        workdir=workdir,
        envs=_envs(cfg.env, env),
        secrets=_secrets(cfg.secret, env),
    )


# --------------------------------------------------------------------------- the verb


def sky_command(given: str, env: Mapping[str, str]) -> list[str] | None:
    """How to run SkyPilot's CLI: ``given``, else this Python when it imports ``sky``,
    else ``sky`` on PATH; None when there is none."""
    if given:
        return [given] if Path(given).is_file() or shutil.which(given) else None
    if importlib.util.find_spec("sky") is not None:
        return [sys.executable, "-c", "import sys; from sky.cli import cli; sys.exit(cli())"]
    found = shutil.which("sky", path=env.get("PATH"))
    return [found] if found else None


def run_launch(cfg: LaunchConfig, call: Invocation) -> int:
    """``shoestring launch``: print, write or submit the task."""
    sky = sky_command(cfg.sky, call.env) if cfg.yes else None
    if cfg.yes and sky is None:
        raise ConfigError(("--sky: not found. " if cfg.sky else "") + INSTALL_HINT)
    spec = spec_from_config(cfg, call.rest, call.env, _hub(call.env))
    text = render(spec)
    path = Path(cfg.output) if cfg.output else None
    if path is None and cfg.yes:
        path = Path(f"{spec.name}.sky.yaml")
    if path is None or cfg.dry_run:
        sys.stdout.write(text)
        return exitcodes.OK
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}", file=sys.stderr)
    if sky is None:
        return exitcodes.OK
    return submit(sky, path, spec, call.env)


def submit(sky: list[str], path: Path, spec: TaskSpec, env: Mapping[str, str]) -> int:
    """``sky jobs launch TASK --yes --detach-run --name NAME --secret S ...``: the
    secrets' values go from this environment to SkyPilot, not through any file."""
    cmd = [*sky, "jobs", "launch", str(path), "--yes", "--detach-run", "--name", spec.name]
    for name in spec.secrets:
        cmd += ["--secret", name]
    print(f"shoestring launch: {' '.join(map(shlex.quote, cmd))}", file=sys.stderr, flush=True)
    try:
        r = subprocess.run(cmd, env=dict(env), timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"shoestring launch: error: sky jobs launch: {e}", file=sys.stderr)
        return exitcodes.FAILED
    if r.returncode != 0:
        print(f"shoestring launch: error: sky jobs launch exited {r.returncode}", file=sys.stderr)
        return exitcodes.FAILED
    print(
        f"submitted managed job {spec.name}; follow it with: sky jobs logs -n {spec.name}",
        file=sys.stderr,
    )
    return exitcodes.OK


def _hub(env: Mapping[str, str]) -> HubAccess:
    from shoestring.checkpoint.mirror import fetch_model_folder
    from shoestring.hub import HubAccess

    cache = Path(env.get("SHOESTRING_CACHE") or Path.home() / ".cache" / "shoestring")
    return HubAccess.from_env(env, cache, buckets=fetch_model_folder)
