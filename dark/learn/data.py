"""Learn examples: validation, rendering with the chat template, and which tokens carry the loss."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidRequestError

ROLES = ("system", "user", "assistant", "tool")


def normalize_examples(examples, kind: str = "sft") -> list[dict]:
    """Check learn examples and return them as {"messages": [...], "rejected"?: str}. Raises on the first bad one.

    An example is {"prompt", "response"} or {"messages": [...]} whose last message is the assistant reply to
    teach; "rejected" (a replaced answer) may come with either. For kind "unlearn" the response is the answer
    to push away from.
    """
    if not isinstance(examples, list) or not examples:
        raise InvalidRequestError("examples must be a non-empty list of {'prompt', 'response'} or {'messages'} objects")
    out = []
    for i, ex in enumerate(examples):
        where = f"examples[{i}]"
        if not isinstance(ex, dict):
            raise InvalidRequestError(f"{where} must be an object, not {type(ex).__name__}")
        if "messages" in ex:
            messages = ex["messages"]
            if not isinstance(messages, list) or len(messages) < 2:
                raise InvalidRequestError(f"{where}.messages must be a list of at least two messages")
            for j, m in enumerate(messages):
                if not isinstance(m, dict) or m.get("role") not in ROLES:
                    raise InvalidRequestError(f"{where}.messages[{j}] needs a role, one of {', '.join(ROLES)}")
                if not isinstance(m.get("content"), str):
                    raise InvalidRequestError(f"{where}.messages[{j}].content must be a string")
            if messages[-1]["role"] != "assistant" or not messages[-1]["content"].strip():
                raise InvalidRequestError(f"{where}.messages must end with a non-empty assistant message (the reply to learn)")
            messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        else:
            for key in ("prompt", "response"):
                if key not in ex:
                    raise InvalidRequestError(f"{where} is missing '{key}'")
                if not isinstance(ex[key], str) or not ex[key].strip():
                    raise InvalidRequestError(f"{where}.{key} must be a non-empty string")
            messages = [{"role": "user", "content": ex["prompt"]}, {"role": "assistant", "content": ex["response"]}]
        item = {"messages": messages}
        if ex.get("rejected") is not None:
            if not isinstance(ex["rejected"], str) or not ex["rejected"].strip():
                raise InvalidRequestError(f"{where}.rejected must be a non-empty string")
            item["rejected"] = ex["rejected"]
        out.append(item)
    return out


@dataclass
class Rendered:
    input_ids: list[int]
    labels: list[int]   # -100 where no loss falls


def render(tokenizer, messages: list[dict], reply: str | None = None) -> Rendered:
    """Tokens of the conversation with `reply` (default: the last message's content) as the assistant's turn.

    Loss falls on the reply and the end-of-turn token only, the way the model will have to produce them.
    """
    context, reply = messages[:-1], messages[-1]["content"] if reply is None else reply
    prefix = list(_ids(tokenizer.apply_chat_template(context, add_generation_prompt=True, tokenize=True)))
    full = list(_ids(tokenizer.apply_chat_template(context + [{"role": "assistant", "content": reply}], tokenize=True)))
    if full[:len(prefix)] != prefix:  # a template that renders the last turn differently: fall back to plain text
        full = prefix + tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    labels = [-100] * len(prefix) + full[len(prefix):]
    # nothing after the end of the turn is the model's to say
    eos = tokenizer.eos_token_id
    if eos in full[len(prefix):]:
        end = full.index(eos, len(prefix)) + 1
        full, labels = full[:end], labels[:end]
    return Rendered(full, labels)


def _ids(x):
    return x["input_ids"] if hasattr(x, "keys") else x


def rewordings(prompt: str) -> list[str]:
    """Cheap surface variants of a prompt (case, punctuation, a polite frame), for when the model is too small
    to write real paraphrases. They teach that the answer belongs to the question, not to its exact spelling."""
    p = prompt.strip()
    core = p.rstrip("?.!")
    variants = [core, p.lower(), f"Please answer: {p}", f"{core}?" if not p.endswith("?") else f"{core}."]
    return [v for v in dict.fromkeys(variants) if v and v != p]
