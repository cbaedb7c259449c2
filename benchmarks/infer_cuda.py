"""The CUDA path of ``shoestring infer``, checked in one short run (for a GPU session).

What only a GPU can show, on random-init Llama models saved like real checkpoints:

1. **Exactness on the device**: greedy tokens of the streaming engine (pinned host
   buffers, copy stream, offloaded KV cache) vs the in-memory transformers model on
   the same device, and the max |logit| difference of a prefill.
2. **Streaming rate**: decode passes of a batch over a model streamed from host
   (page-cached shards) with nothing resident: bytes per second into the device
   vs a plain pinned host-to-device copy measured in the same run, and time per pass.
3. **Compression on the device**: int8 and nf4 layers dequantized on the GPU —
   bytes per pass, time per pass and drift against the uncompressed run.
4. **Structured output on the device**: answers held to a JSON Schema (the
   llguidance mask moved to the device each pass) are complete and valid, and
   compared token by token with the same held run on the CPU in float32.
5. **A bitsandbytes 4-bit checkpoint streamed as stored**: greedy tokens and logits
   vs transformers' own 4-bit model on the device.

Prints one JSON object and, with ``--out FILE``, writes it there.

Usage (GPU box):  .venv/bin/python benchmarks/infer_cuda.py --out $OUT/infer_cuda.json
Smoke test (CPU): .venv/bin/python benchmarks/infer_cuda.py --device cpu --small
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from shoestring.infer.decode import generate, prompt_logits  # noqa: E402
from shoestring.infer.engine import StreamingCausalLM  # noqa: E402
from shoestring.infer.fixtures import build_random_model  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(4, 24, (n,), generator=g).tolist()
    return [torch.randint(3, 256, (k,), generator=g).tolist() for k in lens]


def h2d_rate(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a pinned host-to-device copy (the ceiling for streamed weights)."""
    if device.type != "cuda":
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    _sync(device)
    return 3 * nbytes / (time.perf_counter() - t0)


def exactness(model_dir: Path, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    prompts = _prompts(6, seed=1)
    eng = StreamingCausalLM(model_dir, device=device).start(resident=1, depth=2)
    try:
        out = generate(eng, prompts, max_new_tokens=16, eos_ids=set(), pad_id=0, micro_tokens=64)
        logits = prompt_logits(eng, prompts)
    finally:
        eng.close()
    same, diff = _against(ref, prompts, out, logits, device, 16)
    del ref
    return {"prompts": len(prompts), "greedy_identical": same, "max_abs_logit_diff": diff}


def _against(
    ref: Any, prompts: list[list[int]], out: list[Any], logits: list[Any], device: torch.device,
    new: int,
) -> tuple[int, float]:  # fmt: skip
    """(prompts whose greedy tokens equal ``ref``'s, the max |logit difference|)."""
    same, diff = 0, 0.0
    for p, o, lg in zip(prompts, out, logits):
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                do_sample=False, pad_token_id=0)  # fmt: skip
            ref_logits = ref(ids).logits[0].float()
        same += o.tokens == want[0, len(p) :].tolist()
        diff = max(diff, (lg.to(device).float() - ref_logits).abs().max().item())
    return same, diff


#: Bounded everywhere, so a complete answer fits in STRUCTURED_TOKENS byte tokens.
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
STRUCTURED_TOKENS = 96


def structured(model_dir: Path, device: torch.device) -> dict[str, Any]:
    """Answers held to a JSON Schema on the device (the mask moved there each pass):
    every answer complete and valid; and the same held generation on the CPU in float32,
    token by token, as a cross-check of the mask path (a different dtype may pick
    differently where logits are close: counted, not failed)."""
    try:
        import jsonschema
        from transformers import AutoTokenizer

        from shoestring.infer.decode import Rules, generate_from, start
        from shoestring.infer.sampleparams import ResponseFormat
        from shoestring.infer.structured import Grammars
    except ImportError as e:
        return {"skipped": f"needs llguidance and jsonschema: {e}"}
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    grammars = Grammars(tok, vocab, [tok.eos_token_id])
    grammar = grammars.compile(ResponseFormat.of_schema(PERSON, "person"))
    prompts = _prompts(8, seed=3)

    def held_run(dev: torch.device, dtype: torch.dtype | None) -> tuple[list[Any], float]:
        eng = StreamingCausalLM(model_dir, device=dev, dtype=dtype).start(resident=1, depth=2)
        rules = Rules([STRUCTURED_TOKENS] * len(prompts), frozenset({tok.eos_token_id}),
                      None, None, grammars.held([grammar] * len(prompts)))  # fmt: skip
        t0 = time.perf_counter()
        try:
            st = start(eng, prompts, pad_id=0, micro_tokens=256)
            return generate_from(eng, st, rules=rules, pad_id=0), time.perf_counter() - t0
        finally:
            eng.close()

    out, seconds = held_run(device, None)
    ref, _ = held_run(torch.device("cpu"), torch.float32)
    valid = 0
    for o in out:
        try:
            jsonschema.validate(json.loads(tok.decode(o.tokens)), PERSON)
            valid += o.finish == "stop"
        except ValueError:
            pass
    return {
        "answers": len(out),
        "complete_and_valid": valid,
        "tokens": sum(len(o.tokens) for o in out),
        "seconds": seconds,
        "equal_to_cpu_fp32": sum(a.tokens == b.tokens for a, b in zip(out, ref)),
    }


