"""The embedded draft: artifact + target -> a working reduced-vocabulary draft."""

from __future__ import annotations

import json

import pytest
import torch

from edge_agent.embedded_draft import (ARTIFACT_ALIASES, build_draft, greedy_continue, load_draft, save_artifact,
                                    trainable_state)


def test_build_save_load_roundtrip_tiny(tmp_path, tiny_model):
    """A draft built from a tiny target survives save_artifact -> load_draft unchanged."""
    cfg = tiny_model.config
    embed = tiny_model.model.embed_tokens.weight.detach()
    vocab_map = torch.arange(0, cfg.vocab_size, 3)  # [V']
    sd = tiny_model.state_dict()
    state = {k.replace("model.layers.1.", "model.layers.0."): v for k, v in sd.items()
             if k.startswith("model.layers.1.")}
    state["model.norm.weight"] = sd["model.norm.weight"]
    draft = build_draft(cfg, embed, vocab_map, 1, state)
    with torch.no_grad():
        draft.lm_head.bias.normal_()
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    ref = draft(input_ids=ids).logits  # [1, 5, V']
    assert ref.shape == (1, 5, vocab_map.numel())
    # the head is the target's tied rows: the draft logits equal the target-head logits at vocab_map + bias
    torch.testing.assert_close(draft.lm_head.weight, embed[vocab_map])

    # the artifact keeps only trainable tensors (bf16) + vocab_map; the loader reads the target dir
    target_dir = tmp_path / "target"
    tiny_model.save_pretrained(target_dir)
    path = save_artifact(draft, tmp_path / "d", {"alias": "test"}, dtype=torch.float32)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:  # nothing derivable from the target is stored
        assert set(f.keys()) == set(trainable_state(draft)) | {"vocab_map"}
        assert not any("embed" in k or k == "lm_head.weight" for k in f.keys())
    assert json.loads(path.with_suffix(".json").read_text())["draft_vocab_size"] == vocab_map.numel()
    loaded = load_draft(target_dir, path, dtype="float32")
    assert torch.equal(loaded.vocab_map, vocab_map)
    torch.testing.assert_close(loaded(input_ids=ids).logits, ref)  # fp32 artifact: same draft


def test_build_sets_every_parameter(tiny_model):
    """Parameters a partial state does not name are zeros (norms ones), never uninitialised memory."""
    embed = tiny_model.model.embed_tokens.weight.detach()
    draft = build_draft(tiny_model.config, embed, torch.arange(0, 64), 2, {})
    for name, p in draft.named_parameters():
        if name.startswith("model.layers."):
            assert torch.all(p == (1.0 if name.endswith("norm.weight") else 0.0)), name
    assert torch.isfinite(draft(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.slow
def test_embedded_draft_loads_and_is_deterministic():
    if not ARTIFACT_ALIASES["embedded-draft"].exists():
        pytest.fail("the committed artifact edge_agent/artifacts/embedded-draft.safetensors is missing")
    draft = load_draft(None, "embedded-draft", dtype="float32")
    vm = draft.vocab_map
    V = draft.config.vocab_size
    assert vm.dtype == torch.long and vm.ndim == 1
    assert 0 < vm.numel() <= V and int(vm.min()) >= 0 and int(vm.max()) < V
    assert vm.unique().numel() == vm.numel()  # one draft logit per target token
    assert draft.lm_head.out_features == vm.numel()
    assert 2 in vm.tolist()  # <|im_end|> (EOS) can be drafted
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 2, 198, 1, 4093, 198, 19556, 2, 198, 1, 520, 9531, 198]
    logits = draft(input_ids=torch.tensor([ids])).logits  # [1, T, V']
    assert logits.shape == (1, len(ids), vm.numel())
    assert torch.isfinite(logits).all()
    a = greedy_continue(draft, ids, 8)
    b = greedy_continue(draft, ids, 8)
    assert a == b and len(a) == 8 and all(0 <= t < V for t in a)
