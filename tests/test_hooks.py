"""User hooks (``actbus.hooks``) on a real in-process engine against HF transformers with
the same function hooked in: a hook that reads and saves rows, one that replaces them
(a pre-hook on the embeddings, a post-hook on a layer's output), parameter access, an
untouched request in the same batch bitwise unchanged; and who may pass what."""

from __future__ import annotations

import pytest
import torch

from actbus.config import HooksConfig
from actbus.errors import ConfigError
from actbus.hooks import Hook, take_hooks
from tests.support.engine import start_in_process, stop_llm
from tests.support.oracle import max_rel_error
from tests.support.steer_oracle import HFScale, hf_steered_greedy

MAX_TOKENS = 5


def test_who_may_pass_what():
    cfg = HooksConfig.from_dict({"layers": [1], "named": ["mine"]})
    h = Hook(lambda call: None, layer=1)
    with pytest.raises(ConfigError, match=r"user_hooks\[0\]: a Hook object runs only in"):
        take_hooks({"user_hooks": [h]}, cfg, over_http=False, in_process=False)
    assert take_hooks({"user_hooks": [h]}, cfg, over_http=False, in_process=True)[1][0][0] == "obj"
    with pytest.raises(ConfigError, match=r"user_hooks\[0\]: a Hook object runs only in"):
        take_hooks({"user_hooks": [h]}, cfg, over_http=True, in_process=True)
    with pytest.raises(ConfigError, match=r"user_hooks\[0\].name: 'theirs' is not a hook"):
        take_hooks(
            {"user_hooks": [{"name": "theirs", "layer": 1}]}, cfg, over_http=True, in_process=False
        )
    with pytest.raises(ConfigError, match=r"user_hooks\[0\].layer: expected one of the hookable"):
        take_hooks(
            {"user_hooks": [{"name": "mine", "layer": 2}]}, cfg, over_http=True, in_process=False
        )
    raw, hooks = take_hooks(
        {"user_hooks": [{"name": "mine", "layer": 1}], "return": True},
        cfg,
        over_http=True,
        in_process=False,
    )
    assert raw == {"return": True} and hooks[0][:4] == ["name", "mine", 1, "post_block"]
    with pytest.raises(ConfigError, match=r"points\[1\]: 'post_attn' is not a point user hooks"):
        HooksConfig.from_dict({"layers": [1], "points": ["pre_attn", "post_attn"]})
    with pytest.raises(ConfigError, match="this engine runs no hooks"):
        take_hooks({"user_hooks": [h]}, None, over_http=False, in_process=True)


def test_a_hook_entry_with_an_unknown_key_is_refused():
    cfg = HooksConfig.from_dict({"layers": [1], "named": ["mine"]})
    for extra in ({"scale": 2.0}, {"args": {}}):
        with pytest.raises(
            ConfigError, match=rf"user_hooks\[0\]\.{next(iter(extra))}: unknown key"
        ):
            take_hooks(
                {"user_hooks": [{"name": "mine", "layer": 1, **extra}]},
                cfg,
                over_http=True,
                in_process=False,
            )


HOOK_SOURCE = "def halve(call):\n    return 0.5 * call.rows\n"


def _install_hook(folder, name: str) -> None:
    """A package providing hook ``name`` as an entry point of group actbus.hooks."""
    (folder / "myhooks.py").write_text(HOOK_SOURCE)
    info = folder / "myhooks-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: myhooks\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[actbus.hooks]\n{name} = myhooks:halve\n")


def test_named_hooks_resolve_once_at_start(tmp_path, monkeypatch):
    """Resolved from the installed entry points at start; a request's admission (in the
    engine step) looks them up, never scanning again; a name not installed fails the
    start, naming it."""
    import importlib.metadata

    from actbus.hooks import HookRunner, resolve_named

    _install_hook(tmp_path, "halver")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"\['nowhere'\] not installed as entry points"):
        resolve_named(("halver", "nowhere"))
    named = resolve_named(("halver",))
    runner = HookRunner(torch.nn.Linear(2, 2), named=named)

    def scan(*a, **k):
        raise AssertionError("entry points scanned inside the engine step")

    monkeypatch.setattr(importlib.metadata, "entry_points", scan)
    runner.admit([("r", 4, {"user_hooks": [["name", "halver", 1, "post_block"]]})], set())
    target = torch.ones(4, 3)
    runner.fill(["r"], [0, 4], {"r": 0})
    runner.run(target, None, 1, "post_block")
    assert torch.equal(target, torch.full((4, 3), 0.5))


