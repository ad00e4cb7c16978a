"""The router hook's checks that need no engine: refused on a dense model by name,
only for subscribers that name it, and its messages' shape checked on receipt."""

from __future__ import annotations

import json

import numpy as np
import pytest

from actbus.bus.protocol import Subscription
from actbus.engine.archs import check_router
from actbus.errors import ConfigError
from actbus.streams import parse_hooks, parse_point_key, point_key
from actbus.tiny_models import build_tiny_model
from actbus.wire import Header, RowIndex, WireError


def _config(arch: str) -> dict:
    return json.loads((build_tiny_model(arch) / "config.json").read_text())


def test_dense_model_refuses_router_by_name():
    with pytest.raises(ConfigError, match=r"'router'.*LlamaForCausalLM has no experts"):
        check_router(_config("llama"), ("post_block", "router"), "LlamaForCausalLM")
    check_router(_config("llama"), ("post_block",), "LlamaForCausalLM")  # untouched
    check_router(_config("qwen3_moe"), ("router",), "Qwen3MoeForCausalLM")


def test_router_is_a_capture_hook_with_one_spelling():
    assert parse_hooks(["router", "post_block"], "actbus.hooks") == ("router", "post_block")
    assert parse_point_key(point_key(3, "router")) == (3, "router")
    with pytest.raises(ConfigError, match="not a steering point"):
        parse_hooks("router", "steer.hooks", steerable=("post_block",))


def test_router_rows_go_only_to_subscribers_that_name_them():
    assert not Subscription().wants(3, "router")
    assert Subscription(hooks=("router",)).wants(3, "router")
    assert Subscription().wants(3, "post_block")


def _header(dtype: str, width: int) -> bytes:
    rows = RowIndex(
        request_ids=["r"],
        offsets=np.array([0, 1]),
        positions=np.array([0]),
        token_ids=np.array([5]),
    )
    return Header(0, 3, "router", dtype, (1, width), "m", rows).encode()


def test_router_message_is_float32_pairs():
    assert Header.decode(_header("float32", 4)).hook == "router"
    with pytest.raises(WireError, match="router rows are float32"):
        Header.decode(_header("bfloat16", 4))
    with pytest.raises(WireError, match="router rows are float32"):
        Header.decode(_header("float32", 3))
