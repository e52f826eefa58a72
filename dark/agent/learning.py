"""Learning tool use: a corrected (or approved) call becomes a learn example with the full context the model saw.

The example is the run's messages up to the turn, exactly as the model was prompted (the system turn with the
tool list, any history, earlier turns and tool results), and then the assistant turn it should have written:
the calls as the user left them, in the <tool_call> format. Taught on the server's adapter (`mcp-<server>`),
the model makes that call itself next time.

Small models that never wrote "<tool_call>" need LoRA on lm_head too (see DESIGN.md), hence TOOL_LORA.
It shapes the adapter when it is created; an adapter that exists keeps its own shape.
"""
from __future__ import annotations

from ..config import DEFAULT_LORA_TARGETS
from ..errors import InvalidRequestError
from .loop import AgentRun, ToolCall

TOOL_LORA = {"r": 16, "alpha": 32, "target_modules": [*DEFAULT_LORA_TARGETS, "lm_head"]}


def example_for_call(run: AgentRun, call: ToolCall | str, *, rejected: bool = False) -> dict:
    """{"messages": [...]} teaching the turn that holds `call`, as it now stands.

    For an edited call (or a turn the user rewrote) the assistant turn holds the corrected calls, rejected ones
    left out; for a call approved as proposed it is the model's own turn (a positive example). With `rejected`,
    the model's original text of a corrected turn rides along as "rejected", and the learner also pushes away
    from it (DPO). That is off by default: the corrected call alone already becomes the greedy answer, and on
    SmolLM2 the preference term took 5 steps where plain SFT took 1.
    """
    call = run.calls[call] if isinstance(call, str) else call
    if run.calls.get(call.id) is not call:
        raise InvalidRequestError(f"call {call.id} does not belong to run {run.id}")
    if call.status in ("pending", "invalid", "rejected", "replaced"):
        raise InvalidRequestError(f"call {call.id} is {call.status}: only a call that ran (approved, edited or "
                                  "written by the user) can be taught")
    return example_for_turn(run, call.turn, rejected=rejected)


def example_for_turn(run: AgentRun, turn: int, *, rejected: bool = False) -> dict:
    """{"messages": [...]} teaching one assistant turn of the run as it now stands: its calls (as corrected), or
    a final answer the user kept (a positive example that no tool was needed there)."""
    if not isinstance(turn, int) or not 0 <= turn < len(run.turns):
        raise InvalidRequestError(f"run {run.id} has no turn {turn!r}")
    t = run.turns[turn]
    context = [dict(m) for m in run.messages[:t.message_index]]
    reply = run.turn_text(t, include_rejected=False)
    if not reply.strip():
        raise InvalidRequestError(f"turn {turn} has nothing left to teach (all its calls were rejected)")
    example = {"messages": context + [{"role": "assistant", "content": reply}]}
    if rejected and t.corrected and t.text.strip() and t.text.strip() != reply.strip():
        example["rejected"] = t.text
    return example


def examples_for_run(run: AgentRun, *, include_approved: bool = False, rejected: bool = False) -> list[dict]:
    """One example per corrected turn of the run (and, with include_approved, per turn approved as proposed)."""
    out = []
    for turn in run.turns:
        calls = [run.calls[c] for c in turn.call_ids if run.calls[c].status in ("done", "error")]
        if calls and (turn.corrected or include_approved):
            out.append(example_for_call(run, calls[0], rejected=rejected))
    return out


def learn_from_run(llm, run: AgentRun, *, call_ids: list[str] | None = None, include_approved: bool = False,
                   rejected: bool = False, adapter: str | None = None, wait: bool = False, on_event=None,
                   **learn_settings):
    """Queue a learn job on the run's tool adapter (default `mcp-<server>`) with its corrections (or the turns of
    `call_ids`), shaped by TOOL_LORA when the adapter is new.

    Returns the LearnJob (or, with wait, its report). `learn_settings` go to the learner (e.g. max_steps=80).
    """
    if call_ids:
        examples, seen = [], set()
        for cid in call_ids:
            call = run.calls.get(cid)
            if call is None:
                raise InvalidRequestError(f"run {run.id} has no call {cid!r}")
            if call.turn not in seen:
                seen.add(call.turn)
                examples.append(example_for_call(run, call, rejected=rejected))
    else:
        examples = examples_for_run(run, include_approved=include_approved, rejected=rejected)
    if not examples:
        raise InvalidRequestError("nothing to learn: no call of this run was corrected"
                                  + ("" if include_approved else " (pass include_approved to teach approved calls)"))
    job = llm.submit_learn(examples, adapter=adapter or run.learn_adapter, kind="sft", source="agent",
                           on_event=on_event, lora=TOOL_LORA, **learn_settings)
    return job.wait() if wait else job
