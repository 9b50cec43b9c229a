"""Long turns in which several tokens decide: write a call, among free words, that the observation
determines (the credit study's round-2 tasks).

``synthetic-calls``: each turn the observation names a room (``<at> rX`` and filler); the agent
writes ``turn_length`` words (32), among which the first ``call`` followed by two words is its
call, ``call tT aA``, wherever it puts it. The call is right iff T and A are the room's tool and
argument in two fixed hidden tables (so each argument depends on the observation, and the
policy must learn the tables). A right call moves the agent to the next room of the episode; the
episode always lasts ``calls`` turns and the reward, 1 iff every call was right, comes at the
end. Three tokens of a 32-word turn decide (``call``, the tool, the argument), at positions the
policy chooses: within a turn some tokens deserve far more credit than others, which is what
MPO's mean-centred intra-turn trace is for. ``info["action_quality"]`` grades each turn: +1 for a
right call, -1 for a wrong or missing one.

``synthetic-calls-varlen``: the same with turns the policy ends itself with ``<eot>`` (a stop
word), 64 words at most; scripted and demonstration turns take 8 to 64 words, so turns of very
different lengths meet in a batch, where a product turn ratio and a mean turn ratio differ most.

Instances are room sequences (``rooms ** calls`` of them), split 80/20 by the shared seeded split
(held-out instances are sequences training never draws). A uniformly random turn almost never
holds a right call (random success is about 0), so these tasks are for warm-started policies:
`CallTask.demo_turn` is the scripted turn with a chosen amount of noise, which ``python -m train.sft
--demo-noise`` imitates.
"""

from __future__ import annotations

import itertools

import numpy as np

from envs.base import Observation, StepResult
from envs.registry import register
from envs.synthetic import SPECIALS, WordCodec, _WordTask

__all__ = ["CallTask"]

EOT = "<eot>"


