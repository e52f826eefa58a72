"""Multi-adapter inference against PEFT: each adapter alone, and a batch mixing adapters and none."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from dark import OnlineLLM, UnknownAdapterError
from dark.lora.weights import AdapterWeights
from test_engine import hf_reference

PROMPTS = ["Tell me a story about a fox.", "What is two plus two?", "Translate 'cat' into French."]


def make_peft_adapter(base_path, folder, seed, targets, r=8):
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    # init_lora_weights=False draws B at random too, so the adapter really changes the output
    model = get_peft_model(base, PeftLoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    base = tiny_models["qwen2"]
    root = tmp_path_factory.mktemp("adapters")
    a = make_peft_adapter(base, root / "a", 1, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    b = make_peft_adapter(base, root / "b", 2, ["q_proj", "v_proj", "down_proj", "lm_head"], r=4)
    llm = OnlineLLM(str(base), block_size=8, max_num_seqs=8, data_dir=root / "data")
    assert llm.load_adapter("a", a) == 1
    assert llm.load_adapter("b", b) == 1
    yield base, {"a": a, "b": b}, llm
    llm.close()


def peft_reference(base, folder, ids, steps=24):
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), folder).eval()
    return hf_reference(model, ids, steps)


def test_each_adapter_matches_peft(setup):
    base, folders, llm = setup
    for name, folder in folders.items():
        for prompt in PROMPTS[:2]:
            tokens, logprobs = peft_reference(base, folder, llm.encode(prompt))
            out = llm.complete(prompt, adapter=name, max_tokens=24, ignore_eos=True, logprobs=True)
            assert out.token_ids == tokens, f"adapter {name}: tokens differ from PEFT"
            assert out.adapter == (name, 1)
            torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=1e-4)


def test_adapter_changes_output(setup):
    _, _, llm = setup
    base_out = llm.complete(PROMPTS[0], max_tokens=16, ignore_eos=True).token_ids
    assert llm.complete(PROMPTS[0], adapter="a", max_tokens=16, ignore_eos=True).token_ids != base_out


def test_mixed_batch_equals_each_alone(setup):
    _, _, llm = setup
    alone = {}
    for adapter in ("a", "b", None):
        for prompt in PROMPTS:
            alone[(adapter, prompt)] = llm.complete(prompt, adapter=adapter, max_tokens=20, ignore_eos=True, logprobs=True)
    results = {}
    import threading
    done = []
    lock = threading.Lock()

    def collect(key):
        def cb(out):
            if out.finished:
                with lock:
                    results[key] = out
                    done.append(key)
        return cb

    # all nine requests in flight together, so steps hold tokens of a, b and no adapter at once
    for adapter in ("a", "b", None):
        for prompt in PROMPTS:
            llm.submit(prompt, collect((adapter, prompt)), adapter=adapter, max_tokens=20, ignore_eos=True, logprobs=True)
    import time
    deadline = time.time() + 120
    while len(done) < 9 and time.time() < deadline:
        time.sleep(0.01)
    assert len(done) == 9
    for key, out in results.items():
        assert out.output_ids == alone[key].token_ids, f"{key} differs in a mixed batch"
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(alone[key].logprobs), atol=1e-4, rtol=1e-4)


def test_saved_adapter_round_trips(setup, tmp_path):
    _, folders, llm = setup
    w = AdapterWeights.load(folders["b"])
    w.save(tmp_path / "copy")
    assert llm.load_adapter("b", tmp_path / "copy") == 2
    assert llm.adapters() == [{"name": "a", "version": 1, "versions": [1]}, {"name": "b", "version": 2, "versions": [1, 2]}]
    v2 = llm.complete(PROMPTS[1], adapter="b", max_tokens=12, ignore_eos=True)
    assert v2.adapter == ("b", 2)
    llm.engine.adapters.set_current("b", 1)
    v1 = llm.complete(PROMPTS[1], adapter="b", max_tokens=12, ignore_eos=True)
    assert v1.adapter == ("b", 1) and v1.token_ids == v2.token_ids


def test_unknown_adapter_is_a_clear_error(setup):
    _, _, llm = setup
    with pytest.raises(UnknownAdapterError, match="unknown adapter 'nope'.*known adapters: a, b"):
        llm.generate("hi", adapter="nope")
    with pytest.raises(Exception, match="not a PEFT LoRA folder"):
        llm.load_adapter("c", "/nonexistent")


def test_old_versions_leave_host_memory_and_come_back(tiny_models, tmp_path):
    """Only the newest versions (and the current one) keep their factors in host memory; an evicted version is
    read back from its folder when a request, a rollback or a learn job needs it, with the same factors."""
    base = tiny_models["qwen2"]
    folders = [make_peft_adapter(base, tmp_path / f"v{i}", 10 + i, ["q_proj", "down_proj"], r=4) for i in range(5)]
    with OnlineLLM(str(base), block_size=8, max_num_seqs=4, data_dir=tmp_path / "data") as llm:
        mgr = llm.engine.adapters
        mgr.keep_in_memory = 2
        for i, folder in enumerate(folders):
            assert llm.load_adapter("skill", folder) == i + 1
        assert mgr.versions("skill") == [1, 2, 3, 4, 5]
        assert mgr.loaded_versions("skill") == [4, 5]
        want = AdapterWeights.load(folders[0])
        latest = llm.complete(PROMPTS[0], adapter="skill", max_tokens=8, ignore_eos=True)
        llm.rollback("skill", 1)  # an evicted version: back from its folder, and kept while current
        first = llm.complete(PROMPTS[0], adapter="skill", max_tokens=8, ignore_eos=True)
        assert latest.adapter == ("skill", 5) and first.adapter == ("skill", 1)
        assert first.token_ids != latest.token_ids
        got = mgr.weights("skill", 1)
        for key, (a, b) in want.tensors.items():
            assert torch.equal(got.tensors[key][0], a) and torch.equal(got.tensors[key][1], b)
        assert 1 in mgr.loaded_versions("skill") and len(mgr.loaded_versions("skill")) <= 3
        mgr.weights("skill", 3)  # looked up: loaded for the moment, then trimmed again
        assert len(mgr.loaded_versions("skill")) <= 4
        llm.rollback("skill", 5)
        assert llm.complete(PROMPTS[0], adapter="skill", max_tokens=8, ignore_eos=True).token_ids == latest.token_ids


def _random_weights(shapes, layers, r, targets, seed):
    from dark.config import LoraConfig

    weights = AdapterWeights.init(LoraConfig(r=r, alpha=2 * r, target_modules=targets).validate(), shapes, layers, seed)
    gen = torch.Generator().manual_seed(seed)
    for _, b in weights.tensors.values():
        b.copy_(torch.randn(b.shape, generator=gen))
    return weights


def _slot_contents(slots, slot):
    return {k: (slots.A[k][slot].clone(), slots.B[k][slot].clone()) for k in slots.A}


def test_a_reused_slot_and_a_staged_load_hold_exactly_what_a_fresh_load_does(tiny_models, tmp_path):
    """A slot that held a rank-16 adapter on every projection, then takes a rank-4 one on three, holds exactly what
    an untouched slot loaded with the second holds (the first's rows and projections all zero), in bf16; and a
    version staged from factors already on the device (a learn job's: AdapterSlots.stage) loads to the same bits as
    one brought from the host, while the adapter manager hands a version's staged factors to its first load only."""
    from dark.lora.manager import AdapterManager
    from dark.lora.slots import AdapterSlots

    with OnlineLLM(str(tiny_models["qwen2"]), data_dir=tmp_path / "d") as llm:
        mc = llm.model.config
    shapes, layers = mc.projection_shapes(), mc.num_layers
    wide = _random_weights(shapes, layers, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj", "lm_head"], seed=1)
    narrow = _random_weights(shapes, layers, 4, ["q_proj", "down_proj", "lm_head"], seed=2)

    def fresh(weights, slot, staged=False):
        slots = AdapterSlots(mc, 3, 16, torch.device("cpu"), torch.bfloat16)
        slots.load(slot, wide)  # projections allocated as in the reused one
        slots.load(0 if slot else 1, weights, slots.stage(weights.tensors, weights.scaling) if staged else None)
        return slots

    reused = AdapterSlots(mc, 3, 16, torch.device("cpu"), torch.bfloat16)
    reused.load(1, wide)
    reused.load(1, narrow)
    expected = _slot_contents(fresh(narrow, 1), 0)
    got = _slot_contents(reused, 1)
    assert got.keys() == expected.keys() and len(got) == 7 * layers + 1
    for key in got:
        assert torch.equal(got[key][0], expected[key][0]) and torch.equal(got[key][1], expected[key][1]), key
    assert got[(0, "k_proj")][0].abs().sum() == 0 and got[(0, "q_proj")][0][4:].abs().sum() == 0
    assert got[(0, "q_proj")][0][:4].abs().sum() > 0 and reused.rank[1] == 4
    # staged from "device" factors (here the host's own) gives the same bits as the host path
    staged = _slot_contents(fresh(narrow, 1, staged=True), 0)
    for key in staged:
        assert torch.equal(staged[key][0], expected[key][0]) and torch.equal(staged[key][1], expected[key][1]), key

    mgr = AdapterManager(AdapterSlots(mc, 2, 16, torch.device("cpu"), torch.bfloat16))
    mgr.publish("skill", 1, wide, staged=mgr.slots.stage(wide.tensors, wide.scaling))
    mgr.publish("skill", 2, narrow, staged=mgr.slots.stage(narrow.tensors, narrow.scaling))
    assert list(mgr._staged) == [("skill", 2)]  # an older version's staged factors go when a newer one comes
    slot = mgr.acquire(("skill", 2))
    assert mgr._staged == {} and mgr.slots.rank[slot] == 4
    assert torch.equal(mgr.slots.A[(0, "q_proj")][slot], expected[(0, "q_proj")][0])
    mgr.release(slot)
    mgr.publish("other", 1, wide, staged=mgr.slots.stage(wide.tensors, wide.scaling))
    mgr.remove("other")
    assert mgr._staged == {}


@pytest.mark.parametrize("chunk", [1, 20000, 1 << 30], ids=["a_key_a_copy", "a_few_keys_a_copy", "one_copy"])
def test_a_host_version_staged_in_chunks_holds_the_bits_of_one_staged_whole(tiny_models, tmp_path, chunk, monkeypatch):
    """stage_from_host sends a version's factors in copies of up to STAGE_CHUNK bytes (whole keys each), so the
    device holds one chunk of the host's fp32 at a time: whatever the chunk, every key is staged, to the bits
    stage() gives the host factors as they are, with a key kept in bf16 on the host among fp32 ones."""
    import dark.lora.slots as slots_mod
    from dark.lora.slots import AdapterSlots

    with OnlineLLM(str(tiny_models["qwen2"]), data_dir=tmp_path / "d") as llm:
        mc = llm.model.config
    weights = _random_weights(mc.projection_shapes(), mc.num_layers, 8,
                              ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], seed=5)
    odd = next(iter(weights.tensors))
    weights.tensors[odd] = tuple(t.to(torch.bfloat16) for t in weights.tensors[odd])
    slots = AdapterSlots(mc, 2, 16, torch.device("cpu"), torch.bfloat16)
    monkeypatch.setattr(slots_mod, "STAGE_CHUNK", chunk)
    whole = slots.stage(weights.tensors, weights.scaling)
    got = slots.stage_from_host(weights)
    assert got.keys() == whole.keys() == weights.tensors.keys()
    for key in whole:
        assert torch.equal(got[key][0], whole[key][0]) and torch.equal(got[key][1], whole[key][1]), key
        assert got[key][0].untyped_storage().data_ptr() != weights.tensors[key][0].untyped_storage().data_ptr()


def test_a_version_loads_in_the_background_while_the_engine_serves(setup, tmp_path):
    """With background loads (on by default on CUDA), acquire() answers None while a version's factors are on their
    way to the device on the loader thread, then the slot, holding what a load on the asking thread puts there; the
    engine keeps serving meanwhile and a request on such a version answers as one loaded on the engine thread."""
    import threading

    _, _, llm = setup
    mgr = llm.engine.adapters
    weights = mgr.weights("a", 1)
    expected = llm.generate(PROMPTS[0], adapter="a", max_tokens=10)

    from dark.lora.manager import AdapterManager
    from dark.lora.slots import AdapterSlots

    own = AdapterManager(AdapterSlots(llm.model.config, 2, 16, torch.device("cpu"), torch.float32))
    own.background_loads = True
    loaded = threading.Event()
    own.on_loaded = loaded.set
    own.publish("a", 1, weights)
    assert own.acquire(("a", 1)) is None and ("a", 1) in own._loading
    assert loaded.wait(30)
    slot = own.acquire(("a", 1))
    assert slot is not None and own._loading == {} and own._staged == {}
    sync = AdapterSlots(llm.model.config, 2, 16, torch.device("cpu"), torch.float32)
    sync.load(0, weights)
    for key in sync.A:
        assert torch.equal(own.slots.A[key][slot], sync.A[key][0]) and torch.equal(own.slots.B[key][slot], sync.B[key][0])
    # a version whose host copy left memory comes back from its folder on the loader thread too; a load that
    # fails is raised to the request that asked, once
    own.publish("b", 1, weights, stored=True)
    own.publish("b", 2, weights, stored=True)
    own.loader = lambda name, version: (_ for _ in ()).throw(FileNotFoundError(f"no folder for {name} v{version}"))
    own.keep_in_memory = 1
    own._trim("b")
    assert own.loaded_versions("b") == [2]
    loaded.clear()
    assert own.acquire(("b", 1)) is None
    assert loaded.wait(30)
    with pytest.raises(FileNotFoundError, match="no folder for b v1"):
        own.acquire(("b", 1))
    assert own._failed == {} and own._loading == {}
    own.close()

    # the engine's own manager: a request on a version not in a slot waits for the loader, the others go on
    llm.engine.call_between_steps(lambda: setattr(mgr, "background_loads", True)).result(30)
    try:
        mgr.publish("a-copy", 1, weights)
        assert llm.generate(PROMPTS[0], adapter="a-copy", max_tokens=10) == expected
        # it came through the loader thread, which the engine's manager had not needed before
        assert ("a-copy", 1) in mgr._slot_of and mgr._loading == {} and mgr._loader is not None
    finally:
        llm.engine.call_between_steps(lambda: setattr(mgr, "background_loads", False)).result(30)
        mgr.remove("a-copy")


def test_a_request_whose_adapter_is_deleted_while_it_waits_fails_alone(setup):
    """A request queued on an adapter that is deleted before it starts ends with an error naming the adapter; the
    engine goes on serving the others."""
    import threading

    from dark.engine.sequence import SamplingParams

    _, _, llm = setup
    mgr = llm.engine.adapters
    mgr.publish("gone", 1, mgr.weights("a", 1))
    outs, done = [], threading.Event()

    def on_output(out):
        if out.finished:
            outs.append(out)
            done.set()

    def add_then_delete():  # on the engine thread, between steps: the request is queued, not started
        llm.engine.add_request(llm.encode(PROMPTS[0]), SamplingParams(max_tokens=4), ("gone", 1), on_output)
        mgr.remove("gone")

    llm.engine.call_between_steps(add_then_delete).result(30)
    assert done.wait(30)
    assert outs[0].finish_reason == "error" and "gone" in str(outs[0].error)
    assert isinstance(outs[0].error, UnknownAdapterError)
    assert isinstance(llm.generate(PROMPTS[1], max_tokens=4), str)
    assert isinstance(llm.generate(PROMPTS[1], adapter="a", max_tokens=4), str)


def test_requests_behind_one_whose_version_is_loading_are_served_meanwhile(setup):
    """While a version is on its way to the device (here its host copy is read from its folder, held back until the
    test lets it go), the engine goes on: a request on the base model and one on a resident adapter, both sent after
    it, finish while it still waits; then it finishes too, with the answer of a version loaded on the spot."""
    import threading

    from dark.engine.sequence import SamplingParams

    _, _, llm = setup
    mgr = llm.engine.adapters
    weights = mgr.weights("a", 1)
    expected = llm.generate(PROMPTS[0], adapter="a", max_tokens=8)
    gate, asked = threading.Event(), threading.Event()
    real_loader = mgr.loader

    def slow_loader(name, version):
        asked.set()
        assert gate.wait(60)
        return weights

    llm.engine.call_between_steps(lambda: setattr(mgr, "background_loads", True)).result(30)
    mgr.publish("held", 1, weights, stored=True)
    mgr.publish("held", 2, weights, stored=True)
    mgr.loader, keep = slow_loader, mgr.keep_in_memory
    mgr.keep_in_memory = 1
    mgr._trim("held")  # version 1's host copy leaves memory: the loader must bring it back
    try:
        assert mgr.loaded_versions("held") == [2]
        outs, done = [], threading.Event()
        llm.engine.add_request(llm.encode(PROMPTS[0]), SamplingParams(max_tokens=8, ignore_eos=True), ("held", 1),
                               lambda o: o.finished and (outs.append(o), done.set()))
        assert asked.wait(30)
        # sent after it, served before it
        assert isinstance(llm.generate(PROMPTS[1], max_tokens=6), str)
        assert isinstance(llm.generate(PROMPTS[2], adapter="a", max_tokens=6), str)
        assert not done.is_set() and mgr.loading(("held", 1))
        gate.set()
        assert done.wait(30) and outs[0].error is None
        assert outs[0].text == expected
    finally:
        gate.set()
        mgr.loader, mgr.keep_in_memory = real_loader, keep
        llm.engine.call_between_steps(lambda: setattr(mgr, "background_loads", False)).result(30)
        mgr.remove("held")
