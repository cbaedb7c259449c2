"""``shoestring infer`` is a plain entry of the verb table: its short flags are aliases of
its keys, in both spellings, and errors name the flag as typed."""

from __future__ import annotations

import pytest

from shoestring.cli import VERBS, verb_help
from shoestring.config import ConfigError, to_flat
from shoestring.infer.cli import load_config
from shoestring.infer.config import ALIASES, InferConfig

#: A valid value, other than the default, for each key a short flag sets.
VALUES = {
    "model.path": "m", "model.adapter": "a", "model.device": "cpu", "model.dtype": "float16",
    "io.input": "i.jsonl", "io.output": "o.jsonl", "io.run_dir": "r", "generate.mode": "score",
    "generate.max_new_tokens": "5", "generate.chat_template": "t.jinja", "generate.json_schema": "s.json",
    "generate.temperature": "0.5", "generate.top_p": "0.25", "generate.top_k": "4",
    "generate.seed": "9", "memory.budget": "2GB", "memory.batch_size": "3",
    "memory.kv_bits": "8", "compress.scheme": "int8", "job.num_threads": "2",
    "compress.decode_once": "True",
}  # fmt: skip


def test_every_short_flag_sets_its_key_in_both_spellings() -> None:
    assert set(VALUES) == set(ALIASES.values())
    defaults = to_flat(InferConfig())
    for flag, key in ALIASES.items():
        for spelling in (flag, "--" + flag[2:].replace("-", "_")):
            got = to_flat(load_config(None, [spelling, VALUES[key]]))[key]
            assert str(got) == VALUES[key] != str(defaults[key]), (spelling, key, got)


def test_errors_name_the_flag_as_typed_and_help_lists_the_short_flags() -> None:
    with pytest.raises(ConfigError, match=r"^--memory_budget: 'memory.budget' not a size"):
        load_config(None, ["--memory_budget", "lots"])
    with pytest.raises(ConfigError, match=r"^--dtype: 'model.dtype' must be one of auto, "):
        load_config(None, ["--dtype", "int4"])
    text = verb_help("infer", VERBS["infer"])
    assert all(f"  {flag} " in text for flag in ALIASES)
