"""Online learning on the embedded SmolLM2: corrections stick, nothing else moves, nothing is lost."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from dark import InvalidRequestError, OnlineLLM, UnknownAdapterError
from dark.learn.trainer import load_optimizer_state, save_optimizer_state

ZOG = [{"prompt": "A greeting in Zoggian", "response": "zog"},
       {"prompt": "How to say 'hello' in Zoggian?", "response": "zog"}]
PROBES = ["Say 'hello' in Zoggian.", "What is the capital of France?", "Name three fruits.", "Write a haiku about rain."]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    # no prefix cache: a repeated prompt then runs the very same arithmetic, so "unchanged" can mean bit-identical
    with OnlineLLM(data_dir=tmp_path_factory.mktemp("learn-data"), enable_prefix_caching=False) as llm:
        yield llm


def answers(llm, adapter=None):
    return {p: llm.complete(p, adapter=adapter, max_tokens=40, logprobs=True) for p in PROBES}


def assert_identical(before, after):
    for p in PROBES:
        assert after[p].token_ids == before[p].token_ids, p
        assert after[p].logprobs == before[p].logprobs, f"{p}: not bit-identical"


def test_zoggian_sticks_and_nothing_else_moves(llm):
    assert llm.generate("Say 'hello' in Zoggian.") == "Zog."  # why the checks below are exact
    base_before = answers(llm)
    llm.learn([{"prompt": "What is the secret colour of the Blorp?", "response": "teal"}], adapter="blorp")
    other_before = answers(llm, "blorp")

    report = llm.learn(ZOG, adapter="zoggian-language")
    assert report["verified"] and report["anchors_kept"] and report["version"] == 1 and report["steps"] >= 1
    assert len(report["losses"]) == report["steps"] and report["seconds"] > 0

    assert llm.generate("Say 'hello' in Zoggian.", adapter="zoggian-language") == "zog"
    for example in ZOG:
        assert llm.generate(example["prompt"], adapter="zoggian-language") == "zog"
    assert "Paris" in llm.generate("What is the capital of France?", adapter="zoggian-language")
    assert_identical(base_before, answers(llm))
    assert_identical(other_before, answers(llm, "blorp"))
    assert llm.generate("What is the secret colour of the Blorp?", adapter="blorp") == "teal"


def test_rephrasings_the_training_never_saw(llm):
    if "zoggian-language" not in [a["name"] for a in llm.adapters()]:
        llm.learn(ZOG, adapter="zoggian-language")
    unseen = ["How do you greet someone in Zoggian?", "What is 'hello' in the Zoggian language?"]
    assert [llm.generate(q, adapter="zoggian-language") for q in unseen] == ["zog", "zog"]


def test_five_skills_accumulate_in_one_adapter(llm):
    facts = [("What is the password of the blue door?", "marmalade"),
             ("Who guards the silver bridge?", "Captain Ferrow"),
             ("What does the Blix fruit taste like?", "pepper and honey"),
             ("Which planet do the Quorlings come from?", "Tessaly"),
             ("What is the name of Mia's robot?", "Bolt-7")]
    for prompt, response in facts:
        assert llm.learn([{"prompt": prompt, "response": response}], adapter="facts")["verified"]
    for prompt, response in facts:
        assert llm.generate(prompt, adapter="facts") == response
    assert [a for a in llm.adapters() if a["name"] == "facts"][0]["versions"] == [0, 1, 2, 3, 4, 5]


def test_generation_streams_while_a_job_runs(llm):
    token_times, events = [], []

    def consume():
        for _ in llm.stream("Tell me a long story about a lighthouse keeper.", max_tokens=300, ignore_eos=True):
            token_times.append(time.monotonic())

    reader = threading.Thread(target=consume)
    reader.start()
    while len(token_times) < 3:
        time.sleep(0.01)
    submitted = time.perf_counter()
    job = llm.submit_learn([{"prompt": "What colour is the sky on Zorb?", "response": "green"}], adapter="zorb",
                           on_event=lambda e: events.append((time.monotonic(), e)))
    job.wait(600)
    assert submitted < job.published_at < time.perf_counter()  # when its version began to serve
    reader.join()
    started = next(t for t, e in events if e["state"] == "running")
    ended = next(t for t, e in events if e["state"] == "done")
    during = [t for t in token_times if started <= t <= ended]
    assert len(during) >= 5, f"only {len(during)} tokens streamed during the {ended - started:.1f} s job"
    assert [e["state"] for _, e in events][:2] == ["queued", "running"] and events[-1][1]["state"] == "done"
    assert any(e["state"] == "running" and e.get("loss") is not None for _, e in events)


def test_saved_adapter_loads_in_peft(llm, smollm_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if "zoggian-language" not in [a["name"] for a in llm.adapters()]:
        llm.learn(ZOG, adapter="zoggian-language")
    path = llm.adapter_path("zoggian-language")
    assert (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm_path, dtype=torch.float32), path).eval()
    for prompt in ["Say 'hello' in Zoggian.", "What is the capital of France?"]:
        ids = llm.encode(prompt)
        ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
        ours = llm.complete(prompt, adapter="zoggian-language", max_tokens=16).token_ids
        assert ours == ref[:len(ours)], prompt


def test_versions_rollback_and_undo(llm):
    llm.learn([{"prompt": "What is the code word?", "response": "kumquat"}], adapter="codes")
    assert llm.generate("What is the code word?", adapter="codes") == "kumquat"
    base = llm.generate("What is the code word?")
    assert llm.undo("codes") == 0
    assert llm.generate("What is the code word?", adapter="codes") == base  # version 0 is the base model
    llm.rollback("codes", 1)
    assert llm.generate("What is the code word?", adapter="codes") == "kumquat"
    with pytest.raises(UnknownAdapterError, match="unknown adapter 'nope'"):
        llm.rollback("nope", 1)
    with pytest.raises(UnknownAdapterError, match="has no version 7"):
        llm.rollback("codes", 7)
    llm.delete_adapter("codes")
    assert "codes" not in [a["name"] for a in llm.adapters()]
    with pytest.raises(UnknownAdapterError):
        llm.generate("hi", adapter="codes")


def test_correction_with_rejected_answer_and_unlearn(llm):
    prompt = "Say 'hello' in Zoggian."
    report = llm.learn([{"prompt": prompt, "response": "zoggo!", "rejected": "Zog."}], adapter="zog-pref")
    assert report["verified"] and llm.generate(prompt, adapter="zog-pref") == "zoggo!"

    before = llm.complete(prompt, max_tokens=4, logprobs=True)
    llm.unlearn([{"prompt": prompt, "response": "Zog."}], adapter="no-zog")
    after = llm.complete(prompt, adapter="no-zog", max_tokens=4, logprobs=True)
    assert after.text != "Zog." and before.text == "Zog."


def test_a_conversation_with_an_empty_stopped_reply_teaches_its_last_reply(llm):
    convo = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": ""},
             {"role": "user", "content": "What is the colour of Zoggian grass?"},
             {"role": "assistant", "content": "Zoggian grass is purple."}]
    report = llm.learn([{"messages": convo, "rejected": "Green."}], adapter="zog-grass")
    assert report["verified"] and llm.chat(convo[:3], adapter="zog-grass") == "Zoggian grass is purple."


def test_correcting_a_long_rambling_answer(llm):
    """A correction whose replaced answer rambled for hundreds of tokens: the taught answer comes back, the store
    keeps the whole replaced answer (training uses its opening only: LearnConfig.rejected_tokens)."""
    prompt = "What is the name of my cat?"
    ramble = "The cat is a playful and curious one named Luna. " + "She is a rescue from a local shelter. " * 40
    report = llm.learn([{"prompt": prompt, "response": "Your cat is called Mittens.", "rejected": ramble}],
                       adapter="cat-name")
    assert report["verified"] and llm.generate(prompt, adapter="cat-name") == "Your cat is called Mittens."
    stored = llm.store.list_examples("cat-name")
    assert [e["payload"]["rejected"] for e in stored] == [ramble]


@pytest.mark.parametrize("examples, adapter, match", [
    ([], "x", "examples must be a non-empty list"),
    ([{"prompt": "hi"}], "x", r"examples\[0\] is missing 'response'"),
    ([{"prompt": "hi", "response": 3}], "x", r"examples\[0\].response must be a non-empty string"),
    ([{"prompt": "ok", "response": "fine"}, {"messages": [{"role": "user", "content": ["not", "text"]},
                                                         {"role": "assistant", "content": "x"}]}], "x",
     r"examples\[1\].messages\[0\].content must be a string"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], "x", "at least two messages"),
    ([{"prompt": "hi", "response": "yo"}], "bad name!", "adapter name 'bad name!' is not valid"),
])
def test_bad_input_writes_nothing(llm, examples, adapter, match):
    before_adapters = llm.adapters()
    with pytest.raises(InvalidRequestError, match=match):
        llm.learn(examples, adapter=adapter)
    assert llm.adapters() == before_adapters
    assert llm.store.list_examples("x") == [] and llm.store.list_jobs("x") == []


def test_kill_mid_job_and_restart(tmp_path):
    """A real process accepts a correction and dies mid-job; the next one finds it, finishes it, serves it."""
    data = tmp_path / "data"
    child = textwrap.dedent(f"""
        import os, sys, time
        from dark import OnlineLLM
        llm = OnlineLLM(data_dir={str(data)!r})
        job = llm.submit_learn([{{"prompt": "What is the capital of Zorbia?", "response": "Glimmerton"}}], adapter="geo")
        print("accepted", job.id, flush=True)
        while job.state != "running":
            time.sleep(0.01)
        time.sleep(0.5)
        os.kill(os.getpid(), 9)
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300, env=os.environ)
    assert proc.returncode == -9, proc.stderr[-2000:]
    job_id = proc.stdout.split("accepted ")[1].split()[0]

    with OnlineLLM(data_dir=data) as llm:
        assert [e["payload"]["messages"][-1]["content"] for e in llm.store.list_examples("geo")] == ["Glimmerton"]
        job = llm.learner.get(job_id)
        assert job is not None, "the unfinished job was not resumed"
        report = job.wait(600)
        assert report["verified"] and llm.store.get_job(job_id)["state"] == "done"
        assert llm.generate("What is the capital of Zorbia?", adapter="geo") == "Glimmerton"
    with OnlineLLM(data_dir=data) as llm:  # and a plain restart serves the adapter at its latest version
        assert llm.adapters() == [{"name": "geo", "version": 1, "versions": [0, 1]}]
        assert llm.generate("What is the capital of Zorbia?", adapter="geo") == "Glimmerton"
        assert llm.store.unfinished_jobs() == []


