"""Learn jobs: accepted onto disk first, queued per adapter, trained one at a time beside serving, published
as new adapter versions. A restarted process finds unfinished jobs in the store and runs them."""
from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import json
import logging
import os
import re
import threading
import time
import zlib
from collections import deque
from pathlib import Path
from typing import Callable

import torch

from ..config import LearnConfig, LoraConfig
from ..engine.green import split
from ..engine.loan import KVLender
from ..errors import DarkError, InvalidRequestError
from ..lora.weights import AdapterWeights
from ..store.db import Store
from .data import normalize_examples
from .trainer import ANCHOR_TOKENS, Trainer, load_optimizer_state, save_optimizer_state

log = logging.getLogger(__name__)

ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def training_stream(device: torch.device, sms: int):
    """(green context, stream) whose kernels run on `sms` of the device's SMs only, so serving keeps the others to
    itself: a decode step's ~350 small kernels then never wait behind a training GEMM's thread blocks.
    Falls back to (None, a low-priority stream on every SM) where green contexts are missing."""
    total = torch.cuda.get_device_properties(device).multi_processor_count
    if 0 < sms < total:
        key = (device.index or 0, sms)
        if key not in _GREEN:
            try:
                from torch.cuda.green_contexts import GreenContext

                ctx = GreenContext.create(num_sms=sms, device_id=key[0])
                _GREEN[key] = (ctx, ctx.Stream())
                # never destroyed: memory the caching allocator handed out on its stream can be freed as late as
                # interpreter shutdown, and freeing it after the context is gone aborts the process
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(ctx))
                log.info("learn jobs run on %d of the %d SMs while serving (CUDA green context)", sms, total)
            except Exception as e:  # an older driver or torch build
                log.warning("train_sms=%d: no CUDA green context (%s); training shares every SM with serving", sms, e)
                _GREEN[key] = (None, None)
        ctx, stream = _GREEN[key]
        if ctx is not None:
            return ctx, stream
    return None, torch.cuda.Stream(device=device, priority=0)


def partitions(device: torch.device, train_sms: int):
    """(serving's partition, training's partition of at least train_sms SMs: the driver rounds up to its
    granularity, 8 on Hopper), disjoint, made once per process and size; None where the driver cannot split the
    device, and unless DARK_SPLIT_SMS=1 (off by default: it trades decode latency for training rate, see
    Learner.set_train_sms)."""
    if os.environ.get("DARK_SPLIT_SMS", "0") == "0":
        return None
    key = (device.index or 0, train_sms)
    if key not in _SPLITS:
        try:
            train, serve = split(device, train_sms, priorities=(0, -1))
            _SPLITS[key] = serve, train
            log.info("while a learn job runs beside serving: training on %d SMs, serving on the other %d",
                     train.sms, serve.sms)
        except (RuntimeError, OSError, AttributeError) as e:  # an older driver: no green contexts or no split
            log.warning("no split of the SMs (%s); training keeps to a green context and serving uses every SM", e)
            _SPLITS[key] = None
    return _SPLITS[key]


_SPLITS: dict[tuple[int, int], tuple | None] = {}

# the warm-up's correction: a question, a taught answer and a replaced one. Its step's pass over the taught items
# (the example and one rewording, ~500 tokens) is past the 384 tokens above which a pass is checkpointed, as a real
# correction's is, so the warm-up goes the same way
WARM_UP_EXAMPLE = {
    "prompt": "Explain in a few sentences how a lighthouse keeper kept the lamp burning through a long winter night.",
    "response": " ".join(["The keeper trimmed the wick, refilled the oil, cleaned the soot from the lens and wound the "
                          "clockwork that turned the light, checking it every few hours until dawn."] * 6),
    "rejected": "Lighthouses have always been electric, so there was nothing for a keeper to do at night.",
}

_GREEN: dict[tuple[int, int], tuple] = {}  # (device, SMs) -> (green context, its stream), made once per process


