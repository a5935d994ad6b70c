"""While a node's launch of a supervised run over several nodes runs: its supervisor beats
for the others and stops its own ranks when another node's launch ended in error or another
node's supervisor went silent (`hexiseq.cli.supervise_nodes`).

Without it a node's ranks wait on their lost peers until a collective's timeout: 10 minutes
on NCCL; gloo notices a closed socket at once, but not a machine that vanished. Stopped ranks
end with the launcher's own signal, so none counts as lost: the node reports its launch
ended and waits for node 0's decision. Limits: a node that vanishes before the nodes met
leaves the others in the rendezvous until its timeout (`RENDEZVOUS_TIMEOUT_S`); silence is
judged on this node's clock, from beats read off the shared folder.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hexiseq import supervision

BEAT_S = 2.0
"""How often a node's supervisor beats while its launch runs."""
PEER_POLL_S = 0.5
"""How often a node reads the other nodes' beats and reports while its launch runs."""
SILENT_S = 180.0
"""A node whose supervisor beat and then stopped for this long is gone with its machine: far
above `BEAT_S`, and above the 60 s a network file system may cache what it read."""


@dataclass
class PeerWatch:
    """A node's watch (module docstring), as a thread while its launch runs. Another node's
    silence counts only once it has beaten: before, it has not started yet."""

    exchange: Path
    index: int
    nodes: int
    stop_ranks: Callable[[], int]
    """Stops this node's ranks; how many it stopped (none yet: they start after the others
    meet)."""
    clock: Callable[[], float] = time.monotonic
    beats: int = 0
    heard: dict[int, tuple[int, float]] = field(default_factory=dict)
    """Per other node: its last beat and when this node first saw it."""
    stopped: str | None = None
    """Why this node's ranks were stopped (None: they were not)."""
    _done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name="hexiseq-peer-watch", daemon=True)
        thread.start()
        return thread

    def stop(self, thread: threading.Thread) -> None:
        self._done.set()
        thread.join()

    def _run(self) -> None:
        next_beat = self.clock()
        while not self._done.is_set():
            try:
                if self.clock() >= next_beat:
                    self.beat()
                    next_beat = self.clock() + BEAT_S
                self.check()
            except (OSError, ValueError) as error:  # the shared folder failing: try again
                print(
                    f"hexiseq run: node {self.index} could not read or write its beat "
                    f"({type(error).__name__}: {error}); trying again",
                    file=sys.stderr,
                )
            self._done.wait(PEER_POLL_S)

    def beat(self) -> None:
        self.beats += 1
        supervision.write_json(supervision.beat_path(self.exchange, self.index), self.beats)

    def check(self) -> None:
        """Stop this node's ranks when another node's launch ended in error or went silent."""
        if self.stopped is not None:
            return
        why = self.reason()
        if why is not None and self.stop_ranks() > 0:
            self.stopped = why
            print(f"hexiseq run: node {self.index} stops its ranks: {why}", flush=True)

    def reason(self) -> str | None:
        """Why this node's ranks should stop now (None: they should not)."""
        now = self.clock()
        for node in range(self.nodes):
            if node == self.index:
                continue
            ended = supervision.read_json(supervision.ended_path(self.exchange, node))
            if ended is not None and ended.get("code") != 0:
                return f"node {node}'s launch ended in error"
            beat = supervision.read_json(supervision.beat_path(self.exchange, node))
            if beat is None or ended is not None:
                continue  # not started yet, or finished
            if node not in self.heard or self.heard[node][0] != beat:
                self.heard[node] = (beat, now)
            elif now - self.heard[node][1] > SILENT_S:
                return f"node {node}'s supervisor has been silent for {SILENT_S:.0f} s"
        return None
