"""Oracle: our model's logits against `transformers` on the same checkpoint, for every family."""
import json

import numpy as np
import pytest
import torch

from conftest import FAMILIES, make_checkpoint
from specinfer.config import load_config
from specinfer.engines.torch_runtime import TorchRuntime
from specinfer.errors import SpecInferError
from specinfer.model import load_model

TOL = 1e-4  # max abs logit difference, float32 on CPU (logits are O(1)-O(10))
PROMPT = [1, 40, 41, 200, 7, 99, 120, 3, 64, 65, 66, 310]
# A branching tree: 0 -> 1 -> 3 -> 6, 0 -> 2 -> 4, 2 -> 5, and a second root 7.
TREE_TOKENS = [11, 12, 13, 14, 15, 16, 17, 18]
TREE_PARENTS = [-1, 0, 0, 1, 2, 2, 3, -1]


def hf_model(path):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def hf_last_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].numpy()


def path_of(node):
    path = []
    while node >= 0:
        path.append(TREE_TOKENS[node])
        node = TREE_PARENTS[node]
    return path[::-1]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_tree_step_match_transformers(family, checkpoints):
    hf = hf_model(checkpoints[family])
    rt = TorchRuntime(checkpoints[family], max_context=64)
    seq = rt.start()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].numpy()
    got = rt.score(seq, PROMPT)
    assert np.abs(got - want).max() < TOL
    rt.commit(seq, range(len(PROMPT)))
    tree_logits = rt.score(seq, TREE_TOKENS, TREE_PARENTS)
    for node in range(len(TREE_TOKENS)):  # each branch run on its own through transformers
        diff = np.abs(tree_logits[node] - hf_last_logits(hf, PROMPT + path_of(node))).max()
        assert diff < TOL, f"node {node}: {diff}"


def test_config_of_each_family(checkpoints):
    c = load_config(checkpoints["llama3"])
    assert c.rope_scaling["rope_type"] == "llama3" and c.tie_word_embeddings and c.num_kv_heads == 2
    assert load_config(checkpoints["qwen2"]).attention_bias
    assert not load_config(checkpoints["llama2"]).attention_bias


def edit_config(src, dst, **changes):
    import shutil
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, "unsupported RoPE scaling 'yarn'"),
])
def test_unsupported_features_are_named(change, message, checkpoints, tmp_path):
    d = edit_config(checkpoints["llama2"], tmp_path / "m", **change)
    with pytest.raises(SpecInferError, match=message):
        load_model(d)


def test_missing_weights_and_folder(checkpoints, tmp_path):
    with pytest.raises(SpecInferError, match="model folder not found"):
        load_model(tmp_path / "nope")
    d = edit_config(checkpoints["llama2"], tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(SpecInferError, match="no \\*.safetensors weights"):
        load_model(d)


def test_sharded_checkpoint_loads(tmp_path):
    src = make_checkpoint(tmp_path / "src", "mistral")
    hf = hf_model(src)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ours = load_model(tmp_path / "sharded")
    e = torch.zeros(1, 0, ours.config.num_kv_heads, ours.config.head_dim)
    from specinfer.plugins.tree_attention import tree_mask_from_parents
    ids = torch.tensor([PROMPT])
    mask = torch.from_numpy(tree_mask_from_parents(list(range(-1, len(PROMPT) - 1))))[None]
    with torch.no_grad():
        logits = ours(ids, torch.arange(len(PROMPT))[None], mask, [e] * 2, [e] * 2)[0]
        assert np.abs(logits.numpy() - hf(ids).logits.numpy()).max() < TOL
