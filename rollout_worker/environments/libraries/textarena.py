"""`--rollout.environment textarena:GAME-ID`: a single-player TextArena game, unchanged, as a text-step environment.

    reset(**row)   ta.make(GAME-ID) (with the wrappers TextArena registers for that id), then
                   env.reset(num_players=1, seed=row's seed); the observation is the game's opening messages
                   (its rules and board), appended to the row's prompt
    step(reply)    env.step(reply) (the registered action wrappers apply, e.g. brackets added to a bare move);
                   the observation is what the game said since (hints, boards, an invalid-move notice) as the next
                   user message; while the game goes on the reward is 0; when it ends, env.close()'s reward of
                   player 0 (TextArena scores a game once, at its end)

The player's own move is not repeated in the observation (the conversation holds it as the model's reply), and
TextArena's observation wrappers, which re-send the whole log every turn, are not used: the chat is the log.
A game cut by --rollout.max-turns before it ends scores 0. Games for two or more players are refused at start.
"""

from __future__ import annotations

import difflib
from typing import Any

from rollout_worker.environments.libraries.common import row_seed
from rollout_worker.environments.schema import EnvSpecError


def _import() -> Any:
    try:
        import textarena
    except ImportError as exc:
        from rollout_worker.environments.libraries import missing_library

        raise missing_library("textarena", exc) from None
    return textarena


def _innermost(env: Any, ta: Any) -> Any:
    """The game under TextArena's wrappers: its state holds the messages not yet shown to the player."""
    while isinstance(env, ta.Wrapper):
        env = env.env
    return env


class TextArenaGame:
    """One episode of a TextArena game, through brigade's text-step contract."""

    def __init__(self, game_id: str) -> None:
        ta = _import()
        self.game_id = game_id
        self.ta = ta
        self.env = ta.make(game_id)
        self.game = _innermost(self.env, ta)

    @classmethod
    async def check(cls, game_id: str) -> None:
        """The id is registered and the game can be played by one player (one reset, seed 0)."""
        ta = _import()
        from textarena.envs.registration import ENV_REGISTRY

        if game_id not in ENV_REGISTRY:
            close = difflib.get_close_matches(game_id, list(ENV_REGISTRY), n=5)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise EnvSpecError(f"TextArena {_version(ta)} has no game {game_id!r}{hint}")
        try:
            cls(game_id).reset(seed=0)
        except AssertionError as exc:  # TextArena's states assert their player count
            raise EnvSpecError(
                f"TextArena's {game_id} is not a single-player game ({exc}); brigade trains one model against a "
                "game, so multi-agent games are refused: name a single-player game such as GuessTheNumber-v0"
            ) from None
        except LookupError as exc:  # nltk's data (word games) is downloaded on first use: offline it is missing
            raise EnvSpecError(f"TextArena's {game_id} needs data it cannot find ({exc})") from None

    def reset(self, seed: Any = None, **row: Any) -> str:
        self.env.reset(num_players=1, seed=row_seed({**row, "seed": seed}))
        opening = self._news()
        return f"\n\n{opening}" if opening else ""

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        done, info = self.env.step(action)
        news = self._news()
        if not done:
            return news, 0.0, False, dict(info or {})
        rewards, _game_info = self.env.close()
        reward = float((rewards or {}).get(0, 0.0))
        return news, reward, True, dict(info or {})

    def _news(self) -> str:
        """The messages to player 0 since the last call, less its own moves."""
        _player, observation = self.game.get_observation()
        if isinstance(observation, str):
            return observation.strip()
        action = self.ta.ObservationType.PLAYER_ACTION
        return "\n".join(str(m[1]).strip() for m in observation or [] if len(m) < 3 or m[2] != action)


def _version(module: Any) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("textarena")
    except PackageNotFoundError:
        return getattr(module, "__version__", "")
