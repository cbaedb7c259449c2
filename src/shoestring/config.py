"""One config system for every verb: the machinery.

A config is a tree of dataclasses whose fields are :func:`knob` s: a default, help
text (it feeds ``--help`` and the docs) and an optional ``check``. A field typed
with a ``Literal[...]`` alias takes exactly those values; the alias is the one
place the choices are written. Values come from three layers, later ones winning:
the dataclass defaults, a YAML file (``--config``), and command-line flags
(``--train.lr 1e-4``; ``--hang-floor 5``: dashes in a flag are underscores in the key).

Every value is checked before any expensive work. A bad key or value raises
:class:`ConfigError` whose message names the key and where it came from: the
YAML file and line, or the command-line flag.

This module knows no verb and imports no pillar: each config tree lives with its
owner (``shoestring.train.config``, ``shoestring.supervise.config``, ...).
"""

from __future__ import annotations

import dataclasses
import difflib
import textwrap
import types
import typing
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from shoestring.secrets import redact

T = TypeVar("T")
Check = Callable[[Any], "str | None"]


class ConfigError(ValueError):
    """A configuration problem that names the key and its source."""


def knob(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    check: Check | None = None,
    repeat: bool = False,
) -> Any:
    """A config field: default value, help text, optional check.

    ``check`` returns an error string (without the key) or ``None``; it is not
    called for ``None``. Choices come from a ``Literal`` field type; ``choices``
    is for fields still typed ``str``. ``repeat``: a list whose flag may be given
    several times, each adding one item verbatim (no splitting at commas).
    """
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if check is not None:
        meta["check"] = check
    if repeat:
        meta["repeat"] = True
    if isinstance(default, (list, dict)):

        def copy_of() -> Any:  # a fresh list/dict per instance
            return type(default)(default)

        return field(default_factory=copy_of, metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------- checks


def positive(v: Any) -> str | None:
    return None if v > 0 else "must be > 0"


def storage_url(v: Any) -> str | None:
    """A storage location (fsspec URL or path) without a query string: fsspec keeps
    ``?…`` as part of the path, so every stored object's name would carry it (and any
    credential in it: a presigned signature, a token) into the bucket's listings."""
    if "://" in v and "?" in v:
        return (
            "has a query string (?...), which fsspec would keep in every stored object's "
            "name, credentials included; give credentials through the environment or "
            "fsspec's config (docs/security.md), not the URL"
        )
    return None


def non_negative(v: Any) -> str | None:
    return None if v >= 0 else "must be >= 0"


def unit_interval(v: Any) -> str | None:
    return None if 0.0 <= v < 1.0 else "must be in [0, 1)"


def at_least(low: int) -> Check:
    """A check: ``v >= low``."""
    return lambda v: None if v >= low else f"must be >= {low}"


def in_range(low: int, high: int) -> Check:
    """A check: ``low <= v <= high``."""
    return lambda v: None if low <= v <= high else f"must be in {low}..{high}"


# --------------------------------------------------------------------------- types


@dataclass(frozen=True)
class Source:
    """Where a value came from (for error messages) and its raw text, if a scalar."""

    where: str  # "path/to/file.yaml:12" or "--train.lr" or "default"
    raw: str | None = None  # unparsed text: string keys keep "off", "no", "1e-3" as typed

    def __str__(self) -> str:
        return self.where


Layer = tuple[str, Any, Source]


def iter_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field[Any], Any]]:
    """Yield (dotted key, field, resolved type) for every leaf of a config class."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            yield from iter_fields(typing.cast(type, tp), key + ".")
        else:
            yield key, f, tp


def _optional_of(tp: Any) -> Any:
    """``X`` for ``X | None`` (``Optional[X]``), else ``None``."""
    if typing.get_origin(tp) not in (Union, types.UnionType):
        return None
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 else None


def choices_of(f: dataclasses.Field[Any], tp: Any) -> tuple[Any, ...] | None:
    """The values a field allows: its ``Literal`` type's, else a ``choices=``, else None."""
    inner = _optional_of(tp)
    tp = inner if inner is not None else tp
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    choices: tuple[Any, ...] | None = f.metadata.get("choices")
    return choices