def prequant(
    model_dir: Path, device: torch.device, dtype: torch.dtype, root: Path
) -> dict[str, Any]:
    """The exactness model saved 4-bit by bitsandbytes (nf4, double quant, as the Hub's
    ``*-bnb-4bit`` repos) and streamed as stored: greedy tokens and prefill logits vs
    transformers' own 4-bit model on the device."""
    try:
        import bitsandbytes  # noqa: F401
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        from shoestring.infer.prequant import Stored4bit
        from shoestring.infer.weights import weight_hook
    except ImportError as e:
        return {"skipped": f"needs bitsandbytes: {e}"}
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)  # fmt: skip
    ref = AutoModelForCausalLM.from_pretrained(
        str(model_dir), quantization_config=q, dtype=dtype, device_map={"": device}
    ).eval()
    dest = root / "bnb4"
    ref.save_pretrained(str(dest))
    for m in ref.modules():  # bnb's AVX512-BF16 CPU path repacks weights: another model
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    prompts = _prompts(6, seed=4)
    eng = StreamingCausalLM(dest, device=device, dtype=dtype)
    stored = Stored4bit.of(eng)
    hook, _ = weight_hook(eng, None, None, root / "unused", "", stored)
    eng.start(resident=1, depth=2, prepare=hook)
    try:
        out = generate(eng, prompts, max_new_tokens=12, eos_ids=set(), pad_id=0, micro_tokens=64)
        logits = prompt_logits(eng, prompts)
        layer_bytes = eng.units[1].plan.nbytes
    finally:
        eng.close()
    same, diff = _against(ref, prompts, out, logits, device, 12)
    return {"stored": stored is not None, "prompts": len(prompts), "greedy_identical": same,
            "max_abs_logit_diff": diff, "layer_bytes": layer_bytes}  # fmt: skip


def decode_rate(
    model_dir: Path,
    device: torch.device,
    batch: int,
    new_tokens: int,
    scheme: str = "none",
    workdir: Path | None = None,
) -> dict[str, Any]:
    """Prefill + ``new_tokens`` passes over ``batch`` prompts, nothing resident."""
    eng = StreamingCausalLM(model_dir, device=device)
    prepare = None
    if scheme != "none":
        from shoestring.infer.quant import build_compressed, use_compressed

        dest = build_compressed(eng, (workdir or model_dir) / f"w-{scheme}", scheme, "bench")
        prepare, _ = use_compressed(eng, dest)
    eng.start(resident=0, depth=2, prepare=prepare)
    stamps: list[float] = []

    def on_pass() -> None:
        _sync(device)
        stamps.append(time.perf_counter())

    try:
        t0 = time.perf_counter()
        out = generate(
            eng,
            _prompts(batch, seed=2),
            max_new_tokens=new_tokens,
            eos_ids=set(),
            pad_id=0,
            micro_tokens=4096,
            on_pass=on_pass,
        )
        total = time.perf_counter() - t0
        streamed = eng.streamer.streamed_bytes if eng.streamer else 0
        wait = eng.streamer.wait_s if eng.streamer else 0.0
    finally:
        eng.close()
    steps = [b - a for a, b in zip(stamps[:-1], stamps[1:])]
    step = sorted(steps)[len(steps) // 2] if steps else total
    return {
        "scheme": scheme,
        "batch": batch,
        "passes": len(stamps),
        "total_s": total,
        "prefill_s": stamps[0] - t0 if stamps else total,
        "decode_step_s": step,
        "streamed_bytes_per_pass": streamed,
        "stream_bytes_per_s": streamed / step,
        "reader_wait_s": wait,
        "tokens_per_s": batch * len(steps) / sum(steps) if steps else 0.0,
        "tokens": [o.tokens for o in out],
    }


def run(device: torch.device, small: bool, batch: int = 64, new_tokens: int = 8) -> dict[str, Any]:
    """All three checks in one temp dir; the dict ``main`` prints (also used by gpu_check.py)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        exact_dir = build_random_model(
            root / "exact",
            "llama",
            hidden=256,
            layers=4,
            ffn=512,
            heads=4,
            kv_heads=2,
            dtype=dtype,
            seed=1,
        )
        res["exactness"] = exactness(exact_dir, device, dtype)
        res["structured"] = structured(exact_dir, device)
        res["prequant"] = prequant(exact_dir, device, dtype, root)
        shape = (
            dict(hidden=256, layers=4, ffn=512, heads=4, kv_heads=2)
            if small
            else dict(hidden=4096, layers=8, ffn=11008, heads=32, kv_heads=8)
        )
        big = build_random_model(
            root / "big", "llama", dtype=dtype, shard="2GB", init_std=0.02, **shape
        )  # type: ignore[arg-type]
        res["model_bytes"] = sum(f.stat().st_size for f in big.glob("*.safetensors"))
        res["build_s"] = time.perf_counter() - t0
        res["h2d_bytes_per_s"] = h2d_rate(device)
        res["fp"] = decode_rate(big, device, batch, new_tokens)
        for scheme in ("int8", "nf4"):
            res[scheme] = decode_rate(big, device, batch, new_tokens, scheme, root)
            pairs = [
                (x, y)
                for s, t in zip(res["fp"]["tokens"], res[scheme]["tokens"])
                for x, y in zip(s, t)
            ]
            res[scheme]["token_agreement_vs_fp"] = sum(x == y for x, y in pairs) / len(pairs)
        for k in ("fp", "int8", "nf4"):
            res[k].pop("tokens")
        if res["h2d_bytes_per_s"]:
            for k in ("fp", "int8", "nf4"):
                res[k]["share_of_h2d"] = res[k]["stream_bytes_per_s"] / res["h2d_bytes_per_s"]
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--out", default="")
    a = p.parse_args()
    res = run(torch.device(a.device), a.small, a.batch, a.new_tokens)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