class LearnJob:
    """A handle on an accepted job: its events so far, and wait() for the report."""

    def __init__(self, job_id: str, adapter: str, on_event: Callable[[dict], None] | None):
        self.id, self.adapter = job_id, adapter
        self.events: list[dict] = []
        self.state = "queued"
        self.report: dict | None = None
        self.error: str | None = None
        self.published_at: float | None = None  # time.perf_counter() when its version began to serve
        self._listeners = [on_event] if on_event else []
        self._done = threading.Event()

    def _emit(self, **event) -> None:
        event = {"job_id": self.id, "adapter": self.adapter, **event}
        self.state = event["state"]
        self.events.append(event)
        for fn in self._listeners:
            try:
                fn(event)
            except Exception:
                log.exception("a learn-event listener failed")
        if self.state in ("done", "failed"):
            self._done.set()

    def wait(self, timeout: float | None = None) -> dict:
        if not self._done.wait(timeout):
            raise TimeoutError(f"learn job {self.id} is still {self.state} after {timeout} s")
        if self.state == "failed":
            raise DarkError(f"learn job {self.id} failed: {self.error}")
        return self.report


class Learner:
    def __init__(self, llm, store: Store, adapters_dir: Path, learn_config: LearnConfig):
        self.llm, self.store, self.dir = llm, store, adapters_dir
        self.config = learn_config
        engine = llm.engine
        self.trainer = Trainer(llm.model, llm.tokenizer, engine.device, self._base_answers)
        if engine.device.type == "cuda":  # on the CPU the factors are where the slots are: nothing to skip
            self.trainer.stage_factors = engine.adapters.slots.stage
        self.trainer.kv_lender = KVLender(engine)  # checkpointed passes keep activations in free KV blocks
        self._green = None  # the CUDA green context training runs in while serving is busy (engine.config.train_sms)
        self.set_train_sms(engine.config.train_sms)
        self._queue: deque[tuple[LearnJob, dict]] = deque()
        self._jobs: dict[str, LearnJob] = {}
        self._optimizer: dict[str, dict] = {}  # per adapter, also on disk so corrections accumulate across restarts
        self._opt_gen: dict[str, int] = {}     # per adapter: bumped by forget_optimizer (rollback, undo)
        self._opt_lock = threading.Lock()
        self._busy = False  # a job is being run by the learn thread
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dark-optimizer-writer")
        self._last_write: concurrent.futures.Future | None = None
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="dark-learn", daemon=True)
        warm = engine.config.warm_learning
        self._warm = engine.device.type == "cuda" if warm is None else warm
        self.warmed = threading.Event()  # set once the warm-up step is over (or skipped, or failed)
        self.warm_up_seconds: float | None = None

    def start(self) -> None:
        # the one-time preparation of learning, here on the loading thread so the first correction does not wait
        # for it: the protected subspaces (dark.learn.protect; LAPACK runs 2-3x slower off the main thread on a
        # CPU) and the base model's answers to the anchor prompts (generated once per data folder)
        try:
            self.trainer.protector(self.config.protect_energy)
            if self.config.kl_weight > 0:
                self.trainer.anchors(self.config.anchor_prompts)
        except Exception:
            log.exception("could not prepare learning; the first learn job will try again")
        self._thread.start()
        # the warm-up step (warm_learning) runs on the learn thread, the one that runs jobs; the server is ready once
        # it is over, so it never runs beside the first requests
        self.warmed.wait()

    def set_train_sms(self, sms: int) -> None:
        """SMs training steps may use while requests are being served: -1 half of them, 0 all (shared with serving by
        stream priority), N that many. Steps taken while nothing is served use every SM either way.

        By default training alone is kept to N SMs (torch's green context) and serving uses every SM. With
        DARK_SPLIT_SMS=1 the device's SMs are split in two disjoint partitions (dark.engine.green): training steps
        run on N of them while requests are served, and serving on the others while a train() call runs. That
        trades decode latency for training rate (bench/RESULTS.md, 2026-12-03: at N=96, training 0.73 of its solo
        rate against 0.61, decode p99 2.9x solo against 2.3x), so it is not the default."""
        engine, trainer = self.llm.engine, self.trainer
        trainer.shared_stream, self._green = None, None
        engine.serve_in_partition(None)
        if engine.device.type != "cuda" or sms == 0:
            return
        total = torch.cuda.get_device_properties(engine.device).multi_processor_count
        if sms < 0:
            sms = total // 2
        parts = partitions(engine.device, sms) if 0 < sms < total else None
        if parts is not None:
            serve, train = parts
            self._green = train
            trainer.shared_stream = train.stream
            trainer.serving_busy = engine.scheduler.has_work
            engine.serve_in_partition(serve.stream, lambda: trainer.training > 0, sms=serve.sms)
            return
        self._green, stream = training_stream(engine.device, sms)
        if self._green is not None:
            trainer.shared_stream = stream
            trainer.serving_busy = engine.scheduler.has_work

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=60)
        self._writer.shutdown(wait=True)  # the last moments reach the disk before the process goes

    def _base_answers(self, prompts: list[str]) -> list[str]:
        """The adapter-free model's answers to the anchor prompts, generated once per data folder."""
        path = self.dir.parent / "anchors.json"
        cached = json.loads(path.read_text()) if path.is_file() else {}
        if any(p not in cached for p in prompts):
            answers = self.llm.generate(prompts, max_tokens=ANCHOR_TOKENS + 1)
            cached.update(zip(prompts, answers))
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(cached, indent=1))
            os.replace(tmp, path)
        return [cached[p] for p in prompts]

    # --- adapters on disk ---
    def version_dir(self, name: str, version: int) -> Path:
        return self.dir / name / f"v{version}"

    def create_adapter(self, name: str, lora: LoraConfig) -> None:
        """Version 0 of a new adapter: B = 0, so it answers exactly like the base model until it learns. A's random
        start is seeded by the name (a stable hash: the same name learns the same way in every process)."""
        mc = self.llm.model.config
        weights = AdapterWeights.init(lora, mc.projection_shapes(), mc.num_layers, seed=zlib.crc32(name.encode()))
        self.store.create_adapter(name, {"r": lora.r, "alpha": lora.alpha, "target_modules": list(lora.target_modules)})
        self.publish(name, 0, weights, None, None)

    def publish(self, name: str, version: int, weights: AdapterWeights, parent: int | None, report: dict | None,
                marks: dict | None = None, staged: dict | None = None) -> None:
        """Make `weights` version `version` of adapter `name`: saved, recorded, then served to new requests.
        marks (a job's timings): gets the clock times at which the version was saved and published."""
        path = self.version_dir(name, version)
        mc = self.llm.model.config
        # on disk before anyone can ask for it; named as PEFT names the modules of the base model's transformers class
        weights.save(path, base_model=self.llm.model_name, backbone=mc.hf_backbone, exclude_modules=mc.hf_skipped)
        if marks is not None:
            marks["written"] = time.perf_counter()
        self.store.add_adapter_version(name, version, str(path), parent_version=parent, report=report)
        if marks is not None:
            marks["saved"] = time.perf_counter()
        self.llm.engine.adapters.publish(name, version, weights, stored=True, staged=staged)
        if marks is not None:
            marks["published"] = time.perf_counter()

    # --- jobs ---
    def submit(self, examples, adapter: str, kind: str = "sft", source: str = "api", message_id: str | None = None,
               on_event: Callable[[dict], None] | None = None, lora: LoraConfig | None = None,
               overrides: dict | None = None) -> LearnJob:
        if kind not in ("sft", "preference", "unlearn"):
            raise InvalidRequestError(f"kind must be sft, preference or unlearn, not {kind!r}")
        if not isinstance(adapter, str) or not ADAPTER_NAME.fullmatch(adapter):
            raise InvalidRequestError(f"adapter name {adapter!r} is not valid: use 1-64 letters, digits, '.', '_' or '-', "
                                      "starting with a letter or digit")
        normalized = normalize_examples(examples, kind)
        if kind == "preference" and not all("rejected" in e for e in normalized):
            raise InvalidRequestError("preference examples need a 'rejected' answer each")
        config = self._job_config(overrides)
        if adapter not in self.llm.engine.adapters.names():
            self.create_adapter(adapter, lora or LoraConfig().validate(self.llm.engine.config.max_lora_rank))
        _, row = self.store.add_examples_and_job(adapter, normalized, kind, source, message_id,
                                                 config=dataclasses.asdict(config))
        return self._enqueue(row, on_event)

    def _job_config(self, overrides: dict | None) -> LearnConfig:
        names = {f.name for f in dataclasses.fields(LearnConfig)}
        bad = sorted(set(overrides or {}) - names)
        if bad:
            raise InvalidRequestError(f"unknown learn settings {bad}; known: {sorted(names)}")
        return dataclasses.replace(self.config, **(overrides or {})).validate()

    def _enqueue(self, row: dict, on_event=None) -> LearnJob:
        job = LearnJob(row["id"], row["adapter"], on_event)
        self._jobs[job.id] = job
        job._emit(state="queued")  # before the worker can see it, so "queued" always comes first
        with self._wake:
            self._queue.append((job, row))
            self._wake.notify()
        return job

    def resume(self) -> list[LearnJob]:
        """Queue the jobs a previous process accepted but did not finish."""
        return [self._enqueue(row) for row in self.store.unfinished_jobs()]

    def forget_optimizer(self, name: str) -> None:
        """After a rollback the moments belong to weights no longer served: start them afresh."""
        with self._opt_lock:
            self._opt_gen[name] = self._opt_gen.get(name, 0) + 1  # a write still pending for them is dropped
            self._optimizer.pop(name, None)
            (self.dir / name / "optimizer.pt").unlink(missing_ok=True)

    def _load_optimizer(self, name: str) -> dict | None:
        with self._opt_lock:
            if name not in self._optimizer:
                path = self.dir / name / "optimizer.pt"
                if path.is_file():
                    try:
                        self._optimizer[name] = load_optimizer_state(path)
                    except Exception as e:  # a torn or foreign file costs the moments, never the job
                        log.warning("the optimizer moments of %s could not be read (%s); its next job starts them "
                                    "afresh", name, e)
            return self._optimizer.get(name)

    def _keep_optimizer(self, name: str, state: dict) -> int:
        """The adapter's moments for its next job (in memory now); returns the generation a later write checks."""
        with self._opt_lock:
            self._optimizer[name] = state
            return self._opt_gen.get(name, 0)

    def _save_optimizer(self, name: str, state: dict, generation: int) -> None:
        """Write the moments kept by _keep_optimizer, unless a rollback forgot them since (checked again before the
        file takes its name). The lock is not held while writing: the next job reads the moments from memory."""
        path = self.dir / name / "optimizer.pt"
        tmp = path.with_suffix(".tmp")
        try:
            with self._opt_lock:
                if self._opt_gen.get(name, 0) != generation:
                    return
            save_optimizer_state(state, tmp)
            with self._opt_lock:
                if self._opt_gen.get(name, 0) == generation:
                    os.replace(tmp, path)
                    return
            tmp.unlink(missing_ok=True)
        except Exception:
            log.exception("could not write the optimizer moments of %s; its next job starts them afresh after a restart", name)

    def get(self, job_id: str) -> LearnJob | None:
        return self._jobs.get(job_id)

    def warm_up(self) -> float:
        """One training step of a built-in correction on a fresh adapter, thrown away: nothing is saved, recorded or
        served. Run by the learn thread before its first job, so that job does not pay what a process's first
        training pass costs once (kernel and library setup, pinned staging buffers, the checkpointed path's first
        use): measured on an H200 at 7B, a first correction took 2.8-3.2 s to publish and the next ones 0.6-0.9 s.
        Returns its seconds."""
        start = time.perf_counter()
        mc = self.llm.model.config
        lora = LoraConfig(r=min(LoraConfig.r, self.llm.engine.config.max_lora_rank)).validate()
        weights = AdapterWeights.init(lora, mc.projection_shapes(), mc.num_layers, seed=0)
        cfg = dataclasses.replace(self.config, max_steps=1, min_steps=1)
        items = self.trainer.build_items(normalize_examples([WARM_UP_EXAMPLE]), [], "sft", cfg)
        self.trainer.train(weights, None, items, cfg)
        return time.perf_counter() - start

    def _loop(self) -> None:
        if self._warm and not self._closed:
            try:
                self.warm_up_seconds = round(self.warm_up(), 3)
                log.info("learning warmed up in %.2f s (one throwaway step)", self.warm_up_seconds)
            except Exception:
                log.exception("the learning warm-up step failed; the first learn job pays the setup instead")
        self.warmed.set()
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                job, row = self._queue.popleft()
                self._busy = True
            try:
                self._run(job, row)
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    def _thread_idle(self, timeout: float | None = None) -> bool:
        """Wait until no job is queued or running (its after-publish work included); False on timeout."""
        with self._wake:
            idle = self._wake.wait_for(lambda: not self._queue and not self._busy, timeout)
        if idle and self._last_write is not None:
            concurrent.futures.wait([self._last_write], timeout)
            idle = self._last_write.done()
        return idle

    def _run(self, job: LearnJob, row: dict) -> None:
        name, started = job.adapter, time.perf_counter()
        try:
            self.store.update_job(job.id, state="running")
            job._emit(state="running", step=0, loss=None, total_steps=None)
            cfg = LearnConfig(**row["config"]).validate() if row.get("config") else self.config
            examples = self.store.list_examples(name)
            mine = [e for e in examples if e["id"] in set(row["example_ids"])]
            kind = {"sft": "sft", "preference": "sft", "unlearn": "unlearn"}[mine[0]["kind"]]
            earlier = [e["payload"] for e in examples if e["id"] < min(row["example_ids"]) and e["kind"] != "unlearn"]
            items = self.trainer.build_items([e["payload"] for e in mine], earlier[-cfg.replay:] if cfg.replay else [], kind, cfg)
            mgr = self.llm.engine.adapters
            parent = mgr.current(name)
            marks = {"prepared": time.perf_counter()}  # clock times of the job's phases
            steps_at = []

            def on_step(step, loss):
                steps_at.append(round(time.perf_counter() - started, 3))
                job._emit(state="running", step=step, loss=loss, total_steps=cfg.max_steps)

            result = self.trainer.train(mgr.weights(name, parent), self._load_optimizer(name), items, cfg, on_step)
            marks["trained"] = time.perf_counter()
            version = max(v["version"] for v in self.store.list_versions(name)) + 1
            report = {"adapter": name, "version": version, "parent_version": parent, "steps": result.steps,
                      "losses": result.losses, "verified": result.verified, "anchors_kept": result.anchors_kept,
                      "seconds": round(time.perf_counter() - started, 3),
                      "train_seconds": round(result.seconds, 3),
                      "examples": len(mine), "replays": result.replays, "replays_trained": result.replays_trained}
            self.publish(name, version, result.weights, parent, report, marks, staged=result.staged)
            job.published_at = marks["published"]
            # the moments leave the device after the version is out, stay in memory for this adapter's next job
            # (same thread), and go to disk after that: a crash in between costs a fresh optimizer state, never
            # a version
            state = self.trainer.optimizer_state_to_host(result.optimizer_state)
            marks["moments_to_host"] = time.perf_counter()
            generation = self._keep_optimizer(name, state)
            # seconds from the job's start: items built, training done (first step after "prepared" + steps_at[0]),
            # version saved, version served
            report["timings"] = {k: round(v - started, 3) for k, v in marks.items()} | {"steps_at": steps_at} | \
                {f"train_{k}": v for k, v in result.timings.items()}
            self.store.update_job(job.id, state="done", report=report)
            job.report = report
            job._emit(state="done", version=version, verified=result.verified, report=report)
            # on the writer thread: the next job (a second correction right after this one) starts at once
            self._last_write = self._writer.submit(self._save_optimizer, name, state, generation)
        except Exception as e:
            log.exception("learn job %s failed", job.id)
            job.error = f"{type(e).__name__}: {e}"
            try:
                self.store.update_job(job.id, state="failed", error=job.error)
            finally:
                job._emit(state="failed", error=job.error)
