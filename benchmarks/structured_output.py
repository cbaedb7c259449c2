"""Structured output (``response_format`` JSON Schema): what holding answers to a
schema costs, ours vs transformers ``generate`` with llguidance as a logits processor.

A real-size vocabulary matters here (the mask is computed over every token), and no
tokenizer may be downloaded, so a byte-level BPE tokenizer of ``--vocab`` tokens is
trained on the Python sources of the installed packages (transformers and torch:
about 30 s), and a random-init Llama is built with that
vocabulary. The same completion requests (greedy, ``--max-tokens``) run four ways in
one process, each timed as a whole:

* ours free / ours held: ``shoestring infer`` on an OpenAI batch file, without and
  with ``response_format`` (a bounded person schema);
* peer free / peer held: transformers ``generate`` on the model in memory, the batch
  left-padded, held by a per-row llguidance matcher in a ``LogitsProcessor`` (the
  numpy mask path; llguidance's torch path needs ``torch.compile``).

Each way runs ``--repeat`` times, alternating, and its fastest run is kept (the
machine may be shared). Ours is timed by its passes (``infer_end``'s ``pass_s``), the
peer by its ``generate`` call: neither counts loading the model. Prints one JSON
object (``--out`` writes it too): seconds, generated tokens and tokens/s per way, steps (passes; ``generate``'s forward calls) and seconds per step,
each side's held/free ratios (held answers end when their JSON does, so they are
shorter than the free ones, which run to the limit: seconds per step is the cost of
holding, tokens/s what a user gets), ours/peer ratios, how many held
answers validate against the schema and how many equal the peer's text.

    .venv/bin/python benchmarks/structured_output.py --out benchmarks/results/structured-output-2026-12-06.json
"""

from __future__ import annotations

import argparse
import glob
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Oslo", "Lima", "Pune", "Accra"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "tags", "ok"],
    "additionalProperties": False,
}
EOS = "<|endoftext|>"


def build_tokenizer(target: Path, vocab: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    site = Path(sys.modules["torch"].__file__ or "").parents[1]
    files = sorted(glob.glob(str(site / "transformers" / "**" / "*.py"), recursive=True))
    files += sorted(glob.glob(str(site / "torch" / "**" / "*.py"), recursive=True))
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    raw.train(files, trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS],
                                         initial_alphabet=alphabet))  # fmt: skip
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=EOS, pad_token=EOS)
    tok.save_pretrained(target)
    return tok


def build_model(target: Path, vocab: int, hidden: int, layers: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer(target, vocab)
    cfg = LlamaConfig(
        vocab_size=-(-len(tok) // 64) * 64, hidden_size=hidden, intermediate_size=hidden * 3,
        num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64, max_position_embeddings=2048, initializer_range=0.1,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(target)
    return target


def requests(n: int, max_tokens: int, held: bool) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        body: dict[str, Any] = {
            "prompt": f"def record_{i}(self, value):\n    return",
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        if held:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON},
            }
        out.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body})
    return out


def run_ours(model: Path, work: Path, reqs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    import shutil

    from shoestring.cli import main

    inp, out, run = work / f"{name}.jsonl", work / f"{name}-out.jsonl", work / f"{name}.run"
    inp.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    shutil.rmtree(run, ignore_errors=True)
    t0 = time.perf_counter()
    code = main(["infer", "--model", str(model), "--input", str(inp), "--output", str(out),
                 "--job.progress", "off", "--batch-size", str(len(reqs)), "--run-dir", str(run)])  # fmt: skip
    wall = time.perf_counter() - t0
    assert code == 0, code
    end = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()][-1]
    assert end["event"] == "infer_end", end
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    texts = [x["response"]["body"]["choices"][0]["text"] for x in lines]
    tokens = sum(x["response"]["body"]["usage"]["completion_tokens"] for x in lines)
    seconds = end["pass_s"]  # the passes, as the peer's generate call (no load, no setup)
    return {"seconds": seconds, "wall_s": wall, "tokens": tokens, "tok_per_s": tokens / seconds,
            "steps": end["passes"], "s_per_step": seconds / end["passes"],
            "decode_s_per_step": end["decode_s_per_pass"], "texts": texts}  # fmt: skip


