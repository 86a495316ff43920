"""The paper's tasks by name or from local files, their prompts and client partitions (evaluation:
`deca_ds.evaluation`).

Tasks (`TASKS`): `nwgi`, `agnews`, `tfns`, `mnli` (classification) and `alpaca` (generation). `load_task`
reads one from the Hugging Face hub (or the local `datasets` cache; `HF_DATASETS_OFFLINE=1` /
`HF_HUB_OFFLINE=1` are honoured even when set after `datasets` was imported) or from local
JSONL / JSON / CSV / Parquet files, and turns every row into a `Record`: an instruction-style
prompt, the answer the model is trained to give, and the label index (classification).

Column mapping: a registered task's columns are those of its hub dataset; `text_column`,
`text_pair_column`, `label_column`, `response_column` and `label_names` override them (for local
copies whose columns are named differently). For a generation task `text_column` is the
instruction, `text_pair_column` the optional input and `response_column` the output.

    tasks.py       the task specs, records and prompt templates
    loading.py     rows from the hub or local files into records
    features.py    records as the model reads them (chat template, encoding)
    partitions.py  the clients' shares, their skew and the partition report
"""

from .features import fits_max_length, render, render_chat, to_features, vocabulary
from .loading import load_task
from .partitions import (
    histogram_skew,
    instruction_category,
    label_skew,
    partition_keys,
    partition_records,
    write_partition_report,
)
from .tasks import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_INPUT,
    TASKS,
    LoadedTask,
    Record,
    TaskSpec,
    alpaca_prompt,
    classification_prompt,
    resolve_spec,
    verbalize,
)

__all__ = [
    "ALPACA_PROMPT", "ALPACA_PROMPT_INPUT", "TASKS", "LoadedTask", "Record", "TaskSpec", "alpaca_prompt",
    "classification_prompt", "fits_max_length", "histogram_skew", "instruction_category", "label_skew", "load_task",
    "partition_keys", "partition_records", "render", "render_chat", "resolve_spec", "to_features", "verbalize",
    "vocabulary", "write_partition_report",
]
