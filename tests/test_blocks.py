import copy
import math
import re

import pytest
import torch
import transformers
from torch import nn

from deca_ds.blocks import BLOCK_ORDERS, Block, Partition, block_order, find_decoder_layers, partition_model

NUM_LAYERS = 5


def _config(arch: str, num_layers: int = NUM_LAYERS):
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
                  vocab_size=97)
    if arch == "llama":
        return transformers.LlamaConfig(num_key_value_heads=2, **common)
    if arch == "qwen2":
        return transformers.Qwen2Config(num_key_value_heads=2, **common)
    if arch == "mistral":
        return transformers.MistralConfig(num_key_value_heads=2, **common)
    if arch == "gpt_neox":
        return transformers.GPTNeoXConfig(max_position_embeddings=64, **common)
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_embd=32, n_layer=num_layers, n_head=4, vocab_size=97, n_positions=64, bos_token_id=0, eos_token_id=0
        )
    raise AssertionError(arch)


def _model(arch: str, num_layers: int = NUM_LAYERS) -> nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_config(arch, num_layers))


# arch -> (layer-list path, embeddings, final norm, untied lm_head)
ARCHS = {
    "llama": ("model.layers", ["model.embed_tokens.weight"], ["model.norm.weight"], ["lm_head.weight"]),
    "qwen2": ("model.layers", ["model.embed_tokens.weight"], ["model.norm.weight"], ["lm_head.weight"]),
    "mistral": ("model.layers", ["model.embed_tokens.weight"], ["model.norm.weight"], ["lm_head.weight"]),
    "gpt2": (
        "transformer.h",
        ["transformer.wte.weight", "transformer.wpe.weight"],
        ["transformer.ln_f.weight", "transformer.ln_f.bias"],
        [],  # tied to wte
    ),
    "gpt_neox": (
        "gpt_neox.layers",
        ["gpt_neox.embed_in.weight"],
        ["gpt_neox.final_layer_norm.weight", "gpt_neox.final_layer_norm.bias"],
        ["lm_head.weight"],
    ),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def arch_model(request):
    return request.param, _model(request.param)


def _layer_of(name: str, layers_path: str) -> int | None:
    m = re.match(re.escape(layers_path) + r"\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _check_covering(model: nn.Module, part: Partition) -> None:
    names = [n for n, _ in model.named_parameters()]
    in_blocks = [n for b in part.blocks for n in b.param_names]
    assert len(in_blocks) == len(set(in_blocks))
    assert not set(in_blocks) & set(part.frozen)
    assert sorted(in_blocks + list(part.frozen)) == sorted(names)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    for i, block in enumerate(part.blocks):
        assert block.index == i
        assert list(block.param_names) == [n for n in names if n in set(block.param_names)]  # model order
        assert block.numel == sum(sizes[n] for n in block.param_names)
    assert part.frozen_numel == sum(sizes[n] for n in part.frozen)


def test_find_decoder_layers(arch_model):
    arch, model = arch_model
    path, layers = find_decoder_layers(model)
    assert path == ARCHS[arch][0]
    assert layers is model.get_submodule(path)
    assert isinstance(layers, nn.ModuleList) and len(layers) == NUM_LAYERS


@pytest.mark.parametrize("lpb", [1, 2, 3, 5])
def test_layer_blocks_default(arch_model, lpb):
    arch, model = arch_model
    path, embeddings, final_norm, lm_head = ARCHS[arch]
    part = partition_model(model, lpb)
    _check_covering(model, part)

    assert part.num_blocks == math.ceil(NUM_LAYERS / lpb)
    assert sorted(part.frozen) == sorted(embeddings + final_norm + lm_head)
    for k, block in enumerate(part.blocks):
        layers = list(range(k * lpb, min((k + 1) * lpb, NUM_LAYERS)))
        assert block.name == f"layers[{layers[0]}:{layers[-1] + 1}]"
        assert {_layer_of(n, path) for n in block.param_names} == set(layers)
    layer_params = [n for n, _ in model.named_parameters() if _layer_of(n, path) is not None]
    assert sorted(n for b in part.blocks for n in b.param_names) == sorted(layer_params)


def test_extra_groups_are_own_blocks_in_order(arch_model):
    arch, model = arch_model
    path, embeddings, final_norm, lm_head = ARCHS[arch]
    untied = bool(lm_head)
    part = partition_model(model, 2, train_embeddings=True, train_final_norm=True, train_lm_head=untied)
    _check_covering(model, part)

    expected = ["embeddings", "layers[0:2]", "layers[2:4]", "layers[4:5]", "final_norm"]
    expected += ["lm_head"] if untied else []
    assert [b.name for b in part.blocks] == expected
    by_name = {b.name: list(b.param_names) for b in part.blocks}
    assert by_name["embeddings"] == embeddings
    assert by_name["final_norm"] == final_norm
    if untied:
        assert by_name["lm_head"] == lm_head
    assert part.frozen == ()

    only_norm = partition_model(model, 2, train_final_norm=True)
    assert [b.name for b in only_norm.blocks][-1] == "final_norm"
    assert sorted(only_norm.frozen) == sorted(embeddings + lm_head)


def test_describe_lists_every_block(arch_model):
    _, model = arch_model
    part = partition_model(model, 2, train_embeddings=True)
    text = part.describe()
    for block in part.blocks:
        assert block.name in text and f"{block.numel:,}" in text
    assert "frozen" in text


def test_bare_base_model():
    base = transformers.AutoModel.from_config(_config("llama"))
    path, _ = find_decoder_layers(base)
    assert path == "layers"
    part = partition_model(base, 2, train_embeddings=True, train_final_norm=True)
    _check_covering(base, part)
    assert [b.name for b in part.blocks] == ["embeddings", "layers[0:2]", "layers[2:4]", "layers[4:5]", "final_norm"]
    with pytest.raises(ValueError, match="no LM head"):
        partition_model(base, train_lm_head=True)


def test_gpt2_tied_head_raises():
    model = _model("gpt2")
    with pytest.raises(ValueError, match="tied to the input embeddings.*train_embeddings"):
        partition_model(model, 2, train_lm_head=True)


@pytest.mark.parametrize("lpb", [0, -1, NUM_LAYERS + 1])
def test_bad_layers_per_block(lpb):
    model = _model("llama")
    with pytest.raises(ValueError, match=rf"layers_per_block.*\({NUM_LAYERS}\), got {lpb}"):
        partition_model(model, lpb)


def test_unrecognized_architecture_asks_for_custom():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"decoder layers.*Sequential.*custom=\["):
        find_decoder_layers(model)
    with pytest.raises(ValueError, match=r"decoder layers.*Sequential.*custom=\["):
        partition_model(model)
    # custom does not need the layer list
    part = partition_model(model, custom=["0", "2"])
    assert [b.param_names for b in part.blocks] == [("0.weight", "0.bias"), ("2.weight", "2.bias")]


def test_ambiguous_layer_lists_ask_for_custom():
    class TwoStacks(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = transformers.LlamaConfig(num_hidden_layers=2)
            self.a = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])
            self.b = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])

    with pytest.raises(ValueError, match=r"TwoStacks.*'a', 'b'.*custom="):
        find_decoder_layers(TwoStacks())