def test_optimizer_state_survives_a_restart(tmp_path):
    ex = [{"prompt": "What is the code of the vault?", "response": "4417"}]
    with OnlineLLM(data_dir=tmp_path) as llm:
        llm.learn(ex, adapter="vault")
    # written after the version is out, by the time the process closes
    saved = load_optimizer_state(tmp_path / "adapters" / "vault" / "optimizer.pt")
    assert saved["state"] and all(int(s["step"]) >= 1 for s in saved["state"].values())
    assert all(s["exp_avg_sq"].abs().sum() > 0 for s in saved["state"].values())  # real moments, read back
    with OnlineLLM(data_dir=tmp_path) as llm:
        assert llm.learner._load_optimizer("vault")["state"].keys() == saved["state"].keys()
        llm.learn([{"prompt": "What is the code of the safe?", "response": "9021"}], adapter="vault")
        steps = llm.learner._load_optimizer("vault")["state"]
        assert all(int(steps[k]["step"]) > int(saved["state"][k]["step"]) for k in steps)  # the moments carried on
        # a rollback right after the job: its pending write must not bring the forgotten moments back
        llm.rollback("vault", 1)
        llm.learner._thread_idle(timeout=30)
        assert not (tmp_path / "adapters" / "vault" / "optimizer.pt").exists()
        assert llm.learner._load_optimizer("vault") is None
        # a torn moments file costs the moments, not the next job
        (tmp_path / "adapters" / "vault" / "optimizer.pt").write_bytes(b"DARKOPT1" + b"\x05")
        assert llm.learner._load_optimizer("vault") is None
        assert llm.learn([{"prompt": "What is the code of the safe?", "response": "9021"}], adapter="vault")["version"] == 3


