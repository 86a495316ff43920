"""Reading the mappings users write (run files, grid files, DeepSpeed configs) as YAML or JSON with
one rule more than the parsers': a key given twice in one mapping is an error. PyYAML's and json's
own loaders keep the last value silently, so a run file with `lr:` twice trained with whichever
came second; YAML 1.2 requires keys to be unique, and JSON's RFC 8259 asks for it."""

from __future__ import annotations

import json

import yaml
from yaml.constructor import ConstructorError


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: keys given after it override
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: the base constructor names it
                    continue
                if first is not key_node:
                    lines = f"lines {first.start_mark.line + 1} and {key_node.start_mark.line + 1}"
                    raise ConstructorError(problem=f"the key {key!r} is given twice ({lines}); give each key once")
        return super().construct_mapping(node, deep)


def load_yaml(text: str):
    """`text` as yaml.safe_load reads it; a repeated key raises yaml.YAMLError naming it and its lines."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


def repeated(values: list) -> list:
    """The values `values` holds more than once, each once, in the order of their first repeat
    (compared by ==: lists and other unhashable values too)."""
    seen, again = [], []
    for v in values:
        if v in seen and v not in again:
            again.append(v)
        seen.append(v)
    return again


def _unique(pairs: list[tuple[str, object]]) -> dict:
    again = repeated([k for k, _ in pairs])
    if again:
        raise ValueError(f"the key {again[0]!r} is given twice in one object; give each key once")
    return dict(pairs)


def load_json(text: str):
    """`text` as json.loads reads it; a repeated key raises ValueError naming it (json.JSONDecodeError,
    a ValueError, for text that is not JSON)."""
    return json.loads(text, object_pairs_hook=_unique)