@pytest.fixture(scope="module")
def llama12():
    return _model("llama", num_layers=12)


def _layers_in(block: Block) -> set[int]:
    return {_layer_of(n, "model.layers") for n in block.param_names}


@pytest.mark.parametrize("prefix", ["model.layers.1", "model.layers.1."])
def test_custom_prefix_is_component_wise(llama12, prefix):
    part = partition_model(llama12, custom=[prefix])
    assert part.num_blocks == 1 and part.blocks[0].name == "custom[0]"
    assert _layers_in(part.blocks[0]) == {1}
    _check_covering(llama12, part)
    assert any(n.startswith("model.layers.10.") for n in part.frozen)
    assert any(n.startswith("model.layers.11.") for n in part.frozen)


def test_custom_exact_param_name(llama12):
    part = partition_model(llama12, custom=["model.norm.weight"])
    assert part.blocks[0].param_names == ("model.norm.weight",)


def test_custom_regex_and_union(llama12):
    part = partition_model(
        llama12,
        custom=[r"re:model\.layers\.(2|3)\..*", ["model.layers.0", "model.layers.11", "model.embed_tokens"]],
        layers_per_block=3,  # ignored with custom
        train_lm_head=True,  # ignored with custom
    )
    _check_covering(llama12, part)
    assert [b.name for b in part.blocks] == ["custom[0]", "custom[1]"]
    assert _layers_in(part.blocks[0]) == {2, 3}
    assert _layers_in(part.blocks[1]) == {0, 11, None}
    assert part.blocks[1].param_names[0] == "model.embed_tokens.weight"  # model order, not spec order
    assert "lm_head.weight" in part.frozen