class HeldRows:
    """Per-row llguidance matchers as one transformers logits processor."""

    def __init__(self, tok: Any, vocab: int, rows: int) -> None:
        import llguidance
        import llguidance.hf

        llt = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=[tok.eos_token_id])
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            PERSON, defaults={"whitespace_flexible": False}
        )
        self.matchers = [llguidance.LLMatcher(llt, grammar) for _ in range(rows)]
        self.start: int | None = None

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import llguidance.numpy
        import torch

        if self.start is None:
            self.start = input_ids.shape[1]
        mask = llguidance.numpy.allocate_token_bitmask(len(self.matchers), scores.shape[1])
        for r, m in enumerate(self.matchers):
            if input_ids.shape[1] > self.start and not m.is_stopped():
                m.consume_token(int(input_ids[r, -1]))
            llguidance.numpy.fill_next_token_bitmask(m, mask, r)
        held = scores.detach().numpy().copy()
        llguidance.numpy.apply_token_bitmask_inplace(held, mask)
        return torch.from_numpy(held)


def run_peer(model_dir: Path, reqs: list[dict[str, Any]], held: bool) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    prompts = [r["body"]["prompt"] for r in reqs]
    t0 = time.perf_counter()
    enc = tok(prompts, return_tensors="pt", padding=True)
    procs = [HeldRows(tok, model.config.vocab_size, len(prompts))] if held else []
    with torch.no_grad():
        g = model.generate(**enc, do_sample=False, max_new_tokens=reqs[0]["body"]["max_tokens"],
                           logits_processor=LogitsProcessorList(procs))  # fmt: skip
    seconds = time.perf_counter() - t0
    texts, tokens = [], 0
    steps = g.shape[1] - enc["input_ids"].shape[1]  # forward calls: prefill + each new column
    for row in g[:, enc["input_ids"].shape[1] :].tolist():
        if tok.eos_token_id in row:
            row = row[: row.index(tok.eos_token_id)]
        tokens += len(row) + (held and len(row) < reqs[0]["body"]["max_tokens"])
        texts.append(tok.decode(row, skip_special_tokens=True))
    return {"seconds": seconds, "tokens": tokens, "tok_per_s": tokens / seconds, "steps": steps,
            "s_per_step": seconds / steps, "texts": texts}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/shoestring-structured-bench"))
    ap.add_argument("--vocab", type=int, default=128000)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each way (fastest kept)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import jsonschema
    import torch

    torch.set_num_threads(args.threads)
    model = args.workdir / f"llama-v{args.vocab}-h{args.hidden}-l{args.layers}"
    if not (model / "config.json").is_file():
        build_model(model, args.vocab, args.hidden, args.layers)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(), "threads": args.threads, "requests": args.requests, "max_tokens": args.max_tokens,
                              "vocab": json.loads((model / "config.json").read_text())["vocab_size"], "hidden": args.hidden, "layers": args.layers}  # fmt: skip
    ways = {
        "ours_free": lambda: run_ours(model, args.workdir, requests(args.requests, args.max_tokens, False), "free"),
        "ours_held": lambda: run_ours(model, args.workdir, requests(args.requests, args.max_tokens, True), "held"),
        "peer_free": lambda: run_peer(model, requests(args.requests, args.max_tokens, False), False),
        "peer_held": lambda: run_peer(model, requests(args.requests, args.max_tokens, True), True),
    }  # fmt: skip
    texts: dict[str, list[str]] = {}
    for attempt in range(args.repeat):  # alternating; the fastest of each way is kept
        for name, way in ways.items():
            got = way()
            texts[name] = got.pop("texts")
            print(attempt, name, got, file=sys.stderr)
            if name not in result or got["seconds"] < result[name]["seconds"]:
                result[name] = got
    valid = 0
    for text in texts["ours_held"]:
        try:
            jsonschema.validate(json.loads(text), PERSON)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    result["ours_held_valid"] = valid
    result["held_equal_to_peer"] = sum(
        a == b for a, b in zip(texts["ours_held"], texts["peer_held"])
    )
    result["free_equal_to_peer"] = sum(
        a == b for a, b in zip(texts["ours_free"], texts["peer_free"])
    )
    for side in ("ours", "peer"):
        held, free = result[f"{side}_held"], result[f"{side}_free"]
        result[f"{side}_held_over_free_tok_per_s"] = held["tok_per_s"] / free["tok_per_s"]
        result[f"{side}_held_over_free_s_per_step"] = held["s_per_step"] / free["s_per_step"]
    result["ours_held_over_free_decode_s_per_step"] = (
        result["ours_held"]["decode_s_per_step"] / result["ours_free"]["decode_s_per_step"]
    )
    for kind in ("free", "held"):
        result[f"ours_over_peer_{kind}_tok_per_s"] = (
            result[f"ours_{kind}"]["tok_per_s"] / result[f"peer_{kind}"]["tok_per_s"]
        )
    result["example"] = texts["ours_held"][0]
    text = json.dumps(result, indent=2, ensure_ascii=False)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