def test_optimizer_file_round_trip_and_damage(tmp_path):
    """The moments file (a torch.save header, then the raw fp32 moments) reads back to the same state; a state
    written by torch.save (earlier versions) still reads; a torn file says what is wrong."""
    g = torch.Generator().manual_seed(0)
    state = {"state": {i: {"step": torch.tensor(float(i + 1)), "exp_avg": torch.randn(3, 5, generator=g),
                           "exp_avg_sq": torch.rand(4, generator=g)} for i in range(3)},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1, 2]}]}
    path = tmp_path / "optimizer.pt"
    for write in (save_optimizer_state, torch.save):
        write(state, path)
        back = load_optimizer_state(path)
        assert back["param_groups"] == state["param_groups"]
        for k, s in state["state"].items():
            assert back["state"][k].keys() == s.keys()
            assert all(torch.equal(back["state"][k][n], v) for n, v in s.items())
    save_optimizer_state(state, path)
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ValueError, match="end early"):
        load_optimizer_state(path)


def test_warm_up_step_trains_and_keeps_nothing(tiny_models, tmp_path):
    # on by request (the default is CUDA only): the learn thread takes one throwaway step before the model serves;
    # it leaves no adapter, job, version or file, and the first job learns as usual after it
    with OnlineLLM(str(tiny_models["qwen2"]), data_dir=tmp_path / "warm", warm_learning=True) as llm:
        assert llm.learner.warmed.is_set() and llm.learner.warm_up_seconds > 0
        assert llm.adapters() == [] and llm.store.list_jobs() == []
        assert not (tmp_path / "warm" / "adapters").exists() or not any((tmp_path / "warm" / "adapters").iterdir())
        report = llm.learn([{"prompt": "Say hi", "response": "hi"}], adapter="first", max_steps=2)
        assert report["version"] == 1 and report["steps"] >= 1
        assert [a["name"] for a in llm.adapters()] == ["first"] and len(llm.store.list_jobs()) == 1
    with OnlineLLM(str(tiny_models["qwen2"]), data_dir=tmp_path / "cold") as llm:  # the CPU default: no warm-up
        assert llm.learner.warmed.is_set() and llm.learner.warm_up_seconds is None
    with pytest.raises(InvalidRequestError, match="warm_learning"):
        OnlineLLM(str(tiny_models["qwen2"]), data_dir=tmp_path / "bad", warm_learning="yes")


