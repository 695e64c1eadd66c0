"""The embedded draft model: a few target layers + a reduced-vocabulary head.

:func:`load_draft` gives an HF ``LlamaForCausalLM`` whose ``lm_head`` outputs ``V'`` logits; draft logit
``j`` scores target token ``vocab_map[j]`` (its LongTensor ``[V']`` buffer).
Notes: docs/edge_agent.md, "edge_agent/embedded_draft.py"."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

ARTIFACT_DIR = Path(__file__).resolve().parent / "artifacts"
ARTIFACT_ALIASES = {"embedded-draft": ARTIFACT_DIR / "embedded-draft.safetensors"}
EMBED_KEY = "model.embed_tokens.weight"


def draft_config(target_config, num_layers: int):
    """The target's config with ``num_layers`` decoder layers (input vocab unchanged)."""
    cfg = target_config.__class__.from_dict(target_config.to_dict())
    cfg.num_hidden_layers = num_layers
    cfg.tie_word_embeddings = False
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = cfg.layer_types[:num_layers]
    cfg._attn_implementation = getattr(target_config, "_attn_implementation", None) or "sdpa"
    return cfg


def build_draft(target_config, embed_weight: torch.Tensor, vocab_map: torch.Tensor, num_layers: int,
                layer_state: dict[str, torch.Tensor] | None = None):
    """Assemble a draft ``LlamaForCausalLM``.

    ``embed_weight``: [V, D] the target's (tied) embedding; ``vocab_map``: [V'] long,
    draft logit index -> target token id; ``layer_state``: the trainable tensors
    (``model.layers.*``, ``model.norm.weight``, ``lm_head.bias``) to load, if any.
    """
    from transformers import LlamaForCausalLM

    cfg = draft_config(target_config, num_layers)
    cfg.draft_vocab_size = int(vocab_map.numel())
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").float()
    with torch.no_grad():  # to_empty leaves memory uninitialised: what layer_state does not set is 0 (norms 1)
        for name, p in model.named_parameters():
            p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
    model.model.embed_tokens.weight = nn.Parameter(embed_weight.detach().float().clone(), requires_grad=False)
    head = nn.Linear(cfg.hidden_size, int(vocab_map.numel()), bias=True)
    head.weight = nn.Parameter(embed_weight.detach().float()[vocab_map].clone(), requires_grad=False)  # [V', D]
    nn.init.zeros_(head.bias)
    model.lm_head = head
    model.model.rotary_emb = model.model.rotary_emb.__class__(config=cfg)  # inv_freq was on meta
    model.register_buffer("vocab_map", vocab_map.long().clone(), persistent=False)
    if layer_state is not None:
        missing = [k for k in layer_state if k not in dict(model.named_parameters())]
        if missing:
            raise ValueError(f"artifact tensors unknown to the draft: {missing[:5]}")
        params = dict(model.named_parameters())
        with torch.no_grad():
            for k, v in layer_state.items():
                params[k].copy_(v.float())
    return model.eval()


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The tensors an artifact stores: decoder layers, final norm, head bias."""
    return {k: v.detach() for k, v in model.named_parameters()
            if k.startswith("model.layers.") or k in ("model.norm.weight", "lm_head.bias")}


def save_artifact(model, path: str | Path, meta: dict, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``<path>.safetensors`` (trainable tensors + vocab_map) and ``<path>.json`` (meta)."""
    from safetensors.torch import save_file

    path = Path(path).with_suffix(".safetensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in trainable_state(model).items()}
    tensors["vocab_map"] = model.vocab_map.to(torch.int32).contiguous()
    save_file(tensors, str(path), metadata={"format": "specedge-draft-v1"})
    meta = dict(meta, num_layers=model.config.num_hidden_layers, draft_vocab_size=int(model.vocab_map.numel()))
    path.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    return path


def artifact_available(artifact: str | Path | None = None) -> bool:
    """Whether the artifact (default: the committed ``embedded-draft``) and its meta exist."""
    path = resolve_artifact(artifact)
    return path.exists() and path.with_suffix(".json").exists()


def resolve_artifact(artifact: str | Path | None) -> Path:
    if artifact is None:
        artifact = "embedded-draft"
    if str(artifact) in ARTIFACT_ALIASES:
        return ARTIFACT_ALIASES[str(artifact)]
    return Path(artifact).with_suffix(".safetensors")


def _target_parts(target: str | Path | None):
    """(config, embedding [V, D] fp32) of the target: HF dir (reads one tensor) or GGUF file."""
    from transformers import AutoConfig

    from specdec.model.loading import EMBEDDED_ALIASES, ensure_embedded_model, load_model

    if target is None or str(target) in EMBEDDED_ALIASES:
        target = ensure_embedded_model()
    target = Path(target)
    if target.suffix == ".gguf":
        lm = load_model(str(target), dtype="float32")
        return lm.model.config, lm.model.get_input_embeddings().weight.detach()
    from safetensors import safe_open

    cfg = AutoConfig.from_pretrained(str(target))
    for f in sorted(target.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            if EMBED_KEY in sf.keys():
                return cfg, sf.get_tensor(EMBED_KEY).float()
    raise FileNotFoundError(f"no {EMBED_KEY} in {target}")


def load_draft(target_dir_or_gguf: str | Path | None = None, artifact: str | Path | None = None, *,
               dtype: str | torch.dtype = "auto", device: str = "cpu"):
    """Assemble the draft from an artifact and the target (HF dir or GGUF; default: embedded).

    Returns a ``LlamaForCausalLM`` whose ``lm_head`` gives ``V'`` logits, with
    ``model.vocab_map`` ([V'] long, draft index -> target id) and ``model.draft_meta``.
    """
    from safetensors.torch import load_file

    from specdec.model.loading import resolve_device, resolve_dtype

    path = resolve_artifact(artifact)
    tensors = load_file(str(path))
    meta = json.loads(path.with_suffix(".json").read_text()) if path.with_suffix(".json").exists() else {}
    vocab_map = tensors.pop("vocab_map").long()
    cfg, embed = _target_parts(target_dir_or_gguf)
    if embed.shape[1] != cfg.hidden_size or int(vocab_map.max()) >= embed.shape[0] or int(vocab_map.min()) < 0:
        raise ValueError("artifact does not fit this target (vocab_map outside the target vocabulary)")
    num_layers = 1 + max(int(k.split(".")[2]) for k in tensors if k.startswith("model.layers."))
    model = build_draft(cfg, embed, vocab_map, num_layers, tensors)
    device = resolve_device(device)
    model = model.to(device=device, dtype=resolve_dtype(dtype, device))
    model.draft_meta = meta
    return model.eval()


@torch.inference_mode()
def greedy_continue(model, input_ids: list[int], n: int) -> list[int]:
    """Plain greedy continuation with the draft (target token ids); for tests and demos."""
    ids = torch.tensor([input_ids], dtype=torch.long, device=model.vocab_map.device)
    out: list[int] = []
    past = None
    for _ in range(n):
        o = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = o.past_key_values
        j = int(o.logits[0, -1].float().argmax())  # draft index
        tok = int(model.vocab_map[j])
        out.append(tok)
        ids = torch.tensor([[tok]], dtype=torch.long, device=model.vocab_map.device)
    return out
