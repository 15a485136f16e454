"""One token stream per episode, grown turn by turn and never re-tokenized.

The stream starts as the prompt's tokens (the conversation rendered with the chat template and its generation
prompt, by the replicas' tokenizer through the proxy's /tokenize). Each turn then appends:

1. the exact token ids the model sampled (loss mask 1, vLLM's logprobs), as the replica returned them;
2. the template tokens that close the assistant's message, less what the sampled tokens already hold (a reply
   that ended on its end-of-turn token already has `<|im_end|>`; only the template's "\n" after it is added);
3. the template tokens of the new messages (tool results, the environment's next observation) and the next
   generation prompt (loss mask 0).

(2) and (3) are differences of renderings, never re-tokenized text of earlier turns. With C = the conversation
so far, A its rendering with the generation prompt (what the stream held before the reply; kept from the turn
before, so a turn costs three /tokenize calls):
   closing = render(C + [assistant ""]) after A             (the template's end of an assistant message)
   new     = render(C + [assistant reply] + new, gen prompt) after render(C + [assistant reply])
Each "after" is checked to be an extension (the shorter rendering a prefix of the longer); a template that is
not prefix-preserving (one that rewrites earlier turns, as templates that strip past reasoning do) fails the
episode with an error that says so, instead of training on a stream the model never saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bucket.rollouts import Turn
from rollout_worker.environments.contract import EnvError
from rollout_worker.generation import Generator


class TemplateNotPrefixPreserving(EnvError):
    """The chat template renders a longer conversation with other tokens where the shorter one's were."""


class Renderer:
    """Conversations to token ids with the replicas' chat template, through the proxy's /tokenize."""

    def __init__(self, generator: Generator):
        self.generator = generator
        self.tools_rendered: dict[str, bool] = {}  # per tool set: whether the template renders `tools` at all

    async def render(
        self, messages: list[dict[str, Any]], generation_prompt: bool, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        body: dict[str, Any] = {
            "model": self.generator.base_model,
            "messages": messages,
            "add_generation_prompt": generation_prompt,
        }
        if tools:
            body["tools"] = tools
        resp = await self.generator._post("/tokenize", body)
        return list(resp.json()["tokens"])

    async def renders_tools(self, tools: list[dict[str, Any]]) -> bool:
        """Whether the template puts `tools` in the prompt (SmolLM2's does not: the worker then lists them)."""
        key = repr(tools)
        if key not in self.tools_rendered:
            probe = [{"role": "user", "content": "hello"}]
            with_tools = await self.render(probe, True, tools)
            self.tools_rendered[key] = with_tools != await self.render(probe, True)
        return self.tools_rendered[key]


def extension(longer: list[int], shorter: list[int], what: str) -> list[int]:
    """The tokens `longer` adds after `shorter`, once `shorter` is checked to be its prefix."""
    if longer[: len(shorter)] != shorter:
        at = next((i for i, (a, b) in enumerate(zip(longer, shorter)) if a != b), min(len(longer), len(shorter)))
        raise TemplateNotPrefixPreserving(
            f"the chat template is not prefix-preserving: rendering {what} changes token {at} of the conversation "
            f"before it ({shorter[at : at + 4]} became {longer[at : at + 4]}); an episode's stream can only grow "
            "by appending, so use a template that renders earlier turns unchanged"
        )
    return longer[len(shorter) :]


def overlap(sampled: list[int], closing: list[int]) -> int:
    """How many of the closing tokens the sampled ones already end with (an end-of-turn token, usually)."""
    for k in range(min(len(sampled), len(closing)), 0, -1):
        if sampled[-k:] == closing[:k]:
            return k
    return 0


@dataclass
class Stream:
    """An episode's tokens after the prompt, with the loss mask, logprobs and the span each turn sampled."""

    prompt_ids: list[int]
    tools: list[dict[str, Any]] | None = None  # given to the template when it renders them itself
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    rendered: list[int] = field(default_factory=list)  # the last rendering with a generation prompt

    def __post_init__(self) -> None:
        self.rendered = self.rendered or list(self.prompt_ids)

    @property
    def tokens(self) -> list[int]:
        """The whole stream, prompt included: what the next turn's request sends as its prompt."""
        return self.prompt_ids + self.ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def add_sampled(self, ids: list[int], logprobs: list[float], version: int, replica: str) -> None:
        if ids:
            self.turns.append(Turn(start=len(self.ids), end=len(self.ids) + len(ids), version=version, replica=replica))
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += logprobs

    def add_context(self, ids: list[int]) -> None:
        """Template, environment or tool tokens: in the stream, never trained on."""
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