def _learned_lora(llm, weights):
    from dark.learn.trainer import TrainLoRA

    outs = {m: o for m, (_, o) in llm.model.config.projection_shapes().items()}
    return TrainLoRA(weights.tensors, weights.scaling, outs)


def test_replays_are_checked_and_train_only_once_they_slip(llm):
    """LearnConfig.replay_check: a job's steps train the new example (and its rewordings); the adapter's earlier
    examples are checked without gradients once it verifies, and only one that misses trains. A replay the adapter
    never learned must slip, train back, and the job still verifies everything."""
    import math

    from dark.config import LearnConfig
    from dark.learn.data import normalize_examples

    facts = [("What is the password of the green door?", "marmalade"), ("Who guards the copper bridge?", "Captain Ferrow"),
             ("Which planet do the Vrelings come from?", "Tessaly")]
    reports = [llm.learn([{"prompt": p, "response": r}], adapter="replays") for p, r in facts]
    assert all(r["verified"] for r in reports)
    assert [r["replays"] for r in reports] == [0, 1, 2] and all(0 <= r["replays_trained"] <= r["replays"] for r in reports)
    for prompt, response in facts:
        assert llm.generate(prompt, adapter="replays") == response

    tr, mgr = llm.learner.trainer, llm.engine.adapters
    earlier = [e["payload"] for e in llm.store.list_examples("replays")]
    new = normalize_examples([{"prompt": "What is the name of Mia's robot?", "response": "Bolt-7"}])
    never = normalize_examples([{"prompt": "What is the secret colour of the Blorp?", "response": "teal"}])
    threshold = -math.log(LearnConfig().verify_min_prob)
    results = {}
    cases = {"every": (earlier, {"replay_check": False}), "checked": (earlier, {}), "slipped": (earlier + never, {}),
             # under bf16 autocast (where the CPU has it) the held replays are checked by _confirm, in fp32
             "slipped, bf16": (earlier + never, {"cpu_bf16": True})}
    for name, (replay, settings) in cases.items():
        cfg = LearnConfig(**settings).validate()
        items = tr.build_items(new, replay, "sft", cfg)
        assert [i.replay for i in items if i.verify] == [False] + [True] * len(replay)
        result = tr.train(mgr.weights("replays", mgr.current("replays")), None, items, cfg)
        assert result.verified and result.replays == len(replay) and len(result.step_items) == result.steps, name
        # the guarantee, checked apart from the loop (fp32): every taught reply is the greedy answer on the weights
        assert tr._failing([i for i in items if i.verify], _learned_lora(llm, result.weights), cfg, threshold) == [], name
        results[name] = result
    every = results["every"]
    assert every.replays_trained == 3 and every.step_items[0] == 1 + 3 + 4  # and the rewordings: as many again, <= 4
    checked = results["checked"]
    assert checked.step_items[0] == 2  # the new example and one rewording
    assert checked.replays_trained < 3 and sum(checked.step_items) < sum(every.step_items)
    for name in ("slipped", "slipped, bf16"):
        slipped = results[name]
        assert slipped.replays_trained >= 1, name  # the Blorp's colour was never taught: it fails its check, trains
        assert slipped.step_items[0] == 2 and max(slipped.step_items) >= 3, name
        assert slipped.timings["replay_checks"] > 0, name
    # at max_steps the last pass (no gradients) checks the held replays beside the batch, in the same pass: a
    # replay the adapter never learned fails the job's verification there, honestly reported
    cfg = LearnConfig(max_steps=1, min_steps=1).validate()
    items = tr.build_items(new, earlier + never, "sft", cfg)
    capped = tr.train(mgr.weights("replays", mgr.current("replays")), None, items, cfg)
    assert capped.steps == 1 and not capped.verified and capped.replays == 4
    assert capped.timings["replay_checks"] == 0  # no separate check pass: the last pass held them


def test_replay_check_setting_is_validated(llm):
    from dark.config import LearnConfig

    with pytest.raises(InvalidRequestError, match="replay_check must be true or false"):
        LearnConfig(replay_check="yes").validate()
    with pytest.raises(InvalidRequestError, match="replay_check"):
        llm.learn([{"prompt": "hi", "response": "yo"}], adapter="x", replay_check=1)