class CallTask(_WordTask):
    """Args: seed, split, rooms, tools, args (table sizes), calls (turns an episode), turn_length
    (words a turn; with ``variable`` the most words, the turn ends at ``<eot>``), variable,
    min_length (the shortest scripted turn when variable), obs_len, scratch_words,
    table_seed (the hidden tables)."""

    def __init__(
        self,
        *,
        seed: int = 0,
        split: str = "train",
        rooms: int = 8,
        tools: int = 4,
        args: int = 6,
        calls: int = 4,
        turn_length: int = 32,
        variable: bool = False,
        min_length: int = 8,
        obs_len: int = 2,
        scratch_words: int = 4,
        table_seed: int = 4321,
    ):
        if turn_length < 3 or calls < 1 or rooms < 2 or obs_len < 2:
            raise ValueError(
                "calls: need turn_length >= 3 (a call is three words), calls >= 1, rooms >= 2, "
                f"obs_len >= 2; got {turn_length}, {calls}, {rooms}, {obs_len}"
            )
        if variable and not 3 <= min_length <= turn_length:
            raise ValueError(f"min_length: must be in [3, {turn_length}], got {min_length}")
        self.rooms, self.tools, self.args = rooms, tools, args
        self.max_turns, self.turn_length, self.obs_len = calls, turn_length, obs_len
        self.variable, self.min_length = variable, min_length
        self.scratch_words = scratch_words
        tables = np.random.default_rng(table_seed)
        self.tool_of = tables.integers(tools, size=rooms)
        self.arg_of = tables.integers(args, size=rooms)
        vocabulary = (
            SPECIALS
            + [f"r{i}" for i in range(rooms)]
            + [f"t{i}" for i in range(tools)]
            + [f"a{i}" for i in range(args)]
            + ["call"]
            + [f"s{i}" for i in range(scratch_words)]
            + [f"o{i}" for i in range(4)]
            + ([EOT] if variable else [])
        )
        codec = WordCodec(vocabulary)
        if variable:  # the policy ends its turns: <eot> stops the sampler and closes a cut turn
            codec.stop_ids = codec.end_of_turn = (codec.index[EOT],)
        instances = list(itertools.product(range(rooms), repeat=calls))
        super().__init__(seed=seed, split=split, instances=instances, codec=codec)
        self.turns, self.right = 0, 0

    def max_episode_tokens(self, codec=None) -> int:
        """Prompt, ``calls`` turns (with their ``<eot>`` when variable), observations between."""
        turn = self.turn_length + (1 if self.variable else 0)
        return 5 + self.max_turns * turn + (self.max_turns - 1) * self.obs_len

    @property
    def turn_budget(self) -> int:
        return self.turn_length + (1 if self.variable else 0)

    @property
    def room(self) -> int:
        return self.instance[min(self.turns, self.max_turns - 1)]

    def reset(self) -> list[dict]:
        self._draw()
        self.turns, self.right = 0, 0
        return [{"role": "user", "content": f"<bos> <goal> r{self.instance[-1]} <at> r{self.room}"}]

    @property
    def state_key(self) -> tuple:
        return (self.room, self.turns, self.right)

    @property
    def gold_answer(self) -> str:
        """The episode's whole solution: its right calls in order (what TRACE scores)."""
        return " ".join(self.call_text(room) for room in self.instance)

    def call_text(self, room: int) -> str:
        return f"call t{self.tool_of[room]} a{self.arg_of[room]}"

    def _call(self, text: str) -> tuple[int, int] | None:
        """(tool, argument) of the turn's first well-formed call, or None."""
        words = text.split()
        if self.variable and EOT in words:
            words = words[: words.index(EOT)]
        for i, w in enumerate(words[:-2]):
            if w == "call":
                tool, arg = words[i + 1], words[i + 2]
                if tool[:1] == "t" and tool[1:].isdigit() and arg[:1] == "a" and arg[1:].isdigit():
                    return int(tool[1:]), int(arg[1:])
                return None
        return None

    def step(self, text: str) -> StepResult:
        key = self.state_key
        room = self.room
        call = self._call(text)
        right = call == (self.tool_of[room], self.arg_of[room])
        self.right += int(right)
        self.turns += 1
        done = self.turns >= self.max_turns
        success = done and self.right == self.max_turns
        info = {
            "state_key": key,
            "success": success,
            "action_quality": 1.0 if right else -1.0,
            "gold_answer": self.gold_answer,
            "tool_calls": self.turns,
        }
        head = ["<at>" if right else "<invalid>", f"r{self.room}"]
        obs = Observation(user=self._words(head, lambda i: f"o{i % 4}"))
        return StepResult(obs, float(success), done, False, info)

    # -- scripted policies ------------------------------------------------------------------

    def demo_turn(self, rng: np.random.Generator | None = None, noise: float = 0.0) -> str:
        """A scripted turn: free words with the room's right call at a random position (fixed
        length, or 8 to 64 words; a scripted policy ends it with the codec's stop word); with
        probability ``noise`` the call is wrong (another tool or argument) or missing."""
        rng = rng or np.random.default_rng()
        length = self.turn_length
        if self.variable:
            length = int(rng.integers(self.min_length, self.turn_length + 1))
        words = [f"s{int(rng.integers(self.scratch_words))}" for _ in range(length)]
        room = self.room
        tool, arg = int(self.tool_of[room]), int(self.arg_of[room])
        if rng.random() < noise:
            if rng.random() < 0.3:  # no call at all
                tool = None
            elif rng.random() < 0.5:
                tool = (tool + int(rng.integers(1, self.tools))) % self.tools
            else:
                arg = (arg + int(rng.integers(1, self.args))) % self.args
        if tool is not None:
            at = int(rng.integers(0, length - 2))
            words[at : at + 3] = ["call", f"t{tool}", f"a{arg}"]
        return " ".join(words)

    def optimal_turn(self) -> str:
        """The scripted optimal policy (no noise; the shortest turn when variable)."""
        words = ["s0"] * ((self.min_length if self.variable else self.turn_length) - 3)
        return " ".join(words + self.call_text(self.room).split())


register("synthetic-calls", CallTask)
register(
    "synthetic-calls-varlen",
    lambda seed=0, **kw: CallTask(seed=seed, **{"variable": True, "turn_length": 64, **kw}),
)
