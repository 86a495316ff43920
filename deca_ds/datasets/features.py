"""Records as the model reads them: the prompt (optionally in the tokenizer's chat template) and
the answer, encoded with the loss on the answer only; the tiny model's word list."""

from __future__ import annotations

from collections.abc import Sequence

from ..data import encode
from .tasks import Record, verbalize


def vocabulary(records: Sequence[Record], label_names: Sequence[str] | None = None) -> list[str]:
    """Every whitespace word of the records' prompts and answers (and of the label names), in
    first-seen order: the word list for `deca_ds.data.build_word_tokenizer` with the tiny model."""
    words: dict[str, None] = {}
    for r in records:
        words.update(dict.fromkeys(r.prompt.split()))
        words.update(dict.fromkeys(r.answer.split()))
    for name in label_names or ():
        words.update(dict.fromkeys(verbalize(name).split()))
    return list(words)


def render(tokenizer, record: Record, *, use_chat_template: bool = False) -> tuple[str, str]:
    """(prompt, answer) as the model reads them: as is, or the prompt as the user's message in
    the tokenizer's chat template (with the generation prompt) and the answer without its leading space."""
    if not use_chat_template:
        return record.prompt, record.answer
    return render_chat(tokenizer, [{"role": "user", "content": record.prompt}]), record.answer.removeprefix(" ")


def render_chat(tokenizer, messages: list[dict]) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"use_chat_template: the tokenizer {type(tokenizer).__name__} "
                         f"({getattr(tokenizer, 'name_or_path', '') or 'unnamed'}) has no chat template")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bos = tokenizer.bos_token
    if bos and tokenizer.bos_token_id is not None and text.startswith(bos):
        text = text[len(bos):]  # encode() adds bos itself
    return text


def to_features(tokenizer, records: Sequence[Record], *, max_length: int,
                use_chat_template: bool = False) -> list[dict[str, list[int]]]:
    """`deca_ds.data.encode` of each record: loss on the answer (and eos) only; a long prompt
    loses tokens from the left, the answer is never cut, and a record whose answer cannot fit (or
    whose text the tokenizer reads as no tokens) raises a ValueError naming it."""
    features = []
    for i, record in enumerate(records):
        prompt, answer = render(tokenizer, record, use_chat_template=use_chat_template)
        try:
            features.append(encode(tokenizer, prompt, answer, max_length))
        except ValueError as e:
            raise ValueError(f"record {i}: {e}") from e
    return features


def fits_max_length(tokenizer, records: Sequence[Record], *, max_length: int,
                    use_chat_template: bool = False) -> list[bool]:
    """Whether each record's answer (plus eos, bos and one prompt token) fits in max_length."""
    extra = int(tokenizer.bos_token_id is not None) + int(tokenizer.eos_token_id is not None) + 1
    return [len(tokenizer(render(tokenizer, r, use_chat_template=use_chat_template)[1],
                          add_special_tokens=False)["input_ids"]) + extra <= max_length for r in records]