def _coerce_scalar(key: str, value: Any, tp: Any, src: Source) -> Any:
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{src}: '{key}' expects {expected}, got {value!r}")

    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad("true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise bad("an integer")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads "2e-4" as a string; accept it as users mean it.
            try:
                return float(value)
            except ValueError:
                raise bad("a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        return float(value)
    if tp is str:
        if src.raw is not None and not isinstance(value, (dict, list)):
            return src.raw
        if value is None:
            return ""
        if isinstance(value, (dict, list)):
            raise bad("a string")
        return str(value)
    raise ConfigError(f"{src}: '{key}' has unsupported type {tp}")  # pragma: no cover


def _coerce(key: str, value: Any, tp: Any, src: Source) -> Any:
    inner = _optional_of(tp)
    if inner is not None:
        return None if value is None else _coerce(key, value, inner, src)
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        return _coerce_scalar(key, value, type(allowed[0]), src)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{src}: '{key}' expects a list, got {value!r}")
        item_src = Source(src.where)
        return [_coerce(key, v, item_tp, item_src) for v in value]
    return _coerce_scalar(key, value, tp, src)


# --------------------------------------------------------------------------- YAML


def _yaml_leaves(node: yaml.Node, path: str, prefix: str = "") -> Iterator[Layer]:
    if not isinstance(node, yaml.MappingNode):
        where = f"{path}:{node.start_mark.line + 1}"
        raise ConfigError(f"{where}: expected a mapping of config keys")
    for k_node, v_node in node.value:
        key = f"{prefix}{k_node.value}"
        raw = (
            v_node.value
            if isinstance(v_node, yaml.ScalarNode) and v_node.tag != "tag:yaml.org,2002:null"
            else None
        )
        src = Source(f"{path}:{k_node.start_mark.line + 1}", raw)
        if isinstance(v_node, yaml.MappingNode):
            yield from _yaml_leaves(v_node, path, key + ".")
        else:
            try:
                value = yaml.SafeLoader("").construct_document(v_node)
            except yaml.YAMLError as e:
                raise ConfigError(f"{src}: cannot read value of '{key}': {e}") from e
            yield key, value, src


def read_yaml(path: str | Path, flag: str = "--config") -> list[Layer]:
    """Read a YAML config into (dotted key, value, source) triples with line numbers."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{flag}: cannot read {p}: {e.strerror}") from e
    try:
        node = yaml.compose(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark else str(p)
        raise ConfigError(f"{where}: invalid YAML: {getattr(e, 'problem', e)}") from e
    if node is None:
        return []
    return list(_yaml_leaves(node, str(p)))


# --------------------------------------------------------------------------- command line


@dataclass(frozen=True)
class ArgSpec:
    """How a verb's command line maps onto its config keys, besides ``--KEY VALUE``."""

    aliases: Mapping[str, str] = field(default_factory=dict)  # flag as typed -> key ("-o")
    positional: str | None = None  # key a bare argument sets (report RUN_DIR)
    command: str | None = None  # list key that "-- COMMAND ..." sets (run)
    # Flags of keys the verb does not have are handed on, not errors (slurm passes the
    # finetune overrides on): the class they are for (its booleans may stand alone).
    passthrough: type | None = None
    config_flag: str | None = "--config"  # the flag naming this verb's YAML file


@dataclass
class Parsed:
    """A command line, read: the YAML file named, the flag layers, what is handed on."""

    config_file: str | None = None
    layers: list[Layer] = field(default_factory=list)
    rest: list[str] = field(default_factory=list)
    help: bool = False  # -h or --help among the flags (not in COMMAND)


def _yaml_scalar(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def _is_bool(text: str) -> bool:
    return not text.startswith("-") and isinstance(_yaml_scalar(text), bool)


class _Reader:
    """One pass over argv: flags, switches, a positional, ``-- COMMAND``, passthrough."""

    def __init__(
        self,
        args: list[str],
        switches: Collection[str],
        known: Collection[str] | None,
        spec: ArgSpec,
    ) -> None:
        self.args, self.switches, self.known, self.spec = args, switches, known, spec
        self.passed = switches_of(spec.passthrough) if spec.passthrough else set()
        self.out = Parsed()
        self.i = 0
        self.positional_seen = False

    def read(self) -> Parsed:
        while self.i < len(self.args):
            arg = self.args[self.i]
            if arg == "--" and self.spec.command:
                self._command(self.i + 1, "-- COMMAND")
            elif arg in ("-h", "--help"):
                self.out.help = True
                self.i += 1
            elif arg in self.spec.aliases or (arg.startswith("--") and len(arg) > 2):
                self.i += 1
                self._flag(arg)
            elif arg == "--":
                raise ConfigError("unexpected argument '--': this command runs no COMMAND")
            elif arg.startswith("-") and len(arg) > 1:
                raise ConfigError(f"{arg}: unknown flag (flags look like --key VALUE)")
            elif self.spec.positional and not self.positional_seen:
                name = self.spec.positional
                self.out.layers.append((name, arg, Source(name.upper(), arg)))
                self.positional_seen = True
                self.i += 1
            elif self.spec.command:
                self._command(self.i, "COMMAND")
            else:
                raise ConfigError(f"unexpected argument {arg!r}: flags look like --key VALUE")
        return self.out

    def _command(self, start: int, where: str) -> None:
        assert self.spec.command is not None
        self.out.layers.append((self.spec.command, list(self.args[start:]), Source(where)))
        self.i = len(self.args)

    def _next(self, flag: str) -> str:
        if self.i >= len(self.args):
            raise ConfigError(f"{flag}: missing value")
        self.i += 1
        return self.args[self.i - 1]

    def _pass_on(self, arg: str, flag: str, key: str, eq: str) -> None:
        self.out.rest.append(arg)
        if eq or (key.startswith("no_") and key[3:] in self.passed):
            return
        if key not in self.passed:
            self.out.rest.append(self._next(flag))
        elif self.i < len(self.args) and _is_bool(self.args[self.i]):
            self.out.rest.append(self._next(flag))

    def _flag(self, arg: str) -> None:
        flag, eq, raw = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        key = self.spec.aliases.get(flag) or flag[2:].replace("-", "_")
        if flag == self.spec.config_flag:
            self.out.config_file = raw if eq else self._next(flag)
            return
        negated = key not in self.switches and key.startswith("no_") and key[3:] in self.switches
        if self.known is not None and key not in self.known and not negated:
            self._pass_on(arg, flag, key, eq)
            return
        if negated:
            if eq:
                raise ConfigError(f"{flag}: takes no value (it means --{key[3:]} false)")
            self.out.layers.append((key[3:], False, Source(flag)))
        elif key in self.switches and not eq:
            value, text = True, None
            if self.i < len(self.args) and _is_bool(self.args[self.i]):
                text = self._next(flag)
                value = _yaml_scalar(text)
            self.out.layers.append((key, value, Source(flag, text)))
        else:
            if not eq:
                raw = self._next(flag)
            self.out.layers.append((key, _yaml_scalar(raw), Source(flag, raw)))


def switches_of(cls: type) -> set[str]:
    """The boolean keys of a config class: a flag alone means true, ``--no-KEY`` false."""
    return {key for key, _f, tp in iter_fields(cls) if (_optional_of(tp) or tp) is bool}


def parse_command_line(
    args: list[str], cls: type, spec: ArgSpec = ArgSpec(), also: type | None = None
) -> Parsed:
    """Read a verb's argv against its config class (and ``also``, a flag-only options
    class). Errors name the flag as typed."""
    classes = [cls] + ([also] if also is not None else [])
    known = {key for c in classes for key, _f, _tp in iter_fields(c)}
    switches = {key for c in classes for key in switches_of(c)}
    return _Reader(list(args), switches, known if spec.passthrough else None, spec).read()


def parse_overrides(args: list[str], switches: Collection[str] = ()) -> list[Layer]:
    """Parse ``--a.b VALUE`` / ``--a.b=VALUE`` pairs; values are read as YAML scalars.
    A key in ``switches`` (a boolean) may stand alone, or as ``--no-KEY``."""
    return _Reader(list(args), switches, None, ArgSpec(config_flag=None)).read().layers


@dataclass(frozen=True)
class Invocation:
    """What a verb's runner gets besides its config. Made by :mod:`shoestring.cli`, the
    one module that reads the process environment and argv."""

    env: Mapping[str, str]
    rest: tuple[str, ...] = ()  # flags handed on unparsed (slurm: the finetune overrides)
    options: Any = None  # the verb's flag-only options (finetune: FinetuneOptions)


# --------------------------------------------------------------------------- build


def _check(key: str, f: dataclasses.Field[Any], tp: Any, v: Any, src: Source) -> None:
    choices = choices_of(f, tp)
    if choices is not None and v is not None and v not in choices:
        raise ConfigError(
            f"{src}: '{key}' must be one of {', '.join(map(str, choices))}; got {v!r}"
        )
    check = f.metadata.get("check")
    if check is not None and v is not None:
        problem = check(v)
        if problem:
            raise ConfigError(f"{src}: '{key}' {problem}; got {v!r}")


def build(cls: type[T], layers: list[Layer]) -> T:
    """Build and validate a config object from (key, value, source) triples."""
    leaves = {key: (f, tp) for key, f, tp in iter_fields(cls)}
    values: dict[str, Any] = {}
    for key, value, src in layers:
        if key not in leaves:
            hint = difflib.get_close_matches(key, leaves, n=1)
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise ConfigError(f"{src}: unknown key '{key}'{extra}")
        f, tp = leaves[key]
        repeat = f.metadata.get("repeat", False)
        if repeat and isinstance(value, str):
            value = [src.raw if src.raw is not None else value]
        v = _coerce(key, value, tp, src)
        if repeat:
            for item in v:
                _check(key, f, tp, item, src)
            v = values.get(key, []) + v
        else:
            _check(key, f, tp, v, src)
        values[key] = v
    return typing.cast(T, _instantiate(cls, values, ""))


def _instantiate(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _instantiate(typing.cast(type, tp), values, key + ".")
        elif key in values:
            kwargs[f.name] = values[key]
    return cls(**kwargs)


def load(cls: type[T], config_file: str | None, overrides: list[str]) -> T:
    """Defaults, then the YAML file, then command-line overrides."""
    layers: list[Layer] = []
    if config_file:
        layers += read_yaml(config_file)
    layers += parse_overrides(overrides, switches_of(cls))
    return build(cls, layers)


# --------------------------------------------------------------------------- output


def to_flat(cfg: Any) -> dict[str, Any]:
    """Flatten a config object to {dotted key: value}."""
    out: dict[str, Any] = {}
    for key, _f, _tp in iter_fields(type(cfg)):
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        out[key] = obj
    return out


def to_yaml(cfg: Any) -> str:
    """The config as YAML, as it is written down (``config.yaml``): secrets in URLs
    (storage credentials, webhook tokens) redacted (:mod:`shoestring.secrets`)."""
    return yaml.safe_dump(redact(dataclasses.asdict(cfg)), sort_keys=False)


def _type_name(f: dataclasses.Field[Any], tp: Any) -> str:
    choices = choices_of(f, tp)
    if choices:
        return "|".join(map(str, choices))
    tp = _optional_of(tp) or tp
    if typing.get_origin(tp) is list:
        return "LIST"
    return str(getattr(tp, "__name__", tp)).replace("typing.", "").upper()


def help_table(cls: type, *, dashes: bool = False, width: int | None = None) -> str:
    """Every key with its type, default and help, for ``--help``. ``dashes``: show the
    flag spelling of a flat verb (``--hang-floor``) instead of the key (``--hang_floor``).
    ``width``: wrap the help text (default: one line per key)."""
    lines = []
    defaults = to_flat(cls())
    for key, f, tp in iter_fields(cls):
        flag = key.replace("_", "-") if dashes else key
        lines.append(f"  --{flag} {_type_name(f, tp)}  (default: {defaults[key]!r})")
        text = f.metadata.get("help", "")
        lines += (
            textwrap.wrap(text, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
            if width
            else [f"      {text}"]
        )
    return "\n".join(lines)
