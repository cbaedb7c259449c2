"""Progress display: a tqdm bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class ProgressDisplay:
    def __init__(
        self,
        total: int,
        start: int,
        *,
        log_every: int,
        stream: TextIO | None = None,
        tty: bool | None = None,
        enabled: bool = True,
    ) -> None:
        """``enabled=False`` (ranks other than 0) prints nothing. ``stream``: the current
        ``sys.stderr`` unless given (looked up now, not at import)."""
        stream = stream if stream is not None else sys.stderr
        self.total, self.start, self.log_every, self.stream = total, start, log_every, stream
        self.enabled = enabled
        self.tty = enabled and (stream.isatty() if tty is None else tty)
        self._t0 = time.perf_counter()
        self._bar: Any = None
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                initial=start,
                file=stream,
                unit="step",
                dynamic_ncols=True,
                desc="finetune",
            )

    def update(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix(
                loss=f"{loss:.4f}", tok_s=rate_text(tokens_per_s), lr=f"{lr:.2e}", refresh=False
            )
            return
        if not self.enabled:
            return
        if step % self.log_every == 0 or step == self.total:
            done = step - self.start
            rate = done / max(time.perf_counter() - self._t0, 1e-9)
            eta = (self.total - step) / rate if rate > 0 else 0.0
            print(
                f"step {step}/{self.total} loss {loss:.4f} lr {lr:.2e} "
                f"tok/s {rate_text(tokens_per_s)} eta {_fmt_eta(eta)}",
                file=self.stream,
                flush=True,
            )

    def write(self, msg: str) -> None:
        if self._bar is not None:
            self._bar.write(msg, file=self.stream)
        elif self.enabled:
            print(msg, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def rate_text(per_s: float) -> str:
    """``12,345`` — or, below 10 (a 7B on a CPU: a few tokens a second), 3 significant
    digits, so a slow run does not read ``0``."""
    return f"{per_s:,.0f}" if per_s >= 10 else f"{per_s:.3g}"