def test_custom_regex_is_full_match(llama12):
    # without fullmatch this would catch every parameter containing "layers.1"
    spec = r"re:layers\.1"
    with pytest.raises(ValueError, match=r"custom\[0\] pattern " + re.escape(repr(spec)) + " matches no parameter"):
        partition_model(llama12, custom=[spec])


def test_custom_overlap_raises(llama12):
    with pytest.raises(ValueError, match=r"'model\.layers\.3\.\S+' is matched by two.*custom\[0\].*custom\[1\]"):
        partition_model(llama12, custom=[["model.layers.2", "model.layers.3"], r"re:model\.layers\.3\..*"])


@pytest.mark.parametrize("custom", [["model.layers.12"], [["model.layers.0", "model.layer.1"]], ["model.layers.1x"]])
def test_custom_spec_matching_nothing_raises(llama12, custom):
    with pytest.raises(ValueError, match="matches no parameter"):
        partition_model(llama12, custom=custom)


def test_custom_bad_inputs(llama12):
    with pytest.raises(TypeError, match="list"):
        partition_model(llama12, custom="model.layers.0")
    with pytest.raises(ValueError, match="empty"):
        partition_model(llama12, custom=[])
    with pytest.raises(ValueError, match="invalid regular expression"):
        partition_model(llama12, custom=["re:("])


def test_block_order_fixed():
    assert block_order(5) == [0, 1, 2, 3, 4]
    assert block_order(5, "ascending", round_index=3, seed=7) == [0, 1, 2, 3, 4]
    assert block_order(5, "descending") == [4, 3, 2, 1, 0]
    assert set(BLOCK_ORDERS) == {"ascending", "descending", "random"}


def test_block_order_random():
    orders = [block_order(6, "random", round_index=t, seed=1) for t in range(8)]
    for order in orders:
        assert sorted(order) == list(range(6))
    assert orders == [block_order(6, "random", round_index=t, seed=1) for t in range(8)]
    assert len({tuple(o) for o in orders}) > 1
    assert [block_order(6, "random", t, seed=2) for t in range(8)] != orders
    generator = torch.Generator().manual_seed(1 * 1_000_003 + 5)
    assert orders[5] == torch.randperm(6, generator=generator).tolist()


def test_block_order_unknown():
    with pytest.raises(ValueError, match="ascending, descending, random"):
        block_order(4, "shuffled")


def test_params_on_deep_copy(arch_model):
    _, model = arch_model
    part = partition_model(model, 2, train_embeddings=True)
    clone = copy.deepcopy(model)
    for k, block in enumerate(part.blocks):
        own = dict(clone.named_parameters())
        got = part.params(clone, k)
        assert len(got) == len(block.param_names)
        for name, p in zip(block.param_names, got):
            assert p is own[name]
            assert p is not model.get_parameter(name)
            assert torch.equal(p, model.get_parameter(name))
