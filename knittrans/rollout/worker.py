"""Rollout worker loop: draw prompts per source, report supply, generate, reward, write units, register."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import os
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from knittrans.controlclient import ControlClient
from knittrans.descriptors import UnitDescriptor
from knittrans.errors import Conflict, InvalidRequest, KnitTransError, NotFound, Unavailable
from knittrans.lifecycle import TERMINAL
from knittrans.names import check_name
from knittrans.retry import DEFAULT_RETRY, RetryPolicy
from knittrans.rollout.engines import RolloutEngine, open_engine
from knittrans.rollout.generated import GeneratedGroup, GeneratedSample, PromptRequest, to_trajectory_group
from knittrans.rollout.vlm import VLMLayout, image_prompt_ids, is_vlm
from knittrans.rollout.writer import TrajectoryWriter
from knittrans.schema import Media, TrajectoryGroup

__all__ = [
    "RewardFn",
    "RolloutWorker",
    "RolloutWorkerConfig",
    "SourceProfile",
    "WeightLoads",
    "load_reward",
    "parity_reward",
]

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, np.ndarray, np.ndarray], float]
"""``reward(source, prompt_ids, response_ids) -> float``."""
T = TypeVar("T")

_REPLACE_ATTEMPTS = 3
"""Writes of a unit whose id the node already has (each after deleting that unit), before giving up."""


def _stable_seed(*parts: object) -> int:
    """A seed that is the same in every process (``hash()`` of strings is salted per process)."""
    return zlib.crc32(repr(parts).encode())


def parity_reward(source: str, prompt_ids: np.ndarray, response_ids: np.ndarray) -> float:
    """Demo reward: the fraction of even token ids in the response (learnable, cheap, deterministic)."""
    if response_ids.size == 0:
        return 0.0
    return float(np.mean(response_ids % 2 == 0))


def load_reward(spec: str) -> RewardFn:
    """``parity`` or ``package.module:function``."""
    if spec == "parity":
        return parity_reward
    module, _, name = spec.partition(":")
    if not module or not name:
        raise InvalidRequest(f"reward {spec!r}: use 'parity' or 'package.module:function'")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise InvalidRequest(f"reward {spec!r}: {name} is not a callable in {module}")
    return fn  # type: ignore[no-any-return]


@dataclass(frozen=True, kw_only=True)
class SourceProfile:
    """How prompts of one source look and how long its responses may get."""

    name: str
    """Source name (must have a quota in the job)."""
    prompt_len: tuple[int, int] = (8, 16)
    """Inclusive range of prompt lengths in tokens."""
    max_new_tokens: tuple[int, int] = (8, 16)
    """Inclusive range of the per-group response budget: the source's length profile."""
    image_shape: tuple[int, ...] | None = None
    """Shape of the uint8 image each group's prompt carries (shared by the group); None: text only.
    With ``image_min_shape`` set, the largest shape (each dimension drawn per image)."""
    image_min_shape: tuple[int, ...] | None = None
    """Smallest image shape when images vary in size; None: every image is ``image_shape``."""
    images: int = 1
    """Images per prompt (when ``image_shape`` is set)."""

    def __post_init__(self) -> None:
        check_name(self.name, "source")
        for what, (lo, hi) in (("prompt_len", self.prompt_len), ("max_new_tokens", self.max_new_tokens)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{self.name}.{what}: need 1 <= lo <= hi, got ({lo}, {hi})")
        if self.images < 1:
            raise ValueError(f"{self.name}.images must be >= 1, got {self.images}")
        low = self.image_min_shape
        if low is not None and (
            self.image_shape is None
            or len(low) != len(self.image_shape)
            or any(not 1 <= a <= b for a, b in zip(low, self.image_shape, strict=True))
        ):
            raise ValueError(f"{self.name}: image size ranges need 1 <= min <= max per dimension")

    @classmethod
    def parse(cls, text: str) -> SourceProfile:
        """``NAME:PMIN-PMAX:RMIN-RMAX[:image=CxHxW][:images=K]``; H and W may be ranges ``LO-HI``.

        E.g. ``mm:8-16:32-64:image=3x64-160x64-160:images=2``: two images per prompt, each of a
        random size between 64x64 and 160x160.
        """
        parts = text.split(":")
        try:
            name, prompt, resp = parts[0], parts[1], parts[2]
            image = low = None
            count = 1
            for extra in parts[3:]:
                key, _, value = extra.partition("=")
                if key == "image":
                    dims = [tuple(int(x) for x in d.split("-")) for d in value.split("x")]
                    image = tuple(d[-1] for d in dims)
                    low = tuple(d[0] for d in dims) if any(len(d) > 1 for d in dims) else None
                elif key == "images":
                    count = int(value)
                else:
                    raise ValueError(f"unknown option {key!r}")
            p = tuple(int(x) for x in prompt.split("-"))
            r = tuple(int(x) for x in resp.split("-"))
            return cls(
                name=name,
                prompt_len=(p[0], p[-1]),
                max_new_tokens=(r[0], r[-1]),
                image_shape=image,
                image_min_shape=low,
                images=count,
            )
        except (IndexError, ValueError) as exc:
            raise InvalidRequest(
                f"source {text!r}: expected NAME:PMIN-PMAX:RMIN-RMAX[:image=CxHxW][:images=K] ({exc})"
            ) from None


@dataclass(frozen=True, kw_only=True)
class RolloutWorkerConfig:
    """One rollout worker."""

    control_url: str
    """Control plane base URL."""
    job: str
    """Job name."""
    worker_id: str
    """Unique worker name; prefixes its group and unit ids."""
    node_id: str
    """Store node the worker writes to."""
    store_endpoint: str
    """Flight location of that node."""
    store_dir: str | None
    """The node's directory when it is on this host (direct writes); None uses DoPut."""
    sources: tuple[SourceProfile, ...]
    """Sources this worker generates."""
    model_dir: str
    """Initial policy (a transformers checkpoint directory)."""
    weights_dir: str
    """Where the trainer publishes ``policy-v<N>.safetensors``."""
    state_file: str
    """Worker state (next group sequence number, announced groups) for restarts."""
    engine: str = "hf"
    """``hf`` (transformers) or ``vllm``."""
    group_size: int = 4
    """Responses per prompt (must equal the job's group size)."""
    groups_per_call: int = 1
    """Groups generated one after the other and written together as one unit (one registration for several
    groups, but a finished group stays invisible to admission, and holds the window, until its partners
    finish: ``benchmarks/sim_report/README.md`` measures what 2 costs)."""
    temperature: float = 1.0
    """Sampling temperature."""
    chunk_tokens: int | None = None
    """Generate in chunks of this many tokens, picking up new weights between chunks."""
    vocab_size: int = 256
    """Prompt token ids are drawn from ``[0, vocab_size - 1)`` (the last id is EOS)."""
    reward: str = "parity"
    """Reward function: ``parity`` or ``package.module:function``."""
    seed: int = 0
    """Base seed of prompts and sampling."""
    token: str | None = None
    """Control-plane worker token."""
    store_token: str | None = None
    """Store token (DoPut path)."""
    weights_wait_s: float = 30.0
    """Longest wait for the weights file of a version the control plane reported (the trainer saves it before it
    reports the version, so on a shared filesystem it is there at once); past it the worker generates with the
    weights it has and counts the version as late."""
    wait_s: float = 5.0
    """Longest single wait on the headroom long-poll while the window is full (it answers as soon as room opens)."""
    store_retry: RetryPolicy = DEFAULT_RETRY
    """How long a store node that cannot be reached (restarting) is retried before the worker gives up."""

    def __post_init__(self) -> None:
        check_name(self.worker_id, "worker_id")
        if not self.sources:
            raise ValueError("a rollout worker needs at least one source")
        if self.group_size < 1 or self.groups_per_call < 1:
            raise ValueError("group_size and groups_per_call must be >= 1")
        if self.wait_s <= 0:
            raise ValueError(f"wait_s must be > 0, got {self.wait_s}")
        if not self.weights_wait_s >= 0:
            raise ValueError(f"weights_wait_s must be >= 0, got {self.weights_wait_s}")
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")


@dataclass
class WeightLoads:
    """A worker's cumulative weight-loading counters."""

    loads: int = 0
    """Weights files loaded."""
    late: int = 0
    """Reported versions whose file did not appear within ``weights_wait_s`` (generation went on with older
    weights)."""
    wait_s: float = 0.0
    """Seconds spent waiting for weights files."""


@dataclass
class _State:
    next_seq: int = 0
    announced: dict[str, str] = field(default_factory=dict)
    """group id -> source, announced as started but not yet registered."""
    sealed: dict[str, dict[str, Any]] = field(default_factory=dict)
    """unit id -> descriptor of units sealed on the store but not yet registered."""


class RolloutWorker:
    """Runs :meth:`run` until the job is completed or drained."""

    def __init__(self, config: RolloutWorkerConfig, *, engine: RolloutEngine | None = None) -> None:
        self.config = config
        self.control = ControlClient(config.control_url, token=config.token)
        self.engine = engine or open_engine(config.engine, config.model_dir)  # type: ignore[arg-type]
        self.writer = TrajectoryWriter(
            job=config.job,
            node_id=config.node_id,
            endpoint=config.store_endpoint,
            store_dir=config.store_dir,
            token=config.store_token,
        )
        self.reward = load_reward(config.reward)
        self.version = 0
        self.weights = WeightLoads()
        """Weights files loaded, versions found late and seconds waited (reported to the control plane)."""
        self._late: set[int] = set()
        self.groups_written = 0
        self._sources = {s.name: s for s in config.sources}
        self._layout: VLMLayout | None = VLMLayout.from_dir(config.model_dir) if is_vlm(config.model_dir) else None
        self._state = self._load_state()

    # ------------------------------------------------------------------ state file
    def _load_state(self) -> _State:
        path = Path(self.config.state_file)
        if not path.exists():
            return _State()
        return _State(**json.loads(path.read_text()))

    def _save_state(self) -> None:
        path = Path(self.config.state_file)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self._state)))
        os.replace(tmp, path)

    # ------------------------------------------------------------------ weights
    def maybe_update_weights(self) -> int:
        """Load the weights of the newest version the control plane reports, if newer than ours; return the
        version generation now uses (the one loaded, or the old one when the file came too late)."""
        latest = self.control.get_version(self.config.job)
        if latest <= self.version:
            return self.version
        path = Path(self.config.weights_dir) / f"policy-v{latest}.safetensors"
        waited = 0.0
        if latest not in self._late:  # a version already found late is not waited for again
            waited = self._wait_for(path)
            self.weights.wait_s += waited
        if not path.exists():
            if latest not in self._late:
                self._late.add(latest)
                self.weights.late += 1
                logger.warning(
                    "%s: version %d was reported but %s did not appear within %.1f s; generating with version %d",
                    self.config.worker_id,
                    latest,
                    path,
                    waited,
                    self.version,
                )
                self._report_weights(latest)
            return self.version
        self.engine.load_weights(path)
        self.version = latest
        self.weights.loads += 1
        self._late.discard(latest)
        logger.info("%s: loaded policy version %d (waited %.3f s)", self.config.worker_id, latest, waited)
        self._report_weights(latest)
        return self.version

    def _wait_for(self, path: Path) -> float:
        """Poll for ``path`` up to ``weights_wait_s`` (short sleeps growing to 0.2 s); return the seconds waited."""
        start = time.monotonic()
        pause = 0.005
        while not path.exists():
            left = self.config.weights_wait_s - (time.monotonic() - start)
            if left <= 0:
                break
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.2)
        return time.monotonic() - start

    def _report_weights(self, told: int) -> None:
        """Tell the control plane which weights we generate with (best effort: a failure is only logged)."""
        try:
            self.control.report_rollout_weights(
                self.config.job,
                self.config.worker_id,
                version=self.version,
                told=told,
                **dataclasses.asdict(self.weights),
            )
        except (Unavailable, NotFound, InvalidRequest) as exc:
            logger.warning("%s: could not report its weights: %s", self.config.worker_id, exc)

    # ------------------------------------------------------------------ generation
    def _prompt(self, group_id: str, profile: SourceProfile) -> PromptRequest:
        rng = np.random.default_rng(_stable_seed(self.config.seed, group_id, "prompt"))
        length = int(rng.integers(profile.prompt_len[0], profile.prompt_len[1] + 1))
        ids = rng.integers(0, self.config.vocab_size - 1, size=length, dtype=np.int32)
        media: tuple[Media, ...] = ()
        if profile.image_shape is not None:
            low = profile.image_min_shape or profile.image_shape
            shapes = [
                tuple(int(rng.integers(a, b + 1)) for a, b in zip(low, profile.image_shape, strict=True))
                for _ in range(profile.images)
            ]
            media = tuple(
                Media(kind="image", data=rng.integers(0, 256, size=shape, dtype=np.uint8)) for shape in shapes
            )
            if self._layout is not None:  # the VLM sees the images: one image block each before the text
                ids = image_prompt_ids(self._layout, ids, len(media))
        return PromptRequest(prompt_ids=ids, media=media)

    def _budget(self, group_id: str, profile: SourceProfile) -> int:
        rng = np.random.default_rng(_stable_seed(self.config.seed, group_id, "len"))
        return int(rng.integers(profile.max_new_tokens[0], profile.max_new_tokens[1] + 1))

    def generate(self, source: str, group_ids: Sequence[str]) -> list[TrajectoryGroup]:
        """Generate, reward and version-tag one group per id (chunked when ``chunk_tokens`` is set)."""
        profile = self._sources[source]
        n, temperature = self.config.group_size, self.config.temperature
        out: list[TrajectoryGroup] = []
        for gid in group_ids:
            request = self._prompt(gid, profile)
            budget = self._budget(gid, profile)
            chunk = self.config.chunk_tokens or budget
            seq_seed = _stable_seed(self.config.seed, gid, "sample") % 2**31
            start = self.maybe_update_weights()
            step = min(chunk, budget)
            first = self.engine.generate([request], n, step, temperature, seq_seed)[0]
            # per sample: its chunks, each with the policy version that generated it
            chunks: list[list[tuple[GeneratedSample, int]]] = [[(s, start)] for s in first.samples]
            produced = step
            live = [i for i in range(n) if first.samples[i].finish_reason != "stop"]
            while produced < budget and live:
                step = min(chunk, budget - produced)
                version = self.maybe_update_weights()
                prompts = [
                    PromptRequest(
                        prompt_ids=np.concatenate([request.prompt_ids, *(s.response_ids for s, _ in chunks[i])]),
                        media=request.media,
                    )
                    for i in live
                ]
                for i, g in zip(
                    live, self.engine.generate(prompts, 1, step, temperature, seq_seed + produced), strict=True
                ):
                    chunks[i].append((g.samples[0], version))
                produced += step
                live = [i for i in live if chunks[i][-1][0].finish_reason != "stop"]
            final = GeneratedGroup(
                prompt_ids=request.prompt_ids,
                samples=tuple(
                    GeneratedSample(
                        response_ids=np.concatenate([s.response_ids for s, _ in c]),
                        response_logprobs=np.concatenate([s.response_logprobs for s, _ in c]),
                        finish_reason=c[-1][0].finish_reason,
                    )
                    for c in chunks
                ),
                media=request.media,
            )
            per_token = [np.concatenate([np.full(s.num_tokens, v, dtype=np.float64) for s, v in c]) for c in chunks]
            vw = [float(v.mean()) if v.size else float(start) for v in per_token]
            ve = [int(v.max()) if v.size else start for v in per_token]
            rewards = [self.reward(source, final.prompt_ids, s.response_ids) for s in final.samples]
            out.append(
                to_trajectory_group(
                    final,
                    group_id=gid,
                    source=source,
                    rewards=rewards,
                    version_start=start,
                    version_end=ve,
                    version_weighted=vw,
                )
            )
        return out

    # ------------------------------------------------------------------ main loop
    def _produce(self, source: str, group_ids: list[str]) -> None:
        """Generate, seal, remember the descriptor, register: a crash at any point can be resumed."""
        groups = self.generate(source, group_ids)
        unit_id = f"u-{group_ids[0]}"

        descriptor = self._on_store(lambda: self._store_replacing(groups, unit_id))
        self._state.sealed[unit_id] = descriptor.to_dict()
        self._save_state()
        self._register(unit_id)
        self.groups_written += len(group_ids)

    def _store_replacing(self, groups: list[TrajectoryGroup], unit_id: str) -> UnitDescriptor:
        """Write ``groups`` as ``unit_id``, replacing a unit of that id the node already has: one a crash left,
        never registered, possibly still being published by a killed predecessor, so the delete may find
        nothing and the write may meet the unit again (architecture.md, failure model); retried a few times."""
        for _ in range(_REPLACE_ATTEMPTS - 1):
            try:
                return self.writer.write_groups(groups, unit_id=unit_id)
            except Conflict as exc:
                logger.info(
                    "%s: unit %s is on the node already (%s): replacing it", self.config.worker_id, unit_id, exc
                )
            with contextlib.suppress(NotFound):  # gone meanwhile: the predecessor's publish was aborted
                self.writer.client.delete(self.config.job, unit_id)
        return self.writer.write_groups(groups, unit_id=unit_id)  # a last Conflict is raised

    def _on_store(self, call: Callable[[], T]) -> T:
        """``call()`` against the store node, retried under ``store_retry`` while the node cannot be reached
        (a store restarting on its port and directory); other errors, and the last ``Unavailable``, raise."""
        pauses = self.config.store_retry.pauses()
        while True:
            try:
                return call()
            except Unavailable as exc:
                self._pause(pauses, exc)

    def _pause(self, pauses: Iterator[float], exc: KnitTransError) -> None:
        """Sleep the next of ``pauses`` (a ``store_retry`` schedule) after ``exc``, logged; once the schedule is spent,
        raise ``exc``: the one retry step of :meth:`_on_store` and :meth:`_register`."""
        pause = next(pauses, None)
        if pause is None:
            raise exc
        logger.warning("%s: %s; retrying in %.2f s", self.config.worker_id, exc, pause)
        time.sleep(pause)

    def _register(self, unit_id: str) -> None:
        descriptor = self._state.sealed[unit_id]
        pauses = self.config.store_retry.pauses()
        while True:
            try:
                self.control.register_units(self.config.job, [descriptor])
                break
            except Conflict as exc:
                if not self._node_lost():  # a group of it is registered already: the first incarnation stands
                    logger.warning("%s: %s; keeping the registered copy", self.config.worker_id, exc)
                    with contextlib.suppress(NotFound):  # ours is gone already: nothing to remove
                        self._on_store(lambda: self.writer.client.delete(self.config.job, unit_id))
                    break
                # refused for its node, declared lost, whose store registers it again at its next heartbeat (past
                # store_retry the worker ends: a restart registers the unit from the state file)
                self._pause(pauses, exc)
        for g in descriptor["groups"]:
            self._state.announced.pop(g["group_id"], None)
        del self._state.sealed[unit_id]
        self._save_state()

    def _node_lost(self) -> bool:
        """Whether the control plane holds the worker's store node as lost (it refuses units on it until then)."""
        return any(n["node_id"] == self.config.node_id and n["state"] == "lost" for n in self.control.list_nodes())

    def _announce(self, source: str, group_ids: list[str], view: dict[str, Any]) -> None:
        """Report ``group_ids`` as started, claiming as many lost groups of ``source`` (status ``to_regenerate``,
        oldest first) for them to replace.

        When a store node is lost, the control plane lists the unadmitted groups that were on it (and groups
        retired past the staleness bound) in ``to_regenerate``. Any worker that generates the same source may
        replace them: it starts fresh group ids as usual (so supply accounting stays exact) and names the lost
        ids in the same supply report, which removes them from the list. Two workers may race for the same ids;
        the control plane refuses the whole report then (``Conflict``, nothing applied), and the loser reports its
        groups again without claims.
        """
        job, started = self.config.job, {source: group_ids}
        waiting = [r for r in view.get("to_regenerate", ()) if r.get("source") == source]
        waiting.sort(key=lambda r: (r.get("at", 0.0), r["group_id"]))
        if claims := [r["group_id"] for r in waiting[: len(group_ids)]]:
            try:
                self.control.report_supply(job, group_ids=started, regenerates=claims)
                logger.info("job %s: new groups %s replace lost groups %s", job, group_ids, claims)
                return
            except Conflict as exc:  # another worker claimed them first; nothing was applied
                logger.info("job %s: regeneration claim refused (%s); announcing without claims", job, exc)
        self.control.report_supply(job, group_ids=started)

    def run(self, *, max_groups: int | None = None) -> int:
        """Generate until the job is completed or drained (or ``max_groups`` were written); return groups written."""
        cfg = self.config
        for unit_id in list(self._state.sealed):  # restarted: register what was sealed before the crash
            logger.info("%s: registering unit %s sealed before a restart", cfg.worker_id, unit_id)
            self._register(unit_id)
        if self._state.announced:  # restarted: finish what was announced before the crash, same ids
            by_source: dict[str, list[str]] = {}
            for gid, source in sorted(self._state.announced.items()):
                by_source.setdefault(source, []).append(gid)
            for source, ids in by_source.items():
                logger.info("%s: regenerating %d announced groups after a restart", cfg.worker_id, len(ids))
                self._produce(source, ids)
        while max_groups is None or self.groups_written < max_groups:
            view = self.control.headroom(cfg.job, wait_s=cfg.wait_s, sources=list(self._sources))
            if view["state"] in TERMINAL:
                break
            mine = [s for s in view["launch_order"] if s in self._sources and view["headroom"].get(s, 0) > 0]
            if not mine:
                continue  # the long-poll already waited (no room for our sources yet)
            source = mine[0]
            count = min(cfg.groups_per_call, int(view["headroom"][source]))
            ids = [f"{cfg.worker_id}-g{self._state.next_seq + i}" for i in range(count)]
            self._state.next_seq += count
            self._state.announced.update({gid: source for gid in ids})
            self._save_state()
            self._announce(source, ids, view)
            self._produce(source, ids)
        return self.groups_written

    def close(self) -> None:
        """Release the engine and clients (the writer's Flight channel and data-lane connection too)."""
        self.engine.close()
        self.writer.close()
        self.control.close()
