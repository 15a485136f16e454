"""Where each episode lives: an environment episode's turns are separate requests, each re-sending the whole
conversation, and belong on the replica that holds the episode in its KV cache.

Prefix hashes alone cannot keep them there: the G episodes of a group start from one prompt, so from the second
turn on that prompt's blocks are shared by G distinct prompts and count as template (router.py), which says
nothing about where an episode lives. The rollout worker names each episode (the `X-Session-ID` header); the
router remembers the replica that served its last turn here. Pure: no I/O, no clock; bounded (least recently
used episodes are forgotten first, as a finished episode never says it ended).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class Episode:
    replica: str
    prompt_tokens: int  # the last turn's prompt: what the replica holds of the next one at least


class Sessions:
    def __init__(self, max_sessions: int = 100_000) -> None:
        self.max_sessions = max_sessions
        self._homes: OrderedDict[str, Episode] = OrderedDict()
        self.kept = 0  # turns sent where their episode lives
        self.moved = 0  # turns whose episode had to move (its replica left, drains or was over the load bound)

    def __len__(self) -> int:
        return len(self._homes)

    def home(self, session: str) -> Episode | None:
        return self._homes.get(session)

    def remember(self, session: str, replica: str, prompt_tokens: int) -> None:
        homes = self._homes
        before = homes.get(session)
        if before is not None:
            if before.replica == replica:
                self.kept += 1
            else:
                self.moved += 1
        homes[session] = Episode(replica, prompt_tokens)
        homes.move_to_end(session)
        while len(homes) > self.max_sessions:
            homes.popitem(last=False)

    def forget_replicas(self, removed: Iterable[str]) -> None:
        """A removed replica's cache is gone: its episodes are placed again at their next turn."""
        gone = set(removed)
        for session in [s for s, e in self._homes.items() if e.replica in gone]:
            del self._homes[session]
