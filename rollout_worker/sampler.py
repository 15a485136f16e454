"""Which prompt comes next: seeded shuffles epoch after epoch, a curriculum over levels, a cursor in the bucket.

Prompts of a level are handed out in a seeded order that is reshuffled every
epoch (the order of epoch e depends only on the seed, the level and e), so a
position along the level's sequence names one prompt for good. The cursor
records, per level, the first position whose group is not yet written (every
earlier one is), and the current level; a worker restarted with the same id
continues from there (bucket/datacursor.py).

Curriculum: when the dataset has a `level` column, prompts come from the
lowest level first; once the mean reward of the last `window` groups of the
current level reaches `threshold`, the next level starts. A new level adds its
prompts to the earlier ones, it does not replace them (`mix` "informative"):
each prompt comes from a level drawn among those reached, weighted by the share
of that level's recent groups whose rewards were not all equal (the groups that
still teach something), so a mastered level is asked rarely but never dropped,
and one the model starts to forget is asked more again. With `mix` "newest"
every prompt comes from the current level alone, as before issue 34: the
built-in sums then trained only on operands above 50 once level 2 started,
while the held-out set has operands up to 50, and a 100-step run lost 9 points
of held-out accuracy after its peak. The evaluation set is not touched by any
of this (rollout_worker/prompts.py).
"""

from __future__ import annotations

import logging
import random
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

from bucket.datacursor import DataCursor
from rollout_worker.prompts import PromptData

log = logging.getLogger("brigade.rollout")

Mix = Literal["informative", "newest"]


@dataclass(frozen=True)
class Ticket:
    """One prompt handed out: its level and position along that level's sequence."""

    level: int
    position: int


class PromptSampler:
    def __init__(
        self,
        data: PromptData,
        worker: str,
        seed: int,
        num_epochs: int = 0,
        curriculum: bool = True,
        threshold: float = 0.75,
        window: int = 8,
        cursor: DataCursor | None = None,
        mix: Mix = "informative",
    ):
        self.train, self.worker, self.seed, self.num_epochs = data.train, worker, seed, num_epochs
        self.fingerprint = f"{data.fingerprint}-seed{seed}"  # positions name prompts only under one order
        self.threshold, self.window, self.mix = threshold, window, mix
        if curriculum and "level" in self.train.column_names:
            by_level: dict[int, list[int]] = {}
            for i, lv in enumerate(self.train["level"]):
                by_level.setdefault(int(lv), []).append(i)
            self.levels = [by_level[k] for k in sorted(by_level)]
            self.level_names = sorted(by_level)
        else:
            self.levels, self.level_names = [list(range(len(self.train)))], [0]
        self.level = 0
        self.next_pos = [0] * len(self.levels)  # next position to hand out, per level
        self.written = [0] * len(self.levels)  # every position below is written, per level
        self.done_ahead: list[set[int]] = [set() for _ in self.levels]  # written positions above `written`
        self.recent: deque[float] = deque(maxlen=window)
        # per level: whether each of its last `window` scored groups had rewards that were not all equal
        self.informative: list[deque[bool]] = [deque(maxlen=window) for _ in self.levels]
        self._pick = random.Random(f"{seed}/mix")  # which level the next prompt comes from (not resumed: any is fine)
        self._orders: dict[tuple[int, int], list[int]] = {}
        if cursor is not None and cursor.dataset == self.fingerprint:
            self.level = min(cursor.level, len(self.levels) - 1)
            for k, pos in cursor.positions.items():
                if k.isdigit() and int(k) < len(self.levels):
                    self.next_pos[int(k)] = self.written[int(k)] = pos
            log.info("continuing the prompt data from the bucket's cursor: level %d, %s", self.level, cursor.positions)
        elif cursor is not None:
            log.info("the bucket's data cursor is for other data; starting the data from the beginning")

    def _order(self, level: int, epoch: int) -> list[int]:
        key = (level, epoch)
        if key not in self._orders:
            order = list(self.levels[level])
            random.Random(f"{self.seed}/{level}/{epoch}").shuffle(order)
            # keep what is in flight: this level's last epoch, every other level's orders
            self._orders = {k: v for k, v in self._orders.items() if k[0] != level or k[1] >= epoch - 1}
            self._orders[key] = order
        return self._orders[key]

    def exhausted(self, level: int | None = None) -> bool:
        level = self.level if level is None else level
        n = len(self.levels[level])
        return bool(self.num_epochs) and self.next_pos[level] >= self.num_epochs * n

    def weights(self) -> list[float]:
        """The chance of each level reached to give the next prompt: its recent groups' informative share,
        smoothed by one informative and one uninformative group (so a level with no groups yet weighs 1/2 and a
        mastered one about 1 / (window + 2), never 0)."""
        if self.mix == "newest":
            return [0.0] * self.level + [1.0]
        return [(1 + sum(d)) / (2 + len(d)) for d in self.informative[: self.level + 1]]

    def next(self) -> tuple[Ticket, dict[str, Any]] | None:
        """The next prompt's row, or None once `num_epochs` epochs of the current level are handed out."""
        if self.exhausted():
            return None
        level = self.level
        if level > 0:
            open_levels = [k for k in range(level + 1) if not self.exhausted(k)]
            weights = self.weights()
            level = self._pick.choices(open_levels, [weights[k] for k in open_levels])[0]
        pos = self.next_pos[level]
        self.next_pos[level] += 1
        n = len(self.levels[level])
        row = dict(self.train[self._order(level, pos // n)[pos % n]])
        return Ticket(level, pos), row

    def written_out(self, ticket: Ticket) -> None:
        """The ticket's group is in the bucket (or failed for good): the cursor may move past it."""
        ahead = self.done_ahead[ticket.level]
        ahead.add(ticket.position)
        while self.written[ticket.level] in ahead:
            ahead.discard(self.written[ticket.level])
            self.written[ticket.level] += 1

    def observe(self, ticket: Ticket, mean_reward: float, informative: bool = True) -> bool:
        """A scored group's mean reward, and whether its rewards differed (a group of equal rewards teaches
        nothing); True when it moved the curriculum to the next level (only groups of the current level count)."""
        self.informative[ticket.level].append(informative)
        if ticket.level != self.level:
            return False
        self.recent.append(mean_reward)
        full = len(self.recent) == self.window
        if full and sum(self.recent) / self.window >= self.threshold and self.level + 1 < len(self.levels):
            self.level += 1
            self.recent.clear()
            return True
        return False

    @property
    def level_name(self) -> int:
        return self.level_names[self.level]

    def cursor(self) -> DataCursor:
        return DataCursor(
            worker=self.worker,
            dataset=self.fingerprint,
            level=self.level,
            positions={str(i): p for i, p in enumerate(self.written)},
        )
