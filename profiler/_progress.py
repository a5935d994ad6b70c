"""A progress bar on stderr for long sweeps: tqdm (an Optuna dependency) when importable,
else one line rewritten with `\\r`. Disabled, it prints nothing."""

from __future__ import annotations

import sys
from types import TracebackType


class Progress:
    """`with Progress(total, label, enabled=...) as bar: ... bar.advance(note)`."""

    def __init__(self, total: int, label: str, *, enabled: bool) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.done = 0
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, desc=label, file=sys.stderr, leave=True)

    def advance(self, note: str = "") -> None:
        """One more point done; `note` says what it was."""
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(1)
            return
        sys.stderr.write(f"\r{self.label}: {self.done}/{self.total} {note[:40]:<40}")
        sys.stderr.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            sys.stderr.write("\n")
