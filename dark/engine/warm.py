"""Serving's warm-up: the kernels compiled and the decode steps captured before the first request, not inside it.

A decode step on CUDA is a CUDA graph captured the first time a batch size (its bucket) runs, with or without
adapters, and its Triton kernels compile the first time a variant of them runs (~0.3-0.5 s each on a machine whose
Triton cache is empty: a fresh GPU machine or container). Measured on an H200 at 7B (bench/RESULTS.md, 2026-12-03),
without a warm-up: the first request after start waited 2.5 s for its first token, and the first request on an
adapter 3.2 s, then decoded at 80 ms a token instead of 3.9 while the rest of its variants compiled (8.3 s for 64
tokens). So before the server serves, a few throwaway requests go through the engine: each of the batch sizes a chat
server meets most (1, 2, 4, 8 sequences), without and with an adapter, greedy and sampled, a request arriving
while another decodes (a step that mixes a prompt's chunk with decode rows), and prompts of the lengths that give the
LoRA kernels each of their launch shapes (prefill_lengths). Nothing of them is kept: their
sequences end, their blocks go back (the prefix cache may keep its entries, which any request may evict), and the
throwaway adapter, when none is stored, leaves the adapter registry again.
"""
from __future__ import annotations

import logging
import threading
import time

from ..config import LoraConfig
from ..lora.weights import AdapterWeights
from .sequence import RequestOutput, SamplingParams

log = logging.getLogger(__name__)

WARM_ADAPTER = "dark:warm-up"  # a name no user's adapter can have (dark.learn.jobs.ADAPTER_NAME has no ':')
BATCHES = (1, 2, 4, 8)  # decode batch sizes warmed (each a graph bucket of dark.engine.runner)
# prompts longer than the LoRA kernels' range (the dense path's GEMM shapes), on CUDA only
LONG_PREFILLS = (512, 1024, 2048)


def prefill_lengths(engine) -> list[int]:
    """Prompt lengths whose prefills, alone in a step, launch every shape the LoRA kernels take up to
    KERNEL_MAX_TOKENS: one for each row count of the kernels' block table (dark.kernels.lora.segment_rows), which
    sets their grid and some compile-time constants (a prompt of 256 tokens on an adapter compiled a variant that one
    of 55 had not: bench/RESULTS.md 2026-12-04). On CUDA, LONG_PREFILLS too. All shorter than the context limit."""
    from ..lora.slots import KERNEL_MAX_TOKENS
    from ..models.decoder import kernel_module

    lora = kernel_module("lora")
    seen, lengths = set(), []
    for n in range(2, KERNEL_MAX_TOKENS + 1):
        rows = lora.segment_rows(n, engine.config.max_adapter_slots)
        if rows not in seen:
            seen.add(rows)
            lengths.append(n)
    if engine.device.type == "cuda":
        lengths += [n for n in LONG_PREFILLS if n > KERNEL_MAX_TOKENS]
    return [n for n in lengths if n < engine.max_model_len - 1]


def _run(engine, prompt_ids: list[int], n: int, adapter, params: SamplingParams, timeout: float,
         then: tuple[SamplingParams, int] | None = None) -> None:
    """n requests of prompt_ids at once, until all finish. then (params, count): once the first request has its
    first token, `count` more requests with those params join it while it decodes."""
    left = [n + (then[1] if then else 0)]
    done, first = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    lock = threading.Lock()

    def on_output(out: RequestOutput) -> None:
        if out.token_ids:
            first.set()
        if out.finished:
            with lock:
                if out.error is not None:
                    errors.append(out.error)
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    for _ in range(n):
        engine.add_request(list(prompt_ids), params, adapter, on_output)
    if then is not None:
        if not first.wait(timeout):
            raise TimeoutError(f"the serving warm-up waited {timeout} s for a first token")
        for _ in range(then[1]):
            engine.add_request(list(prompt_ids), then[0], adapter, on_output)
    if not done.wait(timeout):
        raise TimeoutError(f"the serving warm-up's requests did not finish in {timeout} s")
    if errors:
        raise errors[0]


def warm_serving(engine, prompt_ids: list[int], timeout: float = 300.0) -> dict:
    """Run the warm-up's requests through `engine` (running, serving nothing else yet). Adapter requests use the
    first stored adapter's current version, or a throwaway adapter of the default LoRA shape (the learner's for a new
    adapter) published for the warm-up and removed after it. Returns {"seconds", "requests", "graphs"}."""
    start = time.perf_counter()
    mgr = engine.adapters
    graphs = len(engine.runner._graphs)
    names = mgr.names()
    throwaway = not names
    if throwaway:
        mc = engine.model.config
        lora = LoraConfig(r=min(LoraConfig.r, engine.config.max_lora_rank)).validate()
        mgr.publish(WARM_ADAPTER, 0, AdapterWeights.init(lora, mc.projection_shapes(), mc.num_layers, seed=0))
        key = (WARM_ADAPTER, 0)
    else:
        key = mgr.resolve(names[0])
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    sampled = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.7)
    streaming = SamplingParams(max_tokens=24, ignore_eos=True)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    lengths = prefill_lengths(engine)
    # the prompts of those lengths: windows of the warm prompt repeated, each starting at its own token, so that no
    # prompt's first block is another's (the prefix cache would serve it, and the step would be shorter)
    tokens = list(prompt_ids) * (max(lengths, default=0) // max(1, len(prompt_ids)) + 2)
    requests = 0
    try:
        for adapter in (None, key):
            for n in (b for b in BATCHES if b <= engine.config.max_num_seqs):
                _run(engine, prompt_ids, n, adapter, greedy, timeout)
                requests += n
            _run(engine, prompt_ids, 1, adapter, sampled, timeout)
            if engine.config.max_num_seqs > 1:
                _run(engine, prompt_ids, 1, adapter, streaming, timeout, then=(greedy, 1))
                requests += 2
            requests += 1
            for i, n in enumerate(lengths):
                at = (i + 1) % max(1, len(prompt_ids))
                _run(engine, tokens[at:at + n], 1, adapter, one, timeout)
            requests += len(lengths)
    finally:
        if throwaway:
            mgr.remove(WARM_ADAPTER)
    return {"seconds": time.perf_counter() - start, "requests": requests,
            "graphs": len(engine.runner._graphs) - graphs}
