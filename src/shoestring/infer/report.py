"""What the job tells its user: the progress display and the final summary."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from shoestring.infer.engine import StreamingCausalLM
from shoestring.infer.plan import StreamPlan
from shoestring.infer.prefix import SharedPrefix


def peak_rss() -> int:
    """The process's peak resident set: Linux's ``VmHWM`` (``ru_maxrss`` elsewhere).

    Not ``ru_maxrss`` on Linux: a process keeps through ``exec`` the high-water mark of
    the parent it was forked from, so a job started by a big parent (a test, a Python
    orchestrator) would report that parent's peak as its own."""
    hwm = _proc_status("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss() -> int:
    """The process's resident set now (Linux ``VmRSS``; elsewhere its peak so far,
    which is never less)."""
    rss = _proc_status("VmRSS")
    return rss if rss is not None else peak_rss()


def _proc_status(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status``, in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class PromptBar:
    """A tqdm bar of prompts with prompts/hour and read MB/s, or plain lines."""

    def __init__(self, total: int, done: int, style: str, stream: TextIO) -> None:
        self.stream, self.t0, self.done0 = stream, time.perf_counter(), done
        tty = stream.isatty() if style == "auto" else style == "bar"
        self.plain = style != "off" and not tty
        self.bar: Any = None
        if style != "off" and tty:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                initial=done,
                unit="prompt",
                file=stream,
                dynamic_ncols=True,
                desc="infer",
            )
        self.total = total
        self._done = done
        self._last = self.t0

    def update(self, done: int, bytes_read: int, note: str = "") -> None:
        self._done = done
        dt = max(time.perf_counter() - self.t0, 1e-9)
        rate = (done - self.done0) / dt * 3600
        mbs = bytes_read / dt / 1e6
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            self.bar.set_postfix_str(f"{rate:,.0f} prompts/h, {mbs:,.0f} MB/s {note}".strip())
        elif self.plain:
            print(
                f"[infer] {done}/{self.total} prompts, {rate:,.0f} prompts/h, "
                f"{mbs:,.0f} MB/s read {note}".rstrip(),
                file=self.stream,
                flush=True,
            )

    def tick(self, passes: int, bytes_read: int) -> None:
        """After each pass: a long chunk must not look like a hang."""
        now = time.perf_counter()
        if now - self._last < (1.0 if self.bar is not None else 10.0):
            return
        self._last = now
        self.update(
            self.bar.n if self.bar is not None else self._done, bytes_read, f"pass {passes}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class Stats:
    """What the passes of this process did, for the summary."""

    passes: int = 0
    pass_s: float = 0.0
    prefill_s: float = 0.0  # first pass of each chunk (the whole prompt)
    decode_passes: int = 0
    decode_s: float = 0.0
    chunk_pass: int = 0
    tokens: int = 0  # generated (or scored) tokens
    prompts: int = 0
    held: int = 0  # answers held to a response format
    held_cut: int = 0  # of which max_tokens ended before the format was complete
    prefill_tokens: int = 0  # prompt tokens the prefills computed
    prefill_unshared: int = 0  # ... and would have without a shared prefix
    shared_tokens: int = 0  # shared prefixes' tokens, summed over chunks
    shared_seqs: int = 0  # sequences that shared one

    def count_prefill(self, prompts: list[list[int]], shared: SharedPrefix | None) -> None:
        """A chunk's prefill of ``prompts``, computing ``shared`` once if there is one."""
        total = sum(len(p) for p in prompts)
        self.prefill_unshared += total
        self.prefill_tokens += total - (shared.saved if shared is not None else 0)
        if shared is not None:
            self.shared_tokens += len(shared.tokens)
            self.shared_seqs += len(shared.rows)

    def count_pass(self, seconds: float) -> None:
        """A pass of the running chunk took ``seconds``: its first is the prefill."""
        self.passes += 1
        self.pass_s += seconds
        if self.chunk_pass == 0:
            self.prefill_s += seconds
        else:
            self.decode_passes += 1
            self.decode_s += seconds
        self.chunk_pass += 1


def summary(
    engine: StreamingCausalLM, stats: Stats, plan: StreamPlan, streamed: int, wall: float
) -> dict[str, Any]:
    st = engine.streamer
    read = st.reader.bytes_read if st else 0
    read_s = st.reader.read_s if st else 0.0
    bw = read / read_s if read_s > 0 else 0.0
    # The bandwidth roofline of a pass is its streamed bytes at the read rate we
    # measured ourselves; the fraction says how much of the pass time it explains.
    roof = (stats.passes * streamed / bw) if bw else 0.0
    peak = peak_rss()
    return {
        "prompts": stats.prompts,
        "tokens": stats.tokens,
        "passes": stats.passes,
        "wall_s": round(wall, 3),
        "pass_s": round(stats.pass_s, 3),
        "prefill_s": round(stats.prefill_s, 3),
        "decode_passes": stats.decode_passes,
        "decode_s_per_pass": round(stats.decode_s / stats.decode_passes, 4)
        if stats.decode_passes
        else 0.0,
        "prefill_tokens": stats.prefill_tokens,
        "prefill_tokens_unshared": stats.prefill_unshared,
        "shared_prefix_tokens": stats.shared_tokens,
        "shared_prefix_seqs": stats.shared_seqs,
        "tokens_per_s": round(stats.tokens / stats.pass_s, 3) if stats.pass_s else 0.0,
        "prompts_per_hour": round(stats.prompts / stats.pass_s * 3600, 1) if stats.pass_s else 0.0,
        "bytes_read": read,
        "bytes_per_pass": streamed,
        "read_bytes_per_s": round(bw),
        "io_wait_s": round(st.wait_s, 3) if st else 0.0,
        "prepare_s": round(st.prepare_s, 3) if st else 0.0,  # on compute (PrepareAt)
        "roofline_pct": round(100 * roof / stats.pass_s, 1) if stats.pass_s else 0.0,
        "peak_rss_bytes": peak,
        "budget_bytes": plan.budget,
        "over_budget_bytes": max(0, peak - plan.budget),
        "resident_units": len(plan.resident),
        "batch_size": plan.batch_size,
        **({"held": stats.held, "held_cut": stats.held_cut} if stats.held else {}),
    }


def print_summary(s: dict[str, Any], output: Path, stream: TextIO) -> None:
    print(
        f"shoestring infer: wrote {output}\n"
        f"  {s['prompts']} prompts, {s['tokens']} tokens in {s['pass_s']:.1f}s of passes "
        f"({s['tokens_per_s']:.2f} tok/s, {s['prompts_per_hour']:,.0f} prompts/h)\n"
        f"  read {s['bytes_read'] / 1e9:.2f} GB at {s['read_bytes_per_s'] / 1e6:,.0f} MB/s; "
        f"{s['bytes_per_pass'] / 1e6:,.1f} MB per pass, {s['passes']} passes; "
        f"{s['roofline_pct']:.0f}% of the bandwidth roofline"
        + (f"; {s['prepare_s']:.1f}s preparing units on compute" if s.get("prepare_s") else "")
        + "\n"
        f"  peak RSS {s['peak_rss_bytes'] / 1e9:.2f} GB of a {s['budget_bytes'] / 1e9:.2f} GB "
        f"budget; {s['resident_units']} units resident; batch {s['batch_size']}",
        file=stream,
    )
    if s.get("shared_prefix_seqs"):
        print(
            f"  shared prompt prefixes: {s['shared_prefix_tokens']:,} tokens over "
            f"{s['shared_prefix_seqs']} sequences; prefill computed "
            f"{s['prefill_tokens']:,} of {s['prefill_tokens_unshared']:,} prompt tokens",
            file=stream,
        )
    if s.get("held_cut"):
        print(
            f"  WARNING: {s['held_cut']} of {s['held']} answers held to a response format "
            'reached max_tokens before it was complete (finish_reason "length": '
            "incomplete JSON); give them a larger max_tokens",
            file=stream,
        )
    if s["over_budget_bytes"] > 0:
        print(
            f"  WARNING: peak RSS exceeded the memory budget by "
            f"{s['over_budget_bytes'] / 1e6:,.1f} MB; lower memory.batch_size or raise "
            "memory.runtime_reserve (the plan is in OUTPUT.run/events.jsonl, infer_start)",
            file=stream,
        )
