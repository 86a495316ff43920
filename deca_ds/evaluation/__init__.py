"""Evaluation of a trained model: classification by answer likelihood, generation (answers to a
questions file, ROUGE-L), and MT-Bench grading by an LLM judge."""

from .classification import (
    classification_metrics,
    evaluate_classification,
    evaluate_records,
    score_answers,
    score_labels,
)
from .endpoint import RedirectRefused, judge_api_key, judge_url, safe_opener
from .generation import (
    answer_sets,
    conversation_prompt,
    generate_answers,
    read_questions,
    rouge_l,
    rouge_l_of_answers,
)
from .judge import NEED_REFERENCE, judge_answers, judge_prompt, load_references, parse_rating

__all__ = [
    "NEED_REFERENCE", "RedirectRefused", "answer_sets", "classification_metrics", "conversation_prompt",
    "evaluate_classification",
    "evaluate_records", "generate_answers", "judge_answers", "judge_api_key", "judge_prompt", "judge_url",
    "load_references", "parse_rating", "read_questions", "rouge_l", "rouge_l_of_answers", "safe_opener",
    "score_answers", "score_labels",
]
