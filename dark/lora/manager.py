"""Adapter versions in host memory and which of them sit in device slots.

A version, once registered, never changes, so a (name, version) pair found in a slot is always current
for whoever asked for that pair. Publishing a version is one assignment under the lock; requests resolve
their version when they are added and keep it, so a generation never sees a half-updated adapter.

Bringing a version into a slot from host memory takes ~0.1 s at 7B (packing ~150 MB of fp32 factors, copying them
to the device: bench/RESULTS.md 2026-12-04). On CUDA that happens on a loader thread, on a stream of its own, while
the engine keeps stepping the sequences it runs: acquire() starts the load and answers None (wait) until the factors
are on the device, and then only copies them into the slot (~7 ms). Versions a learn job publishes come with their
factors on the device already (AdapterSlots.stage) and skip the loader.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from ..errors import UnknownAdapterError
from .slots import AdapterSlots, Staged
from .weights import AdapterWeights

AdapterKey = tuple[str, int]


class AdapterManager:
    def __init__(self, slots: AdapterSlots, keep_in_memory: int = 3):
        self.slots = slots
        # host copies of the versions: every registered version is known, the newest `keep_in_memory` of each
        # adapter and its current one stay loaded (a 7B adapter is ~160 MB a version: a server taking hundreds
        # of corrections must not keep them all), and `loader` brings an evicted one back from its folder
        self._versions: dict[str, dict[int, AdapterWeights]] = {}
        self._known: dict[str, set[int]] = {}
        self._stored: set[AdapterKey] = set()
        self.keep_in_memory = keep_in_memory
        self.loader: Callable[[str, int], AdapterWeights] | None = None
        self._current: dict[str, int] = {}
        self._lock = threading.RLock()
        self._slot_of: "OrderedDict[AdapterKey, int]" = OrderedDict()  # least recently used first
        self._refs = [0] * slots.num_slots
        self._free = list(range(slots.num_slots))
        self._staged: dict[AdapterKey, Staged] = {}  # published versions' factors on the device, not yet in a slot
        # versions being brought to the device off the engine thread (None: on CUDA only); on_loaded: called when one
        # is there (the engine wakes its loop)
        self.background_loads: bool = slots.device.type == "cuda"
        self.on_loaded: Callable[[], None] | None = None
        self._loading: dict[AdapterKey, Future] = {}
        self._failed: dict[AdapterKey, BaseException] = {}  # loads that failed, raised to the next acquire
        self._loader: ThreadPoolExecutor | None = None
        self._load_stream = None

    # --- registry (any thread) ---
    def publish(self, name: str, version: int, weights: AdapterWeights, make_current: bool = True,
                stored: bool = False, staged: Staged | None = None) -> None:
        """stored: the version is also in its folder, so its host copy may be evicted and loaded again. staged: its
        factors on the device already (AdapterSlots.stage, from a learn job), which its first request then copies
        into a slot instead of bringing them from the host (~0.1 s of that request's wait at 7B on an H200); kept
        until then, or until a later version of the adapter is published."""
        with self._lock:
            self._forget_staged(name)
            if staged is not None:
                self._keep_staged((name, version), staged)
            self._versions.setdefault(name, {})[version] = weights
            self._known.setdefault(name, set()).add(version)
            if stored:
                self._stored.add((name, version))
            if make_current or name not in self._current:
                self._current[name] = version
            self._trim(name)

    def set_current(self, name: str, version: int) -> None:
        with self._lock:
            if version not in self._known.get(name, set()):
                raise UnknownAdapterError(f"adapter {name!r} has no version {version}; versions: {self.versions(name)}")
            self._current[name] = version

    def remove(self, name: str) -> None:
        with self._lock:
            self._require(name)
            del self._versions[name]
            del self._known[name]
            self._stored = {k for k in self._stored if k[0] != name}
            del self._current[name]
            self._forget_staged(name)
            for key in [k for k in self._slot_of if k[0] == name and self._refs[self._slot_of[k]] == 0]:
                slot = self._slot_of.pop(key)
                self._free.append(slot)
                # the kernels read the largest loaded rank (AdapterSlots.kernel_rank): a slot left empty counts
                # for nothing, or a removed rank-64 adapter would keep every later step reading 64 rows
                self.slots.rank[slot] = 0

    def resolve(self, name: str, version: int | None = None) -> AdapterKey:
        with self._lock:
            self._require(name)
            version = self._current[name] if version is None else version
            if version not in self._known[name]:
                raise UnknownAdapterError(f"adapter {name!r} has no version {version}; versions: {self.versions(name)}")
            return name, version

    def weights(self, name: str, version: int | None = None) -> AdapterWeights:
        with self._lock:
            return self._get(*self.resolve(name, version))

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._versions)

    def versions(self, name: str) -> list[int]:
        with self._lock:
            return sorted(self._known.get(name, set()))

    def loaded_versions(self, name: str) -> list[int]:
        """The versions whose factors are in host memory now."""
        with self._lock:
            return sorted(self._versions.get(name, {}))

    def _get(self, name: str, version: int) -> AdapterWeights:
        loaded = self._versions[name]
        if version not in loaded:
            loaded[version] = self.loader(name, version)  # only evicted versions are missing, and only with a loader
            self._trim(name, keep=version)
        return loaded[version]

    def _trim(self, name: str, keep: int | None = None) -> None:
        if self.loader is None:
            return  # nothing can be brought back: keep everything
        loaded = self._versions[name]
        stay = set(sorted(loaded)[-self.keep_in_memory:]) | {self._current[name]} | ({keep} if keep is not None else set())
        for v in [v for v in loaded if v not in stay and (name, v) in self._stored]:
            del loaded[v]

    def current(self, name: str) -> int:
        with self._lock:
            self._require(name)
            return self._current[name]

    def _require(self, name: str) -> None:
        if name not in self._versions:
            known = ", ".join(sorted(self._versions)) or "none yet"
            raise UnknownAdapterError(f"unknown adapter {name!r}; known adapters: {known}")

    # --- slots (engine thread) ---
    def acquire(self, key: AdapterKey) -> int | None:
        """A slot holding this version, loading it if needed; None (ask again) while every slot is busy or, with
        background_loads, while the version is on its way to the device. Raises what loading it met."""
        with self._lock:
            if key in self._slot_of:
                slot = self._slot_of[key]
                self._slot_of.move_to_end(key)
            else:
                self._require(key[0])  # deleted while the request waited: an error for it, not for the engine
                if key in self._failed:
                    raise self._failed.pop(key)
                if key not in self._staged and self.background_loads:
                    if key not in self._loading:
                        if key[1] not in self._known[key[0]]:  # fails here, on the asking thread
                            raise UnknownAdapterError(f"adapter {key[0]!r} has no version {key[1]}")
                        self._start_load(key)  # the host copy too, when it left memory (loader)
                    return None
                slot = self._take_slot()
                if slot is None:
                    return None  # staged factors wait in _staged for a slot to come free
                self.slots.load(slot, self._get(*key), self._staged.pop(key, None))
                self._slot_of[key] = slot
            self._refs[slot] += 1
            return slot

    def loading(self, key: AdapterKey) -> bool:
        """Whether this version is on its way to the device (the loader thread has it)."""
        with self._lock:
            return key in self._loading

    def _start_load(self, key: AdapterKey) -> None:
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dark-adapter-load")
        fut = self._loader.submit(self._load_staged, key)
        self._loading[key] = fut
        fut.add_done_callback(lambda f: self._loaded(key, f))

    def _loaded(self, key: AdapterKey, fut: Future) -> None:
        """On the loader thread, once a load ended: its factors wait in _staged (or its error in _failed) for the
        version's request to ask again; a load the adapter no longer wants (a newer version, removed) is dropped."""
        with self._lock:
            if self._loading.get(key) is not fut:
                return
            del self._loading[key]
            if fut.cancelled():
                return
            if fut.exception() is not None:
                self._failed[key] = fut.exception()
            else:
                self._keep_staged(key, fut.result())
        if self.on_loaded is not None:
            self.on_loaded()

    def _keep_staged(self, key: AdapterKey, staged: Staged) -> None:
        """Staged factors wait for their version's first request; at most as many versions as there are slots (the
        oldest go: a request whose wait was given up never comes for them, and they hold device memory)."""
        self._staged[key] = staged
        while len(self._staged) > self.slots.num_slots:
            del self._staged[next(iter(self._staged))]

    def _load_staged(self, key: AdapterKey) -> Staged:
        """On the loader thread: the version's factors on the device, in the slots' layout, on a stream of its own;
        returns once they are there. A version whose host copy left memory is read from its folder first, without
        the lock (the engine thread takes it every step)."""
        name, version = key
        with self._lock:
            weights = self._versions.get(name, {}).get(version)
        if weights is None:
            if self.loader is None:
                raise UnknownAdapterError(f"adapter {name!r} has no version {version} in memory")
            weights = self.loader(name, version)
            with self._lock:
                if name in self._versions:
                    weights = self._versions[name].setdefault(version, weights)
                    self._trim(name, keep=version)
        if self.slots.device.type != "cuda":
            return self.slots.stage_from_host(weights)
        import torch

        if self._load_stream is None:
            self._load_stream = torch.cuda.Stream(self.slots.device)
        with torch.cuda.stream(self._load_stream):
            staged = self.slots.stage_from_host(weights)
        self._load_stream.synchronize()
        return staged

    def _forget_staged(self, name: str) -> None:
        """Drop the device copies made for an adapter's versions that no slot took (a newer version came, or the
        adapter went): a request for one of them loads it again."""
        for key in [k for k in self._staged if k[0] == name]:
            del self._staged[key]
        for key in [k for k in self._loading if k[0] == name]:
            del self._loading[key]
        for key in [k for k in self._failed if k[0] == name]:
            del self._failed[key]

    def close(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True, cancel_futures=True)

    def release(self, slot: int) -> None:
        with self._lock:
            self._refs[slot] -= 1

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for key, slot in self._slot_of.items():  # evict the least recently used idle slot
            if self._refs[slot] == 0:
                del self._slot_of[key]
                return slot
        return None
