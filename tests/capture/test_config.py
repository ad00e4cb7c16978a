"""Configuration errors name the field and the fix."""

import pytest

from actbus.config import CaptureConfig
from actbus.engine.archs import check_architecture
from actbus.errors import ConfigError


def test_valid_config_parses():
    cfg = CaptureConfig.from_dict({"publish": "ipc:///tmp/x.sock", "layers": [3, 1, 3]})
    assert cfg.layers == (1, 3) and cfg.hooks == ("post_block",)
    assert cfg.resolve_layers(4, "m") == (1, 3)
    assert CaptureConfig.from_dict({"layers": "all"}).resolve_layers(4, "m") == (0, 1, 2, 3)
    assert CaptureConfig.from_dict({"layers": 2, "publish": "tcp://127.0.0.1:5555"}).layers == (2,)


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"layers": [1], "layer": [2]}, "actbus.layer: unknown key"),
        ({}, "actbus.layers: required"),
        ({"layers": []}, "actbus.layers: expected a non-empty list"),
        ({"layers": [1, -2]}, "actbus.layers[1]"),
        ({"layers": [True]}, "actbus.layers[0]"),
        ({"layers": ["1"]}, "actbus.layers[0]"),
        ({"layers": [1], "hooks": ["mlp_in"]}, "actbus.hooks[0]: unknown hook 'mlp_in'"),
        (
            {"layers": [1], "publish": "localhost:5555"},
            "actbus.publish='localhost:5555': not a ZeroMQ address",
        ),
        ({"layers": [1], "publish": "tcp://127.0.0.1"}, "not a ZeroMQ address"),
        ({"layers": [1], "publish": "tcp://127.0.0.1:70000"}, "port must be 1..65535"),
        ({"layers": [1], "publish": "tcp://0.0.0.0:5555"}, "non-loopback interface is refused"),
        (
            {"layers": [1], "publish": "ipc:///no/such/dir/x.sock"},
            "directory /no/such/dir does not exist",
        ),
        ({"layers": [1], "publish": 5555}, "actbus.publish: expected a string"),
        ({"layers": [1], "queue_mb": 0}, "actbus.queue_mb"),
        ([1, 2], "expected a mapping"),
    ],
)
def test_bad_config_names_the_field(raw, needle):
    with pytest.raises(ConfigError) as e:
        CaptureConfig.from_dict(raw)
    assert needle in str(e.value)


def test_layer_out_of_range_names_model_and_range():
    cfg = CaptureConfig.from_dict({"layers": [1, 7]})
    with pytest.raises(
        ConfigError, match=r"actbus.layers\[1\]: layer 7 is out of range; model m has 4"
    ):
        cfg.resolve_layers(4, "m")


def test_unsupported_architecture_is_named():
    """A family known to fit no form is refused by name before vLLM starts; any other is
    left to the engine's structural check (tests/capture/test_families.py)."""
    check_architecture(["Qwen2ForCausalLM"])
    check_architecture(["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match="MiniCPMForCausalLM"):
        check_architecture(["MiniCPMForCausalLM"])


def test_a_requests_unknown_key_names_every_key_a_request_may_give():
    """The steering and monitor keys are taken out before the selection is parsed; its
    unknown-key error lists them too."""
    from actbus.capture.selection import parse_selection
    from actbus.monitor.frontend import KEYS

    with pytest.raises(ConfigError) as e:
        parse_selection(
            {"stear": []}, engine_layers=(1,), engine_hooks=("post_block",), num_layers=4
        )
    msg = str(e.value)
    assert msg.startswith("extra_args.actbus.stear: unknown key; valid keys are "), msg
    for key in ("layers", "hooks", "positions", "tags", "return", "steer", "steer_global", *KEYS):
        assert f" {key}," in msg or f" {key} (" in msg, (key, msg)