@pytest.mark.engine
def test_an_engine_naming_a_hook_not_installed_does_not_start(tiny_models, tmp_path):
    cfg = {"publish": f"ipc://{tmp_path}/bus.sock", "layers": [0], "requests": "selected"}
    cfg["user_hooks"] = {"layers": [1], "named": ["nowhere"]}
    try:
        llm = start_in_process(tiny_models["llama"], cfg, max_model_len=256, max_num_seqs=2)
    except ConfigError as e:
        assert "actbus.user_hooks.named: ['nowhere'] not installed" in str(e)
    else:
        stop_llm(llm)
        pytest.fail("an engine started with a named hook that is not installed")


def _scale(layer: int, point: str, factor: float) -> HFScale:
    return HFScale(layer, point, torch.zeros(1), factor=factor)


@pytest.mark.engine
def test_hooks_match_hf_and_leave_others_alone(tiny_models, tmp_path):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    path = tiny_models["llama"]
    # Started in-process; the requests are sent with the environment as it was: whether
    # Hook objects may pass is the engine's (its core in this process), not the env's.
    llm = start_in_process(
        path,
        {
            "publish": f"ipc://{tmp_path}/bus.sock",
            "layers": [0, 3],
            "hooks": ["post_block"],
            "requests": "selected",
            "user_hooks": {"layers": [0, 1], "points": ["pre_attn", "post_block"]},
        },
        gpu_memory_utilization=0.05,
        max_model_len=256,
        max_num_seqs=8,
        num_gpu_blocks_override=32,
    )
    try:
        seen = []

        def read(call):  # reads, saves, changes nothing
            call.saved.setdefault("rows", []).append(call.rows)
            call.saved["embed"] = tuple(call.param("model.embed_tokens.weight").shape)
            seen.append(call.request_id)

        reader = Hook(read, layer=1, point="post_block")
        halve = Hook(lambda call: 0.5 * call.rows, layer=1, point="post_block")
        pre = Hook(lambda call: 1.5 * call.rows, layer=0, point="pre_attn")
        prompts = [[5 + i, 40, 77, 9, 31, 200 + i, 14] for i in range(4)]

        def params(hooks=None):
            actbus = {"return": True}
            if hooks:
                actbus["user_hooks"] = hooks
            return SamplingParams(
                temperature=0,
                max_tokens=MAX_TOKENS,
                ignore_eos=True,
                extra_args={"actbus": actbus},
            )

        batch = [params([reader]), params([halve]), params([pre, reader]), params()]
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], batch, use_tqdm=False
        )
        alone = llm.generate(
            [TokensPrompt(prompt_token_ids=prompts[3])], [params()], use_tqdm=False
        )[0]
    finally:
        stop_llm(llm)
    oracle = [[], [_scale(1, "post_block", 0.5)], [_scale(0, "pre_attn", 1.5)], []]
    for out, hf in zip(outs, oracle, strict=True):
        prompt = list(out.prompt_token_ids)
        want_tokens, want = hf_steered_greedy(path, prompt, MAX_TOKENS, hf, [0, 1, 3])
        assert list(out.outputs[0].token_ids) == want_tokens
        acts = out.outputs[0].activations
        for layer in (0, 3):
            assert max_rel_error(acts[(layer, "post_block")], want[(layer, "post_block")]) <= 1e-3
        if out is outs[0] or out is outs[2]:  # the reader saw layer 1's stream, each row once
            saved = reader.saved[out.request_id]
            rows = torch.cat(saved["rows"])
            assert max_rel_error(rows, want[(1, "post_block")]) <= 1e-3
            assert saved["embed"][0] >= 256
    # the untouched request: bitwise what it is alone
    assert list(outs[3].outputs[0].token_ids) == list(alone.outputs[0].token_ids)
    for key in alone.outputs[0].activations.tensors:
        assert torch.equal(outs[3].outputs[0].activations[key], alone.outputs[0].activations[key])
    assert set(seen) == {outs[0].request_id, outs[2].request_id}


def test_cuda_graphs_must_split_at_the_hook_op():
    """A CUDA graph would replay the op's kernels without calling Python: an engine
    with hooks starts only without CUDA graphs or with piecewise ones split at it."""
    from types import SimpleNamespace as NS

    from actbus.engine.session import HOOK_OP, check_hook_graphs

    check_hook_graphs(NS(cudagraph_mode=NS(name="NONE"), splitting_ops=None))
    check_hook_graphs(NS(cudagraph_mode=NS(name="PIECEWISE"), splitting_ops=["a", HOOK_OP]))
    for mode, ops in (("FULL_AND_PIECEWISE", [HOOK_OP]), ("PIECEWISE", ["a"])):
        with pytest.raises(ConfigError, match=r"actbus\.user_hooks: CUDA graphs"):
            check_hook_graphs(NS(cudagraph_mode=NS(name=mode), splitting_ops=ops))
